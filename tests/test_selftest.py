"""``twinshard selftest``: exit 0 and the JSON contract when every check passes, 1 when one fails."""

import json

import twinshard.runtime
from twinshard.cli import main

KEYS = {"selftest", "device", "ranks", "checks", "failed", "worst_error", "seconds", "rows"}


def test_selftest_passes_on_cpu_with_json(capsys):
    assert main(["selftest", "--device", "cpu", "--json"]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert set(out) == KEYS and out["selftest"] == "passed" and out["failed"] == []
    assert out["device"] == "cpu" and out["ranks"] == 4 and out["checks"] == len(out["rows"]) >= 12
    whats = " ".join(r["what"] for r in out["rows"])
    for part in ("adjoint", "atoms: LJ", "triangle multiplication", "outer product mean"):
        assert part in whats
    assert all(r["max_abs_error"] <= r["tolerance"] for r in out["rows"])


def test_selftest_exit_status_is_one_when_a_check_fails(monkeypatch, capsys):
    bad = {"what": "planted", "grid": "2x2", "max_abs_error": 1e-3, "tolerance": 1e-13, "passed": False}
    monkeypatch.setattr(twinshard.runtime, "run_ranks", lambda fn, n, **kw: [[bad]])
    assert main(["selftest", "--device", "cpu", "--json"]) == 1
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out["selftest"] == "failed" and out["failed"] == ["planted"]


def test_selftest_rejects_a_missing_gpu_or_wrong_rank_count(capsys):
    assert main(["selftest", "--ranks", "3", "--device", "cpu"]) == 2
    assert "--ranks must be 4" in capsys.readouterr().err
