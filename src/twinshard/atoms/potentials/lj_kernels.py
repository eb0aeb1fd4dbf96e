"""The per-pair kernels of the analytic Lennard-Jones path (:meth:`LennardJones.analytic`).

Both kernels take a half list (each pair once, ``r_ij = x[j] + shift - x[i]``) and return
per-atom energies ``[n]``, forces ``[n, 3]`` and the virial ``[3, 3]`` (or None) in one pass,
without autograd:

- :func:`pairs_torch` (``kernel="torch"``): plain PyTorch in structure-of-arrays form, the
  pairs in chunks. The three cartesian components are separate vectors, because on CPU an
  op on an ``[E, 3]`` tensor is several times slower than three ops on ``[E]`` (a reduction
  over a dimension of 3, a broadcast ``[E] x [E, 3]`` and a 2-D ``index_add_`` leave the
  fast contiguous loops: 20 ms for one ``[E, 3]`` ``index_add_`` against 3 x 2.4 ms at
  E = 1.4M). Chunks of :data:`CHUNK` pairs keep the ~12 temporaries in L2 (the unchunked
  chain streams each of them through memory: 2x slower) and the peak memory at a few MB.
  Gathers and scatters are 1-D ``index_select`` / ``index_add_``; the virial is six dot
  products per chunk. On a GPU the whole list is one chunk.
- :func:`pairs_compiled` (``kernel="compile"``): the same arithmetic as one
  ``torch.compile`` graph. Inductor fuses the position gathers, the species-table gathers,
  the pair arithmetic, the virial reduction and the scatters into one C++ kernel on CPU
  (Triton on GPU) of three passes over the pairs, with five ``[E]`` buffers between them
  (40 bytes per pair in fp64). Compiled once per process with dynamic shapes (one graph
  serves every edge and atom count; the open-block form without shifts is a second graph).
  Inductor's on-disk cache shortens a later process's compile (first graph cold ~60 s, warm
  ~9 s, the second graph ~13 s / <1 s, on the loaded 2-core development machine; most of the
  warm cost is importing the compiler and preprocessing its header).
  Inductor compiles with fast-math flags and, on several threads, scatters with atomic
  adds in a varying order: results agree with the plain kernel to round-off, not bitwise.

``kernel="auto"`` (:func:`resolve_kernel`) takes the compiled kernel when a compile can
repay itself: the list has at least :data:`AUTO_MIN_EDGES` pairs and inductor's back end for
the device is there (a C++ compiler on CPU, Triton on a GPU); otherwise the plain one.
"""

from __future__ import annotations

import functools
import shutil
from typing import NamedTuple

import torch

__all__ = ["KERNELS", "AUTO_MIN_EDGES", "PairResults", "pairs_torch", "pairs_compiled", "resolve_kernel"]

KERNELS = ("torch", "compile", "auto")

# Below this many pairs "auto" stays with plain PyTorch: on one CPU thread the fused kernel saves
# ~30 ns per pair and evaluation, so at 1M pairs (~23k argon atoms) a warm compile (~10 s) is repaid
# after ~300 evaluations (an MD run), and a smaller list would need thousands.
AUTO_MIN_EDGES = 1_000_000

# Pairs per chunk of the plain kernel on CPU: its ~10 [chunk] temporaries (256 KiB each in fp64)
# stay in L2, which halves the time of the unchunked chain at 1.4M pairs; more Python overhead below.
CHUNK = 32768


class PairResults(NamedTuple):
    """Per-atom energies ``[n]``, forces ``[n, 3]`` and virial ``[3, 3]`` (None if not asked)
    of the pairs of a half list, every row of the block (halo rows hold partial sums)."""

    per_atom: torch.Tensor
    forces: torch.Tensor
    virial: torch.Tensor | None


@functools.cache
def _have_cxx() -> bool:
    from torch._inductor import config

    cxx = config.cpp.cxx[-1] if isinstance(config.cpp.cxx, tuple) else config.cpp.cxx
    return cxx is not None and shutil.which(cxx) is not None


@functools.cache
def _have_triton() -> bool:
    from torch.utils._triton import has_triton

    return bool(has_triton())


def resolve_kernel(kernel: str, n_edges: int, device: torch.device) -> str:
    """``"torch"`` or ``"compile"`` for ``kernel`` (``"auto"``: see the module docstring)."""
    if kernel not in KERNELS:
        raise ValueError(f"unknown LJ kernel {kernel!r}; choose one of {KERNELS}")
    if kernel != "auto":
        return kernel
    if n_edges < AUTO_MIN_EDGES:
        return "torch"
    usable = _have_triton() if device.type == "cuda" else _have_cxx()  # inductor's back end there
    return "compile" if usable else "torch"


def pairs_torch(
    x: torch.Tensor,
    i: torch.Tensor,
    j: torch.Tensor,
    shifts: torch.Tensor | None,
    sp: torch.Tensor,
    table: torch.Tensor,
    rc2: float,
    compute_virial: bool = True,
    chunk: int | None = None,
) -> PairResults:
    """Plain-PyTorch kernel, the pairs in chunks of ``chunk`` (default :data:`CHUNK` on CPU, all at
    once on a GPU). Arguments as :func:`pairs_compiled`. Peak: ~12 ``[chunk]`` temporaries."""
    n, dtype, device = x.shape[0], x.dtype, x.device
    n_edges = i.shape[0]
    if chunk is None:
        chunk = CHUNK if device.type == "cpu" else max(n_edges, 1)
    ns = table.shape[1]
    scalars = [float(t) for t in table.flatten()] if ns == 1 else None  # one species: no gathers
    flat = table.flatten(1)
    cols = x.t().contiguous()  # [3, n]: a gather from a strided column would copy it each time
    per_atom = torch.zeros(n, dtype=dtype, device=device)
    forces = torch.zeros(3, n, dtype=dtype, device=device)
    virial = torch.zeros(6, dtype=dtype, device=device)
    for a in range(0, n_edges, chunk):
        ic, jc = i[a : a + chunk], j[a : a + chunk]
        if scalars is None:
            t = sp.index_select(0, ic).mul_(ns).add_(sp.index_select(0, jc))
            sig2, eps4, ec = (p.index_select(0, t) for p in flat)
        else:
            sig2, eps4, ec = scalars
        d = []
        for k in range(3):
            dk = cols[k].index_select(0, jc)
            dk.sub_(cols[k].index_select(0, ic))
            if shifts is not None:
                dk.add_(shifts[a : a + chunk, k])
            d.append(dk)
        inv = d[0] * d[0]
        inv.addcmul_(d[1], d[1]).addcmul_(d[2], d[2])  # r^2
        # 1.0 inside the cutoff, 0.0 beyond, in the float dtype (4x cheaper than a bool mask in a product)
        inside = torch.lt(inv, rc2, out=torch.empty_like(inv))
        inv.reciprocal_().mul_(inside)  # 1 / r^2 inside the cutoff, 0 beyond (no inf reaches a product)
        s6 = inv * sig2
        s6.pow_(3)  # (sigma / r)^6
        w = s6 * s6  # (sigma / r)^12
        phi = (w - s6).mul_(eps4).sub_(ec).mul_(inside).mul_(0.5)  # half the pair energy to each atom
        w.mul_(2.0).sub_(s6).mul_(inv).mul_(eps4).mul_(6.0)  # w = -phi'(r) / r = 24 eps (2 s12 - s6) / r^2
        per_atom.index_add_(0, ic, phi).index_add_(0, jc, phi)
        f = [dk * w for dk in d]  # the force on j from the pair: w r_ij
        if compute_virial:
            for q, (p, r) in enumerate(_UPPER):
                virial[q] += torch.dot(f[p], d[r])
        for k in range(3):
            forces[k].index_add_(0, jc, f[k]).index_add_(0, ic, f[k], alpha=-1.0)
    return PairResults(per_atom, forces.t().contiguous(), _sym(virial) if compute_virial else None)


_UPPER = ((0, 0), (0, 1), (0, 2), (1, 1), (1, 2), (2, 2))


def _sym(v: torch.Tensor) -> torch.Tensor:
    """The symmetric ``[3, 3]`` of its upper triangle ``[6]`` (in :data:`_UPPER` order)."""
    return v[[0, 1, 2, 1, 3, 4, 2, 4, 5]].reshape(3, 3)


def _fused(
    x: torch.Tensor,
    i: torch.Tensor,
    j: torch.Tensor,
    shifts: torch.Tensor | None,
    sp: torch.Tensor,
    table: torch.Tensor,
    rc2: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The traced function of the compiled kernel (out of place, so inductor fuses it):
    ``table [3, ns, ns]`` holds sigma^2, 4 eps and the shift per species pair."""
    n = x.shape[0]
    si, sj = sp[i], sp[j]
    sig2, eps4, ec = table[0][si, sj], table[1][si, sj], table[2][si, sj]
    d = [x[:, k][j] - x[:, k][i] for k in range(3)]
    if shifts is not None:
        d = [d[k] + shifts[:, k] for k in range(3)]
    r2 = d[0] * d[0] + d[1] * d[1] + d[2] * d[2]
    inside = r2 < rc2
    inv = torch.where(inside, 1.0 / r2, 0.0)
    s6 = inv * sig2
    s6 = s6 * s6 * s6
    phi = torch.where(inside, (s6 * s6 - s6) * eps4 - ec, 0.0) * 0.5
    w = (2.0 * s6 * s6 - s6) * inv * eps4 * 6.0
    f = [dk * w for dk in d]
    per_atom = torch.zeros(n, dtype=x.dtype, device=x.device).index_add(0, i, phi).index_add(0, j, phi)
    forces = [
        torch.zeros(n, dtype=x.dtype, device=x.device).index_add(0, j, fk).index_add(0, i, -fk) for fk in f
    ]
    vir = torch.stack([(f[a] * d[b]).sum() for a, b in _UPPER])
    return per_atom, torch.stack(forces, 1), vir


_COMPILED: dict[str, object] = {}


def _compiled() -> object:
    fn = _COMPILED.get("pairs")
    if fn is None:
        fn = _COMPILED["pairs"] = torch.compile(_fused, dynamic=True)
    return fn


def pairs_compiled(
    x: torch.Tensor,
    i: torch.Tensor,
    j: torch.Tensor,
    shifts: torch.Tensor | None,
    sp: torch.Tensor,
    table: torch.Tensor,
    rc2: float,
    compute_virial: bool = True,
) -> PairResults:
    """Compiled kernel: ``sp [n]`` the species row of each atom, ``table [3, ns, ns]`` (sigma^2,
    4 eps, energy shift). Peak: five ``[E]`` buffers and the outputs."""
    from torch.fx.experimental import _config as config

    rc2_t = torch.tensor(rc2, dtype=x.dtype, device=x.device)  # a tensor: a new cutoff does not recompile
    # no duck sizing: an edge count that happens to equal the atom count must not specialise the graph
    with config.patch(use_duck_shape=False):
        per_atom, forces, v = _compiled()(x, i, j, shifts, sp, table, rc2_t)
    return PairResults(per_atom, forces, _sym(v) if compute_virial else None)
