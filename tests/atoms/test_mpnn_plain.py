"""The plain-PyTorch message-passing model, unmodified, through the ShardTensor dispatch.

``PlainMessagePassing`` (no twinshard calls: ``index_select``, ``zeros_like(h).index_add_``, a
scatter into per-system energies, ``torch.autograd.grad`` for forces and, through a
displacement, the virial) runs under ``DistributedPotential(model, mode="dispatch")`` at 1, 2,
3 and 4 ranks and equals the serial model (fp64 round-off budget of ``assert_parity``):
energy, per-atom energies, forces, stress, the backward of a random grad_output on the
per-atom energies (positions and every parameter), and (at 2 ranks) the parameter gradients of a
force loss (double backward through the dispatch). Owned rows are strict, disjoint, covering pieces
of the serial tensors (``assert_shards_cover``).

Negative controls, each a planted handler that does the op on local rows only (what a
disabled handler would silently compute if the dispatch did not raise): the parity test
fails with its message. Disabling a handler instead raises ``UnhandledAtomOp`` naming the op.
"""

import pytest
import torch
import torch.distributed as dist

from twinshard.atoms.data import structures
from twinshard.atoms.data.system import System
from twinshard.atoms.parallel.distributed import DistributedPotential
from twinshard.atoms.parallel.plain_inputs import evaluate_plain, system_inputs
from twinshard.atoms.parallel.sharded import ShardedSystem
from twinshard.atoms.potentials import MessagePassingPotential, evaluate
from twinshard.atoms.potentials.mpnn_plain import PlainMessagePassing
from twinshard.rng import normal
from twinshard.shard import dispatch as D
from twinshard.shard import registry as R
from twinshard.shard.shard_tensor import UnhandledAtomOp, from_local, to_local
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
GRIDS = {1: None, 2: (2, 1, 1), 3: (3, 1, 1), 4: (2, 2, 1)}
KW = dict(species=(18, 36), cutoff=4.0, n_features=8, n_basis=6, n_layers=2, seed=3)


def make_model():
    return PlainMessagePassing(**KW)


def make_system():
    s = structures.fcc_argon(repeat=3, rattle=0.25, seed=1)  # 108 atoms, periodic
    numbers = s.numbers.clone()
    numbers[::5] = 36
    ids = torch.randperm(s.n_atoms, generator=torch.Generator().manual_seed(7)) + 1000
    return System(positions=s.positions, numbers=numbers, cell=s.cell, pbc=s.pbc, ids=ids)


def _go(ids):
    return normal(5, 1, ids.to(torch.int64))


def _go_forces(ids):
    return normal(6, 2, ids[:, None].to(torch.int64), torch.arange(3)[None, :])


# ---------------------------------------------------------------------- planted local-only handlers
def _naive(name):
    """The handler ``name`` replaced by the op on local rows (no communication)."""
    if name == "halo_refresh":

        def run(f, a, k):
            c = D.parse_index_call(f, a, k)
            return R.local_gather(c, to_local(c.target), R.plain_index(c.index))

    elif name == "halo_correction":

        def run(f, a, k):
            c = D.parse_index_call(f, a, k)
            loc = to_local(c.target)
            contrib = R.local_scatter(c, torch.zeros_like(loc), R.plain_index(c.index), to_local(c.source))
            return c.target.add_(from_local(contrib, c.target.spec))

    elif name == "per_system_reduce":

        def run(f, a, k):
            c = D.parse_index_call(f, a, k)
            n = c.source.n_owned
            z = torch.zeros(c.target.shape, dtype=c.source.dtype)
            return c.target + R.local_scatter(c, z, R.plain_index(c.index)[:n], to_local(c.source)[:n])

    else:
        raise ValueError(name)
    pred = next(h.predicate for h in D._shipped() if h.name == name)
    return D.Handler(name, pred, run)


def _rank_eval(nranks, plant=None, force_loss=False):
    model = make_model()
    system = make_system() if dist.get_rank() == 0 else None
    sh = ShardedSystem.scatter(system, cutoff=model.cutoff, skin=SKIN, grid=GRIDS[nranks])
    dp = DistributedPotential(model, mode="dispatch")
    if plant == "replicated_grads":
        ctx = D.REGISTRY.disabled("replicated_grads")
    elif plant is not None:
        ctx = D.REGISTRY.installed(_naive(plant), first=False)  # takes the shipped one's place
    else:
        ctx = D.REGISTRY.disabled()
    with ctx:
        res = dp.compute(sh)
        x = sh.positions.detach().requires_grad_(True)
        per_atom = dp.per_atom_energies(sh, x)
        params = list(model.parameters())
        grads = torch.autograd.grad(per_atom, [x, *params], _go(sh.ids).to(per_atom.dtype))
        out = {
            "ids": sh.ids,
            "n_halo": sh.n_halo,
            "energy": res.energy,
            "per_atom": res.per_atom,
            "forces": res.forces,
            "stress": res.stress,
            "grad_x": grads[0],
            "grad_params": {n: g for (n, _), g in zip(model.named_parameters(), grads[1:])},
        }
        if force_loss:
            r2 = dp.compute(sh, compute_stress=False, create_graph=True)
            loss = (_go_forces(sh.ids) * r2.forces).sum()
            g2 = torch.autograd.grad(loss, params, allow_unused=True)
            out["force_loss"] = {
                n: (torch.zeros_like(p) if g is None else g)
                for (n, p), g in zip(model.named_parameters(), g2)
            }
    return out


def _serial(force_loss=False):
    model = make_model()
    system = make_system()
    ref = evaluate_plain(model, system)
    data = system_inputs(system, model.cutoff)
    x = system.positions.detach().requires_grad_(True)
    data["positions"] = x
    per_atom = model(data, compute_forces=False)["node_energy"]
    params = list(model.parameters())
    grads = torch.autograd.grad(per_atom, [x, *params], _go(system.ids))
    names = [n for n, _ in model.named_parameters()]
    out = {"system": system, "ref": ref, "grad_x": grads[0], "grad_params": dict(zip(names, grads[1:]))}
    if force_loss:
        data["positions"] = system.positions.detach().clone().requires_grad_(True)
        f = model(data, compute_forces=True, training=True)["forces"]
        g2 = torch.autograd.grad((_go_forces(system.ids) * f).sum(), params, allow_unused=True)
        out["force_loss"] = {
            n: (torch.zeros_like(p) if g is None else g) for n, p, g in zip(names, params, g2)
        }
    return out


def test_plain_model_is_the_hand_written_one():
    """Same math and parameter names: serial energies, forces and stress agree to round-off."""
    plain, hand = make_model(), MessagePassingPotential(**KW)
    assert [n for n, _ in plain.named_parameters()] == [n for n, _ in hand.named_parameters()]
    hand.load_state_dict(plain.state_dict())
    system = make_system()
    a, b = evaluate_plain(plain, system), evaluate(hand, system)
    assert_parity(a.energy, b.energy, what="plain vs hand-written mpnn: energy")
    assert_parity(a.forces, b.forces, what="plain vs hand-written mpnn: forces")
    assert_parity(a.stress, b.stress, what="plain vs hand-written mpnn: stress")


@pytest.mark.parametrize("nranks", [1, 2, 3, 4])
def test_plain_mpnn_unmodified_through_dispatch(nranks):
    fl = nranks == 2  # the force-loss double backward once (time)
    s = _serial(force_loss=fl)
    system, ref = s["system"], s["ref"]
    res = run_on_world(_rank_eval, nranks, nranks, None, fl)
    gid, where = str(nranks), f"plain mpnn via dispatch P={nranks}"
    assert_replicated([r["energy"] for r in res], f"energy {where}")
    assert_replicated([r["stress"] for r in res], f"stress {where}")
    assert_replicated([r["grad_params"] for r in res], f"parameter gradients {where}")
    if nranks > 1:
        assert all(r["n_halo"] > 0 for r in res)
    assert float(ref.forces.abs().max()) > 1e-3 and float(ref.stress.abs().max()) > 0
    assert_parity(res[0]["energy"], ref.energy, grid=gid, what=f"energy {where}")
    for key, full in (("per_atom", ref.per_atom), ("forces", ref.forces), ("grad_x", s["grad_x"])):
        pieces = [(r[key], rows_of(r["ids"], system.ids)) for r in res]
        assert_shards_cover(pieces, full, f"{key} {where}", disjoint=True)
        assert_parity(by_id(res, key, system.ids), full, grid=gid, what=f"{key} {where}")
    assert_parity(res[0]["stress"], ref.stress, grid=gid, what=f"stress {where}")
    assert_random_grad_output(res[0]["grad_x"])
    assert_grads_finite_nonzero(res[0]["grad_params"], where)
    for n, g in s["grad_params"].items():
        assert_parity(res[0]["grad_params"][n], g, grid=gid, what=f"d<g, per-atom E>/d{n} {where}")
    if fl:
        assert_replicated([r["force_loss"] for r in res], f"force-loss gradients {where}")
        for n, g in s["force_loss"].items():
            assert_parity(res[0]["force_loss"][n], g, grid=gid, what=f"d<g, F>/d{n} {where}")


@pytest.mark.parametrize(
    "plant,what",
    [
        ("halo_refresh", "forces"),
        ("halo_correction", "per_atom"),
        ("per_system_reduce", "energy"),
        ("replicated_grads", "stress"),
    ],
)
def test_negative_control_local_only_handler_fails_parity(plant, what):
    s = _serial()
    system, ref = s["system"], s["ref"]
    res = run_on_world(_rank_eval, 2, 2, plant)
    if what in ("energy", "stress"):
        actual, expected = res[0][what], getattr(ref, what)
    else:
        actual, expected = by_id(res, what, system.ids), getattr(ref, what)
    with pytest.raises(AssertionError, match=f"parity of {what} with {plant} local-only .* fails"):
        assert_parity(actual, expected, what=f"{what} with {plant} local-only", grid="2")


def _rank_disabled(name):
    model = make_model()
    system = make_system() if dist.get_rank() == 0 else None
    sh = ShardedSystem.scatter(system, cutoff=model.cutoff, skin=SKIN, grid=(2, 1, 1))
    try:
        with D.REGISTRY.disabled(name):
            DistributedPotential(model, mode="dispatch").compute(sh)
    except UnhandledAtomOp as exc:
        return str(exc)
    return "no error"


@pytest.mark.parametrize(
    "name,op", [("halo_refresh", "aten.index_select"), ("per_system_reduce", "aten.index_add")]
)
def test_disabled_handler_raises_naming_the_op(name, op):
    for msg in run_on_world(_rank_disabled, 2, name):
        assert op in msg, msg
