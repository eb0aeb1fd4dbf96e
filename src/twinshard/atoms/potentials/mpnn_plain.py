"""The message-passing potential of :mod:`.mpnn`, written in plain PyTorch (no twinshard calls).

Same math and parameter names as :class:`~twinshard.atoms.potentials.mpnn.MessagePassingPotential`
(a state dict moves between the two unchanged), but written the way a model author writes a
model: ``index_select`` to gather neighbours, ``torch.zeros_like(h).index_add_`` to aggregate,
a scatter of node energies into per-system energies, and ``torch.autograd.grad`` inside
``forward`` for forces and (through a displacement of the positions and edge shifts, as MACE
does) the virial and stress. It knows nothing about ranks: run distributed, the inputs are
ShardTensors and the dispatch (:mod:`twinshard.shard.dispatch`) makes those ops
distribution-aware (``DistributedPotential(model, mode="dispatch")``).

Input (a dict, MACE-like): ``positions [n, 3]``, ``numbers [n]``, ``senders [E]``,
``receivers [E]`` (an edge j -> i contributes to i), ``shifts [E, 3]`` cartesian with
``r_ij = positions[senders] + shifts - positions[receivers]``, ``batch [n]`` (system of each
atom), ``cell [S, 3, 3]``.
Output: ``node_energy [n]``, ``energy [S]``, and when asked ``forces [n, 3]``,
``virial [S, 3, 3]`` (``-dE/d(strain)``), ``stress [S, 3, 3]`` (``dE/d(strain) / V``, None
for a cell without volume).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from twinshard.atoms.potentials.base import lookup_species

__all__ = ["PlainMessagePassing"]


def _envelope(x: torch.Tensor, p: int = 6) -> torch.Tensor:
    env = 1.0 - (p + 1) * (p + 2) / 2 * x**p + p * (p + 2) * x ** (p + 1) - p * (p + 1) / 2 * x ** (p + 2)
    return torch.where(x < 1.0, env, torch.zeros_like(env))


def _bessel(r: torch.Tensor, cutoff: float, n_basis: int) -> torch.Tensor:
    n = torch.arange(1, n_basis + 1, dtype=r.dtype, device=r.device)
    return math.sqrt(2.0 / cutoff) * torch.sin(n * math.pi * r[:, None] / cutoff) / r[:, None]


class PlainMessagePassing(nn.Module):
    """Invariant message passing (SchNet-like), plain PyTorch; arguments as ``MessagePassingPotential``."""

    # the same function and state_dict as MessagePassingPotential: a checkpoint of either restarts
    # with the other (--storage graph <-> halo; atoms.provenance)
    provenance_class = "twinshard.atoms.potentials.mpnn.MessagePassingPotential"

    def __init__(
        self,
        species: Sequence[int] = (18,),
        cutoff: float = 5.0,
        n_features: int = 16,
        n_basis: int = 8,
        n_layers: int = 2,
        seed: int = 0,
        energy_scale: float = 1.0,
        avg_neighbors: float = 12.0,
        dtype: torch.dtype = torch.float64,
    ) -> None:
        super().__init__()
        if n_layers < 1:
            raise ValueError(f"n_layers must be >= 1, got {n_layers}")
        self.species = sorted(int(z) for z in species)
        self.cutoff = float(cutoff)
        self.n_basis = int(n_basis)
        self.n_layers = int(n_layers)
        self.energy_scale = float(energy_scale)
        self.avg_neighbors = float(avg_neighbors)
        gen = torch.Generator().manual_seed(int(seed))
        fdim = int(n_features)

        def w(fan_in: int, fan_out: int) -> nn.Parameter:
            return nn.Parameter(torch.randn(fan_in, fan_out, generator=gen, dtype=dtype) / math.sqrt(fan_in))

        def b(dim: int) -> nn.Parameter:
            return nn.Parameter(0.1 * torch.randn(dim, generator=gen, dtype=dtype))

        # the same draws in the same order as MessagePassingPotential
        self.embedding = nn.Parameter(torch.randn(len(self.species), fdim, generator=gen, dtype=dtype))
        self.layers = nn.ModuleList()
        for _ in range(self.n_layers):
            layer = nn.Module()
            layer.filter1 = nn.ParameterDict({"weight": w(self.n_basis, fdim), "bias": b(fdim)})
            layer.filter2 = nn.ParameterDict({"weight": w(fdim, fdim)})
            layer.message = nn.ParameterDict({"weight": w(fdim, fdim)})
            layer.update1 = nn.ParameterDict({"weight": w(fdim, fdim), "bias": b(fdim)})
            layer.update2 = nn.ParameterDict({"weight": w(fdim, fdim), "bias": b(fdim)})
            self.layers.append(layer)
        self.readout1 = nn.ParameterDict({"weight": w(fdim, fdim), "bias": b(fdim)})
        self.readout2 = nn.ParameterDict({"weight": w(fdim, 1), "bias": b(1)})
        table = torch.full((max(self.species) + 1,), -1, dtype=torch.int64)
        table[torch.tensor(self.species)] = torch.arange(len(self.species))
        self.register_buffer("species_index", table, persistent=False)

    def node_energies(
        self,
        positions: torch.Tensor,
        numbers: torch.Tensor,
        senders: torch.Tensor,
        receivers: torch.Tensor,
        shifts: torch.Tensor,
    ) -> torch.Tensor:
        dtype = torch.promote_types(torch.promote_types(positions.dtype, self.embedding.dtype), torch.float32)

        def lin(p: nn.ParameterDict, x: torch.Tensor) -> torch.Tensor:
            y = x @ p["weight"].to(dtype)
            return y + p["bias"].to(dtype) if "bias" in p else y

        rows = lookup_species(self.species_index, numbers, type(self).__name__, self.species)
        rc = self.cutoff
        vec = positions.index_select(0, senders) + shifts - positions.index_select(0, receivers)
        r2 = vec.to(dtype).pow(2).sum(-1)
        inside = r2 < rc * rc
        r = torch.sqrt(torch.where(inside, r2, torch.full_like(r2, rc * rc)))
        env = torch.where(inside, _envelope(r / rc), torch.zeros_like(r))
        basis = _bessel(r, rc, self.n_basis)
        h = self.embedding.to(dtype)[rows]
        for layer in self.layers:
            filt = lin(layer.filter2, F.silu(lin(layer.filter1, basis))) * env[:, None]
            msg = filt * lin(layer.message, h).index_select(0, senders)
            agg = torch.zeros_like(h).index_add_(0, receivers, msg)
            h = h + lin(layer.update2, F.silu(lin(layer.update1, agg / self.avg_neighbors)))
        e = lin(self.readout2, F.silu(lin(self.readout1, h)))
        return self.energy_scale * e[:, 0]

    def forward(
        self,
        data: dict[str, torch.Tensor],
        compute_forces: bool = True,
        compute_stress: bool = False,
        training: bool = False,
    ) -> dict[str, torch.Tensor | None]:
        positions, shifts, cell, batch = data["positions"], data["shifts"], data["cell"], data["batch"]
        n_systems = cell.shape[0]
        displacement = None
        if compute_forces and not positions.requires_grad:
            positions.requires_grad_(True)
        pos, sh = positions, shifts.to(positions.dtype)
        if compute_stress:
            displacement = torch.zeros(n_systems, 3, 3, dtype=positions.dtype, device=positions.device)
            displacement.requires_grad_(True)
            sym = 0.5 * (displacement + displacement.transpose(-1, -2))
            pos = pos + (pos.unsqueeze(-2) @ sym[batch]).squeeze(-2)
            edge_sym = sym[batch.index_select(0, data["receivers"])]
            sh = sh + (sh.unsqueeze(-2) @ edge_sym).squeeze(-2)
        node_e = self.node_energies(pos, data["numbers"], data["senders"], data["receivers"], sh)
        energy = torch.zeros(n_systems, dtype=node_e.dtype, device=node_e.device).index_add(0, batch, node_e)
        out: dict[str, torch.Tensor | None] = {"node_energy": node_e, "energy": energy}
        if compute_forces or compute_stress:
            inputs = [positions] + ([displacement] if compute_stress else [])
            grads = torch.autograd.grad(energy.sum(), inputs, create_graph=training, allow_unused=True)
            if compute_forces:
                out["forces"] = -grads[0] if grads[0] is not None else torch.zeros_like(positions)
            if compute_stress:
                de = grads[1] if grads[1] is not None else torch.zeros_like(displacement)
                out["virial"] = -de
                vol = torch.linalg.det(cell).abs()
                out["stress"] = de / vol[:, None, None] if bool((vol > 0).all()) else None
        return out
