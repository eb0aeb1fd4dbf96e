"""The analytic LJ fast path against the autograd reference (the oracle), serial and distributed.

Each pair once (half list; across ranks the owner rule of ``ShardedSystem.half_edges``), closed-
form energies, forces and virial. Parity at the default round-off gate of ``assert_parity``
(both paths sum the same pair terms in a different order). Negative controls: a broken owner rule
(pairs straddling ranks counted on both) and a misrouted reverse sum are caught.
"""

import inspect
import textwrap

import pytest
import torch
import torch.distributed as dist
from _planted import planted
from test_distributed import SKIN, make_potential, make_system

from twinshard.atoms.data.neighbors import VerletList, half_of, neighbor_list
from twinshard.atoms.data.structures import triclinic_argon
from twinshard.atoms.data.system import System
from twinshard.atoms.parallel.distributed import DistributedPotential
from twinshard.atoms.parallel.sharded import ShardedSystem
from twinshard.atoms.potentials import LennardJones, evaluate, lj, lj_kernels
from twinshard.testing import (
    assert_parity,
    assert_replicated,
    assert_shards_cover,
    by_id,
    rows_of,
    run_on_world,
)

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


KERNEL_CASES = ["torch", "torch_chunked", "compile"]
KERNEL_SYSTEMS = ["triclinic", "cluster", "small_triclinic_one_species"]


def _kernel_system(name):
    if name == "small_triclinic_one_species":  # scalar parameters; self-image pairs
        s = _small_triclinic()
        return System(positions=s.positions, numbers=torch.full_like(s.numbers, 18), cell=s.cell)
    return make_system(name)


def _kernel_potential(kernel, mp):
    """The test potential with ``kernel``; ``torch_chunked`` is the plain kernel cut into chunks of 7
    pairs (many chunks and a ragged last one: the default chunk is larger than these test lists)."""
    if kernel == "compile":
        pytest.importorskip("torch._inductor")
    if kernel == "torch_chunked":
        mp.setattr(lj_kernels, "CHUNK", 7)
        kernel = "torch"
    pot = make_potential("lj")
    pot.kernel = kernel
    return pot


@pytest.mark.parametrize("name", KERNEL_SYSTEMS)
@pytest.mark.parametrize("kernel", KERNEL_CASES)
def test_every_kernel_equals_autograd(kernel, name, monkeypatch):
    """Each kernel against the autograd oracle (energy, per-atom, forces, virial, stress), and the
    block form the distributed path uses (no shifts) on an open system; the compiled kernel also
    against the plain one. The compiled graph is built once per process (dynamic sizes)."""
    system = _kernel_system(name)
    pot = _kernel_potential(kernel, monkeypatch)
    ref = evaluate(pot, system, analytic=False)
    fast = evaluate(pot, system)
    _check_serial(fast, ref, f"{name}, kernel {kernel}")
    if kernel == "compile":
        pot.kernel = "torch"
        plain = evaluate(pot, system)
        for k in FIELDS:
            if getattr(plain, k) is not None:  # no stress without a cell
                assert_parity(
                    getattr(fast, k), getattr(plain, k), what=f"{k} compiled vs torch kernel, {name}"
                )
        pot.kernel = "compile"
    if not bool(system.pbc.any()):  # an open block, as DistributedPotential passes it: shifts=None
        half = neighbor_list(system.positions, pot.cutoff, half=True)
        pair = pot.analytic(system.positions, system.numbers, half.receivers, half.senders, None)
        for k in ("per_atom", "forces", "virial"):
            assert_parity(getattr(pair, k), getattr(ref, k), what=f"{k} {kernel}, shifts=None, {name}")


def test_auto_kernel_choice(monkeypatch):
    """ "auto": plain below AUTO_MIN_EDGES pairs or without a C++ compiler, compiled otherwise
    (always on a GPU); an unknown kernel name is refused."""
    big, cpu = lj_kernels.AUTO_MIN_EDGES, torch.device("cpu")
    monkeypatch.setattr(lj_kernels, "_have_cxx", lambda: True)
    assert lj_kernels.resolve_kernel("auto", big - 1, cpu) == "torch"
    assert lj_kernels.resolve_kernel("auto", big, cpu) == "compile"
    assert lj_kernels.resolve_kernel("torch", big, cpu) == "torch"
    assert lj_kernels.resolve_kernel("compile", 1, cpu) == "compile"
    monkeypatch.setattr(lj_kernels, "_have_cxx", lambda: False)
    assert lj_kernels.resolve_kernel("auto", big, cpu) == "torch"
    cuda = torch.device("cuda")
    for triton in (True, False):
        monkeypatch.setattr(lj_kernels, "_have_triton", lambda t=triton: t)
        assert lj_kernels.resolve_kernel("auto", big, cuda) == ("compile" if triton else "torch")
    # a small system under "auto" runs the plain kernel: bitwise the torch kernel's results
    system = _small_triclinic()
    pot = make_potential("lj")
    pot.kernel = "auto"
    auto = evaluate(pot, system)
    pot.kernel = "torch"
    plain = evaluate(pot, system)
    assert all(torch.equal(getattr(auto, k), getattr(plain, k)) for k in FIELDS)
    with pytest.raises(ValueError, match="unknown LJ kernel 'fused'; choose one of"):
        LennardJones(kernel="fused")
    pot.kernel = "fused"  # set after construction: refused at evaluation, not run as the plain kernel
    with pytest.raises(ValueError, match="unknown LJ kernel 'fused'; choose one of"):
        evaluate(pot, system)


def _plant(fn, old, new):
    """``fn`` rebuilt from its source with the one line ``old`` replaced by ``new`` (a planted bug)."""
    src = textwrap.dedent(inspect.getsource(fn))
    assert src.count(old) == 1, f"planted bug: {old!r} not found once in {fn.__name__}"
    ns = {}  # defined with the module's live globals (a monkeypatched CHUNK reaches it)
    exec(compile(src.replace(old, new), f"<planted {fn.__name__}>", "exec"), fn.__globals__, ns)
    return ns[fn.__name__]


FUSED_BUGS = {
    # the fused kernel's traced function, run eagerly with the bug (the check is under test, not inductor)
    "j-side force dropped": (".index_add(0, j, fk).index_add(0, i, -fk)", ".index_add(0, i, -fk)", "forces"),
    "virial missing a factor": ("(f[a] * d[b]).sum()", "(f[a] * d[b]).sum() * 0.5", "virial"),
    "energy shift dropped": ("(s6 * s6 - s6) * eps4 - ec", "(s6 * s6 - s6) * eps4", "energy"),
}


@pytest.mark.parametrize("bug", FUSED_BUGS)
def test_negative_control_fused_kernel_bug_is_caught(bug, monkeypatch):
    old, new, field = FUSED_BUGS[bug]
    buggy = _plant(lj_kernels._fused, old, new)
    monkeypatch.setattr(lj_kernels, "_compiled", lambda: buggy)
    system = make_system("triclinic")
    pot = make_potential("lj")
    ref = evaluate(pot, system, analytic=False)
    pot.kernel = "compile"
    with pytest.raises(AssertionError, match=f"parity of {field} analytic vs autograd, planted .* fails"):
        _check_serial(evaluate(pot, system), ref, f"planted {bug}")


def test_negative_control_chunked_virial_keeps_only_the_last_chunk(monkeypatch):
    """The plain kernel's virial assigned per chunk instead of accumulated: caught because the test
    chunks are small (the one-chunk case would not see it)."""
    buggy = _plant(lj_kernels.pairs_torch, "virial[q] += torch.dot(", "virial[q] = torch.dot(")
    monkeypatch.setattr(lj_kernels, "pairs_torch", buggy)
    monkeypatch.setattr(lj, "pairs_torch", buggy)
    system = make_system("triclinic")
    pot = _kernel_potential("torch_chunked", monkeypatch)
    ref = evaluate(pot, system, analytic=False)
    with pytest.raises(AssertionError, match="parity of virial analytic vs autograd, planted .* fails"):
        _check_serial(evaluate(pot, system), ref, "planted last-chunk virial")


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
    import twinshard.atoms.parallel.sharded as sharded_mod

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
    total = sum(r["pairs"] for r in res)
    assert total == serial_pairs.n_edges, (
        f"{where}: {total} pairs evaluated over all ranks, the serial half list has "
        f"{serial_pairs.n_edges}: the owner rule keeps a boundary pair at both ends (or at neither)"
    )
    if nranks > 1:
        assert all(0 < r["pairs"] < serial_pairs.n_edges for r in res)
    checks = ["each pair once", "owned rows cover"]
    assert_parity(res[0]["energy"], ref.energy, grid=gid, what=f"energy (analytic) {where}", checks=checks)
    for key, full in (("per_atom", ref.per_atom), ("forces", ref.forces)):
        pieces = [(r[key], rows_of(r["ids"], system.ids)) for r in res]
        assert_shards_cover(pieces, full, f"{key} (analytic) {where}", disjoint=True)
        assert_parity(by_id(res, key, system.ids), full, grid=gid, what=f"{key} (analytic) {where}")
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
        assert_parity(by_id(res, "forces", system.ids), ref.forces, what="forces, misrouted reverse sum")


def _rank_self_images(nranks):
    pot = make_potential("lj")
    system = _small_triclinic() if dist.get_rank() == 0 else None
    sh = ShardedSystem.scatter(system, cutoff=pot.cutoff, skin=SKIN, partition="block")
    res = DistributedPotential(pot).compute(sh)
    own_images = int(torch.isin(sh.plan.halo_ids.to(sh.ids.device), sh.ids).sum())
    return {
        "ids": sh.ids,
        "energy": res.energy,
        "forces": res.forces,
        "virial": res.virial,
        "pairs": sh.half_edges().n_edges,
        "own_images": own_images,
    }


@pytest.mark.parametrize("nranks", [2, 3])
def test_own_periodic_images_as_halo_rows_of_the_same_rank(nranks):
    """A 9-atom cell with a 3.7 A axis in block partition (no wrap axes: every image is a halo row):
    each rank's halo holds periodic images of its own atoms, and an atom and its own image form a
    pair within the cutoff. The owner rule keeps each such pair once (by the sign of the relative
    lattice shift, on the one rank that holds both ends) and each cross-rank pair once."""
    system, pot = _small_triclinic(), make_potential("lj")
    ref = evaluate(pot, system, analytic=False)
    res = run_on_world(_rank_self_images, nranks, nranks)
    where = f"lj small triclinic, block partition P={nranks}"
    assert all(r["own_images"] > 0 for r in res), f"{where}: no rank holds an image of its own atom"
    serial_pairs = neighbor_list(system.positions, pot.cutoff + SKIN, system.cell, system.pbc, half=True)
    self_pairs = int((serial_pairs.senders == serial_pairs.receivers).sum())
    assert self_pairs > 0, "the cell must put atoms within the cutoff of their own images"
    assert sum(r["pairs"] for r in res) == serial_pairs.n_edges, f"{where}: a pair counted twice or never"
    gid = str(nranks)
    assert_parity(res[0]["energy"], ref.energy, grid=gid, what=f"energy {where}")
    assert_parity(by_id(res, "forces", system.ids), ref.forces, grid=gid, what=f"forces {where}")
    assert_parity(res[0]["virial"], ref.virial, grid=gid, what=f"virial {where}")
