"""The distributed potential against its serial twin (fp64, gloo, several rank grids).

Each case scatters a system, evaluates LJ or the message-passing potential on
halo-padded blocks and compares with the serial evaluation of the whole box:
energy, per-atom energies, forces and stress, and the backward of a random
grad_output on the per-atom energies (position and per-parameter gradients), all
through ``assert_parity`` at the fp64 round-off budget; each rank's owned rows
(per-atom energies, forces, position gradients) are pieces of the serial tensors
at their atoms' rows (``assert_shards_cover``: strict parts, disjoint, covering).
"""

import pytest
import torch
import torch.distributed as dist
from _planted import planted

from twinshard.atoms.data import structures
from twinshard.atoms.data.system import System
from twinshard.atoms.parallel.distributed import DistributedPotential
from twinshard.atoms.parallel.sharded import ShardedSystem
from twinshard.atoms.potentials import LennardJones, MessagePassingPotential, evaluate
from twinshard.atoms.potentials.base import graph_from_system
from twinshard.rng import normal
from twinshard.runtime import RankFailure
from twinshard.testing import (
    assert_grads_finite_nonzero,
    assert_parity,
    assert_random_grad_output,
    assert_replicated,
    assert_shards_cover,
    by_id,
    rows_of,
    run_on_world,
)

SKIN = 0.5


def make_potential(kind):
    if kind == "lj":
        # two species so the mixing rules are exercised; cutoff 6 A keeps boxes small
        return LennardJones({18: (0.0104, 3.405), 36: (0.0140, 3.65)}, cutoff=6.0)
    pot = MessagePassingPotential(species=(18, 36), cutoff=5.0, n_layers=3, seed=3)
    return pot


def make_system(name):
    if name == "fcc":  # periodic orthorhombic, 256 atoms, 21 A
        s = structures.fcc_argon(repeat=4, rattle=0.25, seed=1)
    elif name == "triclinic":  # periodic 60-degree rhombohedral supercell, 252 atoms
        s = structures.triclinic_argon(repeat=(7, 6, 6), rattle=0.25, seed=2)
    elif name == "cluster":  # open box, no cell: a molecule in vacuum
        f = structures.fcc_argon(repeat=4, rattle=0.25, seed=3)
        s = System(positions=f.positions, numbers=f.numbers, pbc=False)
    elif name == "slab":  # triclinic, periodic in-plane, open along the third axis
        t = structures.triclinic_argon(repeat=(7, 6, 6), rattle=0.25, seed=4)
        s = System(positions=t.positions, numbers=t.numbers, cell=t.cell, pbc=(True, True, False))
    else:
        raise ValueError(name)
    numbers = s.numbers.clone()
    numbers[::5] = 36  # every fifth atom krypton
    # shuffle ids so owned rows are not contiguous id ranges
    g = torch.Generator().manual_seed(7)
    ids = torch.randperm(s.n_atoms, generator=g) + 1000
    return System(positions=s.positions, numbers=numbers, cell=s.cell, pbc=s.pbc, ids=ids)


def grad_output_for(ids):
    """Random per-atom grad_output keyed by global id (same serially and distributed)."""
    return normal(5, 1, ids.to(torch.int64))


def _rank_eval(kind, name, grid, partition, plant=None):
    with planted(plant):
        return _eval(kind, name, grid, partition)


def _eval(kind, name, grid, partition):
    pot = make_potential(kind)
    system = make_system(name) if dist.get_rank() == 0 else None
    sh = ShardedSystem.scatter(system, cutoff=pot.cutoff, skin=SKIN, grid=grid, partition=partition)
    dp = DistributedPotential(pot)
    res = dp.compute(sh)
    # backward of a random grad_output on the per-atom energies
    x = sh.positions.detach().requires_grad_(True)
    per_atom = dp.per_atom_energies(sh, x)
    go = grad_output_for(sh.ids).to(per_atom.dtype)
    params = list(pot.parameters())
    grads = torch.autograd.grad(per_atom, [x, *params], go)  # complete: sync_params summed them
    for p, g in zip(params, grads[1:]):
        p.grad = g
    return {
        "ids": sh.ids,
        "energy": res.energy,
        "per_atom": res.per_atom,
        "forces": res.forces,
        "stress": res.stress,
        "virial": res.virial,
        "grad_x": grads[0],
        "grad_params": {n: p.grad for n, p in pot.named_parameters()},
        "n_halo": sh.n_halo,
        "grid": getattr(sh.partition, "grid", None),
        "grad_output": go,
    }


def _serial(kind, name):
    pot = make_potential(kind)
    system = make_system(name)
    ref = evaluate(pot, system)
    x = system.positions.detach().requires_grad_(True)
    graph = graph_from_system(system, pot.cutoff)
    graph.positions = x
    per_atom = pot(graph)
    params = list(pot.parameters())
    grads = torch.autograd.grad(per_atom, [x, *params], grad_output_for(system.ids))
    names = [n for n, _ in pot.named_parameters()]
    return system, ref, grads[0], dict(zip(names, grads[1:]))


CASES = [
    # (potential, system, ranks, grid)
    ("lj", "fcc", 1, None),
    ("lj", "fcc", 2, (1, 2, 1)),
    ("lj", "fcc", 3, (3, 1, 1)),
    ("lj", "triclinic", 4, (2, 2, 1)),
    ("lj", "cluster", 8, (2, 2, 2)),
    ("lj", "slab", 3, (3, 1, 1)),
    ("mpnn", "fcc", 8, (2, 2, 2)),
    ("mpnn", "triclinic", 3, None),
    ("mpnn", "triclinic", 4, (1, 2, 2)),
    ("mpnn", "cluster", 2, None),
    ("mpnn", "slab", 4, (2, 2, 1)),
    ("mpnn", "fcc", 1, None),
]


@pytest.mark.parametrize("kind,name,nranks,grid", CASES, ids=lambda v: str(v).replace(" ", ""))
def test_parity_with_serial(kind, name, nranks, grid):
    system, ref, ref_gx, ref_gp = _serial(kind, name)
    res = run_on_world(_rank_eval, nranks, kind, name, grid, "spatial")
    where = f"{kind}/{name} P={nranks} grid={res[0]['grid']}"
    gid = "x".join(map(str, res[0]["grid"]))
    if grid is not None:
        assert res[0]["grid"] == grid
    assert_replicated([r["energy"] for r in res], f"energy {where}")
    assert_replicated([r["virial"] for r in res], f"virial {where}")
    assert_replicated([r["grad_params"] for r in res], f"parameter gradients {where}")
    if nranks > 1:
        assert all(r["n_halo"] > 0 for r in res)
    assert float(ref.forces.abs().max()) > 1e-3  # rattled: forces are not zero by symmetry
    checks = ["replicated", "owned rows cover"]
    assert_parity(res[0]["energy"], ref.energy, grid=gid, what=f"energy {where}", checks=checks)
    # per-atom results: each rank's owned rows are a strict, disjoint part; together all atoms
    for key, full in (("per_atom", ref.per_atom), ("forces", ref.forces), ("grad_x", ref_gx)):
        pieces = [(r[key], rows_of(r["ids"], system.ids)) for r in res]
        assert_shards_cover(pieces, full, f"{key} {where}", disjoint=True)
    assert_parity(
        by_id(res, "per_atom", system.ids), ref.per_atom, grid=gid, what=f"per-atom energies {where}"
    )
    assert_parity(
        by_id(res, "forces", system.ids), ref.forces, grid=gid, what=f"forces {where}", checks=checks
    )
    if system.volume > 0:
        assert float(ref.stress.abs().max()) > 0
        assert_parity(res[0]["stress"], ref.stress, grid=gid, what=f"stress {where}", checks=checks)
    else:
        assert res[0]["stress"] is None and ref.stress is None
    # backward of a random grad_output: positions and every parameter
    assert_random_grad_output(res[0]["grad_output"])
    gx = by_id(res, "grad_x", system.ids)
    assert_grads_finite_nonzero({"positions": gx, **res[0]["grad_params"]}, where)
    assert_parity(gx, ref_gx, grid=gid, what=f"d<g, per-atom E>/dx {where}", checks=["random grad_output"])
    for n, g in ref_gp.items():
        assert_parity(res[0]["grad_params"][n], g, grid=gid, what=f"d<g, per-atom E>/d{n} {where}")


def test_block_partition_parity():
    system, ref, ref_gx, _ = _serial("mpnn", "fcc")
    res = run_on_world(_rank_eval, 3, "mpnn", "fcc", None, "block")
    assert res[0]["grid"] is None
    pieces = [(r["forces"], rows_of(r["ids"], system.ids)) for r in res]
    assert_shards_cover(pieces, ref.forces, "forces mpnn/fcc block P=3", disjoint=True)
    assert_parity(res[0]["energy"], ref.energy, what="energy mpnn/fcc block P=3")
    assert_parity(by_id(res, "forces", system.ids), ref.forces, what="forces mpnn/fcc block P=3")
    assert_parity(res[0]["stress"], ref.stress, what="stress mpnn/fcc block P=3")
    assert_parity(by_id(res, "grad_x", system.ids), ref_gx, what="d<g,E>/dx mpnn/fcc block P=3")


def test_negative_control_missing_parameter_reduce_is_caught():
    """Planted in the ranks: parameters bypass comm.sync_params (each rank keeps its share)."""
    system, ref, _, ref_gp = _serial("lj", "fcc")
    res = run_on_world(_rank_eval, 2, "lj", "fcc", (1, 2, 1), "spatial", "no_param_sync")
    # forces do not see the bug (only the parameter gradients do)
    assert_parity(by_id(res, "forces", system.ids), ref.forces, what="forces with no_param_sync")
    with pytest.raises(AssertionError, match=r"parity of d<g, per-atom E>/depsilon .* fails"):
        assert_parity(
            res[0]["grad_params"]["epsilon"], ref_gp["epsilon"], what="d<g, per-atom E>/depsilon P=2"
        )


def _rank_no_refresh():
    """Negative control: a message-passing model whose halo is never refreshed."""
    pot = make_potential("mpnn")
    system = make_system("fcc") if dist.get_rank() == 0 else None
    sh = ShardedSystem.scatter(system, cutoff=pot.cutoff, skin=SKIN)
    graph = sh.block_graph()
    graph.refresh = lambda h: h  # stale halo features after the first layer
    return sh.ids, pot(graph)[: sh.n_owned].detach()


def test_negative_control_stale_halo_features_are_caught():
    system, ref, _, _ = _serial("mpnn", "fcc")
    res = run_on_world(_rank_no_refresh, 2)
    per_atom = by_id([{"ids": i, "e": e} for i, e in res], "e", system.ids)
    with pytest.raises(AssertionError, match="parity of per-atom energies, halo never refreshed .* fails"):
        assert_parity(per_atom, ref.per_atom, what="per-atom energies, halo never refreshed")


# ------------------------------------------------------------------ training through forces
def _rank_force_loss(kind, name, grid):
    pot = make_potential(kind)
    system = make_system(name) if dist.get_rank() == 0 else None
    sh = ShardedSystem.scatter(system, cutoff=pot.cutoff, skin=SKIN, grid=grid)
    dp = DistributedPotential(pot)
    res = dp.compute(sh, compute_stress=False, create_graph=True)
    go = normal(6, 2, sh.ids[:, None].to(torch.int64), torch.arange(3)[None, :])
    loss = (go * res.forces).sum()  # this rank's share of <g, F>
    params = list(pot.parameters())
    # double backward through the halo exchanges; an output bias has no force gradient
    grads = torch.autograd.grad(loss, params, allow_unused=True)
    for p, g in zip(params, grads):
        p.grad = g  # complete: the double backward ran through comm.sync_params too
    return {n: p.grad for n, p in pot.named_parameters()}


@pytest.mark.parametrize(
    "kind,name,nranks,grid", [("lj", "triclinic", 3, (3, 1, 1)), ("mpnn", "fcc", 4, (2, 2, 1))]
)
def test_force_loss_parameter_gradients(kind, name, nranks, grid):
    """d<g, F>/dtheta (double backward, as in force matching) equals the serial one."""
    pot = make_potential(kind)
    system = make_system(name)
    x = system.positions.detach().requires_grad_(True)
    graph = graph_from_system(system, pot.cutoff)
    graph.positions = x
    (gx,) = torch.autograd.grad(pot(graph).sum(), x, create_graph=True)
    go = normal(6, 2, system.ids[:, None].to(torch.int64), torch.arange(3)[None, :])
    ref = torch.autograd.grad((go * -gx).sum(), list(pot.parameters()), allow_unused=True)
    names = [n for n, _ in pot.named_parameters()]
    unused = {n for n, g in zip(names, ref) if g is None}
    assert unused <= {"readout2.bias"}
    ref = [torch.zeros_like(p) if g is None else g for p, g in zip(pot.parameters(), ref)]
    res = run_on_world(_rank_force_loss, nranks, kind, name, grid)
    assert_replicated(res, "force-loss parameter gradients")
    assert_grads_finite_nonzero(
        {n: g for n, g in res[0].items() if n not in unused}, f"force loss {kind}/{name}"
    )
    for n, g in zip(names, ref):
        assert_parity(res[0][n], g, grid="x".join(map(str, grid)), what=f"d<g, F>/d{n} {kind}/{name}")


# ------------------------------------------------------------------ bad input inside the model
def _rank_unknown_species():
    pot = LennardJones(cutoff=6.0)  # argon only
    system = None
    if dist.get_rank() == 0:
        s = structures.fcc_argon(repeat=4, rattle=0.1, seed=1)
        numbers = s.numbers.clone()
        far = torch.argmax(s.positions[:, 0])  # one krypton at the far x end: one rank owns it
        numbers[far] = 36
        system = System(positions=s.positions, numbers=numbers, cell=s.cell, pbc=True)
    sh = ShardedSystem.scatter(system, cutoff=6.0, skin=SKIN, grid=(3, 1, 1))
    try:
        DistributedPotential(pot).compute(sh)
    except RankFailure as exc:
        return str(exc)
    return "no error"


def test_model_input_error_on_some_ranks_fails_on_every_rank():
    msgs = run_on_world(_rank_unknown_species, 3, timeout=60)
    for m in msgs:
        assert "no parameters for atomic numbers [36]" in m
