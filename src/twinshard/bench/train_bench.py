"""``twinshard bench pair --op train``: one whole-model Boltz-2 training step's memory per rank.

For every N of ``--tokens`` and every grid of ``--grid``, the CP model (``CPBoltz2Model``) and the
serial ``Boltz2Model`` (rank 0, the same weights; the model of ``--op predict``) run one
:class:`~twinshard.pair.train_boltz2.Boltz2Training` step (training forward with
``--diffusion-samples`` as ``multiplicity_diffusion_train``, ``--sampling-steps`` for the
confidence inputs' sample, losses, backward, AdamW, EMA) on the synthetic complex with
``synthetic_training_features``. The losses: Boltz-2's three (``LossHooks.default``: the
distogram loss, the diffusion loss with its weighted rigid alignment and smooth lDDT, the
confidence losses with PAE), so every module runs its backward. Measured: the
profiler's tensor peak per rank beside the serial's over the whole step, the wall time of each,
the loss and the updated weights' errors against serial. The last stdout line is one JSON object
``{"op": "train", "runs": [...]}`` with ``peak_ratio_vs_serial_over_p``.
"""

from __future__ import annotations

import argparse
import json
import os
from typing import Any

from twinshard.runtime import reports, run_ranks

__all__ = ["run_train_bench", "train_rank"]


def train_rank(
    tokens: int,
    grid_shape: tuple[int, int],
    o: dict[str, Any],
    dtype_name: str,
    steps: int,
    samples: int,
    seed: int,
) -> dict[str, Any]:
    """Run on every rank of a world of rows x cols ranks; returns this rank's figures."""
    import time

    from twinshard.bench.predict_bench import rank_models
    from twinshard.memory import peak_memory_during
    from twinshard.pair.features import distribute
    from twinshard.pair.synthetic import synthetic_training_features
    from twinshard.pair.train_boltz2 import Boltz2Training, LossHooks, TrainingArgs

    grid, device, dtype, serial, cp, feats = rank_models(tokens, grid_shape, o, dtype_name, seed)
    feats.update(synthetic_training_features(feats, seed=seed))
    feats["frames_idx"], feats["frame_resolved_mask"] = (
        feats["frames_idx"][:, 0],
        feats["frame_resolved_mask"][:, 0],
    )
    feats["coords"] = feats["coords"].to(dtype)
    feats = {k: v.to(device) for k, v in feats.items()}
    fd = distribute(feats, grid)
    args = TrainingArgs(
        recycling_steps=o["recycling"],
        sampling_steps=steps,
        diffusion_multiplicity=samples,
        diffusion_samples=1,
        diffusion_loss_weight=1.0,
        distogram_loss_weight=1.0,
        confidence_loss_weight=1.0,
        alpha_pae=1.0,
        weight_decay=0.01,
        weight_decay_exclude=True,
    )
    run = Boltz2Training(cp, args, seed=seed, losses=LossHooks.default(cp))
    t0 = time.perf_counter()
    got, peak = peak_memory_during(lambda: run.step(fd), device)
    mine: dict[str, Any] = {"peak": peak, "seconds": time.perf_counter() - t0, "atoms": fd.layout.n_atoms}
    loss = float(got["loss"])
    params = {n: p.detach().clone() for n, p in cp.named_parameters()}
    del got
    if grid.rank != 0:
        return mine
    serial = serial.to(device)
    srun = Boltz2Training(serial, args, seed=seed, losses=LossHooks.default(serial))
    t0 = time.perf_counter()
    ref, speak = peak_memory_during(lambda: srun.step(feats), device)
    mine["serial_seconds"] = time.perf_counter() - t0
    mine["serial_peak"] = speak
    mine["errors"] = {
        "loss": {"max_abs": abs(loss - float(ref["loss"])), "ref_scale": abs(float(ref["loss"]))},
        "updated_weights": {
            "max_abs": max(float((params[n] - p.detach()).abs().max()) for n, p in serial.named_parameters()),
            "ref_scale": max(float(p.detach().abs().max()) for p in serial.parameters()),
        },
    }
    return mine


def run_train_bench(
    args: argparse.Namespace, shapes: list[tuple[int, int]], tokens: list[int]
) -> dict[str, Any]:
    from twinshard.bench import whole_trunk as W

    o = W.options(args, msa=args.sequences)
    steps = int(getattr(args, "sampling_steps", 3))
    samples = int(getattr(args, "diffusion_samples", 1))
    runs = []
    for n in tokens:
        for shape in shapes:
            nranks = shape[0] * shape[1]
            call = (n, shape, o, args.dtype, steps, samples, args.seed)
            ranks = run_ranks(
                train_rank, nranks, *call, option="--grid", deadline=float(getattr(args, "timeout", 3600.0))
            )
            if not reports():
                continue
            r0 = ranks[0]
            peaks = [r["peak"] for r in ranks]
            runs.append(
                {
                    "tokens": n,
                    "grid": f"{shape[0]}x{shape[1]}",
                    "dtype": args.dtype,
                    "atoms": r0["atoms"],
                    "sampling_steps": steps,
                    "multiplicity_diffusion_train": samples,
                    "recycling": o["recycling"],
                    "peak_memory_bytes_per_rank": peaks,
                    "serial_peak_memory_bytes": r0["serial_peak"],
                    "peak_ratio_vs_serial_over_p": max(peaks) / (r0["serial_peak"] / nranks),
                    "seconds_per_rank": [r["seconds"] for r in ranks],
                    "serial_seconds": r0["serial_seconds"],
                    "errors": r0["errors"],
                    "threads_per_rank": int(os.environ.get("OMP_NUM_THREADS", "0") or 0) or None,
                }
            )
    if not reports():
        return {}
    out = {"op": "train", "runs": runs}
    if not getattr(args, "json", False):
        for r in runs:
            keys = (
                "tokens",
                "grid",
                "atoms",
                "peak_ratio_vs_serial_over_p",
                "seconds_per_rank",
                "serial_seconds",
            )
            print(" ".join(f"{k}={r[k]}" for k in keys))
    print(json.dumps(out))
    return out
