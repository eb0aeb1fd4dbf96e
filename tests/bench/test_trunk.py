"""``twinshard trunk``: the random-weight CP Boltz-2 trunk (default) or Pairformer stack
(``--pairformer-only``, ``--train-step``) against serial, measured (small N).

- ``test_whole_trunk_json_matches_serial``: the whole trunk (input embedder with atoms, pair init,
  templates, MSA module, Pairformer, distogram) on the synthetic complex, 2x2 grid, N = 10, fp64,
  with and without a recycling step: ``s_inputs``, ``s``, ``z``, ``pdistogram``, the gradient of
  ``ref_pos`` and every parameter gradient equal the serial ``Boltz2Trunk``'s at fp64 round-off;
  the JSON carries ``twinshard bench pair``'s keys, per-rank memory and ledger bytes (per op too),
  and each new collective's ledger bytes equal its stated model (the contraction's: at most it).
- ``test_pairformer_only_json_matches_serial`` (``--pairformer-only``): on a 2x2 grid with uneven N (padding) the CP stack's output,
  input gradients and every parameter gradient equal the serial stack's at fp64 round-off (with and
  without activation checkpointing), and the JSON carries the keys of ``twinshard bench pair``
  plus ``layers``, per-rank memory (tensors and resident), saved and ledger bytes, all positive.
- ``test_trunk_train_step_matches_serial``: ``--train-step`` (stack, distogram loss, backward,
  AdamW; Boltz dropout) on 2x2 with uneven N: the loss and every weight after the update equal
  the serial step's at fp64 round-off.
- ``test_trunk_option_errors``: a bad grid or width ends with a one-line error (exit 2), no
  traceback.
"""

from __future__ import annotations

import json
import math

import pytest

from twinshard.cli import main

BENCH_PAIR_KEYS = {
    "op",
    "grid",
    "tokens",
    "dtype",
    "padded_tokens",
    "channels",
    "hidden",
    "sequences",
    "batch",
    "schedule",
    "max_abs_error_out",
    "max_abs_error_grad_inputs",
    "max_abs_error_grad_params",
    "saved_bytes_per_rank",
    "serial_saved_bytes",
    "saved_ratio_vs_serial_over_p",
    "peak_memory_bytes_per_rank",
    "serial_peak_memory_bytes",
    "peak_rss_bytes_per_rank",
    "rss_reset_per_rank",
    "rss_source",
    "serial_peak_rss_bytes",
    "comm_bytes_model",
    "comm_bytes_per_rank",
    "comm_bytes_sent_per_rank",
    "comm_bytes_recv_per_rank",
    "comm_backward_bytes_per_rank",
    "comm_lower_bound_bytes",
    "comm_ratio_vs_lower_bound",
    "seconds_per_rank",
    "serial_seconds",
}
SMALL = [
    "--single-channels",
    "8",
    "--pair-channels",
    "4",
    "--heads",
    "2",
    "--pair-head-width",
    "2",
    "--pair-heads",
    "2",
]


@pytest.mark.parametrize("checkpointing", [False, True], ids=["plain", "checkpointed"])
def test_pairformer_only_json_matches_serial(checkpointing, capsys):
    argv = [
        "trunk",
        "--pairformer-only",
        "--tokens",
        "7",
        "--grid",
        "2x2",
        "--layers",
        "2",
        "--check-serial",
        "--dtype",
        "float64",
    ]
    argv += SMALL + ["--json"] + (["--checkpointing"] if checkpointing else [])
    assert main(argv) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert BENCH_PAIR_KEYS <= set(out), sorted(BENCH_PAIR_KEYS - set(out))
    assert out["op"] == "pairformer" and out["layers"] == 2 and out["padded_tokens"] == [8, 8]
    assert out["checkpointing"] is checkpointing
    scale = out["reference_max_abs_out"]
    assert scale > 0.1
    for k in ("max_abs_error_out", "max_abs_error_grad_inputs"):
        assert out[k] < 1e-12 * scale, (k, out[k])
    assert out["max_abs_error_grad_params"] < 1e-11 * scale  # sums over every pair entry
    for k in (
        "saved_bytes_per_rank",
        "peak_memory_bytes_per_rank",
        "peak_rss_bytes_per_rank",
        "ledger_bytes_per_rank",
    ):
        assert len(out[k]) == 4 and all(v > 0 for v in out[k]), (k, out[k])
    assert out["serial_saved_bytes"] > 0 and out["serial_peak_memory_bytes"] > 0


def test_trunk_train_step_matches_serial(capsys):
    argv = ["trunk", "--tokens", "7", "--grid", "2x2", "--layers", "2", "--train-step", "--check-serial"]
    assert main(argv + ["--dtype", "float64", *SMALL, "--json"]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert BENCH_PAIR_KEYS <= set(out) and out["train_step"] is True and out["layers"] == 2
    assert out["max_abs_error_out"] < 1e-13 * out["reference_max_abs_out"]  # the loss
    assert out["max_abs_error_grad_params"] < 1e-13  # weights after the AdamW update (lr 1e-3)
    assert all(v > 0 for v in out["peak_memory_bytes_per_rank"] + out["ledger_bytes_per_rank"])


@pytest.mark.parametrize("mode", ["bf16-mixed", "bf16"])
@pytest.mark.parametrize("what", ["--pairformer-only", "--train-step", "whole"])
def test_trunk_precision_modes(what, mode, capsys):
    """``--precision`` reaches every mode of the command: the JSON names it and its parameter dtype,
    the CP run and the serial check in the same mode both ran and report finite errors (fp64 is
    the parity mode; the bf16 figures are reported, not gated)."""
    extra = [] if what == "whole" else [what, "--layers", "1"]
    argv = ["trunk", "--tokens", "7", "--grid", "2x2", "--check-serial", "--precision", mode, "--json"]
    assert main(argv + (TRUNK_SMALL if what == "whole" else SMALL) + extra) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out["precision"] == mode and out["dtype"] == ("bfloat16" if mode == "bf16" else "float32")
    err = out["max_abs_error_out"] if "max_abs_error_out" in out else out["errors"]["s"]["max_abs"]
    assert err is not None and math.isfinite(err), err


@pytest.mark.parametrize(
    "extra,message",
    [
        (["--grid", "2by2"], "grid must look like"),
        (["--single-channels", "6", "--heads", "4"], "multiple of --heads"),
        (["--single-channels", "6", "--heads", "4", "--pairformer-only"], "multiple of --heads"),
        (["--atoms-per-token", "30"], "at most 24"),
        (["--msa", "0"], "--msa must be an integer >= 1"),
        (["--dtype", "float64", "--precision", "bf16"], "contradicts --precision bf16"),
    ],
)
def test_trunk_option_errors(extra, message, capsys):
    assert main(["trunk", "--tokens", "5", *extra]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


TRUNK_SMALL = [
    *SMALL,
    "--atom-channels",
    "4",
    "--atom-pair-channels",
    "2",
    "--msa-channels",
    "4",
    "--template-channels",
    "4",
    "--bins",
    "8",
    "--atom-heads",
    "2",
    "--msa-heads",
    "2",
    "--msa-head-width",
    "2",
    "--opm-hidden",
    "2",
    "--atoms-per-token",
    "4",
    "--msa",
    "3",
    "--layers",
    "1",
]
EXACT_MODELS = (
    "embed:halo",
    "z_init:columns",
    "relpos:columns",
    "msa:s_proj",
    "msa:token_mask",
    "template:columns",
    "template:counted",
)


@pytest.mark.parametrize("recycling", [0, 1])
def test_whole_trunk_json_matches_serial(recycling, capsys):
    argv = ["trunk", "--tokens", "10", "--grid", "2x2", "--check-serial", "--json", "--dtype", "float64"]
    assert main(argv + TRUNK_SMALL + ["--recycling", str(recycling)]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert BENCH_PAIR_KEYS <= set(out), sorted(BENCH_PAIR_KEYS - set(out))
    assert out["op"] == "trunk" and out["recycling"] == recycling and out["templates"] == 2
    assert out["padded_tokens"] == [10, 10] and out["atoms"] >= 10
    assert set(out["max_abs_error_out_by_output"]) == {"s_inputs", "s", "z", "pdistogram"}
    for err, scale in (
        ("max_abs_error_out", "reference_max_abs_out"),
        ("max_abs_error_grad_inputs", "reference_max_abs_grad_inputs"),
        ("max_abs_error_grad_params", "reference_max_abs_grad_params"),
    ):
        assert out[scale] > 0.1, (scale, out[scale])
        assert out[err] < 1e-12 * out[scale], (err, out[err], out[scale])
    for k in (
        "saved_bytes_per_rank",
        "peak_memory_bytes_per_rank",
        "peak_rss_bytes_per_rank",
        "ledger_bytes_per_rank",
    ):
        assert len(out[k]) == 4 and all(v > 0 for v in out[k]), (k, out[k])
    assert out["serial_saved_bytes"] > 0 and out["serial_peak_memory_bytes"] > 0
    assert out["ledger_forward_by_op"]["embed:halo"]["calls"] == [2, 2, 2, 2]  # static + 1 layer
    models = out["model_bytes"]
    for name in EXACT_MODELS:
        assert models[name]["ledger_recv_bytes"] == models[name]["model_bytes"], (name, models[name])
    assert max(models["embed:halo"]["model_bytes"]) > 0
    pwa = models["pwa (contraction)"]
    assert all(0 < g <= m for g, m in zip(pwa["ledger_recv_bytes"], pwa["model_bytes"])), pwa
