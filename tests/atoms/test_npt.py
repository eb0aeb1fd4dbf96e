"""NPT (issue 22): the isotropic MTK barostat with Nose-Hoover chains. The serial integrator equals
ASE's ``IsotropicMTKNPT`` (an outside oracle) step by step; under halo decomposition on 1, 2 and 4
ranks it equals the serial run at round-off (every thermo row: volume, pressure and the conserved
quantity included; the final positions, velocities, cell and barostat variables), while the box
breathes, the partition follows it and atoms migrate; a run restarted at another rank count equals
the uninterrupted one (the barostat is in the checkpoint); ``twinshard md --pressure``. Bad input
raises on every rank. Negative controls: the barostat's virial not all-reduced, the new cell set
on rank 0 only (parity fails)."""

import json

import numpy as np
import pytest
import torch
import torch.distributed as dist
from _planted import planted
from ase import units

from twinshard.atoms import run_md
from twinshard.atoms.data.structures import fcc_argon, random_packing
from twinshard.atoms.dynamics.driver import DistributedEngine
from twinshard.atoms.dynamics.md import (
    IsotropicMTK,
    NoseHooverChain,
    SerialEngine,
    ThermoLog,
    check_restart,
    checkpoint_state,
    load_checkpoint,
    maxwell_boltzmann,
    simulate,
)
from twinshard.atoms.parallel.distributed import DistributedPotential
from twinshard.atoms.parallel.sharded import ShardedSystem
from twinshard.atoms.potentials import LennardJones
from twinshard.cli import main
from twinshard.runtime.errors import RankFailure
from twinshard.testing import assert_parity, assert_shards_cover, rows_of, run_on_world

CUTOFF, SKIN, STEPS = 5.0, 0.6, 40
# a hot liquid (160 atoms from 200 K) at 400 K and 2000 bar with a fast barostat (pdamp 100 fs):
# the volume moves by a few percent within 40 steps and atoms migrate on 2 and 4 ranks
NPT = dict(dt=4.0, temperature=400.0, pressure=2000.0, tdamp=40.0, pdamp=100.0)
COLUMNS = ThermoLog.NPT_COLUMNS
NPT_CHAIN = 3  # both chains' default length


def _start():
    s = random_packing(160, seed=1)
    s.velocities = maxwell_boltzmann(s.masses, s.ids, 200.0, seed=1)
    return s


def _table(log: ThermoLog) -> torch.Tensor:
    return torch.tensor([[row[c] for c in COLUMNS] for row in log.rows], dtype=torch.float64)


def _baro(integ: IsotropicMTK) -> torch.Tensor:
    return torch.tensor(integ.eta + integ.p_eta + integ.xi + integ.p_xi + integ.eps + integ.p_eps)


# ------------------------------------------------------------------ serial: the outside oracle


@pytest.mark.parametrize(
    ("pressure", "chains", "loops"), [(1000.0, (3, 3), (1, 1)), (-200.0, (4, 2), (2, 2))]
)
def test_serial_equals_ase_isotropic_mtk(pressure, chains, loops):
    """108 atoms of fcc argon (60 -> 120 K), 20 steps, against ASE's IsotropicMTKNPT driving the
    same LJ model through twinshard's ASE calculator (so only the integrators differ)."""
    from ase.md.nose_hoover_chain import IsotropicMTKNPT

    from twinshard.atoms.calculator import TwinshardCalculator

    s = fcc_argon(3, rattle=0.05, seed=1)
    s.velocities = maxwell_boltzmann(s.masses, s.ids, 60.0, seed=1)
    lj, steps = LennardJones(cutoff=6.0), 20
    kw = dict(tdamp=40.0, pdamp=200.0)
    integ = IsotropicMTK(
        4.0, 120.0, pressure, **kw, chain=chains[0], pchain=chains[1], tloop=loops[0], ploop=loops[1]
    )
    engine = SerialEngine(lj, s, skin=1.0)
    log = simulate(engine, integ, steps)["thermo"]
    cols = {k: torch.tensor(log.column(k), dtype=torch.float64) for k in ("conserved", "volume", "pressure")}

    atoms = s.to_ase()
    atoms.calc = TwinshardCalculator(lj)
    md = IsotropicMTKNPT(
        atoms,
        timestep=4.0 * units.fs,
        temperature_K=120.0,
        pressure_au=pressure * units.bar,
        tdamp=40.0 * units.fs,
        pdamp=200.0 * units.fs,
        tchain=chains[0],
        pchain=chains[1],
        tloop=loops[0],
        ploop=loops[1],
    )

    def sample():
        p = -np.trace(atoms.get_stress(voigt=False, include_ideal_gas=True)) / 3 / units.bar
        return md.get_conserved_energy(), atoms.get_volume(), p

    got = [sample()]
    for _ in range(steps):
        md.run(1)
        got.append(sample())
    ref_cols = torch.tensor(got, dtype=torch.float64).T
    # As for the NVT chain (test_nose_hoover): two summation orders (ASE recomputes sum p^2/m
    # after each chain scaling and works in momenta; its volume is det(cell), ours V0 exp(3 eps)),
    # measured ~1e-15 relative, grown over 20 steps far below the Lyapunov time: 1e-10 x scale.
    why = "rounding of two summation orders grown over 20 steps: 1e-10 x scale (measured ~1e-15)"
    ref = {
        "positions": torch.from_numpy(atoms.get_positions()),
        "velocities": torch.from_numpy(atoms.get_velocities()),
        "cell": torch.from_numpy(np.asarray(atoms.get_cell())),
        "conserved": ref_cols[0],
        "volume": ref_cols[1],
        "pressure": ref_cols[2],
    }
    ours = {
        "positions": engine.system.positions,
        "velocities": engine.system.velocities,
        "cell": engine.system.cell,
        **cols,
    }
    for key in ref:
        tol = 1e-10 * float(ref[key].abs().max())
        assert_parity(
            ours[key], ref[key], what=f"MTK vs ASE {key}", grid="serial", rtol=0.0, atol=tol, why=why
        )
    b = md._barostat
    want = torch.tensor([*b._xi, *b._p_xi, md._eps, md._p_eps], dtype=torch.float64)
    have = torch.tensor(integ.xi + integ.p_xi + integ.eps + integ.p_eps, dtype=torch.float64)
    tol = 1e-10 * float(want.abs().max())
    assert_parity(
        have, want, what="MTK vs ASE xi, p_xi, eps, p_eps", grid="serial", rtol=0.0, atol=tol, why=why
    )
    # anti-vacuous: the box moved (by far more than the tolerance) and the barostat's chain acted
    assert abs(float(cols["volume"][-1] / cols["volume"][0]) - 1.0) > 1e-3
    assert min(abs(v) for v in integ.p_xi) > 0


def test_state_settings_and_barostat_in_checkpoints():
    integ = IsotropicMTK(2.0, 300.0, 100.0, pchain=2)
    assert integ.pdamp_fs == 2000.0 and integ.tdamp_fs == 200.0  # 1000 dt and 100 dt
    integ.load_state(
        {**integ.state(), "eps": [0.01], "p_eps": [0.5], "cell0": [10.0, 0, 0, 0, 10, 0, 0, 0, 10]}
    )
    state = checkpoint_state(random_packing(20, seed=3), 7, integ, -0.25)
    assert state["integrator"]["eps"] == [0.01] and state["integrator"]["cell0"][0] == 10.0
    check_restart(state, IsotropicMTK(2.0, 300.0, 100.0, pchain=2))  # the variables are not settings
    for other, match in [
        (IsotropicMTK(2.0, 300.0, 200.0, pchain=2), "pressure_bar: checkpoint 100.0, now 200.0"),
        (IsotropicMTK(2.0, 300.0, 100.0, pdamp=50.0, pchain=2), "pdamp_fs: checkpoint 2000.0, now 50.0"),
        (NoseHooverChain(2.0, 300.0), "kind: checkpoint 'npt-mtk', now 'nose-hoover'"),
    ]:
        with pytest.raises(ValueError, match=match):
            check_restart(state, other)
    with pytest.raises(ValueError, match="no MTK barostat state"):
        IsotropicMTK(2.0, 300.0).load_state(NoseHooverChain(2.0, 300.0).state())
    for bad, match in [
        (dict(pdamp=-10.0), "pressure coupling time pdamp must be > 0"),
        (dict(temperature=0.0), "temperature > 0"),
    ]:
        with pytest.raises(ValueError, match=match):
            IsotropicMTK(**{"dt": 2.0, "temperature": 300.0, **bad})


def _rank_open_axis():
    s = None
    if dist.get_rank() == 0:
        s = random_packing(60, seed=2)
        s.pbc = torch.tensor([True, True, False])
    sh = ShardedSystem.scatter(s, cutoff=CUTOFF, skin=SKIN)
    engine = DistributedEngine(sh, DistributedPotential(LennardJones(cutoff=CUTOFF)))
    try:
        simulate(engine, IsotropicMTK(**NPT), 2)
    except ValueError as exc:
        return str(exc)
    return None


def test_open_axis_raises_on_every_rank():
    msgs = run_on_world(_rank_open_axis, 2)
    assert all(m is not None and "periodic along all three axes" in m for m in msgs), msgs


# ------------------------------------------------------------------ distributed == serial


def _rank_md(plant=None):
    with planted(plant):
        s = _start() if dist.get_rank() == 0 else None
        grid = (2, 2, 1) if dist.get_world_size() == 4 else None  # more faces than slabs
        sh = ShardedSystem.scatter(s, cutoff=CUTOFF, skin=SKIN, grid=grid)
        engine = DistributedEngine(sh, DistributedPotential(LennardJones(cutoff=CUTOFF)))
        integ = IsotropicMTK(**NPT)
        out = simulate(engine, integ, STEPS)
    return {
        "thermo": _table(out["thermo"]),
        "baro": _baro(integ),
        "cell": sh.cell.clone(),
        "partition_cell": sh.partition.cell.clone(),
        "ids": sh.ids,
        "positions": sh.positions,
        "velocities": sh.velocities,
        "migrations": sh.migrations,
        "builds": sh.builds,
    }


_SERIAL = []


def _serial():
    if not _SERIAL:
        engine = SerialEngine(LennardJones(cutoff=CUTOFF), _start(), skin=SKIN)
        integ = IsotropicMTK(**NPT)
        out = simulate(engine, integ, STEPS)
        _SERIAL.append((_table(out["thermo"]), _baro(integ), engine.system))
    return _SERIAL[0]


def _check(res):
    thermo, baro, final = _serial()
    where, grid = f"npt P={len(res)}, {STEPS} steps", str(len(res))
    for j, name in enumerate(COLUMNS):  # every row: step 0, 1, ..., STEPS
        assert_parity(
            res[0]["thermo"][:, j], thermo[:, j], what=f"thermo {name} per step, {where}", grid=grid
        )
    for key in ("positions", "velocities"):
        pieces = [(r[key], rows_of(r["ids"], final.ids)) for r in res]
        assert_shards_cover(pieces, getattr(final, key), f"final owned {key} {where}", disjoint=len(res) > 1)
    for r in res:
        assert_parity(r["cell"], final.cell, what=f"cell, {where}", grid=grid)
    # one check per variable: their scales differ by many orders (p_eps ~ W / pdamp is huge)
    names = ("eta", "p_eta", "xi", "p_xi", "eps", "p_eps")
    sizes = (NPT_CHAIN, NPT_CHAIN, NPT_CHAIN, NPT_CHAIN, 1, 1)
    for name, got, want in zip(names, res[0]["baro"].split(sizes), baro.split(sizes), strict=True):
        assert_parity(got, want, what=f"barostat {name}, {where}", grid=grid)


@pytest.mark.parametrize("ranks", [1, 2, 4])
def test_npt_equals_serial_at_round_off(ranks):
    res = run_on_world(_rank_md, ranks)
    _check(res)  # parity first: a wrong trajectory is reported as such
    for r in res[1:]:  # global values, cell and barostat: identical on every rank
        assert torch.equal(r["thermo"], res[0]["thermo"]) and torch.equal(r["baro"], res[0]["baro"])
        assert torch.equal(r["cell"], res[0]["cell"])
    for r in res:  # the partition follows the cell
        assert torch.equal(r["partition_cell"], r["cell"].to(r["partition_cell"].dtype))
        assert r["builds"] >= 1  # (the rebuild rule under a changing cell: test_npt_rebuild.py)
    thermo = res[0]["thermo"]
    vol, cons, e = thermo[:, 6], thermo[:, 5], thermo[:, 2] + thermo[:, 3]
    # anti-vacuous: the box breathed; the extended energy drifted far less than the energy moved
    assert abs(float(vol[-1] / vol[0]) - 1.0) > 0.01, vol
    assert float((cons - cons[0]).abs().max()) < 0.05 * float((e - e[0]).abs().max())
    if ranks > 1:
        assert res[0]["migrations"] > 0, "no atom changed owner: this run does not exercise migration"


@pytest.mark.parametrize("plant", ["npt_virial_local", "npt_cell_one_rank"])
def test_planted_barostat_bugs_are_caught(plant):
    """Caught by parity, or (a cell on one rank only: its halo images then sit at the old cell's
    lattice vectors, too close to the scaled atoms) by the run failing on every rank."""
    try:
        res = run_on_world(_rank_md, 2, plant)
    except RankFailure as exc:
        assert plant == "npt_cell_one_rank", exc
        return
    with pytest.raises(AssertionError, match=r"parity of .* npt P=2, 40 steps on grid .* fails"):
        _check(res)


# ------------------------------------------------------------------ restart, run_md, the CLI


def test_restart_at_another_rank_count_equals_the_uninterrupted_run(tmp_path):
    """run_md: 40 steps on 4 ranks vs 20 on 4, checkpoint, 20 more on 2 (thermo file appended);
    the barostat, both chains and the reference cell restored."""
    full_ck, ck, end_ck, log = (
        tmp_path / "full.pt",
        tmp_path / "ck.pt",
        tmp_path / "end.pt",
        tmp_path / "t.log",
    )
    lj = LennardJones(cutoff=CUTOFF)
    kw = dict(thermostat="nose-hoover", dt=4.0, temperature=400.0, pressure=2000.0, tdamp=40.0, pdamp=100.0)
    kw.update(skin=SKIN, thermo_every=5)
    full = run_md(_start(), lj, ranks=4, steps=40, checkpoint=full_ck, **kw)
    run_md(_start(), lj, ranks=4, steps=20, checkpoint=ck, thermo=log, **kw)
    saved = load_checkpoint(ck)["integrator"]
    assert saved["kind"] == "npt-mtk" and abs(saved["eps"][0]) > 1e-3 and abs(saved["p_xi"][0]) > 0
    second = run_md(None, lj, ranks=2, steps=40, restart=ck, checkpoint=end_ck, thermo=log, **kw)
    assert second.start_step == 20 and second.ranks == 2
    grid = "4->2"
    for key in ("positions", "velocities", "cell"):
        assert_parity(getattr(second.system, key), getattr(full.system, key), what=f"NPT {key}", grid=grid)
    rows = [_table(r.thermo) for r in (full, second)]
    assert torch.equal(rows[0][4:, 0], rows[1][:, 0])  # steps 20, 25, ..., 40
    for j, name in enumerate(COLUMNS[2:], 2):
        assert_parity(rows[1][:, j], rows[0][4:, j], what=f"NPT thermo {name}, steps 20..40", grid=grid)
    a, b = load_checkpoint(full_ck)["integrator"], load_checkpoint(end_ck)["integrator"]
    for k in IsotropicMTK.dynamic:
        t = [torch.tensor(x[k], dtype=torch.float64) for x in (b, a)]
        assert_parity(t[0], t[1], what=f"NPT barostat {k}", grid=grid)
    text = log.read_text().splitlines()  # one header, rows 0..40 every 5, 8 columns
    assert text[0].split()[1:] == list(COLUMNS) and len(text) == 1 + 9
    assert all(len(line.split()) == len(COLUMNS) for line in text[1:])
    assert full.info["final_volume"] == pytest.approx(float(full.thermo.rows[-1]["volume"]))
    assert second.info["final_volume"] == pytest.approx(
        abs(float(torch.linalg.det(full.system.cell))), rel=1e-12
    )


def test_cli_pressure_check_serial_and_json(capsys):
    """``twinshard md --thermostat nose-hoover --pressure 2000 --ranks 2 --check-serial --json``."""
    argv = "md random_packing --atoms 160 --cutoff 5 --skin 0.6 --temperature 400 --dt 4 --seed 1"
    argv += " --thermostat nose-hoover --tdamp 40 --pressure 2000 --pdamp 100 --steps 20"
    argv += " --check-serial --json --thermo-every 5 --ranks 2"
    assert main(argv.split()) == 0
    r = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert r["pressure"] == 2000.0 and r["barostat"] == "mtk" and r["atoms_conserved"]
    assert r["energy_rel_error"] <= 1e-12 and r["max_position_error"] <= 1e-9, r
    assert r["final_volume"] > 0 and isinstance(r["mean_pressure"], float)
    for bad, match in [
        (" --pdamp -5", "pdamp must be > 0"),
        (" --thermostat langevin", "--thermostat nose-hoover"),
    ]:
        assert main((argv + bad).split()) != 0  # the error on every rank, reported once
        assert match in capsys.readouterr().err
