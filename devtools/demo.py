"""The demo behind ``scripts/demo.sh`` (``make demo``): ncclguard on a real mini Slurm cluster.

    python -m devtools.demo run  [--dir .demo]   # (re)build and start it, show the story
    python -m devtools.demo stop [--dir .demo]   # stop its daemons (pid files, checked)

``run`` stops and removes a demo already in ``--dir`` first, so running it twice works
twice. It then

1. gets two real ``libnccl.so.2`` (2.21.5, 2.18.3) from the PyPI wheels, shared with the
   tests' cache (:mod:`devtools.ncclwheels`), and compiles a net plugin with gcc;
2. composes seven node roots (:func:`devtools.nodetree.build_node`): five alike, the
   lowest-numbered one on NCCL 2.18.3, one with its IB port down and no plugin, one
   without the plugin, and starts a private slurmctld + 7 slurmd, each node with its own
   NodeAddr and munged (:class:`~devtools.devcluster.DevCluster`), the gate as
   ``PrologSlurmctld``;
3. has each node publish its signed record (``ncclguard-inventoryd once --publish``) and
   the collector (``collect --once``) write the inventory; shows a forged record rejected;
4. shows ``ncclguard classes``, a batch job that lands on the mixed set ``n[1-4]`` (Slurm
   picks the lowest-numbered idle nodes), is refused, steered away from ``n1`` and then
   completes on ``n[2-5]``, ``ncclguard decisions``;
5. starts the features daemon (class features in Slurm, the file job_submit.lua reads)
   and shows the same job, with ``n2`` busy, waiting for its class and running on
   ``n[2-5]`` with no refusal, and an ``srun -N2`` on one class;
6. shows ``ncclguard check`` of a bad hostlist and ``ncclguard drain-recommend``;
7. starts the collector as the controller's service (``ncclguard-inventoryd collect``)
   with its metrics endpoint on a free loopback port, and prints the metrics line that
   shows the split and where to point Prometheus;
8. leaves the cluster running and prints how to use it and how to stop it.

``<dir>/state.json`` records what the demo did (job id, paths) for the end-to-end test.

Over 500 lines: the demo's nine steps in the order it shows them, each with the text it
prints; one reader follows the story from top to bottom.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import textwrap
import time
import urllib.request
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from devtools.devcluster import ClusterError, DevCluster, find_program, missing_programs
from devtools.devcluster import _free_port_block as free_port_block
from devtools.ncclwheels import PartUnavailable, build_plugin, extract_nccl, nccl_path
from devtools.nodetree import NodeTreeError, build_node

NODES = 7
JOB_NODES = 4
BASELINE_NCCL = "2.21.5"
OLD_NCCL = "2.18.3"
PLUGIN_NAME = "IBext_v8"  # as nccl-rdma-sharp-plugins names its v8 struct
PLUGIN_ABIS = (8, 7, 6, 5)
PLUGIN_PATH = "/usr/lib/x86_64-linux-gnu/libnccl-net.so"  # NCCL's default name, linker search
NCCL_CONF = "NCCL_IB_HCA=mlx5\nNCCL_SOCKET_IFNAME=ib0\n"
WAIT_REFUSAL_S = 60.0
STEPS = 9
WAIT_COMPLETE_S = 120.0


class DemoError(RuntimeError):
    """The demo cannot go on; the message says what is missing or what failed."""


# ------------------------------------------------------------------------- the nodes


def node_specs() -> dict[str, dict[str, Any]]:
    """Node name -> (what it is, build_node arguments). ``n1`` is odd on purpose: Slurm's
    default selection takes the lowest-numbered idle nodes, so ``sbatch -N 4`` lands on
    ``n[1-4]`` without any pinning."""
    good = {"nccl": BASELINE_NCCL, "plugin": True, "rdma": "mlx5-ib"}
    specs: dict[str, dict[str, Any]] = {}
    for i in range(1, NODES + 1):
        specs[f"n{i}"] = dict(good, what="NCCL 2.21.5, net plugin IBext_v8, IB port ACTIVE")
    specs["n1"] = dict(good, nccl=OLD_NCCL,
                       what="NCCL 2.18.3 (an old image), net plugin, IB port ACTIVE")
    specs["n6"] = dict(good, plugin=False, rdma="mlx5-down",
                       what="NCCL 2.21.5, no plugin, IB port DOWN: NCCL falls back to Socket")
    specs["n7"] = dict(good, plugin=False,
                       what="NCCL 2.21.5, net plugin missing, IB port ACTIVE")
    return specs


def build_nodes(root: Path, libs: Mapping[str, Path], plugin: Path) -> dict[str, str]:
    """Compose every node's ``--root`` tree under ``root``; returns node -> description."""
    described = {}
    for name, spec in node_specs().items():
        extra = {PLUGIN_PATH: plugin} if spec["plugin"] else {}
        build_node(root / name, rdma=spec["rdma"], nccl_conf=NCCL_CONF,
                   libnccl=libs[spec["nccl"]], extra_files=extra, hostname=name)
        described[name] = spec["what"]
    return described


# ------------------------------------------------------------------------- output


def free_port() -> int:
    """A free loopback port for the metrics endpoint (the dev cluster's own picker)."""
    return free_port_block(1)


def say(text: str = "") -> None:
    print(text, flush=True)


def step(n: int, title: str, why: str) -> None:
    say()
    say(f"==> [{n}/{STEPS}] {title}")
    for line in textwrap.wrap(why, 88):
        say(f"    {line}")


def show(argv: Sequence[str], out: str) -> None:
    """A command as a shell takes it (quoted: it runs as pasted, issue 46), then its output."""
    say(f"    $ {shlex.join(argv)}")
    for line in out.rstrip("\n").splitlines():
        say(f"      {line}")


# ------------------------------------------------------------------------- the demo


class Demo:
    def __init__(self, base: Path) -> None:
        self.base = base.resolve()
        self.cluster_dir = self.base / "cluster"
        self.nodes_dir = self.base / "nodes"
        self.db = self.base / "inventory.db"
        self.audit = self.base / "decisions.jsonl"
        self.config = self.cluster_dir / "ncclguard.toml"
        self.bin = Path(sys.executable).parent
        self.metrics_port = free_port()
        self.state: dict[str, Any] = {"dir": str(self.base), "db": str(self.db),
                                      "config": str(self.config), "audit_log": str(self.audit)}

    # -- configuration
    def gate_config(self) -> str:
        return textwrap.dedent(f"""\
            # Written by devtools.demo. Keys: docs/config.example.toml.
            [inventory]
            db = "{self.db}"
            # the demo collects once; real nodes heartbeat every inventoryd.heartbeat_s
            stale_after_s = 2592000

            [gate]
            audit_log = "{self.audit}"
            steering = "steer"
            steer_wait_s = 30
            deadline_s = 10

            [drain]
            # 3 odd nodes of 7: above the 10% a real cluster should allow (the default)
            max_share = 0.5

            [collector]
            publisher = "{os.getuid()}"
            # the cluster's metrics for Prometheus (docs/metrics.md)
            metrics_port = {self.metrics_port}
            """)

    def env(self) -> dict[str, str]:
        path = os.pathsep.join([str(self.bin), os.environ.get("PATH", "/usr/bin:/bin")])
        return {**os.environ, "PATH": path, "NCCLGUARD_CONFIG": str(self.config),
                "SLURM_CONF": str(self.cluster_dir / "slurm.conf")}

    def tool(self, name: str, *args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
        exe = self.bin / name
        argv = [str(exe) if exe.exists() else name, *args]
        try:
            return subprocess.run(argv, env=self.env(), capture_output=True, text=True,
                                  timeout=timeout, check=False)
        except subprocess.TimeoutExpired:
            raise DemoError(f"{name} {' '.join(args)}: no answer within {timeout:.0f}s") from None

    def ncclguard(self, *args: str, ok: Sequence[int] = (0,)) -> str:
        r = self.tool("ncclguard", *args)
        show(["ncclguard", *args], r.stdout + (r.stderr if r.returncode not in ok else ""))
        if r.returncode not in ok:
            raise DemoError(f"ncclguard {' '.join(args)} exited {r.returncode}: "
                            f"{r.stderr.strip()}")
        return r.stdout

    # -- steps
    def run(self) -> int:
        t0 = time.monotonic()
        preflight()
        if stop(self.base, quiet=True):
            say(f"stopped the demo that was running in {self.base}")
        if self.base.exists():
            shutil.rmtree(self.base)
        self.base.mkdir(parents=True)

        step(1, "Real NCCL libraries and a net plugin",
             "Two libnccl.so.2 from NVIDIA's PyPI wheels (cached in ~/.cache/ncclguard, "
             "shared with the tests), and a net plugin built by gcc that exports "
             f"ncclNetPlugin_v{PLUGIN_ABIS[-1]}..v{PLUGIN_ABIS[0]}, as real plugins do.")
        libs = {}
        for v in (BASELINE_NCCL, OLD_NCCL):
            if not nccl_path(v).is_file():
                say(f"    fetching NCCL {v} (one time, about 150-220 MB) ...")
            libs[v] = extract_nccl(v)
            say(f"    NCCL {v}: {libs[v]}")
        plugin = build_plugin(self.base / "plugin", net_abis=PLUGIN_ABIS, name=PLUGIN_NAME)
        say(f"    net plugin {PLUGIN_NAME}: {plugin}")

        step(2, f"A real Slurm cluster: slurmctld, {NODES} slurmd, a munged per node",
             "All in a private directory on free ports, with ncclguard-prolog installed as "
             "PrologSlurmctld: the controller runs it for every job, after the nodes are "
             "picked and before anything starts. Each node has its own NodeAddr on the "
             "loopback range, and its own munged that signs from that address.")
        described = build_nodes(self.nodes_dir, libs, plugin)
        self.write_config()
        cluster = DevCluster(self.cluster_dir, nodes=NODES, prolog=True,
                             gate_config=self.gate_config(), db=self.db,
                             python=sys.executable, prolog_timeout_s=30, job_submit=True)
        try:
            cluster.start(timeout=90)
        except (ClusterError, OSError) as e:
            cluster.stop()
            raise DemoError(f"the Slurm cluster did not start: {e}") from None
        self.state["slurm_conf"] = str(cluster.conf)
        self.state["spool"] = str(cluster.records)
        sinfo = cluster.run(["sinfo", "-N", "-o", "%N %P %T"], check=False).stdout
        show(["sinfo", "-N", "-o", "%N %P %T"], sinfo)
        self.save_state()

        step(3, f"{NODES} nodes publish signed fingerprints; the collector writes the inventory",
             "Each node is a directory laid out like a real node's /sys, /proc and "
             "/usr/lib. `ncclguard-inventoryd once --publish` reads it as it would read / on "
             "a compute node, has the node's own munged sign the fingerprint, and writes it "
             "to the spool. The collector on the controller accepts a record only when it "
             "was signed from the address Slurm knows for that node; it is the only writer "
             "of the inventory.")
        for name, what in described.items():
            r = self.tool("ncclguard-inventoryd", "once", "--publish", "--json",
                          "--root", str(self.nodes_dir / name), "--hostname", name,
                          "--config", str(cluster.node_config(name)))
            if r.returncode != 0:
                raise DemoError(f"ncclguard-inventoryd once --publish for {name} exited "
                                f"{r.returncode}: {r.stderr.strip()}")
            say(f"    {name}: {what}  -> {summarize(json.loads(r.stdout))}")
        self.collect(cluster, "ncclguard-inventoryd collect --once")
        say(f"    inventory: {self.db}")
        say("    A forgery: n2's publisher writes a record for n3 (claiming another NCCL).")
        fp = json.loads(self.tool("ncclguard-inventoryd", "once", "--json", "--root",
                                  str(self.nodes_dir / "n1"), "--hostname", "n3").stdout)
        cluster.publish_fingerprint("n2", fp)  # signed by n2's munged, written as n3.rec
        self.collect(cluster, "ncclguard-inventoryd collect --once   # again")
        self.ncclguard("rejections")
        self.state["forged"] = {"file": "n3.rec", "signer": "n2"}
        r = self.tool("ncclguard-inventoryd", "once", "--publish", "--root",
                      str(self.nodes_dir / "n3"), "--hostname", "n3",
                      "--config", str(cluster.node_config("n3")))
        if r.returncode != 0:
            raise DemoError(f"n3 could not publish again: {r.stderr.strip()}")
        self.collect(cluster, "ncclguard-inventoryd collect --once   # n3 publishes its own")

        step(4, "ncclguard classes",
             "Nodes that NCCL would let talk to each other share a compatibility class. "
             "The largest class is the baseline; the others are the odd ones.")
        self.ncclguard("classes")

        step(5, f"A batch job that lands on a mixed set: sbatch -N {JOB_NODES}",
             f"Slurm gives it the lowest-numbered idle nodes, n[1-{JOB_NODES}], and n1 runs "
             "another NCCL. The gate refuses the job (NCCL would hang or fail at init), "
             "writes why into AdminComment, and steers it: once Slurm has requeued it, a "
             "detached follow-up sets ExcNodeList=n1 StartTime=now. The job then runs on "
             "a compatible set.")
        self.job_story(cluster)

        step(6, "Prevention: Slurm itself never picks a mixed set",
             "Each class becomes a node feature (nc_ and 8 hex digits), kept in Slurm by "
             "`ncclguard-inventoryd features` on the controller. The shipped job_submit.lua "
             "adds the matching-OR constraint [class|class|...] to every multi-node job, so "
             "all its nodes carry one class. Here n2, a node of the large class, is busy: "
             "without the constraint Slurm would take n1,n3-n5 (mixed); with it the job "
             "waits for n2 and runs on n[2-5], with no refusal and no requeue.")
        self.prevention_story(cluster)

        step(7, "ncclguard check: the gate's verdict on any hostlist",
             "The same policy the prolog runs, on a set you name; exit 0 accept, 1 warn, "
             "2 refuse. Here: the two nodes without the plugin and one good node.")
        self.ncclguard("check", "n[5-7]", ok=(2,))
        self.state["check"] = {"hostlist": "n[5-7]", "exit": 2}

        step(8, "ncclguard drain-recommend",
             "Which nodes to drain, per partition, grouped by reason, measured against the "
             "majority class. `--apply` would drain them with an `ncclguard:` reason.")
        self.ncclguard("drain-recommend")

        step(9, "The cluster's NCCL drift, for Prometheus",
             "The collector runs as the controller's service would "
             "(`ncclguard-inventoryd collect`) and serves the cluster's metrics: classes per "
             "partition, the baseline's share, versions, stale nodes, rejections, and the "
             "gate's decisions from its audit trail. prometheus/ncclguard.rules.yml alerts "
             "on a split partition (docs/alerts.md).")
        self.metrics(cluster)

        self.save_state()
        conf = cluster.conf
        say()
        say(f"Done in {time.monotonic() - t0:.0f}s. The cluster is still running. Use it with:")
        say(f"  export SLURM_CONF={conf} NCCLGUARD_CONFIG={self.config} "
            f"PATH={self.bin}:$PATH")
        say("  then: sinfo; sbatch -N 4 --wrap hostname; ncclguard classes; ncclguard decisions")
        default = Path(__file__).resolve().parent.parent / ".demo"
        if self.base == default:
            say("Stop it with: scripts/demo.sh stop   (or: make demo-stop)")
        else:
            say(f"Stop it with: NCCLGUARD_DEMO_DIR={self.base} scripts/demo.sh stop")
        return 0

    def metrics(self, cluster: DevCluster) -> None:
        """Start the collector service with its endpoint; show the line of the split."""
        log = open(self.cluster_dir / "log" / "collector.log", "ab")  # noqa: SIM115
        try:
            p = subprocess.Popen([str(self.bin / "ncclguard-inventoryd"), "collect",
                                  "--config", str(self.config)], env=self.env(),
                                 stdin=subprocess.DEVNULL, stdout=log, stderr=log,
                                 start_new_session=True)
        finally:
            log.close()
        (self.cluster_dir / "collector.pid").write_text(f"{p.pid}\n")
        url = f"http://127.0.0.1:{self.metrics_port}/metrics"
        want = ("ncclguard_partition_classes", "ncclguard_partition_baseline_share",
                "ncclguard_nccl_version_nodes")
        lines: list[str] = []
        deadline = time.monotonic() + 60
        while not any(ln.startswith(want[0] + "{") for ln in lines):
            if time.monotonic() > deadline or p.poll() is not None:
                raise DemoError(f"the collector's metrics did not answer on {url}; see "
                                f"{self.cluster_dir / 'log' / 'collector.log'}")
            time.sleep(0.5)
            try:
                with urllib.request.urlopen(url, timeout=5) as r:
                    lines = r.read().decode().splitlines()
            except OSError:
                lines = []
        shown = [ln for ln in lines if ln.startswith(want)]
        show(["curl", "-s", url, "|", "grep", "-E", "'^ncclguard_(partition_classes|"
              "partition_baseline_share|nccl_version_nodes)'"], "\n".join(shown))
        split = next(ln for ln in shown if ln.startswith(want[0] + "{"))
        say(f"    the split: {split}  (alert NcclguardPartitionSplit: more than 1)")
        say(f"    Point Prometheus at {url} (job and rules: prometheus/prometheus.example.yml,")
        say("    prometheus/ncclguard.rules.yml); all metrics: docs/metrics.md")
        self.state["metrics"] = {"url": url, "split": split, "pid": p.pid}

    def write_config(self) -> None:
        self.cluster_dir.mkdir(parents=True, exist_ok=True)
        self.config.write_text(self.gate_config())

    def collect(self, cluster: DevCluster, label: str) -> None:
        """One collector scan (``collect --once``), its log lines shown."""
        r = cluster.collect(check=False)
        lines = [ln for ln in r.stderr.splitlines() if "rejected" in ln or "records in" in ln]
        show(label.split(), "\n".join(lines))
        if r.returncode != 0:
            raise DemoError(f"the collector failed ({r.returncode}): {r.stderr.strip()}")

    def save_state(self) -> None:
        (self.base / "state.json").write_text(json.dumps(self.state, indent=2) + "\n")

    def job_story(self, cluster: DevCluster) -> None:
        wrap = 'echo "ran on $SLURM_JOB_NODELIST"'
        args = [f"-N{JOB_NODES}", "-J", "demo-allreduce", "--wrap", wrap]
        job = cluster.sbatch(args)
        say(f"    $ sbatch {' '.join(args[:-1])} '{wrap}'")
        say(f"      Submitted batch job {job}")
        self.state["job"] = job
        self.save_state()

        refusal = self.wait_refusal(job)
        say(f"    job {job} allocated {refusal.get('nodes')}: the gate said "
            f"{refusal.get('decision')} -> {refusal.get('action')}")
        say(f"    AdminComment: {cluster_admin_comment(cluster, job)}")
        self.state["refusal"] = refusal

        try:
            state = cluster.wait_job(job, {"COMPLETED", "FAILED", "CANCELLED"},
                                     timeout=WAIT_COMPLETE_S)
        except ClusterError as e:
            raise DemoError(f"job {job} did not finish: {e}") from None
        fields = {k: cluster.job_field(job, k) for k in
                  ("JobState", "NodeList", "ExcNodeList", "Restarts")}
        out = cluster.run(["scontrol", "show", "job", str(job)], check=False).stdout
        keep = [ln for ln in out.splitlines()
                if any(k in ln for k in ("JobState=", "NodeList=", "Restarts=", "ExcNodeList="))]
        show(["scontrol", "show", "job", str(job)], "\n".join(ln.strip() for ln in keep))
        self.state["final"] = fields
        self.save_state()
        if state != "COMPLETED":
            raise DemoError(f"job {job} ended {state}:\n{cluster.show_job(job)}")
        say(f"    job {job} COMPLETED on {fields['NodeList']} after "
            f"{fields['Restarts']} refusal(s); steered away from {fields['ExcNodeList']}")
        self.ncclguard("decisions", "--job", str(job))

    def prevention_story(self, cluster: DevCluster) -> None:
        cluster.start_features_daemon()
        deadline = time.monotonic() + 30
        while not cluster.classes_file.exists():
            if time.monotonic() > deadline:
                raise DemoError("the features daemon wrote no file of classes within 30s; "
                                f"see {self.cluster_dir / 'log' / 'features.out'}")
            time.sleep(0.2)
        time.sleep(1.1)  # job_submit.lua trusts a file verified after its own start
        self.state["features_pid"] = cluster._procs["features"].pid
        out = cluster.run(["sinfo", "-N", "-h", "-o", "%N %f"], check=False).stdout
        show(["sinfo", "-N", "-h", "-o", "%N %f"], out)
        blocker = cluster.sbatch(["-w", "n2", "--exclusive", "-J", "busy", "--wrap", "sleep 6"])
        cluster.wait_job(blocker, {"RUNNING"}, 60)
        wrap = 'echo "ran on $SLURM_JOB_NODELIST"'
        args = [f"-N{JOB_NODES}", "-J", "demo-prevented", "--wrap", wrap]
        job = cluster.sbatch(args)
        say(f"    $ sbatch {' '.join(args[:-1])} '{wrap}'      # n2 busy")
        say(f"      Submitted batch job {job}")
        say(f"    Features={cluster.job_field(job, 'Features')} (added by job_submit.lua); "
            f"state {cluster.job_field(job, 'JobState')}, waiting for its class")
        self.state["prevented_job"] = job
        self.save_state()
        try:
            state = cluster.wait_job(job, {"COMPLETED", "FAILED", "CANCELLED"},
                                     timeout=WAIT_COMPLETE_S)
        except ClusterError as e:
            raise DemoError(f"job {job} did not finish: {e}") from None
        fields = {k: cluster.job_field(job, k) for k in ("JobState", "NodeList", "Restarts")}
        self.state["prevented"] = fields
        self.save_state()
        if state != "COMPLETED":
            raise DemoError(f"job {job} ended {state}:\n{cluster.show_job(job)}")
        say(f"    job {job} COMPLETED on {fields['NodeList']} after {fields['Restarts']} "
            "refusal(s)")
        r = cluster.run(["srun", "-N2", "-J", "demo-srun", "hostname"], check=False, timeout=60)
        show(["srun", "-N2", "hostname"], r.stdout + r.stderr)
        self.ncclguard("decisions", "--since", "5m")

    def wait_refusal(self, job: int) -> dict[str, Any]:
        """The gate's first refusal of ``job``, from its audit trail (bounded wait)."""
        deadline = time.monotonic() + WAIT_REFUSAL_S
        while time.monotonic() < deadline:
            r = self.tool("ncclguard", "decisions", "--job", str(job), "--json")
            if r.returncode == 0:
                for rec in json.loads(r.stdout).get("decisions", []):
                    if rec.get("decision") == "refuse":
                        return dict(rec)
            time.sleep(0.5)
        raise DemoError(f"the gate did not refuse job {job} within {WAIT_REFUSAL_S:.0f}s; "
                        f"see {self.cluster_dir / 'gate.log'} and "
                        f"{self.cluster_dir / 'log' / 'slurmctld.log'}")


def cluster_admin_comment(cluster: DevCluster, job: int) -> str:
    """AdminComment, whole (it holds spaces and '='), from ``scontrol show job``."""
    out = cluster.run(["scontrol", "show", "job", str(job)], check=False).stdout
    for line in out.splitlines():
        line = line.strip()
        if line.startswith("AdminComment="):
            return line.split("=", 1)[1]
    return ""


def summarize(fp: Mapping[str, Any]) -> str:
    """One line of a fingerprint: NCCL, plugin and ABI, RDMA ports up."""
    libs = [lib for lib in fp.get("libnccl") or [] if lib.get("default")]
    nccl = libs[0].get("version") if libs else None
    net = fp.get("net") or {}
    pname = next((p.get("name") for p in fp.get("plugins") or []
                  if p.get("kind") == "net" and p.get("path") == net.get("plugin")), None)
    abi = net.get("effective_net_abi")
    ports = [p for d in (fp.get("rdma") or {}).get("devices") or [] for p in d.get("ports") or []]
    up = sum(1 for p in ports if "ACTIVE" in str(p.get("state")))
    plug = f"plugin {pname} ABI v{abi}" if pname else "no plugin"
    return f"nccl {nccl}, {plug}, IB ports up {up}/{len(ports)}"


# ------------------------------------------------------------------------- preflight / stop


def preflight() -> None:
    """Say exactly what is missing, all at once."""
    missing = missing_programs()
    problems = []
    if missing:
        problems.append(f"programs not installed: {', '.join(missing)} "
                        "(apt-get install slurm-wlm munge)")
    if shutil.which("gcc") is None:
        problems.append("gcc is not installed (apt-get install gcc)")
    if os.geteuid() != 0:
        problems.append("not root: the demo's slurmctld and slurmd run as SlurmUser=root "
                        "(run it as root, e.g. sudo scripts/demo.sh)")
    if problems:
        raise DemoError("cannot run the demo:\n  - " + "\n  - ".join(problems))


# features.pid, collector.pid: the controller's services (steps 6, 9), stopped first;
# munge/*.pid: the controller's munged and each node's
PIDFILES = ("features.pid", "collector.pid", "log/slurmd-*.pid", "slurmctld.pid",
            "munge/*.pid")


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(
            errors="replace")
    except OSError:
        return ""


def demo_pids(base: Path) -> dict[int, str]:
    """The demo's daemons that are alive: pid -> pid file. A pid counts only when its
    command line names this demo's directory (a stale pid file may name another process)."""
    cluster = base.resolve() / "cluster"
    pids: dict[int, str] = {}
    for pattern in PIDFILES:
        for f in sorted(cluster.glob(pattern)):
            try:
                pid = int(f.read_text().split()[0])
            except (OSError, ValueError, IndexError):
                continue
            if pid > 1 and str(cluster) in _cmdline(pid):
                pids[pid] = str(f.relative_to(cluster))
    return pids


def stop(base: Path, quiet: bool = False, timeout: float = 20.0) -> bool:
    """Stop the demo's daemons (slurmd first, munged last). True if any was running."""
    pids = demo_pids(base)
    if not pids:
        if not quiet:
            say(f"no demo running in {base.resolve()}")
        return False
    for pid, what in pids.items():  # ordered like PIDFILES: collector, slurmd, slurmctld, munged
        if not quiet:
            say(f"stopping {Path(what).stem} (pid {pid})")
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout
    alive = set(pids)
    while alive and time.monotonic() < deadline:
        alive = {p for p in alive if str(base.resolve()) in _cmdline(p)}
        time.sleep(0.2)
    for pid in alive:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    if not quiet:
        say("demo stopped" + (f" ({len(alive)} killed after {timeout:.0f}s)" if alive else ""))
    return True


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="ncclguard-demo", description=__doc__.splitlines()[0])
    p.add_argument("action", choices=("run", "stop"), nargs="?", default="run")
    p.add_argument("--dir", default=".demo", help="the demo's private directory (.demo)")
    args = p.parse_args(argv)
    base = Path(args.dir)
    if args.action == "stop":
        stop(base)
        return 0
    try:
        return Demo(base).run()
    except (DemoError, PartUnavailable, ClusterError, NodeTreeError, OSError,
            subprocess.SubprocessError) as e:
        print(f"demo: {e}", file=sys.stderr, flush=True)
        _stop_after_failure(base)
        return 1
    except BaseException:  # a bug or ^C: no daemons left behind either
        _stop_after_failure(base)
        raise


def _stop_after_failure(base: Path) -> None:
    if find_program("slurmctld") and stop(base, quiet=True):
        print("demo: stopped its cluster; logs are in "
              f"{(base / 'cluster' / 'log').resolve()}", file=sys.stderr, flush=True)


if __name__ == "__main__":
    sys.exit(main())
