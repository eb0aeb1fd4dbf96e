"""A training step of the Pairformer trunk and its checkpoints, serial and context-parallel.

:class:`Trunk` (serial) and :class:`CPTrunk` (its twin) hold a Pairformer stack and a distogram
head under Boltz-2's names (``pairformer_module``, ``distogram_module``), so their
``state_dict``s are the same dict of names. The loss is the distogram loss plus, with
``single_weight > 0``, a small term on the single track (``single_weight * sum_i mask_i
|s_i|^2 / (B N c_s)``), so that every parameter of the stack gets a gradient (the distogram
sees only ``z``, which the single track never feeds).

:func:`train_step` is one step for either: forward, loss, backward, ``optimizer.step()``. The
CP twin's parameters are plain tensors replicated on every rank whose gradients come back
complete and identical (each twin all-reduces its own), so a stock ``torch.optim.AdamW`` on
every rank keeps the replicas identical and equal to the serial update. Control-flow scalars
are checked identical on every rank first (``agree_scalars``): by ``train_step`` the seed, the
optimizer's step counts and hyperparameters; by ``CPTrunk`` its ``single_weight`` and the
target's shape; by the stack its own (``CPPairformerStack.control_scalars``).

Checkpoints (:func:`save_checkpoint`, :func:`load_checkpoint`) are plain tensors with the serial
names: ``{"model": state_dict, "optimizer": optimizer.state_dict(), "step": int}``, written by
rank 0 and readable with ``torch.load(path, weights_only=True)`` by the serial model. Loading
into the CP model: rank 0 reads the file, broadcasts it, and every rank loads the same
parameters and optimizer state (checked identical afterwards).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from contextlib import nullcontext
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from twinshard.comm import primitives as P
from twinshard.comm.amp import autocast_rule
from twinshard.pair.features import layout_of
from twinshard.pair.layers.distogram import CPDistogramHead
from twinshard.pair.layers.pairformer import CPPairformerStack
from twinshard.pair.layers.triangle import pair_grid
from twinshard.pair.precision import precision as _precision
from twinshard.pair.reference.distogram import DistogramHead, distogram_loss
from twinshard.pair.reference.pairformer import PairformerStack
from twinshard.runtime.agree import agree_scalars
from twinshard.runtime.files import atomic_write

__all__ = ["CPTrunk", "Trunk", "load_checkpoint", "save_checkpoint", "train_step"]


class Trunk(nn.Module):
    """Serial trunk: ``forward(s, z, target, mask=None, pair_mask=None, seed=None) -> (loss,
    per_sample)`` with ``target[B, N, N, (K,) bins]`` bin counts (``distogram_target``)."""

    stack_cls: type[nn.Module] = PairformerStack
    head_cls: type[nn.Module] = DistogramHead

    def __init__(
        self,
        token_s: int,
        token_z: int,
        num_blocks: int,
        num_bins: int = 64,
        single_weight: float = 0.1,
        **stack_kw,
    ):
        super().__init__()
        self.single_weight = float(single_weight)
        self.pairformer_module = self.stack_cls(token_s, token_z, num_blocks, **stack_kw)
        self.distogram_module = self.head_cls(token_z, num_bins)

    def forward(
        self,
        s: torch.Tensor,
        z: torch.Tensor,
        target: torch.Tensor,
        mask: torch.Tensor | None = None,
        pair_mask: torch.Tensor | None = None,
        seed: int | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        s, z = self.pairformer_module(s, z, mask, pair_mask, seed)
        m = mask if mask is not None else s.new_ones(s.shape[:2])
        loss, per_sample = distogram_loss(self.distogram_module(z), target, m)
        if self.single_weight:
            loss = loss + self.single_weight * (s.pow(2) * m[..., None]).sum() / s.numel()
        return loss, per_sample


@autocast_rule()
class _SumOverRowBlocks(torch.autograd.Function):
    """Sum of per-rank partial sums over the grid column (the single track's row blocks).
    Every rank gets the same total; backward passes the (replicated) gradient to the local part
    unchanged -- each rank differentiates only its own rows (slice, do not sum).

    Dtype path: the partial sums are reduced in reduce_dtype (>= fp32), the result in the part's
    dtype; backward passes the gradient unchanged.
    """

    @staticmethod
    def forward(ctx: Any, part: torch.Tensor, group: Any) -> torch.Tensor:
        return P.all_reduce(part, group, op="trunk:single_sum")

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor):
        return g, None


class CPTrunk(Trunk):
    """The twin of :class:`Trunk` on DTensors (``s`` single, ``z``/``target``/``pair_mask`` pair,
    ``mask`` single); the loss is replicated on every rank. Same names and parameters."""

    stack_cls = CPPairformerStack
    head_cls = CPDistogramHead

    def forward(
        self,
        s: DTensor,
        z: DTensor,
        target: DTensor,
        mask: DTensor | None = None,
        pair_mask: DTensor | None = None,
        seed: int | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # the trunk's own control flow (the single-track term's all-reduce) and the target the
        # loss reads, agreed before the stack (which agrees its own scalars and the masks)
        agree_scalars(
            {"single_weight": self.single_weight, "target_shape": tuple(target.shape)}, type(self).__name__
        )
        s, z = self.pairformer_module(s, z, mask, pair_mask, seed)
        loss, per_sample = self.distogram_module.loss(z, target, mask)
        if self.single_weight:
            layout = layout_of(s) or layout_of(z)
            n = layout.n_tokens if layout is not None else s.shape[1]
            local = s.to_local()  # padded rows are exactly zero (the twins' contract)
            sq = local.pow(2) if mask is None else local.pow(2) * mask.to_local()[..., None]
            total = _SumOverRowBlocks.apply(sq.sum(), pair_grid(z).col_group)
            loss = loss + self.single_weight * total / (s.shape[0] * n * s.shape[2])
        return loss, per_sample


def train_step(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    batch: Mapping[str, Any],
    seed: int,
    precision: str | None = None,
) -> torch.Tensor:
    """One step: zero the gradients, ``loss = model(**batch, seed=seed)[0]``, backward, update.
    Returns the detached loss. On DTensor inputs the seed, the optimizer's step counts and its
    param groups' hyperparameters (learning rate, betas, weight decay, ...) are checked identical
    on every rank first (they steer dropout and the update). ``precision`` (a mode of
    ``twinshard.pair.precision``; None: none entered, the dtypes the model and batch carry): the
    forward and backward run in its scope (agreed across ranks on DTensor inputs; the model and
    batch are expected in its dtypes already); the update runs outside it."""
    distributed = any(isinstance(v, DTensor) for v in batch.values())
    scope = (
        nullcontext()
        if precision is None
        else _precision(precision).scope(what="train_step", agree=distributed)
    )
    if distributed:
        steps = sorted(int(st["step"]) for st in optimizer.state.values() if "step" in st)
        groups = tuple(
            tuple(sorted((k, v) for k, v in group.items() if k != "params"))
            for group in optimizer.param_groups
        )
        agree_scalars(
            {"seed": int(seed), "optimizer_steps": tuple(steps), "param_groups": groups}, "train_step"
        )
    optimizer.zero_grad(set_to_none=True)
    with scope:
        loss, _ = model(**batch, seed=seed)
        loss.backward()
    optimizer.step()
    return loss.detach()


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def save_checkpoint(
    path: str | os.PathLike, model: nn.Module, optimizer: torch.optim.Optimizer | None = None, step: int = 0
) -> None:
    """Write ``{"model", "optimizer", "step"}`` as plain tensors with the serial names (rank 0
    writes, atomically: :func:`twinshard.runtime.atomic_write`; every rank waits for it)."""
    state = {
        "model": {k: v.detach().clone() for k, v in model.state_dict().items()},
        "optimizer": optimizer.state_dict() if optimizer is not None else None,
        "step": int(step),
    }
    for k, v in state["model"].items():
        if isinstance(v, DTensor):
            raise TypeError(
                f"checkpoint entry {k!r} is a DTensor: parameters must be replicated plain tensors"
            )
    if _rank() == 0:
        atomic_write(path, lambda f: torch.save(state, f))  # fsynced: a kill leaves old or new
    if dist.is_initialized():
        dist.barrier()


def load_checkpoint(
    path: str | os.PathLike, model: nn.Module, optimizer: torch.optim.Optimizer | None = None
) -> int:
    """Load a checkpoint (serial names, plain tensors) into ``model`` (serial or CP) and
    ``optimizer`` on every rank; returns the step. Rank 0 reads the file (``weights_only``) and
    broadcasts it, so other ranks need no access to it; every rank then checks that all ranks
    hold the same parameters (a checksum all-gathered)."""
    box: list[Any] = [None]
    if _rank() == 0:
        box[0] = torch.load(path, map_location="cpu", weights_only=True)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.broadcast_object_list(box, src=0)
    state = box[0]
    model.load_state_dict(state["model"])
    if optimizer is not None:
        if state["optimizer"] is None:
            raise ValueError(f"checkpoint {os.fspath(path)!r} holds no optimizer state")
        optimizer.load_state_dict(state["optimizer"])
    with torch.no_grad():
        checksum = [float(p.double().sum()) for p in model.parameters()]
    agree_scalars({"step": int(state["step"]), "checksum": tuple(checksum)}, "load_checkpoint")
    return int(state["step"])
