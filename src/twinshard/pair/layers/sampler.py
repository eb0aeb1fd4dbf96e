"""The CP twin of the sampler (:class:`twinshard.pair.reference.sampler.AtomDiffusion`):
``CPAtomDiffusion.sample`` draws the serial sample on any grid.

Placements. In: ``atom_mask`` the atom DTensor ``feats["atom_pad_mask"]`` (``[B, R A_blk]``,
``(Shard(1), Replicate())``), the score model's inputs as :class:`CPDiffusionModule` takes them
(``s_inputs``, ``s_trunk`` single DTensors; ``feats`` the ``ShardedFeatures`` of ``distribute``;
``diffusion_conditioning`` the :class:`CPDiffusionConditioning` outputs as Boltz's dict). Out:
``sample_atom_coords[B m, R A_blk, 3]`` an atom DTensor on :func:`sample_layout` (grid row r holds
the atoms of its token block for every sample, replicated along the row; padded slots exactly
zero): :func:`~twinshard.pair.features.collect_tensor` gives the serial ``[B m, A, 3]``.

Draws. Every rank draws exactly its atoms' entries of the serial draws: the counter-based source
(:class:`CounterDraws`, the default) keys each number by (seed, sample row, step, global atom
index x 3 + component), the per-sample rotations and translations by (seed, sample row, step,
component): the same numbers on every rank and grid as serially. With :class:`GivenDraws` (the
``"boltz"`` convention) the callback's full serial tensors are indexed the same way (a test
convention: each rank materialises a full ``[B m, A, 3]`` draw).

Reductions. The sampler's only cross-atom quantities are sums over the atoms of a sample: the
centring mean (over all ``A`` atoms, Boltz's padding atoms included) and, with
``alignment_reverse_diff``, the weighted centroids (one round) and the 3 x 3 covariance (a second
round) of the rigid alignment. Each is a sum of per-row partials: every rank sums its row's atoms
(its slots below ``atom_counts``), the partials are all-gathered along the grid column (each grid
row's atoms counted once: the ranks of a row hold the same atoms) and summed in grid-row order, so
every rank of the column holds the same bits, and the 3 x 3 SVD runs replicated on each rank.

Collectives per denoising step: the score model's (:class:`CPDiffusionModule`, forward only, once
per sample chunk), one all-gather along the grid column (``sampler:atom_sum``) of ``[R, B m, 3]``
for the centring mean and, with alignment, four more: the weight sum ``[R, B m, 1]``, the two
weighted centroids ``[R, B m, 3]`` and the covariance ``[R, B m, 3, 3]`` (tiny messages; they
could be fused into two). Before the loop: ``agree_scalars`` on the control values (steps, samples,
chunking, seed, draw source, alignment and steering flags). No gradients (``no_grad``).

Memory per rank: the coordinates, noisy and denoised tiles ``[B m, A_blk, 3]`` (``3 x A / R`` per
sample, a few copies) and the score model's activations for one chunk of samples; nothing of
size A except under :class:`GivenDraws`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from twinshard.pair.layers.atom_encoder import tile_features
from twinshard.pair.layers.diffusion import CPDiffusionModule, sample_layout
from twinshard.pair.layers.structure_loss import cp_compute_loss
from twinshard.pair.layers.sums import column_sum
from twinshard.pair.layout import with_layout
from twinshard.pair.reference.attention_backends import backends_agreed, module_backends
from twinshard.pair.reference.sampler import (
    AtomDiffusion,
    CounterDraws,
    SampleFrame,
    boltz_sample_chunks,
)
from twinshard.pair.tiling import SINGLE, check_placements, from_local
from twinshard.runtime.agree import agree_scalars

__all__ = ["CPAtomDiffusion", "atom_frame"]


def atom_frame(layout, row: int, multiplicity: int, device) -> SampleFrame:
    """The :class:`SampleFrame` of grid row ``row``: its slots of every sample row ``b m + j``."""
    lay = sample_layout(layout, multiplicity)
    starts = torch.tensor([s[row] for s in lay.atom_starts], device=device)
    counts = torch.tensor([c[row] for c in lay.atom_counts], device=device)
    slot = torch.arange(lay.atom_block, device=device)
    valid = slot[None, :] < counts[:, None]
    atoms = torch.where(valid, starts[:, None] + slot[None, :], torch.zeros_like(slot)[None, :])
    return SampleFrame(torch.arange(len(counts), device=device), atoms, valid, lay.n_atoms)


class CPAtomDiffusion(AtomDiffusion):
    """Context-parallel ``AtomDiffusion`` (module docstring); the score model is a
    :class:`CPDiffusionModule`; ``sample`` takes the serial arguments as DTensors."""

    _score_cls = CPDiffusionModule

    def _atom_sum(self, x: torch.Tensor, frame: SampleFrame) -> torch.Tensor:
        part = super()._atom_sum(x, frame)  # my grid row's atoms (valid slots only)
        return column_sum(part, self._grid, "sampler:atom_sum")  # grid-row order: replicated bits

    def _score(self, r_noisy: torch.Tensor, times: torch.Tensor, kwargs: dict) -> torch.Tensor:
        lay = sample_layout(self._layout, kwargs["multiplicity"])
        r = with_layout(from_local(r_noisy.contiguous(), self._grid.mesh, SINGLE), lay, "atom")
        return self.score_model(r_noisy=r, times=times, **kwargs).to_local()

    def forward(  # type: ignore[override]
        self,
        s_inputs: Any,
        s_trunk: Any,
        feats: Any,
        diffusion_conditioning: dict,
        multiplicity: int = 1,
        *,
        draws: Any = None,
        seed: int = 0,
    ) -> dict[str, Any]:
        """The training forward (the serial ``AtomDiffusion.forward``) on the grid: ``feats["coords"]``
        an atom DTensor ``[B m, R A_blk, 3]`` on ``sample_layout(layout, m)``; returns
        ``denoised_atom_coords`` and ``aligned_true_atom_coords`` there (padding exactly zero) and
        ``sigmas [B m]`` plain, identical on every rank. Every draw is the serial one (global
        atom index keys). Collectives: ``agree_scalars`` once; the centring's two atom sums (one
        all-gather each along the grid column, no gradient: the true coordinates are data); the
        score model's forward and backward (:class:`CPDiffusionModule`). Memory: the coordinate
        tiles ``[B m, A_blk, 3]`` and the score model's activations for all m samples."""
        what = f"{type(self).__name__}.forward"
        tile = tile_features(feats, what)
        layout, grid = tile.layout, tile.grid
        m = int(multiplicity)
        coords = feats["coords"]
        check_placements(coords, SINGLE, f"{what} coords", ndim=3)
        agree_scalars(
            {
                "multiplicity": m,
                "coords_shape": tuple(coords.shape),
                "seed": int(seed) if draws is None else None,
                "draws": "counter" if draws is None else type(draws).__name__,
                "synchronize_sigmas": bool(self.synchronize_sigmas),
                "coordinate_augmentation": bool(self.coordinate_augmentation),
            },
            what,
        )
        draws = CounterDraws(seed) if draws is None else draws
        local = coords.to_local()
        mask = feats["atom_pad_mask"].to_local().repeat_interleave(m, 0).to(local.dtype)
        frame = atom_frame(layout, grid.coords[0], m, local.device)
        kwargs = {
            "s_inputs": s_inputs,
            "s_trunk": s_trunk,
            "feats": feats,
            "diffusion_conditioning": diffusion_conditioning,
        }
        self._grid, self._layout = grid, layout
        try:
            out = self._train(local, mask, frame, m, draws, kwargs)
        finally:
            self._grid = self._layout = None
        lay = sample_layout(layout, m)
        for k in ("denoised_atom_coords", "aligned_true_atom_coords"):
            out[k] = with_layout(from_local(out[k].contiguous(), grid.mesh, SINGLE), lay, "atom")
        return out

    @torch.no_grad()
    def sample(  # type: ignore[override]
        self,
        atom_mask: Any,
        num_sampling_steps: int | None = None,
        multiplicity: int = 1,
        max_parallel_samples: int | None = None,
        steering_args: Mapping[str, Any] | None = None,
        *,
        draws: Any = None,
        seed: int = 0,
        **network_condition_kwargs: Any,
    ) -> dict[str, Any]:
        what = f"{type(self).__name__}.sample"
        feats = network_condition_kwargs["feats"]
        tile = tile_features(feats, what)
        layout, grid = tile.layout, tile.grid
        check_placements(atom_mask, SINGLE, f"{what} atom_mask", ndim=2)
        m = int(multiplicity)
        steps = int(self.num_sampling_steps if num_sampling_steps is None else num_sampling_steps)
        flags = {
            k: bool((steering_args or {}).get(k))
            for k in ("fk_steering", "physical_guidance_update", "contact_guidance_update")
        }
        agree_scalars(
            {
                "num_sampling_steps": steps,
                "multiplicity": m,
                "max_parallel_samples": max_parallel_samples,
                "seed": int(seed) if draws is None else None,
                "draws": "counter" if draws is None else type(draws).__name__,
                "alignment_reverse_diff": bool(self.alignment_reverse_diff),
                "steering": tuple(sorted(flags.items())),
                "attention_backends": module_backends(self),
            },
            what,
        )
        self._check_steering(steering_args)
        if m < 1:
            raise ValueError(f"{what}: multiplicity must be at least 1, got {m}")
        draws = CounterDraws(seed) if draws is None else draws
        s_trunk = network_condition_kwargs["s_trunk"]
        dtype = s_trunk.dtype
        mask = atom_mask.to_local().repeat_interleave(m, 0).to(dtype)
        frame = atom_frame(layout, grid.coords[0], m, mask.device)
        chunks = boltz_sample_chunks(m, max_parallel_samples)
        self._grid, self._layout = grid, layout
        try:
            with backends_agreed(module_backends(self)):  # agreed above: no per-call agreement
                x = self._run(mask, frame, steps, m, chunks, draws, network_condition_kwargs, dtype)
        finally:
            self._grid = self._layout = None
        out = with_layout(from_local(x.contiguous(), grid.mesh, SINGLE), sample_layout(layout, m), "atom")
        return {"sample_atom_coords": out, "diff_token_repr": None}

    def compute_loss(  # type: ignore[override]
        self,
        feats: Any,
        out_dict: Mapping[str, Any],
        add_smooth_lddt_loss: bool = True,
        nucleotide_loss_weight: float = 5.0,
        ligand_loss_weight: float = 10.0,
        multiplicity: int = 1,
        filter_by_plddt: float = 0.0,
    ) -> dict[str, Any]:
        """Boltz-2's diffusion loss on the grid: :func:`twinshard.pair.layers.structure_loss.cp_compute_loss`
        (placements, collectives and memory in that module's docstring)."""
        return cp_compute_loss(
            self,
            feats,
            out_dict,
            add_smooth_lddt_loss,
            nucleotide_loss_weight,
            ligand_loss_weight,
            multiplicity,
            filter_by_plddt,
        )
