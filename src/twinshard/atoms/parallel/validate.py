"""``twinshard validate``: serial against distributed on one system, and the first op that diverged.

``twinshard validate --potential mpnn|mace [--model FILE] --ranks P [--storage halo|graph]
[--structure FILE] [--json]`` evaluates a plain-PyTorch potential (the plain message-passing
model or MACE, see :mod:`twinshard.atoms.parallel.plain_inputs`) serially and on ``P`` local ranks through
the ShardTensor dispatch (``DistributedPotential(mode="dispatch")``) on halo-decomposed
(:class:`~twinshard.atoms.parallel.sharded.ShardedSystem`) or graph-parallel storage
(:class:`~twinshard.atoms.parallel.graph_storage.GraphSharded`), forward and backward
(energy, forces, stress), and reports the errors with the keys of ``twinshard md --json``
(``energy_rel_error``, ``max_force_error``, ``max_stress_error``). Beyond tolerance it exits
non-zero and names the first op whose distributed result diverged, with the dispatch handler
that ran it: both runs are traced (a ``TorchFunctionMode`` around the model's forward records
every top-level torch call in order; the two runs execute the same Python, so the k-th calls
correspond), and each distributed per-atom output's owned rows are compared with the serial
output's rows of the same atoms (per-system outputs directly; per-edge outputs, whose edge
sets differ, are skipped).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from twinshard.atoms.data.system import System

__all__ = ["TOLERANCES", "ValidateConfig", "Traced", "run_validate", "validate_rank"]

# fp64: the bounds (energy relative, forces and stress absolute)
TOLERANCES = {"energy_rel_error": 1e-10, "max_force_error": 1e-9, "max_stress_error": 1e-9}


@dataclass
class ValidateConfig:
    potential: str = "mpnn"
    model: str | None = None
    structure: str | None = None
    ranks: int = 2
    storage: str = "halo"
    skin: float = 0.5
    seed: int = 0
    timeout: float = 600.0  # seconds the distributed run may take (a slow job is not a deadlock)
    setup: Any = None  # a picklable callable returning a context manager entered on every rank (tests)


def _name(func: Any) -> str:
    from twinshard.shard.shard_tensor import fn_name

    return fn_name(func)


class _Trace(TorchFunctionMode):
    """Records (call index, op name, handler that matched, output) of every top-level torch call."""

    def __init__(self, keep: Any, row_ids: torch.Tensor | None = None) -> None:
        super().__init__()
        self.keep = keep
        self.row_ids = row_ids
        self.calls: list[tuple[str, str | None, Any]] = []

    def _gather(self, func: Any, args: tuple, kwargs: dict, out: Any) -> Any:
        """A gather along the atom rows with a 1-D index: (atom id of each output row, output)."""
        from twinshard.shard.dispatch import parse_index_call
        from twinshard.shard.shard_tensor import ShardTensor

        if self.row_ids is None or not isinstance(out, torch.Tensor) or isinstance(out, ShardTensor):
            return None
        c = parse_index_call(func, args, kwargs)
        if c is None or c.scatter or c.dim != 0 or c.rest:
            return None
        idx = c.index._local if isinstance(c.index, ShardTensor) else c.index
        if (
            idx.dim() != 1
            or out.dim() == 0
            or out.shape[0] != idx.shape[0]
            or c.target.shape[0] != len(self.row_ids)
        ):
            return None
        return ("gather", self.row_ids[idx.to(torch.int64)], out.detach().clone())

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        from twinshard.shard.dispatch import REGISTRY
        from twinshard.shard.shard_tensor import ShardTensor

        handler = None
        if any(isinstance(t, ShardTensor) for t in torch.utils._pytree.tree_flatten((args, kwargs))[0]):
            h = REGISTRY.match(func, args, kwargs)
            handler = None if h is None else h.name
        out = func(*args, **kwargs)
        first = out[0] if isinstance(out, (tuple, list)) and out and isinstance(out[0], torch.Tensor) else out
        rec = self._gather(func, args, kwargs, first)
        self.calls.append((_name(func), handler, rec if rec is not None else self.keep(first)))
        return out


class Traced(nn.Module):
    """``model`` with every top-level torch call of its forward recorded (``keep`` maps outputs)."""

    plain_contract = True  # stands in for a plain model (or for the module inside its adapter)

    def __init__(self, model: nn.Module, keep: Any, row_ids: torch.Tensor | None = None) -> None:
        super().__init__()
        self.model = model
        if hasattr(model, "cutoff"):
            self.cutoff = float(model.cutoff)
        self.keep = keep
        self.row_ids = row_ids
        self.calls: list[tuple[str, str | None, Any]] = []

    def forward(self, *args: Any, **flags: Any) -> Any:
        with _Trace(self.keep, self.row_ids) as tr:
            out = self.model(*args, **flags)
        self.calls = tr.calls
        return out


def with_trace(model: nn.Module, keep: Any) -> tuple[nn.Module, Traced]:
    """(potential to run, its trace): a model with its own evaluation path (``native_call``, e.g.
    MaceAdapter) is traced inside, around the module its ``native_module`` names, so the trace
    starts where the serial trace of ``native_call`` starts; any other model is traced whole."""
    name = getattr(model, "native_module", None)
    if name is None:
        traced = Traced(model, keep)
        return traced, traced
    traced = Traced(getattr(model, name), keep)
    setattr(model, name, traced)
    return model, traced


def tolerances(dtype: torch.dtype) -> dict[str, float]:
    """The pass bounds for a model of ``dtype``: the fp64 bounds of :data:`TOLERANCES`; a lower
    precision model gets the harness's round-off budget of its dtype, ``(2 + 16 sqrt(4096)) eps``
    (relative for the energy; for forces and stress times their scale, 1 eV/A or eV/A^3 at most)."""
    if dtype == torch.float64:
        return dict(TOLERANCES)
    bound = (2 + 16 * 64) * torch.finfo(dtype).eps
    return dict.fromkeys(TOLERANCES, bound)


def build_potential(cfg: ValidateConfig, species: list[int]) -> nn.Module:
    """The plain model ``validate`` traces, from the one factory (``make_potential``)."""
    from twinshard.atoms.potentials import make_potential

    if cfg.potential == "mace":
        return make_potential("mace", species, model=cfg.model)
    if cfg.potential == "mpnn":
        return make_potential(
            "mpnn",
            species,
            model=cfg.model,
            plain=True,
            cutoff=4.0,
            n_features=8,
            n_basis=6,
            n_layers=2,
            seed=3,
        )
    raise ValueError(f"validate: unknown potential {cfg.potential!r}; choose 'mpnn' or 'mace'")


def load_system(cfg: ValidateConfig, species: list[int] | None = None) -> System:
    if cfg.structure:
        from twinshard.atoms.data.io import as_system

        return as_system(cfg.structure)
    from twinshard.atoms.data import structures

    s = structures.fcc_argon(repeat=2, rattle=0.25, seed=1)  # 32 atoms, periodic
    zs = torch.tensor(species or [18])
    numbers = zs[torch.randperm(s.n_atoms, generator=torch.Generator().manual_seed(3)) % len(zs)]
    ids = torch.randperm(s.n_atoms, generator=torch.Generator().manual_seed(7)) + 100
    return System(positions=s.positions, numbers=numbers, cell=s.cell, pbc=s.pbc, ids=ids)


def _default_species(cfg: ValidateConfig) -> list[int]:
    return [1, 6, 8, 29] if cfg.potential == "mace" else [18, 36]


def _keep_dist(n_owned_holder: list[int]) -> Any:
    from twinshard.shard.shard_tensor import ShardTensor

    def keep(t: Any) -> Any:
        if _stacked(t):
            return None
        if isinstance(t, ShardTensor):
            if not t.spec.per_atom:
                return ("system", t._local.detach().clone())
            if t.spec.row_block != 1 or t._local.dim() == 0:
                return None
            return ("atoms", t._local[: n_owned_holder[0]].detach().clone())
        if isinstance(t, torch.Tensor) and t.dim() <= 2 and t.numel() <= 64:
            return ("small", t.detach().clone())  # per-system values (energies, virials)
        return None

    return keep


def validate_rank(cfg: ValidateConfig, species: list[int]) -> dict[str, Any]:
    """On every rank: the distributed evaluation, traced; returns this rank's owned results."""
    import torch.distributed as dist

    from twinshard.atoms.parallel.evaluate import place
    from twinshard.atoms.parallel.sharded import ShardedSystem
    from twinshard.atoms.parallel.storage import STORAGES

    if cfg.storage not in STORAGES:
        raise ValueError(f"validate: --storage is one of {STORAGES}, got {cfg.storage!r}")
    model = build_potential(cfg, species)
    system = load_system(cfg, species) if dist.get_rank() == 0 else None
    holder = [0]
    pot, traced = with_trace(model, _keep_dist(holder))
    store, dp = place(system, pot, storage=cfg.storage, skin=cfg.skin, mode="dispatch")
    if isinstance(
        store, ShardedSystem
    ):  # graph storage's gathers index other ranks' rows: compared by outputs only
        assert store.plan is not None
        traced.row_ids = torch.cat([store.ids, store.plan.halo_ids.to(store.ids.device)])
    holder[0] = store.n_owned
    with cfg.setup() if cfg.setup is not None else contextlib.nullcontext():
        res = dp.compute(store)
    return {
        "ids": store.ids,
        "energy": res.energy,
        "forces": res.forces,
        "stress": res.stress,
        "trace": traced.calls,
    }


def _stacked(t: Any) -> bool:
    """A stack of per-atom tensors (``rowwise.StackedRows``: only its sum over the stack is
    defined; its sum is traced instead)."""
    from twinshard.shard.rowwise import StackedRows

    return isinstance(t, StackedRows)


def _keep_serial(t: Any) -> Any:
    if isinstance(t, torch.Tensor) and t.dim() > 0:
        return t.detach().clone()
    return None


def _first_divergence(
    serial_calls: list, rank_calls: list[list], rank_ids: list, ids: torch.Tensor, bound: float = 1e-9
) -> Any:
    pos = {int(i): k for k, i in enumerate(ids.tolist())}
    n = len(ids)
    for k, (name, _, s) in enumerate(serial_calls):
        if any(k >= len(c) for c in rank_calls):
            return {
                "op": name,
                "index": k,
                "handler": None,
                "reason": "the distributed run stopped before it",
            }
        handler = next((c[k][1] for c in rank_calls if c[k][1]), None)
        if s is None:
            continue
        worst = 0.0
        compared = False
        first_row: dict[int, int] = {}
        if isinstance(s, tuple):  # a gather: the first serial output row of each atom
            for row, a in enumerate(s[1].tolist()):
                first_row.setdefault(int(a), row)
        for calls, rids in zip(rank_calls, rank_ids):
            d = calls[k][2]
            if d is None:
                continue
            if d[0] == "gather" or isinstance(s, tuple):
                if not (d[0] == "gather" and isinstance(s, tuple)):
                    continue
                keep = [j for j, a in enumerate(d[1].tolist()) if int(a) in first_row]
                val = d[2][keep]
                ref = s[2][[first_row[int(d[1][j])] for j in keep]]
                if val.shape != ref.shape:
                    continue
                compared = True
                if val.dtype.is_floating_point and ref.numel():
                    worst = max(worst, float((val - ref).abs().max()) / max(1.0, float(ref.abs().max())))
                elif ref.numel() and not torch.equal(val, ref):
                    worst = float("inf")
                continue
            kind, val = d
            if kind == "atoms" and s.shape[0] == n and tuple(val.shape[1:]) == tuple(s.shape[1:]):
                ref = s[torch.tensor([pos[int(i)] for i in rids.tolist()], dtype=torch.int64)]
            elif kind in ("system", "small") and val.shape == s.shape and s.shape[0] != n:
                ref = s
            else:
                continue
            compared = True
            if val.dtype.is_floating_point and ref.dtype.is_floating_point and ref.numel():
                scale = max(1.0, float(ref.abs().max()))
                worst = max(worst, float((val.to(ref.dtype) - ref).abs().max()) / scale)
            elif ref.numel() and not torch.equal(val, ref):
                worst = float("inf")
        if compared and worst > bound:
            return {"op": name, "index": k, "handler": handler, "relative_error": worst}
    return None


def run_validate(cfg: ValidateConfig) -> dict[str, Any] | None:
    """Serial and distributed (``cfg.ranks`` local ranks, or the torchrun world); the report (see
    the module docstring) on rank 0 or without a world, ``None`` on the other ranks of a world."""
    from twinshard.atoms.parallel.plain_inputs import evaluate_plain, evaluate_reference
    from twinshard.atoms.potentials.base import error_figures
    from twinshard.runtime import reports, run_ranks

    system0 = load_system(cfg, _default_species(cfg))
    species = sorted(set(system0.numbers.tolist()))
    if not cfg.structure:
        species = _default_species(cfg)
    results = run_ranks(validate_rank, int(cfg.ranks), cfg, species, deadline=float(cfg.timeout))
    if not reports():
        return None
    model = build_potential(cfg, species)
    ref = evaluate_reference(model, system0)  # the model's own evaluation path where it has one
    native = getattr(model, "native_call", None)
    if callable(native):  # the serial trace: the model's own inputs through its own module
        module, args, flags = native(system0)
        traced = Traced(module, _keep_serial, system0.ids)
        traced(*args, **flags)
    else:
        traced = Traced(model, _keep_serial, system0.ids)
        evaluate_plain(traced, system0)
    serial_calls = traced.calls
    forces = torch.full_like(ref.forces, float("nan"))
    pos = {int(i): k for k, i in enumerate(system0.ids.tolist())}
    for r in results:
        forces[torch.tensor([pos[int(i)] for i in r["ids"].tolist()], dtype=torch.int64)] = r["forces"]
    e = float(results[0]["energy"])
    report: dict[str, Any] = {
        "potential": cfg.potential,
        "ranks": len(results),
        "storage": cfg.storage,
        "atoms": system0.n_atoms,
        "energy": e,
        "serial_energy": float(ref.energy),
    }
    figures = error_figures(
        e, forces, ref.energy, ref.forces, stress=results[0]["stress"], ref_stress=ref.stress
    )
    report.update({k: figures[k] for k in ("energy_rel_error", "max_force_error", "max_stress_error")})
    tols = tolerances(next(model.parameters()).dtype)
    bad = [k for k, tol in tols.items() if report[k] is not None and not report[k] <= tol]
    report["tolerances"] = tols
    report["passed"] = not bad
    report["first_divergence"] = None
    if bad:
        report["first_divergence"] = _first_divergence(
            serial_calls, [r["trace"] for r in results], [r["ids"] for r in results], system0.ids,
            tols["energy_rel_error"] * 10,
        )  # fmt: skip
    return report
