"""Planted bugs for negative controls, applied inside a rank function (workers are separate
processes: a monkeypatch in the test process does not reach them).

A rank function takes ``plant=None`` and runs its body under ``with planted(plant):``; the
patch is undone when the block exits, so the reused pool workers stay clean. Each entry is one
realistic single-line bug; production modules have no switch for any of them.
"""

from __future__ import annotations

import types
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import torch


def _no_param_sync(mp: pytest.MonkeyPatch) -> None:
    """Parameter gradients stay per-rank partial sums (the all-reduce is missing)."""
    from twinshard.atoms.parallel import distributed

    mp.setattr(distributed, "sync_params", lambda params, group=None: list(params))


def _reverse_direction(op: str) -> bool:
    return op.startswith("halo_reverse") or op == "halo_forward:backward"


def _halo_reverse_misrouted(mp: pytest.MonkeyPatch) -> None:
    """Inside the exchange: each reverse message's rows are shifted by one, so every halo partial
    sum lands on the wrong owned atom of the right peer."""
    from twinshard.atoms.parallel import halo

    orig = halo._exchange

    def exchange(sends: list, recvs: list, dtype: torch.dtype, op: str) -> list:
        if _reverse_direction(op):
            sends = [(p, torch.roll(t, 1, 0)) for p, t in sends]
        return orig(sends, recvs, dtype, op)

    mp.setattr(halo, "_exchange", exchange)


def _halo_reverse_fp32(mp: pytest.MonkeyPatch) -> None:
    """The reverse sum accumulates in float32 (a ``.float()`` in an fp64 path)."""
    from twinshard.atoms.parallel import halo

    prim = types.SimpleNamespace(**vars(halo.prim))
    prim.reduce_dtype = lambda dtype: torch.float32 if dtype.is_floating_point else dtype
    mp.setattr(halo, "prim", prim)


def _thin_halo(mp: pytest.MonkeyPatch) -> None:
    """The ghost shell is 3% thinner than cutoff + skin."""
    from twinshard.atoms.parallel.halo import HaloPlan

    orig = HaloPlan.build

    def build(frac, ids, partition, ghost_width=None, group=None):  # noqa: ANN001, ANN202
        w = partition.ghost_width if ghost_width is None else ghost_width
        return orig(frac, ids, partition, 0.97 * w, group)

    mp.setattr(HaloPlan, "build", staticmethod(build))


def _migrate_drop(mp: pytest.MonkeyPatch) -> None:
    """After a migration, rank 1 loses its last atom."""
    from twinshard.atoms.parallel.sharded import ShardedSystem

    orig = ShardedSystem._migrate

    def migrate(self: ShardedSystem) -> None:
        orig(self)
        if self.rank == 1 and self.n_owned:
            self._set_fields({k: v[:-1] for k, v in self._fields().items()})

    mp.setattr(ShardedSystem, "_migrate", migrate)


def _migrate_duplicate(mp: pytest.MonkeyPatch) -> None:
    """Rank 0 keeps a copy of the first atom it sent away."""
    from twinshard.atoms.parallel.sharded import ShardedSystem

    orig = ShardedSystem._migrate

    def migrate(self: ShardedSystem) -> None:
        before = {k: v.clone() for k, v in self._fields().items()}
        orig(self)
        gone = torch.nonzero(~torch.isin(before["ids"], self.ids)).flatten()
        if self.rank == 0 and gone.numel():
            j = gone[:1]
            self._set_fields({k: torch.cat([self._get(k), before[k][j]]) for k in before})

    mp.setattr(ShardedSystem, "_migrate", migrate)


def _langevin_row_keys(mp: pytest.MonkeyPatch) -> None:
    """Langevin noise keyed by the local row instead of the global atom id."""
    from twinshard.atoms.dynamics import integrators

    def keys(ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        rows = torch.arange(ids.shape[0], dtype=torch.int64, device=ids.device)
        return rows[:, None], torch.arange(3, dtype=torch.int64, device=ids.device)[None, :]

    mp.setattr(integrators, "_keys", keys)


def _nhc_local_kinetic(mp: pytest.MonkeyPatch) -> None:
    """The Nose-Hoover chain is driven by this rank's kinetic energy, not the all-reduced one."""
    from twinshard.atoms.dynamics.integrators import NoseHooverChain, kinetic_energy

    mp.setattr(NoseHooverChain, "_twice_kinetic", lambda self, v, m: float(2.0 * kinetic_energy(v, m)))


def _block_inputs_drops_wrap_shift(mp: pytest.MonkeyPatch) -> None:
    """The dispatch inputs forget the block neighbour list's own lattice shift (wrap axes): edge
    shifts from the rows' frames only, as when every image was a halo row."""
    from twinshard.atoms.parallel.sharded import ShardedSystem

    orig = ShardedSystem.edge_shifts

    def edge_shifts(self, dtype, device):  # noqa: ANN001, ANN202
        cell = self.cell.to(device, dtype)
        return orig(self, dtype, device) - self.edges.cell_shifts.to(device, dtype) @ cell

    mp.setattr(ShardedSystem, "edge_shifts", edge_shifts)


def _npt_virial_local(mp: pytest.MonkeyPatch) -> None:
    """The barostat's virial is this rank's partial sum: the potential's all-reduce of
    ``[energy, virial]`` reduces the energy only."""
    from twinshard.atoms.parallel import distributed

    prim = distributed.prim
    orig = prim.all_reduce

    def all_reduce(x, group=None, op="all_reduce", **kw):  # noqa: ANN001, ANN003, ANN202
        out = orig(x, group, op=op, **kw)
        if op == "potential" and x.numel() == 10:
            out = torch.cat([out[:1], x[1:]])
        return out

    mp.setattr(distributed, "prim", types.SimpleNamespace(**{**vars(prim), "all_reduce": all_reduce}))


def _npt_cell_one_rank(mp: pytest.MonkeyPatch) -> None:
    """The barostat's new cell reaches rank 0's engine only."""
    from twinshard.atoms.dynamics.driver import DistributedEngine

    orig = DistributedEngine.set_cell

    def set_cell(self, cell):  # noqa: ANN001, ANN202
        if self.rank == 0:
            orig(self, cell)

    mp.setattr(DistributedEngine, "set_cell", set_cell)


def _balance_local_histogram(mp: pytest.MonkeyPatch) -> None:
    """The balancer's cut planes come from this rank's histogram only (the all_reduce is missing)."""
    from twinshard.atoms.parallel import sharded

    prim = types.SimpleNamespace(**vars(sharded.prim))
    orig = sharded.prim.all_reduce
    prim.all_reduce = lambda x, group=None, op="all_reduce": (
        x.clone() if op == "balance" else orig(x, group, op)
    )
    mp.setattr(sharded, "prim", prim)


PLANTS = {
    "balance_local_histogram": _balance_local_histogram,
    "npt_virial_local": _npt_virial_local,
    "npt_cell_one_rank": _npt_cell_one_rank,
    "block_inputs_drops_wrap_shift": _block_inputs_drops_wrap_shift,
    "no_param_sync": _no_param_sync,
    "halo_reverse_misrouted": _halo_reverse_misrouted,
    "halo_reverse_fp32": _halo_reverse_fp32,
    "thin_halo": _thin_halo,
    "migrate_drop": _migrate_drop,
    "migrate_duplicate": _migrate_duplicate,
    "langevin_row_keys": _langevin_row_keys,
    "nhc_local_kinetic": _nhc_local_kinetic,
}


@contextmanager
def planted(name: str | None) -> Iterator[None]:
    """Apply the planted bug ``name`` (None: nothing) for the duration of the block."""
    with pytest.MonkeyPatch.context() as mp:
        if name is not None:
            PLANTS[name](mp)
        yield
