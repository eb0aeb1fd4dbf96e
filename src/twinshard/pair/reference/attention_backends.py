"""Attention backends of the pair vertical: how ``softmax(q k^T + bias) v`` is computed.

Attention with pair bias and triangle attention (serial modules and CP twins) compute, per
batch-and-head, ``o = softmax_k(q k^T + bias) v`` with an additive float bias (the pair bias
plus the mask bias; ``q`` already scaled). Three backends:

=============  ====================================================  ===========================
backend        forward                                               backward
=============  ====================================================  ===========================
``reference``  explicit einsums and ``softmax`` (the default; the    autograd of the einsums
               modules' own code, unchanged)                         (saves the probabilities)
``sdpa``       PyTorch's fused SDPA kernel that returns the          recompute, flash-style
               log-sum-exp: CPU ``aten._scaled_dot_product_flash_    (below)
               attention_for_cpu`` (fp64/fp32/bf16, float mask);
               CUDA ``aten._scaled_dot_product_efficient_attention``
               (``compute_log_sumexp=True``, fp32/fp16/bf16, a float
               bias: the kernel F.scaled_dot_product_attention picks
               for a float mask); fp64 on CUDA: the explicit math
``flex``       ``torch.nn.attention.flex_attention`` with a          recompute (below)
               ``score_mod`` adding the bias, the log-sum-exp from
               ``AuxRequest(lse=True)``: CUDA ``torch.compile``-d
               (the fused Triton kernel); CPU eager (torch 2.13:
               compiled flex on CPU is inference-only and cannot
               return the log-sum-exp; eager materializes the scores)
=============  ====================================================  ===========================

Backward of ``sdpa`` and ``flex`` (:class:`_BlockAttention`): torch 2.13 has no CPU kernel that
differentiates the bias (the CPU flash kernel refuses a mask that requires grad; FlexAttention
raises "does not support backward on CPU"), and a bias gradient needs the probabilities. So the
backward recomputes them from the saved log-sum-exp, ``p = exp(q k^T + bias - lse)``, and forms
``ds = p (do v^T - rowsum(do o) + dlse)``: dq, dk, dv and the bias gradient, in the compute
dtype. Nothing of the size of the probabilities is saved (the reference saves them); the
recompute is transient. Not wired: the fused CUDA backward (the efficient-attention backward
returns the bias gradient too, when no log-sum-exp gradient flows).

Every kernel returns ``(o, lse)``: the CP twins merge the partial softmaxes of key blocks with
the log-sum-exp (``lse``, differentiable here).

Selection: a module's constructor argument ``backend=`` (None: the context's), or the context
:func:`attention_backend` (default ``"reference"``). The CP twins agree the backend over the
world before any buffer moves (``runtime.agree_scalars``; a rank on another backend raises the
same error on every rank), since the backend changes the rounding: once per forward of a CP
stack or per sampling run (their control scalars carry :func:`module_backends`, then
:func:`backends_agreed`), per call for a twin used on its own (:func:`agree_backend`).
"""

from __future__ import annotations

import contextvars
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.nn.functional as F

from twinshard.comm.amp import autocast_rule
from twinshard.pair.reference.norm import compute_dtype

__all__ = [
    "BACKENDS",
    "attention_backend",
    "biased_attention",
    "agree_backend",
    "backends_agreed",
    "check_backend",
    "current_attention_backend",
    "module_backends",
    "resolve_backend",
]

BACKENDS = ("reference", "sdpa", "flex")
_BACKEND: contextvars.ContextVar[str] = contextvars.ContextVar(
    "twinshard_attention_backend", default="reference"
)


def check_backend(name: str) -> str:
    """``name`` if it is one of :data:`BACKENDS`, else a ValueError naming the choices."""
    if name not in BACKENDS:
        raise ValueError(f"attention backend must be one of {BACKENDS}, got {name!r}")
    return name


@contextmanager
def attention_backend(name: str) -> Iterator[None]:
    """Run the body with attention backend ``name`` for every module built with ``backend=None``."""
    token = _BACKEND.set(check_backend(name))
    try:
        yield
    finally:
        _BACKEND.reset(token)


def current_attention_backend() -> str:
    return _BACKEND.get()


def resolve_backend(explicit: str | None) -> str:
    """The module's own backend if it names one, else the context's."""
    return check_backend(explicit) if explicit is not None else _BACKEND.get()


# Set while a caller that agreed its modules' backends over the world runs them (a CP stack's
# forward, the CP sampler's loop): the twins inside skip their own per-call agreement, which is
# one object all-gather per attention call otherwise.
_AGREED: contextvars.ContextVar[frozenset[str]] = contextvars.ContextVar(
    "twinshard_attention_backends_agreed", default=frozenset()
)


def module_backends(module: Any) -> tuple[str, ...]:
    """The backends ``module``'s attention submodules resolve to now (sorted, distinct): what a
    caller adds to its agreed control scalars before :func:`backends_agreed`."""
    return tuple(sorted({resolve_backend(m.backend) for m in module.modules() if hasattr(m, "backend")}))


@contextmanager
def backends_agreed(backends: tuple[str, ...]) -> Iterator[None]:
    """The body runs modules whose backends (``backends``) the caller has agreed over the world."""
    token = _AGREED.set(_AGREED.get() | frozenset(backends))
    try:
        yield
    finally:
        _AGREED.reset(token)


def agree_backend(backend: str, what: str) -> None:
    """Agree ``backend`` over the world (``runtime.agree_scalars``: a rank on another backend raises
    the same error on every rank) unless an enclosing caller agreed it already (every rank runs the
    same callers in the same order, so every rank takes the same branch)."""
    if backend in _AGREED.get():
        return
    from twinshard.runtime.agree import agree_scalars

    agree_scalars({"attention_backend": backend}, f"{what}: the attention backend")  # it changes rounding


_FLEX: dict[str, Any] = {}


def _flex(device_type: str) -> Any:
    """flex_attention: compiled on CUDA (the fused kernel), eager elsewhere (module docstring)."""
    if device_type not in _FLEX:
        from torch.nn.attention.flex_attention import flex_attention

        _FLEX[device_type] = torch.compile(flex_attention) if device_type == "cuda" else flex_attention
    return _FLEX[device_type]


def _kernel(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor, backend: str):
    """``(o, lse)`` of ``softmax(q k^T + bias) v`` by the backend's kernel (scale 1)."""
    if backend == "flex":
        from torch.nn.attention.flex_attention import AuxRequest

        def add_bias(score, b, h, i, j):
            return score + bias[b, h, i, j]

        with warnings.catch_warnings():  # eager on CPU is the documented choice
            warnings.filterwarnings("ignore", message="flex_attention called without torch.compile")
            o, aux = _flex(q.device.type)(
                q, k, v, score_mod=add_bias, scale=1.0, return_aux=AuxRequest(lse=True)
            )
        return o, aux.lse
    if q.device.type == "cpu":
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, attn_mask=bias, scale=1.0)
    if q.device.type == "cuda" and q.dtype != torch.float64:
        s = bias.shape[-1]
        pad = (-s) % 16  # the kernel wants an aligned bias row stride (F.sdpa pads the same way)
        b = F.pad(bias, (0, pad))[..., :s] if pad else bias
        o, lse = torch.ops.aten._scaled_dot_product_efficient_attention(q, k, v, b, True, scale=1.0)[:2]
        return o, lse[..., : q.shape[-2]]
    s = q @ k.transpose(-1, -2) + bias
    lse = torch.logsumexp(s, dim=-1)
    return torch.softmax(s, dim=-1) @ v, lse


@autocast_rule("compute")
class _BlockAttention(torch.autograd.Function):
    """``(o, lse)`` of ``softmax(q k^T + bias) v`` by a fused backend kernel (module docstring).

    ``q[N, H, L, d]``, ``k, v[N, H, S, d]``, ``bias`` broadcastable to ``[N, H, L, S]``.

    Dtype path (cast="compute": the attention softmax region in fp32, autocast off): q, k, v
    and the bias are cast once to ``ct = promote(q, fp32)`` before the kernel; the kernel, its
    output and the log-sum-exp are in ``ct``; saved in ``ct`` (q, k, v, bias, o, lse).
    Backward: the probabilities recomputed and every gradient formed in ``ct``, cast once to
    the input dtypes. No communication.
    """

    @staticmethod
    def forward(
        ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor, backend: str
    ):
        ct = compute_dtype(q.dtype)
        ctx.in_dtypes = (q.dtype, k.dtype, v.dtype, bias.dtype)
        ctx.bias_shape = bias.shape
        q, k, v = (t.to(ct).contiguous() for t in (q, k, v))
        bias = bias.to(ct).expand(*q.shape[:-1], k.shape[-2])
        o, lse = _kernel(q, k, v, bias, backend)
        lse = lse.to(ct)
        ctx.save_for_backward(q, k, v, bias, o, lse)
        return o, lse

    @staticmethod
    def backward(ctx: Any, do: torch.Tensor, dlse: torch.Tensor):
        q, k, v, bias, o, lse = ctx.saved_tensors
        do, dlse = do.to(q.dtype), dlse.to(q.dtype)
        s = q @ k.transpose(-1, -2) + bias
        # a row whose every key has -inf bias (a key block of padding only) has lse = -inf: p = 0
        live = torch.isfinite(lse)
        p = torch.exp(s - torch.where(live, lse, torch.zeros_like(lse)).unsqueeze(-1))
        p = torch.where(live.unsqueeze(-1), p, torch.zeros_like(p))
        del s
        dv = p.transpose(-1, -2) @ do
        delta = (do * torch.where(live.unsqueeze(-1), o, torch.zeros_like(o))).sum(-1) - dlse
        ds = p * (do @ v.transpose(-1, -2) - delta.unsqueeze(-1))
        del p
        dq, dk = ds @ k, ds.transpose(-1, -2) @ q
        dbias = ds.sum_to_size(ctx.bias_shape)
        grads = (g.to(dt) for g, dt in zip((dq, dk, dv, dbias), ctx.in_dtypes))
        return (*grads, None)


def biased_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor, backend: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(o[N, H, L, d], lse[N, H, L])`` of ``softmax(q k^T + bias) v`` (``q[N, H, L, d]`` already
    scaled, ``k, v[N, H, S, d]``, ``bias`` broadcastable to ``[N, H, L, S]``: the pair bias plus
    the mask bias) in ``promote_types(dtype, float32)``, by ``backend`` (module docstring);
    differentiable in q, k, v and bias through both outputs."""
    check_backend(backend)
    if backend == "reference":
        ct = compute_dtype(q.dtype)
        s = q.to(ct) @ k.to(ct).transpose(-1, -2) + bias.to(ct)
        return torch.softmax(s, dim=-1) @ v.to(ct), torch.logsumexp(s, dim=-1)
    return _BlockAttention.apply(q, k, v, bias, backend)
