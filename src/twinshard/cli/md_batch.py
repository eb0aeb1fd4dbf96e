"""``twinshard md --batch S1,S2,... [--steps N1,N2,...]``: MD on a batch of systems in one run
(:func:`twinshard.atoms.dynamics.batch_api.run_md_batch` through ``run_md``); rank 0 prints a
summary, or one JSON line with ``--json``: per system its structure, atoms, steps, final potential
and temperature, conserved-quantity drift, thermo file and (``--pressure``: every system its own
barostat) final volume and mean pressure; for the batch the drop-outs, seconds
and systems x steps per second."""

from __future__ import annotations

import argparse
import json
from dataclasses import replace
from typing import Any

from twinshard.atoms.dynamics.config import MDConfig, load_structure, potential_from_config

__all__ = ["run_batch"]


def run_batch(args: argparse.Namespace, cfg: MDConfig) -> dict[str, Any]:
    from twinshard.atoms.dynamics.api import run_md
    from twinshard.runtime import reports

    names = [s.strip() for s in str(args.batch).split(",") if s.strip()]
    if not names:
        raise ValueError("--batch takes structures separated by commas (files or embedded names), got none")
    if cfg.structure is not None:
        raise ValueError("give the structures with --batch only, not also as the STRUCTURE argument")
    if cfg.storage != "halo" and cfg.storage != "graph":
        raise ValueError(f"--batch runs in graph storage, got --storage {cfg.storage}")
    for opt, bad in (
        ("--balance", cfg.balance is not None),
        ("--check-serial", cfg.check_serial),
        ("--json-arrays", cfg.json_arrays),
    ):
        if bad:
            raise ValueError(f"{opt} is not available with --batch (graph storage, one run per batch)")
    restart = [s for s in cfg.restart.split(",")] if cfg.restart else None
    systems = None if restart else [load_structure(replace(cfg, structure=n)) for n in names]
    if restart is not None and len(restart) != len(names):
        raise ValueError(f"--restart takes {len(names)} checkpoints for {len(names)} --batch systems")
    if systems is not None:
        species = sorted({int(z) for s in systems for z in s.numbers.unique().tolist()})
    else:
        from twinshard.atoms.dynamics.md import load_checkpoint

        species = sorted(
            {int(z) for p in restart for z in load_checkpoint(p)["system"].numbers.unique().tolist()}
        )
    potential = potential_from_config(replace(cfg, storage="graph"), species)
    outs = run_md(
        systems,
        potential,
        ranks=int(args.ranks),
        steps=cfg.steps,
        thermostat=cfg.thermostat,
        dt=cfg.dt,
        temperature=cfg.temperature,
        friction=cfg.friction,
        tdamp=cfg.tdamp,
        chain=cfg.chain,
        pressure=cfg.pressure,
        barostat=cfg.barostat,
        pdamp=cfg.pdamp,
        pchain=cfg.pchain,
        coupling=cfg.coupling,
        compressibility=cfg.compressibility,
        zero_momentum=cfg.zero_momentum,
        seed=cfg.seed,
        skin=cfg.skin,
        storage="graph",
        thermo=cfg.thermo,
        thermo_every=cfg.thermo_every,
        trajectory=cfg.trajectory,
        trajectory_every=cfg.trajectory_every,
        checkpoint=cfg.checkpoint,
        checkpoint_every=cfg.checkpoint_every,
        restart=restart,
        allow_changed_potential=cfg.allow_changed_potential,
        timeout=float(getattr(args, "timeout", 3600.0)),
        max_temperature=cfg.max_temperature,
        max_force=cfg.max_force,
    )
    done = sum(o.steps - o.start_step for o in outs)
    seconds = outs[0].seconds
    result: dict[str, Any] = {
        "batch": names,
        "ranks": outs[0].ranks,
        "potential": cfg.potential,
        "storage": "graph",
        "thermostat": cfg.thermostat,
        "atoms": sum(o.thermo.n_atoms for o in outs),
        "dropouts": [list(d) for d in outs[0].info["dropouts"]],
        "owned_atoms_per_rank_start": outs[0].info["owned_atoms_per_rank_start"],
        "seconds": seconds,
        "system_steps_per_second": done / seconds if seconds > 0 else None,
        "systems": [
            {
                "structure": name,
                "atoms": o.thermo.n_atoms,
                "steps": o.steps,
                "start_step": o.start_step,
                "final_potential": o.thermo.rows[-1]["potential"],
                "final_temperature": o.thermo.rows[-1]["temperature"],
                "conserved_drift": o.thermo.rows[-1]["conserved"] - o.thermo.rows[0]["conserved"],
                "energy": o.energy,
                "final_volume": o.info.get("final_volume"),
                "mean_pressure": o.info.get("mean_pressure"),
                "thermo": o.thermo.path,
            }
            for name, o in zip(names, outs)
        ],
    }
    if not reports():
        return result
    if getattr(args, "json", False):
        print(json.dumps(result))
    else:
        print(
            f"twinshard md --batch: {len(names)} systems, {result['atoms']} atoms, {result['ranks']} ranks, "
            f"potential {cfg.potential}, thermostat {cfg.thermostat}, {result['system_steps_per_second']:.3g} "
            "system-steps/s"
        )
        for row in result["systems"]:
            print(
                f"  {row['structure']:24s} {row['atoms']:6d} atoms  steps {row['start_step']}-{row['steps']}  "
                f"T {row['final_temperature']:.1f} K  drift {row['conserved_drift']:.3g} eV"
            )
    return result
