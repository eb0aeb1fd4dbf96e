"""A small message-passing network potential (SchNet-like, invariant).

Per layer t (node features ``h [n, F]``, edges j -> i within the cutoff):

    h        <- refresh(h)                                  # halo rows = owners' values
    W_ij      = (silu(B(r_ij) A1 + a1) A2) * u(r_ij / r_c)  # continuous filter, [E, F]
    m_i       = sum_{j -> i} W_ij * (h_j M)                 # scatter-sum over receivers
    h_i      <- h_i + silu(m_i / k U1 + c1) U2 + c2

``B`` is the Bessel radial basis ``sqrt(2/r_c) sin(n pi r / r_c) / r`` and
``u`` the polynomial envelope of DimeNet (p = 6), zero with two continuous
derivatives at the cutoff, so energies and forces are smooth and edges of a
skin contribute exactly zero. The per-atom energy is a small MLP readout of
the final ``h`` times ``energy_scale``. ``k`` is a fixed neighbour-count
normaliser.

Weights are random by default, drawn from ``torch.Generator`` seeded by
``seed`` (the global RNG is untouched); the computation runs in the promoted
dtype of the positions and the parameters, so fp64 in gives fp64 out. Node
features depend on neighbours' features, so a distributed run needs a
one-cutoff halo refreshed before every layer: this module calls
``graph.refresh`` on ``h`` before each interaction.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from twinshard.atoms.potentials.base import Graph, Potential

__all__ = ["MessagePassingPotential", "bessel_basis", "polynomial_envelope"]


def polynomial_envelope(x: torch.Tensor, p: int = 6) -> torch.Tensor:
    """DimeNet envelope: 1 at x=0, 0 with two zero derivatives at x=1; 0 beyond."""
    env = 1.0 - (p + 1) * (p + 2) / 2 * x**p + p * (p + 2) * x ** (p + 1) - p * (p + 1) / 2 * x ** (p + 2)
    return torch.where(x < 1.0, env, torch.zeros_like(env))


def bessel_basis(r: torch.Tensor, cutoff: float, n_basis: int) -> torch.Tensor:
    """``sqrt(2/rc) sin(n pi r / rc) / r`` for n = 1..n_basis, shape ``[E, n_basis]``."""
    n = torch.arange(1, n_basis + 1, dtype=r.dtype, device=r.device)
    return math.sqrt(2.0 / cutoff) * torch.sin(n * math.pi * r[:, None] / cutoff) / r[:, None]


class MessagePassingPotential(Potential):
    """Invariant message-passing potential with random (seeded) weights.

    Args:
        species: atomic numbers it embeds (others raise); default argon only.
        cutoff: radial cutoff in Angstrom.
        n_features, n_basis, n_layers: widths and depth (``n_layers >= 1``).
        seed: seed of the weight draw.
        energy_scale: eV per unit of the readout (keeps random dynamics tame).
        avg_neighbors: the fixed normaliser ``k`` of the aggregated messages.
        dtype: parameter dtype.

    Parameter names (``embedding``, ``layers.{t}.filter1.weight``, ...) are
    what a distributed twin must register in the same order.
    """

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
        self.set_species(self.species)

    def extra_repr(self) -> str:
        return (
            f"species={self.species}, cutoff={self.cutoff}, n_basis={self.n_basis}, "
            f"n_layers={self.n_layers}, energy_scale={self.energy_scale}"
        )

    def forward(self, graph: Graph) -> torch.Tensor:
        pos = graph.positions
        dtype = torch.promote_types(torch.promote_types(pos.dtype, self.embedding.dtype), torch.float32)

        def lin(p: nn.ParameterDict, x: torch.Tensor) -> torch.Tensor:
            y = x @ p["weight"].to(dtype)
            return y + p["bias"].to(dtype) if "bias" in p else y

        rc = self.cutoff
        r2 = graph.edge_vectors().to(dtype).pow(2).sum(-1)
        inside = r2 < rc * rc
        # Safe distance for skin edges (and no sqrt'(0)): their filter is zeroed below.
        r = torch.sqrt(torch.where(inside, r2, torch.full_like(r2, rc * rc)))
        env = polynomial_envelope(r / rc)
        env = torch.where(inside, env, torch.zeros_like(env))
        basis = bessel_basis(r, rc, self.n_basis)
        h = self.embedding.to(dtype)[self.species_rows(graph.numbers)]
        n, fdim = h.shape
        for layer in self.layers:
            h = graph.refresh(h)
            filt = lin(layer.filter2, F.silu(lin(layer.filter1, basis))) * env[:, None]
            msg = filt * lin(layer.message, h)[graph.senders]
            agg = torch.zeros(n, fdim, dtype=dtype, device=pos.device).index_add(0, graph.receivers, msg)
            h = h + lin(layer.update2, F.silu(lin(layer.update1, agg / self.avg_neighbors)))
        e = lin(self.readout2, F.silu(lin(self.readout1, h)))
        return self.energy_scale * e[:, 0]
