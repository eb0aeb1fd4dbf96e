"""``twinshard md`` under torchrun joins the launched world (init_world) instead of spawning ranks, and
exits cleanly (code 0, no "terminate called" abort from a process group left to interpreter exit)."""

import json
import os
import shutil
import subprocess
import sys

import pytest


def test_md_under_torchrun_uses_the_launched_world():
    torchrun = shutil.which("torchrun", path=os.path.dirname(sys.executable))
    if torchrun is None:
        pytest.skip("torchrun is not installed beside this Python")
    env = dict(os.environ, OMP_NUM_THREADS="1")
    cmd = [
        torchrun,
        "--standalone",
        "--nproc-per-node",
        "2",
        "-m",
        "twinshard.cli",
        "md",
        "--potential",
        "lj",
        "--atoms",
        "256",
        "--steps",
        "5",
        "--check-serial",
        "--json",
    ]
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    # every rank destroyed its process group before exit (no gloo teardown abort at finalization)
    assert "terminate called" not in out.stderr, out.stderr[-3000:]
    lines = [ln for ln in out.stdout.splitlines() if ln.startswith("{")]
    assert len(lines) == 1  # only rank 0 prints
    res = json.loads(lines[0])
    assert res["ranks"] == 2 and res["atoms"] == 256 and len(res["halo_atoms_per_rank"]) == 2
    assert res["energy_rel_error"] <= 1e-12 and res["max_force_error"] <= 1e-10
    assert res["max_position_error"] <= 1e-9
