"""Random inputs of the diffusion loss (Boltz-2's ``AtomDiffusion.compute_loss``), fp64.

``loss_case(b, n, m, seed, atoms=(1, 4), w=8, lattice=False)``: B elements of N tokens, each real
token with a random number of atoms in ``atoms`` (contiguous, in token order), A = the most real
atoms of any element padded up to a multiple of ``w`` (Boltz's padding atoms: mask 0, on no
token). Element 1 (when B > 1) has its last token padding. The tokens' ``mol_type`` covers
protein, DNA, RNA and ligand (the first four tokens are 0, 1, 2, 3, the rest random); about a
fifth of the real atoms are unresolved. True coordinates spread over ~40 A, so pairs fall below
15 A, between 15 and 30 A and beyond 30 A; with ``lattice`` they are integers in [0, 24] and
pairs are planted exactly at the cutoffs: the first atoms of the protein and RNA tokens 15 A
apart, of the DNA and ligand tokens 30 A apart (``exact_cutoff_pairs`` counts such pairs).

Returns ``feats`` (``atom_to_token``, ``atom_pad_mask``, ``atom_resolved_mask``, ``plddt``,
``mol_type``, ``token_pad_mask``), ``coords[B m, A, 3]`` (true, repeated per sample),
``out`` (``denoised_atom_coords`` = the true coordinates plus noise, padding atoms noisy too;
``aligned_true_atom_coords`` = each row's true coordinates rotated and shifted at random;
``sigmas[B m]`` drawn as EDM's training noise).
"""

from __future__ import annotations

import torch

F64 = torch.float64


def _rotations(k: int, g: torch.Generator) -> torch.Tensor:
    q, r = torch.linalg.qr(torch.randn(k, 3, 3, generator=g, dtype=F64))
    q = q * torch.sign(torch.diagonal(r, dim1=-2, dim2=-1))[:, None, :]
    det = torch.det(q)
    return q * torch.stack([torch.ones_like(det), torch.ones_like(det), det], -1)[:, None, :]


def loss_case(
    b: int, n: int, m: int, seed: int = 0, atoms: tuple[int, int] = (1, 4), w: int = 8, lattice: bool = False
) -> dict:
    g = torch.Generator().manual_seed(seed)
    per = torch.randint(atoms[0], atoms[1] + 1, (b, n), generator=g)
    tok_mask = torch.ones(b, n, dtype=F64)
    if b > 1:
        per[1, -1] = 0
        tok_mask[1, -1] = 0
    real = per.sum(1)
    a = int(-(-int(real.max()) // w) * w)
    if a == int(real.max()):
        a += w  # at least a few of Boltz's padding atoms
    a2t = torch.zeros(b, a, n, dtype=torch.long)
    pad = torch.zeros(b, a, dtype=F64)
    for s in range(b):
        at = 0
        for t in range(n):
            k = int(per[s, t])
            a2t[s, at : at + k, t] = 1
            pad[s, at : at + k] = 1
            at += k
    mol = torch.randint(0, 4, (b, n), generator=g)
    mol[:, :4] = torch.arange(4)
    mol = mol * tok_mask.long()
    resolved = pad * (torch.rand(b, a, generator=g, dtype=F64) > 0.2).to(F64)
    if lattice:
        true = torch.randint(0, 25, (b, a, 3), generator=g).to(F64)
        first = [[int(a2t[s, :, t].argmax()) for t in range(4)] for s in range(b)]
        for s, (a0, a1, a2, a3) in enumerate(first):  # protein-RNA at 15 A, DNA-ligand at 30 A
            true[s, a2] = true[s, a0] + torch.tensor([9.0, 12.0, 0.0], dtype=F64)
            true[s, a3] = true[s, a1] + torch.tensor([0.0, 30.0, 0.0], dtype=F64)
            resolved[s, [a0, a1, a2, a3]] = 1.0
    else:
        true = 10.0 * torch.randn(b, a, 3, generator=g, dtype=F64)
    true = true * pad[..., None]
    coords = true.repeat_interleave(m, 0)
    rot = _rotations(b * m, g)
    shift = 5.0 * torch.randn(b * m, 1, 3, generator=g, dtype=F64)
    aligned = torch.einsum("bni,bji->bnj", coords, rot) + shift
    den = coords + 2.0 * torch.randn(b * m, a, 3, generator=g, dtype=F64)
    sigmas = 16.0 * torch.exp(-1.2 + 1.5 * torch.randn(b * m, generator=g, dtype=F64))
    feats = {
        "atom_to_token": a2t,
        "atom_pad_mask": pad,
        "atom_resolved_mask": resolved,
        "plddt": torch.rand(b, a, generator=g, dtype=F64) * pad,
        "mol_type": mol,
        "token_pad_mask": tok_mask,
    }
    out = {"denoised_atom_coords": den, "sigmas": sigmas, "aligned_true_atom_coords": aligned}
    return {"feats": feats, "coords": coords, "out": out}


def exact_cutoff_pairs(case: dict, cutoff: float) -> int:
    """Pairs (i != j, both resolved) whose true distance is exactly ``cutoff``."""
    t = case["feats"]["atom_resolved_mask"]
    x = case["coords"][:: case["coords"].shape[0] // t.shape[0]]
    d2 = ((x[:, :, None] - x[:, None, :]) ** 2).sum(-1)
    both = t[:, :, None] * t[:, None, :] * (1 - torch.eye(t.shape[1], dtype=F64))
    return int(((d2 == cutoff * cutoff) & (both > 0)).sum())
