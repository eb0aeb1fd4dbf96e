"""What produced an MD checkpoint, and the checksum of its payload.

A checkpoint (:mod:`twinshard.atoms.dynamics.md`) records the potential that wrote it
(:func:`potential_provenance`: its class, cutoff and a few hyperparameters, a SHA-256 of its
``state_dict`` and, for a model file, the file's SHA-256) and the identity of the structure
(:func:`structure_identity`: atom count, sorted ids, species counts). Storage, partition and rank
count are not recorded: a restart may change them. A restart compares the records
(:func:`check_potential`, :func:`check_structure`) and refuses a difference in one line.

:func:`sha256_of` digests a nest of dicts (keys in sorted order), lists, plain scalars and
tensors (dtype, shape and bytes, on the CPU): the same value in every process, for any rank
count, so the checksum of a checkpoint's payload and the digest of a ``state_dict`` are
reproducible.
"""

from __future__ import annotations

import hashlib
import os
import sys
from typing import Any

import torch

from twinshard.atoms.data.system import System

__all__ = [
    "sha256_of",
    "payload_checksum",
    "check_payload",
    "file_sha256",
    "structure_identity",
    "potential_provenance",
    "check_potential",
    "check_structure",
]

# plain hyperparameters that change the physics but live outside the state_dict
HYPERPARAMETERS = ("cutoff", "shift", "energy_scale", "avg_neighbors", "head")
LABELS = {"parameters_sha256": "parameters digest", "model_sha256": "model file digest"}


def _feed(h: Any, value: Any) -> None:
    if isinstance(value, dict):
        h.update(b"{%d" % len(value))
        for k in sorted(value, key=str):  # insertion order differs between writers: sort
            _feed(h, str(k))
            _feed(h, value[k])
    elif isinstance(value, (list, tuple)):
        h.update(b"[%d" % len(value))
        for v in value:
            _feed(h, v)
    elif torch.is_tensor(value):
        t = value.detach().cpu().contiguous()
        h.update(f"T{t.dtype}{tuple(t.shape)}".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    else:  # repr round-trips floats exactly; the type name keeps 1, 1.0 and True apart
        h.update(f"{type(value).__name__}:{value!r};".encode())


def sha256_of(value: Any) -> str:
    """SHA-256 (hex) of a nest of dicts, lists/tuples, tensors and plain scalars (see the module)."""
    h = hashlib.sha256()
    _feed(h, value)
    return h.hexdigest()


def file_sha256(path: str | os.PathLike) -> str:
    """SHA-256 (hex) of a file's bytes."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def structure_identity(system: System) -> dict[str, Any]:
    """The identity of a structure: atom count, SHA-256 of its sorted ids, ``[[Z, count], ...]``."""
    z, counts = torch.unique(system.numbers.cpu(), return_counts=True)
    return {
        "atoms": int(system.n_atoms),
        "ids_sha256": sha256_of(torch.sort(system.ids.cpu().to(torch.int64)).values),
        "species": [[int(a), int(b)] for a, b in zip(z.tolist(), counts.tolist(), strict=True)],
    }


def potential_provenance(potential: torch.nn.Module, model_file: str | os.PathLike | None = None) -> dict:
    """What identifies ``potential``: its class (``module.qualname``; a plain twin names the class
    it reproduces in ``provenance_class``, so a restart may switch storage), the plain
    hyperparameters of :data:`HYPERPARAMETERS` it has, LJ's table (``"Ar:EPS:SIGMA ..."``), the
    SHA-256 of its ``state_dict`` (names, dtypes, shapes, bytes) and, with ``model_file``, that
    file's SHA-256."""
    from ase.data import chemical_symbols

    from twinshard.atoms.potentials import LennardJones

    cls = type(potential)
    out: dict[str, Any] = {
        "class": getattr(potential, "provenance_class", f"{cls.__module__}.{cls.__qualname__}")
    }
    for name in HYPERPARAMETERS:
        value = getattr(potential, name, None)
        if isinstance(value, (bool, int, float, str)):
            out[name] = value
    if isinstance(potential, LennardJones):
        rows = zip(potential.species, potential.epsilon.tolist(), potential.sigma.tolist(), strict=True)
        out["lj"] = " ".join(f"{chemical_symbols[z]}:{e!r}:{s!r}" for z, e, s in rows)
    out["parameters_sha256"] = sha256_of(dict(potential.state_dict()))
    if model_file is not None:
        out["model_sha256"] = file_sha256(model_file)
    return out


def payload_checksum(state: dict[str, Any]) -> str:
    """SHA-256 of a checkpoint's payload: every entry but ``"checksum"`` (the system's tensors'
    dtypes, shapes and bytes; the step, heat, integrator, RNG and provenance values)."""
    return sha256_of({k: v for k, v in state.items() if k != "checksum"})


def check_payload(state: dict[str, Any], path: str) -> None:
    """Raise ValueError (one line) if checkpoint ``state`` (as loaded from ``path``) does not match
    its checksum; a version-1 checkpoint has none: print a one-line notice on stderr instead."""
    if state.get("version") == 1:
        print(
            f"twinshard: checkpoint {path} has version 1: it records no checksum and no provenance, "
            "so its payload and its potential cannot be checked",
            file=sys.stderr,
            flush=True,
        )
    elif state.get("checksum") != payload_checksum(state):
        raise ValueError(
            f"checkpoint {path} is corrupted: its payload does not match its checksum (a flipped "
            "bit or a partial write); use an earlier checkpoint"
        )


def _show(key: str, value: Any) -> str:
    if value is None:
        return "(none)"
    return f"{value[:12]}.." if key.endswith("sha256") and isinstance(value, str) else str(value)


def _changes(saved: dict[str, Any], now: dict[str, Any]) -> str:
    keys = sorted(set(saved) | set(now), key=lambda k: (k.endswith("sha256"), k))  # digests last
    return ", ".join(
        f"{LABELS.get(k, k)} {_show(k, saved.get(k))} -> {_show(k, now.get(k))}"
        for k in keys
        if saved.get(k) != now.get(k)
    )


def check_potential(
    state: dict[str, Any], now: dict[str, Any], path: str, same: str, override: str, allow: bool = False
) -> str | None:
    """Compare the potential provenance of checkpoint ``state`` with ``now``.

    Raises ValueError in one line naming what differs (``same``: the options to repeat,
    ``override``: the option that accepts the change); with ``allow`` returns that line as a
    notice instead. Returns a notice, or None when they match. A checkpoint without a record
    (version 1: :func:`check_payload` said so) returns None; one whose writer gave none, a
    notice that it cannot be checked."""
    saved = (state.get("provenance") or {}).get("potential")
    if saved is None:
        if state.get("version") == 1:
            return None
        return f"checkpoint {path} records no potential: the restart cannot check it is the same one"
    text = _changes(saved, now)
    if not text:
        return None
    if allow:
        return f"checkpoint {path} was written by another potential ({text}); continuing with the new one"
    raise ValueError(
        f"checkpoint {path} was written by another potential: {text}; restart with the same {same}, "
        f"or pass {override} to continue with the new one on purpose"
    )


def check_structure(state: dict[str, Any], system: System, path: str) -> None:
    """Raise ValueError (one line, no override) if ``system`` is not the structure of checkpoint
    ``state``: another atom count, ids or species counts cannot continue the same run."""
    text = _changes(structure_identity(state["system"]), structure_identity(system))
    if text:
        raise ValueError(
            f"checkpoint {path} holds another structure than the one given ({text}): a restart "
            "continues the run that wrote it; give its structure or none, or start a new run"
        )
