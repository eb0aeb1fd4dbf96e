"""`twinshard bench atoms` smoke tests: JSON runs with the md keys, parity, plot; --potential mace;
--mode overhead (hooks / dispatch / plain side by side) and its negative control."""

import argparse
import json

import pytest
import torch

from twinshard.atoms.dynamics.driver import result_keys
from twinshard.bench.atoms import add_parser
from twinshard.bench.atoms_overhead import check_agreement
from twinshard.testing import run_on_world


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
        # P=1, periodic: images are edge shifts, no halo rows (and none estimated); P=2 splits one axis
        assert run["ghost_shell_estimate"] > 0 if run["ranks"] > 1 else run["ghost_shell_estimate"] == 0
        assert min(run["halo_atoms_per_rank"]) > 0 if run["ranks"] > 1 else run["halo_atoms_per_rank"] == [0]
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


def _bench(argv, capsys):
    parser = argparse.ArgumentParser()
    add_parser(parser.add_subparsers())
    args = parser.parse_args(["atoms"] + argv + ["--json"])
    args.func(args)
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])


def test_bench_atoms_mace_md(capsys):
    """--potential mace: the small random-weight MACE on fcc argon with its four species assigned,
    MD at P = 1, 2 with the md keys (tensor and resident peaks per rank, halo against the ghost
    shell, time per step) and parity against serial MACE."""
    r = _bench(
        ["--potential", "mace", "--atoms", "32", "--ranks", "1,2", "--steps", "1", "--mode", "md"], capsys
    )
    assert r["potential"] == "mace" and r["atoms"] == 32 and [x["ranks"] for x in r["runs"]] == [1, 2]
    for run in r["runs"]:
        assert set(result_keys()) <= set(run)
        assert run["energy_rel_error"] <= 1e-13 and run["max_force_error"] <= 1e-13
        assert run["max_stress_error"] <= 1e-15 and run["max_position_error"] <= 1e-12
        assert min(run["peak_memory_bytes_per_rank"]) > 0 and min(run["peak_rss_bytes_per_rank"]) > 0
        assert run["seconds_per_step"] > 0
        assert run["ghost_shell_estimate"] > 0 if run["ranks"] > 1 else run["ghost_shell_estimate"] == 0
    assert r["halo_ratio_max"] > 0


def test_bench_atoms_overhead_mpnn(capsys):
    """--mode overhead: hooks, dispatch and graph storage (same weights, loaded strict) and at P=1
    the plain model and the serial evaluator, side by side; parity fields at round-off (the graph
    leg's forces by its own ids), ratios present."""
    r = _bench(
        ["--mode", "overhead", "--atoms", "108", "--ranks", "1,2", "--repeats", "1", "--stress"], capsys
    )
    assert r["mode"] == "overhead" and r["stress"] and r["atoms"] == 108
    assert [sorted(x["legs"]) for x in r["runs"]] == [
        ["dispatch", "graph", "hooks", "plain", "serial"],
        ["dispatch", "graph", "hooks"],
    ]
    for run in r["runs"]:
        # P=1, periodic: images are edge shifts, no halo rows (and none estimated); P=2 splits one axis
        assert run["ghost_shell_estimate"] > 0 if run["ranks"] > 1 else run["ghost_shell_estimate"] == 0
        assert min(run["halo_atoms_per_rank"]) > 0 if run["ranks"] > 1 else run["halo_atoms_per_rank"] == [0]
        for leg in run["legs"].values():
            assert leg["energy_rel_error"] <= 1e-14 and leg["max_force_error"] <= 1e-13 * leg["max_force"]
            assert leg["max_virial_error"] <= 1e-12
            assert leg["seconds_per_evaluation"] > 0 and leg["cpu_seconds_per_evaluation"] > 0
            assert min(leg["peak_memory_bytes_per_rank"]) > 0
    ratios = ["dispatch_over_hooks_P1", "dispatch_over_hooks_P2", "hooks_over_plain_P1"]
    ratios += ["dispatch_over_plain_P1", "hooks_over_serial_P1", "dispatch_over_hooks_cpu_P2"]
    ratios += ["graph_over_dispatch_P1", "graph_over_dispatch_P2"]
    for key in ratios:
        assert r[key] > 0, key
    assert r["max_force_error"] <= 1e-13 and isinstance(r["dispatch_target_met"], bool)


def _overhead_with_other_weights(opts):
    """Planted bug: the dispatch leg's plain model does not get the hooks model's weights."""
    from twinshard.bench import atoms_overhead

    original = atoms_overhead._models

    def models(o):
        hooks, plain = original(o)
        with torch.no_grad():
            plain.layers[0].message["weight"].mul_(1.01)
        return hooks, plain

    atoms_overhead._models = models
    try:
        return atoms_overhead.overhead_rank(opts)
    finally:  # the pool's workers are reused: leave no patch behind
        atoms_overhead._models = original


def test_bench_atoms_overhead_catches_legs_that_differ():
    """Negative control: legs running different weights are refused (their ratio means nothing)."""
    opts = dict(potential="mpnn", model=None, atoms=32, seed=0, skin=1.0, repeats=0, stress=False)
    run = run_on_world(_overhead_with_other_weights, 1, opts)[0]
    with pytest.raises(ValueError, match="leg disagrees with the serial plain model .* not comparable"):
        check_agreement(run, run.pop("reference"))
