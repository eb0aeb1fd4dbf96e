"""Evidence of parity checks: one line per successful check, in a log file and the pytest summary.

A line reads: test id | grid | what | max abs error | max rel error | tolerance and its
derivation | checks passed. The file is ``parity-evidence.log`` in the working directory unless
``TWINSHARD_EVIDENCE`` (or the pytest option ``--twinshard-evidence``) names another;
``TWINSHARD_EVIDENCE=`` (empty) turns the file off.

The file is written only when a twinshard check runs: a pytest session that never calls one
(another project's tests in the same environment) leaves no file and truncates none. In a
pytest session the plugin asks for a fresh file (``start_fresh``): the first line logged in
that process truncates it, later ones append.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

LINES: list[str] = []
RECORDS: list[tuple[str, Evidence]] = []
_fresh = False


@dataclass
class Evidence:
    what: str
    grid: str
    max_abs: float
    max_rel: float
    tolerance: str
    checks: tuple[str, ...] = ()
    budget: float = float("nan")
    """The absolute budget the check applied (max abs error must stay below it)."""

    def line(self) -> str:
        return (
            f"{current_test()} | grid {self.grid} | {self.what} | max_abs {self.max_abs:.3e} | "
            f"max_rel {self.max_rel:.3e} | {self.tolerance} | checks: "
            f"{','.join(self.checks) if self.checks else 'parity'}"
        )


def current_test() -> str:
    return os.environ.get("PYTEST_CURRENT_TEST", "").rsplit(" (", 1)[0] or "-"


def evidence_path() -> str | None:
    path = os.environ.get("TWINSHARD_EVIDENCE", "parity-evidence.log")
    return path or None


def start_fresh() -> None:
    """The next line logged in this process starts the file afresh (one pytest session)."""
    global _fresh
    _fresh = True


def log(ev: Evidence) -> str:
    """Record one line of evidence (memory for the terminal summary, and the log file)."""
    global _fresh
    line = ev.line()
    LINES.append(line)
    RECORDS.append((current_test(), ev))
    path = evidence_path()
    if path:
        with open(path, "w" if _fresh else "a") as fh:
            fh.write(line + "\n")
        _fresh = False
    return line
