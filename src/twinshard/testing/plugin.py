"""pytest plugin (registered through the ``pytest11`` entry point).

- ``@pytest.mark.grids((1, 1), (2, 2), (2, 3))`` parametrizes a test's ``grid`` argument over grid
  shapes (ids "1x1", "2x2", ...); 1-D shapes such as ``(4,)`` give world sizes.
- ``--twinshard-evidence PATH`` chooses the evidence log (default ``parity-evidence.log``; the
  file is started afresh each session); the terminal summary repeats every evidence line.
"""

from __future__ import annotations

import os

import pytest

from twinshard.testing import evidence


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--twinshard-evidence",
        default=None,
        help="file for parity evidence lines (default: parity-evidence.log)",
    )


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "grids(*shapes): run the test once per process-grid shape (argument `grid`)"
    )
    path = config.getoption("--twinshard-evidence")
    if path is not None:
        os.environ["TWINSHARD_EVIDENCE"] = path
    target = evidence.evidence_path()
    if target and not hasattr(config, "workerinput"):
        open(target, "w").close()


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    marker = metafunc.definition.get_closest_marker("grids")
    if marker is None:
        return
    if "grid" not in metafunc.fixturenames:
        raise pytest.UsageError(f"{metafunc.definition.nodeid}: @pytest.mark.grids needs a `grid` argument")
    shapes = [tuple(s) for s in marker.args]
    metafunc.parametrize("grid", shapes, ids=["x".join(map(str, s)) for s in shapes])


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    if not evidence.LINES:
        return
    terminalreporter.section(f"twinshard parity evidence ({len(evidence.LINES)} checks)")
    for line in evidence.LINES:
        terminalreporter.write_line(line)
    path = evidence.evidence_path()
    if path:
        terminalreporter.write_line(f"(also written to {path})")
