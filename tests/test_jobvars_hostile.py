"""A hostile job's NCCL_* variables at the gate (issue 40, ncclguard/policy/jobvars.py).

The job's user chooses every value. Each test here is an input where the gate, applying
the job's variables, accepted (or only warned about) nodes that NCCL itself puts on
different transports for that job, or cost unbounded time, or showed a user's value
uncut. "What NCCL does" is cited from NVIDIA/nccl's sources (v2.18.3 .. v2.30.7):

- ``src/misc/socket.cc`` ``ncclFindInterfaces``: ``if (env && strlen(env) > 1)``: a
  ``NCCL_SOCKET_IFNAME`` of one character is ignored (NCCL picks interfaces itself: ib,
  then any but docker and lo, then docker, then lo).
- ``src/misc/utils.cc`` ``parseStringList``: a port is ``atoi`` (glibc: ``(int) strtol``:
  ASCII digits, the long's value cut to 32 bits); at most ``maxList`` entries are read:
  ``MAX_IB_DEVS`` (32 since 2.18.5) for ``NCCL_IB_HCA``, ``MAX_IFS`` (16) for
  ``NCCL_SOCKET_IFNAME``; the rest of the list is ignored.
- ``src/misc/param.cc`` ``setEnvFile``: ``setenv(name, value, 0)``: a variable the job
  sets, even to the empty string, keeps /etc/nccl.conf's line out; ``ncclLoadParam``
  then takes an empty value as the default.

Every scenario: n1 and n2 alike (one ACTIVE InfiniBand port, an IP interface), but n2's
/etc/nccl.conf sets something n1's does not, so that NCCL runs n1 on IB and n2 on Socket
for the job: a mixed allocation that the gate must not accept.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path
from types import SimpleNamespace

import pytest
from helpers.fingerprints import fingerprint

from ncclguard.config import PolicyConfig
from ncclguard.fingerprint.jobenv import loading_vars
from ncclguard.policy import evaluate_env, evaluate_nccl, evaluate_values, node_values
from prolog import ownnccl

POLICY = PolicyConfig()
JOB = {"nccl_version": "2.23.4", "net_abis": [8, 7, 6, 5], "path": "/v/l",
       "source": "VIRTUAL_ENV"}


def save_env(state: Path, job_id: int, env: dict[str, str]) -> None:
    """The job's environment as slurmctld saves it (as tests/test_gate_ownnccl.py)."""
    d = state / f"hash.{job_id % 10}" / f"job.{job_id}"
    d.mkdir(parents=True, exist_ok=True)
    entries = [f"{k}={v}".encode() + b"\0" for k, v in env.items()]
    f = d / "environment"
    f.write_bytes(struct.pack("=I", len(entries)) + b"".join(entries))
    f.chmod(0o600)


def _n2_ib_off() -> dict[str, dict]:
    """n1 on IB; n2's /etc/nccl.conf sets NCCL_IB_DISABLE=1: Socket. The records show it."""
    return {"n1": node_values(fingerprint("n1")),
            "n2": node_values(fingerprint("n2", conf={"NCCL_IB_DISABLE": "1"}))}


def _refused(records: dict, variables: dict[str, str]) -> None:
    v = evaluate_env(records, POLICY, variables)
    assert v.decision == "refuse" and "transport" in {f.rule for f in v.findings}, (
        repr(variables)[:200], v.format_text()[:2000])


def test_the_mix_is_refused_without_variables() -> None:
    assert evaluate_values(_n2_ib_off(), POLICY).decision == "refuse"


@pytest.mark.parametrize("value", ["^", "x"])
def test_a_one_character_socket_ifname_is_ignored_as_nccl_does(value: str) -> None:
    """NCCL_SOCKET_IFNAME=^ : NCCL ignores a value of one byte (strlen > 1) and finds
    n1's interface itself: n1 on IB, n2 on Socket (its file). The gate took '^' as
    "exclude every interface": no IP interface anywhere, Socket on both: accepted."""
    _refused(_n2_ib_off(), {"NCCL_SOCKET_IFNAME": value})


@pytest.mark.parametrize("value", [
    "mlx5_0:4294967297",  # atoi: (int) 4294967297 == 1: port 1 kept
    "mlx5_0:99999999999999999999",  # strtol saturates at LONG_MAX, (int) -1: any port
    "^mlx5_0:\u0661",  # ARABIC-INDIC DIGIT ONE: not a digit to atoi: port 0, none excluded
])
def test_an_hca_port_is_read_as_nccls_atoi(value: str) -> None:
    """The gate read the port with Python's int (any size, any Unicode digit): it found
    no port of n1 selected (Socket on both: accepted) where NCCL keeps mlx5_0 port 1."""
    _refused(_n2_ib_off(), {"NCCL_IB_HCA": value})


def test_an_hca_list_is_read_no_further_than_nccl_reads_it() -> None:
    """NCCL reads 32 entries of NCCL_IB_HCA (MAX_IB_DEVS): the 33rd, 'mlx5', does not
    exclude n1's mlx5_0 (IB). The gate read it: no port on n1, Socket on both."""
    dummies = ",".join(f"zz{i}" for i in range(32))
    _refused(_n2_ib_off(), {"NCCL_IB_HCA": f"^{dummies},mlx5"})


def test_a_socket_ifname_list_is_read_no_further_than_nccl_reads_it() -> None:
    """NCCL reads 16 entries of NCCL_SOCKET_IFNAME (MAX_IFS): n1's 'ib0' is not
    excluded, n1 has an IP interface and runs on IB. The gate excluded it."""
    dummies = ",".join(f"zz{i}" for i in range(16))
    _refused(_n2_ib_off(), {"NCCL_SOCKET_IFNAME": f"^{dummies},ib,eth,en,lo"})


def test_an_empty_variable_still_keeps_the_files_line_out() -> None:
    """n1's file sets NCCL_IB_DISABLE=1, n2's NCCL_IB_HCA names no HCA it has: both on
    Socket, not refused. A job whose environment holds NCCL_IB_DISABLE= (empty) keeps n1's
    line out (setenv(..., 0)) and NCCL reads the empty value as 0: n1 on IB, n2 on
    Socket. The gate reads a job's variables with loading_vars, which dropped an empty one:
    judged by n1's file, only warned about. Now kept, and applied."""
    records = {"n1": node_values(fingerprint("n1", conf={"NCCL_IB_DISABLE": "1"})),
               "n2": node_values(fingerprint("n2", conf={"NCCL_IB_HCA": "mlx9_"}))}
    # (the rdma-* rules warn: n2's file selects no HCA; no rule refuses)
    assert evaluate_values(records, POLICY).decision == "warn"
    variables, _ = loading_vars({"NCCL_IB_DISABLE": ""})  # what the gate takes
    v = evaluate_env(records, POLICY, variables)
    assert v.decision == "refuse", v.format_text()


def test_nccl_variables_too_long_to_hand_on_are_still_applied(tmp_path: Path) -> None:
    """The gate's read of the saved environment refuses to hand on more than 32 KiB
    (MAX_HANDED), counting the NCCL_* variables that are never handed on: a 40 KB
    NCCL_TUNER_PLUGIN drops the job's NCCL_IB_DISABLE=0 too, and the job is judged as if
    it set nothing. n1's file sets NCCL_IB_DISABLE=1 (n2's names no HCA): both on
    Socket by their files; with the job's 0, n1 on IB."""
    records = {"n1": node_values(fingerprint("n1", conf={"NCCL_IB_DISABLE": "1"})),
               "n2": node_values(fingerprint("n2", conf={"NCCL_IB_HCA": "mlx9_"}))}
    small = {"NCCL_IB_DISABLE": "0"}
    assert evaluate_env(records, POLICY, small).decision == "refuse"
    save_env(tmp_path / "state", 77, {**small, "NCCL_TUNER_PLUGIN": "t" * 40_000})
    env, why = ownnccl.read(SimpleNamespace(state_save_location=str(tmp_path / "state")),
                            77, None)
    verdict = ownnccl.judge(records, POLICY, (), None, env, None)
    assert verdict.decision == "refuse", (why, verdict.format_text()[:500])


def test_a_users_nccl_net_is_cut_in_every_finding() -> None:
    """NCCL_NET=<64 KiB>: the transport the gate derives, 'none (NCCL_NET=<value>)', is
    a finding's label as it is: the whole value, in the transport finding (a node of an
    older daemon beside one with inputs) and in job-stack (a job's own NCCL)."""
    value = "\x1b]0;owned\x07" + "A" * 65_000
    old_new = {h: node_values(fingerprint(h)) for h in ("n1", "n2")}
    del old_new["n1"]["job"]["inputs"]
    own = {h: node_values(fingerprint(h, plugin_abi=a, offers=True))
           for h, a in (("n1", 8), ("n2", 10))}
    for v in (evaluate_env(old_new, POLICY, {"NCCL_NET": value}),
              evaluate_nccl(own, POLICY, JOB, variables={"NCCL_NET": value})):
        assert v.decision == "refuse"
        longest = max(len(g[0]) for f in v.findings for g in f.groups)
        assert longest < 1000, [(f.rule, [len(g[0]) for g in f.groups]) for f in v.findings]
        assert len(v.format_text()) < 5000
        assert len(json.dumps(v.to_dict())) < 5000


def test_a_long_hca_list_costs_what_nccl_reads_of_it() -> None:
    """A 64 KiB NCCL_IB_HCA of 16,000 entries: each distinct record's ports were matched
    against every entry (about 9 ms a record of 4 HCAs): 1,024 distinct records took 9 s,
    16,384 about 150 s, past the gate's 5 s deadline (and gate.on_error accepts by
    default). NCCL reads 32 entries; the list is parsed once per value and limit, whatever
    the number of records (the work, counted; the time is bench/bench_policy.py's)."""
    from ncclguard.fingerprint import transport

    text = json.dumps(node_values(fingerprint("n1", hcas=4)))
    records = {f"n{i}": json.loads(text) for i in range(256)}  # distinct objects
    hca = ("^" + ",".join("mmm" for _ in range(16_400)))[:65_536]
    assert len(transport.parse_if_list(hca, transport.MAX_IB_DEVS)[2]) == 32
    before = transport._parsed.cache_info().misses
    evaluate_env(records, POLICY, {"NCCL_IB_HCA": hca, "NCCL_SOCKET_IFNAME": hca})
    # one parse per (value, limit): 32 and 16 entries of the HCA list, 16 of the interfaces
    assert transport._parsed.cache_info().misses - before <= 3


def test_an_ib_disable_of_many_digits_is_out_of_range_as_for_nccl() -> None:
    """NCCL_IB_DISABLE of 5,000 nines: strtoll sets ERANGE and NCCL takes the default,
    0: n1 (its file sets 1) on IB, n2 (its file selects no HCA) on Socket. The gate's
    strtoll raised (Python's int() of more than 4,300 digits): transport unknown, n1 kept
    its file's Socket and job-vars only warned. 100 nines were already refused."""
    records = {"n1": node_values(fingerprint("n1", conf={"NCCL_IB_DISABLE": "1"})),
               "n2": node_values(fingerprint("n2", conf={"NCCL_IB_HCA": "mlx9_"}))}
    for value in ("9" * 100, "9" * 5000, "-" + "0" * 60_000 + "9" * 5000):
        v = evaluate_env(records, POLICY, {"NCCL_IB_DISABLE": value})
        assert v.decision == "refuse", (len(value), v.format_text()[:500])
