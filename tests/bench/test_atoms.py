"""`twinshard bench atoms` smoke test: JSON runs with the md keys, parity, plot."""

import argparse
import json

from twinshard.atoms.driver import result_keys
from twinshard.bench.atoms import add_parser


def test_bench_atoms_json_and_plot(tmp_path, capsys):
    parser = argparse.ArgumentParser()
    add_parser(parser.add_subparsers())
    png = tmp_path / "atoms.png"
    args = parser.parse_args(
        ["atoms", "--atoms", "500", "--ranks", "1,2", "--steps", "1", "--json", "--plot", str(png)]
    )
    args.func(args)
    r = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert r["bench"] == "atoms" and r["atoms"] == 500 and r["potential"] == "mpnn"
    assert [run["ranks"] for run in r["runs"]] == [1, 2]
    for run in r["runs"]:
        assert set(result_keys()) <= set(run)
        assert run["max_force_error"] <= 1e-10 and run["energy_rel_error"] <= 1e-12
        assert run["max_position_error"] <= 1e-9
        assert min(run["peak_memory_bytes_per_rank"]) > 0 and run["serial_peak_memory_bytes"] > 0
    two = r["runs"][1]
    assert max(two["peak_memory_bytes_per_rank"]) < two["serial_peak_memory_bytes"]
    assert min(two["comm_bytes_per_step_per_rank"]) > 0
    assert r["halo_ratio_max"] > 0 and png.stat().st_size > 10_000
