"""The files of an MD run: checks before step 1, and the repair of torn tails on a restart.

Rank 0 writes three files: the checkpoint (atomically, :func:`~twinshard.runtime.atomic_write`),
the trajectory (extxyz frames appended) and the thermo log (rows appended). A process killed with
SIGKILL can leave a torn last frame or row (the file ends part-way through it) and the temporary
of an interrupted atomic write. :func:`prepare_outputs` runs on rank 0 before step 1 (the
distributed drivers call it inside their fail-together step, so its errors reach every rank):

- every output path must be writable (its directory exists, the path is no directory), else a
  ValueError names the option, the path and the fix before any step ran;
- the temporaries killed writers left for these files are removed;
- on a restart at step ``s`` the trajectory keeps its complete frames up to step ``s`` and the
  thermo log its header and complete rows up to ``s``; a torn tail and what a killed run wrote
  after its last checkpoint are cut (rewritten atomically). Damage followed by more data is not
  the tail a killed writer leaves: it raises a ValueError naming the file and the line.

Each action is reported in one line on stderr and returned.
"""

from __future__ import annotations

import os
import re
import sys
from collections.abc import Iterable
from dataclasses import dataclass
from typing import IO

from twinshard.runtime.files import atomic_write, temporary_pattern

__all__ = [
    "NPT_COLUMNS",
    "THERMO_COLUMNS",
    "check_writable",
    "prepare_outputs",
    "remove_stale_temporaries",
    "repair_thermo",
    "repair_trajectory",
]

THERMO_COLUMNS = ("step", "time_fs", "potential", "kinetic", "temperature", "conserved")
NPT_COLUMNS = THERMO_COLUMNS + ("volume", "pressure")  # a barostat's run: A^3, bar
_STEP = re.compile(r"(?:^|\s)step=(-?\d+)(?=\s|$)")
_PROPERTIES = re.compile(r"(?:^|\s)Properties=(\S+)")

StrPath = str | os.PathLike


def check_writable(paths: dict[str, StrPath | None]) -> None:
    """Raise ValueError unless every given path (keyed by the option that named it) can be
    written: its directory exists and is writable, and the path is not a directory."""
    for option, path in paths.items():
        if path is None:
            continue
        p = os.fspath(path)
        folder = os.path.dirname(os.path.abspath(p))
        if os.path.isdir(p):
            why = "is a directory"
        elif not os.path.exists(folder):
            why = f"is in {folder!r}, which does not exist (create it with mkdir -p)"
        elif not os.path.isdir(folder):
            why = f"is under {folder!r}, which is a file, not a directory"
        elif not os.access(folder, os.W_OK | os.X_OK) or (os.path.exists(p) and not os.access(p, os.W_OK)):
            why = "cannot be written (no write permission)"
        else:
            continue
        raise ValueError(
            f"{option} {p!r} {why}: give a file path in an existing, writable directory "
            "(checked before step 1: nothing ran)"
        )


def remove_stale_temporaries(paths: Iterable[StrPath | None]) -> list[str]:
    """Delete the temporaries killed writers left beside ``paths``: those of
    :func:`~twinshard.runtime.atomic_write` and ``<name>.tmp<pid>`` (the trajectory rewrite of
    earlier versions). Other files are untouched. Returns the removed paths."""
    removed: list[str] = []
    for p in dict.fromkeys(os.path.abspath(os.fspath(p)) for p in paths if p is not None):
        folder, name = os.path.split(p)
        ours = (temporary_pattern(p), re.compile(re.escape(name) + r"\.tmp\d+"))
        for entry in sorted(os.listdir(folder)):
            full = os.path.join(folder, entry)
            if any(pat.fullmatch(entry) for pat in ours) and os.path.isfile(full):
                os.unlink(full)
                removed.append(full)
    return removed


@dataclass
class _Frame:
    start: int  # byte offsets of the frame in the file
    end: int
    step: int | None  # its ``step=`` (None: a frame of another writer)


@dataclass
class _Damage:
    line: int  # the first bad line (1-based)
    frame: int  # 1-based
    first_line: int  # the frame's count line
    reason: str
    more: bool  # data follows the bad line: not a torn tail


def _is_numbers(tokens: list[str]) -> bool:
    try:
        [float(t) for t in tokens]
    except ValueError:
        return False
    return True


def _columns(comment: str) -> tuple[int, list[int]] | None:
    """(columns per atom line, indices of the numeric ones) from an extxyz ``Properties=``."""
    m = _PROPERTIES.search(comment)
    if m is None:
        return None
    parts = m.group(1).split(":")
    if len(parts) % 3:
        return None
    ncol, numeric = 0, []
    for kind, count in zip(parts[1::3], parts[2::3], strict=True):
        if not count.isdigit():
            return None
        if kind in ("R", "I"):
            numeric += range(ncol, ncol + int(count))
        ncol += int(count)
    return ncol, numeric


def _scan_trajectory(path: str) -> tuple[list[_Frame], _Damage | None]:
    """The complete frames of an extxyz file in order, up to the first damaged one."""
    frames: list[_Frame] = []
    line = 0
    with open(path, "rb") as f:

        def damage(first: int, bad: int, reason: str) -> tuple[list[_Frame], _Damage]:
            return frames, _Damage(bad, len(frames) + 1, first, reason, more=f.read(1) != b"")

        while True:
            start, raw = f.tell(), f.readline()
            if not raw:
                return frames, None
            line += 1
            first, text = line, raw.decode("utf-8", "replace")
            if not raw.endswith(b"\n"):
                return damage(first, line, "a partial count line")
            if not text.strip().isdigit():
                return damage(first, line, f"count line {text.strip()[:40]!r} is not an atom count")
            n = int(text)
            raw = f.readline()
            line += 1
            if not raw.endswith(b"\n"):
                return damage(first, line, "no complete comment line")
            comment = raw.decode("utf-8", "replace")
            cols = _columns(comment)
            for j in range(1, n + 1):
                raw = f.readline()
                line += 1
                if not raw.endswith(b"\n"):  # the file ends inside this frame
                    return damage(first, line, f"{j - 1} of {n} atom lines")
                tokens = raw.decode("utf-8", "replace").split()
                if cols is None:  # no Properties: species and three coordinates at least
                    ok = len(tokens) >= 4 and _is_numbers(tokens[1:4])
                else:
                    ok = len(tokens) == cols[0] and _is_numbers([tokens[i] for i in cols[1]])
                if not ok:
                    return damage(first, line, f"atom line {j} of {n} is not a row of its Properties")
            m = _STEP.search(comment)
            frames.append(_Frame(start, f.tell(), None if m is None else int(m.group(1))))


def _cut_message(what: str, path: str, torn: str | None, late: int, unit: str, step: int, kept: int) -> str:
    cut = [f"a torn last {unit} ({torn})"] if torn else []
    if late:
        cut.append(f"{late} {unit}(s) written after step {step} (past the checkpoint)")
    return f"{what} {path!r}: cut {' and '.join(cut)}; kept {kept} {unit}(s) of steps <= {step}"


def repair_trajectory(path: StrPath, step: int) -> str | None:
    """Prepare the extxyz trajectory ``path`` for a restart at ``step``: keep its complete
    frames with ``step=`` <= ``step`` (and frames without a step, of other writers), cut a torn
    last frame and the frames written after ``step``, rewrite atomically. Returns what was cut
    (None: nothing). Raises ValueError naming the file and line if a damaged frame is followed
    by more data (not a torn tail: a repair by hand is needed)."""
    path = os.fspath(path)
    if not os.path.isfile(path):
        return None
    frames, damage = _scan_trajectory(path)
    if damage is not None and damage.more:
        raise ValueError(
            f"trajectory {path!r} is damaged at line {damage.line} (frame {damage.frame}: "
            f"{damage.reason}) and more data follows, so it is not the torn end a killed run leaves; "
            f"keep the frames before it (head -n {damage.first_line - 1}) or move the file away, "
            "then restart"
        )
    keep = [fr for fr in frames if fr.step is None or fr.step <= step]
    if damage is None and len(keep) == len(frames):
        return None

    def write(out: IO[bytes]) -> None:
        with open(path, "rb") as src:
            for fr in keep:
                src.seek(fr.start)
                out.write(src.read(fr.end - fr.start))

    atomic_write(path, write)
    torn = None if damage is None else damage.reason
    return _cut_message("trajectory", path, torn, len(frames) - len(keep), "frame", step, len(keep))


def repair_thermo(path: StrPath, step: int) -> str | None:
    """Prepare the thermo log ``path`` for a restart at ``step``: keep its ``#`` lines and the
    complete rows (``len(THERMO_COLUMNS)`` numbers, ``len(NPT_COLUMNS)`` with a barostat) of steps <= ``step``, cut a torn last row and
    the rows of later steps, rewrite atomically. Returns what was cut (None: nothing). Raises
    ValueError naming the file and line if a damaged row is followed by more lines."""
    path = os.fspath(path)
    if not os.path.isfile(path):
        return None
    with open(path, "rb") as f:
        lines = f.readlines()
    keep, late, torn = [], 0, None
    for i, raw in enumerate(lines):
        text = raw.decode("utf-8", "replace")
        tokens = text.split()
        if raw.startswith(b"#") and raw.endswith(b"\n"):
            keep.append(raw)
        elif (
            raw.endswith(b"\n")
            and len(tokens) in (len(THERMO_COLUMNS), len(NPT_COLUMNS))
            and _is_numbers(tokens)
        ):
            if int(float(tokens[0])) <= step:
                keep.append(raw)
            else:
                late += 1
        elif i + 1 < len(lines):
            raise ValueError(
                f"thermo log {path!r} line {i + 1} is not a row of {len(THERMO_COLUMNS)} numbers "
                f"({text[:60]!r}) and more lines follow, so it is not the torn end a killed run leaves; "
                "delete that line or move the file away, then restart"
            )
        else:
            torn = f"line {i + 1}: {text[:40]!r}"
    if late == 0 and torn is None:
        return None
    atomic_write(path, lambda out: out.write(b"".join(keep)))
    rows = sum(not raw.startswith(b"#") for raw in keep)
    return _cut_message("thermo log", path, torn, late, "row", step, rows)


def prepare_outputs(
    start_step: int,
    checkpoint: StrPath | None = None,
    trajectory: StrPath | None = None,
    thermo: StrPath | None = None,
    names: tuple[str, str, str] = ("--checkpoint", "--trajectory", "--thermo"),
) -> list[str]:
    """Rank 0, before step 1 of a run that starts at ``start_step`` (0: a fresh run): check the
    output paths can be written (:func:`check_writable`; ``names`` are the options that gave
    them, for the message), remove stale temporaries of these files, and on a restart repair the
    trajectory and thermo tails. Prints each action in one line on stderr and returns them."""
    check_writable(dict(zip(names, (checkpoint, trajectory, thermo), strict=True)))
    notes = []
    removed = remove_stale_temporaries([checkpoint, trajectory, thermo])
    if removed:
        notes.append(
            f"removed {len(removed)} stale temporary file(s) of killed writers: {', '.join(removed)}"
        )
    if start_step > 0:
        if trajectory is not None:
            notes.append(repair_trajectory(trajectory, start_step))
        if thermo is not None:
            notes.append(repair_thermo(thermo, start_step))
    notes = [n for n in notes if n]
    for note in notes:
        print(f"twinshard md: {note}", file=sys.stderr, flush=True)
    return notes
