"""Issue 23 (3, 4): a diverged or exploded run raises one clear error on every rank.

Divergence: `twinshard md --ranks 2 --dt 200` once died with SIGFPE inside vesin (huge but finite
positions reached the neighbour list) and was reported as "rank 0 process died". Explosion: two
atoms 0.3 A apart ran to a final temperature of 2e30 K and exit 0. The calculator handed NaN to
ASE."""

import json

import numpy as np
import pytest
import torch

from twinshard.atoms import (
    Diverged,
    LennardJones,
    NonFiniteResults,
    SerialEngine,
    TwinshardCalculator,
    VelocityVerlet,
    fcc_argon,
    maxwell_boltzmann,
    run_md,
    simulate,
    write,
)
from twinshard.cli import main
from twinshard.testing import run_on_world

LJ = ["--cutoff", "6.0", "--skin", "0.5"]


def _md(capsys, argv):
    rc = main(["md", *argv])
    out = capsys.readouterr()
    return rc, out.err, (json.loads(out.out.strip().splitlines()[-1]) if rc == 0 else None)


def _overlap(gap, n_atoms=256):
    """fcc argon at 60 K with atom 1 moved to ``gap`` A from atom 0."""
    s = fcc_argon(n_atoms=n_atoms, rattle=0.05, seed=1)
    s.positions[1] = s.positions[0] + torch.tensor([gap, 0.0, 0.0], dtype=s.dtype)
    s.velocities = maxwell_boltzmann(s.masses, s.ids, 60.0, seed=1)
    return s


# ------------------------------------------------------------------------------ divergence


@pytest.mark.parametrize(
    "ranks,extra",
    [
        ("1", ["--atoms", "864"]),
        ("2", ["--atoms", "864"]),  # the SIGFPE in vesin (864 atoms is the smallest box found)
        ("2", ["--atoms", "108", "--storage", "graph", "--potential", "mpnn", "--dt", "20000"]),
    ],
    ids=["halo-1", "halo-2", "graph-2"],
)
def test_diverging_md_raises_one_clear_error(capsys, ranks, extra):
    rc, err, _ = _md(capsys, ["--ranks", ranks, "--steps", "50", "--dt", "200", "--json", *extra])
    assert rc == 1 and "process died" not in err, err[-2000:]
    assert "dynamics diverged at step" in err and "smaller time step (--dt)" in err, err[-2000:]
    assert "farther than their interaction range" in err and "ids" in err


def test_diverging_run_md_raises_on_two_ranks():
    s = fcc_argon(n_atoms=864, rattle=0.05, seed=0)
    with pytest.raises(Exception, match=r"dynamics diverged at step 2: atoms jumped") as info:
        run_md(s, LennardJones(cutoff=8.5), ranks=2, steps=50, dt=200.0, initial_temperature=60.0)
    assert "process died" not in str(info.value)


def test_serial_engine_raises_the_same_error():
    s = _overlap(3.7, n_atoms=108)
    s.positions[5, 2] = float("inf")  # a broken step, as the integrator would hand it over
    engine = SerialEngine(LennardJones(cutoff=6.0), _overlap(3.7, n_atoms=108), skin=0.5)
    with pytest.raises(Diverged, match=r"non-finite positions \(rank 0: 1 atom, id 5\)"):
        engine.set_state(s.positions, s.velocities, moved=True)
    with pytest.raises(Diverged, match=r"at step 0 \(the start structure\): non-finite energy"):
        simulate(SerialEngine(LennardJones(cutoff=6.0), _overlap(0.0, 108), skin=0.5), VelocityVerlet(2.0), 1)


# ------------------------------------------------------------------------------ explosion


@pytest.mark.parametrize("ranks", ["1", "2"])
def test_atoms_03_apart_raise_the_force_bound(capsys, tmp_path, ranks):
    path = str(tmp_path / "overlap.extxyz")
    write(path, _overlap(0.3))
    rc, err, _ = _md(capsys, [path, "--ranks", ranks, "--steps", "20", "--temperature", "0", "--json", *LJ])
    assert rc == 1, err[-2000:]
    assert "dynamics diverged at step 0 (the start structure): force" in err, err[-2000:]
    assert "exceeds max_force 1e+03 eV/A" in err and "--max-force" in err
    assert "on atom 0 (rank" in err or "on atom 1 (rank" in err


def test_run_md_explosion_raises_on_two_ranks_and_bounds_are_reported():
    lj = LennardJones(cutoff=6.0)
    with pytest.raises(Exception, match=r"at step 0 \(the start structure\): force .* exceeds max_force"):
        run_md(_overlap(0.3), lj, ranks=2, steps=10, skin=0.5)
    # 2 A apart: a hard but finite collision, within the default bounds ...
    ok = run_md(_overlap(2.0), lj, ranks=2, steps=20, skin=0.5, thermo_every=5)
    assert ok.info["max_temperature"] == 1e5 and ok.info["max_force"] == 1e3
    hot = max(ok.thermo.column("temperature"))
    assert hot > 300.0  # the collision heated the box
    # ... which a user's tighter bounds catch on every rank, and 0 switches off
    with pytest.raises(Exception, match=r"at step \d+: temperature .* exceeds max_temperature 300 K"):
        run_md(_overlap(2.0), lj, ranks=2, steps=20, skin=0.5, thermo_every=5, max_temperature=300.0)
    off = run_md(
        _overlap(2.0), lj, ranks=2, steps=20, skin=0.5, thermo_every=5, max_temperature=0, max_force=0
    )
    assert off.info["max_temperature"] is None and off.info["max_force"] is None
    assert max(off.thermo.column("temperature")) == pytest.approx(hot, rel=1e-12)


def test_cli_bounds_disabled_run_and_are_in_the_json(capsys, tmp_path):
    path = str(tmp_path / "collide.extxyz")
    write(path, _overlap(2.0))
    argv = [path, "--ranks", "2", "--steps", "10", "--temperature", "0", "--json", *LJ]
    rc, err, _ = _md(capsys, argv + ["--max-force", "50"])
    assert rc == 1 and "exceeds max_force 50 eV/A" in err, err[-2000:]
    rc, err, r = _md(capsys, argv + ["--max-force", "0", "--max-temperature", "inf"])
    assert rc == 0, err[-2000:]
    assert r["max_force"] is None and r["max_temperature"] is None
    rc, err, r = _md(capsys, argv)
    assert rc == 0 and r["max_force"] == 1e3 and r["max_temperature"] == 1e5
    assert main(["md", path, "--max-force", "-1", *LJ]) == 1
    assert "max_force must be >= 0" in capsys.readouterr().err


# ------------------------------------------------------------------------------ calculator


def _coincident():
    s = fcc_argon(repeat=4, rattle=0.05, seed=3)  # 256 atoms, 21 A: two ranks fit
    s.positions[7] = s.positions[3]
    return s.to_ase()


def _calc_on_rank():
    atoms = _coincident()
    atoms.calc = TwinshardCalculator(LennardJones(cutoff=6.0))
    try:
        atoms.get_forces()
    except NonFiniteResults as exc:
        return str(exc)
    return "no error"


def test_calculator_refuses_non_finite_results():
    atoms = _coincident()
    atoms.calc = TwinshardCalculator(LennardJones(cutoff=6.0))
    with pytest.raises(NonFiniteResults, match=r"non-finite energy .*forces of atoms \[3, 7\]"):
        atoms.get_potential_energy()
    msgs = run_on_world(_calc_on_rank, 2)
    assert len(msgs) == 2 and msgs[0] == msgs[1]
    assert "forces of atoms [3, 7]" in msgs[0] and "same position" in msgs[0]
    good = fcc_argon(repeat=2, rattle=0.05, seed=3).to_ase()
    good.calc = TwinshardCalculator(LennardJones(cutoff=6.0))
    assert np.isfinite(good.get_forces()).all()
