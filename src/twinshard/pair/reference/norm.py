"""Layer normalisation over the channel (last) dimension, computed in >= fp32.

Inputs in bf16/fp16 are normalised in fp32 and cast back; fp32 stays fp32 and
fp64 stays fp64 (``torch.promote_types(dtype, torch.float32)``), so an fp64
parity run has no hidden fp32 step. Parameter names are nn.LayerNorm's
(``weight``, ``bias``), which AF3/Boltz checkpoints use.

Parameter gradients. ``dweight = sum_tokens dy * xhat`` and ``dbias = sum_tokens dy`` are
sums over every token of the tensor (N^2 of them for a pair tensor). torch's fused
``layer_norm`` backward accumulates them in long sequential fp32 chains, whose error grows
with the token count: measured on CPU (c = 128, fp32, max |dg| / max |g| against fp64) 1.5e-6 at
4096 tokens, 8.3e-6 at 65536, 1.2e-5 at 262144 (200 u), the largest parameter-gradient error of
the triangle multiplication (10-20x its projections'). Here (:class:`_LayerNormFn`) the input
gradient is torch's own, and the two parameter gradients are reduced with torch's sum, which
sums in a cascade (pairwise) order on CPU and a tree on GPU: 1.4e-7 - 2.7e-7 at every size
above (3-5 u). Saved for backward: what the fused op saves (input, per-token mean and 1/std);
the backward's transient is one chunk of ``dy * xhat`` (``AFFINE_CHUNK`` elements).
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.autograd.function import once_differentiable

from twinshard.comm.amp import autocast_rule

__all__ = ["LayerNorm", "compute_dtype"]

AFFINE_CHUNK = 1 << 20  # elements of dy * xhat formed at once in backward (4 MiB in fp32)


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype internal reductions run in: at least fp32, never lower than the input."""
    return torch.promote_types(dtype, torch.float32)


def _affine_grads(
    dy: torch.Tensor,
    x: torch.Tensor,
    mean: torch.Tensor,
    rstd: torch.Tensor,
    shape: tuple[int, ...],
    want_w: bool,
    want_b: bool,
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """``(sum dy * xhat, sum dy)`` over every token (all dims but the normalised ``shape``), each
    a torch sum (cascade order) per chunk of tokens, the chunks' partials summed the same way."""
    width = math.prod(shape)
    dy2, x2 = dy.reshape(-1, width), x.reshape(-1, width)
    mean2, rstd2 = mean.reshape(-1, 1), rstd.reshape(-1, 1)
    rows = max(1, AFFINE_CHUNK // max(1, width))
    gw: list[torch.Tensor] = []
    gb: list[torch.Tensor] = []
    for lo in range(0, dy2.shape[0], rows):
        d = dy2[lo : lo + rows]
        if want_w:
            xhat = (x2[lo : lo + rows] - mean2[lo : lo + rows]) * rstd2[lo : lo + rows]
            gw.append((d * xhat).sum(0))
        if want_b:
            gb.append(d.sum(0))

    def total(parts: list[torch.Tensor]) -> torch.Tensor:
        if not parts:  # no tokens
            return dy.new_zeros(shape)
        return (parts[0] if len(parts) == 1 else torch.stack(parts).sum(0)).reshape(shape)

    return (total(gw) if want_w else None), (total(gb) if want_b else None)


@autocast_rule("compute")
class _LayerNormFn(torch.autograd.Function):
    """``F.layer_norm`` whose weight and bias gradients are reduced in a cascade order (see the
    module docstring); the input gradient is torch's fused one. Once differentiable.

    Dtype path (cast="compute"): the caller passes x, weight and bias in ``compute_dtype`` (>=
    fp32); normalised, saved and differentiated in it; the parameter gradients are cascade sums
    in it.
    """

    @staticmethod
    def forward(
        ctx: Any,
        x: torch.Tensor,
        weight: torch.Tensor | None,
        bias: torch.Tensor | None,
        shape: tuple[int, ...],
        eps: float,
    ) -> torch.Tensor:
        y, mean, rstd = torch.native_layer_norm(x, shape, weight, bias, eps)
        ctx.shape, ctx.has_w, ctx.has_b = shape, weight is not None, bias is not None
        ctx.save_for_backward(x, weight, bias, mean, rstd)
        return y

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, dy: torch.Tensor):
        x, weight, bias, mean, rstd = ctx.saved_tensors
        dy = dy.contiguous()
        dx = None
        if ctx.needs_input_grad[0]:
            dx = torch.ops.aten.native_layer_norm_backward(
                dy, x, ctx.shape, mean, rstd, weight, bias, [True, False, False]
            )[0]
        want_w = ctx.has_w and ctx.needs_input_grad[1]
        want_b = ctx.has_b and ctx.needs_input_grad[2]
        gw, gb = _affine_grads(dy, x, mean, rstd, ctx.shape, want_w, want_b)
        return dx, gw, gb, None, None


def layer_norm(
    x: torch.Tensor,
    shape: tuple[int, ...],
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    eps: float,
) -> torch.Tensor:
    """``F.layer_norm`` with cascade-summed parameter gradients (see the module docstring)."""
    if weight is None and bias is None:
        return F.layer_norm(x, shape, None, None, eps)
    return _LayerNormFn.apply(x, weight, bias, tuple(shape), eps)


class LayerNorm(nn.LayerNorm):
    """``nn.LayerNorm`` (default eps 1e-5, as AF3/Boltz) that normalises in >= fp32, with
    accurately summed parameter gradients (module docstring)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ct = compute_dtype(x.dtype)
        w = None if self.weight is None else self.weight.to(ct)
        b = None if self.bias is None else self.bias.to(ct)
        return layer_norm(x.to(ct), tuple(self.normalized_shape), w, b, self.eps).to(x.dtype)
