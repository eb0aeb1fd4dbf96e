"""System validation, field handling and ASE round trips."""

import numpy as np
import pytest
import torch

from twinshard.atoms.data.structures import (
    build,
    fcc_argon,
    lj_mixture,
    random_packing,
    triclinic_argon,
)
from twinshard.atoms.data.system import System, default_masses


def _small(n=5, **kw):
    g = torch.Generator().manual_seed(0)
    return System(
        positions=torch.rand(n, 3, generator=g, dtype=torch.float64) * 5,
        numbers=torch.full((n,), 18),
        cell=torch.eye(3, dtype=torch.float64) * 5,
        pbc=True,
        **kw,
    )


def test_defaults_and_fields():
    s = _small(arrays={"charges": torch.arange(5.0)}, info={"charge": 0})
    assert s.masses.dtype == torch.float64 and torch.equal(
        s.masses, torch.full((5,), 39.948, dtype=torch.float64)
    )
    assert torch.equal(s.ids, torch.arange(5))
    assert torch.equal(s.velocities, torch.zeros(5, 3, dtype=torch.float64))
    assert s.pbc.tolist() == [True, True, True]
    assert s.volume == pytest.approx(125.0)
    sub = s.select([3, 1])
    assert sub.ids.tolist() == [3, 1]
    assert sub.arrays["charges"].tolist() == [3.0, 1.0] and sub.info == {"charge": 0}
    f = s.to(torch.float32)
    assert f.positions.dtype == torch.float32 and f.ids.dtype == torch.int64


def test_wrapped_triclinic():
    s = triclinic_argon(2, rattle=0.3)
    s.positions = s.positions + 3.7 * s.cell[0] - 2.0 * s.cell[2]
    w = s.wrapped()
    frac = torch.linalg.solve(s.cell.T, w.T).T
    assert bool(((frac >= 0) & (frac < 1)).all())
    # Same points modulo lattice translations.
    d = torch.linalg.solve(s.cell.T, (w - s.positions).T).T
    torch.testing.assert_close(d, torch.round(d))


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"positions": torch.tensor([[0.0, float("nan"), 0.0]])}, "NaN"),
        ({"positions": torch.zeros(2, 2)}, r"shape \[n_atoms, 3\]"),
        ({"numbers": torch.tensor([0])}, "missing mass"),
        ({"masses": torch.tensor([float("nan")])}, "missing mass"),
        ({"masses": torch.tensor([-1.0])}, "missing mass"),
        ({"masses": torch.tensor([1.0, 2.0])}, "masses must have shape"),
        (
            {
                "ids": torch.tensor([0, 0]),
                "positions": torch.zeros(2, 3),
                "numbers": torch.tensor([1, 1]),
            },
            "unique",
        ),
        ({"cell": torch.zeros(3, 3), "pbc": True}, "non-zero volume"),
        ({"arrays": {"q": torch.zeros(3)}}, "first dimension"),
    ],
)
def test_validation_errors(kwargs, match):
    base = {"positions": torch.zeros(1, 3, dtype=torch.float64), "numbers": torch.tensor([18])}
    base.update(kwargs)
    with pytest.raises(ValueError, match=match):
        System(**base)


def test_default_masses_error_names_atoms():
    with pytest.raises(ValueError, match=r"atoms \[1\].*pass masses"):
        default_masses(torch.tensor([1, 200]))


def test_ase_round_trip():
    s = lj_mixture(40, seed=3)
    s.velocities = torch.randn(40, 3, dtype=torch.float64)
    s.ids = torch.arange(40) * 7 + 1
    s.arrays["charges"] = torch.linspace(-1, 1, 40, dtype=torch.float64)
    atoms = s.to_ase()
    np.testing.assert_array_equal(atoms.get_atomic_numbers(), s.numbers.numpy())
    back = System.from_ase(atoms)
    for name in ("positions", "numbers", "cell", "pbc", "masses", "velocities", "ids"):
        torch.testing.assert_close(getattr(back, name), getattr(s, name))
    torch.testing.assert_close(back.arrays["charges"], s.arrays["charges"])


def test_structures():
    s = fcc_argon(n_atoms=500)
    assert s.n_atoms == 500 and s.info["name"] == "fcc_argon"  # 5^3 * 4
    assert fcc_argon(n_atoms=32768).n_atoms >= 32768
    p = random_packing(300, seed=1)
    d = torch.cdist(p.positions, p.positions)  # the box is large: check the direct distances
    d = d + torch.eye(300, dtype=d.dtype) * 1e9
    assert float(d.min()) >= 3.0 - 1e-12
    assert float(p.positions.std()) > 1.0
    t = triclinic_argon(3)
    assert abs(float(t.cell[0] @ t.cell[1])) > 1.0  # genuinely non-orthogonal
    m = lj_mixture(100)
    assert sorted(m.numbers.unique().tolist()) == [18, 36]
    assert torch.equal(
        build("random_packing", n_atoms=50, seed=2).positions, random_packing(50, seed=2).positions
    )
    with pytest.raises(ValueError, match="unknown embedded structure"):
        build("nope")
