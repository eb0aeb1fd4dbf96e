"""A model's own ASE calculator as the serial oracle: its results as tensors, and as ``Results``.

Third-party potentials (MACE, SevenNet) are checked against their own evaluation path, never
against twinshard's serial path, so an error shared by twinshard's serial and distributed paths
cannot hide. Each adapter builds its package's calculator; these two functions read it the same
way for every package.
"""

from __future__ import annotations

from typing import Any

import torch

from twinshard.atoms.potentials.base import Results

__all__ = ["calculator_results", "native_results"]


def calculator_results(atoms: Any, calc: Any, compute_stress: bool = True) -> dict[str, torch.Tensor]:
    """``calc`` (an ASE calculator) on a copy of ``atoms``: ``energy [1]``, ``node_energy [n]``
    (ASE's per-atom ``energies``, E0 included), ``forces [n, 3]`` and, with ``compute_stress``
    and a cell with a volume, ``stress [3, 3]`` (ASE's sign), as float64 tensors (what the
    calculator hands ASE: the model's precision, widened)."""
    from ase.stress import voigt_6_to_full_3x3_stress

    atoms = atoms.copy()
    atoms.calc = calc
    props = ["energy", "forces"] + (["stress"] if compute_stress and atoms.cell.volume > 0 else [])
    calc.calculate(atoms, properties=props)
    got = calc.results

    def t(v: Any) -> torch.Tensor:
        return torch.as_tensor(v, dtype=torch.float64)

    res = {"energy": t([got["energy"]]), "node_energy": t(got["energies"]), "forces": t(got["forces"])}
    if "stress" in props:
        res["stress"] = t(voigt_6_to_full_3x3_stress(got["stress"]))
    return res


def native_results(got: dict[str, torch.Tensor], system: Any) -> Results:
    """:func:`calculator_results` of ``system`` as :class:`Results` in its positions' dtype and
    device (virial ``-V stress`` where there is a stress; None for a system without a volume)."""
    dtype, dev = system.positions.dtype, system.positions.device
    stress = got.get("stress")
    stress = None if stress is None else stress.to(dev, dtype)
    virial = None if stress is None else -system.volume * stress
    return Results(
        got["energy"][0].to(dev, dtype), got["node_energy"].to(dev, dtype), got["forces"].to(dev, dtype),
        stress, virial,
    )  # fmt: skip
