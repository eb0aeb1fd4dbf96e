"""Evidence of parity checks: one line per successful check, in a log file and the pytest summary.

A line reads: test id | grid | what | max abs error | max rel error | tolerance | checks passed.
The file is ``parity-evidence.log`` in the working directory unless ``TWINSHARD_EVIDENCE`` (or
the pytest option ``--twinshard-evidence``) names another; ``TWINSHARD_EVIDENCE=`` (empty) turns
the file off.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

LINES: list[str] = []


@dataclass
class Evidence:
    what: str
    grid: str
    max_abs: float
    max_rel: float
    tolerance: str
    checks: tuple[str, ...] = ()

    def line(self) -> str:
        test = os.environ.get("PYTEST_CURRENT_TEST", "").rsplit(" (", 1)[0] or "-"
        return (
            f"{test} | grid {self.grid} | {self.what} | max_abs {self.max_abs:.3e} | "
            f"max_rel {self.max_rel:.3e} | {self.tolerance} | checks: "
            f"{','.join(self.checks) if self.checks else 'parity'}"
        )


def evidence_path() -> str | None:
    path = os.environ.get("TWINSHARD_EVIDENCE", "parity-evidence.log")
    return path or None


def log(ev: Evidence) -> str:
    """Record one line of evidence (memory for the terminal summary, and the log file)."""
    line = ev.line()
    LINES.append(line)
    path = evidence_path()
    if path:
        with open(path, "a") as fh:
            fh.write(line + "\n")
    return line
