"""SevenNet (``sevenn``) as a plain-PyTorch potential: built offline, run through the dispatch.

``sevenn`` is imported lazily. It needs e3nn >= 0.5 while mace-torch pins e3nn 0.4.4, so it lives
in its own environment (README "Set-up": ``.venv-mlip``); its tests are ``tests/mlip``.

:func:`build_sevennet` builds a small SevenNet (``sevenn.model_build.build_E3_equivariant_model``
from sevenn's own default config: NequIP-style interaction blocks, e3nn tensor products, gates)
with random weights (no download). SevenNet runs float32 only: its ``OnehotEmbedding`` casts the
one-hot features with ``.float()`` and its calculator casts every input to float32.

:class:`SevenNetAdapter` puts a SevenNet ``AtomGraphSequential`` behind twinshard's plain-model
contract (:mod:`twinshard.atoms.parallel.plain_inputs`): sevenn's own data dict (``atomic_numbers``,
``pos``, ``edge_index = [receivers, senders]``, ``cell``, ``pbc_shift`` (integer lattice
shifts), ``cell_volume``, ``batch``) in, ``node_energy``, ``energy``, ``forces``, ``virial``,
``stress`` out. sevenn's sign convention is twinshard's: its edge ``i -> j`` carries the message
of ``j`` to ``i`` (``IrrepsConvolution`` gathers ``x[edge_index[1]]`` and scatters onto
``edge_index[0]``) along ``r = x[j] + shift - x[i]``, so ``edge_index = [receivers, senders]``
and the shifts as they are.

The model's modules run unmodified (the same module objects: parameter names are the model's
behind ``model.``), in sevenn's single-system mode (``set_is_batch_data(False)``, as sevenn's
calculator sets it), with sevenn's *position* force head: ``EdgePreprocess(is_stress=True)``
(edge vectors from ``pos`` and a strain) before them and ``ForceStressOutput`` (forces and stress
from ``d E / d pos`` and ``d E / d strain``) in place of the model's ``force_output``, sevenn's
own modules of its serial TorchScript models. The model's own head, ``ForceStressOutputFromEdge``
(forces from ``d E / d edge_vec``, scattered onto both ends of each edge into a plain
``torch.zeros(num_atoms, 3)``), is written for LAMMPS' ghost atoms with reverse communication of
ghost forces: under the dispatch its plain scatter onto the *sender* rows is invisible (every
operand is plain), so in halo storage the owned rows miss the halo rows' partial forces (wrong
forces and stress at P >= 2, with no error) and in graph storage the scatter index (global ids)
overruns the buffer. With the position head every gradient passes through the dispatch (the halo
refresh's adjoint sums halo gradients onto their owners; the strain's gradient is all-reduced).
``tests/mlip`` checks both (the edge head's error at P = 2 is the control).

:func:`sevennet_native` evaluates the model through sevenn's own ASE calculator
(``SevenNetCalculator``: matscipy's neighbour list, ``AtomGraphData``, its casts, the model's
own edge head): the serial oracle.
"""

from __future__ import annotations

import copy
import warnings
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from twinshard.atoms.potentials.base import lookup_species

__all__ = [
    "SevenNetAdapter",
    "build_sevennet",
    "sevennet_available",
    "sevennet_calculator",
    "sevennet_native",
]

DEFAULT_SPECIES = (1, 6, 8, 29)


def sevennet_available() -> bool:
    try:
        import sevenn.model_build  # noqa: F401
    except Exception:  # noqa: BLE001 - any import failure means "not usable here"
        return False
    return True


def _require() -> None:
    if not sevennet_available():
        raise ImportError(
            "SevenNet needs sevenn (pip install sevenn==0.13.0, in an environment of its own: it "
            "needs e3nn >= 0.5, mace-torch pins 0.4.4; README 'Set-up', .venv-mlip)"
        )


def build_sevennet(
    species: Sequence[int] = DEFAULT_SPECIES,
    cutoff: float = 4.0,
    channel: int = 8,
    lmax: int = 1,
    num_convolution: int = 2,
    radial_hidden: Sequence[int] = (8, 8),
    num_bessel: int = 6,
    avg_num_neighbors: float = 10.0,
    scale: float = 1.3,
    seed: int = 0,
    perturb: float = 0.1,
) -> nn.Module:
    """A small SevenNet with random weights (offline), from sevenn's default model config.

    ``channel`` node features of ``lmax`` (``lmax = 1``: ``0e`` and ``1o``), ``num_convolution``
    NequIP interaction blocks (the last one scalars only), a Bessel basis with sevenn's polynomial
    cutoff, species-wise shifts drawn from ``seed`` and one ``scale``; every weight is then
    perturbed by ``perturb x N(0, 1)`` (so no path starts inert). Float32, as sevenn runs."""
    _require()
    import sevenn._const as const
    import sevenn._keys as key
    import sevenn.util as sutil
    from ase.data import chemical_symbols
    from sevenn.model_build import build_E3_equivariant_model

    zs = sorted(int(z) for z in species)
    gen = torch.Generator().manual_seed(int(seed))
    shifts = (-1.0 - torch.rand(len(zs), generator=gen, dtype=torch.float64)).tolist()
    cfg = copy.deepcopy(const.DEFAULT_E3_EQUIVARIANT_MODEL_CONFIG)
    cfg.update(sutil.chemical_species_preprocess([chemical_symbols[z] for z in zs]))
    cfg.update(
        {
            key.CUTOFF: float(cutoff),
            key.NODE_FEATURE_MULTIPLICITY: int(channel),
            key.LMAX: int(lmax),
            key.NUM_CONVOLUTION: int(num_convolution),
            key.CONVOLUTION_WEIGHT_NN_HIDDEN_NEURONS: [int(h) for h in radial_hidden],
            key.CONV_DENOMINATOR: float(avg_num_neighbors),
            key.RADIAL_BASIS: {key.RADIAL_BASIS_NAME: "bessel", key.BESSEL_BASIS_NUM: int(num_bessel)},
            key.SHIFT: shifts,
            key.SCALE: float(scale),
        }
    )
    torch.manual_seed(int(seed))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = build_E3_equivariant_model(cfg)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(perturb * torch.randn(p.shape, generator=gen, dtype=torch.float64).to(p.dtype))
    return model


class SevenNetAdapter(nn.Module):
    """A SevenNet ``AtomGraphSequential`` behind twinshard's plain-model contract (see the module
    docstring). One system per call (sevenn's single-system mode, as its calculator runs).

    Dtype: the model's (float32): the inputs are cast to it at this boundary and every result
    back to the positions' dtype, so the MD state stays fp64 around the fp32 model."""

    plain_contract = True  # dict in, dict out (atoms.plain_inputs): DistributedPotential(mode="dispatch")

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        _require()
        import sevenn._keys as key
        from sevenn.nn.edge_embedding import EdgePreprocess
        from sevenn.nn.force_output import ForceStressOutput
        from sevenn.nn.sequential import AtomGraphSequential

        if getattr(model, "type_map", None) is None or not float(getattr(model, "cutoff", 0.0)):
            raise ValueError("a SevenNet model needs its type_map and cutoff (as sevenn's calculator does)")
        if getattr(model, "modal_map", None):
            raise ValueError("multi-modal SevenNet models are not supported here (no modal is passed)")
        self.model = model
        self.cutoff = float(model.cutoff)
        self.species = sorted(int(z) for z in model.type_map)
        table = torch.full((max(self.species) + 1,), -1, dtype=torch.int64)
        for z, i in model.type_map.items():
            table[int(z)] = int(i)
        self.register_buffer("species_index", table, persistent=False)
        model.set_is_batch_data(False)  # sevenn's single-system mode, as SevenNetCalculator sets it
        body = [(k, m) for k, m in model._modules.items() if k != "force_output"]

        def twin(is_stress: bool, head: nn.Module | None, grad: str | None) -> nn.Module:
            mods = OrderedDict([("edge_preprocess", EdgePreprocess(is_stress=is_stress))])
            mods.update(body)
            if head is not None:
                mods["force_output"] = head
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                seq = AtomGraphSequential(
                    mods, cutoff=self.cutoff, type_map=dict(model.type_map), data_key_grad=grad
                )
            seq.set_is_batch_data(False)
            return seq

        # not registered: they hold the model's own modules (its parameters, under ``model.``)
        self._runs = {"forces": twin(True, ForceStressOutput(), key.POS), "energy": twin(False, None, None)}
        self._keys = key

    @property
    def dtype(self) -> torch.dtype:
        return next(self.model.parameters()).dtype

    def check_species(self, species: Sequence[int]) -> None:
        """Raise a clear ``ValueError`` if some atomic numbers have no parameters in this model."""
        missing = sorted({int(z) for z in species} - set(self.species))
        if missing:
            raise ValueError(
                f"the SevenNet model has no parameters for atomic numbers {missing} of the structure; "
                f"it knows {self.species} (its type_map)"
            )

    def native(self, system: Any, compute_stress: bool = True) -> Any:
        """sevenn's own calculator (:func:`sevennet_native`) as
        :class:`~twinshard.atoms.potentials.base.Results` in the positions' dtype: the oracle."""
        from twinshard.atoms.potentials.oracle import native_results

        return native_results(sevennet_native(self.model, system.to_ase(), compute_stress), system)

    def sevenn_inputs(self, data: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """sevenn's data dict from twinshard's plain-model dict (ShardTensors pass through)."""
        k = self._keys
        numbers, cell = data["numbers"], data["cell"]
        if cell.reshape(-1, 3, 3).shape[0] != 1:
            raise ValueError("SevenNetAdapter evaluates one system per call (sevenn's single-system mode)")
        lookup_species(self.species_index, numbers, "this SevenNet model", self.species)  # the check
        dtype = self.dtype
        cell3 = cell.reshape(3, 3)
        # twinshard: r = x[senders] + shifts - x[receivers]; sevenn: r = pos[j] - pos[i] + shift . cell
        # with edge_index = [i, j] = [receivers, senders]; pinv: an open system's zero cell gives 0
        unit = torch.round(data["shifts"] @ torch.linalg.pinv(cell3))
        return {
            k.NODE_FEATURE: numbers,  # a placeholder: the model's type map writes the one-hot index
            k.ATOMIC_NUMBERS: numbers,
            k.POS: data["positions"].to(dtype),
            k.EDGE_IDX: torch.stack([data["receivers"], data["senders"]]),
            k.CELL: cell3.to(dtype),
            k.CELL_SHIFT: unit.to(dtype),
            k.CELL_VOLUME: torch.linalg.det(cell3).abs().to(dtype),
            k.BATCH: data["batch"],
        }

    def forward(
        self,
        data: dict[str, torch.Tensor],
        compute_forces: bool = True,
        compute_stress: bool = False,
        training: bool = False,
    ) -> dict[str, torch.Tensor | None]:
        k = self._keys
        want = data["positions"].dtype  # results come back in the caller's dtype (MD state: fp64)
        inputs = self.sevenn_inputs(data)
        volume = inputs[k.CELL_VOLUME]
        run = self._runs["forces" if compute_forces or compute_stress else "energy"]
        if compute_forces or compute_stress:
            run.force_output.train(training)  # ForceStressOutput: create_graph=self.training
        out = run(inputs)
        res: dict[str, torch.Tensor | None] = {
            "node_energy": out[k.ATOMIC_ENERGY].reshape(-1),
            "energy": out[k.PRED_TOTAL_ENERGY].reshape(1),
        }
        if compute_forces:
            res["forces"] = out[k.PRED_FORCE]
        if compute_stress:
            s = -out[k.PRED_STRESS]  # sevenn: -stress as [xx, yy, zz, xy, yz, zx]
            full = torch.stack([s[0], s[3], s[5], s[3], s[1], s[4], s[5], s[4], s[2]]).reshape(1, 3, 3)
            res["virial"] = -volume * full
            res["stress"] = full if bool(volume > 0) else None
        return {key_: None if v is None else v.to(want) for key_, v in res.items()}


def sevennet_calculator(model: nn.Module) -> Any:
    """sevenn's own ASE calculator (``SevenNetCalculator``) on a copy of ``model`` (it sets the
    copy's modes, never the caller's)."""
    _require()
    from sevenn.calculator import SevenNetCalculator

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # it warns that no tensor-product accelerator is used
        return SevenNetCalculator(
            copy.deepcopy(model), file_type="model_instance", device=str(next(model.parameters()).device)
        )


def sevennet_native(model: nn.Module, atoms: Any, compute_stress: bool = True) -> dict[str, torch.Tensor]:
    """Serial SevenNet through sevenn's own ASE calculator (:func:`sevennet_calculator`): the
    oracle. ``energy [1]``, ``node_energy [n]`` (its ASE ``energies``), ``forces [n, 3]`` and,
    with ``compute_stress`` and a cell with a volume, ``stress [3, 3]`` (ASE's sign), float64."""
    from twinshard.atoms.potentials.oracle import calculator_results

    return calculator_results(atoms, sevennet_calculator(model), compute_stress)
