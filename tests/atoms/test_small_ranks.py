"""Ranks that hold one atom row or none: MACE (mace-torch, unmodified, random weights) through the
dispatch in graph and halo storage, against mace-torch's own calculator.

aten lowers a few ops by the sizes it sees, and a rank with one atom row sees sizes the others do
not: e3nn's compiled ``Linear`` to one channel (MACE's readouts) is ``tensordot(x [1, k], w [k,
1])``, which aten turns into ``dot`` of the row viewed as a vector; a rank with no rows meets
``out.view(0, -1)`` (mace's symmetric contraction), ambiguous to aten. Both used to fail on such a
rank, the first with an empty ``RuntimeError:`` (the dispatch's refusal, raised inside TorchScript,
lost its text) and the others waiting in their next collective. Cases (skin 0):

- graph storage, a 3-atom molecule at 2, 3 and 4 ranks (counts ``[2, 1]``, ``[1, 1, 1]``,
  ``[1, 1, 1, 0]``): one-atom ranks with edges to the other ranks' atoms, and a rank without atoms;
- halo storage, block partition at 4 ranks: a 4-atom system with an isolated atom (a block of one
  row and no halo: ``[1 | 0]``) and the 3-atom molecule (an empty block ``[0 | 0]``);
- halo storage, spatial partition ``2x1x1`` of the 4-atom system: rank 0 owns three atoms and
  imports none, rank 1 owns the isolated atom and imports one of rank 0's (so rank 0 sends rows
  although it has no halo of its own).

Each: energy, per-atom energies and forces equal ``MACECalculator(models=model,
default_dtype="float64")`` (``assert_parity``'s fp64 round-off gate); the backward of a random
grad_output on the per-atom energies (positions and every parameter) equals serial MACE's. The
per-atom pieces are disjoint, covering and strict (``assert_shards_cover``; an empty rank holds
none).

TorchScript errors: a refusal raised by the dispatch inside scripted code surfaces as itself
(type, message, traceback), chained from the TorchScript error that says where; with the one-atom
lowering switched off (a planted regression) every rank of a 3-rank world reports
``UnhandledAtomOp`` naming ``aten.dot``. A rank's report of an exception without a message says
so (its type, repr, cause, and for TorchScript how to see the text: ``PYTORCH_JIT=0``).
"""

import pytest
import torch
import torch.distributed as dist
from torch import nn

from twinshard.atoms.data.system import System
from twinshard.atoms.parallel.distributed import DistributedPotential
from twinshard.atoms.parallel.graph_storage import GraphSharded
from twinshard.atoms.parallel.plain_inputs import system_inputs
from twinshard.atoms.parallel.sharded import ShardedSystem
from twinshard.atoms.potentials.mace import MaceAdapter, build_mace, mace_native
from twinshard.rng import normal
from twinshard.runtime.errors import RankFailure
from twinshard.runtime.world import format_exception
from twinshard.shard import small_blocks
from twinshard.shard.placements import HaloPadded, HaloState, Owned, ShardSpec
from twinshard.shard.shard_tensor import ShardTensor, UnhandledAtomOp, from_local, to_local
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

_MODELS: dict[str, nn.Module] = {}
CASES = {
    "graph-2": ("graph", "molecule", 2, {}),
    "graph-3": ("graph", "molecule", 3, {}),
    "graph-4": ("graph", "molecule", 4, {}),
    "halo-block-one-row": ("halo", "isolated", 4, {"partition": "block"}),
    "halo-block-empty": ("halo", "molecule", 4, {"partition": "block"}),
    "halo-spatial": ("halo", "isolated", 2, {"grid": (2, 1, 1)}),
}


def _model():
    if "m" not in _MODELS:  # built once per worker process (seeded: the same weights everywhere)
        _MODELS["m"] = build_mace()
    return _MODELS["m"]


def molecule():
    """A bent O-H-H molecule in vacuum (ids not in row order)."""
    x = torch.tensor([[0.0, 0.0, 0.0], [0.97, 0.05, 0.0], [-0.25, 0.93, 0.1]], dtype=torch.float64)
    return System(positions=x + 5.0, numbers=torch.tensor([8, 1, 1]), ids=torch.tensor([12, 10, 11]))


def isolated():
    """The molecule and a carbon atom 9 A away (farther than the cutoff from every atom)."""
    m = molecule()
    x = torch.cat([m.positions, torch.tensor([[14.0, 5.5, 5.2]], dtype=torch.float64)])
    return System(positions=x, numbers=torch.tensor([8, 1, 1, 6]), ids=torch.tensor([12, 10, 11, 13]))


SYSTEMS = {"molecule": molecule, "isolated": isolated}


def _go(ids):
    return normal(11, 1, ids.to(torch.int64))


def _calculator(system):
    """mace-torch's own calculator (on a copy of the model: it freezes the parameters it gets)."""
    got = mace_native(_model(), system.to_ase(), compute_stress=False)
    return {"energy": got["energy"][0], "per_atom": got["node_energy"], "forces": got["forces"]}


def _serial_grads(system):
    """d<g, per-atom E>/d(positions, parameters) of serial MACE (plain tensors), g random by id."""
    model = MaceAdapter(_model())
    data = system_inputs(system, model.cutoff)
    x = system.positions.detach().clone().requires_grad_(True)
    data["positions"] = x
    per_atom = model(data, compute_forces=False)["node_energy"]
    named = list(model.named_parameters())
    assert all(p.requires_grad for _, p in named)  # a calculator given the model would freeze them
    grads = torch.autograd.grad(per_atom, [x, *[p for _, p in named]], _go(system.ids))
    return grads[0], {n: g for (n, _), g in zip(named, grads[1:])}


def _scatter(storage, system, nranks, kw):
    cutoff = float(_model().r_max)
    if storage == "graph":
        return GraphSharded.scatter(system, cutoff=cutoff, skin=0.0)
    return ShardedSystem.scatter(system, cutoff=cutoff, skin=0.0, **kw)


def _rank(case):
    storage, which, nranks, kw = CASES[case]
    system = SYSTEMS[which]() if dist.get_rank() == 0 else None
    sh = _scatter(storage, system, nranks, kw)
    dp = DistributedPotential(MaceAdapter(_model()), mode="dispatch")
    res = dp.compute(sh, compute_stress=False)
    x = sh.positions.detach().requires_grad_(True)
    per_atom = dp.per_atom_energies(sh, x)
    named = list(dp.module.named_parameters())
    go = _go(sh.ids).to(per_atom.dtype)
    grads = torch.autograd.grad(per_atom, [x, *[p for _, p in named]], go)
    return {
        "ids": sh.ids,
        "rows": (sh.n_owned, sh.n_halo),
        "energy": res.energy,
        "per_atom": res.per_atom,
        "forces": res.forces,
        "grad_output": go,
        "grad_x": grads[0],
        "grad_params": {n: g for (n, _), g in zip(named, grads[1:])},
    }


ROWS = {  # (owned, halo) rows per rank: the small blocks each case is about
    "graph-2": [(2, 0), (1, 0)],
    "graph-3": [(1, 0), (1, 0), (1, 0)],
    "graph-4": [(1, 0), (1, 0), (1, 0), (0, 0)],
    "halo-block-one-row": [(1, 2), (1, 2), (1, 2), (1, 0)],
    "halo-block-empty": [(1, 2), (1, 2), (1, 2), (0, 0)],
    "halo-spatial": [(3, 0), (1, 1)],
}


@pytest.mark.parametrize("case", list(CASES))
def test_mace_on_one_atom_and_empty_ranks_equals_mace_calculator(case):
    storage, which, nranks, _ = CASES[case]
    system = SYSTEMS[which]()
    ref = _calculator(system)
    grad_x, grad_params = _serial_grads(system)
    res = run_on_world(_rank, nranks, case)
    where, gid = f"MACE {case} (rows {ROWS[case]})", str(nranks)
    assert [r["rows"] for r in res] == ROWS[case]
    assert float(ref["forces"].abs().max()) > 1e-3
    assert_replicated([r["energy"] for r in res], f"energy {where}")
    assert_parity(res[0]["energy"], ref["energy"], grid=gid, what=f"energy {where} vs MACECalculator")
    for key, full, oracle in (
        ("per_atom", ref["per_atom"], "MACECalculator"),
        ("forces", ref["forces"], "MACECalculator"),
        ("grad_x", grad_x, "serial MACE, random grad_output"),
    ):
        pieces = [(r[key], rows_of(r["ids"], system.ids)) for r in res]
        assert_shards_cover(pieces, full, f"{key} {where}", disjoint=True, allow_empty=True)
        assert_parity(by_id(res, key, system.ids), full, grid=gid, what=f"{key} {where} vs {oracle}")
    assert_random_grad_output(torch.cat([r["grad_output"] for r in res]))
    assert_replicated([r["grad_params"] for r in res], f"parameter gradients {where}")
    assert_grads_finite_nonzero(res[0]["grad_params"], where)
    assert len(grad_params) == len(res[0]["grad_params"]) > 10
    for n, g in grad_params.items():
        assert_parity(res[0]["grad_params"][n], g, grid=gid, what=f"d<g, per-atom E>/d{n} {where}")


# ---------------------------------------------------------------------- TorchScript errors
def _rank_planted():
    """The one-atom lowering switched off: every rank (one atom each) refuses tensordot's dot."""
    saved = small_blocks.ONE_ATOM_CONTRACTIONS
    small_blocks.ONE_ATOM_CONTRACTIONS = frozenset()
    try:
        return _rank("graph-3")
    finally:
        small_blocks.ONE_ATOM_CONTRACTIONS = saved


def test_refusal_inside_torchscript_reaches_every_rank_with_its_message():
    with pytest.raises(RankFailure) as info:
        run_on_world(_rank_planted, 3)
    err = info.value
    assert sorted(err.failures) == [0, 1, 2]
    for rank, text in err.failures.items():
        assert "UnhandledAtomOp: aten.dot.default" in text, f"rank {rank}: {text[-2000:]}"
        assert "contracts the atom dimension" in text and "TorchScript" in text
    assert "UnhandledAtomOp: aten.dot.default" in str(err)


class _SumOverAtoms(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.sum(0)


def test_refusal_inside_a_scripted_module_keeps_its_type_and_message():
    x = ShardTensor.wrap(torch.randn(3, 2, dtype=torch.float64), ShardSpec(Owned()))
    scripted = torch.jit.script(_SumOverAtoms())
    with pytest.raises(UnhandledAtomOp, match="reduces over the atom dimension") as info:
        scripted(x)
    assert "TorchScript" in str(info.value.__cause__)  # the scripted code's traceback: where
    assert "reduces over the atom dimension" in format_exception(info.value)


class _Loud(torch.Tensor):
    """A wrapper subclass whose dispatch raises on ``dot``, with no record: TorchScript drops it."""

    @staticmethod
    def __new__(cls, x):
        r = torch.Tensor._make_wrapper_subclass(cls, x.shape, strides=x.stride(), dtype=x.dtype)
        r._x = x
        return r

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        if func is torch.ops.aten.dot.default:
            raise ValueError("the text TorchScript drops")
        args = [a._x if isinstance(a, _Loud) else a for a in args]
        out = func(*args, **(kwargs or {}))
        return _Loud(out) if isinstance(out, torch.Tensor) else out


class _Readout(nn.Module):
    def forward(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return torch.tensordot(x, w, ([1], [0]))


def test_a_report_of_an_exception_without_a_message_says_what_it_was():
    try:
        raise RuntimeError()
    except RuntimeError as exc:
        text = format_exception(exc)
    assert "this builtins.RuntimeError has no message of its own; repr: RuntimeError()" in text
    try:
        torch.jit.script(_Readout())(_Loud(torch.randn(1, 4)), torch.randn(4, 1))
    except RuntimeError as exc:
        assert str(exc).rstrip().endswith("RuntimeError:")  # what TorchScript leaves of it
        text = format_exception(exc)
    else:
        raise AssertionError("the planted dispatch error did not raise")
    assert "has no message of its own" in text and "PYTORCH_JIT=0" in text
    assert "has no message" not in format_exception(ValueError("a message"))


# ---------------------------------------------------------------------- the lowerings, one process
class _Plan:
    """A halo plan stub of one owned row and no halo (no op here exchanges)."""

    n_owned = 1
    n_halo = 0

    def forward(self, x):
        raise AssertionError("no exchange expected")

    reverse = forward


@pytest.mark.parametrize("state", [HaloState.FRESH, HaloState.STALE])
def test_one_row_tensordot_keeps_the_atom_row_and_its_state(state):
    """tensordot of a one-row block to one channel (lowered to dot inside TorchScript) is that
    row's value as a one-row ShardTensor with the block's halo state; its backward (random
    grad_output) equals plain autograd's."""
    gen = torch.Generator().manual_seed(2)
    local = torch.randn(1, 6, dtype=torch.float64, generator=gen, requires_grad=True)
    w = torch.randn(6, 1, dtype=torch.float64, generator=gen, requires_grad=True)
    spec = ShardSpec(HaloPadded(_Plan()), state)
    y = torch.jit.script(_Readout())(from_local(local, spec), w)
    assert isinstance(y, ShardTensor) and y.shape == (1, 1) and y.state == state
    want = local @ w
    assert_parity(to_local(y), want, what="one-row tensordot vs mm")
    go = torch.tensor([[0.7]], dtype=torch.float64)
    got = torch.autograd.grad(y, [local, w], go)
    exp = torch.autograd.grad(want, [local, w], go)
    assert_parity(got[0], exp[0], what="one-row tensordot: d/dx")
    assert_parity(got[1], exp[1], what="one-row tensordot: d/dw")
    # the 0-d value of the one atom: views back to one row are per-atom; other ops refuse
    v = torch.dot(ShardTensor.wrap(local.detach().reshape(6), spec.with_row_block(6)), w.detach().reshape(6))
    assert isinstance(v, small_blocks.AtomScalar)
    assert isinstance((v * 2.0).view(1), ShardTensor)
    with pytest.raises(UnhandledAtomOp, match="value of a one-atom block"):
        v.item()


def test_dot_over_several_atoms_still_refuses():
    x = ShardTensor.wrap(torch.randn(3, dtype=torch.float64), ShardSpec(Owned()))
    with pytest.raises(UnhandledAtomOp, match="contracts the atom dimension"):
        torch.dot(x, torch.randn(3, dtype=torch.float64))


class _Flat(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.view(x.shape[0], -1)


def test_view_of_an_empty_block_infers_the_size_per_row():
    x = ShardTensor.wrap(torch.zeros(0, 3, 4, dtype=torch.float64), ShardSpec(Owned()))
    for y, shape in (
        (x.view(0, -1), (0, 12)),
        (torch.jit.script(_Flat())(x), (0, 12)),
        (x.view(0, 2, -1), (0, 2, 6)),
    ):
        assert isinstance(y, ShardTensor) and tuple(y.shape) == shape
    assert small_blocks.resolve_empty_view(x, [0, 0, -1]) is None  # ambiguous for every rank


class _EmptyPlan:
    """A halo plan stub of a block without rows."""

    n_owned = 0
    n_halo = 0

    def forward(self, x):
        raise AssertionError("no exchange expected")

    reverse = forward


def test_a_plain_operand_makes_an_empty_block_stale_as_it_does_a_full_one():
    """The halo state must not depend on the row count (the next gather's refresh is collective):
    a pointwise op with a plain per-row operand is STALE on a block without rows as on one with."""
    for plan, n in ((_EmptyPlan(), 0), (_PlanOf(3), 3)):
        x = ShardTensor.wrap(
            torch.zeros(n, 2, dtype=torch.float64), ShardSpec(HaloPadded(plan), HaloState.FRESH)
        )
        assert (x + torch.zeros(n, 2, dtype=torch.float64)).state == HaloState.STALE
        assert (x * 2.0).state == HaloState.FRESH


class _PlanOf(_EmptyPlan):
    def __init__(self, n):
        self.n_owned = n
