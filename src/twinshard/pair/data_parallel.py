"""Data x context parallel training of the pair trunk: a batch split over ``dp`` replicas, each
replica a rows x cols CP grid (``twinshard.runtime.mesh.DPCPMesh``).

Batch. Replica ``d`` holds the contiguous elements ``[k_d, k_d + B_d)`` of the whole batch of
``B`` structures, ``split = (B_0, ..., B_{dp-1})`` (:func:`twinshard.runtime.mesh.split_sizes`:
uneven ``B`` allowed, the first ``B % dp`` replicas take one more; ``B < dp`` raises on every
rank). :func:`split_batch` cuts a full batch (held by every rank) to this replica's elements,
:func:`distribute_batch` also tiles them over the replica's grid, :func:`collect_batch` gathers
a replica-distributed tensor back to the whole batch on every rank.

Step (:func:`dp_train_step`). The serial loss is the mean over the batch of per-element losses
(``Trunk``: the distogram's per-sample mean and the single-track term's ``/ (B N c_s)``), so
``L = sum_d (B_d / B) L_d`` with ``L_d`` the replica's mean over its ``B_d`` elements, and the
gradient is the same weighted sum of the replicas' gradients. Each replica runs forward and
backward inside its sub-world (the twins' own CP reductions make its gradients complete and
identical on its ranks; dropout keyed by each element's index in the whole batch,
``batch_offset``); then the weighted gradients are summed over ``dp`` once (one all-reduce per
dtype over ``mesh.dp_group``, in >= fp32) and the optimizer steps, or a
:class:`twinshard.optim.ShardedAdamW` reduce-scatters them and steps its shard (ZeRO-1/2).

Agreement, before any collective of the step: over the whole world the mesh shape, the seed,
the batch split (each replica's ``B_d``; every rank of a replica must hold the same ``B_d`` and it
must equal ``split`` when given), the model's parameter names, shapes, dtypes, trainable flags,
its mode and a checksum of the weights, and the optimizer's hyperparameters and step counts; per
replica the twins agree their own control scalars (masks, shapes, dropout, ...) as on a world of
``rows x cols`` ranks. A disagreement raises the same error on every rank.

Collectives per step: two object all-gathers over the world (agreement), the replica's CP
collectives (forward and backward, within the replica), one all-reduce per gradient dtype and
one scalar all-reduce (the loss) over ``dp_group``; with ``ShardedAdamW`` the gradient all-reduce
is replaced by its reduce-scatter over ``dp_group`` and an all-gather of the updated parameters
over the world. Memory per rank: the CP step's, plus one flat gradient buffer per dtype
(parameters' size) during the reduction.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from twinshard.comm import primitives as P
from twinshard.pair.features import PairLayout, ShardedFeatures, collect_tensor, distribute, shard_tensor
from twinshard.pair.reference.dropout import batch_offset
from twinshard.runtime.agree import agree_scalars, raise_together
from twinshard.runtime.mesh import DPCPMesh, split_sizes
from twinshard.runtime.scope import current_scope

__all__ = [
    "agree_split",
    "batch_size",
    "collect_batch",
    "distribute_batch",
    "distribute_features",
    "dp_train_step",
    "reduce_gradients",
    "replica_weight",
    "split_batch",
]

TRUNK_KINDS = {"s": "single", "z": "pair", "target": "pair", "mask": "single", "pair_mask": "pair"}


def _offset(split: Sequence[int], d: int) -> int:
    return int(sum(split[:d]))


def split_batch(features: Mapping[str, torch.Tensor], mesh: DPCPMesh) -> dict[str, torch.Tensor]:
    """This replica's elements of a full batch (every value ``[B, ...]``, the same on every rank):
    ``x[k_d : k_d + B_d]`` (views, no communication)."""
    sizes = {int(v.shape[0]) for v in features.values()}
    if len(sizes) != 1:
        raise ValueError(f"split_batch: every feature needs the same batch size, got {sorted(sizes)}")
    split = split_sizes(sizes.pop(), mesh.dp)
    k = _offset(split, mesh.dp_index)
    return {name: v[k : k + split[mesh.dp_index]] for name, v in features.items()}


def distribute_batch(
    features: Mapping[str, torch.Tensor],
    mesh: DPCPMesh,
    kinds: Mapping[str, str] | None = None,
    n_tokens: int | None = None,
) -> ShardedFeatures:
    """A full batch (on every rank) -> this replica's elements as padded DTensors on its grid
    (``shard_tensor`` per key; ``kinds`` default to the trunk's: ``s``/``mask`` single,
    ``z``/``target``/``pair_mask`` pair). The result has ``.layout``, ``.split`` (elements per
    replica) and ``.offset`` (this replica's first element). No communication; differentiable
    (each rank's input gradient covers its tiles of its replica's elements)."""
    kinds = dict(TRUNK_KINDS if kinds is None else kinds)
    local = split_batch(features, mesh)
    n = n_tokens if n_tokens is not None else int(next(iter(features.values())).shape[1])
    with mesh.replica() as grid:
        layout = PairLayout.for_sizes(n, grid)
        out = ShardedFeatures({k: shard_tensor(v, kinds[k], grid, layout) for k, v in local.items()}, layout)
    out.split = split_sizes(int(next(iter(features.values())).shape[0]), mesh.dp)  # type: ignore[attr-defined]
    out.offset = _offset(out.split, mesh.dp_index)  # type: ignore[attr-defined]
    return out


def distribute_features(
    features: Mapping[str, torch.Tensor], mesh: DPCPMesh, kinds: Mapping[str, str] | None = None
) -> ShardedFeatures:
    """A whole model's full feature dict (every value ``[B, ...]``, the same on every rank; e.g.
    Boltz-2's features with the training ones) -> this replica's elements distributed on its grid
    at the contract placements (:func:`split_batch`, then ``pair.features.distribute(...,
    src=None)`` inside ``mesh.replica()``; ``kinds`` as there). The result has ``.layout`` (the
    replica's), ``.split`` and ``.offset`` as :func:`distribute_batch`'s. Collectives: those of
    ``distribute`` within the replica (metadata agreement, atom planning). Memory: the replica's
    tiles, views of the caller's full tensors where no padding is needed."""
    local = split_batch(features, mesh)
    with mesh.replica() as grid:
        out = distribute(local, grid, kinds=kinds)
    out.split = split_sizes(int(next(iter(features.values())).shape[0]), mesh.dp)  # type: ignore[attr-defined]
    out.offset = _offset(out.split, mesh.dp_index)  # type: ignore[attr-defined]
    return out


def collect_batch(x: DTensor | torch.Tensor, mesh: DPCPMesh, kind: str | None = None) -> torch.Tensor:
    """The whole batch of a replica-distributed tensor on every rank: the replica's full tensor
    (``collect_tensor`` on its grid; a plain tensor is taken as the replica's full value), then
    an all-gather of the replicas' (uneven) blocks along dim 0 over ``dp_group``. A gathering
    boundary function (tests, outputs)."""
    if isinstance(x, DTensor):
        with mesh.replica():
            x = collect_tensor(x, kind=kind)
    x = x.detach().contiguous()
    sizes: list = [None] * mesh.dp
    dist.all_gather_object(sizes, int(x.shape[0]), group=mesh.dp_group)
    return P.all_gather(x, 0, mesh.dp_group, sizes=sizes, op="dp:collect_batch")


def replica_weight(split: Sequence[int], mesh: DPCPMesh) -> float:
    """Replica ``d``'s weight ``B_d / B`` in the batch mean: the average over the ``dp`` replicas
    (``/ dp``) of the replica's share relative to an even split (``B_d dp / B``)."""
    share = split[mesh.dp_index] * mesh.dp / sum(split)
    return share / mesh.dp


def batch_size(batch: Mapping[str, Any], who: str = "dp_train_step") -> int | None:
    sizes = {int(v.shape[0]) for v in batch.values() if isinstance(v, torch.Tensor) and v.dim() > 0}
    if len(sizes) != 1:
        raise ValueError(f"{who}: every batch tensor needs the same leading batch size, got {sorted(sizes)}")
    return sizes.pop()


def _settings(model: nn.Module, optimizer: Any, seed: int, mesh: DPCPMesh) -> dict[str, Any]:
    steps = sorted(int(st["step"]) for st in optimizer.state.values() if "step" in st)
    groups = tuple(
        tuple(sorted((k, v) for k, v in group.items() if k != "params")) for group in optimizer.param_groups
    )
    with torch.no_grad():
        params = tuple(
            (k, tuple(p.shape), str(p.dtype), bool(p.requires_grad)) for k, p in model.named_parameters()
        )
        checksum = tuple(float(p.double().sum()) for p in model.parameters())
    return {
        "mesh": mesh.shape,
        "seed": int(seed),
        "model": type(model).__name__,
        "training": model.training,
        "single_weight": getattr(model, "single_weight", None),
        "parameters": params,
        "weights_checksum": checksum,
        "optimizer": type(optimizer).__name__,
        "optimizer_steps": tuple(steps),
        "param_groups": groups,
    }


def agree_split(
    local_b: int | None,
    err: BaseException | None,
    split: Sequence[int] | None,
    mesh: DPCPMesh,
    who: str = "dp_train_step",
) -> tuple[int, ...]:
    """The batch split from every rank's ``(replica, B_local)``; raises on every rank when the
    ranks of a replica hold different sizes, a replica is empty, or it differs from ``split``."""
    every: list = [None] * mesh.size
    dist.all_gather_object(every, (mesh.dp_index, local_b, None if split is None else tuple(split)))
    if err is None:
        per: dict[int, set] = {}
        for d, b, _ in every:
            per.setdefault(d, set()).add(b)
        bad = {d: sorted(bs, key=str) for d, bs in per.items() if len(bs) != 1}
        got = tuple(next(iter(per[d])) for d in range(mesh.dp)) if not bad else None
        if bad:
            err = ValueError(
                f"{who}: the ranks of a replica hold batches of different sizes ({bad}); every "
                "rank of replica d must hold that replica's elements (split_batch / distribute_batch / "
                "distribute_features)"
            )
        elif any(b is None or b < 1 for b in got):  # type: ignore[union-attr]
            err = ValueError(f"{who}: every replica needs at least one structure, got split {got}")
        elif split is not None and tuple(split) != got:
            err = ValueError(f"{who}: the batches held {got} are not the split {tuple(split)} passed")
    raise_together(err, step=f"{who} (batch split)")
    return got


def dp_train_step(
    model: nn.Module,
    optimizer: Any,
    batch: Mapping[str, Any],
    seed: int,
    mesh: DPCPMesh,
    split: Sequence[int] | None = None,
) -> torch.Tensor:
    """One data x context parallel training step (module docstring); returns the whole batch's
    loss (detached, replicated on every rank), equal to the serial step's on the whole batch.

    ``batch``: this replica's elements as DTensors on ``mesh.grid`` (:func:`distribute_batch`);
    ``optimizer``: any ``torch.optim`` optimizer over ``model``'s parameters (replicated; the
    gradients it sees are the whole batch's), or a :class:`twinshard.optim.ShardedAdamW`;
    ``split``: the elements per replica, checked when given."""
    if current_scope() is not None:
        raise ValueError("dp_train_step runs over the whole world, not inside a replica's sub-world")
    err: BaseException | None = None
    local_b = None
    try:
        local_b = batch_size(batch)
    except Exception as exc:  # raised on every rank below
        err = exc
    agree_scalars(_settings(model, optimizer, seed, mesh), "dp_train_step")
    split = agree_split(local_b, err, split, mesh)
    weight = replica_weight(split, mesh)
    optimizer.zero_grad(set_to_none=True)
    with mesh.replica(), batch_offset(_offset(split, mesh.dp_index)):
        loss, _ = model(**batch, seed=seed)
        loss.backward()
    params = [p for p in model.parameters() if p.requires_grad]
    if hasattr(optimizer, "reduce_and_step"):
        optimizer.reduce_and_step(weight)
    else:
        reduce_gradients(params, weight, mesh)
        optimizer.step()
    return P.all_reduce(loss.detach() * weight, mesh.dp_group, op="dp:loss")


def reduce_gradients(params: Sequence[torch.Tensor], weight: float, mesh: DPCPMesh) -> None:
    """``p.grad <- sum_d weight_d p.grad_d`` over ``mesh.dp_group`` (every rank's replica-complete
    gradients, weighted by its replica's ``B_d / B``): one all-reduce per dtype of a flat
    buffer, summed in >= fp32. A parameter without a gradient counts as zero (and gets one)."""
    buckets: dict[torch.dtype, list[torch.Tensor]] = {}
    for p in params:
        buckets.setdefault(p.dtype, []).append(p)
    for _, ps in sorted(buckets.items(), key=lambda kv: str(kv[0])):  # the same order on every rank
        flat = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1) for p in ps])
        flat = flat * weight
        flat = P.all_reduce(flat, mesh.dp_group, op="dp:grad")
        i = 0
        for p in ps:
            p.grad = flat[i : i + p.numel()].view_as(p).clone()
            i += p.numel()
