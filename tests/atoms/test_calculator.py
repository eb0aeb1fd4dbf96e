"""The ASE calculator, serial and inside a world."""

import numpy as np
import pytest
import torch

from twinshard.atoms.calculator import TwinshardCalculator
from twinshard.atoms.data.structures import lj_mixture, lj_mixture_parameters
from twinshard.atoms.parallel.plain_inputs import evaluate_serial
from twinshard.atoms.potentials import LennardJones, MessagePassingPotential, evaluate
from twinshard.atoms.potentials.mpnn_plain import PlainMessagePassing
from twinshard.testing import assert_parity, run_on_world


def _atoms():
    s = lj_mixture(120, seed=2)
    s.ids = torch.randperm(120, generator=torch.Generator().manual_seed(0))  # not arange
    return s


def _potential(name):
    if name == "lj":
        return LennardJones(lj_mixture_parameters(), cutoff=6.0)
    if name == "mpnn_plain":  # plain PyTorch (no twinshard call): runs in either storage
        return PlainMessagePassing(species=(18, 36), cutoff=4.5, n_features=8, n_layers=2, seed=2)
    return MessagePassingPotential(species=(18, 36), cutoff=4.5, seed=2)


def test_serial_calculator_matches_evaluate():
    s = _atoms()
    pot = _potential("lj")
    atoms = s.to_ase()
    atoms.calc = TwinshardCalculator(pot)
    ref = evaluate(pot, s)
    assert atoms.get_potential_energy() == pytest.approx(float(ref.energy), rel=1e-15)
    np.testing.assert_array_equal(atoms.get_forces(), ref.forces.numpy())
    np.testing.assert_array_equal(atoms.get_potential_energies(), ref.per_atom.numpy())
    # the calculator derives the stress from the virial (-W / V): the same sum, one more rounding
    stress = torch.from_numpy(atoms.get_stress(voigt=False))
    assert_parity(stress, ref.stress, what="serial calculator stress", reduction=1)
    with pytest.raises(TypeError, match="cutoff"):
        TwinshardCalculator(torch.nn.Linear(2, 2))


def _on_rank(name, storage="halo"):
    from twinshard.runtime import get_world

    s = _atoms()
    atoms = s.to_ase()
    atoms.calc = TwinshardCalculator(_potential(name), storage=storage)
    return (
        get_world().rank,
        atoms.get_potential_energy(),
        atoms.get_forces(),
        atoms.get_potential_energies(),
        atoms.get_stress(),
    )


@pytest.mark.parametrize(
    "name,storage", [("lj", "halo"), ("mpnn", "halo"), ("mpnn_plain", "halo"), ("mpnn_plain", "graph")]
)
def test_distributed_calculator_equals_serial(name, storage):
    s = _atoms()
    ref = evaluate_serial(_potential(name), s)
    out = run_on_world(_on_rank, 3, name, storage)
    assert [o[0] for o in out] == [0, 1, 2]
    r = ref.stress
    voigt = torch.stack([r[0, 0], r[1, 1], r[2, 2], r[1, 2], r[0, 2], r[0, 1]])
    for rank, energy, forces, energies, stress in out:
        # the calculator returns whole-system arrays on every rank (gathered); the owned-row
        # sharding behind them is proven in test_distributed and test_graph_storage
        where = f"ASE calculator {name} ({storage} storage) P=3 rank {rank}"
        energy = torch.tensor(energy, dtype=torch.float64)
        assert_parity(energy, ref.energy, what=f"energy, {where}")
        assert_parity(torch.from_numpy(forces), ref.forces, what=f"forces, {where}")
        assert_parity(torch.from_numpy(energies), ref.per_atom, what=f"per-atom energies, {where}")
        assert_parity(torch.from_numpy(stress), voigt, what=f"stress (Voigt), {where}")
    assert float(ref.forces.abs().max()) > 1e-3


def _graph_storage_with_hooks_model():
    s = _atoms()
    atoms = s.to_ase()
    atoms.calc = TwinshardCalculator(_potential("mpnn"), storage="graph")
    try:
        atoms.get_potential_energy()
    except ValueError as exc:
        return str(exc)
    return None


def test_graph_storage_calculator_refuses_a_refresh_hook_model_on_every_rank():
    """Graph storage runs plain-PyTorch models; a Graph-contract model (graph.refresh) raises the
    same clear error on every rank, and a storage name that does not exist raises at once."""
    for msg in run_on_world(_graph_storage_with_hooks_model, 2):
        assert msg is not None and "mode='dispatch'" in msg and "halo storage" in msg
    with pytest.raises(ValueError, match="storage must be one of"):
        TwinshardCalculator(_potential("lj"), storage="spatial")
