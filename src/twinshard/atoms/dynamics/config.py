"""The options of ``twinshard md`` and what they build: :class:`MDConfig` (everything a rank
needs, picklable, the same on every rank), the start structure, the potential, the integrator,
and the ghost-shell estimate the JSON reports. The rank body that uses them is
:func:`twinshard.atoms.dynamics.driver.md_rank`."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from twinshard.atoms.data.system import System
from twinshard.atoms.dynamics.ensembles import integrator_for
from twinshard.atoms.dynamics.md import VelocityVerlet, maxwell_boltzmann
from twinshard.atoms.dynamics.run import MDOptions
from twinshard.atoms.potentials import make_potential

__all__ = [
    "DEFAULT_ATOMS",
    "MDConfig",
    "RESULT_KEYS",
    "ghost_shell_estimate",
    "lj_parameters",
    "load_structure",
    "make_integrator",
    "potential_from_config",
]

DEFAULT_ATOMS = 4000
RESULT_KEYS = (
    "ranks",
    "atoms",
    "steps",
    "potential",
    "energy_rel_error",
    "max_force_error",
    "max_stress_error",
    "max_position_error",
    "migrations",
    "halo_atoms_per_rank",
    "ghost_shell_estimate",
    "comm_bytes_per_step_per_rank",
    "peak_memory_bytes_per_rank",
    "serial_peak_memory_bytes",
    "seconds_per_step",
    "serial_seconds_per_step",
)


@dataclass
class MDConfig(MDOptions):
    """Everything a rank needs (picklable, the same on every rank): the run's options
    (:class:`~twinshard.atoms.dynamics.run.MDOptions`, shared with ``run_md``) and what names the
    structure, the potential, the ensemble and the figures."""

    structure: str | None = None
    atoms: int | None = None
    potential: str = "lj"
    model: str | None = None
    cutoff: float | None = None
    dt: float = 2.0
    thermostat: str = "none"
    temperature: float = 60.0
    friction: float = 0.01
    tdamp: float | None = None
    chain: int = 3
    pressure: float | None = None  # bar: NPT with --barostat
    barostat: str = "mtk"
    pdamp: float | None = None
    pchain: int = 3
    coupling: str = "iso"  # --barostat scr: iso, aniso or tri
    compressibility: float = 4.5e-5  # --barostat scr: beta_T, 1/bar
    seed: int = 0
    rattle: float = 0.05
    serial_cache: str | None = None
    epsilon: float | None = None
    sigma: float | None = None
    shift: bool = True
    lj: list[str] | None = None
    json_arrays: bool = False
    zero_momentum: bool = False  # remove the net momentum at the start; 3N - 3 kinetic dof


# ----------------------------------------------------------------------------- inputs


def load_structure(cfg: MDConfig) -> System:
    """The start structure: an embedded one by name (default fcc argon) or a file.

    Velocities that are all zero get a Maxwell-Boltzmann draw at
    ``cfg.temperature`` keyed by global id (the same on any rank count).
    """
    from twinshard.atoms.data import structures

    name = cfg.structure
    if cfg.atoms is not None and cfg.atoms < 1:
        raise ValueError(f"atoms must be a positive number of atoms, got {cfg.atoms}")
    if name is None or name in structures.STRUCTURES:
        name = name or "fcc_argon"
        n = cfg.atoms
        if name == "fcc_argon":
            system = structures.fcc_argon(n_atoms=n or DEFAULT_ATOMS, rattle=cfg.rattle, seed=cfg.seed)
        elif name == "triclinic_argon":
            rep = max(2, round((n or 1000) ** (1 / 3)))
            system = structures.triclinic_argon(rep, seed=cfg.seed)
        else:
            kwargs: dict[str, Any] = {"seed": cfg.seed}
            if n:
                kwargs["n_atoms"] = n
            system = structures.build(name, **kwargs)
    else:
        from twinshard.atoms.data.io import as_system

        system = as_system(name)
    if not bool(system.velocities.abs().gt(0).any()) and cfg.temperature > 0:
        system.velocities = maxwell_boltzmann(system.masses, system.ids, cfg.temperature, seed=cfg.seed)
    return system


def lj_parameters(cfg: MDConfig, species: list[int]) -> dict[int, tuple[float, float]] | None:
    """Per-species ``(epsilon eV, sigma A)`` from ``--epsilon/--sigma`` (every species) and
    ``--lj SYMBOL:EPS:SIGMA`` (one species each, overriding); ``None``: the defaults."""
    if cfg.epsilon is None and cfg.sigma is None and not cfg.lj:
        return None
    from ase.data import atomic_numbers

    from twinshard.atoms.data.structures import lj_mixture_parameters

    defaults = {18: (0.0104, 3.405), **lj_mixture_parameters()}
    params: dict[int, tuple[float, float]] = {}
    for z in species:
        e, sg = defaults.get(z, (None, None))
        e = cfg.epsilon if cfg.epsilon is not None else e
        sg = cfg.sigma if cfg.sigma is not None else sg
        if e is not None and sg is not None:
            params[z] = (float(e), float(sg))
    for spec in cfg.lj or []:
        parts = str(spec).split(":")
        if len(parts) != 3 or parts[0] not in atomic_numbers:
            raise ValueError(f"--lj takes SYMBOL:EPSILON:SIGMA (e.g. Ar:0.0104:3.405), got {spec!r}")
        try:
            params[atomic_numbers[parts[0]]] = (float(parts[1]), float(parts[2]))
        except ValueError:
            raise ValueError(f"--lj takes SYMBOL:EPSILON:SIGMA with numbers, got {spec!r}") from None
    missing = sorted(set(species) - set(params))
    if missing:
        raise ValueError(
            f"no LJ parameters for atomic numbers {missing}: give --epsilon and --sigma, or "
            "--lj SYMBOL:EPS:SIGMA for each species"
        )
    return params


def potential_from_config(cfg: MDConfig, species: list[int]) -> Any:
    """The potential ``twinshard md`` options describe, for the given atomic numbers.

    ``mace``: the saved model ``cfg.model`` (mace-torch's ``torch.save``; :func:`load_mace`) or,
    without it, the small random-weight MACE (:func:`build_mace`) for its default species and
    the structure's (so the embedded argon box runs), behind :class:`MaceAdapter`; a species of
    the structure a saved model does not know raises (a clear ValueError)."""
    if cfg.model is not None and cfg.potential != "mace":
        raise ValueError("--model is an option of --potential mace")
    if cfg.potential == "mace":
        if cfg.epsilon is not None or cfg.sigma is not None or cfg.lj or not cfg.shift:
            raise ValueError("--epsilon/--sigma/--lj/--no-shift are options of --potential lj")
        if cfg.cutoff is not None:
            raise ValueError("--cutoff: a MACE model has its own cutoff (r_max)")
        return make_potential("mace", species, model=cfg.model)  # replicated: species are agreed
    kw: dict[str, Any] = {} if cfg.cutoff is None else {"cutoff": cfg.cutoff}
    if cfg.potential == "lj":
        params = lj_parameters(cfg, species)
        if params is not None:
            kw["parameters"] = params
        kw["shift"] = cfg.shift
    elif cfg.epsilon is not None or cfg.sigma is not None or cfg.lj or not cfg.shift:
        raise ValueError("--epsilon/--sigma/--lj/--no-shift are options of --potential lj")
    if cfg.storage == "graph":  # plain-PyTorch models only, through the dispatch
        if cfg.potential != "mpnn":
            raise ValueError("--storage graph runs plain-PyTorch models: --potential mpnn or mace")
    return make_potential(cfg.potential, species, plain=cfg.storage == "graph", **kw)


def make_integrator(cfg: MDConfig) -> VelocityVerlet:
    integ = _make_integrator(cfg)
    if cfg.zero_momentum:
        integ.zero_momentum = True  # a setting: recorded in the checkpoint's integrator state
    return integ


def _make_integrator(cfg: MDConfig) -> VelocityVerlet:
    if cfg.balance is not None and (cfg.storage != "halo" or cfg.partition != "spatial"):
        raise ValueError(
            "--balance moves the cut planes of the spatial partition: it runs with --storage halo "
            "--partition spatial (graph storage and the block partition split atoms by index, "
            "already balanced)"
        )
    if cfg.balance is not None and not (cfg.balance >= 1.0 and math.isfinite(cfg.balance)):
        raise ValueError(
            f"--balance is a threshold on max/mean owned atoms, >= 1 (e.g. 1.1); got {cfg.balance}"
        )
    return integrator_for(
        cfg.thermostat,
        cfg.dt,
        cfg.temperature,
        cfg.friction,
        cfg.seed,
        cfg.tdamp,
        cfg.chain,
        cfg.pressure,
        cfg.barostat,
        cfg.pdamp,
        cfg.pchain,
        cfg.coupling,
        cfg.compressibility,
    )


def ghost_shell_estimate(
    n_atoms: int, cell: torch.Tensor, pbc: Any, grid: tuple[int, ...], width: float
) -> float:
    """Halo atoms per rank of a slab decomposition (see the module docstring). ``pbc`` does not
    enter: an unsplit axis imports nothing whether periodic or open, a split one a slab each side
    (at a non-periodic outer face that over-counts: an upper bound there)."""
    from twinshard.atoms.parallel.partition import cell_heights, ghost_fraction

    c = cell.to(torch.float64)
    if abs(float(torch.linalg.det(c))) == 0:
        return float("nan")
    return n_atoms * ghost_fraction(cell_heights(c).tolist(), grid, width)
