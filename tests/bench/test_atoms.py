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


def test_bench_atoms_evaluation_lj_both_paths(tmp_path, capsys):
    """--mode eval: serial analytic and autograd back to back, per-P parts, parity, plot."""
    parser = argparse.ArgumentParser()
    add_parser(parser.add_subparsers())
    png = tmp_path / "eval.png"
    args = parser.parse_args(
        ["atoms", "--potential", "lj", "--atoms", "500", "--ranks", "1,2", "--mode", "eval"]
        + ["--both-paths", "--repeats", "2", "--json", "--plot", str(png)]
    )
    args.func(args)
    r = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert r["mode"] == "eval" and r["potential"] == "lj" and not r["weak_scaling"]
    paths = r["serial"]["1"]["paths"]
    assert set(paths) == {"analytic", "autograd"}
    # the half list holds each pair once: half the directed edges of the full list
    assert 2 * paths["analytic"]["pairs_listed"] == paths["autograd"]["pairs_listed"]
    assert [(x["ranks"], x["path"]) for x in r["runs"]] == [
        (1, "analytic"),
        (1, "autograd"),
        (2, "analytic"),
        (2, "autograd"),
    ]
    for run in r["runs"]:
        assert run["max_force_error"] <= 1e-12 and run["energy_rel_error"] <= 1e-12
        assert run["max_virial_error"] <= 1e-11
        assert min(run["peak_memory_bytes_per_rank"]) > 0 and min(run["peak_rss_bytes_per_rank"]) > 0
        assert run["ghost_shell_estimate"] > 0 and min(run["halo_atoms_per_rank"]) > 0
    fast2 = r["runs"][2]["parts_seconds_per_rank"]
    assert set(fast2) >= {"neighbor_list", "halo_forward", "pairs", "halo_reverse"}
    assert all(len(v) == 2 for v in fast2.values())
    assert "time_ratio_to_serial_P2" in r and "halo_fraction_P2" in r
    assert r["serial_memory_ratio_autograd_over_analytic"] > 1
    assert png.stat().st_size > 10_000


def test_bench_atoms_evaluation_weak_scaling_mpnn(capsys):
    """--weak: atoms per rank fixed; the message-passing model against its plain serial run."""
    parser = argparse.ArgumentParser()
    add_parser(parser.add_subparsers())
    args = parser.parse_args(
        ["atoms", "--potential", "mpnn", "--atoms", "108", "--ranks", "1,2", "--mode", "eval", "--weak"]
        + ["--repeats", "1", "--json"]
    )
    args.func(args)
    r = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert r["weak_scaling"] and set(r["serial"]) == {"1", "2"}
    assert [x["atoms"] for x in r["runs"]] == [108, 256]  # smallest fcc cubes with >= 108 and 216
    for run in r["runs"]:
        assert run["path"] == "autograd" and run["max_force_error"] <= 1e-10
        assert run["time_ratio_to_serial"] > 0
