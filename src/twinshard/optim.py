"""AdamW with its state and the parameter gradients sharded over the ranks of a mesh (ZeRO-1/2).

:class:`ShardedAdamW` keeps, on each of the ``P = dp x rows x cols`` ranks of a
``twinshard.runtime.mesh.DPCPMesh``, one ``1/P`` chunk (buckets dealt round-robin, below) of the flattened trainable
parameters' gradient and AdamW moments (``exp_avg``, ``exp_avg_sq``) instead of all of them;
the parameters themselves stay replicated (what the CP twins compute with).

Gradients (``shard_grads_in_backward=True``, the default: ZeRO-2 proper). The flat vector,
padded to ``R P b``, is cut into buckets of ``b`` (``bucket_elements``) dealt round-robin: bucket
``t`` belongs to world rank ``t mod P`` (``k = d * rows * cols + pos``) in its round ``t div P``, so
rank ``k``'s "chunk" is its ``R`` buckets, ``m = R b ~ L / P`` elements, and every rank holds
``1/P`` of each layer's gradient (with contiguous chunks the rank owning the last layers filled its
buffer at the start of backward, where the activations peak). The rank at grid position ``pos`` of
replica ``d`` sends the chunks of ranks ``{e * rows * cols + pos}_e`` (one per replica, ``dp * m =
L dp / P`` elements, its "send buffer"). The twins' replicated parameters get their replica's complete gradient from their own
CP all-reduce inside backward (``comm.sync_params`` / ``sync_grad``: identical on the ranks of one
replica), and the engine's AccumulateGrad writes ``p.grad``; a ``post_accumulate_grad`` hook on
every trainable parameter then ADDS the flat ranges of ``p.grad`` that fall in this rank's send
buffer into a persistent accumulation buffer (in the parameters' dtype, kept as pieces of
``bucket_elements`` per slot, each allocated when a gradient first reaches it, so the buffer
grows as backward proceeds instead of appearing whole at its first hook) and sets ``p.grad =
None``. So right after ``loss.backward()`` every ``p.grad`` is None and
the buffer holds this rank's ranges of the (summed, when several backward passes accumulate)
replica gradient; a parameter that backward never reached counts as zero. The hook is local: no
collective is added to backward. With ``shard_grads_in_backward=False`` (the ZeRO-1-like path of
before, kept for comparison) backward leaves the full gradients in ``p.grad`` and the step takes
the same ranges out of them, parameter by parameter, as the hook would; either way the step
also takes any ``p.grad`` left set (a gradient written outside backward).

A step (:meth:`ShardedAdamW.reduce_and_step`, after backward). The ranks at grid position ``pos``
of every replica (``dp_group``) reduce-scatter their weighted send buffers (``weight = B_d / B``),
so each rank receives exactly its chunk of ``sum_d weight_d g_d`` -- the whole batch's gradient --
having sent ``(dp - 1) / (dp rows cols)`` of the vector (with ``dp = 1``: no communication, the
buffer is its chunk). Each rank steps its chunk with a stock ``torch.optim.AdamW`` over one flat
parameter (AdamW is elementwise: shard-invariant, the same math as the serial optimizer's), then
the updated chunks are all-gathered over the world and written straight into the parameters.
Both collectives run round by round (one bucket per rank and slot; ``b`` defaults to ``max(min(
BUCKET_MIN, L / P), L / (ROUNDS P))``: at most ``ROUNDS`` rounds), so their transients are ``P b``
(<= ``L / P``), and round ``r`` gathers the contiguous flat range of buckets ``r P .. r P + P - 1``.

Why not FSDP2's ``fully_shard``: the twins' parameters are plain replicated tensors whose
gradients come back complete from each twin's own CP all-reduce inside backward, so FSDP2's
reduce-scatter over the whole mesh would sum ``rows x cols`` identical copies (right only through
its averaging divisor, which cannot weight uneven replica batches exactly), and it would replace
the parameters by DTensors that it unshards with module hooks the twins' functional calls do
not see. Written on ``torch.distributed`` collectives through ``twinshard.comm.primitives``
(gloo and NCCL alike), the sharding is exactly the update's data and nothing else.

Collectives per step: none in backward (the hooks are local; the twins' own CP all-reduces are
unchanged), ``ceil(m / bucket_elements)`` (<= ``P``) reduce-scatters over ``dp_group`` (no
communication when ``dp = 1``) and as many all-gathers over the world, in the parameters' dtype
(sums in >= fp32).

Memory per rank: the moments and the gradient chunk ``3 L / P`` plus a flat parameter chunk
``L / P`` (``L``: the trainable elements), instead of ``3 L``. During backward (in-backward
sharding): the send buffer, at most ``L dp / P`` (the pieces reached so far), plus the gradients
the engine holds whole until their AccumulateGrad fires -- the limit: one CP gradient bucket (a
layer's parameters, flattened by its ``sync_params`` all-reduce) or one parameter's gradient at
a time, rather than the full gradients ``L`` at the end of backward. After-backward sharding
instead holds the full gradients ``L`` at the end of backward, until the step takes them into
the send buffer (one parameter freed at a time). In the step: the send buffer's pieces (freed round by
round) and the received chunk ``L / P``, one reduce-scatter round's buffers (``dp *
bucket_elements``, copied; gloo adds a copy of its own), the chunk's AdamW temporaries (one
``PIECE`` at a time) and one all-gather round, ``P * bucket_elements`` (~ ``L / P``; one gather
of all ``L``, or one reduce-scatter of the whole buffer, was the step's peak at small N).
Parameters (``L``) stay replicated.

Limits: between ``backward`` and the step ``p.grad`` is None (no gradient clipping or inspection
on ``p.grad`` there: use ``shard_grads_in_backward=False`` or ``keep_grads``); the buffer
accumulates over ``backward`` calls exactly as ``p.grad`` would, until :meth:`zero_grad`
(``dp_train_step`` calls it first; ``torch.autograd.grad`` does not accumulate and feeds no
hook). One live ``ShardedAdamW`` with in-backward sharding per parameter (a second one over the
same parameters raises; :meth:`remove_hooks` releases them). The buffer is ``L dp / P``, not
``L / P``: the dp reduce-scatter waits for the end of backward (issuing it per bucket inside
backward, as DeepSpeed's ZeRO-2 does, would bring it to ``L / P`` at the price of collectives in
backward).
"""

from __future__ import annotations

import bisect
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
BUCKET_MIN = 1 << 16  # elements of one bucket (unless L / P is smaller)
ROUNDS = 64  # at most this many rounds per step (larger buckets past L = 64 P BUCKET_MIN)

# parameter -> the ShardedAdamW whose hooks take its gradient in backward (weak both ways)
_OWNERS: WeakIdKeyDictionary = WeakIdKeyDictionary()


class ShardedAdamW:
    """``torch.optim.AdamW(params, lr, betas, eps, weight_decay)`` with its state and the
    gradients sharded over ``mesh`` (module docstring). One param group; one dtype.

    ``shard_grads_in_backward=True`` (default) takes each parameter's gradient into this rank's
    send buffer as soon as backward has accumulated it (``p.grad`` is None after backward);
    ``False`` leaves the full gradients in ``p.grad`` until :meth:`reduce_and_step` (the older
    after-backward path). ``keep_grads=True`` all-gathers the reduced gradient back into every
    ``p.grad`` (tests: it costs the memory the sharding saves). ``bucket_elements``: elements per
    rank (and slot) per round of the step's reduce-scatter and all-gather (module docstring; tests
    set it small to cross parameter boundaries). ``state`` and ``param_groups`` are
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
        bucket_elements: int | None = None,
    ):
        self.params = [p for p in params if p.requires_grad]
        if not self.params:
            raise ValueError("ShardedAdamW needs at least one trainable parameter")
        if len({id(p) for p in self.params}) != len(self.params):
            raise ValueError("ShardedAdamW: a parameter appears more than once in params")
        if not all(p.is_contiguous() for p in self.params):
            raise ValueError("ShardedAdamW writes the gathered chunks into contiguous parameters only")
        dtypes = {p.dtype for p in self.params}
        if len(dtypes) != 1:
            raise ValueError(
                f"ShardedAdamW shards one flat vector of one dtype; got {sorted(map(str, dtypes))}"
            )
        self.mesh, self.keep_grads = mesh, bool(keep_grads)
        self.in_backward = bool(shard_grads_in_backward)
        self.numel = sum(p.numel() for p in self.params)
        self.starts = [0]  # each parameter's first flat index
        for p in self.params[:-1]:
            self.starts.append(self.starts[-1] + p.numel())
        # the flat vector in buckets of b dealt round-robin: bucket t is rank t % P's, in its
        # round t // P (so every rank holds 1/P of each layer's gradient, not of the layers)
        default = max(min(BUCKET_MIN, -(-self.numel // mesh.size)), -(-self.numel // (mesh.size * ROUNDS)))
        self.bucket_elements = int(bucket_elements or default)
        if self.bucket_elements < 1:
            raise ValueError(f"ShardedAdamW: bucket_elements must be positive, got {bucket_elements}")
        self.rounds = -(-self.numel // (mesh.size * self.bucket_elements))  # R
        self.chunk = self.rounds * self.bucket_elements  # m = R b per rank
        self.index = dist.get_rank()  # world rank = chunk index
        if P.group_rank(mesh.dp_group) != mesh.dp_index:
            raise ValueError("dp_group ranks are not in replica order")
        with torch.no_grad():
            flat = self._flat([p.detach() for p in self.params])
            self.shard = self._chunk(flat, self.index).clone()  # this rank's buckets, in round order
        # stepped as pieces that share its storage: AdamW's temporaries (sqrt(v), the update)
        # are then one piece at a time, not the whole chunk
        self.pieces = [torch.nn.Parameter(v) for v in self.shard.split(PIECE)]
        self.optimizer = torch.optim.AdamW(
            self.pieces, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay
        )
        # the send buffer, accumulated in backward: pieces (slot d, round j) of bucket_elements,
        # each allocated when a gradient first reaches it
        self.buffer: dict[tuple[int, int], torch.Tensor] = {}
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
        """Rank ``k``'s buckets of the padded flat vector, in round order."""
        return flat.view(self.rounds, self.mesh.size, self.bucket_elements)[:, k].reshape(-1)

    def _send_chunks(self) -> list[int]:
        """The ranks whose chunks this rank sends, in replica order: ``d * rows * cols + pos``."""
        per = self.mesh.shape[1] * self.mesh.shape[2]
        return [d * per + self.index % per for d in range(self.mesh.dp)]

    def _segments(self) -> list[tuple[tuple[int, int, int, int, int], ...]]:
        """Per parameter, its ranges in the send buffer: ``(a, e, d, j, at)`` = ``p.grad.flatten()
        [a:e]`` goes to ``buffer[d, j][at : at + e - a]`` (slot ``d``, the piece at offset ``j`` of
        the slot: round ``j // b``; the hook's map, computed once)."""
        out, start, size, n = [], 0, self.bucket_elements, self.mesh.size
        slot_of = {k: d for d, k in enumerate(self._send_chunks())}
        for p in self.params:
            end, segs = start + p.numel(), []
            for t in range(start // size, -(-end // size)):  # the buckets the parameter spans
                d = slot_of.get(t % n)
                if d is None:
                    continue  # another dp group's bucket
                lo = t * size
                a, e = max(lo, start), min(lo + size, end)
                segs.append((a - start, e - start, d, (t // n) * size, a - lo))
            out.append(tuple(segs))
            start = end
        return out

    def send_buffer(self) -> torch.Tensor:
        """The send buffer as one flat ``[dp * m]`` tensor (slot ``d`` at ``d * m``; zeros where no
        gradient arrived): tests and inspection."""
        m = self.chunk
        flat = self.params[0].new_zeros(self.mesh.dp * m)
        for (d, j), piece in self.buffer.items():
            flat[d * m + j : d * m + j + piece.numel()] = piece
        return flat

    def _write_params(self, lo: int, src: torch.Tensor) -> None:
        """``flat_parameters[lo : lo + len(src)] <- src`` (the padding past ``L`` dropped)."""
        hi = min(lo + src.numel(), self.numel)
        i = max(bisect.bisect_right(self.starts, lo) - 1, 0)
        while i < len(self.params) and self.starts[i] < hi:
            p, s0 = self.params[i], self.starts[i]
            a, b = max(lo, s0), min(hi, s0 + p.numel())
            if a < b:
                p.detach().view(-1)[a - s0 : b - s0].copy_(src[a - lo : b - lo])
            i += 1

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
            flat = g.reshape(-1)
            for a, e, d, j, at in self.segments[i]:
                piece = self.buffer.get((d, j))
                if piece is None:
                    size = min(self.bucket_elements, self.chunk - j)
                    piece = self.buffer[d, j] = torch.zeros(size, dtype=p.dtype, device=p.device)
                piece[at : at + e - a].add_(flat[a:e])
        p.grad = None

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self.params:
            p.grad = None
        for piece in self.pieces:
            piece.grad = None
        self.buffer = {}

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
        # gradients still in p.grad (all of them on the after-backward path, none after an
        # in-backward one) go into the send buffer as the hooks would, each p.grad then freed
        for i, p in enumerate(self.params):
            self._take(i, p)
        # my dp group's chunks in replica order (slot d: chunk d * per + pos, replica d's), round
        # by round: the buffer's pieces (zeros where no gradient arrived) reduce-scattered over dp
        # and freed
        m, b, n = self.chunk, self.bucket_elements, mesh.size
        buffer, self.buffer = self.buffer, {}
        shard_grad = self.params[0].new_empty(m)
        for j in range(0, m, b):
            slots = [buffer.pop((d, j), None) for d in range(mesh.dp)]
            send = torch.stack([self.params[0].new_zeros(min(b, m - j)) if x is None else x for x in slots])
            del slots
            send.mul_(weight)
            got = P.reduce_scatter(send, 0, mesh.dp_group, op="zero:grad_reduce_scatter")
            shard_grad[j : j + got.numel()].copy_(got.view(-1))
            del send, got
        for piece, part in zip(self.pieces, shard_grad.split(PIECE)):
            piece.grad = part
        del part
        self.optimizer.step()  # in place on the pieces, i.e. on self.shard
        for piece in self.pieces:
            piece.grad = None  # freed before the gathered parameters arrive
        if not self.keep_grads:
            del shard_grad
        # the updated chunks, gathered in rounds of bucket_elements per rank (the gathered
        # transient is P * bucket_elements ~ L / P, not L) and written into the parameters
        with torch.no_grad():
            for j in range(0, m, b):  # round j // b: buckets (j // b) P ... (j // b + 1) P - 1, contiguous
                got = P.all_gather(self.shard[j : j + b], 0, dist.group.WORLD, op="zero:param_all_gather")
                self._write_params(j * n, got)
                del got
        if self.keep_grads:
            g = P.all_gather(shard_grad, 0, dist.group.WORLD, op="zero:grad_all_gather")
            g = g.view(n, self.rounds, b).transpose(0, 1).reshape(-1)  # rank-major -> flat order
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
