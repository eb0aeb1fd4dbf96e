"""pytest plugin (registered through the ``pytest11`` entry point).

- ``@pytest.mark.grids((1, 1), (2, 2), (2, 3))`` parametrizes a test's ``grid`` argument over grid
  shapes (ids "1x1", "2x2", ...); 1-D shapes such as ``(4,)`` give world sizes.
- ``--twinshard-evidence PATH`` chooses the evidence log (default ``parity-evidence.log``). The
  log is written only if a twinshard parity check runs; the session's first line starts it
  afresh, so a project that installs twinshard but never uses it gets no file.
- The terminal summary gives one line per test module (checks, worst abs and rel error, worst
  error as a fraction of its budget) and the log's path; ``-v`` or
  ``--twinshard-evidence-lines`` prints every evidence line.
"""

from __future__ import annotations

import math
import os

import pytest

from twinshard.testing import evidence


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("twinshard")
    group.addoption(
        "--twinshard-evidence",
        default=None,
        help="file for parity evidence lines (default: parity-evidence.log)",
    )
    group.addoption(
        "--twinshard-evidence-lines",
        action="store_true",
        default=False,
        help="print every parity evidence line in the terminal summary (also with -v)",
    )


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "grids(*shapes): run the test once per process-grid shape (argument `grid`)"
    )
    path = config.getoption("--twinshard-evidence")
    if path is not None:
        os.environ["TWINSHARD_EVIDENCE"] = path
    if not hasattr(config, "workerinput"):
        evidence.start_fresh()


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    marker = metafunc.definition.get_closest_marker("grids")
    if marker is None:
        return
    if "grid" not in metafunc.fixturenames:
        raise pytest.UsageError(f"{metafunc.definition.nodeid}: @pytest.mark.grids needs a `grid` argument")
    shapes = [tuple(s) for s in marker.args]
    metafunc.parametrize("grid", shapes, ids=["x".join(map(str, s)) for s in shapes])


def summary_rows(records: list[tuple[str, evidence.Evidence]]) -> list[str]:
    """One line per test module: checks, worst abs/rel error, worst error / budget."""
    by_module: dict[str, list[evidence.Evidence]] = {}
    for test, ev in records:
        by_module.setdefault(test.split("::", 1)[0], []).append(ev)
    rows = []
    for module, evs in sorted(by_module.items()):
        worst_abs = max(e.max_abs for e in evs)
        worst_rel = max(e.max_rel for e in evs)
        ratios = [e.max_abs / e.budget for e in evs if math.isfinite(e.budget) and e.budget > 0]
        ratio = f"{max(ratios):.2g}" if ratios else "-"
        rows.append(
            f"{module}: {len(evs)} checks | worst max_abs {worst_abs:.2e} | worst max_rel "
            f"{worst_rel:.2e} | worst error/budget {ratio}"
        )
    return rows


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter, config: pytest.Config) -> None:
    if not evidence.RECORDS:
        return
    terminalreporter.section(f"twinshard parity evidence ({len(evidence.RECORDS)} checks)")
    every = config.getoption("--twinshard-evidence-lines") or config.getoption("verbose") > 0
    for line in evidence.LINES if every else summary_rows(evidence.RECORDS):
        terminalreporter.write_line(line)
    path = evidence.evidence_path()
    if path:
        terminalreporter.write_line(f"every line: {os.path.abspath(path)}")
