"""Row-wise and column-wise dropout with counter-based masks, in two conventions.

For a tensor ``x[..., R, C, c]`` (pair ``z[B, N, N, c]`` or MSA ``m[B, S, N, c]``), the
``"af3"`` convention (AF2/AF3 supplement, OpenFold):

- row-wise dropout shares one mask across all rows: ``mask[..., 1, C, c]`` keyed
  by (batch, column j, channel) -- AF3 ``DropoutRowwise`` after triangle
  multiplication, triangle attention (starting node) and in the MSA module;
- column-wise dropout shares it across all columns: ``mask[..., R, 1, c]`` keyed
  by (batch, row i, channel) -- AF3 ``DropoutColumnwise`` after triangle
  attention (ending node).

The ``"boltz"`` convention (Boltz-2's ``get_dropout_mask``) drops whole rows or columns
instead, one draw shared over the other spatial axis and all channels:

- row-wise: ``mask[..., R, 1, 1]`` keyed by (batch, row i) (Boltz's ``z[:, :, 0:1, 0:1]``);
- column-wise: ``mask[..., 1, C, 1]`` keyed by (batch, column j) (``z[:, 0:1, :, 0:1]``).

Boltz-2 draws its masks from torch's stateful generator; here both conventions draw from
``twinshard.rng`` keyed by GLOBAL (batch, position, channel), so a rank
that holds rows/columns starting at an offset draws exactly the serial mask for
its block, for any grid. ``seed`` changes per training step and ``stream``
separates dropout sites; the same (seed, stream) gives the same mask.
Kept entries are scaled by 1 / (1 - p).

Streams. Two sites with the same stream draw the same mask, a silent correlation.
So a site has no default stream: give ``stream=`` (an int, or a name hashed by
:func:`stream_id`), or leave it None and call :func:`assign_dropout_streams` on
the model, which derives each site's stream from its qualified module name (the
serial model and its twin share names, so they share streams) and raises if two
sites collide. A site still without a stream raises in training mode.

Data parallelism. A replica that holds batch elements ``[k, k + B_local)`` of a larger batch
draws their masks under ``with batch_offset(k):`` (the key is the element's index in the whole
batch), so dp replicas together draw the serial masks of the whole batch. The offset is
process-wide (backward's recomputation under checkpointing must see it too, on any thread).
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn

from twinshard.rng import uniform

__all__ = [
    "CONVENTIONS",
    "Dropout",
    "assign_dropout_streams",
    "batch_offset",
    "current_batch_offset",
    "dropout_mask",
    "stream_id",
]

CONVENTIONS = ("af3", "boltz")

# The "boltz" masks have no channel axis; they are keyed with this channel index, which no
# tensor reaches, so the two conventions never share a draw.
_BOLTZ_CHANNEL_KEY = 2**32 - 1


_BATCH_OFFSET = 0


@contextmanager
def batch_offset(k: int) -> Iterator[None]:
    """Masks drawn in the block key batch element ``b`` as ``k + b`` (module docstring)."""
    global _BATCH_OFFSET
    if int(k) < 0:
        raise ValueError(f"a batch offset is a non-negative index, got {k}")
    saved, _BATCH_OFFSET = _BATCH_OFFSET, int(k)
    try:
        yield
    finally:
        _BATCH_OFFSET = saved


def current_batch_offset() -> int:
    """The batch offset of the enclosing :func:`batch_offset` block (0 outside one): the index in
    the whole batch of the first element this process holds. Other counter-keyed draws (the
    structure module's sample rows, ``reference.sampler``) read it too."""
    return _BATCH_OFFSET


def stream_id(name: str) -> int:
    """A stable 32-bit stream number for a dropout site's name (blake2b; the same on every
    machine and Python process, unlike ``hash``)."""
    return int.from_bytes(hashlib.blake2b(name.encode(), digest_size=4).digest(), "little")


def dropout_mask(
    shape: tuple[int, ...] | torch.Size,
    p: float,
    *,
    seed: int,
    stream: int,
    columnwise: bool = False,
    row_offset: int = 0,
    col_offset: int = 0,
    dtype: torch.dtype = torch.float64,
    device: torch.device | None = None,
    convention: str = "af3",
) -> torch.Tensor:
    """Scaled keep-mask for ``x`` of ``shape = (..., R, C, c)``.

    Returns, holding 0 or 1 / (1 - p): ``[..., 1, C, c]`` (row-wise) or ``[..., R, 1, c]``
    (column-wise) in the ``"af3"`` convention; ``[..., R, 1, 1]`` (row-wise) or
    ``[..., 1, C, 1]`` (column-wise) in the ``"boltz"`` one. ``row_offset`` /
    ``col_offset`` are the global indices of the block's first row / column (0 for a
    serial tensor). Leading dims are unsharded: their flat index is the batch key.
    """
    if convention not in CONVENTIONS:
        raise ValueError(f"dropout convention must be one of {CONVENTIONS}, got {convention!r}")
    shape = tuple(int(s) for s in shape)
    if len(shape) < 3:
        raise ValueError(f"dropout needs x[..., R, C, c], got shape {shape}")
    if not 0.0 <= p < 1.0:
        raise ValueError(f"dropout probability must be in [0, 1), got {p}")
    lead, (rows, cols, chans) = shape[:-3], shape[-3:]
    nb = math.prod(lead)
    # the flat leading index of element (b, rest...) is b * prod(rest) + ...: a batch offset of
    # k elements (batch_offset) shifts it by k * prod(rest)
    start = _BATCH_OFFSET * math.prod(lead[1:]) if lead else 0
    b = torch.arange(start, start + nb, dtype=torch.int64, device=device).view(nb, 1, 1)
    ch = torch.arange(chans, dtype=torch.int64, device=device).view(1, 1, chans)
    # af3 row-wise and boltz column-wise vary along the columns; the other two along the rows.
    along_rows = columnwise == (convention == "af3")
    if along_rows:
        pos = torch.arange(row_offset, row_offset + rows, dtype=torch.int64, device=device)
    else:
        pos = torch.arange(col_offset, col_offset + cols, dtype=torch.int64, device=device)
    if convention == "boltz":
        ch = torch.full((1, 1, 1), _BOLTZ_CHANNEL_KEY, dtype=torch.int64, device=device)
        out_shape = (*lead, rows, 1, 1) if along_rows else (*lead, 1, cols, 1)
    else:
        out_shape = (*lead, rows, 1, chans) if along_rows else (*lead, 1, cols, chans)
    u = uniform(seed, stream, b, pos.view(1, -1, 1), ch, device=device)
    mask = (u >= p).to(dtype) * (1.0 / (1.0 - p))
    return mask.reshape(out_shape)


class Dropout(nn.Module):
    """Row-wise (default) or column-wise dropout of ``x[..., R, C, c]``; no parameters.

    ``convention`` (``"af3"``, the default, or ``"boltz"``) picks the mask's shape and keys
    (module docstring).

    ``forward(x, seed=...)``: identity in eval mode or when ``p == 0``; in training
    mode a ``seed`` (e.g. the step number mixed with a run seed) is required, so
    every rank and the serial twin draw the same mask.
    """

    def __init__(
        self, p: float, columnwise: bool = False, stream: int | str | None = None, convention: str = "af3"
    ):
        super().__init__()
        if not 0.0 <= p < 1.0:
            raise ValueError(f"dropout probability must be in [0, 1), got {p}")
        if convention not in CONVENTIONS:
            raise ValueError(f"dropout convention must be one of {CONVENTIONS}, got {convention!r}")
        self.p = float(p)
        self.columnwise = bool(columnwise)
        self.convention = convention
        self.stream: int | None = stream_id(stream) if isinstance(stream, str) else stream
        if self.stream is not None and not 0 <= int(self.stream) < 2**32:
            raise ValueError(f"dropout stream must be in [0, 2**32), got {stream}")

    def active(self) -> bool:
        return self.training and self.p > 0.0

    def mask(
        self,
        shape: tuple[int, ...] | torch.Size,
        seed: int,
        dtype: torch.dtype,
        device: torch.device | None = None,
        row_offset: int = 0,
        col_offset: int = 0,
    ) -> torch.Tensor:
        """This site's mask for a block starting at (row_offset, col_offset)."""
        if self.stream is None:
            raise ValueError(
                "this Dropout site has no stream, and sites sharing one draw the same mask: pass "
                "stream= (an int or a name) or call twinshard.pair.reference.assign_dropout_streams(model)"
            )
        return dropout_mask(
            shape,
            self.p,
            seed=seed,
            stream=self.stream,
            columnwise=self.columnwise,
            row_offset=row_offset,
            col_offset=col_offset,
            dtype=dtype,
            device=device,
            convention=self.convention,
        )

    def forward(self, x: torch.Tensor, seed: int | None = None) -> torch.Tensor:
        if not self.active():
            return x
        if seed is None:
            raise ValueError(
                "dropout in training mode needs seed=<int> (e.g. derived from the step), "
                "so that every rank draws the same mask as the serial model"
            )
        return x * self.mask(x.shape, seed, x.dtype, x.device)

    def extra_repr(self) -> str:
        kind = "columnwise" if self.columnwise else "rowwise"
        return f"p={self.p}, {kind}, stream={self.stream}, convention={self.convention!r}"


def assign_dropout_streams(model: nn.Module) -> dict[str, int]:
    """Give every ``Dropout`` in ``model`` without a stream the :func:`stream_id` of its qualified
    name; raise if two sites end up with the same stream. Returns ``{name: stream}``.

    Call it on the serial model and on its twin: both have the same module names, hence the
    same streams, so the twin draws the serial masks.
    """
    streams: dict[str, int] = {}
    for name, mod in model.named_modules():
        if isinstance(mod, Dropout):
            if mod.stream is None:
                mod.stream = stream_id(name or type(model).__name__)
            streams[name] = int(mod.stream)
    seen: dict[int, str] = {}
    for name, st in streams.items():
        if st in seen:
            raise ValueError(
                f"dropout sites {seen[st]!r} and {name!r} share stream {st}, so they would draw the "
                "same mask: give one of them another stream="
            )
        seen[st] = name
    return streams
