"""AdamW with its state and the parameter gradients sharded over the ranks of a mesh (ZeRO-1/2).

:class:`ShardedAdamW` keeps, on each of the ``P = dp x rows x cols`` ranks of a
``twinshard.runtime.mesh.DPCPMesh``, one contiguous ``1/P`` chunk of the flattened trainable
parameters' gradient and AdamW moments (``exp_avg``, ``exp_avg_sq``) instead of all of them;
the parameters themselves stay replicated (what the CP twins compute with).

A step (:meth:`ShardedAdamW.reduce_and_step`, after backward): every rank holds its replica's
complete gradient (the twins' CP all-reduces; identical on the ranks of one replica). The flat
vector, padded to ``P * m``, is cut into ``P`` chunks of ``m``; chunk ``k`` belongs to world rank
``k = d * rows * cols + pos``. The ranks at grid position ``pos`` of every replica (``dp_group``)
reduce-scatter the chunks ``{d * rows * cols + pos}_d`` of their weighted gradients
(``weight = B_d / B``), so each rank receives exactly its chunk of ``sum_d weight_d g_d`` -- the
whole batch's gradient -- having sent ``(dp - 1) / (dp rows cols)`` of the vector (with
``dp = 1``: no communication, each rank slices its chunk). The full gradients are freed. Each
rank steps its chunk with a stock ``torch.optim.AdamW`` over one flat parameter (AdamW is
elementwise: shard-invariant, the same math as the serial optimizer's), then the updated chunks
are all-gathered over the world and copied into the parameters.

Why not FSDP2's ``fully_shard``: the twins' parameters are plain replicated tensors whose
gradients come back complete from each twin's own CP all-reduce inside backward, so FSDP2's
reduce-scatter over the whole mesh would sum ``rows x cols`` identical copies (right only through
its averaging divisor, which cannot weight uneven replica batches exactly), and it would replace
the parameters by DTensors that it unshards with module hooks the twins' functional calls do
not see. Written on ``torch.distributed`` collectives through ``twinshard.comm.primitives``
(gloo and NCCL alike), the sharding is exactly the update's data and nothing else.

Collectives per step: one reduce-scatter over ``dp_group`` (skipped when ``dp = 1``), one
all-gather over the world, in the parameters' dtype (sums in >= fp32). Memory per rank: the
moments and the gradient chunk ``3 L / P`` plus a flat parameter chunk ``L / P`` (``L``: the
trainable elements), instead of ``3 L``; transiently the send buffer ``L / (rows cols)`` (copied
straight from the gradients, which are then freed), the chunk's AdamW temporaries (one
``PIECE`` at a time) and the gathered parameters ``L``. Parameters (``L``) stay replicated, and
the full gradients exist at the end of backward (the twins' CP all-reduces produce them): the
floor of the peak is the backward's.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist

from twinshard.comm import primitives as P
from twinshard.runtime.mesh import DPCPMesh

__all__ = ["ShardedAdamW"]

PIECE = 1 << 20  # elements per AdamW piece of a chunk (bounds the update's temporaries)


class ShardedAdamW:
    """``torch.optim.AdamW(params, lr, betas, eps, weight_decay)`` with its state and the
    gradients sharded over ``mesh`` (module docstring). One param group; one dtype.

    ``keep_grads=True`` all-gathers the reduced gradient back into every ``p.grad`` (tests: it
    costs the memory the sharding saves). ``state`` and ``param_groups`` are those of the inner
    AdamW over this rank's flat chunk, stepped in pieces of ``PIECE`` elements (step counts and
    hyperparameters, agreed by the step)."""

    def __init__(
        self,
        params: Iterable[torch.Tensor],
        mesh: DPCPMesh,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        keep_grads: bool = False,
    ):
        self.params = [p for p in params if p.requires_grad]
        if not self.params:
            raise ValueError("ShardedAdamW needs at least one trainable parameter")
        dtypes = {p.dtype for p in self.params}
        if len(dtypes) != 1:
            raise ValueError(
                f"ShardedAdamW shards one flat vector of one dtype; got {sorted(map(str, dtypes))}"
            )
        self.mesh, self.keep_grads = mesh, bool(keep_grads)
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

    def _copy_range(self, lo: int, out: torch.Tensor) -> None:
        """``out <- flat_gradient[lo : lo + len(out)]`` (zeros past the end and for ``None``)."""
        hi, start = lo + out.numel(), 0
        for p in self.params:
            end = start + p.numel()
            a, b = max(lo, start), min(hi, end)
            if a < b and p.grad is not None:
                out[a - lo : b - lo].copy_(p.grad.reshape(-1)[a - start : b - start])
            start = end

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self.params:
            p.grad = None
        for piece in self.pieces:
            piece.grad = None

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
        # my dp group's chunks, in replica order (chunk d * per + pos goes to replica d's rank),
        # copied straight from the parameters' gradients: no flat copy of the whole gradient
        send = self.params[0].new_zeros(mesh.dp * self.chunk)
        for d in range(mesh.dp):
            self._copy_range((d * per + pos) * self.chunk, send[d * self.chunk : (d + 1) * self.chunk])
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
