"""Sanity of a run: diverged positions, exploding energies, forces and temperatures.

One set of checks for every engine and storage (serial, halo, graph):

- positions, every MD step, before they reach migration, the halo plan or the neighbour list
  (vesin dies with SIGFPE on coordinates of ~1e21 A): a non-finite coordinate, or an atom that
  moved farther than ``cutoff + skin`` since the last neighbour-list build, is a diverged step.
  The list is rebuilt as soon as an atom moved ``skin / 2``, so such an atom crossed more than
  its whole interaction range in one step (thermal MD moves atoms ~0.01-0.1 A per step);
- on every logged thermo step (:func:`twinshard.atoms.dynamics.md.simulate`): finite energies, the
  temperature at most ``max_temperature`` and the largest force at most ``max_force``;
- a single evaluation (the ASE calculator): finite energy, forces and stress.

Every check decides from values every rank holds identically (the storages' gathered
displacement report, the all-reduced thermo sums), so all ranks raise the same error without
a collective of their own.
"""

from __future__ import annotations

import math

import torch

__all__ = ["Diverged", "MAX_TEMPERATURE", "MAX_FORCE", "bound", "check_positions", "check_thermo"]

# Classical MD of matter stays far below 1e5 K (solids melt, liquids boil and atoms ionise
# below ~1e4 K, beyond which fitted potentials are meaningless), while a diverging run's kinetic
# energy grows geometrically and crosses it within a few steps. Cascade runs that put keV into
# a few atoms of a small box may need more: --max-temperature.
MAX_TEMPERATURE = 1e5  # K
# Thermal and even strongly compressed structures stay below ~1e2 eV/A (LJ argon: 1e2 eV/A at
# 0.6 sigma); 1e3 eV/A means two atoms nearly on top of each other (argon at half its sigma):
# a broken structure or a diverged step, not a state the potential describes (collision
# cascades with keV recoils are the exception: --max-force).
MAX_FORCE = 1e3  # eV/A
N_IDS = 3  # atom ids a report names per rank

_STEP_FIX = "use a smaller time step (--dt) or check the potential and the start structure"


class Diverged(ValueError):
    """The run left physics: raised with the same message on every rank. ``step`` is filled in
    by :func:`~twinshard.atoms.dynamics.md.simulate` (:meth:`at`)."""

    def __init__(self, detail: str, fix: str = _STEP_FIX, step: int | None = None) -> None:
        super().__init__(detail, fix, step)  # args rebuild it when a worker pickles it
        self.detail, self.fix, self.step = detail, fix, step

    def at(self, step: int) -> Diverged:
        return Diverged(self.detail, self.fix, step)

    def __str__(self) -> str:
        at = "" if self.step is None else f" at step {self.step}"
        at += " (the start structure)" if self.step == 0 else ""
        return f"dynamics diverged{at}: {self.detail}; {self.fix}"


def bound(name: str, value: float) -> float:
    """A user's bound: ``> 0`` (inf when ``0`` or ``inf``: the check is off)."""
    value = float(value)
    if not value >= 0:
        raise ValueError(f"{name} must be >= 0 (0 or inf: no bound), got {value}")
    return value if value > 0 else math.inf


def _where(rows: list[tuple[int, int, torch.Tensor]], shown: int = 4) -> str:
    """``rank 0: 41 atoms, ids 10, 24, 27, ...; rank 1: ...`` (the first ``shown`` ranks)."""
    parts = []
    for r, n, ids in rows[:shown]:
        named = ", ".join(str(int(i)) for i in ids.tolist() if i >= 0)
        parts.append(f"rank {r}: {n} atom{'s' if n > 1 else ''}, id{'s' if n > 1 else ''} {named}")
        parts[-1] += ", ..." if n > ids.numel() else ""
    more = f"; {len(rows) - shown} more ranks" if len(rows) > shown else ""
    return "; ".join(parts) + more


# ------------------------------------------------------------------------------ positions


def displacements(x: torch.Tensor, ref: torch.Tensor | None) -> torch.Tensor:
    """``|x - ref|`` per atom (0 without a reference), +inf where a coordinate is non-finite,
    so the largest value carries the flag through a plain max."""
    x = x.detach()
    d = (x - ref).norm(dim=1) if ref is not None and ref.shape == x.shape else x.new_zeros(len(x))
    return torch.where(torch.isfinite(x).all(1) & torch.isfinite(d), d, math.inf)


def position_report(
    x: torch.Tensor, ref: torch.Tensor | None, ids: torch.Tensor, limit: float
) -> torch.Tensor:
    """This rank's row (fp64: ids < 2**32 are exact), ``[largest displacement (inf if a position
    is non-finite), non-finite atoms, atoms beyond limit, N_IDS ids of them (-1 padded)]``."""
    d = displacements(x, ref)
    nonfinite = ~torch.isfinite(x.detach()).all(1)
    bad = nonfinite | (d > limit)
    first = torch.full((N_IDS,), -1.0, dtype=torch.float64, device=x.device)
    named = ids[bad][:N_IDS].to(first)
    first[: named.numel()] = named
    head = torch.stack(
        [d.max() if d.numel() else d.new_zeros(()), nonfinite.sum(), bad.sum() - nonfinite.sum()]
    )
    return torch.cat([head.to(first), first])


def check_positions(rows: torch.Tensor, limit: float) -> float:
    """From every rank's :func:`position_report` (``[P, 3 + N_IDS]``, the same on every rank):
    raise :class:`Diverged` naming the ranks and atoms, or return the largest displacement."""
    rows = rows.detach().cpu().to(torch.float64)
    nonfinite = [(r, int(row[1] + row[2]), row[3:]) for r, row in enumerate(rows) if row[1] > 0]
    far = [(r, int(row[2]), row[3:]) for r, row in enumerate(rows) if row[1] == 0 and row[2] > 0]
    if nonfinite:
        raise Diverged(f"non-finite positions ({_where(nonfinite)})")
    if far:
        jump = float(rows[:, 0].max())
        raise Diverged(
            f"atoms jumped up to {jump:.3g} A in one step, farther than their interaction range "
            f"cutoff + skin = {limit:.3g} A ({_where(far)})"
        )
    return float(rows[:, 0].max()) if rows.numel() else 0.0


# ------------------------------------------------------------------------------ thermo


def force_report(forces: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """This rank's ``[largest |F| (inf if non-finite), its atom id]`` (fp64; ``[0, -1]`` with no atoms)."""
    f = forces.detach()
    if not f.shape[0]:
        return torch.tensor([0.0, -1.0], dtype=torch.float64, device=f.device)
    norm = f.norm(dim=1)
    norm = torch.where(torch.isfinite(norm), norm, math.inf)
    i = int(norm.argmax())
    return torch.stack([norm[i].to(torch.float64), ids[i].to(torch.float64)])


def check_thermo(
    row: dict[str, float], forces: torch.Tensor, max_temperature: float, max_force: float
) -> None:
    """A logged thermo ``row`` (global values) and every rank's :func:`force_report` (``[P, 2]``,
    the same on every rank): raise :class:`Diverged` if an energy is non-finite or a bound is
    exceeded (``math.inf``: no bound)."""
    forces = forces.detach().cpu().to(torch.float64)
    r = int(forces[:, 0].argmax())
    fmax, atom = float(forces[r, 0]), int(forces[r, 1])
    on = f"on atom {atom} (rank {r})"
    if not (math.isfinite(row["potential"]) and math.isfinite(row["kinetic"])):
        raise Diverged(f"non-finite energy (potential {row['potential']} eV, kinetic {row['kinetic']} eV)")
    if not math.isfinite(fmax):
        raise Diverged(f"non-finite force {on}")
    if fmax > max_force:
        raise Diverged(
            f"force {fmax:.3g} eV/A {on} exceeds max_force {max_force:.3g} eV/A",
            "fix the structure (atoms too close?), use a smaller time step (--dt), or raise "
            "--max-force (0 disables the check)",
        )
    if row["temperature"] > max_temperature:
        raise Diverged(
            f"temperature {row['temperature']:.3g} K exceeds max_temperature {max_temperature:.3g} K",
            "use a smaller time step (--dt), fix the start structure (atoms too close?), or raise "
            "--max-temperature (0 disables the check)",
        )


def nonfinite_rows(t: torch.Tensor) -> list[int]:
    """Indices of the rows of ``t`` (per-atom values) that hold a NaN/inf."""
    t = t.detach()
    return torch.nonzero(~torch.isfinite(t.reshape(len(t), -1)).all(1)).flatten().tolist()
