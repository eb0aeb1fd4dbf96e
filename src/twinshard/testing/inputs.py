"""Seeded inputs for parity tests: random grad_output, synthetic tensors, perturbed parameters."""

from __future__ import annotations

import torch
from torch import nn


def synthetic(
    *shape: int, seed: int = 0, dtype: torch.dtype = torch.float64, scale: float = 1.0
) -> torch.Tensor:
    """A seeded standard-normal tensor (the same on every rank and in the test process)."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(tuple(shape), generator=g, dtype=dtype) * scale  # a tuple: 0-d works too


# The seed of a random grad_output on both sides of a parity test: the rank functions and
# serial_reference draw the same one unless a test says otherwise on both sides.
GRAD_SEED = 1234


def random_grad_output(
    like: torch.Tensor | tuple[int, ...], seed: int = GRAD_SEED, dtype: torch.dtype | None = None
) -> torch.Tensor:
    """A random (never uniform) gradient for backward: a uniform one (``.sum().backward()``)
    hides sign, permutation and transposition bugs in backward."""
    shape = tuple(like.shape) if isinstance(like, torch.Tensor) else tuple(like)
    dtype = dtype or (like.dtype if isinstance(like, torch.Tensor) else torch.float64)
    return synthetic(*shape, seed=seed, dtype=dtype)


def random_mask(*shape: int, seed: int = 7, keep: float = 0.8) -> torch.Tensor:
    """A seeded 0/1 mask (as float64) with about ``keep`` of the entries set."""
    g = torch.Generator().manual_seed(seed)
    return (torch.rand(*shape, generator=g, dtype=torch.float64) < keep).to(torch.float64)


@torch.no_grad()
def perturb_zero_parameters(module: nn.Module, seed: int = 99, scale: float = 0.1) -> list[str]:
    """Give every all-zero parameter (zero-initialised gates, output projections) seeded random
    values, so gradient parity through it is not vacuous. Returns the names perturbed."""
    g = torch.Generator().manual_seed(seed)
    names = []
    for name, p in module.named_parameters():
        if p.numel() and not bool(p.any()):
            p.copy_(torch.randn(p.shape, generator=g, dtype=torch.float64).to(p.dtype) * scale)
            names.append(name)
    return names


@torch.no_grad()
def randomize_parameters(module: nn.Module, seed: int, scale: float = 0.5, shift: float = 0.1) -> None:
    """Overwrite every parameter with seeded ``shift + scale * N(0, 1)`` values: a reference test
    against naive loops then exercises every term (AF3's zero and unit initialisations hide some)."""
    g = torch.Generator().manual_seed(seed)
    for p in module.parameters():
        p.copy_((torch.randn(p.shape, generator=g, dtype=torch.float64) * scale + shift).to(p.dtype))
