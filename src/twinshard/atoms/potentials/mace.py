"""MACE (``mace-torch``) as a plain-PyTorch potential: built offline or loaded, run unmodified.

``mace-torch`` is imported lazily (the ``mace`` extra: ``pip install -e ".[mace]"``).

:func:`build_mace` builds a small MACE with random weights (no download: an embedded default of
two interactions, ``L = 1`` hidden features, several species, fp64). :func:`load_mace` reads a
model saved by mace-torch (``torch.save(model, path)``) the way mace's own calculator does
(``torch.load(path, map_location=device)``, the whole module).

:class:`MaceAdapter` puts a MACE module behind twinshard's plain-model contract
(:mod:`twinshard.atoms.parallel.plain_inputs`: ``data = {positions, numbers, senders, receivers,
shifts, batch, cell}`` in, ``node_energy``, ``energy``, ``forces``, ``virial``, ``stress``
out) by building mace's own data dict (``positions``, ``node_attrs`` one-hot over its
``atomic_numbers``, ``edge_index = [senders, receivers]`` (mace's sender/receiver), ``shifts``
and ``unit_shifts`` in mace's sign convention, ``cell``, ``batch``, ``ptr``) and calling the
MACE module's own ``forward`` with ``compute_force`` / ``compute_stress``. The MACE module is
not modified: distributed (``DistributedPotential(MaceAdapter(model), mode="dispatch")``) its
inputs are ShardTensors and the dispatch (:mod:`twinshard.shard.dispatch`) makes its ops
distribution-aware. Parameter names are the MACE module's behind the prefix ``model.``.

:func:`mace_native` evaluates a MACE module through mace's own data pipeline
(``mace.data.AtomicData.from_config`` with mace's neighbour list): the serial oracle.
"""

from __future__ import annotations

import contextlib
import functools
import io
import warnings
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch import nn

from twinshard.atoms.potentials.base import lookup_species
from twinshard.shard.shard_tensor import to_local

__all__ = [
    "MaceAdapter",
    "build_mace",
    "build_scaleshift_mace",
    "load_mace",
    "mace_native",
    "mace_available",
]

DEFAULT_SPECIES = (1, 6, 8, 29)


# Notices of mace-torch and e3nn themselves, not of the user's run: a print at import
# (cuequivariance), warnings about their TorchScript annotations (one per compiled e3nn module) and
# their torch.load defaults, 60-90 lines per MACE run.
_NOISE = (
    "The TorchScript type system doesn't support instance-level annotations",
    "Environment variable TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD detected",
    "You are using `torch.load` with `weights_only=False`",
)


def _quietly(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Run ``fn`` without mace-torch's and e3nn's own notices (``_NOISE``, and mace's import print)."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()):
            for message in _NOISE:
                warnings.filterwarnings("ignore", message=message)
            return fn(*args, **kwargs)

    return wrapper


@_quietly
def mace_available() -> bool:
    try:
        import mace.modules  # noqa: F401
    except Exception:  # noqa: BLE001 - any import failure means "not usable here"
        return False
    return True


def _require() -> None:
    if not mace_available():
        raise ImportError(
            'MACE needs mace-torch: pip install -e ".[mace]" (or pip install mace-torch); '
            "it is imported lazily and only for --potential mace"
        )


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    prev = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(prev)


@_quietly
def build_mace(
    species: Sequence[int] = DEFAULT_SPECIES,
    r_max: float = 4.0,
    num_interactions: int = 2,
    hidden_irreps: str = "8x0e + 8x1o",
    max_ell: int = 2,
    correlation: int = 2,
    num_bessel: int = 6,
    avg_num_neighbors: float = 10.0,
    seed: int = 0,
    dtype: torch.dtype = torch.float64,
    scale_shift: tuple[float, float] | None = None,
    interaction: str = "RealAgnosticResidualInteractionBlock",
    pair_repulsion: bool = False,
    distance_transform: str | None = None,
    heads: Sequence[str] | None = None,
) -> nn.Module:
    """A small ``mace.modules.MACE`` with random weights (offline; the embedded default).

    Residual interaction blocks (the mace-torch default), ``hidden_irreps`` with ``1o`` features,
    a non-linear readout, per-species E0s drawn from ``seed``; every weight drawn from ``seed``.
    ``scale_shift=(scale, shift)`` builds mace's ``ScaleShiftMACE`` instead (the class of real
    saved models such as MACE-MP: ``atomic_inter_scale`` / ``atomic_inter_shift``).
    ``interaction``: any of mace's ``interaction_classes`` (for every layer);
    ``pair_repulsion``: mace's ZBL pair term and ``distance_transform`` (``"Agnesi"``,
    ``"Soft"``) its radial transform: the MACE-MP foundation-model recipe. ``heads``: a multi-head
    model (mace's ``heads``; per-head E0s, and per-head scale and shift for ``ScaleShiftMACE``,
    the head ``k`` ones shifted by ``k``)."""
    _require()
    import numpy as np
    from e3nn import o3
    from mace import modules

    species = sorted(int(z) for z in species)
    gen = torch.Generator().manual_seed(int(seed))
    n_heads = len(heads) if heads else 1
    e0 = (-1.0 - torch.rand(n_heads, len(species), generator=gen, dtype=torch.float64)).numpy()
    e0 = e0 if heads else e0[0]
    if interaction not in modules.interaction_classes:
        raise ValueError(
            f"unknown MACE interaction {interaction!r}; mace offers {sorted(modules.interaction_classes)}"
        )
    block = modules.interaction_classes[interaction]
    with _default_dtype(dtype):
        torch.manual_seed(int(seed))
        cls: Any = modules.MACE
        extra: dict[str, Any] = {}
        if scale_shift is not None:
            cls = modules.ScaleShiftMACE
            scale, shift = float(scale_shift[0]), float(scale_shift[1])
            extra = {"atomic_inter_scale": scale, "atomic_inter_shift": shift}
            if heads:
                extra = {
                    "atomic_inter_scale": [scale + k for k in range(n_heads)],
                    "atomic_inter_shift": [shift + k for k in range(n_heads)],
                }
        if heads:
            extra["heads"] = list(heads)
        if pair_repulsion:
            extra["pair_repulsion"] = True
        if distance_transform is not None:
            extra["distance_transform"] = distance_transform
        model = cls(
            **extra,
            r_max=float(r_max),
            num_bessel=int(num_bessel),
            num_polynomial_cutoff=5,
            max_ell=int(max_ell),
            interaction_cls=block,
            interaction_cls_first=block,
            num_interactions=int(num_interactions),
            num_elements=len(species),
            hidden_irreps=o3.Irreps(hidden_irreps),
            MLP_irreps=o3.Irreps("8x0e"),
            atomic_energies=np.asarray(e0),
            avg_num_neighbors=float(avg_num_neighbors),
            atomic_numbers=species,
            correlation=int(correlation),
            gate=torch.nn.functional.silu,
            radial_MLP=[16, 16],
        )
        # some weights start at zero (mace's residual skip init): perturb every parameter, so
        # no path is silently inert in a parity test
        with torch.no_grad():
            for p in model.parameters():
                p.add_(0.1 * torch.randn(p.shape, generator=gen, dtype=torch.float64).to(p.dtype))
    return model.to(dtype)


def build_scaleshift_mace(scale: float = 1.7, shift: float = -0.3, **kwargs: Any) -> nn.Module:
    """A small random-weight ``mace.modules.ScaleShiftMACE`` (``build_mace`` with ``scale_shift``)."""
    return build_mace(scale_shift=(scale, shift), **kwargs)


@_quietly
def load_mace(path: str, device: str | torch.device = "cpu", dtype: torch.dtype | None = None) -> nn.Module:
    """A MACE model saved by mace-torch (``torch.save(model, path)``), loaded as mace's calculator
    does: ``torch.load(path, map_location=device)`` (the whole pickled module; trust the file)."""
    _require()
    import os

    import mace.modules  # noqa: F401 - the pickled classes live there

    if not os.path.isfile(path):
        raise ValueError(f"model file {path!r} does not exist")
    try:
        model = torch.load(path, map_location=device, weights_only=False)
    except Exception as exc:  # a torn or foreign file raises many types: one clear line
        from twinshard.runtime.errors import short_reason

        raise ValueError(
            f"model file {path!r} cannot be read as a saved MACE model ({short_reason(exc)}); "
            "give a file written by mace-torch (torch.save(model, path))"
        ) from None
    if not (isinstance(model, nn.Module) and hasattr(model, "r_max") and hasattr(model, "atomic_numbers")):
        raise ValueError(
            f"model file {path!r} holds a {type(model).__module__}.{type(model).__qualname__}, not a MACE "
            "model (mace.modules.MACE or ScaleShiftMACE saved with torch.save(model, path))"
        )
    return model if dtype is None else model.to(dtype)


class MaceAdapter(nn.Module):
    """A MACE module behind twinshard's plain-model contract (see the module docstring).

    Dtype: the model runs in its own dtype (a saved fp32 model stays fp32): the inputs are cast
    to it at this boundary and every result back to the positions' dtype, as mace's calculator
    does, so the MD state stays fp64 (or whatever the caller holds) around an fp32 model."""

    plain_contract = True  # dict in, dict out (atoms.plain_inputs): DistributedPotential(mode="dispatch")
    native_module = "model"  # the child that native_call's module is (validate traces it on both sides)

    def __init__(self, model: nn.Module, head: str | None = None) -> None:
        super().__init__()
        self.model = model
        heads = list(getattr(model, "heads", None) or ["default"])
        if head is not None and head not in heads:
            raise ValueError(f"the MACE model has no head {head!r}; its heads are {heads}")
        # a multi-head model: which head's readout (mace's default: the first, as its calculator's
        # "default" when a model has one)
        self.head = head if head is not None else ("default" if "default" in heads else heads[0])
        self.head_index = heads.index(self.head)
        self.cutoff = float(model.r_max)
        z = [int(v) for v in model.atomic_numbers.tolist()]
        self.species = sorted(z)
        table = torch.full((max(z) + 1,), -1, dtype=torch.int64)
        table[torch.tensor(z)] = torch.arange(len(z))
        self.register_buffer("species_index", table, persistent=False)
        # the last edge_index handed to mace, with what it was stacked from: reused while the
        # neighbour list hands the same tensors (so the dispatch's routing of mace's
        # edge_index[0] / [1] gathers, kept per index tensor, is reused across evaluations)
        self._edges: tuple[Any, ...] | None = None

    def edge_index(self, senders: torch.Tensor, receivers: torch.Tensor) -> torch.Tensor:
        """``[senders, receivers]`` stacked once per neighbour list (module docstring)."""
        key = (senders, receivers, senders._version, receivers._version)
        kept = self._edges
        if kept is None or any(a is not b for a, b in zip(kept[:2], key[:2])) or kept[2:4] != key[2:]:
            self._edges = (*key, torch.stack([senders, receivers]))
        return self._edges[4]

    @property
    def dtype(self) -> torch.dtype:
        return next(self.model.parameters()).dtype

    def check_species(self, species: Sequence[int]) -> None:
        """Raise a clear ``ValueError`` if some atomic numbers have no parameters in this model."""
        missing = sorted({int(z) for z in species} - set(self.species))
        if missing:
            raise ValueError(
                f"the MACE model has no parameters for atomic numbers {missing} of the structure; "
                f"it knows {self.species} (its atomic_numbers)"
            )

    def native(self, system: Any, compute_stress: bool = True) -> Any:
        """The model's own evaluation path, mace-torch's calculator (:func:`mace_native`), as
        :class:`~twinshard.atoms.potentials.base.Results` in the positions' dtype: the serial
        oracle of ``--check-serial`` and ``validate`` (``plain_inputs.evaluate_reference``)."""
        from twinshard.atoms.potentials.oracle import native_results

        return native_results(
            mace_native(self.model, system.to_ase(), compute_stress, head=self.head), system
        )

    def native_call(self, system: Any) -> tuple[nn.Module, tuple, dict[str, Any]]:
        """``(module, args, flags)``: the MACE module, mace's own input batch of ``system`` (its
        neighbour list, ``AtomicData``, batching, in the model's dtype) and the flags
        :meth:`forward` passes. ``validate`` traces ``module(*args, **flags)`` as the serial side."""
        _require()
        from mace import data as mdata
        from mace.tools import torch_geometric, utils

        z_table = utils.AtomicNumberTable([int(z) for z in self.model.atomic_numbers.tolist()])
        with _default_dtype(self.dtype):  # mace's data pipeline builds tensors in the default dtype
            config = mdata.config_from_atoms(system.to_ase())
            ad = mdata.AtomicData.from_config(config, z_table=z_table, cutoff=float(self.model.r_max))
            loader = torch_geometric.dataloader.DataLoader(dataset=[ad], batch_size=1, shuffle=False)
            batch = next(iter(loader)).to_dict()
        for k, v in batch.items():
            if isinstance(v, torch.Tensor) and v.is_floating_point():
                batch[k] = v.to(self.dtype)
        if self.head_index:
            batch["head"] = torch.full((batch["ptr"].numel() - 1,), self.head_index, dtype=torch.int64)
        flags = {"training": False, "compute_force": True, "compute_stress": True, "compute_virials": True}
        return self.model, (batch,), flags

    def mace_inputs(self, data: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """mace's data dict from twinshard's plain-model dict (ShardTensors pass through)."""
        numbers, cell = data["numbers"], data["cell"]
        rows = lookup_species(self.species_index, numbers, "this MACE model", self.species)
        dtype = self.dtype  # the model's: inputs are cast to it here, as mace's calculator does
        classes = torch.arange(len(self.species), device=rows.device)
        node_attrs = (rows[:, None] == classes[None, :]).to(dtype)
        # twinshard: r = x[senders] + shifts - x[receivers]; mace: r = x[receiver] - x[sender] + shifts
        shifts = -data["shifts"].to(dtype)
        cell3 = cell.to(dtype).reshape(-1, 3, 3)
        batch = data["batch"]
        if cell3.shape[0] == 1:
            inv = torch.linalg.pinv(cell3[0])  # pinv: an open system's zero cell gives zero shifts
            unit = torch.round(shifts @ inv)
        else:  # a batch of systems: each edge's lattice vectors are its system's
            inv = torch.linalg.pinv(cell3)[to_local(batch[data["receivers"]])]
            unit = torch.round(torch.einsum("ec,ecd->ed", shifts, inv))
        # mace reads only ptr's length (its number of graphs); the values are this call's rows
        counts = torch.bincount(to_local(batch), minlength=cell3.shape[0])
        ptr = torch.cat([counts.new_zeros(1), counts.cumsum(0)]).to(cell.device)
        inputs = {
            "positions": data["positions"].to(dtype),
            "node_attrs": node_attrs,
            "edge_index": self.edge_index(data["senders"], data["receivers"]),
            "shifts": shifts,
            "unit_shifts": unit,
            "cell": cell3.reshape(-1, 3),
            "batch": batch,
            "ptr": ptr,
        }
        if self.head_index:  # per-system head index (a replicated table mace reads as head[batch])
            inputs["head"] = torch.full(
                (cell3.shape[0],), self.head_index, dtype=torch.int64, device=cell.device
            )
        return inputs

    def forward(
        self,
        data: dict[str, torch.Tensor],
        compute_forces: bool = True,
        compute_stress: bool = False,
        training: bool = False,
    ) -> dict[str, torch.Tensor | None]:
        want = data["positions"].dtype  # results come back in the caller's dtype (MD state: fp64)
        out = self.model(
            self.mace_inputs(data),
            training=training,
            compute_force=compute_forces,
            compute_stress=compute_stress,
            compute_virials=compute_stress,
        )  # the flags native_call hands validate
        res: dict[str, torch.Tensor | None] = {"node_energy": out["node_energy"], "energy": out["energy"]}
        if compute_forces:
            res["forces"] = out["forces"]
        if compute_stress:
            res["virial"] = out["virials"]
            vol = torch.linalg.det(data["cell"].to(self.dtype).reshape(-1, 3, 3)).abs()
            has = vol > 0
            if bool(has.all()):
                res["stress"] = out["stress"]
            elif vol.numel() > 1 and bool(has.any()):  # a batch: a system without a volume has no stress
                res["stress"] = torch.where(has[:, None, None], out["stress"], float("nan"))
            else:
                res["stress"] = None
        return {k: None if v is None else v.to(want) for k, v in res.items()}


@_quietly
def mace_calculator(model: nn.Module, head: str | None = None) -> Any:
    """mace-torch's own ASE calculator (``MACECalculator``) on a copy of ``model`` at the model's
    dtype (so it converts nothing; it freezes its copy's parameters, never the caller's);
    ``head``: a multi-head model's head (mace's default otherwise)."""
    _require()
    import copy
    import logging

    from mace.calculators import MACECalculator

    dtype = next(model.parameters()).dtype
    if dtype not in (torch.float32, torch.float64):
        raise ValueError(f"mace's calculator runs float32 or float64 models, this one is {dtype}")
    quiet = logging.getLogger().level
    logging.getLogger().setLevel(logging.ERROR)  # it logs its set-up at INFO/WARNING
    try:
        return MACECalculator(
            models=copy.deepcopy(model), device=str(next(model.parameters()).device),
            default_dtype=str(dtype).removeprefix("torch."), **({} if head is None else {"head": head}),
        )  # fmt: skip
    finally:
        logging.getLogger().setLevel(quiet)


def mace_native(
    model: nn.Module, atoms: Any, compute_stress: bool = True, head: str | None = None
) -> dict[str, torch.Tensor]:
    """Serial MACE through mace-torch's own evaluation path, its ASE calculator
    (:func:`mace_calculator`: its neighbour list, ``AtomicData``, batching, dtype casts): the
    oracle, read by :func:`~twinshard.atoms.potentials.oracle.calculator_results`."""
    from twinshard.atoms.potentials.oracle import calculator_results

    return calculator_results(atoms, mace_calculator(model, head), compute_stress)
