"""Adapters that run opaque kernels (``torch.library.custom_op``) on ShardTensors, and the halo
moves as custom ops.

A custom op's kernel is opaque: twinshard cannot see which rows it reads or writes, so on a
per-atom ShardTensor it never runs on local rows by default (``UnhandledAtomOp``, naming the
op). An *adapter* declares what the kernel needs, per argument and per output::

    adapt(torch.ops.mylib.pair_energy,
          inputs={"positions": HALO_PAD, "charges": OWNED_ROWS},
          outputs=[HALO_CORRECT])

    with distributed_scope():          # adapters installed here only
        e = torch.ops.mylib.pair_energy(positions, charges, senders, receivers)

Inside :func:`distributed_scope` a handler of :data:`twinshard.shard.dispatch.REGISTRY`
recognises the op (a custom op called with a ShardTensor reaches
``ShardTensor.__torch_function__`` as its ``OpOverload``, above autograd), applies the input
transforms, calls the op on plain local tensors (so the op's own ``register_autograd`` backward
runs), and applies the output transforms. Every transform is built from differentiable pieces
with exact adjoints (``to_local``/``from_local``, the halo custom ops below, ``comm`` collectives),
so backward through an adapter is the exact adjoint of its forward. Outside the scope the
handler is gone: a plain call runs serially as before, a ShardTensor call raises.

Input transforms (a ShardTensor argument; the kernel gets plain rows):

============== ======================================= =========================================
``HALO_PAD``   ``[owned | halo]`` rows with fresh halo  STALE: forward exchange; PARTIAL: reverse
               (an ``Owned`` input is padded with the   then forward; FRESH: none. Backward: the
               call's plan)                             adjoints (reverse / forward exchanges)
``GATHER``     every rank's owned rows, in rank order   all-gather (uneven); backward:
               (``Owned(counts)``: global row order)    reduce-scatter
``OWNED_ROWS`` the owned rows (halo rows dropped)       none; backward: zero gradient on the halo
``AS_IS``      the local rows unchanged (default)       none; a STALE/PARTIAL halo-padded tensor
                                                        raises (its halo rows are not copies)
============== ======================================= =========================================

A PARTIAL input's owned rows are completed first (its halo partial sums added onto their owners:
reverse exchange; backward: forward exchange) for ``HALO_PAD``, ``GATHER`` and ``OWNED_ROWS``.

Output transforms (the kernel's plain output; what the caller gets):

================ ===================================================== ==========================
``HALO_CORRECT`` ``[owned | halo]`` rows holding partial sums: halo    FRESH HaloPadded; reverse
                 rows summed onto their owners, owners' totals copied  + forward exchange; back-
                 back into the halo                                    ward: the same adjoints
``ALL_REDUCE``   per-rank partial sums -> the replicated total         all-reduce; backward:
                                                                       identity (counted once)
``OWNED_ROWS``   a block or gathered output sliced to this rank's rows ``Owned``; none; backward:
                                                                       zero-padded gradient
``AS_IS``        block rows -> STALE HaloPadded (halo rows unknown),   none
                 owned rows -> Owned, anything else unchanged
================ ===================================================== ==========================

The call's halo plan is that of its first ``HaloPadded`` ShardTensor argument, else the plan
given to :func:`distributed_scope`. An op whose per-atom inputs are all gathered computes the same
value on every rank: its outputs must be ``OWNED_ROWS`` (an all-reduce would count it P times, and
a replicated differentiable output would get P gradients through the gather's reduce-scatter);
other declarations raise.

A block output is recognised by its row count (``n_owned + n_halo``) where some input reached the
kernel as a block, so the choice is the same on every rank (on a rank without halo rows, block and
owned counts coincide). Declaration errors raise on every rank; an output whose row count is wrong
on some ranks only (a kernel's bug) raises there alone, as the dispatch's own shape checks do.

The halo moves are custom ops with registered autograd, each the other's backward:
``twinshard::halo_forward(Tensor x, int plan, str op)`` (owned rows -> halo copies) and
``twinshard::halo_reverse(Tensor y, int plan, str op)`` (halo partials -> owner sums). A custom
op takes tensors and scalars only, so the plan travels as an int handle into a table of live
plans (:func:`plan_handle`) that holds it for the duration of one call. Call them through
:func:`halo_forward` / :func:`halo_reverse`: these first agree across ranks on the autograd path
(``comm.agree_requires_grad``: one all_gather of a vote), so every rank runs its half of the
backward exchange; a rank with no halo rows and nothing to send still votes and completes.

Memory per rank: ``HALO_PAD`` / ``HALO_CORRECT`` hold one ``[n_owned + n_halo, ...]`` block;
``GATHER`` holds the full ``[N, ...]`` rows transiently (and for backward if the kernel saves its
input: O(N), use it only for inputs that are small per atom); the others hold nothing extra.
"""

from __future__ import annotations

import contextlib
import enum
import itertools
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

import twinshard.shard.dispatch  # noqa: F401  (the shipped handlers are registered before any adapter)
from twinshard.comm import ops
from twinshard.comm import primitives as prim
from twinshard.comm.ops import agree_requires_grad
from twinshard.shard.placements import HaloPadded, HaloState, Owned, ShardSpec
from twinshard.shard.reduce_handlers import partial_to_replicate
from twinshard.shard.registry import REGISTRY, Handler
from twinshard.shard.shard_tensor import ShardTensor, from_local, to_local

__all__ = [
    "ALL_REDUCE",
    "AS_IS",
    "GATHER",
    "HALO_CORRECT",
    "HALO_PAD",
    "OWNED_ROWS",
    "Adapter",
    "Move",
    "adapt",
    "adapter_of",
    "distributed_scope",
    "halo_forward",
    "halo_reverse",
    "plan_handle",
    "remove_adapter",
]


class Move(enum.Enum):
    """What an adapter does to one argument or output of a custom op (module docstring)."""

    HALO_PAD = "halo_pad"
    GATHER = "gather"
    OWNED_ROWS = "owned_rows"
    AS_IS = "as_is"
    HALO_CORRECT = "halo_correct"
    ALL_REDUCE = "all_reduce"


HALO_PAD, GATHER, OWNED_ROWS, AS_IS = Move.HALO_PAD, Move.GATHER, Move.OWNED_ROWS, Move.AS_IS
HALO_CORRECT, ALL_REDUCE = Move.HALO_CORRECT, Move.ALL_REDUCE
_INPUT_MOVES = (HALO_PAD, GATHER, OWNED_ROWS, AS_IS)
_OUTPUT_MOVES = (HALO_CORRECT, ALL_REDUCE, OWNED_ROWS, AS_IS)


# ---------------------------------------------------------------------- live plans (handles)
_PLANS: dict[int, Any] = {}
_KEYS = itertools.count(1)


@contextlib.contextmanager
def plan_handle(plan: Any) -> Iterator[int]:
    """An int handle to ``plan`` for a custom op's argument, live inside the block only."""
    for need in ("forward_copy", "reverse_sum", "n_owned", "n_halo"):
        if not hasattr(plan, need):
            raise TypeError(
                f"a halo plan for the halo custom ops needs .{need}; {type(plan).__name__} lacks it"
            )
    key = next(_KEYS)
    _PLANS[key] = plan
    try:
        yield key
    finally:
        del _PLANS[key]


def _plan(key: int) -> Any:
    try:
        return _PLANS[key]
    except KeyError:
        raise RuntimeError(
            f"halo plan handle {key} is not live: call the halo ops through "
            "twinshard.shard.custom_ops.halo_forward / halo_reverse"
        ) from None


# ---------------------------------------------------------------------- the halo custom ops
@torch.library.custom_op("twinshard::halo_forward", mutates_args=())
def _halo_forward_op(x: torch.Tensor, plan: int, op: str) -> torch.Tensor:
    return _plan(plan).forward_copy(x, op)


@torch.library.custom_op("twinshard::halo_reverse", mutates_args=())
def _halo_reverse_op(y: torch.Tensor, plan: int, op: str) -> torch.Tensor:
    return _plan(plan).reverse_sum(y, op)


@_halo_forward_op.register_fake
def _(x: torch.Tensor, plan: int, op: str) -> torch.Tensor:
    return x.new_empty((_plan(plan).n_halo,) + tuple(x.shape[1:]))


@_halo_reverse_op.register_fake
def _(y: torch.Tensor, plan: int, op: str) -> torch.Tensor:
    return y.new_empty((_plan(plan).n_owned,) + tuple(y.shape[1:]))


def _setup(ctx: Any, inputs: tuple, output: torch.Tensor) -> None:
    ctx.plan, ctx.op = _plan(inputs[1]), inputs[2]  # the plan itself: backward may run after the call


def _backward_name(op: str) -> str:
    return op if op.endswith(":backward") else op + ":backward"


def _backward_of_forward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor, None, None]:
    with plan_handle(ctx.plan) as key:
        return _halo_reverse_op(g.contiguous(), key, _backward_name(ctx.op)), None, None


def _backward_of_reverse(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor, None, None]:
    with plan_handle(ctx.plan) as key:
        return _halo_forward_op(g.contiguous(), key, _backward_name(ctx.op)), None, None


# looked up at call time, so a test can plant a bug in one backward
_halo_forward_op.register_autograd(lambda ctx, g: _backward_of_forward(ctx, g), setup_context=_setup)
_halo_reverse_op.register_autograd(lambda ctx, g: _backward_of_reverse(ctx, g), setup_context=_setup)


def _vote(t: torch.Tensor, plan: Any, op: str) -> None:
    if t.is_floating_point():  # integer payloads (atomic numbers) never take the autograd path
        agree_requires_grad(t.requires_grad, op, getattr(plan, "group", None))


def halo_forward(x: torch.Tensor, plan: Any, op: str = "halo_forward") -> torch.Tensor:
    """Halo copies ``[n_halo, ...]`` of owned rows ``x [n_owned, ...]`` via ``twinshard::halo_forward``.

    Placements: in, this rank's owned rows (plain); out, its halo rows (plain). Collectives:
    forward, one vote (all_gather of two ints, floating ``x`` only) and one neighbour exchange;
    backward, the reverse exchange (``twinshard::halo_reverse``, ledger ``<op>:backward``), whose
    own backward is this exchange again (double backward). Memory: nothing saved but the plan."""
    if x.shape[0] != plan.n_owned:
        raise ValueError(f"halo forward: expected {plan.n_owned} owned rows, got {x.shape[0]}")
    _vote(x, plan, op)
    with plan_handle(plan) as key:
        return _halo_forward_op(x.contiguous(), key, op)


def halo_reverse(y: torch.Tensor, plan: Any, op: str = "halo_reverse") -> torch.Tensor:
    """Owner sums ``[n_owned, ...]`` of halo partials ``y [n_halo, ...]`` via ``twinshard::halo_reverse``
    (accumulated in ``promote_types(dtype, float32)``).

    Placements: in, this rank's halo rows (plain partial sums); out, its owned rows (plain).
    Collectives: forward, one vote and one neighbour exchange; backward, the forward exchange.
    Memory: nothing saved but the plan."""
    if y.shape[0] != plan.n_halo:
        raise ValueError(f"halo reverse: expected {plan.n_halo} halo rows, got {y.shape[0]}")
    _vote(y, plan, op)
    with plan_handle(plan) as key:
        return _halo_reverse_op(y.contiguous(), key, op)


# ---------------------------------------------------------------------- declarations
def _overload(op: Any) -> torch._ops.OpOverload:
    if isinstance(op, torch._ops.OpOverload):
        return op
    if isinstance(op, torch._ops.OpOverloadPacket):
        return op.default
    qualname = getattr(op, "_qualname", None)  # a CustomOpDef
    if isinstance(qualname, str) and "::" in qualname:
        ns, name = qualname.split("::")
        return getattr(getattr(torch.ops, ns), name).default
    raise TypeError(f"adapt: expected a custom op (CustomOpDef, torch.ops.ns.name[.overload]), got {op!r}")


def _key(func: Any) -> tuple[str, str] | None:
    if isinstance(func, torch._ops.OpOverload):
        return func._schema.name, func._overloadname or "default"
    if isinstance(func, torch._ops.OpOverloadPacket):
        return func._qualified_op_name, "default"
    return None


@dataclass(frozen=True)
class Adapter:
    """A custom op and the transform of each named argument (others: ``AS_IS``) and output."""

    op: torch._ops.OpOverload
    inputs: Mapping[str, Move] = field(default_factory=dict)
    outputs: tuple[Move, ...] = ()

    @property
    def name(self) -> str:
        return f"{self.op._schema.name}.{self.op._overloadname or 'default'}"

    def bind(self, args: tuple, kwargs: dict) -> dict[str, Any]:
        """The call's arguments by schema name (omitted defaults stay omitted)."""
        out = {}
        for i, a in enumerate(self.op._schema.arguments):
            if i < len(args):
                out[a.name] = args[i]
            elif a.name in kwargs:
                out[a.name] = kwargs[a.name]
        return out


_ADAPTERS: dict[tuple[str, str], Adapter] = {}


def adapt(
    op: Any, inputs: Mapping[str, Move] | None = None, outputs: Sequence[Move] | None = None
) -> Adapter:
    """Declare (or replace) the adapter of ``op``; active inside :func:`distributed_scope`.

    ``inputs`` maps argument names of the op's schema to an input move (undeclared: ``AS_IS``);
    ``outputs`` lists one output move per return (default: ``AS_IS`` each). Only functional ops
    (``mutates_args=()``) can be adapted. Raises ``ValueError`` for unknown names or moves. No
    collective: declarations are per process; declare the same ones on every rank (at import)."""
    ov = _overload(op)
    schema = ov._schema
    if any(a.alias_info is not None and a.alias_info.is_write for a in schema.arguments):
        raise ValueError(
            f"adapt: {schema.name} mutates an argument; only functional custom ops can be adapted"
        )
    names = [a.name for a in schema.arguments]
    inputs = dict(inputs or {})
    for n, m in inputs.items():
        if n not in names:
            raise ValueError(f"adapt: {schema.name} has no argument {n!r} (arguments: {names})")
        if m not in _INPUT_MOVES:
            raise ValueError(f"adapt: input {n!r} of {schema.name}: {m} is not one of {list(_INPUT_MOVES)}")
    outs = tuple(outputs) if outputs is not None else (AS_IS,) * len(schema.returns)
    if len(outs) != len(schema.returns):
        raise ValueError(
            f"adapt: {schema.name} returns {len(schema.returns)} values, {len(outs)} output moves given"
        )
    for m in outs:
        if m not in _OUTPUT_MOVES:
            raise ValueError(f"adapt: output of {schema.name}: {m} is not one of {list(_OUTPUT_MOVES)}")
    ad = Adapter(ov, inputs, outs)
    _ADAPTERS[_key(ov)] = ad  # type: ignore[index]
    return ad


def adapter_of(op: Any) -> Adapter | None:
    return _ADAPTERS.get(_key(_overload(op)))  # type: ignore[arg-type]


def remove_adapter(op: Any) -> Adapter | None:
    return _ADAPTERS.pop(_key(_overload(op)), None)  # type: ignore[arg-type]


# ---------------------------------------------------------------------- the scope
_SCOPE_PLANS: list[Any] = []
HANDLER_NAME = "custom_op_adapters"


@contextlib.contextmanager
def distributed_scope(plan: Any = None) -> Iterator[None]:
    """Install the custom-op adapters (a handler of the dispatch registry) inside the block.

    ``plan``: the halo plan for calls that have no ``HaloPadded`` ShardTensor argument (an
    ``Owned`` input declared ``HALO_PAD``, a ``HALO_CORRECT`` output). Scopes nest; the handler
    goes when the outermost exits, and with it every adapter: outside, a custom op on a plain
    tensor runs serially, on a per-atom ShardTensor it raises ``UnhandledAtomOp``. No collective."""
    if not _SCOPE_PLANS:
        REGISTRY.register(Handler(HANDLER_NAME, _matches, _run, "adapted custom ops"), first=True)
    _SCOPE_PLANS.append(plan)
    try:
        yield
    finally:
        _SCOPE_PLANS.pop()
        if not _SCOPE_PLANS:
            REGISTRY.unregister(HANDLER_NAME)


def _scope_plan() -> Any:
    return next((p for p in reversed(_SCOPE_PLANS) if p is not None), None)


def _matches(func: Any, args: tuple, kwargs: dict) -> bool:
    k = _key(func)
    return k is not None and k in _ADAPTERS


# ---------------------------------------------------------------------- one adapted call
@dataclass
class _Call:
    name: str
    plan: Any = None
    halo_spec: ShardSpec | None = None  # of the first HaloPadded argument (or the scope plan's)
    group: Any = None
    counts: list[int] | None = None  # row counts of a GATHER (every rank's)
    owned: tuple[int, ShardSpec] | None = None  # rows and spec of the first Owned argument
    local: bool = False  # some per-atom input kept this rank's rows (rank-dependent result)
    gathered: bool = False
    padded: bool = False  # some input reached the kernel as a [owned | halo] block


def _flat(v: Any) -> list[Any]:
    return list(v) if isinstance(v, (list, tuple)) else [v]


def _context(ad: Adapter, bound: dict[str, Any]) -> _Call:
    c = _Call(ad.name)
    sts = [t for v in bound.values() for t in _flat(v) if isinstance(t, ShardTensor)]
    halo = next((t for t in sts if t._spec.halo), None)
    if halo is not None:
        c.plan, c.halo_spec = halo.plan, halo._spec.with_state(HaloState.FRESH)
    elif _scope_plan() is not None:
        c.plan = _scope_plan()
        group = sts[0].group if sts else getattr(c.plan, "group", None)
        c.halo_spec = ShardSpec(HaloPadded(c.plan), HaloState.FRESH, group)
    c.group = sts[0].group if sts else getattr(c.plan, "group", None)
    own = next((t for t in sts if isinstance(t._spec.placement, Owned) and t._spec.per_atom), None)
    if own is not None:
        c.owned = (int(own.shape[0]), own._spec)
    return c


def _need_plan(c: _Call, what: str) -> Any:
    if c.plan is None:
        raise ValueError(
            f"{c.name}: {what} needs a halo plan: pass a HaloPadded ShardTensor argument or "
            "distributed_scope(plan=...)"
        )
    return c.plan


def _input(c: _Call, move: Move, name: str, v: Any) -> Any:
    if isinstance(v, (list, tuple)):
        return type(v)(_input(c, move, name, t) for t in v)
    if not isinstance(v, ShardTensor):
        if move is not AS_IS and isinstance(v, torch.Tensor):
            raise ValueError(
                f"{c.name}: argument {name!r} is declared {move.name} but is a plain tensor; "
                "pass the per-atom ShardTensor (or declare it AS_IS)"
            )
        return v
    spec = v._spec
    if not spec.per_atom:
        return to_local(v)  # per-system rows are replicated: every move keeps them
    if move is AS_IS:
        if spec.halo and spec.state != HaloState.FRESH:
            raise ValueError(
                f"{c.name}: argument {name!r} is declared AS_IS but is a {spec.state.value.upper()} "
                "halo-padded ShardTensor: its halo rows are not copies of their owners' rows. Declare "
                "it HALO_PAD (the kernel reads halo rows) or OWNED_ROWS (it reads owned rows only)"
            )
        c.local, c.padded = True, c.padded or spec.halo
        return to_local(v)
    if move is OWNED_ROWS:
        c.local = True
        if c.owned is None:  # an OWNED_ROWS / AS_IS output of n_owned rows is Owned
            c.owned = (v.n_owned, spec.owned() if spec.halo else spec)
        return _owned_of(v)
    if move is HALO_PAD:
        c.local = c.padded = True
        return _halo_pad(c, name, v)
    return _gather(c, v)


def _owned_of(v: ShardTensor) -> torch.Tensor:
    """The complete owned rows (differentiable): a PARTIAL tensor's halo partial sums are added onto
    their owners first (reverse exchange; backward: forward exchange)."""
    local = to_local(v)
    if not v._spec.halo:
        return local
    n = v.plan.n_owned
    if v.state == HaloState.PARTIAL:
        return local[:n] + halo_reverse(local[n:], v.plan)
    return local[:n]


def _halo_pad(c: _Call, name: str, v: ShardTensor) -> torch.Tensor:
    if v._spec.halo:
        plan = v.plan
        if v.state == HaloState.FRESH:
            return to_local(v)
        own = _owned_of(v)
    else:
        local = to_local(v)
        plan = _need_plan(c, f"HALO_PAD of the Owned argument {name!r}")
        if local.shape[0] != plan.n_owned:
            raise ValueError(
                f"{c.name}: argument {name!r} has {local.shape[0]} owned rows, the halo plan {plan.n_owned}"
            )
        own = local
    return torch.cat([own, halo_forward(own, plan)])


def _gather(c: _Call, v: ShardTensor) -> torch.Tensor:
    rows = _owned_of(v)
    pl = v._spec.placement
    counts = getattr(pl, "counts", None)
    if counts is None:
        mine = torch.tensor([[rows.shape[0]]], dtype=torch.int64, device=rows.device)
        counts = prim.all_gather(mine, 0, v.group, op="custom_op_gather").flatten().tolist()
    counts = [int(n) for n in counts]
    if c.counts is not None and c.counts != counts:
        raise ValueError(f"{c.name}: GATHER inputs have different row counts ({c.counts} vs {counts})")
    c.counts, c.gathered = counts, True
    return ops.all_gather(rows, 0, v.group, counts)


def _output(c: _Call, move: Move, t: Any) -> Any:
    if not isinstance(t, torch.Tensor):
        return t
    if c.gathered and not c.local and move is not OWNED_ROWS:
        raise ValueError(
            f"{c.name}: every per-atom input is gathered, so every rank computes the same output; "
            f"declare the outputs OWNED_ROWS (each rank keeps its rows), not {move.name}"
        )
    if move is ALL_REDUCE:
        return partial_to_replicate(t, c.group)
    rows = int(t.shape[0]) if t.dim() else -1
    block = None if c.plan is None else int(c.plan.n_owned) + int(c.plan.n_halo)
    # a block layout only where an input was a block (a replicated fact): on a rank without halo
    # rows, block and owned counts coincide, and every rank must pick the same placement
    padded = c.padded and rows == block
    if move is HALO_CORRECT:
        plan = _need_plan(c, "a HALO_CORRECT output")
        if rows != block:
            raise ValueError(
                f"{c.name}: a HALO_CORRECT output needs {block} block rows, the op returned {rows}"
            )
        n = plan.n_owned
        own = t[:n] + halo_reverse(t[n:], plan)
        return from_local(torch.cat([own, halo_forward(own, plan)]), c.halo_spec)
    if move is OWNED_ROWS:
        if padded:
            return from_local(t[: c.plan.n_owned], c.halo_spec.owned())  # type: ignore[union-attr]
        if c.counts is not None and rows == sum(c.counts):
            me = prim.group_rank(c.group)
            off = sum(c.counts[:me])
            spec = ShardSpec(Owned(tuple(c.counts)), group=c.group)
            return from_local(t[off : off + c.counts[me]], spec)
        if c.owned is not None and rows == c.owned[0]:
            return from_local(t, c.owned[1])
        raise ValueError(
            f"{c.name}: an OWNED_ROWS output of {rows} rows matches no layout of the call "
            f"(block {block}, gathered {None if c.counts is None else sum(c.counts)}, "
            f"owned {None if c.owned is None else c.owned[0]})"
        )
    if padded:  # AS_IS: halo rows unknown until refreshed
        return from_local(t, c.halo_spec.with_state(HaloState.STALE))  # type: ignore[union-attr]
    if c.owned is not None and rows == c.owned[0]:
        return from_local(t, c.owned[1])
    return t


def _run(func: Any, args: tuple, kwargs: dict) -> Any:
    ad = _ADAPTERS[_key(func)]  # type: ignore[index]
    bound = ad.bind(args, kwargs)
    c = _context(ad, bound)
    local = {n: _input(c, ad.inputs.get(n, AS_IS), n, v) for n, v in bound.items()}
    out = ad.op(**local)
    if isinstance(out, (tuple, list)):
        return type(out)(_output(c, m, t) for m, t in zip(ad.outputs, out))
    return _output(c, ad.outputs[0], out)
