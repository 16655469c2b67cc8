"""ncclguard/config.py: the shipped example covers every key and loads; errors name the
file, the key and the value."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

import pytest

from ncclguard import config as configmod
from ncclguard.policy.rules import RULES
from ncclguard.policy.settings import BASELINE_KEYS, check_config, load_config

EXAMPLE = Path(__file__).resolve().parents[1] / "docs" / "config.example.toml"


def test_example_loads_and_equals_the_defaults() -> None:
    cfg = load_config(EXAMPLE)
    assert cfg.source == str(EXAMPLE)
    assert cfg.replace(source="<defaults>") == check_config(configmod.Config())


def test_example_names_every_key_of_every_section() -> None:
    data = tomllib.loads(EXAMPLE.read_text())
    missing = []
    for section, cls in configmod._SECTIONS.items():
        for name in cls.field_names():
            if name not in data.get(section, {}):
                missing.append(f"{section}.{name}")
    assert not missing, f"add to docs/config.example.toml: {missing}"
    assert set(data["policy"]["severity"]) == {r.name for r in RULES}
    text = EXAMPLE.read_text()
    assert "[baseline]" in text
    for key in BASELINE_KEYS:
        assert re.search(rf"^# {key} = ", text, re.M), key
    top = set(configmod.Config.field_names()) - {"source", "baseline"}
    assert top == set(configmod._SECTIONS)


@pytest.mark.parametrize(
    ("toml", "pattern"),
    [
        ('[inventory]\njournal_mode = "truncate"\n',
         r"inventory\.journal_mode = 'truncate': expected one of delete, wal"),
        ("[inventory]\nbusy_timeout_ms = -1\n",
         r"inventory\.busy_timeout_ms = -1: expected a non-negative integer"),
        ("[inventoryd]\njitter = 2\n", r"inventoryd\.jitter = 2: expected a share"),
        ("[inventoryd]\ninterval_s = 0\n", r"inventoryd\.interval_s = 0: must be greater than 0"),
        ("[gate]\ncli_slurm_timeout_s = 0\n",
         r"gate\.cli_slurm_timeout_s = 0: must be greater than 0"),
        ("[inventoryd]\ntextfile_dir = 3\n", r"inventoryd\.textfile_dir = 3: expected a string"),
        ("[inventory]\nnope = 1\n", r"inventory\.nope: unknown key"),
        ("[nope]\n", r"unknown section \[nope\]"),
        ("[inventory\n", r"not valid TOML"),
    ],
)
def test_errors_name_file_key_and_value(tmp_path: Path, toml: str, pattern: str) -> None:
    p = tmp_path / "config.toml"
    p.write_text(toml)
    with pytest.raises(configmod.ConfigError, match=rf"^{re.escape(str(p))}: .*{pattern}"):
        configmod.load(p)


def test_environment_and_missing_files(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    p = tmp_path / "c.toml"
    p.write_text('[inventory]\ndb = "/x/inventory.db"\njournal_mode = "wal"\n')
    monkeypatch.setenv("NCCLGUARD_CONFIG", str(p))
    cfg = configmod.load()
    assert cfg.inventory.journal_mode == "wal" and cfg.source == str(p)
    monkeypatch.delenv("NCCLGUARD_DB", raising=False)
    assert cfg.inventory.db_path() == Path("/x/inventory.db")
    monkeypatch.setenv("NCCLGUARD_DB", str(tmp_path / "env.db"))
    assert cfg.inventory.db_path() == tmp_path / "env.db"
    monkeypatch.setenv("NCCLGUARD_CONFIG", str(tmp_path / "missing.toml"))
    with pytest.raises(configmod.ConfigError, match="config file not found"):
        configmod.load()


@pytest.mark.parametrize(
    ("toml", "pattern"),
    [
        ('[policy.severity]\nnccl-versoin = "warn"\n',
         r"policy\.severity: unknown rule 'nccl-versoin' \(known: nccl-version, "),
        ('[policy.severity]\nnccl-version = "loud"\n',
         r"nccl-version = 'loud': expected one of ignore, warn, refuse"),
        ('[baseline]\nnccl_version = "2.21.5"\n',
         r"baseline\.nccl_version: unknown key \(known: nccl, net_plugin, net_abi, "
         r"env_plugin, transport\)"),
    ],
)
def test_rule_names_and_baseline_keys_are_the_policys(
    tmp_path: Path, toml: str, pattern: str
) -> None:
    """The names in [policy.severity] and [baseline] come from the rules themselves."""
    p = tmp_path / "config.toml"
    p.write_text(toml)
    with pytest.raises(configmod.ConfigError, match=rf"^{re.escape(str(p))}: .*{pattern}"):
        load_config(p)


def test_every_rule_gets_its_default_severity() -> None:
    cfg = load_config(EXAMPLE)
    assert cfg.policy.severity == {r.name: r.severity for r in RULES}
    assert cfg.policy.severity["nccl-version"] == "refuse"
    assert cfg.policy.severity["gpudirect"] == "warn"


def test_the_audit_trail_has_a_directory_of_its_own(tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 12: with the documented layout (the inventory's directory is ncclguard's) the
    old default, next to the inventory, could never be written by the gate (SlurmUser)."""
    import os

    from ncclguard import audit

    monkeypatch.setenv("NCCLGUARD_DB", str(tmp_path / "state" / "inventory.db"))
    (tmp_path / "state").mkdir()
    os.chown(tmp_path / "state", 999, 999)  # the collector's
    log_dir = tmp_path / "log"
    monkeypatch.setattr(configmod, "AUDIT_DIR", log_dir)
    old = configmod.GateConfig().audit_path()
    assert old == tmp_path / "state" / "decisions.jsonl"  # no log dir: next to it
    with pytest.raises(audit.AuditError, match="owned by uid 999"):
        audit.append(old, {"job": 1})
    log_dir.mkdir()
    new = configmod.GateConfig().audit_path()
    assert new == log_dir / "decisions.jsonl"
    audit.append(new, {"job": 1})
    assert [r["job"] for r in audit.read(new)] == [1]
    assert configmod.GateConfig(audit_log="/x/a.jsonl").audit_path() == Path("/x/a.jsonl")


@pytest.mark.parametrize("value", ["inf", "nan", "1e999"])
def test_a_number_setting_must_be_finite(tmp_path: Path, value: str) -> None:
    """Found by review: max_age_s = inf was taken, and the features daemon's image lines
    then failed every sync (an OverflowError)."""
    path = tmp_path / "config.toml"
    path.write_text(f"[registry]\nmax_age_s = {value}\n")
    with pytest.raises(configmod.ConfigError,
                       match=r"registry.max_age_s = .*: expected a non-negative number \(finite\)"):
        configmod.load(path)


def test_the_cli_runs_slurm_under_the_configured_timeout(tmp_path: Path) -> None:
    from ncclguard.cli.context import Ctx

    p = tmp_path / "c.toml"
    p.write_text("[gate]\ncli_slurm_timeout_s = 90\n")
    assert Ctx(str(p), None).slurm.timeout == 90.0
