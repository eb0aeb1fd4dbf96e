"""The analytic LJ fast path against the autograd reference (the oracle), serial and distributed.

Each pair once (half list; across ranks the owner rule of ``ShardedSystem.half_edges``), closed-
form energies, forces and virial. Parity at the default round-off gate of ``assert_parity``
(both paths sum the same pair terms in a different order). Negative controls: a broken owner rule
(pairs straddling ranks counted on both) and a misrouted reverse sum are caught.
"""

import pytest
import torch
import torch.distributed as dist
from _planted import planted
from test_distributed import SKIN, _by_id, make_potential, make_system

from twinshard.atoms.distributed import DistributedPotential
from twinshard.atoms.neighbors import VerletList, half_of, neighbor_list
from twinshard.atoms.potentials import LennardJones, evaluate
from twinshard.atoms.sharded import ShardedSystem
from twinshard.atoms.structures import triclinic_argon
from twinshard.atoms.system import System
from twinshard.testing import assert_parity, assert_replicated, assert_shards_cover, rows_of, run_on_world

FIELDS = ("energy", "per_atom", "forces", "virial", "stress")


def _small_triclinic():
    """3x3x1 primitive fcc cells (9 atoms, two species): the short third axis (3.7 A) puts atoms
    within the cutoff of their own periodic images (self pairs)."""
    s = triclinic_argon((3, 3, 1), rattle=0.15, seed=0)
    numbers = s.numbers.clone()
    numbers[::3] = 36
    return System(positions=s.positions, numbers=numbers, cell=s.cell, pbc=True)


def _check_serial(fast, ref, where):
    assert float(ref.forces.abs().max()) > 1e-3 and float(ref.virial.abs().max()) > 0
    for k in FIELDS:
        a, b = getattr(fast, k), getattr(ref, k)
        if b is None:
            assert a is None, f"{k} {where}"
            continue
        assert_parity(a, b, what=f"{k} analytic vs autograd, {where}", checks=["two species"])


@pytest.mark.parametrize("name", ["small_triclinic", "fcc", "triclinic", "cluster", "slab"])
def test_serial_analytic_equals_autograd(name):
    system = _small_triclinic() if name == "small_triclinic" else make_system(name)
    pot = make_potential("lj")
    ref = evaluate(pot, system, analytic=False)
    _check_serial(evaluate(pot, system), ref, name)  # own half list
    full = neighbor_list(system.positions, pot.cutoff + 0.7, system.cell, system.pbc)
    _check_serial(evaluate(pot, system, full), ref, f"{name}, full list halved")
    verlet = VerletList(pot.cutoff, skin=0.5)
    _check_serial(evaluate(pot, system, verlet), ref, f"{name}, Verlet half list")
    assert verlet.half and verlet.n_builds == 1


def test_half_list_is_the_canonical_half_of_the_full_list():
    system = _small_triclinic()
    full = neighbor_list(system.positions, 6.5, system.cell, system.pbc)
    half = neighbor_list(system.positions, 6.5, system.cell, system.pbc, half=True)
    assert half.n_edges * 2 == full.n_edges
    assert bool((half.receivers == half.senders).any())  # self-image pairs are exercised

    def rows(e):
        t = torch.cat([e.receivers[:, None], e.senders[:, None], e.cell_shifts], 1)
        return sorted(map(tuple, t.tolist()))

    assert rows(half) == rows(half_of(full))


def test_compile_kernel_equals_torch_kernel():
    """The torch.compile kernel (C++ on CPU) against the plain PyTorch one, and the oracle."""
    pytest.importorskip("torch._inductor")
    system = _small_triclinic()
    params = {18: (0.0104, 3.405), 36: (0.0140, 3.65)}
    plain = evaluate(LennardJones(params, cutoff=6.0), system)
    compiled = evaluate(LennardJones(params, cutoff=6.0, kernel="compile"), system)
    for k in FIELDS:
        assert_parity(getattr(compiled, k), getattr(plain, k), what=f"{k} compiled vs torch kernel")
    single = System(positions=system.positions, numbers=torch.full_like(system.numbers, 18), cell=system.cell)
    one = LennardJones(cutoff=6.0, kernel="compile")  # one species: scalar parameters
    _check_serial(evaluate(one, single), evaluate(one, single, analytic=False), "compiled, one species")


def _rank_fast(name, grid, plant=None):
    with planted(plant):
        pot = make_potential("lj")
        system = make_system(name) if dist.get_rank() == 0 else None
        sh = ShardedSystem.scatter(system, cutoff=pot.cutoff, skin=SKIN, grid=grid)
        dp = DistributedPotential(pot)
        res = dp.compute(sh)
        assert set(dp.timings) >= {"neighbor_list", "halo_forward", "pairs", "halo_reverse"}
        return {
            "ids": sh.ids,
            "energy": res.energy,
            "per_atom": res.per_atom,
            "forces": res.forces,
            "virial": res.virial,
            "stress": res.stress,
            "pairs": sh.half_edges().n_edges,
            "grid": getattr(sh.partition, "grid", None),
        }


def _rank_fast_both_ends(name, grid):
    import twinshard.atoms.sharded as sharded_mod

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(sharded_mod, "owner_keeps", lambda a, b, s: torch.ones_like(a, dtype=torch.bool))
        return _rank_fast(name, grid)


CASES = [
    ("fcc", 1, None),
    ("fcc", 2, (1, 2, 1)),
    ("fcc", 3, (3, 1, 1)),
    ("triclinic", 4, (2, 2, 1)),
    ("slab", 3, (3, 1, 1)),
    ("cluster", 4, (2, 2, 1)),
]


@pytest.mark.parametrize("name,nranks,grid", CASES, ids=lambda v: str(v).replace(" ", ""))
def test_distributed_analytic_equals_serial_autograd(name, nranks, grid):
    system = make_system(name)
    pot = make_potential("lj")
    ref = evaluate(pot, system, analytic=False)
    res = run_on_world(_rank_fast, nranks, name, grid)
    where = f"lj/{name} P={nranks} grid={res[0]['grid']}"
    gid = "x".join(map(str, res[0]["grid"]))
    assert_replicated([r["energy"] for r in res], f"energy {where}")
    assert_replicated([r["virial"] for r in res], f"virial {where}")
    # each pair once over all ranks: as many pairs as the serial half list
    serial_pairs = neighbor_list(system.positions, pot.cutoff + SKIN, system.cell, system.pbc, half=True)
    assert sum(r["pairs"] for r in res) == serial_pairs.n_edges
    if nranks > 1:
        assert all(0 < r["pairs"] < serial_pairs.n_edges for r in res)
    checks = ["each pair once", "owned rows cover"]
    assert_parity(res[0]["energy"], ref.energy, grid=gid, what=f"energy (analytic) {where}", checks=checks)
    for key, full in (("per_atom", ref.per_atom), ("forces", ref.forces)):
        pieces = [(r[key], rows_of(r["ids"], system.ids)) for r in res]
        assert_shards_cover(pieces, full, f"{key} (analytic) {where}", disjoint=True)
        assert_parity(_by_id(res, key, system), full, grid=gid, what=f"{key} (analytic) {where}")
    assert_parity(res[0]["virial"], ref.virial, grid=gid, what=f"virial (analytic) {where}", checks=checks)
    if system.volume > 0:
        assert_parity(res[0]["stress"], ref.stress, grid=gid, what=f"stress (analytic) {where}")
    else:
        assert res[0]["stress"] is None and ref.stress is None


def test_negative_control_owner_rule_keeping_both_ends_is_caught():
    system = make_system("fcc")
    ref = evaluate(make_potential("lj"), system, analytic=False)
    res = run_on_world(_rank_fast_both_ends, 2, "fcc", (1, 2, 1))
    with pytest.raises(AssertionError, match="parity of energy, pairs kept at both ends .* fails"):
        assert_parity(res[0]["energy"], ref.energy, what="energy, pairs kept at both ends")


def test_negative_control_misrouted_reverse_sum_is_caught():
    system = make_system("fcc")
    ref = evaluate(make_potential("lj"), system, analytic=False)
    res = run_on_world(_rank_fast, 2, "fcc", (1, 2, 1), "halo_reverse_misrouted")
    assert_parity(res[0]["energy"], ref.energy, what="energy, misrouted reverse (not seen)")
    with pytest.raises(AssertionError, match="parity of forces, misrouted reverse sum .* fails"):
        assert_parity(_by_id(res, "forces", system), ref.forces, what="forces, misrouted reverse sum")
