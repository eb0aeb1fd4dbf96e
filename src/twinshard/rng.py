"""Counter-based random numbers keyed by global index (Philox4x32-10).

A draw is a pure function of ``(seed, stream, keys)``: no generator state, so
a distributed run that draws only for the indices it owns gets exactly the
numbers the serial run draws for those indices, for any rank count (DESIGN
rule 8). Langevin noise is keyed by (atom id, step, component); dropout masks
by (i, j, channel).

Philox4x32-10 (Salmon et al., SC'11) is computed in int64 torch ops with
16-bit limbs, so no intermediate overflows and results are identical on every
backend and device. Keys are non-negative integers below 2**32 (Python ints or
int64 tensors, broadcast together); up to three key words are free for the
caller, the fourth is used internally to draw several words per key.

Seeds and streams are integers in [0, 2**32) too: the Philox key is
``(seed, stream * 0x9E3779B1 mod 2**32)``, a bijection of (seed, stream), so two
different (seed, stream) pairs never draw the same stream. (A 64-bit seed cannot
share a 64-bit key with a stream without collisions; out-of-range values raise.)
"""

from __future__ import annotations

import math
import operator

import torch

__all__ = ["philox4x32", "random_bits", "uniform", "normal"]

_MASK32 = 0xFFFFFFFF
_MASK16 = 0xFFFF
_M0, _M1 = 0xD2511F53, 0xCD9E8D57
_W0, _W1 = 0x9E3779B9, 0xBB67AE85


def _mulhilo(a: int, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(hi, lo) 32-bit words of the 64-bit product a * b, with a < 2**32 constant."""
    a1, a0 = a >> 16, a & _MASK16
    b1, b0 = b >> 16, b & _MASK16
    p00 = a0 * b0
    mid = a0 * b1 + a1 * b0 + (p00 >> 16)
    lo = ((mid & _MASK16) << 16) | (p00 & _MASK16)
    hi = a1 * b1 + (mid >> 16)
    return hi & _MASK32, lo


def philox4x32(counter: list[torch.Tensor], key: tuple[int, int], rounds: int = 10) -> list[torch.Tensor]:
    """Philox4x32 block function on four int64 tensors holding 32-bit words."""
    c0, c1, c2, c3 = counter
    k0, k1 = key[0] & _MASK32, key[1] & _MASK32
    for _ in range(rounds):
        hi0, lo0 = _mulhilo(_M0, c0)
        hi1, lo1 = _mulhilo(_M1, c2)
        c0, c1, c2, c3 = hi1 ^ c1 ^ k0, lo1, hi0 ^ c3 ^ k1, lo0
        k0, k1 = (k0 + _W0) & _MASK32, (k1 + _W1) & _MASK32
    return [c0, c1, c2, c3]


def _counters(keys: tuple[torch.Tensor | int, ...], device: torch.device | None) -> list[torch.Tensor]:
    if not 1 <= len(keys) <= 3:
        raise ValueError(f"give 1 to 3 key words, got {len(keys)}")
    for k in keys:
        if isinstance(k, int) and not 0 <= k <= _MASK32:
            raise ValueError(f"random keys must be integers in [0, 2**32), got {k}")
    ts = [torch.as_tensor(k, dtype=torch.int64, device=device) for k in keys]
    for t in ts:
        if not t.numel():
            continue
        bad = (t < 0) | (t > _MASK32)
        if t.device.type == "cpu":
            if bool(bad.any()):
                raise ValueError("random keys must be integers in [0, 2**32)")
        else:  # no host sync on an accelerator: the check runs on the device, asynchronously
            torch._assert_async(~bad.any(), "random keys must be integers in [0, 2**32)")
    ts = list(torch.broadcast_tensors(*ts))
    while len(ts) < 3:
        ts.append(torch.zeros_like(ts[0]))
    return ts


def random_bits(
    seed: int, stream: int, *keys: torch.Tensor | int, block: int = 0, device: torch.device | None = None
) -> list[torch.Tensor]:
    """Four independent 32-bit words (int64 tensors) per broadcast key.

    ``seed``, ``stream`` and ``block`` are integers in [0, 2**32) (ValueError otherwise)."""
    seed, stream, block = _word("seed", seed), _word("stream", stream), _word("block", block)
    c = _counters(keys, device)
    c.append(torch.full_like(c[0], block))
    # 0x9E3779B1 is odd, so stream -> stream * 0x9E3779B1 mod 2**32 is a bijection: the key
    # (seed, that) identifies (seed, stream) uniquely
    return philox4x32(c, (seed, (stream * 0x9E3779B1) & _MASK32))


def _word(name: str, value: int) -> int:
    v = operator.index(value)  # ints only (numpy ints too), not floats or tensors
    if not 0 <= v <= _MASK32:
        raise ValueError(
            f"random {name} must be an integer in [0, 2**32), got {v}: the counter-based RNG keys on "
            "32-bit words (fold a larger value first, e.g. value % 2**32)"
        )
    return v


def _u53(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Uniform in (0, 1) with 53 random bits, from two 32-bit words."""
    x = ((a >> 5) * (1 << 26) + (b >> 6)).to(torch.float64)
    return (x + 0.5) / float(1 << 53)


def uniform(
    seed: int,
    stream: int,
    *keys: torch.Tensor | int,
    dtype: torch.dtype = torch.float64,
    device: torch.device | None = None,
) -> torch.Tensor:
    """Uniform draws in (0, 1), one per broadcast key, computed in fp64 then cast."""
    w = random_bits(seed, stream, *keys, device=device)
    return _u53(w[0], w[1]).to(dtype)


def normal(
    seed: int,
    stream: int,
    *keys: torch.Tensor | int,
    dtype: torch.dtype = torch.float64,
    device: torch.device | None = None,
    block: int = 0,
) -> torch.Tensor:
    """Standard normal draws (Box-Muller on two 53-bit uniforms), one per broadcast key
    (``block``: the counter's fourth word, as in :func:`random_bits`)."""
    w = random_bits(seed, stream, *keys, block=block, device=device)
    u1, u2 = _u53(w[0], w[1]), _u53(w[2], w[3])
    return (torch.sqrt(-2.0 * torch.log(u1)) * torch.cos(2.0 * math.pi * u2)).to(dtype)
