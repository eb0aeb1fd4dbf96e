"""Every ``twinshard`` command runs on the world torchrun launched: no local ranks of its own (no
worker pool, no child process), one result printed by rank 0, exit 0 on every rank; a grid that
does not match the world raises the same clear error on every rank. ``torchrun -m twinshard``
and ``python -m twinshard`` work (the package has a ``__main__``)."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

from commands_on_world import COMMANDS  # tests/cli is on sys.path (no __init__: rootdir-relative)

HERE = Path(__file__).resolve().parent
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node"]
JSON_COMMANDS = [n for n, argv in COMMANDS.items() if "--json" in argv or n == "bench-harness"]


def _env():
    return dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")


def test_every_command_runs_on_the_launched_world():
    out = subprocess.run(
        TORCHRUN + ["4", str(HERE / "commands_on_world.py")],
        capture_output=True,
        text=True,
        env=_env(),
        timeout=400,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert "terminate called" not in out.stderr
    ran = re.findall(r"RAN (\S+) rank (\d) code (\d+) pool (\w+) children (\d+)", out.stderr)
    by_name: dict[str, list] = {}
    for name, rank, code, pool, children in ran:
        by_name.setdefault(name, []).append((int(rank), int(code), pool, int(children)))
    assert sorted(by_name) == sorted(COMMANDS), out.stderr[-3000:]
    for name, rows in by_name.items():
        assert sorted(r[0] for r in rows) == [0, 1, 2, 3], (name, rows)
        # the launched world ran it: no worker pool, no child process on any rank
        assert all(pool == "False" and children == 0 for _, _, pool, children in rows), (name, rows)
        want = 1 if name == "trunk-wrong-grid" else 0
        assert all(code == want for _, code, _, _ in rows), (name, rows, out.stderr[-3000:])
    wrong = re.findall(
        r"twinshard: error on rank \d: ValueError: --grid asks for 2 ranks but this world has 4", out.stderr
    )
    assert len(wrong) == 4, out.stderr[-3000:]  # every rank says it
    # one result per command, printed by rank 0 only
    results = [json.loads(ln[ln.index("{") :]) for ln in out.stdout.splitlines() if "{" in ln]
    assert len(results) == len(JSON_COMMANDS) - 1, out.stdout[-3000:]  # the wrong grid printed none
    assert out.stdout.count("twinshard demo: 4 ") == 1
    md = next(r for r in results if "halo_atoms_per_rank" in r)
    assert md["ranks"] == 4 and md["atoms"] == 108 and len(md["halo_atoms_per_rank"]) == 4
    assert md["energy_rel_error"] <= 1e-12 and md["max_force_error"] <= 1e-10  # equal to serial
    assert md["max_position_error"] <= 1e-9
    trunk = next(r for r in results if r.get("op") == "trunk")  # the whole Boltz-2 trunk
    assert trunk["grid"] == "2x2" and len(trunk["peak_memory_bytes_per_rank"]) == 4
    predict = next(r for r in results if r.get("command") == "predict")  # rank 0 gathered and wrote
    assert predict["ranks"] == 4 and len(predict["samples"]) == 1
    assert Path(predict["samples"][0]["files"]["structure"]).is_file()
    assert all(e["max_abs"] <= 1e-3 * max(e["ref_scale"], 1.0) for e in predict["errors"].values())  # fp32
    validate = next(r for r in results if "first_divergence" in r)
    assert validate["ranks"] == 4 and validate["passed"] is True  # --ranks 2 ignored: torchrun sets it
    selftest = next(r for r in results if "selftest" in r)
    assert selftest["selftest"] == "passed" and selftest["ranks"] == 4


def test_python_dash_m_twinshard():
    out = subprocess.run(
        [sys.executable, "-m", "twinshard", "--help"], capture_output=True, text=True, env=_env(), timeout=120
    )
    assert out.returncode == 0 and "twinshard demo" in out.stdout, out.stderr[-2000:]
