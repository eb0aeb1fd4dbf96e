"""A batch of systems as one set of rows: validation, the header every rank needs, the split back.

Helpers of :mod:`twinshard.atoms.parallel.graph_storage`: a batch (one System or a list of Systems of any
sizes) is concatenated in the caller's order, so global row ``g`` is atom ``g`` of the
concatenation; :func:`balanced_counts` splits the rows into contiguous per-rank blocks;
:func:`split_systems` cuts gathered rows back into Systems. Only :func:`broadcast_header` is
collective.
"""

from __future__ import annotations

import pickle
from typing import Any

import torch
import torch.distributed as dist

from twinshard.atoms.data.system import System
from twinshard.atoms.parallel.plain_inputs import SYSTEM_VALUES
from twinshard.atoms.parallel.sharded import check_ids, source_system
from twinshard.comm import primitives as prim

__all__ = [
    "FIELDS",
    "as_batch",
    "balanced_counts",
    "batch_header",
    "broadcast_header",
    "fingerprint",
    "split_systems",
]

FIELDS = ("numbers", "ids", "masses", "velocities")  # per-atom, sharded (positions: replicated)


def balanced_counts(n: int, nranks: int) -> tuple[int, ...]:
    """Rows per rank of ``n`` rows in ``nranks`` contiguous blocks differing by at most one."""
    return tuple(n // nranks + (1 if r < n % nranks else 0) for r in range(nranks))


def as_batch(source: Any, dtype: torch.dtype | None) -> list[System]:
    """Validated Systems from a System / ``ase.Atoms`` / path or a list of them (one dtype; each
    system's ids unique and in range)."""
    items = list(source) if isinstance(source, (list, tuple)) else [source]
    if not items:
        raise ValueError("graph storage: an empty batch (give a System or a non-empty list of them)")
    systems = [source_system(s, dtype) for s in items]
    dtypes = {s.dtype for s in systems}
    if len(dtypes) != 1:
        raise ValueError(
            f"graph storage: the systems of a batch have different dtypes {sorted(map(str, dtypes))}"
        )
    for s in systems:
        check_ids(s.ids)
    return systems


def fingerprint(systems: list[System]) -> torch.Tensor:
    """Numbers every rank can compare to tell whether they hold the same batch (sizes, positions,
    numbers and ids weighted by row, cells, pbc, charge and spin)."""
    rows: list[float] = [float(len(systems))]
    for s in systems:
        k = torch.arange(1, s.n_atoms + 1, dtype=torch.float64)
        x = s.positions.detach().to(torch.float64)
        rows += [
            float(s.n_atoms),
            float((x.sum(1) * k).sum()),
            float((s.numbers.to(torch.float64) * k).sum()),
            float((s.ids.to(torch.float64) * k).sum()),
            float(s.cell.to(torch.float64).sum()),
            float(s.pbc.to(torch.float64) @ torch.tensor([1.0, 2.0, 4.0], dtype=torch.float64)),
        ]
        # the per-system values a model reads (plain_inputs.SYSTEM_VALUES); inf (equal to itself) if absent
        rows += [float(s.info.get(key, float("inf"))) for key in SYSTEM_VALUES]
    return torch.tensor(rows, dtype=torch.float64)


def batch_header(systems: list[System]) -> dict[str, Any]:
    """What every rank needs of the batch: sizes, cells, pbc, dtype, the per-atom fields' schema."""
    return {
        "sizes": [s.n_atoms for s in systems],
        "cells": torch.stack([s.cell.detach() for s in systems]),
        "pbcs": torch.stack([torch.as_tensor(s.pbc, dtype=torch.bool).reshape(3) for s in systems]),
        "dtype": systems[0].dtype,
        "schema": {
            k: (getattr(systems[0], k).dtype, tuple(getattr(systems[0], k).shape[1:])) for k in FIELDS
        },
        "infos": [dict(s.info) for s in systems],
    }


def broadcast_header(
    header: dict[str, Any] | None, src: int, group: dist.ProcessGroup | None, dev: Any
) -> dict:
    """Collective (two broadcasts: length, bytes): rank ``src``'s header on every rank."""
    me = dist.get_rank(group)
    payload = pickle.dumps(header) if me == src else b""
    n = prim.broadcast(torch.tensor([len(payload)], dtype=torch.int64, device=dev), src, group, op="scatter")
    raw = (
        torch.frombuffer(bytearray(payload), dtype=torch.uint8).to(dev)
        if me == src
        else torch.zeros(int(n[0]), dtype=torch.uint8, device=dev)
    )
    return pickle.loads(prim.broadcast(raw, src, group, op="scatter").cpu().numpy().tobytes())


def split_systems(
    sizes: list[int],
    cells: torch.Tensor,
    pbcs: torch.Tensor,
    positions: torch.Tensor,
    fields: dict[str, torch.Tensor],
    infos: list[dict[str, Any]],
) -> list[System]:
    """All rows of the batch (global order) cut back into its Systems, each in the caller's order."""
    out, start = [], 0
    for s, size in enumerate(sizes):
        cut = slice(start, start + size)
        out.append(
            System(
                positions=positions[cut].clone(),
                numbers=fields["numbers"][cut],
                cell=cells[s].clone(),
                pbc=pbcs[s].clone(),
                masses=fields["masses"][cut],
                velocities=fields["velocities"][cut],
                ids=fields["ids"][cut],
                info=dict(infos[s]),
            )
        )
        start += size
    return out
