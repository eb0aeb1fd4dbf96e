"""NPT on a batch of systems (issue 22, sections 1 and 2): four systems of different sizes in one
graph-storage run, three with their own barostat (MTK with Nose-Hoover chains; stochastic cell
rescaling, anisotropic with Langevin and triclinic without a thermostat), each at its own pressure
with its own cell ``cells[s]``, and one open molecule at constant volume (a Nose-Hoover chain);
systems drop out at their last step. At 1, 2 and 3 ranks every system equals its run alone,
serially, at round-off: positions, velocities, cell, barostat state and every thermo row (volume,
pressure and the conserved quantity included). Negative control (tools/mutations.py
``batch_barostat_swapped``): a system's barostat state swapped with another's fails the parity."""

import pytest
import torch

from twinshard.atoms import run_md
from twinshard.atoms.data import structures
from twinshard.atoms.data.system import System
from twinshard.atoms.dynamics.ensembles import integrator_for
from twinshard.atoms.dynamics.md import SerialEngine, ThermoLog, load_checkpoint, maxwell_boltzmann, simulate
from twinshard.atoms.potentials.mpnn_plain import PlainMessagePassing
from twinshard.testing import assert_parity

KW = dict(species=(18, 36), cutoff=4.0, n_features=8, n_basis=6, n_layers=2, seed=3)
SKIN = 0.4
KINDS = ["nose-hoover", "langevin", "nose-hoover", "none"]
PRESSURES = [2000.0, 500.0, None, 1000.0]
BAROSTATS = ["mtk", "scr", "mtk", "scr"]
COUPLINGS = ["iso", "aniso", "iso", "tri"]
PDAMPS = [200.0, 40.0, 1000.0, 40.0]
TEMPS = [300.0, 200.0, 150.0, 250.0]
SEEDS = [1, 2, 3, 4]
STEPS = [14, 8, 6, 14]  # systems 2 and 1 drop out while 0 and 3 continue


def make_model():
    return PlainMessagePassing(**KW)


def make_batch():
    a = structures.fcc_argon(repeat=2, rattle=0.1, seed=1)  # 32 atoms, periodic
    zs = torch.tensor([18, 36])
    b = structures.fcc_argon(repeat=2, rattle=0.2, seed=5)
    b = System(
        positions=b.positions, numbers=zs[torch.arange(32) % 2], cell=b.cell, pbc=b.pbc, ids=b.ids.flip(0) + 7
    )
    c = System(positions=a.positions[:12] + 20.0, numbers=zs[torch.arange(12) % 2])  # open
    d = structures.build("random_packing", n_atoms=20, seed=2)
    return [a, b, c, d]


def integrator(i):
    return integrator_for(
        KINDS[i],
        4.0,
        TEMPS[i],
        0.01,
        SEEDS[i],
        tdamp=40.0,
        pressure=PRESSURES[i],
        barostat=BAROSTATS[i],
        pdamp=PDAMPS[i],
        coupling=COUPLINGS[i],
    )


def _columns(i):
    return ThermoLog.NPT_COLUMNS if PRESSURES[i] is not None else ThermoLog.COLUMNS


@pytest.fixture(scope="module")
def alone():
    """Each system run alone, serially, with its own integrator (the oracle)."""
    model, out = make_model(), []
    for i, s in enumerate(make_batch()):
        st = s.clone()
        st.velocities = maxwell_boltzmann(st.masses, st.ids, TEMPS[i], seed=SEEDS[i])
        eng = SerialEngine(model, st, skin=SKIN)
        integ = integrator(i)
        run = simulate(eng, integ, STEPS[i], thermo_every=1)
        order = torch.argsort(eng.system.ids)
        out.append((eng.system.select(order), run["thermo"].rows, integ.state()))
    return out


def _run(ranks, **kw):
    args = dict(
        thermostat=KINDS, temperature=TEMPS, initial_temperature=TEMPS, seed=SEEDS, tdamp=40.0, dt=4.0
    )
    args.update(pressure=PRESSURES, barostat=BAROSTATS, coupling=COUPLINGS, pdamp=PDAMPS)
    args.update(kw)
    return run_md(make_batch(), make_model(), ranks=ranks, skin=SKIN, thermo_every=1, **args)


@pytest.mark.parametrize("ranks", [1, 2, 3])
def test_batch_npt_equals_each_system_alone(alone, ranks, tmp_path):
    ckpt = str(tmp_path / "ck.{i}.pt")
    outs = _run(ranks, steps=STEPS, checkpoint=ckpt)
    grid = str(ranks)
    assert outs[0].info["dropouts"] == [(6, 2), (8, 1)]  # (last step, system): the others continued
    for i, (out, (sys_a, rows_a, _)) in enumerate(zip(outs, alone)):
        assert [r["step"] for r in out.thermo.rows] == list(range(STEPS[i] + 1))
        for key in ("positions", "velocities", "cell"):
            assert_parity(
                getattr(out.system, key), getattr(sys_a, key), what=f"batch system {i} {key}", grid=grid
            )
        cols = _columns(i)
        got = torch.tensor([[r[c] for c in cols] for r in out.thermo.rows], dtype=torch.float64)
        want = torch.tensor([[r[c] for c in cols] for r in rows_a], dtype=torch.float64)
        for j, name in enumerate(cols):  # every row, one check per column (their scales differ)
            assert_parity(got[:, j], want[:, j], what=f"batch system {i} thermo {name}", grid=grid)
        saved = load_checkpoint(ckpt.replace("{i}", str(i)))["integrator"]
        for name in getattr(integrator(i), "dynamic", ()):  # the system's own barostat state
            t = [torch.tensor(x[name], dtype=torch.float64) for x in (saved, alone[i][2])]
            assert_parity(t[0], t[1], what=f"batch system {i} integrator {name}", grid=grid)
        if PRESSURES[i] is not None:  # anti-vacuous: every barostat moved its own cell
            vol = got[:, cols.index("volume")]
            assert float((vol / vol[0] - 1.0).abs().max()) > 5e-3, (i, vol)
            assert out.info["final_volume"] == pytest.approx(float(vol[-1]))
        else:
            assert torch.equal(out.system.cell, make_batch()[i].cell)
    if ranks > 1:  # sharding active: every rank a strict part
        owned = outs[0].info["owned_atoms_per_rank_start"]
        assert max(owned) < sum(owned) and min(owned) > 0


def test_restart_at_another_rank_count(alone, tmp_path):
    """Checkpoints (each system's barostat state and cell) after a first leg at 2 ranks, restarted
    at 3 ranks up to the full steps: equal to each system alone."""
    ckpt = str(tmp_path / "ck.{i}.pt")
    first = [7, 4, 3, 7]
    _run(2, steps=first, checkpoint=ckpt)
    outs = _run(3, steps=STEPS, restart=[ckpt.replace("{i}", str(i)) for i in range(4)])
    for i, out in enumerate(outs):
        assert out.start_step == first[i]
        for key in ("positions", "velocities", "cell"):
            assert_parity(
                getattr(out.system, key), getattr(alone[i][0], key), what=f"restarted {i} {key}", grid="2->3"
            )
        got = torch.tensor([r["conserved"] for r in out.thermo.rows], dtype=torch.float64)
        want = torch.tensor([r["conserved"] for r in alone[i][1][first[i] :]], dtype=torch.float64)
        assert_parity(got, want, what=f"restarted {i} conserved, steps {first[i]}..{STEPS[i]}", grid="2->3")


@pytest.mark.parametrize(
    "kw, msg",
    [
        (dict(pressure=[1.0, None, 1.0, None]), "periodic along all three axes"),  # the open molecule
        (dict(pressure=1.0, barostat="mtk", thermostat="langevin"), "--thermostat nose-hoover"),
        (dict(pressure=[1.0, 1.0]), "2 values for a batch of 4"),
    ],
)
def test_bad_batch_npt_input_raises(kw, msg):
    with pytest.raises(Exception, match=msg):
        _run(2, steps=2, **kw)


def test_md_cli_batch_pressure(capsys):
    """``twinshard md --batch A,B --pressure 2000 --barostat scr`` (2 ranks): every system its own
    barostat; each system's final volume equals its ``twinshard md --storage graph`` run alone."""
    import json

    from twinshard.cli import main

    base = "--potential mpnn --cutoff 4.0 --atoms 32 --thermostat langevin --temperature 300 --seed 2"
    base += " --dt 4 --pressure 2000 --barostat scr --pdamp 40 --json"
    assert main(f"md --batch fcc_argon,random_packing --steps 6,4 --ranks 2 {base}".split()) == 0
    batch = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    for i, (name, steps) in enumerate((("fcc_argon", 6), ("random_packing", 4))):
        assert main(f"md {name} --storage graph --steps {steps} --ranks 1 {base}".split()) == 0
        alone = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
        got = batch["systems"][i]
        for key in ("final_volume", "final_potential", "conserved_drift"):
            assert abs(got[key] - alone[key]) <= 1e-10 * max(1.0, abs(alone[key])), (name, key)
