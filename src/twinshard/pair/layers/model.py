"""CP twin of the whole Boltz-2 inference forward (``twinshard.pair.reference.model.Boltz2Model``):
trunk, diffusion conditioning, sampler and confidence on a rows x cols grid.

Placements. In: the ``ShardedFeatures`` of :func:`twinshard.pair.features.distribute` (the trunk's
features, plus ``frames_idx`` single ``[B, Nr, 3]`` for the confidence module). Out: ``s`` single
``[B, Nr, token_s]`` at ``(Shard(1), Replicate())``; ``z`` pair ``[B, Nr, Nc, token_z]`` and
``pdistogram`` pair ``[B, Nr, Nc, 1, bins]`` at ``(Shard(1), Shard(2))``; ``sample_atom_coords``
``[B m, R A_blk, 3]`` of kind ``atom`` on ``sample_layout(layout, m)`` (the atoms of token block r
on grid row r, replicated along it); the confidence outputs as
:class:`~twinshard.pair.layers.confidence.CPConfidenceModule` returns them (pair logits, ``pae``,
``pde`` tiles; ``plddt`` single; the summary figures plain ``[B m]`` tensors, identical on every
rank). Every DTensor carries the layout, padding exactly zero; ``collect_tensor`` gives the serial
tensor.

Computation: the serial model's ``forward`` with its parts replaced by their twins (the same
constructor, so the same names in Boltz2's order and a whole Boltz-2 ``state_dict`` loads strict):
:class:`~twinshard.pair.layers.trunk.CPBoltz2Trunk`'s trunk (its relative position encoding kept
for the conditioning), :class:`~twinshard.pair.layers.diffusion.CPDiffusionConditioning`,
:class:`~twinshard.pair.layers.sampler.CPAtomDiffusion` (draws keyed by global index: the serial
sample on any grid), :class:`~twinshard.pair.layers.diffusion.CPDistogramHead` and
:class:`~twinshard.pair.layers.confidence.CPConfidenceModule`. The first distogram's logits are a
tile-local slice; detaching re-attaches the layout (no data moves).

Collectives: those of the parts (each part's docstring), plus one ``agree_scalars`` before
anything else (training mode, recycling steps, sampling steps, samples, ``max_parallel_samples``,
``run_confidence_sequentially``), so a rank asked for another forward raises on every rank.
Inference: forward only. Training mode (``training_forward``, the serial one's): the parts'
forward and backward collectives; the true coordinates ``coords`` (kind ``atom_conf``) are reshaped
to the atom DTensor of the training samples locally.

Memory per rank: the parts' (pair-sized activations serial / P, single-sized serial / R, atom
coordinates and atom activations serial / R plus the window halo); no rank holds a full N x N,
A x N or A x A tensor. The trunk, conditioning and sampler run without gradients, as in Boltz's
evaluation path; the conditioning's outputs (atom biases for the rank's windows, the token
transformer bias tile) stay alive for the sampling loop, as in serial.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.tensor import DTensor

from twinshard.pair.layers.trunk import CPBoltz2Trunk
from twinshard.pair.layout import layout_kind, layout_of, with_layout
from twinshard.pair.reference.model import Boltz2Model
from twinshard.pair.tiling import PAIR, SINGLE, from_local
from twinshard.runtime.agree import agree_scalars

__all__ = ["CPBoltz2Model", "cp_model_parts"]


def cp_model_parts() -> dict[str, type]:
    from twinshard.pair.layers.confidence import CPConfidenceModule
    from twinshard.pair.layers.diffusion import CPDiffusionConditioning
    from twinshard.pair.layers.sampler import CPAtomDiffusion

    return {
        "conditioning": CPDiffusionConditioning,
        "sampler": CPAtomDiffusion,
        "confidence": CPConfidenceModule,
    }


class CPBoltz2Model(CPBoltz2Trunk, Boltz2Model):
    """The CP Boltz-2 model, inference (module docstring): ``Boltz2Model``'s constructor and
    ``forward`` arguments, ``feats`` from ``distribute``; outputs as DTensors (and plain figures)."""

    @classmethod
    def model_parts(cls) -> dict[str, type]:
        return cp_model_parts()

    def detached(self, x: DTensor) -> DTensor:  # type: ignore[override]
        lay = layout_of(x)
        d = x.detach()
        return d if lay is None else with_layout(d, lay, layout_kind(x))

    def cast(self, x: Any, dtype: torch.dtype) -> Any:
        if not (isinstance(x, DTensor) and x.dtype != dtype):
            return super().cast(x, dtype)
        lay = layout_of(x)
        d = x.to(dtype)  # a local cast of each tile
        return d if lay is None else with_layout(d, lay, layout_kind(x))

    def first_distogram(self, pdistogram: DTensor) -> DTensor:  # type: ignore[override]
        local = pdistogram.to_local()[:, :, :, 0].contiguous()
        return with_layout(from_local(local, pdistogram.device_mesh, PAIR), layout_of(pdistogram), "pair")

    def model_scalars(self, scalars: dict[str, Any]) -> None:
        agree_scalars(dict(scalars, grad_enabled=torch.is_grad_enabled()), type(self).__name__)

    def training_coords(self, coords: DTensor, multiplicity: int) -> DTensor:  # type: ignore[override]
        """The ``atom_conf`` DTensor ``coords [B, K, R A_blk, 3]`` -> the atom DTensor
        ``[B m, R A_blk, 3]`` on ``sample_layout(layout, m)`` (local: the same reshape and repeat
        as serial; no communication)."""
        from twinshard.pair.layers.diffusion import sample_layout

        lay = layout_of(coords)
        if lay is None or layout_kind(coords) != "atom_conf":
            raise ValueError("CPBoltz2Model: feats['coords'] must be the atom_conf DTensor of distribute")
        local = coords.to_local()
        b, k = local.shape[:2]
        x = local.reshape((b * k,) + tuple(local.shape[2:])).repeat_interleave(multiplicity // k, 0)
        return with_layout(
            from_local(x.contiguous(), coords.device_mesh, SINGLE), sample_layout(lay, multiplicity), "atom"
        )

    def with_feature(self, feats: Any, name: str, value: Any) -> Any:  # type: ignore[override]
        out = type(feats)({**feats, name: value}, feats.layout)
        return out
