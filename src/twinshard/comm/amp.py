"""The autocast rule of twinshard's hand-written autograd Functions, and the dtype audit.

The rule (:func:`autocast_rule`, on every ``torch.autograd.Function`` under ``twinshard.comm``
and ``twinshard.pair``; ``git grep -n "autograd.Function" src/twinshard/pair src/twinshard/comm``
lists them):

1. **Closed region.** A Function's forward and backward run with autocast OFF for the device
   type of its tensors (``torch.amp.custom_fwd`` / ``custom_bwd`` semantics, the device type read
   at call time from the tensor inputs, so one Function serves CPU and CUDA; the backward runs
   with autocast off whatever state the engine thread is in). No op inside a Function is
   autocast: every dtype inside is the one its code writes, and its docstring states it.
2. **Compute dtype.** ``cast="compute"`` marks the Functions that do arithmetic (Boltz's fp32
   regions: the triangle-multiplication and outer-product contractions, the triangle-attention
   softmax, the distogram loss, the layer norm): each casts its operands itself, before the math,
   to ``ct = promote_types(dtype, float32)`` (Boltz's ``.float()`` in an autocast-disabled region;
   fp64 stays fp64), and no arithmetic op inside runs narrower than fp32 (the audit checks it:
   only copies, casts and views may make a bf16 tensor there). The decorator casts nothing
   itself: an upcast copy of an operand the Function stores or sends narrower (a bf16 tile that
   travels in bf16 and is upcast per block product) would be one transient tile more.
   ``cast=None`` (moves and comm ops, whose only arithmetic is a sum carried in
   ``reduce_dtype``): likewise no cast.
3. **Wire.** Every buffer a Function communicates has a dtype computed from the dtypes of its
   (cast) inputs and its explicit arguments, never from the autocast state (which rule 1 has
   switched off inside); a compute Function sends its operands in ``ct`` or in an explicit wire
   dtype its caller derives from the module's input dtype (the residual stream's, which autocast
   does not change); the remaining input dtypes come from the
   mode, which the pair entry points agree across ranks together with the autocast state
   (``twinshard.pair.precision``), so a rank in another mode raises on every rank before any
   buffer moves.
4. **Reductions.** Sums over ranks run in ``primitives.reduce_dtype`` (>= fp32, fp64 kept).

The audit (:class:`DtypeAudit`, tests only): per Function class and phase (forward/backward),
the dtypes of its inputs and outputs, of every tensor an op creates inside it (a
``TorchDispatchMode`` entered around the Function body, so a cast that is made and reverted
inside still shows), of what it saves for backward (``saved_tensors_hooks``), and of every
buffer the comm primitives put on the wire (with the peer or the group, so the test compares
the two ends of each message across ranks). In audit mode the primitives first agree each
buffer's dtype with the other end (one small message): a mismatch is recorded and the buffer
travels in the wider dtype, so a planted wire-dtype bug fails the test's comparison with a
message instead of hanging the world. Nothing is recorded, and nothing extra is sent, outside
an audit.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager, nullcontext
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = [
    "DtypeAudit",
    "audit_active",
    "autocast_device",
    "autocast_on",
    "autocast_rule",
    "current_function",
    "fp32_region",
    "record_wire",
]

_STACK: list[tuple[str, str]] = []  # (Function name, phase) while its body runs under an audit
_AUDITS: list[DtypeAudit] = []


def autocast_device(*values: Any) -> str:
    """The device type of the first tensor among ``values`` (nested in lists/tuples), else
    "cuda" when a world runs on CUDA, else "cpu"."""
    for v in values:
        if isinstance(v, torch.Tensor):
            return v.device.type
        if isinstance(v, (list, tuple)):
            for w in v:
                if isinstance(w, torch.Tensor):
                    return w.device.type
    return "cuda" if torch.cuda.is_available() and torch.cuda.is_initialized() else "cpu"


def autocast_on(device_type: str) -> bool:
    return bool(torch.is_autocast_enabled(device_type))


@contextmanager
def fp32_region(device_type: str = "cpu") -> Iterator[None]:
    """Autocast off for ``device_type`` (and CUDA): the explicit >= fp32 regions of the serial
    modules (Boltz's ``with torch.autocast("cuda", enabled=False)`` around ``.float()`` math)."""
    kinds = {device_type, "cuda"} if torch.cuda.is_available() else {device_type}
    on = [d for d in sorted(kinds) if autocast_on(d)]
    if not on:
        yield
        return
    with ExitStack() as stack:
        for d in on:
            stack.enter_context(torch.autocast(d, enabled=False))
        yield


def current_function() -> str | None:
    """``"Name.phase"`` of the innermost audited Function body running, else None."""
    return f"{_STACK[-1][0]}.{_STACK[-1][1]}" if _STACK else None


def audit_active() -> bool:
    return bool(_AUDITS)


def autocast_rule(cast: str | None = None) -> Callable[[type], type]:
    """Class decorator: the module docstring's rule on an ``autograd.Function`` subclass.

    ``cast``: ``"compute"`` (the Function does arithmetic, in >= fp32: rule 2) or None (a move).
    Neither casts an input. Marks the class with ``_autocast_rule = cast`` (the audit test
    checks every Function in the package carries it)."""
    if cast not in (None, "compute"):
        raise ValueError(f"cast must be None or 'compute', got {cast!r}")

    def deco(cls: type) -> type:
        fwd, bwd = cls.forward, cls.backward
        name = cls.__name__

        @functools.wraps(fwd)
        def forward(ctx: Any, *args: Any, **kwargs: Any) -> Any:
            dev = autocast_device(*args)
            ctx._amp_device = dev
            on = autocast_on(dev)
            with torch.autocast(dev, enabled=False) if on else nullcontext():
                return _run(name, "forward", fwd, ctx, args, kwargs)

        @functools.wraps(bwd)
        def backward(ctx: Any, *grads: Any) -> Any:
            dev = getattr(ctx, "_amp_device", autocast_device(*grads))
            with torch.autocast(dev, enabled=False) if autocast_on(dev) else nullcontext():
                return _run(name, "backward", bwd, ctx, grads, {})

        cls.forward = staticmethod(forward)
        cls.backward = staticmethod(backward)
        cls._autocast_rule = cast
        return cls

    return deco


def _dtypes(values: Any) -> tuple[str, ...]:
    out: list[str] = []

    def walk(v: Any) -> None:  # tensors, and explicit dtype arguments (a stated wire dtype)
        if isinstance(v, torch.Tensor):
            out.append(str(v.dtype).removeprefix("torch."))
        elif isinstance(v, torch.dtype):
            out.append(str(v).removeprefix("torch."))
        elif isinstance(v, (list, tuple)):
            for w in v:
                walk(w)

    walk(values)
    return tuple(out)


def _run(name: str, phase: str, fn: Any, ctx: Any, args: tuple, kwargs: dict) -> Any:
    if not _AUDITS:
        return fn(ctx, *args, **kwargs)
    key = f"{name}.{phase}"
    for a in _AUDITS:
        a._event(key, "inputs", _dtypes(args))
    _STACK.append((name, phase))
    try:
        with _OpRecorder():
            out = fn(ctx, *args, **kwargs)
    finally:
        _STACK.pop()
    for a in _AUDITS:
        a._event(key, "outputs", _dtypes(out))
    return out


class _OpRecorder(TorchDispatchMode):
    """Records the dtype of every tensor an op returns, under the innermost audited Function."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        key = current_function()
        if key is not None and _AUDITS:
            dts = {d for d in _dtypes(out if isinstance(out, (list, tuple)) else (out,))}
            for a in _AUDITS:
                a.ops.setdefault(key, {})
                for d in dts:
                    a.ops[key].setdefault(d, set()).add(str(func.__name__))
        return out


def record_wire(op: str, dtype: torch.dtype, kind: str, peer: Any) -> None:
    """One buffer on the wire (``kind``: the primitive, e.g. "all_reduce", or "send"/"recv";
    ``peer``: the global peer rank, or the tuple of the group's global ranks), recorded in every
    active audit."""
    for a in _AUDITS:
        a.wire.append(WireRecord(op, str(dtype).removeprefix("torch."), kind, peer, current_function()))


@dataclass(frozen=True)
class WireRecord:
    op: str
    dtype: str
    kind: str
    peer: Any
    function: str | None


@dataclass
class DtypeAudit:
    """What the module docstring says, for one rank. Use as a context manager around a forward
    and backward; then ``summary()`` (picklable) is compared across ranks by the tests.

    ``events[key]``: the list of (what, dtypes) per call (what: inputs, outputs; the inputs'
    dtypes include explicit ``torch.dtype`` arguments, e.g. a stated wire dtype);
    ``ops[key][dtype]``: the ops that created a tensor of that dtype inside the Function body;
    ``saved[key]``: dtypes of the tensors saved for backward inside it; ``wire``: every buffer.
    ``key`` is ``"<Function>.<phase>"``."""

    events: dict[str, list[tuple[str, tuple[str, ...]]]] = field(default_factory=dict)
    ops: dict[str, dict[str, set[str]]] = field(default_factory=dict)
    saved: dict[str, list[str]] = field(default_factory=dict)
    wire: list[WireRecord] = field(default_factory=list)
    mismatches: list[str] = field(default_factory=list)

    def _event(self, key: str, what: str, dtypes: tuple[str, ...]) -> None:
        self.events.setdefault(key, []).append((what, dtypes))

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        key = current_function()
        if key is not None:
            self.saved.setdefault(key, []).append(str(t.dtype).removeprefix("torch."))
        return t

    def __enter__(self) -> DtypeAudit:
        _AUDITS.append(self)
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self._hooks.__exit__(*exc)
        _AUDITS.remove(self)

    def functions(self) -> set[str]:
        return {k.split(".")[0] for k in self.events}

    def summary(self) -> dict[str, Any]:
        return {
            "events": {k: list(v) for k, v in self.events.items()},
            "ops": {k: {d: sorted(s) for d, s in v.items()} for k, v in self.ops.items()},
            "saved": {k: list(v) for k, v in self.saved.items()},
            "wire": [tuple(vars(w).values()) for w in self.wire],
            "mismatches": list(self.mismatches),
        }


def note_mismatch(text: str) -> None:
    for a in _AUDITS:
        a.mismatches.append(text)
