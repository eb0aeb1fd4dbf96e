"""The main job: ``twinshard demo`` runs every section against serial and prints its table."""

import re

from twinshard.cli import DEMO_SECTIONS, main


def test_demo_table(capsys):
    assert main(["demo"]) == 0  # on the shared pool the tests use (run_ranks outside a world)
    out = capsys.readouterr().out
    for section in (
        "adjoint",
        "atoms: LJ NVE",
        "atoms: MPNN",
        "triangle multiplication",
        "outer product mean",
    ):
        assert section in out
    errors = [
        float(m.group(1)) for ln in out.splitlines() if (m := re.search(r"\s(\d\.\d\de[+-]\d\d)\s+\d+$", ln))
    ]
    assert len(errors) >= 12  # 6 comm adjoints, 3 atoms rows, 3 pair rows
    assert max(errors) < 1e-12  # every section agrees with its serial twin to round-off
    assert len(DEMO_SECTIONS) == 3


def test_cli_reports_rank_failures_in_one_line(capsys):
    assert main(["md", "/nonexistent/structure.xyz", "--ranks", "2", "--steps", "1"]) == 1
    err = capsys.readouterr().err
    assert "twinshard: error on rank 0" in err and "does not exist" in err and "Traceback" not in err
