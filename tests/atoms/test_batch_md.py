"""MD on a batch of systems (issue 22, section 2; ``atoms.dynamics.batch``): four systems of
different sizes (periodic, open, another periodic, a random packing) with their own integrators
(Langevin, Nose-Hoover chains at two temperatures, NVE), seeds and end steps in one graph-storage
run at 1, 2 and 4 ranks; every system equals its run alone serially (positions, velocities, every
thermo row incl. the conserved quantity) at round-off. Systems drop out at their last step while
the others continue. The per-system thermo files are the single-system format; a batch checkpointed
at 2 ranks and restarted at 4 equals the uninterrupted batch. Bad input raises a clear error.
Negative control (tools/mutations.py ``batch_thermostat_swapped``): a system's Nose-Hoover chain
swapped with another's fails the parity."""

import json

import pytest
import torch

from twinshard.atoms import run_md
from twinshard.atoms.data import structures
from twinshard.atoms.data.system import System
from twinshard.atoms.dynamics.batch import per_system_paths
from twinshard.atoms.dynamics.md import (
    Langevin,
    NoseHooverChain,
    SerialEngine,
    VelocityVerlet,
    maxwell_boltzmann,
    simulate,
)
from twinshard.atoms.potentials import LennardJones
from twinshard.atoms.potentials.mpnn_plain import PlainMessagePassing
from twinshard.testing import assert_parity

KW = dict(species=(18, 36), cutoff=4.0, n_features=8, n_basis=6, n_layers=2, seed=3)
SKIN = 0.3
THERMO = ("temperature", "potential", "kinetic", "conserved")
KINDS = ["langevin", "nose-hoover", "none", "nose-hoover"]
TEMPS = [100.0, 300.0, 200.0, 150.0]
SEEDS = [1, 2, 3, 4]
STEPS = [6, 4, 3, 6]  # systems 2 and 1 drop out while 0 and 3 continue


def make_model():
    return PlainMessagePassing(**KW)


def make_batch():
    a = structures.fcc_argon(repeat=2, rattle=0.25, seed=1)  # 32 atoms, periodic
    zs = torch.tensor([18, 36])
    a.numbers = zs[torch.arange(a.n_atoms) % 2]
    b = System(positions=a.positions[:12] + 20.0, numbers=zs[torch.arange(12) % 2])  # open
    c = structures.fcc_argon(repeat=2, rattle=0.2, seed=5)
    c = System(positions=c.positions, numbers=c.numbers, cell=c.cell, pbc=c.pbc, ids=c.ids.flip(0) + 7)
    d = structures.build("random_packing", n_atoms=20, seed=2)
    return [a, b, c, d]


def integrator(i):
    if KINDS[i] == "langevin":
        return Langevin(2.0, TEMPS[i], 0.01, seed=SEEDS[i])
    if KINDS[i] == "nose-hoover":
        return NoseHooverChain(2.0, TEMPS[i], tdamp=40.0)
    return VelocityVerlet(2.0)


@pytest.fixture(scope="module")
def alone():
    """Each system run alone, serially, with its own integrator (the oracle)."""
    model, out = make_model(), []
    for i, s in enumerate(make_batch()):
        st = s.clone()
        st.velocities = maxwell_boltzmann(st.masses, st.ids, TEMPS[i], seed=SEEDS[i])
        eng = SerialEngine(model, st, skin=SKIN)
        run = simulate(eng, integrator(i), STEPS[i], thermo_every=1)
        order = torch.argsort(eng.system.ids)
        out.append((eng.system.select(order), run["thermo"].rows))
    return out


def _run(ranks, **kw):
    args = dict(thermostat=KINDS, temperature=TEMPS, initial_temperature=TEMPS, seed=SEEDS, tdamp=40.0)
    args.update(kw)
    return run_md(make_batch(), make_model(), ranks=ranks, skin=SKIN, thermo_every=1, **args)


def _check(outs, alone, grid, steps=STEPS):
    assert len(outs) == len(alone)
    for i, (out, (sys_a, rows_a)) in enumerate(zip(outs, alone)):
        assert out.steps == steps[i] and [r["step"] for r in out.thermo.rows] == list(range(steps[i] + 1))
        moved = float(
            (out.system.positions - make_batch()[i].positions[torch.argsort(make_batch()[i].ids)]).abs().max()
        )
        assert moved > 1e-3, "the system did not move: a vacuous comparison"
        for key in ("positions", "velocities"):
            assert_parity(
                getattr(out.system, key), getattr(sys_a, key), what=f"batch system {i} {key}", grid=grid
            )
        got = torch.tensor([[r[c] for c in THERMO] for r in out.thermo.rows], dtype=torch.float64)
        want = torch.tensor([[r[c] for c in THERMO] for r in rows_a], dtype=torch.float64)
        assert_parity(got, want, what=f"batch system {i} thermo rows", grid=grid)


@pytest.mark.parametrize("ranks", [1, 2, 4])
def test_batch_equals_each_system_alone(alone, ranks):
    outs = _run(ranks, steps=STEPS)
    _check(outs, alone, grid=str(ranks))
    info = outs[0].info
    assert info["dropouts"] == [(3, 2), (4, 1)]  # (last step, system): the others continued
    owned = info["owned_atoms_per_rank_start"]
    assert sum(owned) == sum(s.n_atoms for s in make_batch()) and len(owned) == ranks
    if ranks > 1:  # sharding active: every rank a strict part
        assert max(owned) < sum(owned)
    # the final evaluation: each system's own energy and forces at its final state
    model = make_model()
    from twinshard.atoms.parallel.plain_inputs import evaluate_plain

    for i, out in enumerate(outs):
        ref = evaluate_plain(model, alone[i][0])
        assert_parity(out.forces, ref.forces, what=f"batch system {i} final forces", grid=str(ranks))
        assert abs(out.energy - float(ref.energy)) <= 1e-12 * max(1.0, abs(float(ref.energy)))
    assert outs[1].stress is None and outs[0].stress is not None  # the open system has no volume


def test_thermo_files_and_restart_at_another_rank_count(alone, tmp_path):
    """Per-system thermo files in the single-system format; checkpoints at each system's end of a
    first leg at 2 ranks, restarted at 4 ranks up to the full steps: equal to the oracle."""
    thermo, ckpt = str(tmp_path / "thermo.{i}.log"), str(tmp_path / "ckpt.{i}.pt")
    first = [3, 2, 3, 3]
    _run(2, steps=first, thermo=thermo, checkpoint=ckpt)
    outs = _run(4, steps=STEPS, thermo=thermo, restart=per_system_paths(ckpt, 4, "checkpoint"))
    for i, out in enumerate(outs):
        assert out.start_step == first[i]
        assert [r["step"] for r in out.thermo.rows] == list(range(first[i], STEPS[i] + 1))
        for key in ("positions", "velocities"):
            assert_parity(
                getattr(out.system, key), getattr(alone[i][0], key), what=f"restarted {i} {key}", grid="2->4"
            )
        lines = open(thermo.replace("{i}", str(i))).read().splitlines()
        assert lines[0].startswith("# step time_fs potential kinetic temperature conserved")
        rows = torch.tensor([[float(x) for x in ln.split()] for ln in lines[1:]], dtype=torch.float64)
        want = torch.tensor(
            [[r["step"], r["potential"], r["conserved"]] for r in alone[i][1]], dtype=torch.float64
        )
        assert rows.shape[0] == STEPS[i] + 1  # each row once: the restart appended after the checkpoint's row
        assert torch.allclose(rows[:, [0, 2, 5]], want, rtol=1e-11, atol=1e-12)  # 12 significant digits


@pytest.mark.parametrize(
    "kw, msg",
    [
        (dict(system=[]), "empty list of systems"),
        (dict(potential="list"), "one potential"),
        (dict(potential="lj"), "Graph contract"),
        (dict(steps=[3, 3]), "2 values for a batch of 4"),
        (dict(thermo="thermo.log"), r"holding \{i\}"),
        (dict(pressure=1.0), "--thermostat nose-hoover"),  # MTK (the default) with Langevin
        (dict(restart=["missing.pt"] * 4), "does not exist"),
    ],
)
def test_bad_batch_input_raises(kw, msg):
    model = make_model()
    system = kw.pop("system", make_batch())
    pot = kw.pop("potential", None)
    pot = {"list": [model, model], "lj": LennardJones(cutoff=4.0), None: model}[pot]
    with pytest.raises(Exception, match=msg):
        run_md(system, pot, ranks=2, steps=kw.pop("steps", 2), **kw)


def test_md_cli_batch_equals_each_alone(capsys, tmp_path):
    """``twinshard md --batch A,B --steps 5,3`` (2 ranks, Langevin) against ``twinshard md A`` alone
    (graph storage, 1 rank): each system's final potential, temperature and conserved drift; one
    thermo file per system."""
    from twinshard.cli import main

    base = "--potential mpnn --cutoff 4.0 --atoms 32 --thermostat langevin --temperature 100 --seed 2 --json"
    thermo = str(tmp_path / "t.{i}.log")
    assert (
        main(f"md --batch fcc_argon,random_packing --steps 5,3 --ranks 2 --thermo {thermo} {base}".split())
        == 0
    )
    batch = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert batch["dropouts"] == [[3, 1]] and batch["owned_atoms_per_rank_start"] == [32, 32]
    for i, (name, steps) in enumerate((("fcc_argon", 5), ("random_packing", 3))):
        assert (
            main(f"md {name} --storage graph --steps {steps} --ranks 1 --thermo-every 10 {base}".split()) == 0
        )
        alone = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
        got = batch["systems"][i]
        for key in ("final_potential", "final_temperature", "conserved_drift"):
            assert abs(got[key] - alone[key]) <= 1e-10 * max(1.0, abs(alone[key])), (name, key)
        assert len(open(thermo.replace("{i}", str(i))).read().splitlines()) == 3  # header, step 0, last step
