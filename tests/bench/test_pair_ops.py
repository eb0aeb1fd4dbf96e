"""``twinshard bench pair --op triattn-start|triattn-end|attn-pair-bias|pairformer`` and the
memory/bytes plot (tiny sizes; the figures are measured by the CLI, not here).

- ``test_trunk_ops_match_serial_and_measure``: on a 2x2 grid with uneven N (padding) each op's
  output, input gradients and every parameter gradient equal serial at fp64 round-off, and the
  per-rank figures are there: saved bytes below serial's, tensor and resident peaks and ledger
  bytes (forward and backward) positive.
- ``test_ops_registered``: ``bench pair`` accepts the new ops.
- ``test_plot_memory_and_bytes``: the plot is written for results on 1x1 and 2x2.
- ``test_bench_pair_trunk_op``: ``--op trunk --tokens 8,10 --grid 2x2`` (the whole Boltz-2 trunk,
  fp64, small widths) prints one JSON object with a run and a ratio row per N (peak and saved per
  rank / (serial / P)), errors at round-off, per-op ledger bytes beside the byte models, and the
  memory-against-N plot; several ``--tokens`` values with another op are a clear error.
"""

from __future__ import annotations

import pytest

from twinshard.bench.pair import OPS, add_parser
from twinshard.bench.pair_ops import TRUNK_OPS, bench_rank_op, plot_memory_and_bytes
from twinshard.testing import run_on_grid


def _rank_ops(grid, n):
    return {op: bench_rank_op(op, n, tuple(grid.shape), "float64", 4, 2, 6, 1, 0) for op in TRUNK_OPS}


def test_trunk_ops_match_serial_and_measure():
    ranks = run_on_grid(_rank_ops, (2, 2), 7, timeout=900)
    for op in TRUNK_OPS:
        rs = [r[op] for r in ranks]
        for r in rs:
            assert r["padded_tokens"] == [8, 8]
            assert max(r["err_out"], r["err_in"]) < 1e-12, (op, r["err_out"], r["err_in"])
            assert r["err_par"] < 1e-11, (op, r["err_par"])  # sums over every pair entry
            assert 0 < r["saved"] < r["serial_saved"], (op, r["saved"], r["serial_saved"])
            assert r["peak"] > 0 and r["rss_peak"] > 0 and r["comm_fwd"] > 0 and r["comm_bwd"] > 0, op


def test_ops_registered():
    import argparse

    parser = argparse.ArgumentParser()
    add_parser(parser.add_subparsers())
    for op in TRUNK_OPS:
        assert op in OPS
        assert parser.parse_args(["pair", "--op", op]).op == op


def _fake(grid: str, p: int) -> dict:
    return {
        "op": "pairformer",
        "grid": grid,
        "tokens": 8,
        "channels": 4,
        "hidden": 2,
        "dtype": "float64",
        "saved_bytes_per_rank": [1000 // p] * p,
        "peak_memory_bytes_per_rank": [2000 // p] * p,
        "serial_saved_bytes": 1000,
        "serial_peak_memory_bytes": 2000,
        "comm_bytes_per_rank": [0 if p == 1 else 300] * p,
        "comm_backward_bytes_per_rank": [0 if p == 1 else 600] * p,
        "comm_lower_bound_bytes": 100.0,
    }


def test_plot_memory_and_bytes(tmp_path):
    pytest.importorskip("matplotlib")
    path = tmp_path / "mem.png"
    plot_memory_and_bytes([_fake("2x2", 4), _fake("1x1", 1)], str(path))
    assert path.stat().st_size > 1000


TRUNK_SMALL = (
    "--single-channels 8 --pair-channels 4 --heads 2 --pair-head-width 2 --pair-heads 2 --atom-channels 4 "
    "--atom-pair-channels 2 --msa-channels 4 --template-channels 4 --bins 8 --msa-heads 2 --msa-head-width 2 "
    "--opm-hidden 2 --atoms-per-token 4 --sequences 3 --layers 1"
).split()


def test_bench_pair_trunk_op(tmp_path, capsys):
    import json

    from twinshard.cli import main

    plot = tmp_path / "trunk.png"
    argv = ["bench", "pair", "--op", "trunk", "--tokens", "8,10", "--grid", "2x2", "--json"]
    assert main(argv + TRUNK_SMALL + ["--plot", str(plot)]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out["op"] == "trunk" and [r["tokens"] for r in out["runs"]] == [8, 10]
    assert [(r["tokens"], r["grid"]) for r in out["ratios"]] == [(8, "2x2"), (10, "2x2")]
    for run, row in zip(out["runs"], out["ratios"]):
        assert run["dtype"] == "float64" and run["sequences"] == 3
        assert run["max_abs_error_out"] < 1e-12 * run["reference_max_abs_out"]
        assert run["max_abs_error_grad_params"] < 1e-12 * run["reference_max_abs_grad_params"]
        assert row["peak_ratio_vs_serial_over_p"] > 0 and row["saved_ratio_vs_serial_over_p"] > 0
        assert (
            run["model_bytes"]["msa:s_proj"]["model_bytes"]
            == run["model_bytes"]["msa:s_proj"]["ledger_recv_bytes"]
        )
        assert "tri_attn:ring" in run["ledger_forward_by_op"]
    if out["plot"]:
        assert plot.stat().st_size > 1000


def test_several_tokens_only_with_trunk():
    import argparse

    from twinshard.bench import pair as bench_pair

    parser = argparse.ArgumentParser()
    add_parser(parser.add_subparsers())
    with pytest.raises(ValueError, match="only with --op trunk"):
        bench_pair.run(parser.parse_args(["pair", "--op", "opm", "--tokens", "6,8"]))


def test_bench_pair_predict_op(capsys):
    """``--op predict``: the whole Boltz-2 inference forward (fp64, small widths) on 2x2 prints one
    JSON object: per-rank peaks beside serial, the ratio, and the errors against serial at round-off."""
    import json

    from twinshard.cli import main

    small = [a if a != "8" or TRUNK_SMALL[i - 1] != "--bins" else "64" for i, a in enumerate(TRUNK_SMALL)]
    argv = ["bench", "pair", "--op", "predict", "--tokens", "10", "--grid", "2x2", "--json"]
    assert main(argv + small + ["--diffusion-samples", "2"]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    (run,) = out["runs"]
    assert out["op"] == "predict" and run["grid"] == "2x2" and run["diffusion_samples"] == 2
    assert len(run["peak_memory_bytes_per_rank"]) == 4 and run["peak_ratio_vs_serial_over_p"] > 0
    for k, e in run["errors"].items():
        assert e["max_abs"] <= 1e-11 * max(e["ref_scale"], 1.0), (k, e)


def test_bench_pair_train_op(capsys):
    """``--op train``: one whole-model training step (fp64, small widths) on 2x2 prints one JSON
    object: per-rank peaks beside serial, the ratio, and the loss and updated weights against serial."""
    import json

    from twinshard.cli import main

    small = [a if a != "8" or TRUNK_SMALL[i - 1] != "--bins" else "64" for i, a in enumerate(TRUNK_SMALL)]
    argv = ["bench", "pair", "--op", "train", "--tokens", "10", "--grid", "2x2", "--json"]
    assert main(argv + small + ["--diffusion-samples", "2", "--sampling-steps", "2"]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    (run,) = out["runs"]
    assert out["op"] == "train" and run["grid"] == "2x2" and run["multiplicity_diffusion_train"] == 2
    assert len(run["peak_memory_bytes_per_rank"]) == 4 and run["peak_ratio_vs_serial_over_p"] > 0
    for k, e in run["errors"].items():
        assert e["max_abs"] <= 1e-11 * max(e["ref_scale"], 1.0), (k, e)
