"""MD observables of a 4-rank run equal the serial run's at round-off: every thermo row (potential,
kinetic energy, temperature, conserved quantity) and the final owned positions and velocities,
NVE and Langevin; a planted Langevin noise keyed by local row is caught."""

import pytest
import torch
import torch.distributed as dist
from _planted import planted

from twinshard.atoms.data.structures import random_packing
from twinshard.atoms.dynamics.driver import DistributedEngine
from twinshard.atoms.dynamics.md import (
    Langevin,
    SerialEngine,
    ThermoLog,
    VelocityVerlet,
    maxwell_boltzmann,
    simulate,
)
from twinshard.atoms.parallel.distributed import DistributedPotential
from twinshard.atoms.parallel.sharded import ShardedSystem
from twinshard.atoms.potentials import LennardJones
from twinshard.testing import assert_parity, assert_shards_cover, rows_of, run_on_world

CUTOFF, SKIN, STEPS = 5.0, 0.6, 40
OBSERVABLES = ("potential", "kinetic", "temperature", "conserved")


def _start():
    # a small hot liquid (160 atoms, 200 K, 4 fs): atoms cross subdomain faces within 40 steps
    s = random_packing(160, seed=1)
    s.velocities = maxwell_boltzmann(s.masses, s.ids, 200.0, seed=1)
    return s


def _integrator(kind):
    return VelocityVerlet(4.0) if kind == "nve" else Langevin(4.0, 200.0, 0.05, seed=3)


def _table(log: ThermoLog) -> torch.Tensor:
    return torch.tensor([[row[c] for c in ThermoLog.COLUMNS] for row in log.rows], dtype=torch.float64)


def _rank_md(kind, plant=None):
    with planted(plant):
        s = _start() if dist.get_rank() == 0 else None
        # a 2x2 grid (more rank boundaries than the automatic slabs): atoms migrate during the run
        sh = ShardedSystem.scatter(s, cutoff=CUTOFF, skin=SKIN, grid=(2, 2, 1))
        engine = DistributedEngine(sh, DistributedPotential(LennardJones(cutoff=CUTOFF)))
        out = simulate(engine, _integrator(kind), STEPS)
    return {
        "thermo": _table(out["thermo"]),
        "ids": sh.ids,
        "positions": sh.positions,
        "velocities": sh.velocities,
        "migrations": sh.migrations,
    }


_SERIAL = {}


def _serial(kind):
    if kind not in _SERIAL:
        s = _start()
        engine = SerialEngine(LennardJones(cutoff=CUTOFF), s, skin=SKIN)
        out = simulate(engine, _integrator(kind), STEPS)
        _SERIAL[kind] = (_table(out["thermo"]), engine.system)
    return _SERIAL[kind]


def _check(res, kind):
    thermo, final = _serial(kind)
    where = f"{kind} P=4, {STEPS} steps"
    assert_parity(res[0]["thermo"][:, :2], thermo[:, :2], what=f"thermo step/time {where}")
    for j, name in enumerate(ThermoLog.COLUMNS):
        if name in OBSERVABLES:  # every row: step 0, 1, ..., STEPS
            assert_parity(res[0]["thermo"][:, j], thermo[:, j], what=f"thermo {name} per step, {where}")
    for key in ("positions", "velocities"):
        pieces = [(r[key], rows_of(r["ids"], final.ids)) for r in res]
        assert_shards_cover(pieces, getattr(final, key), f"final owned {key} {where}", disjoint=True)


@pytest.mark.parametrize("kind", ["nve", "langevin"])
def test_md_observables_equal_serial_at_round_off(kind):
    res = run_on_world(_rank_md, 4, kind)
    for r in res[1:]:  # the thermo rows are global sums: identical on every rank
        assert torch.equal(r["thermo"], res[0]["thermo"])
    _check(res, kind)  # parity first: a wrong trajectory is reported as such
    assert res[0]["migrations"] > 0, "no atom changed owner: this run does not exercise migration"


def test_langevin_noise_keyed_by_row_is_caught():
    res = run_on_world(_rank_md, 4, "langevin", "langevin_row_keys")
    with pytest.raises(AssertionError, match=r"parity of thermo potential per step, langevin P=4.* fails"):
        _check(res, "langevin")
