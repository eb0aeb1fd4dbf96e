"""DTensor boundary helpers: contract placements, explicit from_local, padding.

Distributed modules take DTensors at their boundary, work on the local tile with
plain tensor math and explicit ``twinshard.comm`` collectives, and wrap the
result with :func:`from_local`, which states the global shape and stride (no
``run_check`` collective, no implicit redistribution).

Pair contract on a rows x cols grid (mesh dims ``("rows", "cols")``):

======== =================== ============================= ====================
kind     tensor              placements (rows, cols)       tile on rank (r, c)
======== =================== ============================= ====================
pair     ``z[B, N, N, ...]`` ``(Shard(1), Shard(2))``      rows block r x cols
                                                           block c
single   ``s[B, N, ...]``    ``(Shard(1), Replicate())``   rows block r, same on
                                                           every rank of grid row
msa      ``m[B, S, N, ...]`` ``(Shard(1), Shard(2))``      sequences block r x
                                                           tokens block c
sample   ``x[B, ...]``       ``(Replicate(), Replicate())`` everything
======== =================== ============================= ====================

Uneven sizes (policy). Every tile of a tensor has the same shape, so tile
shapes, sends and receives agree on all ranks and the global shape follows from
the local one. The token count N is padded at the END, separately along each grid
axis: to a multiple of ``rows`` where tokens are split over grid rows (dim 1 of
``z``/``s``) and to a multiple of ``cols`` where they are split over grid columns
(dim 2 of ``z`` and ``m``), so ``z`` is ``[B, Nr, Nc, ...]``, square only when both
paddings agree (always on a square grid). Per rank this is the least any 2-D block
tiling can hold, ``ceil(N / rows) * ceil(N / cols)`` entries of ``z`` (one padded
length for both axes, a multiple of ``lcm(rows, cols)``, held up to ``(N + lcm - 1)^2 / P``).
Tokens that exist along one axis only (``min(Nr, Nc) <= k < max(Nr, Nc)``) are padding:
the mixing layers treat every token index as padding beyond either extent (a missing
row or column is zero). The MSA depth S is padded up to a multiple of ``rows``.
Padding at the end keeps every real entry at its serial global index, so
index-keyed randomness (dropout) needs no translation. Padded entries are filled
with zeros and their masks are zero: token-local layers may write finite junk
there, mixing layers (triangle updates, outer product mean, attention) must
apply the masks, and the collector slices padding away
(:mod:`twinshard.pair.features`).

All checks here depend only on replicated metadata (shapes, placements, grid),
so every rank raises the same error at the same point, without a collective.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Placement, Replicate, Shard

from twinshard.runtime.grid import ProcessGrid

__all__ = [
    "MSA",
    "PAIR",
    "PAIR_MESH_DIMS",
    "SAMPLE",
    "SINGLE",
    "block_range",
    "check_placements",
    "from_local",
    "local_block",
    "local_offsets",
    "pad_dim",
    "pad_multiple",
    "padded_sequences",
    "padded_tokens",
    "padding_mask",
    "placements_str",
    "real_tile",
    "reduction_axes",
    "tile_slices",
    "unpad",
]

PAIR_MESH_DIMS = ("rows", "cols")
PAIR: tuple[Placement, ...] = (Shard(1), Shard(2))
SINGLE: tuple[Placement, ...] = (Shard(1), Replicate())
MSA: tuple[Placement, ...] = (Shard(1), Shard(2))
SAMPLE: tuple[Placement, ...] = (Replicate(), Replicate())

GridLike = ProcessGrid | DeviceMesh


# -- sizes and padding ----------------------------------------------------------------------


def _mesh(grid: GridLike) -> DeviceMesh:
    return grid.mesh if isinstance(grid, ProcessGrid) else grid


def _shape(grid: GridLike | Sequence[int]) -> tuple[int, ...]:
    if isinstance(grid, ProcessGrid):
        return tuple(grid.shape)
    if isinstance(grid, DeviceMesh):
        return tuple(grid.shape)
    return tuple(int(s) for s in grid)


def pad_multiple(n: int, multiple: int) -> int:
    """Smallest multiple of ``multiple`` that is >= ``n`` (``n >= 1``)."""
    if n < 1 or multiple < 1:
        raise ValueError(f"sizes must be positive, got n={n}, multiple={multiple}")
    return -(-n // multiple) * multiple


def padded_tokens(n: int, grid: GridLike | Sequence[int]) -> tuple[int, int]:
    """Padded token counts ``(Nr, Nc)`` on a rows x cols grid: ``n`` padded to a multiple of
    ``rows`` (tokens split over grid rows) and of ``cols`` (split over grid columns)."""
    shape = _shape(grid)
    if len(shape) != 2:
        raise ValueError(f"token padding needs a rows x cols grid, got {shape}")
    return pad_multiple(n, shape[0]), pad_multiple(n, shape[1])


def padded_sequences(s: int, grid: GridLike | Sequence[int]) -> int:
    """Padded MSA depth: a multiple of the number of grid rows."""
    return pad_multiple(s, _shape(grid)[0])


def padding_mask(
    n: int, n_padded: int, *, dtype: torch.dtype = torch.float64, device: torch.device | None = None
) -> torch.Tensor:
    """``[n_padded]`` vector: 1 for the ``n`` real entries, 0 for the padding after them."""
    if not 0 < n <= n_padded:
        raise ValueError(f"need 0 < n <= n_padded, got n={n}, n_padded={n_padded}")
    m = torch.zeros(n_padded, dtype=dtype, device=device)
    m[:n] = 1
    return m


def pad_dim(x: torch.Tensor, dim: int, size: int, value: float = 0.0) -> torch.Tensor:
    """``x`` padded at the end of ``dim`` up to ``size`` (differentiable; no copy when equal)."""
    dim = dim % x.ndim
    extra = size - x.shape[dim]
    if extra < 0:
        raise ValueError(f"cannot pad dim {dim} of size {x.shape[dim]} down to {size}")
    if extra == 0:
        return x
    pad = [0, 0] * (x.ndim - dim - 1) + [0, extra]
    return F.pad(x, pad, value=value)


def unpad(x: torch.Tensor, sizes: dict[int, int]) -> torch.Tensor:
    """``x`` with each ``dim`` in ``sizes`` cut back to its first ``sizes[dim]`` entries."""
    idx = [slice(None)] * x.ndim
    for dim, n in sizes.items():
        idx[dim % x.ndim] = slice(0, n)
    return x[tuple(idx)]


# -- tiles ----------------------------------------------------------------------------------


def block_range(size: int, parts: int, index: int) -> tuple[int, int]:
    """``[start, stop)`` of block ``index`` when ``size`` splits into ``parts`` equal blocks."""
    if size % parts:
        raise ValueError(
            f"size {size} does not split into {parts} equal blocks: pad it first "
            "(twinshard.pair.tiling.padded_tokens / pad_dim)"
        )
    b = size // parts
    return index * b, (index + 1) * b


def _coords(grid: GridLike) -> tuple[int, ...]:
    if isinstance(grid, ProcessGrid):
        return tuple(grid.coords)
    c = grid.get_coordinate()
    if c is None:
        raise ValueError("this rank is not part of the device mesh")
    return tuple(c)


def _check_placement_kinds(placements: Sequence[Placement], ndim: int, what: str) -> None:
    sharded: dict[int, int] = {}
    for a, p in enumerate(placements):
        if isinstance(p, Shard):
            d = p.dim % ndim
            if d in sharded:
                raise ValueError(
                    f"{what}: tensor dim {d} is sharded over two mesh axes; "
                    "twinshard tiles one tensor dim per grid axis"
                )
            sharded[d] = a
        elif isinstance(p, Partial):
            raise ValueError(
                f"{what}: Partial placements are not accepted at a module boundary; "
                "reduce explicitly with twinshard.comm first"
            )
        elif not isinstance(p, Replicate):
            raise ValueError(f"{what}: unsupported placement {p!r}")


def tile_slices(
    global_shape: Sequence[int],
    grid: GridLike | Sequence[int],
    placements: Sequence[Placement],
    coords: Sequence[int] | None = None,
) -> tuple[slice, ...]:
    """Where the tile of grid position ``coords`` (default: this rank's) sits in the global tensor.

    One slice per tensor dim: ``block_range`` along every sharded dim, everything along the
    others. The one tiling rule of the project (features, contractions, the worked example and
    the sharding evidence all call it); sizes must split evenly (pad first).
    """
    shape = _shape(grid)
    coords = _coords(grid) if coords is None else tuple(coords)  # type: ignore[arg-type]
    _check_placement_kinds(placements, len(global_shape), "tile_slices")
    idx = [slice(0, int(n)) for n in global_shape]
    for a, p in enumerate(placements):
        if isinstance(p, Shard):
            d = p.dim % len(global_shape)
            idx[d] = slice(*block_range(int(global_shape[d]), shape[a], coords[a]))
    return tuple(idx)


def real_tile(
    local: torch.Tensor,
    grid: GridLike | Sequence[int],
    placements: Sequence[Placement],
    real_shape: Sequence[int],
    coords: Sequence[int] | None = None,
) -> tuple[torch.Tensor, tuple[slice, ...]]:
    """The real (unpadded) part of an equal-size tile and where it sits in the unpadded tensor.

    ``local`` is the tile at ``coords`` of a tensor padded at the end of each dim from
    ``real_shape``; returns ``(local[real entries], index)`` with ``index`` one slice per dim
    into the unpadded tensor. A tile made only of padding gives an empty part.
    """
    shape = _shape(grid)
    padded = list(local.shape)
    for a, p in enumerate(placements):
        if isinstance(p, Shard):
            padded[p.dim % local.ndim] *= shape[a]
    if len(real_shape) != local.ndim or any(r > q for r, q in zip(real_shape, padded)):
        raise ValueError(f"real shape {tuple(real_shape)} does not fit the padded shape {tuple(padded)}")
    glob = tile_slices(padded, grid, placements, coords)
    cut, index = [], []
    for g, r in zip(glob, real_shape):
        lo, hi = min(g.start, r), min(g.stop, r)
        cut.append(slice(0, hi - lo))
        index.append(slice(lo, hi))
    return local[tuple(cut)], tuple(index)


def local_offsets(
    global_shape: Sequence[int], grid: GridLike, placements: Sequence[Placement]
) -> tuple[int, ...]:
    """Global index of this rank's tile origin, one entry per tensor dim."""
    return tuple(s.start for s in tile_slices(global_shape, grid, placements))


def local_block(full: torch.Tensor, grid: GridLike, placements: Sequence[Placement]) -> torch.Tensor:
    """This rank's tile of a tensor that every rank holds in full (a contiguous copy).

    Sizes must split evenly (pad first). Differentiable: the adjoint scatters the
    tile's gradient into zeros, so ``full.grad`` on one rank holds only its tile.
    """
    return full[tile_slices(full.shape, grid, placements)].contiguous()


def _contiguous_stride(shape: Sequence[int]) -> tuple[int, ...]:
    stride, acc = [], 1
    for s in reversed(shape):
        stride.append(acc)
        acc *= max(1, s)
    return tuple(reversed(stride))


def from_local(
    local: torch.Tensor,
    grid: GridLike,
    placements: Sequence[Placement],
    global_shape: Sequence[int] | None = None,
) -> DTensor:
    """Wrap an equal-size tile as a DTensor with an explicit global shape and stride.

    ``global_shape=None`` infers it (tile size x grid size along each sharded dim),
    valid because every tile has the same shape (see the padding policy above).
    No communication (``run_check=False``): the caller guarantees the tiles agree.
    Differentiable; the gradient's placements must equal ``placements``.
    """
    mesh, shape = _mesh(grid), _shape(grid)
    placements = tuple(placements)
    if len(placements) != len(shape):
        raise ValueError(f"{len(placements)} placements for a {len(shape)}-D grid")
    _check_placement_kinds(placements, local.ndim, "from_local")
    expected = list(local.shape)
    for a, p in enumerate(placements):
        if isinstance(p, Shard):
            expected[p.dim % local.ndim] *= shape[a]
    if global_shape is None:
        global_shape = expected
    global_shape = tuple(int(s) for s in global_shape)
    if tuple(expected) != global_shape:
        raise ValueError(
            f"local tile {tuple(local.shape)} with placements {placements_str(placements)} on a "
            f"{'x'.join(map(str, shape))} grid implies global shape {tuple(expected)}, not "
            f"{global_shape}: tiles must be equal (pad to a multiple of the grid first)"
        )
    return DTensor.from_local(
        local,
        mesh,
        placements,
        run_check=False,
        shape=torch.Size(global_shape),
        stride=_contiguous_stride(global_shape),
    )


# -- contract checks ------------------------------------------------------------------------


def placements_str(placements: Sequence[Placement]) -> str:
    return "(" + ", ".join(repr(p) for p in placements) + ")"


def check_placements(
    x: object,
    placements: Sequence[Placement],
    what: str,
    grid: GridLike | None = None,
    mesh_dim_names: Sequence[str] | None = PAIR_MESH_DIMS,
    ndim: int | None = None,
) -> DTensor:
    """Return ``x`` if it is a DTensor at ``placements`` (on ``grid``'s mesh); raise otherwise.

    The error names the tensor (``what``), the placements found and expected, and
    how to get the right ones. It also rejects tiles of unequal size (uneven
    global shapes): those must be padded. ``ndim`` optionally checks the rank.
    """
    want = placements_str(placements)
    if not isinstance(x, DTensor):
        raise TypeError(
            f"{what} must be a DTensor with placements {want} on the pair grid, got "
            f"{type(x).__name__}: build it with twinshard.pair.features.distribute or "
            "twinshard.pair.tiling.from_local"
        )
    if ndim is not None and x.ndim != ndim:
        raise ValueError(f"{what} must have {ndim} dims, got shape {tuple(x.shape)}")
    mesh = x.device_mesh
    if grid is not None and _mesh(grid) is not mesh and _mesh(grid) != mesh:
        raise ValueError(f"{what} lives on mesh {mesh}, not on the grid given ({_mesh(grid)})")
    if mesh_dim_names is not None and tuple(mesh.mesh_dim_names or ()) != tuple(mesh_dim_names):
        raise ValueError(
            f"{what} lives on a mesh with dims {mesh.mesh_dim_names}, expected "
            f"{tuple(mesh_dim_names)}: use a grid from make_grid((rows, cols))"
        )
    got = tuple(x.placements)
    norm_got = tuple(Shard(p.dim % x.ndim) if isinstance(p, Shard) else p for p in got)
    norm_want = tuple(Shard(p.dim % x.ndim) if isinstance(p, Shard) else p for p in placements)
    if norm_got != norm_want:
        raise ValueError(
            f"{what} has placements {placements_str(got)} but this module needs {want} on mesh "
            f"{tuple(mesh.mesh_dim_names or ())}: distribute it with twinshard.pair.features, or "
            "redistribute once at the boundary (not inside a hot loop)"
        )
    for a, p in enumerate(norm_got):
        if isinstance(p, Shard) and x.shape[p.dim] % mesh.size(a):
            raise ValueError(
                f"{what} has size {x.shape[p.dim]} along dim {p.dim}, not a multiple of the "
                f"{mesh.size(a)} ranks of mesh axis {a}: pad it (twinshard.pair.tiling)"
            )
    return x


def reduction_axes(placements: Sequence[Placement]) -> tuple[int, ...]:
    """Mesh axes along which a tensor at ``placements`` is sharded.

    A replicated parameter used on such a tensor has a partial gradient on each
    rank that must be summed over exactly these axes; along replicated axes every
    rank computed the same contribution and summing would over-count it.
    """
    return tuple(a for a, p in enumerate(placements) if isinstance(p, Shard))
