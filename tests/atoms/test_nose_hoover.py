"""Nose-Hoover chain NVT (issue 22): the serial integrator equals ASE's ``NoseHooverChainNVT``
(an outside oracle), holds its extended energy and the bath temperature; a 2- and 4-rank run
under halo decomposition equals the serial run at round-off (every thermo row, the conserved
quantity included, the final positions and velocities, the chain variables); a run restarted at
another rank count equals the uninterrupted one (the chain is in the checkpoint); ``twinshard md
--thermostat nose-hoover`` with ``--check-serial``. Negative controls: the chain driven by the
local kinetic energy (parity fails), a restart with the chain zeroed (differs)."""

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
    Langevin,
    NoseHooverChain,
    SerialEngine,
    ThermoLog,
    VelocityVerlet,
    check_restart,
    checkpoint_state,
    load_checkpoint,
    maxwell_boltzmann,
    save_checkpoint,
    simulate,
)
from twinshard.atoms.parallel.distributed import DistributedPotential
from twinshard.atoms.parallel.sharded import ShardedSystem
from twinshard.atoms.potentials import LennardJones
from twinshard.cli import main
from twinshard.testing import assert_parity, assert_shards_cover, rows_of, run_on_world

CUTOFF, SKIN, STEPS = 5.0, 0.6, 40
# a hot liquid (160 atoms from 200 K) under a strong bath (400 K, tdamp 40 fs = 10 steps): the
# chain doubles the kinetic energy within 40 steps, and atoms migrate on 2 and 4 ranks
NHC = dict(dt=4.0, temperature=400.0, tdamp=40.0, chain=3)


def _start():
    s = random_packing(160, seed=1)
    s.velocities = maxwell_boltzmann(s.masses, s.ids, 200.0, seed=1)
    return s


def _table(log: ThermoLog) -> torch.Tensor:
    return torch.tensor([[row[c] for c in ThermoLog.COLUMNS] for row in log.rows], dtype=torch.float64)


def _chain(integ: NoseHooverChain) -> torch.Tensor:
    return torch.tensor([integ.eta, integ.p_eta], dtype=torch.float64)


# ------------------------------------------------------------------ serial: the outside oracle


@pytest.mark.parametrize(("chain", "tloop"), [(3, 1), (4, 2)])
def test_serial_equals_ase_nose_hoover_chain(chain, tloop):
    """108 atoms of fcc argon (60 -> 120 K), 20 steps, against ASE's NoseHooverChainNVT driving the
    same LJ model through twinshard's ASE calculator (so only the integrators differ)."""
    from ase.md.nose_hoover_chain import NoseHooverChainNVT

    from twinshard.atoms.calculator import TwinshardCalculator

    s = fcc_argon(3, rattle=0.05, seed=1)
    s.velocities = maxwell_boltzmann(s.masses, s.ids, 60.0, seed=1)
    lj, steps = LennardJones(cutoff=6.0), 20
    integ = NoseHooverChain(4.0, 120.0, tdamp=40.0, chain=chain, tloop=tloop)
    engine = SerialEngine(lj, s, skin=1.0)
    conserved = torch.tensor(
        simulate(engine, integ, steps)["thermo"].column("conserved"), dtype=torch.float64
    )

    atoms = s.to_ase()
    atoms.calc = TwinshardCalculator(lj)
    md = NoseHooverChainNVT(
        atoms, timestep=4.0 * units.fs, temperature_K=120.0, tdamp=40.0 * units.fs, tchain=chain, tloop=tloop
    )
    ase_conserved = [md.get_conserved_energy()]
    for _ in range(steps):
        md.run(1)
        ase_conserved.append(md.get_conserved_energy())
    # The two differ only in rounding: ASE recomputes sum p^2/m after each chain scaling where we
    # scale the sum (relative 1e-16 x sqrt(N)), and converts p = m v. Measured: 2e-15 A, 1e-16
    # A/fs, 3e-15 eV. Over 20 steps (80 fs, far below the ps Lyapunov time of LJ argon) that
    # rounding grows by orders of magnitude at most: 1e-10 x scale leaves >= 1e4 of margin and is
    # 1e-6 of the thermostat's own effect (checked below), so an operator in the wrong order, a
    # mass convention off by a factor or N_dof = 3N - 3 fails it.
    why = "rounding of two summation orders grown over 20 steps: 1e-10 x scale (measured ~1e-15)"
    x = torch.from_numpy(atoms.get_positions())
    v = torch.from_numpy(atoms.get_velocities())
    ref = {"positions": x, "velocities": v, "conserved": torch.tensor(ase_conserved, dtype=torch.float64)}
    ours = {
        "positions": engine.system.positions,
        "velocities": engine.system.velocities,
        "conserved": conserved,
    }
    for key in ref:
        tol = 1e-10 * float(ref[key].abs().max())
        assert_parity(
            ours[key], ref[key], what=f"NHC vs ASE {key}", grid="serial", rtol=0.0, atol=tol, why=why
        )
    th = md._thermostat  # the chain itself (ASE's private state: the oracle's internals)
    for name in ("eta", "p_eta"):
        want = torch.from_numpy(np.asarray(getattr(th, f"_{name}")))
        got = torch.tensor(getattr(integ, name), dtype=torch.float64)
        tol = 1e-10 * float(want.abs().max())
        assert_parity(got, want, what=f"NHC vs ASE {name}", grid="serial", rtol=0.0, atol=tol, why=why)
    # anti-vacuous: the thermostat acted (velocity Verlet from the same start ends far away)
    nve = SerialEngine(lj, s, skin=1.0)
    simulate(nve, VelocityVerlet(4.0), steps)
    assert float((nve.system.velocities - v).abs().max()) > 1e-4 * float(v.abs().max())


def test_extended_energy_is_conserved_and_the_bath_temperature_reached():
    """500 steps (2 ps) of 108 atoms: the extended energy drifts by far less than the energy the
    bath moved, and the mean temperature of the second half is the bath's within its error."""
    s = fcc_argon(3, rattle=0.05, seed=2)
    s.velocities = maxwell_boltzmann(s.masses, s.ids, 40.0, seed=2)
    out = simulate(SerialEngine(LennardJones(cutoff=6.0), s), NoseHooverChain(4.0, 80.0, tdamp=100.0), 500)
    col = {k: torch.tensor(out["thermo"].column(k), dtype=torch.float64) for k in ThermoLog.COLUMNS}
    e = col["potential"] + col["kinetic"]
    drift = float((col["conserved"] - col["conserved"][0]).abs().max())
    assert drift < 1e-3 * float((e - e[0]).abs().max()), drift
    # T of 108 atoms fluctuates by sqrt(2 / 324) = 8% per sample; the 250 samples of the second
    # half are correlated over ~tdamp = 25 steps: ~10 independent ones, so the mean's error is
    # ~2.5% (2 K); 8 K is over 3 of those
    assert abs(float(col["temperature"][250:].mean()) - 80.0) < 8.0


def test_state_settings_and_chain_in_checkpoints():
    integ = NoseHooverChain(2.0, 300.0, chain=4)
    assert integ.tdamp_fs == 200.0 and integ.state()["eta"] == [0.0] * 4  # tdamp defaults to 100 dt
    integ.load_state({"eta": [1.0, 2.0, 3.0, 4.0], "p_eta": [0.5, 0.0, -0.5, 1.0]})
    s = random_packing(20, seed=3)
    state = checkpoint_state(s, 7, integ, -0.25)
    assert state["integrator"]["eta"] == [1.0, 2.0, 3.0, 4.0]
    check_restart(state, NoseHooverChain(2.0, 300.0, chain=4))  # the chain is not a setting
    for other, match in [
        (NoseHooverChain(2.0, 300.0, tdamp=100.0, chain=4), "tdamp_fs: checkpoint 200.0, now 100.0"),
        (NoseHooverChain(2.0, 300.0, chain=3), "chain: checkpoint 4, now 3"),
        (Langevin(2.0, 300.0), "kind: checkpoint 'nose-hoover', now 'langevin'"),
    ]:
        with pytest.raises(ValueError, match=match):
            check_restart(state, other)
    with pytest.raises(ValueError, match="no Nose-Hoover chain of length 4"):
        NoseHooverChain(2.0, 300.0, chain=4).load_state(Langevin(2.0).state())
    with pytest.raises(ValueError, match="tdamp"):
        NoseHooverChain(2.0, 300.0, tdamp=0.0)


# ------------------------------------------------------------------ distributed == serial


def _rank_md(plant=None):
    with planted(plant):
        s = _start() if dist.get_rank() == 0 else None
        grid = (2, 2, 1) if dist.get_world_size() == 4 else None  # more faces than slabs
        sh = ShardedSystem.scatter(s, cutoff=CUTOFF, skin=SKIN, grid=grid)
        engine = DistributedEngine(sh, DistributedPotential(LennardJones(cutoff=CUTOFF)))
        integ = NoseHooverChain(**NHC)
        out = simulate(engine, integ, STEPS)
    return {
        "thermo": _table(out["thermo"]),
        "chain": _chain(integ),
        "ids": sh.ids,
        "positions": sh.positions,
        "velocities": sh.velocities,
        "migrations": sh.migrations,
    }


_SERIAL = []


def _serial():
    if not _SERIAL:
        engine = SerialEngine(LennardJones(cutoff=CUTOFF), _start(), skin=SKIN)
        integ = NoseHooverChain(**NHC)
        out = simulate(engine, integ, STEPS)
        _SERIAL.append((_table(out["thermo"]), _chain(integ), engine.system))
    return _SERIAL[0]


def _check(res):
    thermo, chain, final = _serial()
    where, grid = f"nose-hoover P={len(res)}, {STEPS} steps", str(len(res))
    for j, name in enumerate(ThermoLog.COLUMNS):  # every row: step 0, 1, ..., STEPS
        assert_parity(
            res[0]["thermo"][:, j], thermo[:, j], what=f"thermo {name} per step, {where}", grid=grid
        )
    for key in ("positions", "velocities"):
        pieces = [(r[key], rows_of(r["ids"], final.ids)) for r in res]
        assert_shards_cover(pieces, getattr(final, key), f"final owned {key} {where}", disjoint=True)
    assert_parity(res[0]["chain"], chain, what=f"chain eta, p_eta, {where}", grid=grid)


@pytest.mark.parametrize("ranks", [2, 4])
def test_nose_hoover_equals_serial_at_round_off(ranks):
    res = run_on_world(_rank_md, ranks)
    _check(res)  # parity first: a wrong trajectory is reported as such
    for r in res[1:]:  # global sums and the chain: identical on every rank
        assert torch.equal(r["thermo"], res[0]["thermo"]) and torch.equal(r["chain"], res[0]["chain"])
    thermo = res[0]["thermo"]
    cons, e = thermo[:, 5], thermo[:, 2] + thermo[:, 3]
    # anti-vacuous: the bath moved far more energy than the extended energy drifted
    assert float((cons - cons[0]).abs().max()) < 0.01 * float((e - e[0]).abs().max())
    assert res[0]["migrations"] > 0, "no atom changed owner: this run does not exercise migration"


def test_chain_driven_by_the_local_kinetic_energy_is_caught():
    res = run_on_world(_rank_md, 2, "nhc_local_kinetic")
    with pytest.raises(AssertionError, match=r"parity of .* nose-hoover P=2, 40 steps on grid .* fails"):
        _check(res)


# ------------------------------------------------------------------ restart, run_md, the CLI


def test_restart_at_another_rank_count_equals_the_uninterrupted_run(tmp_path):
    """run_md: 60 steps on 4 ranks vs 30 on 4, checkpoint, 30 more on 2; the chain restored."""
    full_ck, ck, end_ck = tmp_path / "full.pt", tmp_path / "ck.pt", tmp_path / "end.pt"
    lj = LennardJones(cutoff=CUTOFF)
    kw = dict(
        thermostat="nose-hoover", dt=4.0, temperature=120.0, tdamp=40.0, chain=4, skin=SKIN, thermo_every=10
    )
    full = run_md(_start(), lj, ranks=4, steps=60, checkpoint=full_ck, **kw)
    run_md(_start(), lj, ranks=4, steps=30, checkpoint=ck, **kw)
    saved = load_checkpoint(ck)["integrator"]
    assert saved["kind"] == "nose-hoover" and len(saved["p_eta"]) == 4 and abs(saved["p_eta"][0]) > 0
    second = run_md(None, lj, ranks=2, steps=60, restart=ck, checkpoint=end_ck, **kw)
    assert second.start_step == 30 and second.ranks == 2 and second.migrations > 0
    grid = "4->2"
    for key in ("positions", "velocities"):
        assert_parity(getattr(second.system, key), getattr(full.system, key), what=f"NHC {key}", grid=grid)
    rows = [_table(r.thermo) for r in (full, second)]
    assert torch.equal(rows[0][3:, 0], rows[1][:, 0])  # steps 30, 40, ..., 60
    for j, name in enumerate(ThermoLog.COLUMNS[2:], 2):
        assert_parity(rows[1][:, j], rows[0][3:, j], what=f"NHC thermo {name}, steps 30..60", grid=grid)
    a, b = load_checkpoint(full_ck), load_checkpoint(end_ck)
    chains = [
        torch.tensor([x["integrator"][k] for k in ("eta", "p_eta")], dtype=torch.float64) for x in (b, a)
    ]
    assert_parity(chains[0], chains[1], what="NHC chain eta, p_eta", grid=grid)
    heat = [torch.tensor(x["heat"], dtype=torch.float64) for x in (b, a)]
    assert_parity(heat[0], heat[1], what="NHC chain energy (-heat)", grid=grid)

    # negative control: the same restart with the chain dropped (zeroed) differs
    state = torch.load(ck, weights_only=True)
    state["integrator"] = dict(state["integrator"], eta=[0.0] * 4, p_eta=[0.0] * 4)
    save_checkpoint(ck, {k: v for k, v in state.items() if k != "checksum"})
    cold = run_md(None, lj, ranks=2, steps=60, restart=ck, **kw)
    with pytest.raises(AssertionError, match="parity of NHC zeroed-chain velocities"):
        assert_parity(cold.system.velocities, full.system.velocities, what="NHC zeroed-chain velocities")


def test_cli_nose_hoover_check_serial_and_restart(capsys, tmp_path):
    """``twinshard md --thermostat nose-hoover --ranks 2 --check-serial --json``, then a restart
    from its checkpoint on 3 ranks, whose serial twin starts from the checkpoint's chain too."""
    ck = tmp_path / "ck.pt"
    argv = "md random_packing --atoms 160 --cutoff 5 --skin 0.6 --temperature 120 --dt 4 --seed 1"
    argv += " --thermostat nose-hoover --tdamp 40 --chain 3 --check-serial --json --thermo-every 5"
    runs = []
    for extra in (f" --ranks 2 --steps 20 --checkpoint {ck}", f" --ranks 3 --steps 40 --restart {ck}"):
        assert main((argv + extra).split()) == 0
        runs.append(json.loads(capsys.readouterr().out.strip().splitlines()[-1]))
    for r, ranks in zip(runs, (2, 3)):
        assert r["thermostat"] == "nose-hoover" and r["ranks"] == ranks and r["atoms_conserved"]
        assert r["energy_rel_error"] <= 1e-12 and r["max_force_error"] <= 1e-10
        assert r["max_position_error"] <= 1e-9, r["max_position_error"]
    assert runs[1]["start_step"] == 20
    assert abs(load_checkpoint(ck)["integrator"]["p_eta"][0]) > 0
