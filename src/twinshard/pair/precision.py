"""Precision modes of the pair entry points (``twinshard trunk``, ``twinshard predict``, the trunk
training step): one explicit option, agreed across ranks.

=============  ==============  ==================  ==========================  =================
mode           parameters      activations/inputs  autocast                    TF32 matmuls (CUDA)
=============  ==============  ==================  ==========================  =================
``fp64``       float64         float64             off                         off
``fp32``       float32         float32             off                         off
``tf32``       float32         float32             off                         on
``bf16``       bfloat16        bfloat16            off                         off
``bf16-mixed`` float32         float32             bfloat16 (the inputs' dev.) off
=============  ==============  ==================  ==========================  =================

``fp64`` is the parity mode (every parity test); ``bf16-mixed`` is Boltz-2's training and
inference mode (Lightning's ``"bf16-mixed"``: ``torch.autocast`` with bfloat16 around fp32
weights), with Boltz's fp32 regions kept by the modules themselves (autocast off and operands
>= fp32 in the triangle-multiplication and outer-product contractions, the triangle-attention and
pair-bias attention softmaxes and the whole attention half of a Pairformer layer, the distogram
loss; see ``twinshard.comm.amp`` for the rule every autograd Function follows). ``tf32`` is fp32
storage with TF32 tensor-core matmuls on CUDA (``torch.backends.cuda.matmul.allow_tf32`` and
``cudnn.allow_tf32``); on CPU it computes as ``fp32``. In every mode sums over ranks and the
reductions inside the fp32 regions run in >= fp32 (fp64 stays fp64).

Agreement. :meth:`Precision.scope` first agrees, over the world, the mode and the autocast state
each rank is actually in (``runtime.agree_scalars``: a rank in another mode, or one that entered
or left ``torch.autocast`` on its own, raises the same ``ValueError`` on every rank, before any
buffer moves), then sets the TF32 flags and enters autocast as the mode says, restoring both on
exit.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from twinshard.comm.amp import autocast_on
from twinshard.runtime.agree import agree_scalars

__all__ = ["MODES", "Precision", "add_precision_options", "dtype_default", "precision", "run_in_mode"]

MODES = ("fp64", "fp32", "tf32", "bf16", "bf16-mixed")


@dataclass(frozen=True)
class Precision:
    """One mode of the table in the module docstring."""

    name: str
    param_dtype: torch.dtype
    activation_dtype: torch.dtype
    autocast_dtype: torch.dtype | None
    tf32: bool

    def cast_module(self, module: nn.Module) -> nn.Module:
        """``module`` with its parameters and buffers in the mode's parameter dtype (in place)."""
        return module.to(self.param_dtype)

    def cast_inputs(self, value: Any) -> Any:
        """Floating tensors (nested in dicts, lists, tuples) in the activation dtype; masks and
        indices of other dtypes untouched."""
        if isinstance(value, torch.Tensor):
            return value.to(self.activation_dtype) if value.is_floating_point() else value
        if isinstance(value, dict):
            return {k: self.cast_inputs(v) for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            return type(value)(self.cast_inputs(v) for v in value)
        return value

    def control(self, device_type: str = "cpu") -> dict[str, Any]:
        """The scalars agreed across ranks: the mode and this rank's autocast state now."""
        on = autocast_on(device_type)
        dt = torch.get_autocast_dtype(device_type) if on else None
        return {"precision": self.name, "autocast": on, "autocast_dtype": str(dt)}

    @contextmanager
    def scope(self, device_type: str = "cpu", what: str = "precision", agree: bool = True) -> Iterator[None]:
        """Agree the mode (and the autocast state each rank is in) over the world, then run the
        body in the mode: TF32 flags on CUDA, ``torch.autocast(device_type, bfloat16)`` for
        ``bf16-mixed``. Restores the flags on exit. ``agree=False``: no collective (a caller that
        agreed already, or a serial run)."""
        if agree:
            agree_scalars(self.control(device_type), f"{what} (the precision mode)")
        with ExitStack() as stack:
            if torch.cuda.is_available():
                old = (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32)
                torch.backends.cuda.matmul.allow_tf32 = self.tf32
                torch.backends.cudnn.allow_tf32 = self.tf32

                def restore() -> None:
                    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = old

                stack.callback(restore)
            if self.autocast_dtype is not None:
                stack.enter_context(torch.autocast(device_type, dtype=self.autocast_dtype))
            yield


_TABLE = {
    "fp64": Precision("fp64", torch.float64, torch.float64, None, False),
    "fp32": Precision("fp32", torch.float32, torch.float32, None, False),
    "tf32": Precision("tf32", torch.float32, torch.float32, None, True),
    "bf16": Precision("bf16", torch.bfloat16, torch.bfloat16, None, False),
    "bf16-mixed": Precision("bf16-mixed", torch.float32, torch.float32, torch.bfloat16, False),
}


def precision(name: str | Precision) -> Precision:
    """The mode called ``name`` (one of :data:`MODES`); raises ValueError naming the choices."""
    if isinstance(name, Precision):
        return name
    if name not in _TABLE:
        raise ValueError(f"precision must be one of {MODES}, got {name!r}")
    return _TABLE[name]


def dtype_default(dtype_name: str | None, precision_name: str | None, default: str) -> Precision:
    """The mode of a CLI that has both ``--dtype`` (float32/float64, the older option) and
    ``--precision``: ``--precision`` wins; ``--dtype`` alone maps float64 -> fp64 and float32 ->
    fp32; neither: ``default``. Both given and disagreeing about the storage dtype: ValueError."""
    if precision_name is None:
        if dtype_name is None:
            return precision(default)
        return precision({"float64": "fp64", "float32": "fp32"}[dtype_name])
    mode = precision(precision_name)
    if dtype_name is not None and getattr(torch, dtype_name) != mode.param_dtype:
        raise ValueError(
            f"--dtype {dtype_name} contradicts --precision {mode.name} (parameters in "
            f"{str(mode.param_dtype).removeprefix('torch.')}): pass --precision alone"
        )
    return mode


def run_in_mode(mode_name: str, fn: Any, *args: Any) -> Any:
    """``fn(*args)`` inside the scope of the mode ``mode_name`` (agreed over the world first): the
    rank body of a command run with ``runtime.run_ranks(run_in_mode, n, mode, body, ...)``."""
    from twinshard.runtime import get_world

    with precision(mode_name).scope(get_world().device.type, what=getattr(fn, "__name__", "rank body")):
        return fn(*args)


def add_precision_options(parser: Any, note: str = "") -> None:
    """A command's ``--dtype`` (the older option) and ``--precision`` (read them with
    :func:`dtype_default`); ``note`` ends the ``--precision`` help."""
    parser.add_argument(
        "--dtype",
        choices=("float32", "float64"),
        default=None,
        help="parameter and activation dtype (the older option; --precision says more)",
    )
    parser.add_argument(
        "--precision",
        choices=MODES,
        default=None,
        help="fp32 (default), tf32 (TF32 matmuls on CUDA), bf16 (weights and activations), bf16-mixed "
        "(autocast around fp32 weights, Boltz's fp32 regions kept: Boltz-2's own mode), fp64" + note,
    )
