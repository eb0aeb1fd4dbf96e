"""Precision modes (``twinshard.pair.precision``, issue 21 s. 1): accuracy per mode beside the serial
module's own, and the mode agreed across ranks.

``test_accuracy_per_mode`` (Pairformer stack, one layer, N = 8, c = 8, 2x2; every mode but fp64):
the fp64 weights and inputs are rounded once to the mode, serial and twin run forward and backward
in it, and each result (outputs s and z, input gradients, every parameter gradient) is compared
with the fp64 serial result, ``e = max |y - y64| / max |y64|``. The gate is
``e_twin <= FACTOR * max(e_serial, FLOOR_mode)``.

Derivation of FACTOR and FLOOR. The twin performs the serial module's roundings in the same dtypes
at the same steps (``test_dtype_paths``: every submodule receives the serial module's dtype, every
fp32 region is kept); what the partition adds is only the order of the >= fp32 sums it splits
(each contraction over k in R or C partials plus one sum of partials; the online softmax's C
rescalings; parameter gradients as P per-rank partials plus one all-reduce): at most R + C + log2 P
<= 6 extra fp32 roundings per quantity on 2x2, each u32 = 2^-24 relative, i.e. <= 4e-7, below
the serial fp32 errors measured (1e-7 - 1.5e-6) and 1e4 below the bf16 ones (5e-3 - 4e-2). A
changed sum order does move the fp32 (and, in bf16 modes, the bf16) roundings that follow it,
so the twin's error is a second realisation of the same rounding process, not a copy of the
serial one: both are bounded by the same forward-error bound, and their realised maxima differ
by chance. Two realisations of a max over tens to hundreds of entries of such errors differ by
up to ~3x (measured: fp32 0.8x median, max 2.9x, proj_v.weight 6.9e-7 vs 2.4e-7; bf16 1.0x
median, max 1.7x; bf16-mixed 1.0x median, max 3.2x, pre_norm_s.weight 1.9e-2 vs 6.0e-3);
FACTOR = 4 is that spread plus the <= 6 extra fp32 roundings (<= 1.1x on the smallest fp32 error
here). FLOOR = 4 u of the mode's narrowest storage dtype (u = 2^-24 fp32/tf32, 2^-8 bf16): a
quantity with only a few roundings moves by ~2x either way by chance. A cast to bf16 in an fp32
run (~2^-8, 1e4 above the budget) or a softmax in bf16 in a bf16-mixed run (its fp32 region
lost: the logits' rounding, up to |logit| 2^-8, enters every probability) lands far outside it.

Parameter gradients zero in exact arithmetic (the LayerNorm bias in front of the pair-bias
softmax) have no relative error and are left out (``bench.precision.compare``).
"""

from __future__ import annotations

import pytest
import torch

from twinshard.bench import precision as B
from twinshard.pair.precision import MODES, dtype_default, precision
from twinshard.testing import run_on_grid

FACTOR = 4.0
U = {"fp32": 2.0**-24, "tf32": 2.0**-24, "bf16": 2.0**-8, "bf16-mixed": 2.0**-8}
GRID = (2, 2)
RUN_MODES = ["fp32", "tf32", "bf16", "bf16-mixed"]


@pytest.fixture(scope="module")
def twin_runs():
    return run_on_grid(B.twin_rank, GRID, dict(B.CONFIG), RUN_MODES)


@pytest.mark.parametrize("mode", RUN_MODES)
def test_accuracy_per_mode(mode, twin_runs):
    cfg = dict(B.CONFIG)
    truth = B.serial_run(cfg, "fp64")
    serial = B.serial_run(cfg, mode)
    for rank, r in enumerate(twin_runs):  # replicated results: every rank's copy checked
        assert set(r[mode]["results"]) == set(serial), f"rank {rank}: quantities differ"
    errs = B.compare(truth, serial, twin_runs[0][mode]["results"])
    floor = 4 * U[mode]
    worse, lines = [], []
    for k, (es, et) in sorted(errs.items()):
        assert es > 0 or mode == "fp64", f"{mode}: {k}: serial error 0 (the mode did not apply)"
        lines.append(f"{k}: serial {es:.2e} twin {et:.2e}")
        if et > FACTOR * max(es, floor):
            worse.append(f"{k}: twin {et:.2e} vs serial {es:.2e} ({et / es:.1f}x)")
    print(f"[precision {mode} {GRID[0]}x{GRID[1]}] " + "; ".join(lines[:4]))  # noqa: T201
    assert not worse, (
        f"{mode} on {GRID[0]}x{GRID[1]}: the twin less accurate than the serial module by more than "
        f"{FACTOR}x (floor {floor:.1e}): " + "; ".join(worse)
    )
    for other in twin_runs[1:]:
        for k, v in other[mode]["results"].items():
            assert torch.equal(v, twin_runs[0][mode]["results"][k]), f"{mode}: {k} not replicated"


def _mixed_modes(grid):
    """The last rank asks for another mode: every rank raises the same error, before any buffer."""
    mode = "bf16-mixed" if grid.rank == grid.size - 1 else "fp32"
    try:
        with precision(mode).scope(what="test"):
            pass
    except ValueError as e:
        return str(e)
    return None


def _autocast_on_one_rank(grid):
    """Every rank asks for fp32 but one entered torch.autocast on its own: raises everywhere."""
    ctx = (
        torch.autocast("cpu", dtype=torch.bfloat16)
        if grid.rank == 0
        else torch.autocast("cpu", enabled=False)
    )
    try:
        with ctx, precision("fp32").scope(what="test"):
            pass
    except ValueError as e:
        return str(e)
    return None


@pytest.mark.parametrize("body", [_mixed_modes, _autocast_on_one_rank], ids=["mode", "autocast"])
def test_a_rank_in_another_mode_raises_everywhere(body):
    msgs = run_on_grid(body, (1, 2))
    assert all(m is not None for m in msgs), msgs
    assert len(set(msgs)) == 1, msgs
    assert "precision" in msgs[0] or "autocast" in msgs[0], msgs[0]


def test_modes_table():
    assert MODES == ("fp64", "fp32", "tf32", "bf16", "bf16-mixed")
    assert precision("bf16-mixed").param_dtype == torch.float32
    assert precision("bf16-mixed").autocast_dtype == torch.bfloat16
    assert precision("bf16").param_dtype == precision("bf16").activation_dtype == torch.bfloat16
    assert precision("tf32").tf32 and not precision("fp32").tf32
    assert dtype_default("float64", None, "fp32").name == "fp64"
    assert dtype_default(None, None, "fp32").name == "fp32"
    assert dtype_default(None, "bf16-mixed", "fp32").name == "bf16-mixed"
    with pytest.raises(ValueError, match="contradicts"):
        dtype_default("float64", "bf16", "fp32")
    with pytest.raises(ValueError, match="one of"):
        precision("fp8")
    with torch.autocast("cpu", enabled=False), precision("bf16-mixed").scope(agree=False):
        assert torch.is_autocast_enabled("cpu")
        assert torch.get_autocast_dtype("cpu") == torch.bfloat16
