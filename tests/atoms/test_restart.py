"""Restartable MD: an interrupted and resumed run equals the uninterrupted one; atomic checkpoints.

The resumed runs scatter the checkpoint over a different rank count (4 -> 2) or the same (4 -> 4),
with atoms migrating between ranks both before and after the restart; the final state (positions,
velocities, bath heat) equals the uninterrupted 4-rank run within fp64 round-off (the harness's
default budget). The checkpoint writer is tested directly: a process SIGKILLed between its
temporary write and the rename, or in the middle of the write, leaves the previous checkpoint
readable.
"""

import os
import signal
import subprocess
import sys
import textwrap

import pytest
import torch

from twinshard.atoms.data.structures import random_packing
from twinshard.atoms.dynamics.driver import MDConfig, md_rank
from twinshard.atoms.dynamics.md import (
    CHECKPOINT_FORMAT,
    Langevin,
    VelocityVerlet,
    checkpoint_state,
    load_checkpoint,
    save_checkpoint,
)
from twinshard.runtime import RankFailure
from twinshard.testing import assert_parity, run_on_world

# a small hot liquid on 4 ranks: atoms cross subdomain faces in both halves of a 60-step run
BASE = dict(
    structure="random_packing",
    atoms=160,
    cutoff=5.0,
    skin=0.6,
    temperature=1000.0,
    dt=4.0,
    seed=1,
    friction=0.05,
    thermo_every=10,
)
STEPS, CUT = 60, 30


@pytest.mark.parametrize(("thermostat", "resume_ranks"), [("none", 2), ("langevin", 2), ("langevin", 4)])
def test_resumed_run_equals_uninterrupted_run(tmp_path, thermostat, resume_ranks):
    full_ck, ck, end_ck = tmp_path / "full.pt", tmp_path / "ck.pt", tmp_path / "end.pt"
    full_log, log = tmp_path / "full.txt", tmp_path / "resumed.txt"
    cfg = dict(BASE, thermostat=thermostat)
    full = run_on_world(
        md_rank, 4, MDConfig(steps=STEPS, checkpoint=str(full_ck), thermo=str(full_log), **cfg)
    )
    first = run_on_world(
        md_rank,
        4,
        MDConfig(steps=CUT, checkpoint=str(ck), checkpoint_every=10, thermo=str(log), **cfg),
    )[0]
    # a killed run may have logged past its last checkpoint: the resumed log drops those rows
    with open(log, "a") as f:
        f.write(f"{CUT + 5} 0 0 0 0 0\n")
    second = run_on_world(
        md_rank,
        resume_ranks,
        MDConfig(steps=STEPS, restart=str(ck), checkpoint=str(end_ck), thermo=str(log), **cfg),
    )[0]
    assert first["migrations"] > 0 and second["migrations"] > 0  # migrations on both sides
    assert second["start_step"] == CUT and second["ranks"] == resume_ranks and second["atoms_conserved"]
    a, b = load_checkpoint(full_ck), load_checkpoint(end_ck)
    assert a["step"] == b["step"] == STEPS and b["rng"]["next_step"] == STEPS + 1
    assert torch.equal(a["system"].ids, b["system"].ids)
    grid = f"4->{resume_ranks}"
    for name in ("positions", "velocities"):
        assert_parity(
            getattr(b["system"], name), getattr(a["system"], name), what=f"{thermostat} {name}", grid=grid
        )
    heat = [torch.tensor(x["heat"], dtype=torch.float64) for x in (b, a)]
    assert_parity(heat[0], heat[1], what=f"{thermostat} bath heat", grid=grid)
    if thermostat == "langevin":
        assert abs(a["heat"]) > 0  # the noise acted: a replayed (step 1..) noise would differ
    # the thermo files have the same rows (steps 0, 10, ..., 60) and values
    rows = [_rows(p) for p in (full_log, log)]
    assert torch.equal(rows[0][:, 0], rows[1][:, 0])
    assert_parity(
        rows[1][:, 2:5],
        rows[0][:, 2:5],
        what=f"{thermostat} thermo file E_pot/E_kin/T",
        grid=grid,
        rtol=1e-11,
        atol=0.0,
        why="the file prints 12 significant digits: each side rounds by <= 5e-12 relative",
    )
    for key in ("final_potential", "final_temperature"):
        v = [torch.tensor(x[key], dtype=torch.float64) for x in (second, full[0])]
        assert_parity(v[0], v[1], what=f"{thermostat} {key}", grid=grid)


def _rows(path):
    return torch.tensor(
        [[float(v) for v in ln.split()] for ln in open(path) if not ln.startswith("#")], dtype=torch.float64
    )


def test_resumed_run_with_a_wrong_replay_differs(tmp_path):
    """Negative control: restarting the noise at step 1 (the old behaviour) is caught by the parity gate."""
    ck, end_ck, full_ck = tmp_path / "ck.pt", tmp_path / "end.pt", tmp_path / "full.pt"
    cfg = dict(BASE, thermostat="langevin")
    run_on_world(md_rank, 2, MDConfig(steps=20, checkpoint=str(full_ck), **cfg))
    run_on_world(md_rank, 2, MDConfig(steps=10, checkpoint=str(ck), **cfg))
    state = torch.load(ck, weights_only=True)
    state["step"] = 0  # resume as if nothing had run: steps 1..20 of noise again
    save_checkpoint(ck, state)
    run_on_world(md_rank, 2, MDConfig(steps=10, restart=str(ck), checkpoint=str(end_ck), **cfg))
    a, b = load_checkpoint(full_ck), load_checkpoint(end_ck)
    with pytest.raises(AssertionError, match="parity of replayed positions"):
        assert_parity(b["system"].positions, a["system"].positions, what="replayed positions")


def test_restart_errors_reach_every_rank(tmp_path):
    ck = tmp_path / "ck.pt"
    run_on_world(md_rank, 2, MDConfig(steps=10, checkpoint=str(ck), thermostat="langevin", **_without(BASE)))
    cfg = dict(_without(BASE), thermostat="none")
    with pytest.raises(
        RankFailure, match="other integrator settings.*kind: checkpoint 'langevin', now 'nve'"
    ):
        run_on_world(md_rank, 2, MDConfig(steps=20, restart=str(ck), **cfg))
    with pytest.raises(RankFailure, match="at step 10 but --steps is 5"):
        run_on_world(md_rank, 2, MDConfig(steps=5, restart=str(ck), thermostat="langevin", **_without(BASE)))
    with pytest.raises(RankFailure, match="does not exist"):
        run_on_world(md_rank, 2, MDConfig(steps=5, restart=str(tmp_path / "no.pt"), **cfg))
    torch.save({"something": 1}, tmp_path / "foreign.pt")
    with pytest.raises(ValueError, match="not a twinshard MD checkpoint"):
        load_checkpoint(tmp_path / "foreign.pt")


def _without(d):
    return {k: v for k, v in d.items() if k != "thermostat"}


def test_checkpoint_holds_the_state_and_loads_weights_only(tmp_path):
    s = random_packing(20, seed=3)
    s.velocities = torch.randn(20, 3, dtype=torch.float64)
    s.ids = s.ids * 7 + 5
    s.arrays["charges"] = torch.linspace(-1, 1, 20, dtype=torch.float64)
    integ = Langevin(2.0, 300.0, 0.02, seed=9)
    path = tmp_path / "c.pt"
    save_checkpoint(path, checkpoint_state(s, 42, integ, 1.25))
    raw = torch.load(path, weights_only=True)  # plain values and tensors only
    assert raw["format"] == CHECKPOINT_FORMAT and raw["rng"]["next_step"] == 43 and raw["rng"]["seed"] == 9
    st = load_checkpoint(path)
    assert st["step"] == 42 and st["heat"] == 1.25 and st["integrator"] == integ.state()
    for name in ("positions", "velocities", "ids", "numbers", "masses", "cell", "pbc"):
        assert torch.equal(getattr(st["system"], name), getattr(s, name)), name
    assert torch.equal(st["system"].arrays["charges"], s.arrays["charges"])
    assert [p.name for p in tmp_path.iterdir()] == ["c.pt"]  # no temporary left behind


_WRITER = textwrap.dedent(
    """
    import os, sys, time, torch
    from twinshard.atoms.dynamics import md
    from twinshard.atoms.data.structures import random_packing

    path, mode = sys.argv[1], sys.argv[2]
    state = md.checkpoint_state(random_packing(400, seed=1), 20, md.VelocityVerlet(2.0), 0.0)
    real_save = torch.save

    def stall(*args):
        print("STALLED", flush=True)
        time.sleep(600)

    if mode == "before-replace":  # the temporary is complete: stop before the rename
        os.replace = stall
    else:  # stop in the middle of writing the bytes (to the temporary, or to the file itself)
        def torn(obj, f):
            f.write(b"PK\\x03\\x04 half a checkpoint")
            f.flush()
            stall()
        torch.save = torn
    if mode == "non-atomic":  # the planted bug: write straight to the destination
        with open(path, "wb") as f:
            torch.save(state, f)
    else:
        md.save_checkpoint(path, state)
    """
)


@pytest.mark.parametrize("mode", ["before-replace", "mid-write"])
def test_sigkill_mid_write_leaves_the_previous_checkpoint(tmp_path, mode):
    path = tmp_path / "ck.pt"
    save_checkpoint(path, checkpoint_state(random_packing(400, seed=1), 10, VelocityVerlet(2.0), 0.0))
    _kill_writer(path, mode)
    leftovers = [p.name for p in tmp_path.iterdir() if p.name != "ck.pt"]
    assert len(leftovers) == 1 and leftovers[0].endswith(".tmp")  # it was killed while writing
    assert load_checkpoint(path)["step"] == 10  # the previous checkpoint, intact


def test_sigkill_mid_write_of_a_non_atomic_writer_is_caught(tmp_path):
    """Negative control: writing in place leaves a torn file that load_checkpoint refuses."""
    path = tmp_path / "ck.pt"
    save_checkpoint(path, checkpoint_state(random_packing(400, seed=1), 10, VelocityVerlet(2.0), 0.0))
    _kill_writer(path, "non-atomic")
    with pytest.raises(ValueError, match="cannot be read"):
        load_checkpoint(path)


def _kill_writer(path, mode):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.Popen(
        [sys.executable, "-c", _WRITER, str(path), mode], stdout=subprocess.PIPE, text=True, env=env
    )
    try:
        line = proc.stdout.readline()
        assert line.strip() == "STALLED", line
        os.kill(proc.pid, signal.SIGKILL)
        assert proc.wait(timeout=60) == -signal.SIGKILL
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_restart_drops_trajectory_frames_past_the_checkpoint(tmp_path):
    """A killed run leaves frames past its last checkpoint; the restart drops them before appending,
    so every step appears once (frames carry ``step=``), and the resumed frames equal the first run's."""
    import shutil

    import ase.io

    from twinshard.atoms.dynamics.md import SerialEngine, simulate
    from twinshard.atoms.potentials import LennardJones

    pot = LennardJones(cutoff=5.0)
    traj, ck, ck4 = tmp_path / "t.extxyz", tmp_path / "ck.pt", tmp_path / "ck4.pt"

    def run(system, steps, start=0, heat=0.0):
        engine = SerialEngine(pot, system, skin=0.6)
        simulate(
            engine, VelocityVerlet(4.0), steps, trajectory=str(traj), trajectory_every=2,
            checkpoint=str(ck), checkpoint_every=4, start_step=start, heat=heat,
        )  # fmt: skip

    start = random_packing(40, seed=3)
    run(start, 4)  # frames 0, 2, 4 and the checkpoint at step 4
    shutil.copy(ck, ck4)
    state = load_checkpoint(str(ck4))
    run(state["system"], 10, 4, state["heat"])  # the "killed" run: frames 6, 8, 10 past step 4
    first = ase.io.read(traj, index=":")
    assert [a.info["step"] for a in first] == [0, 2, 4, 6, 8, 10]
    run(state["system"], 8, 4, state["heat"])  # restarted from step 4 again, up to 8
    frames = ase.io.read(traj, index=":")
    assert [a.info["step"] for a in frames] == [0, 2, 4, 6, 8]
    for a, b in zip(frames, first[:5]):
        assert (a.positions == b.positions).all()
