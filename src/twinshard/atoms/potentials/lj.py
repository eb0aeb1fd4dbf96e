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
  autograd graph. ``kernel="torch"`` is plain vectorised PyTorch written as a
  chain of in-place operations (few ``[E]`` temporaries, no ``[E, 3, 3]``),
  ``kernel="compile"`` runs the per-pair arithmetic through ``torch.compile``
  (C++ on CPU, Triton on GPU; compiled once per process, dynamic edge count).
  Both are tested against each other and against the autograd path.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import NamedTuple

import torch
from torch import nn

from twinshard.atoms.potentials.base import Graph, Potential

__all__ = ["LennardJones", "PairResults"]


class PairResults(NamedTuple):
    """Per-atom energies ``[n]``, forces ``[n, 3]`` and virial ``[3, 3]`` (None if not asked)
    of the pairs of a half list, every row of the block (halo rows hold partial sums)."""

    per_atom: torch.Tensor
    forces: torch.Tensor
    virial: torch.Tensor | None


KERNELS = ("torch", "compile")
_COMPILED: dict[str, object] = {}


def _pair_terms(
    d: torch.Tensor,
    sig2: torch.Tensor | float,
    eps4: torch.Tensor | float,
    ec: torch.Tensor | float,
    rc2: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(pair energy phi [E], w = -phi'(r)/r [E]) of LJ from r_ij ``d [E, 3]``; zero beyond ``rc2``.

    In-place chain: three ``[E]`` float temporaries and one bool mask.
    """
    inv = torch.linalg.vecdot(d, d)  # r^2
    inside = inv < rc2
    inv.reciprocal_().mul_(inside)  # 1 / r^2 inside the cutoff, 0 outside (no inf reaches a product)
    s6 = inv * sig2
    s6.pow_(3)  # (sigma / r)^6
    w = s6 * s6  # (sigma / r)^12
    phi = (w - s6).mul_(eps4).sub_(ec).mul_(inside)
    w.mul_(2.0).sub_(s6).mul_(inv).mul_(eps4).mul_(6.0)  # 24 eps (2 s12 - s6) / r^2
    return phi, w


def _compiled_pair_terms() -> object:
    fn = _COMPILED.get("pair_terms")
    if fn is None:

        def terms(d, sig2, eps4, ec, rc2: float):  # out-of-place: inductor fuses it into one loop
            r2 = (d * d).sum(1)
            inside = r2 < rc2
            inv = torch.where(inside, 1.0 / r2, 0.0)
            s6 = (inv * sig2) ** 3
            phi = torch.where(inside, eps4 * (s6 * s6 - s6) - ec, 0.0)
            w = 6.0 * eps4 * (2.0 * s6 * s6 - s6) * inv
            return phi, w

        fn = _COMPILED["pair_terms"] = torch.compile(terms, dynamic=True)
    return fn


_ARGON = {18: (0.0104, 3.405)}  # eV, Angstrom


class LennardJones(Potential):
    """Multi-species shifted LJ.

    Args:
        parameters: ``{atomic_number: (epsilon_eV, sigma_A)}``; default argon.
        cutoff: absolute cutoff in Angstrom; default ``2.5 * max(sigma)``.
        shift: subtract ``phi_ab(r_c)`` so the energy is continuous at the cutoff.
        kernel: the per-pair arithmetic of :meth:`analytic`: ``"torch"`` (default,
            plain PyTorch) or ``"compile"`` (``torch.compile``).
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

    def _pair_parameters(
        self, numbers: torch.Tensor, i: torch.Tensor, j: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor | float, torch.Tensor | float, torch.Tensor | float]:
        """(sigma_ij^2, 4 eps_ij, energy shift) per pair, scalars for a single species."""
        eps = self.epsilon.detach().to(dtype)
        sig = self.sigma.detach().to(dtype)
        ns = eps.numel()
        eps_t = torch.sqrt(eps[:, None] * eps[None, :])
        sig2_t = (0.5 * (sig[:, None] + sig[None, :])) ** 2
        rc2 = self.cutoff**2
        s6c = (sig2_t / rc2) ** 3
        ec_t = 4.0 * eps_t * (s6c * s6c - s6c) if self.shift else torch.zeros_like(eps_t)
        if ns == 1:
            self.species_rows(numbers)  # the same clear error for an unknown atomic number
            return float(sig2_t), float(4.0 * eps_t), float(ec_t)
        sp = self.species_rows(numbers)
        t = sp.index_select(0, i).mul_(ns).add_(sp.index_select(0, j))
        return sig2_t.flatten()[t], (4.0 * eps_t).flatten()[t], ec_t.flatten()[t]

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
        Results cover every row (halo rows hold the partial sums of their owners).
        """
        dtype = torch.promote_types(torch.promote_types(positions.dtype, self.epsilon.dtype), torch.float32)
        pos = positions.detach().to(dtype)
        n = pos.shape[0]
        i, j = receivers, senders
        d = pos.index_select(0, j)
        d.sub_(pos.index_select(0, i))
        if shifts is not None:
            d.add_(shifts.to(dtype))
        sig2, eps4, ec = self._pair_parameters(numbers, i, j, dtype)
        rc2 = float(self.cutoff**2)
        if self.kernel == "compile":
            phi, w = _compiled_pair_terms()(d, sig2, eps4, ec, rc2)
        else:
            phi, w = _pair_terms(d, sig2, eps4, ec, rc2)
        phi.mul_(0.5)
        per_atom = torch.zeros(n, dtype=dtype, device=pos.device)
        per_atom.index_add_(0, i, phi)
        per_atom.index_add_(0, j, phi)
        del phi
        f = d * w[:, None]  # the force on j from the pair: w r_ij
        virial = None
        if compute_virial:  # sum_pairs w r_ij (x) r_ij, symmetric (the matmul's rounding is not)
            virial = f.transpose(0, 1) @ d
            virial = 0.5 * (virial + virial.transpose(0, 1))
        del d, w
        forces = torch.zeros(n, 3, dtype=dtype, device=pos.device)
        forces.index_add_(0, j, f)
        forces.index_add_(0, i, f, alpha=-1.0)
        return PairResults(per_atom, forces, virial)

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
