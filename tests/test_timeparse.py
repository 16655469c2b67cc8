"""ncclguard.timeparse: the one parser behind ``--since`` and ``--at`` (each command is
tested to use it in test_cli_commands.py and test_gate_units.py)."""

from __future__ import annotations

from datetime import UTC, datetime

import pytest

from ncclguard.timeparse import parse_iso, parse_time

NOW = 1_000_000.0


@pytest.mark.parametrize(
    ("text", "ago"),
    [("7d", 7 * 86400), ("2h", 7200), ("30m", 1800), ("45s", 45), ("1w", 7 * 86400),
     ("1.5h", 5400), (" 2 H ", 7200)],
)
def test_an_age_counts_back_from_now(text: str, ago: float) -> None:
    assert parse_time(text, now=NOW) == NOW - ago


@pytest.mark.parametrize(
    ("text", "epoch"),
    [("1700000000", 1700000000.0), ("@1700000000", 1700000000.0),
     ("1700000000.25", 1700000000.25), (" 1700000000 ", 1700000000.0)],
)
def test_epoch_seconds(text: str, epoch: float) -> None:
    assert parse_time(text, now=NOW) == epoch


def test_iso_times_are_utc_without_a_zone() -> None:
    midnight = datetime(2026, 11, 30, tzinfo=UTC).timestamp()
    assert parse_time("2026-11-30") == midnight
    assert parse_time("20261130") == midnight  # eight digits that make a date: the date
    assert parse_time("20261399") == 20261399.0  # no date: epoch seconds
    assert parse_time("2026-11-30T00:00:00Z") == midnight
    assert parse_time("2026-11-30 02:00:00+02:00") == midnight
    assert parse_time(datetime(2026, 11, 30)) == midnight
    assert parse_time(midnight) == midnight
    assert parse_iso("2026-11-30T00:00:00Z") == midnight
    assert parse_iso("not a time") is None and parse_iso(None) is None


@pytest.mark.parametrize(
    "text", ["yesterday", "", "2x", "-5", "1e9", "nan", "inf", "@", "2h ago", "2026-13-01"]
)
def test_anything_else_is_an_error_that_names_the_value(text: str) -> None:
    with pytest.raises(ValueError, match="expected an age") as e:
        parse_time(text, now=NOW)
    assert repr(text) in str(e.value)
