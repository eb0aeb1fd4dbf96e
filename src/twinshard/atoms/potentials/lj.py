"""Shifted Lennard-Jones with per-species parameters (Lorentz-Berthelot mixing).

    phi_ab(r) = 4 eps_ab [(sig_ab / r)^12 - (sig_ab / r)^6] - phi_ab(r_c),  r < r_c

with ``sig_ab = (sig_a + sig_b) / 2`` and ``eps_ab = sqrt(eps_a eps_b)``; by
default the energy is shifted to zero at the cutoff (the force jumps there, as in
ASE's ``LennardJones(smooth=False)``); ``shift=False`` truncates without the
shift (the energy then jumps at the cutoff). Each directed edge j->i adds ``phi / 2`` to
atom i, so a pair is counted once over both directions.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import nn

from twinshard.atoms.potentials.base import Graph, Potential

__all__ = ["LennardJones"]

_ARGON = {18: (0.0104, 3.405)}  # eV, Angstrom


class LennardJones(Potential):
    """Multi-species shifted LJ.

    Args:
        parameters: ``{atomic_number: (epsilon_eV, sigma_A)}``; default argon.
        cutoff: absolute cutoff in Angstrom; default ``2.5 * max(sigma)``.
        shift: subtract ``phi_ab(r_c)`` so the energy is continuous at the cutoff.
        dtype: dtype of the parameters (computation runs in the promoted dtype
            of parameters and positions, so fp64 positions give fp64 energies).

    ``epsilon`` and ``sigma`` are ``nn.Parameter`` of shape ``[n_species]`` in
    the order of sorted atomic numbers, so gradients with respect to them can be
    checked like any model's.
    """

    def __init__(
        self,
        parameters: Mapping[int, tuple[float, float]] | None = None,
        cutoff: float | None = None,
        dtype: torch.dtype = torch.float64,
        shift: bool = True,
    ) -> None:
        super().__init__()
        self.shift = bool(shift)
        params = dict(parameters or _ARGON)
        species = sorted(int(z) for z in params)
        if not species:
            raise ValueError("give LJ parameters for at least one species")
        for z in species:
            e, s = params[z]
            if not (e > 0 and s > 0):
                raise ValueError(f"LJ epsilon and sigma must be positive, got {params[z]} for Z={z}")
        self.epsilon = nn.Parameter(torch.tensor([params[z][0] for z in species], dtype=dtype))
        self.sigma = nn.Parameter(torch.tensor([params[z][1] for z in species], dtype=dtype))
        self.set_species(species)
        self.cutoff = float(cutoff if cutoff is not None else 2.5 * max(p[1] for p in params.values()))

    def extra_repr(self) -> str:
        return f"species={self.species}, cutoff={self.cutoff}, shift={self.shift}"

    def forward(self, graph: Graph) -> torch.Tensor:
        pos = graph.positions
        dtype = torch.promote_types(pos.dtype, self.epsilon.dtype)
        dtype = torch.promote_types(dtype, torch.float32)
        n = graph.n_atoms
        sp = self.species_rows(graph.numbers)
        eps = self.epsilon.to(dtype)
        sig = self.sigma.to(dtype)
        si, sj = sp[graph.receivers], sp[graph.senders]
        eps_ij = torch.sqrt(eps[si] * eps[sj])
        sig_ij = 0.5 * (sig[si] + sig[sj])
        r2 = graph.edge_vectors().to(dtype).pow(2).sum(-1)
        rc2 = self.cutoff**2
        inside = r2 < rc2
        # Edges beyond the cutoff (skin) get a safe r2 so no inf/NaN reaches autograd.
        r2 = torch.where(inside, r2, torch.full_like(r2, rc2))
        s6 = (sig_ij**2 / r2) ** 3
        s6c = (sig_ij**2 / rc2) ** 3 if self.shift else torch.zeros_like(s6)
        phi = 4.0 * eps_ij * ((s6 * s6 - s6) - (s6c * s6c - s6c))
        phi = torch.where(inside, phi, torch.zeros_like(phi))
        out = torch.zeros(n, dtype=dtype, device=pos.device)
        return out.index_add(0, graph.receivers, 0.5 * phi)
