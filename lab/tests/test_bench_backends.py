"""``kvpolicy bench backends`` runs and prints a row per available backend plus the copy row (speeds
are not asserted); the plugin kvpolicy-quanto-hqq's backends join those of the core."""

from __future__ import annotations

import pytest
from lab_fixtures import quanto_hqq_backends  # noqa: F401  (pytest fixtures)

from kvpolicy import registry
from kvpolicy.cli import main

pytestmark = pytest.mark.usefixtures("quanto_hqq_backends")


def test_bench_backends_prints_a_row_per_backend(capsys):
    assert main(["bench", "backends", "--shape", "1", "2", "16", "64", "--group-size", "16", "--repeats", "2"]) == 0
    lines = capsys.readouterr().out.splitlines()
    rows = {line.split()[0]: line.split()[1:] for line in lines[2:] if not line.startswith("skipped")}
    skipped = {line.split()[1].rstrip(":") for line in lines if line.startswith("skipped")}
    assert "clone" in rows
    assert {"torch", "quanto", "hqq"} <= set(rows)
    assert set(rows) | skipped == {"clone", *registry.names("backends")}
    for name, cells in rows.items():
        assert len(cells) == 6 and all(float(c) > 0 for c in cells[:5]), name
        assert (float(cells[5]) == 0) == (name == "clone")
    assert float(rows["torch"][4]) == 2 + 32 / 16  # bits + two 16-bit values per group of 16


def test_bench_backends_says_why_a_backend_is_skipped(capsys):
    argv = ["bench", "backends", "--shape", "1", "1", "8", "64", "--bits", "3", "--group-size", "8", "--repeats", "1"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "skipped quanto: backend 'quanto' does not support bits=3; it supports bits in [2, 4]" in out
    assert "\ntorch " in out  # torch packs 3-bit codes (eight per three bytes)
    assert "\nhqq " in out


def test_bench_backends_rejects_bad_shape(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["bench", "backends", "--shape", "1", "2", "3"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "argument --shape: must be four integers batch kv_heads tokens head_dim (e.g. 1 8 4096 128); got 3" in err
