"""``twinshard md`` on the command line: its parser, and the run in the current world or on
``--ranks`` local ranks (:func:`twinshard.atoms.dynamics.driver.md_rank` on every rank; rank 0 prints
the summary, or the JSON line with ``--json``)."""

from __future__ import annotations

import argparse
import json
import os
from typing import Any

from twinshard.atoms.dynamics.config import DEFAULT_ATOMS, RESULT_KEYS, MDConfig
from twinshard.atoms.dynamics.driver import md_rank
from twinshard.atoms.dynamics.sanity import MAX_FORCE, MAX_TEMPERATURE

__all__ = ["add_md_parser", "config_from_args", "run_md"]


def _positive(text: str) -> int:
    """An argparse type: a positive integer, or a one-line usage error saying so."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


def _steps(text: str) -> int | list[int]:
    """An argparse type: ``S`` or, with ``--batch``, ``S1,S2,...`` (one per system)."""
    try:
        values = [int(v) for v in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected a number of steps (or N1,N2,... with --batch), got {text!r}"
        ) from None
    return values[0] if len(values) == 1 else values


def add_md_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register ``md`` on a subparsers object (``twinshard md ...``)."""
    p = subparsers.add_parser(
        "md",
        help="molecular dynamics, serial or over P ranks (spatial decomposition)",
        description="Run MD on an embedded structure (default: fcc argon) or a structure file, "
        "over P local ranks (or the torchrun world), optionally checking it against serial.",
    )
    p.add_argument(
        "structure",
        nargs="?",
        default=None,
        help="a structure file (extxyz, cif, POSCAR, ...) or an embedded name: "
        "fcc_argon, random_packing, triclinic_argon, lj_mixture",
    )
    p.add_argument(
        "--potential",
        choices=("lj", "mpnn", "mace"),
        default="lj",
        help="mace: mace-torch's MACE, unmodified, through the ShardTensor dispatch "
        "(--model FILE, or a small random-weight default)",
    )
    p.add_argument(
        "--model",
        default=None,
        metavar="FILE",
        help="--potential mace: a MACE model saved by mace-torch (torch.save of the module); "
        "default: a small random-weight MACE built offline",
    )
    p.add_argument(
        "--epsilon", type=float, default=None, help="LJ well depth in eV, every species (default: argon's)"
    )
    p.add_argument(
        "--sigma", type=float, default=None, help="LJ length in Angstrom, every species (default: argon's)"
    )
    p.add_argument(
        "--lj",
        action="append",
        default=None,
        metavar="SYMBOL:EPS:SIGMA",
        help="LJ parameters of one species (repeatable; overrides --epsilon/--sigma), e.g. Ar:0.0104:3.405",
    )
    p.add_argument(
        "--no-shift",
        dest="shift",
        action="store_false",
        help="LJ: truncate at the cutoff without shifting the energy to zero there",
    )
    p.add_argument(
        "--cutoff",
        type=float,
        default=None,
        help="potential cutoff in Angstrom (default: 2.5 sigma for LJ, 5 for mpnn)",
    )
    p.add_argument(
        "--ranks",
        type=int,
        default=1,
        help="local ranks to spawn (ignored under torchrun, which sets the world)",
    )
    p.add_argument(
        "--steps",
        type=_steps,
        default=100,
        help="steps of the run; with --batch one value for every system or N1,N2,... (a system with "
        "fewer steps drops out while the others continue)",
    )
    p.add_argument(
        "--batch",
        default=None,
        metavar="S1,S2,...",
        help="MD on a batch of systems in one run (graph storage, plain models: --potential mpnn or "
        "mace): structure files or embedded names, comma-separated; each system equals its run alone; "
        "--thermo/--trajectory/--checkpoint then take a path holding {i} (the system's index), "
        "--restart the checkpoints comma-separated",
    )
    p.add_argument("--dt", type=float, default=2.0, help="time step in fs")
    p.add_argument(
        "--thermostat",
        choices=("none", "langevin", "nose-hoover"),
        default="none",
        help="none: NVE velocity Verlet; langevin: BAOAB; nose-hoover: a Nose-Hoover chain (MTTK)",
    )
    p.add_argument(
        "--temperature", type=float, default=60.0, help="K: start velocities and the thermostat's bath"
    )
    p.add_argument("--friction", type=float, default=0.01, help="Langevin friction, 1/fs")
    p.add_argument(
        "--tdamp", type=float, default=None, metavar="FS", help="Nose-Hoover time scale, fs (default 100 dt)"
    )
    p.add_argument("--chain", type=_positive, default=3, metavar="N", help="Nose-Hoover chain length")
    p.add_argument(
        "--pressure",
        type=float,
        default=None,
        metavar="BAR",
        help="NPT at this pressure (bar) with --barostat (needs a cell periodic along all axes)",
    )
    p.add_argument(
        "--barostat",
        choices=("mtk", "scr"),
        default="mtk",
        help="mtk: isotropic Martyna-Tobias-Klein with Nose-Hoover chains (with --thermostat "
        "nose-hoover); scr: stochastic cell rescaling (Bernetti-Bussi), with any --thermostat",
    )
    p.add_argument(
        "--coupling",
        choices=("iso", "aniso", "tri"),
        default="iso",
        help="--barostat scr: iso (volume), aniso (box lengths x, y, z) or tri (lengths and tilts)",
    )
    p.add_argument(
        "--compressibility",
        type=float,
        default=4.5e-5,
        metavar="PER_BAR",
        help="--barostat scr: the compressibility beta_T (1/bar) setting its relaxation with --pdamp",
    )
    p.add_argument(
        "--pdamp", type=float, default=None, metavar="FS", help="barostat time scale, fs (default 1000 dt)"
    )
    p.add_argument("--pchain", type=_positive, default=3, metavar="N", help="barostat chain length")
    p.add_argument(
        "--atoms",
        type=_positive,
        default=None,
        help=f"size of the embedded structure (default {DEFAULT_ATOMS} for fcc_argon)",
    )
    p.add_argument("--skin", type=float, default=1.0, help="Verlet skin in Angstrom")
    p.add_argument("--partition", choices=("spatial", "block"), default="spatial")
    p.add_argument(
        "--balance",
        type=float,
        default=None,
        metavar="THRESHOLD",
        help="load balance (spatial partition, halo storage): when max/mean owned atoms per rank "
        "exceeds THRESHOLD (>= 1, e.g. 1.1) at the start or at a neighbour-list rebuild, the cut "
        "planes move to balance the counts and atoms migrate (default: equal slabs)",
    )
    p.add_argument(
        "--storage",
        choices=("halo", "graph"),
        default="halo",
        help="halo: spatial domains with halos and migration; graph: atoms split by index into "
        "balanced blocks, geometry replicated (plain models: --potential mpnn or mace)",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--max-temperature",
        type=float,
        default=MAX_TEMPERATURE,
        metavar="K",
        help=f"stop with an error when a logged temperature exceeds this (default {MAX_TEMPERATURE:g} K; "
        "0: no bound); energies, forces and positions must also stay finite",
    )
    p.add_argument(
        "--max-force",
        type=float,
        default=MAX_FORCE,
        metavar="EV_PER_A",
        help=f"stop with an error when a logged step's largest force exceeds this "
        f"(default {MAX_FORCE:g} eV/A: atoms nearly on top of each other; 0: no bound)",
    )
    p.add_argument(
        "--zero-momentum",
        action="store_true",
        help="remove the net momentum at the start (ASE's Stationary) and count the kinetic degrees "
        "of freedom as 3N - 3 (temperature, Nose-Hoover chains); default: velocities as given, 3N",
    )
    p.add_argument(
        "--check-serial",
        action="store_true",
        help="also run the serial potential and trajectory and report differences",
    )
    p.add_argument("--thermo-every", type=int, default=10)
    p.add_argument("--thermo", default=None, help="write the thermo log to this file")
    p.add_argument("--trajectory", default=None, help="write an extxyz trajectory here")
    p.add_argument("--trajectory-every", type=int, default=10)
    p.add_argument(
        "--checkpoint",
        default=None,
        metavar="FILE",
        help="write a restart checkpoint here (atomically) every --checkpoint-every steps and at the end",
    )
    p.add_argument("--checkpoint-every", type=int, default=0, metavar="K")
    p.add_argument(
        "--restart",
        default=None,
        metavar="FILE",
        help="continue from a checkpoint (any rank count) up to --steps, which counts the whole run; "
        "give the same --thermostat/--dt/--temperature/--friction/--seed/--tdamp/--chain (and "
        "--pressure/--barostat/--pdamp/--pchain/--coupling/--compressibility) and potential options",
    )
    p.add_argument(
        "--allow-changed-potential",
        action="store_true",
        help="with --restart: continue with a potential other than the one that wrote the "
        "checkpoint (other class, cutoff, LJ parameters, weights or model file) on purpose",
    )
    p.add_argument(
        "--timeout",
        type=float,
        default=3600.0,
        help="seconds the whole run may take (any one collective may wait at most min(this, 300 s))",
    )
    p.add_argument("--json", action="store_true", help="print one JSON object as the last stdout line")
    p.add_argument(
        "--json-arrays",
        action="store_true",
        help="with --json: also the final ids, positions, velocities and forces (ordered by id)",
    )
    p.set_defaults(func=run_md)
    return p


def config_from_args(args: argparse.Namespace) -> MDConfig:
    fields = MDConfig.__dataclass_fields__
    kw = {k: getattr(args, k) for k in fields if hasattr(args, k)}
    kw["progress"] = not getattr(args, "json", False) and bool(getattr(args, "progress", True))
    return MDConfig(**kw)


def run_md(args: argparse.Namespace) -> dict[str, Any]:
    """``twinshard md``: run in the current world (torchrun or an enclosing launch), or spawn
    ``--ranks`` local ranks; rank 0 prints the summary (and the JSON line with ``--json``)."""
    from twinshard.runtime import reports, run_ranks

    cfg = config_from_args(args)
    if getattr(args, "ranks", 1) < 1:
        raise ValueError(f"--ranks must be >= 1, got {args.ranks}")
    if getattr(args, "batch", None) is not None:
        from twinshard.cli.md_batch import run_batch

        return run_batch(args, cfg)
    if isinstance(cfg.steps, list):
        raise ValueError(
            "--steps N1,N2,... gives one value per system of a --batch; without it give one number"
        )
    deadline = float(getattr(args, "timeout", 3600.0))
    # --ranks is ignored in a world (torchrun sets it): no option named
    result = run_ranks(md_rank, int(args.ranks), cfg, deadline=deadline)[0]
    if not reports():
        return result
    if getattr(args, "json", False):
        print(json.dumps(result))
    else:
        _print_summary(result, cfg)
    return result


def _print_summary(result: dict[str, Any], cfg: MDConfig) -> None:
    print(
        f"twinshard md: {result['atoms']} atoms, {result['ranks']} ranks "
        f"(grid {result['rank_grid']}), potential {result['potential']}, "
        f"{result['steps']} steps of {cfg.dt} fs, thermostat {result['thermostat']}"
    )
    extra = ("final_volume", "mean_pressure") if result.get("final_volume") is not None else ()
    for k in RESULT_KEYS[4:] + ("final_temperature", "conserved_drift", "atoms_conserved") + extra:
        print(f"  {k:30s} {result.get(k)}")
    if cfg.thermo and os.path.exists(cfg.thermo):
        print(f"  thermo log: {cfg.thermo}")
