"""The rebuild rule under a changing cell (issue 22): the partition, halo plan and neighbour lists
follow a barostat's cell without a rebuild while the skin covers the change, ``2 d + (cutoff + skin)
(1 - sigma_min(M)) <= skin`` (``M`` the cell's deformation since the last build, ``d`` the largest
non-affine displacement). A strain within the bound keeps the lists and gives the serial forces; a
strain past it rebuilds (skipping that rebuild loses pairs: mutant ``npt_rebuild_skips_strain``);
a slowly breathing NPT run rebuilds rarely and equals the serial run at round-off."""

import pytest
import torch
import torch.distributed as dist

from twinshard.atoms.data.structures import fcc_argon, random_packing
from twinshard.atoms.dynamics.driver import DistributedEngine
from twinshard.atoms.dynamics.md import SerialEngine, ThermoLog, maxwell_boltzmann, simulate
from twinshard.atoms.dynamics.scr import StochasticCellRescaling
from twinshard.atoms.parallel.distributed import DistributedPotential
from twinshard.atoms.parallel.sharded import ShardedSystem
from twinshard.atoms.potentials import LennardJones
from twinshard.testing import assert_parity, assert_shards_cover, rows_of, run_on_world

CUTOFF, SKIN = 5.0, 0.6
COLUMNS = ThermoLog.NPT_COLUMNS


def _rank_strain(scale, shear):
    """Scatter, then deform cell and positions affinely by M (a scale and a shear) and evaluate."""
    s = random_packing(120, seed=4) if dist.get_rank() == 0 else None
    sh = ShardedSystem.scatter(s, cutoff=CUTOFF, skin=SKIN)
    dp = DistributedPotential(LennardJones(cutoff=CUTOFF))
    dp.compute(sh)  # the lists of the start cell
    m = torch.eye(3, dtype=torch.float64) * scale
    m[1, 0] = shear
    built = sh.builds
    sh.set_cell(sh.cell @ m)
    sh.positions = (sh.positions @ m).contiguous()
    rebuilt = sh.update()
    res = dp.compute(sh, compute_stress=True)
    return {
        "rebuilt": rebuilt,
        "builds": sh.builds - built,
        "energy": res.energy,
        "forces": res.forces,
        "virial": res.virial,
        "ids": sh.ids,
        "m": m,
    }


@pytest.mark.parametrize(
    ("scale", "shear", "rebuild"),
    [(0.97, 0.01, False), (1.05, 0.0, False), (0.85, 0.0, True), (1.0, 0.3, True)],
)
def test_strain_bound_rebuilds_exactly_when_needed(scale, shear, rebuild):
    """2 ranks. Within the bound (3% compression and a 1% shear: (cutoff + skin)(1 - sigma_min)
    = 0.4 A < skin; any expansion) the lists stay; past it (15% compression: pairs from 5.6 A to
    5.9 A come within the cutoff; a 30% shear: sigma_min 0.86) the update rebuilds. Either way the forces, energy
    and virial equal the serial evaluation of the deformed system."""
    res = run_on_world(_rank_strain, 2, scale, shear)
    sys0 = random_packing(120, seed=4)
    m = res[0]["m"]
    sys0.cell = sys0.cell @ m
    sys0.positions = sys0.positions @ m
    eng = SerialEngine(LennardJones(cutoff=CUTOFF), sys0, skin=SKIN)
    eng.need_virial = True
    energy, forces = eng.compute()
    grid, where = "2", f"M = {scale} I + {shear} e_yx, rebuild {rebuild}"
    assert_parity(res[0]["energy"], energy, what=f"energy after a strain, {where}", grid=grid)
    assert_parity(res[0]["virial"], eng.virial, what=f"virial after a strain, {where}", grid=grid)
    pieces = [(r["forces"], rows_of(r["ids"], sys0.ids)) for r in res]
    assert_shards_cover(pieces, forces, f"forces after a strain, {where}", disjoint=True)
    assert all(r["rebuilt"] == rebuild for r in res), [r["rebuilt"] for r in res]


# ------------------------------------------------------------------ a slowly breathing box

STEPS = 60
# fcc argon (108 atoms, rattled) near its 60 K, 500 bar volume, a slow barostat (pdamp 2 ps): the
# cell changes every step by ~1e-4, the atoms vibrate
SLOW = dict(dt=4.0, temperature=60.0, pressure=500.0, pdamp=2000.0, compressibility=1e-4, friction=0.01)


def _start():
    s = fcc_argon(3, rattle=0.05, seed=2)
    s.velocities = maxwell_boltzmann(s.masses, s.ids, 60.0, seed=2)
    return s


def _table(log):
    return torch.tensor([[row[c] for c in COLUMNS] for row in log.rows], dtype=torch.float64)


def _rank_slow():
    s = _start() if dist.get_rank() == 0 else None
    sh = ShardedSystem.scatter(s, cutoff=CUTOFF, skin=SKIN)
    engine = DistributedEngine(sh, DistributedPotential(LennardJones(cutoff=CUTOFF)))
    integ = StochasticCellRescaling(**SLOW, thermostat="langevin", coupling="aniso", seed=7)
    builds0 = sh.builds
    out = simulate(engine, integ, STEPS)
    return {
        "thermo": _table(out["thermo"]),
        "cell": sh.cell.clone(),
        "ids": sh.ids,
        "positions": sh.positions,
        "velocities": sh.velocities,
        "builds": sh.builds - builds0,
    }


def test_slowly_breathing_box_rebuilds_rarely_and_equals_serial():
    res = run_on_world(_rank_slow, 2)
    engine = SerialEngine(LennardJones(cutoff=CUTOFF), _start(), skin=SKIN)
    out = simulate(
        engine, StochasticCellRescaling(**SLOW, thermostat="langevin", coupling="aniso", seed=7), STEPS
    )
    thermo, final = _table(out["thermo"]), engine.system
    where, grid = f"slow scr P=2, {STEPS} steps", "2"
    for j, name in enumerate(COLUMNS):
        assert_parity(
            res[0]["thermo"][:, j], thermo[:, j], what=f"thermo {name} per step, {where}", grid=grid
        )
    for key in ("positions", "velocities"):
        pieces = [(r[key], rows_of(r["ids"], final.ids)) for r in res]
        assert_shards_cover(pieces, getattr(final, key), f"final owned {key} {where}", disjoint=True)
    assert_parity(res[0]["cell"], final.cell, what=f"cell, {where}", grid=grid)
    vol = res[0]["thermo"][:, 6]
    assert float((vol[1:] - vol[:-1]).abs().min()) > 0  # the cell changed at every step
    assert 1 <= res[0]["builds"] <= STEPS // 6, res[0]["builds"]  # yet the lists were rebuilt rarely
