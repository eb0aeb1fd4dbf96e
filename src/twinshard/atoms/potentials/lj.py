"""Shifted Lennard-Jones with per-species parameters (Lorentz-Berthelot mixing).

    phi_ab(r) = 4 eps_ab [(sig_ab / r)^12 - (sig_ab / r)^6] - phi_ab(r_c),  r < r_c

with ``sig_ab = (sig_a + sig_b) / 2`` and ``eps_ab = sqrt(eps_a eps_b)``; by
default the energy is shifted to zero at the cutoff (the force jumps there, as in
ASE's ``LennardJones(smooth=False)``); ``shift=False`` truncates without the
shift (the energy then jumps at the cutoff). Each directed edge j->i adds ``phi / 2`` to
atom i, so a pair is counted once over both directions.

Two evaluations of the same function:

- ``forward(graph)``: per-atom energies from the full edge list, forces and
  virial by autograd (the reference: the oracle, parameter gradients, training);
- :meth:`LennardJones.analytic`: the fast path. Each pair once (a half list),
  energy, per-atom energies, forces and virial in closed form in one pass, no
  autograd graph. The kernels live in :mod:`~twinshard.atoms.potentials.lj_kernels`:
  ``kernel="torch"`` (default) is plain PyTorch, structure-of-arrays and chunked so
  its temporaries stay in cache; ``kernel="compile"`` is one ``torch.compile`` graph
  that fuses gathers, arithmetic, virial and scatters (C++ on CPU, Triton on GPU;
  compiled once per process, dynamic sizes); ``kernel="auto"`` compiles for large
  lists when a compiler is present. All are tested against each other and against
  the autograd path.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import nn

from twinshard.atoms.potentials.base import Graph, Potential
from twinshard.atoms.potentials.lj_kernels import (
    KERNELS,
    PairResults,
    pairs_compiled,
    pairs_torch,
    resolve_kernel,
)

__all__ = ["LennardJones", "PairResults"]


_ARGON = {18: (0.0104, 3.405)}  # eV, Angstrom


class LennardJones(Potential):
    """Multi-species shifted LJ.

    Args:
        parameters: ``{atomic_number: (epsilon_eV, sigma_A)}``; default argon.
        cutoff: absolute cutoff in Angstrom; default ``2.5 * max(sigma)``.
        shift: subtract ``phi_ab(r_c)`` so the energy is continuous at the cutoff.
        kernel: the per-pair kernel of :meth:`analytic` (see
            :mod:`~twinshard.atoms.potentials.lj_kernels`): ``"torch"`` (default, plain
            PyTorch), ``"compile"`` (one fused ``torch.compile`` kernel) or ``"auto"``
            (compiled for large lists when a compiler is available).
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
        kernel: str = "torch",
    ) -> None:
        super().__init__()
        if kernel not in KERNELS:
            raise ValueError(f"unknown LJ kernel {kernel!r}; choose one of {KERNELS}")
        self.kernel = kernel
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
        return f"species={self.species}, cutoff={self.cutoff}, shift={self.shift}, kernel={self.kernel}"

    def _tables(self, dtype: torch.dtype) -> torch.Tensor:
        """``[3, ns, ns]``: sigma_ab^2, 4 eps_ab and the energy shift phi_ab(r_c) (0 unshifted)."""
        eps = self.epsilon.detach().to(dtype)
        sig = self.sigma.detach().to(dtype)
        eps4 = 4.0 * torch.sqrt(eps[:, None] * eps[None, :])
        sig2 = (0.5 * (sig[:, None] + sig[None, :])) ** 2
        s6c = (sig2 / self.cutoff**2) ** 3
        ec = eps4 * (s6c * s6c - s6c) if self.shift else torch.zeros_like(eps4)
        return torch.stack([sig2, eps4, ec])

    @torch.no_grad()
    def analytic(
        self,
        positions: torch.Tensor,
        numbers: torch.Tensor,
        receivers: torch.Tensor,
        senders: torch.Tensor,
        shifts: torch.Tensor | None = None,
        compute_virial: bool = True,
    ) -> PairResults:
        """The fast path: each pair of a *half* list once, in closed form, no autograd.

        ``receivers`` i, ``senders`` j, ``shifts`` (cartesian, or None for an open
        block) list each pair once with ``r_ij = positions[j] + shift - positions[i]``.
        Each pair adds ``phi / 2`` to both atoms' energies, ``w r_ij`` to the force on
        j and ``-w r_ij`` to i (``w = -phi'(r) / r``), ``w r_ij (x) r_ij`` to the virial.
        Results cover every row (halo rows hold the partial sums of their owners). The
        arithmetic runs in :mod:`~twinshard.atoms.potentials.lj_kernels` (``self.kernel``).
        """
        dtype = torch.promote_types(torch.promote_types(positions.dtype, self.epsilon.dtype), torch.float32)
        pos = positions.detach().to(dtype)
        n, device = pos.shape[0], pos.device
        i, j = receivers, senders
        if shifts is not None:
            shifts = shifts.to(dtype)
        sp = self.species_rows(numbers)  # a clear error for an unknown atomic number, on every path
        table = self._tables(dtype).to(device)
        rc2 = float(self.cutoff**2)
        if i.numel() == 0:
            zero = torch.zeros(3, 3, dtype=dtype, device=device) if compute_virial else None
            return PairResults(pos.new_zeros(n), pos.new_zeros(n, 3), zero)
        kernel = (
            pairs_compiled if resolve_kernel(self.kernel, i.numel(), device) == "compile" else pairs_torch
        )
        return kernel(pos, i, j, shifts, sp, table, rc2, compute_virial)

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
