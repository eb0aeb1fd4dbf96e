"""AdamW with its state and the parameter gradients sharded over the ranks of a mesh (ZeRO-1/2).

:class:`ShardedAdamW` keeps, on each of the ``P = dp x rows x cols`` ranks of a
``twinshard.runtime.mesh.DPCPMesh``, one contiguous ``1/P`` chunk of the flattened trainable
parameters' gradient and AdamW moments (``exp_avg``, ``exp_avg_sq``) instead of all of them;
the parameters themselves stay replicated (what the CP twins compute with).

Gradients (``shard_grads_in_backward=True``, the default: ZeRO-2 proper). The flat vector,
padded to ``P * m``, is cut into ``P`` chunks of ``m``; chunk ``k`` belongs to world rank
``k = d * rows * cols + pos``. The rank at grid position ``pos`` of replica ``d`` sends the chunks
``{e * rows * cols + pos}_e`` (one per replica, ``dp * m = L dp / P`` elements, its "send
buffer"). The twins' replicated parameters get their replica's complete gradient from their own
CP all-reduce inside backward (``comm.sync_params`` / ``sync_grad``: identical on the ranks of one
replica), and the engine's AccumulateGrad writes ``p.grad``; a ``post_accumulate_grad`` hook on
every trainable parameter then ADDS the flat ranges of ``p.grad`` that fall in this rank's send
buffer into a persistent accumulation buffer (allocated at the first hook, in the parameters'
dtype) and sets ``p.grad = None``. So right after ``loss.backward()`` every ``p.grad`` is None and
the buffer holds this rank's ranges of the (summed, when several backward passes accumulate)
replica gradient; a parameter that backward never reached counts as zero. The hook is local: no
collective is added to backward. With ``shard_grads_in_backward=False`` (the ZeRO-1-like path of
before, kept for comparison) backward leaves the full gradients in ``p.grad`` and the step copies
the same ranges out of them; either way the step also adds any ``p.grad`` left set (a gradient
written outside backward).

A step (:meth:`ShardedAdamW.reduce_and_step`, after backward). The ranks at grid position ``pos``
of every replica (``dp_group``) reduce-scatter their weighted send buffers (``weight = B_d / B``),
so each rank receives exactly its chunk of ``sum_d weight_d g_d`` -- the whole batch's gradient --
having sent ``(dp - 1) / (dp rows cols)`` of the vector (with ``dp = 1``: no communication, the
buffer is its chunk). Each rank steps its chunk with a stock ``torch.optim.AdamW`` over one flat
parameter (AdamW is elementwise: shard-invariant, the same math as the serial optimizer's), then
the updated chunks are all-gathered over the world and copied into the parameters.

Why not FSDP2's ``fully_shard``: the twins' parameters are plain replicated tensors whose
gradients come back complete from each twin's own CP all-reduce inside backward, so FSDP2's
reduce-scatter over the whole mesh would sum ``rows x cols`` identical copies (right only through
its averaging divisor, which cannot weight uneven replica batches exactly), and it would replace
the parameters by DTensors that it unshards with module hooks the twins' functional calls do
not see. Written on ``torch.distributed`` collectives through ``twinshard.comm.primitives``
(gloo and NCCL alike), the sharding is exactly the update's data and nothing else.

Collectives per step: none in backward (the hooks are local; the twins' own CP all-reduces are
unchanged), one reduce-scatter over ``dp_group`` (skipped when ``dp = 1``), one all-gather over
the world, in the parameters' dtype (sums in >= fp32). Memory per rank: the moments and the
gradient chunk ``3 L / P`` plus a flat parameter chunk ``L / P`` (``L``: the trainable elements),
instead of ``3 L``. During backward (in-backward sharding): the send buffer ``L dp / P`` plus the
gradients the engine holds whole until their AccumulateGrad fires -- the limit: one CP gradient
bucket (a layer's parameters, flattened by its ``sync_params`` all-reduce) or one parameter's
gradient at a time, rather than the full gradients ``L`` at the end of backward. After-backward
sharding instead holds the full gradients ``L`` at the end of backward plus the send buffer
``L / (rows cols)`` copied from them. In the step, transiently: the chunk's AdamW temporaries (one
``PIECE`` at a time) and the gathered parameters ``L``. Parameters (``L``) stay replicated.

Limits: between ``backward`` and the step ``p.grad`` is None (no gradient clipping or inspection
on ``p.grad`` there: use ``shard_grads_in_backward=False`` or ``keep_grads``); the buffer
accumulates over ``backward`` calls exactly as ``p.grad`` would, until :meth:`zero_grad`
(``dp_train_step`` calls it first; ``torch.autograd.grad`` does not accumulate and feeds no
hook). One live ``ShardedAdamW`` with in-backward
sharding per parameter (a second one over the same parameters raises; :meth:`remove_hooks`
releases them).
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist
from torch.utils.weak import WeakIdKeyDictionary

from twinshard.comm import primitives as P
from twinshard.runtime.mesh import DPCPMesh

__all__ = ["ShardedAdamW"]

PIECE = 1 << 20  # elements per AdamW piece of a chunk (bounds the update's temporaries)

# parameter -> the ShardedAdamW whose hooks take its gradient in backward (weak both ways)
_OWNERS: WeakIdKeyDictionary = WeakIdKeyDictionary()


class ShardedAdamW:
    """``torch.optim.AdamW(params, lr, betas, eps, weight_decay)`` with its state and the
    gradients sharded over ``mesh`` (module docstring). One param group; one dtype.

    ``shard_grads_in_backward=True`` (default) takes each parameter's gradient into this rank's
    send buffer as soon as backward has accumulated it (``p.grad`` is None after backward);
    ``False`` leaves the full gradients in ``p.grad`` until :meth:`reduce_and_step` (the older
    after-backward path). ``keep_grads=True`` all-gathers the reduced gradient back into every
    ``p.grad`` (tests: it costs the memory the sharding saves). ``state`` and ``param_groups`` are
    those of the inner AdamW over this rank's flat chunk, stepped in pieces of ``PIECE`` elements
    (step counts and hyperparameters, agreed by the step)."""

    def __init__(
        self,
        params: Iterable[torch.Tensor],
        mesh: DPCPMesh,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        keep_grads: bool = False,
        shard_grads_in_backward: bool = True,
    ):
        self.params = [p for p in params if p.requires_grad]
        if not self.params:
            raise ValueError("ShardedAdamW needs at least one trainable parameter")
        if len({id(p) for p in self.params}) != len(self.params):
            raise ValueError("ShardedAdamW: a parameter appears more than once in params")
        dtypes = {p.dtype for p in self.params}
        if len(dtypes) != 1:
            raise ValueError(
                f"ShardedAdamW shards one flat vector of one dtype; got {sorted(map(str, dtypes))}"
            )
        self.mesh, self.keep_grads = mesh, bool(keep_grads)
        self.in_backward = bool(shard_grads_in_backward)
        self.numel = sum(p.numel() for p in self.params)
        self.chunk = -(-self.numel // mesh.size)  # m = ceil(L / P)
        self.index = dist.get_rank()  # world rank = chunk index
        if P.group_rank(mesh.dp_group) != mesh.dp_index:
            raise ValueError("dp_group ranks are not in replica order")
        with torch.no_grad():
            flat = self._flat([p.detach() for p in self.params])
            self.shard = self._chunk(flat, self.index).clone()  # this rank's flat chunk
        # stepped as pieces that share its storage: AdamW's temporaries (sqrt(v), the update)
        # are then one piece at a time, not the whole chunk
        self.pieces = [torch.nn.Parameter(v) for v in self.shard.split(PIECE)]
        self.optimizer = torch.optim.AdamW(
            self.pieces, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay
        )
        self.buffer: torch.Tensor | None = None  # the send buffer, accumulated in backward
        self.segments = self._segments()
        self._handles: list[Any] = []
        if self.in_backward:
            self._install_hooks()

    # -- views -------------------------------------------------------------------------------
    @property
    def state(self) -> Any:
        return self.optimizer.state

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self.optimizer.param_groups

    def _flat(self, tensors: list[torch.Tensor]) -> torch.Tensor:
        flat = torch.cat([t.reshape(-1) for t in tensors])
        pad = self.chunk * self.mesh.size - flat.numel()
        return torch.cat([flat, flat.new_zeros(pad)]) if pad else flat

    def _chunk(self, flat: torch.Tensor, k: int) -> torch.Tensor:
        return flat[k * self.chunk : (k + 1) * self.chunk]

    def _send_chunks(self) -> list[int]:
        """The flat chunks this rank sends, in replica order: ``d * rows * cols + pos``."""
        per = self.mesh.shape[1] * self.mesh.shape[2]
        return [d * per + self.index % per for d in range(self.mesh.dp)]

    def _segments(self) -> list[tuple[tuple[int, int, int], ...]]:
        """Per parameter, its ranges in the send buffer: ``(a, b, at)`` = ``p.grad.flatten()[a:b]``
        goes to ``buffer[at : at + b - a]`` (the hook's map; computed once)."""
        out, start = [], 0
        for p in self.params:
            end, segs = start + p.numel(), []
            for slot, k in enumerate(self._send_chunks()):
                lo = k * self.chunk
                a, b = max(lo, start), min(lo + self.chunk, end)
                if a < b:
                    segs.append((a - start, b - start, slot * self.chunk + a - lo))
            out.append(tuple(segs))
            start = end
        return out

    def _add_range(self, lo: int, out: torch.Tensor) -> None:
        """``out += flat_gradient[lo : lo + len(out)]`` from ``p.grad`` (nothing past the end and
        for ``None``)."""
        hi, start = lo + out.numel(), 0
        for p in self.params:
            end = start + p.numel()
            a, b = max(lo, start), min(hi, end)
            if a < b and p.grad is not None:
                out[a - lo : b - lo].add_(p.grad.reshape(-1)[a - start : b - start])
            start = end

    # -- in-backward sharding ----------------------------------------------------------------
    def _install_hooks(self) -> None:
        for p in self.params:
            owner = _OWNERS.get(p)
            if owner is not None and owner() is not None and owner()._handles:
                raise ValueError(
                    "ShardedAdamW: a parameter is already sharded in backward by another live "
                    "ShardedAdamW (its hooks would take the gradient first); call remove_hooks() on "
                    "that one or pass shard_grads_in_backward=False"
                )
        me = weakref.ref(self)  # the parameters do not keep the optimizer alive
        for i, p in enumerate(self.params):
            _OWNERS[p] = me
            self._handles.append(p.register_post_accumulate_grad_hook(_hook(me, i)))
        weakref.finalize(self, _remove, self._handles)

    def remove_hooks(self) -> None:
        """Stop sharding in backward (the step then reads ``p.grad``, as the after path)."""
        _remove(self._handles)
        self.in_backward = False

    def _take(self, i: int, p: torch.Tensor) -> None:
        """Parameter ``i``'s accumulated gradient: its send-buffer ranges added, ``p.grad`` freed."""
        g = p.grad
        if g is None:
            return
        with torch.no_grad():
            if self.buffer is None:
                self.buffer = torch.zeros(self.mesh.dp * self.chunk, dtype=p.dtype, device=p.device)
            flat = g.reshape(-1)
            for a, b, at in self.segments[i]:
                self.buffer[at : at + b - a].add_(flat[a:b])
        p.grad = None

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self.params:
            p.grad = None
        for piece in self.pieces:
            piece.grad = None
        self.buffer = None

    def state_dict(self) -> dict[str, Any]:
        raise NotImplementedError(
            "ShardedAdamW keeps 1/P of the AdamW state per rank: checkpoint with the replicated "
            "torch.optim.AdamW (twinshard.pair.train.save_checkpoint) for now"
        )

    # -- the step ----------------------------------------------------------------------------
    def reduce_and_step(self, weight: float = 1.0) -> None:
        """Reduce-scatter the weighted replica gradients, step this rank's chunk, all-gather the
        parameters (module docstring). Every rank must call it, in the same step."""
        mesh = self.mesh
        per = mesh.shape[1] * mesh.shape[2]
        pos = self.index % per
        # my dp group's chunks, in replica order (chunk d * per + pos goes to replica d's rank):
        # the buffer the hooks filled in backward, plus any gradient still in p.grad (all of them
        # on the after-backward path), added straight from the parameters: no flat copy of L
        send, self.buffer = self.buffer, None
        if send is None:
            send = self.params[0].new_zeros(mesh.dp * self.chunk)
        if any(p.grad is not None for p in self.params):
            for d in range(mesh.dp):
                self._add_range((d * per + pos) * self.chunk, send[d * self.chunk : (d + 1) * self.chunk])
        for p in self.params:  # the full gradients are not kept (the point of sharding them)
            p.grad = None
        send.mul_(weight)
        shard_grad = P.reduce_scatter(send, 0, mesh.dp_group, op="zero:grad_reduce_scatter")
        del send
        for piece, g in zip(self.pieces, shard_grad.split(PIECE)):
            piece.grad = g
        self.optimizer.step()  # in place on the pieces, i.e. on self.shard
        for piece in self.pieces:
            piece.grad = None  # freed before the gathered parameters arrive
        if not self.keep_grads:
            del shard_grad
        full = P.all_gather(self.shard, 0, dist.group.WORLD, op="zero:param_all_gather")
        with torch.no_grad():
            i = 0
            for p in self.params:
                p.copy_(full[i : i + p.numel()].view_as(p))
                i += p.numel()
        del full
        if self.keep_grads:
            g = P.all_gather(shard_grad, 0, dist.group.WORLD, op="zero:grad_all_gather")
            i = 0
            for p in self.params:
                p.grad = g[i : i + p.numel()].view_as(p).clone()
                i += p.numel()


def _hook(ref: weakref.ref, i: int):
    def take(p: torch.Tensor) -> None:
        opt = ref()
        if opt is not None:
            opt._take(i, p)

    return take


def _remove(handles: list[Any]) -> None:
    for h in handles:
        h.remove()
    handles.clear()
