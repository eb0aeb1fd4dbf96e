"""``twinshard bench pair --op predict``: the whole Boltz-2 inference forward's memory per rank.

For every N of ``--tokens N,N,...`` and every grid of ``--grid``, the CP model
(``twinshard.pair.layers.model.CPBoltz2Model``: trunk, diffusion conditioning, sampler,
distogram, confidence) and the serial ``Boltz2Model`` (rank 0, the same weights) run the inference
forward (``model.eval()``, no gradients, as ``Boltz2.forward`` in evaluation mode) on the
synthetic complex of that size (the trunk's options of ``twinshard bench pair --op trunk``; the
score model and the confidence module at small fixed widths: 1 atom-encoder, token-transformer and
atom-decoder layer of 2 heads, a 1-block confidence Pairformer), with ``--sampling-steps`` steps
and ``--diffusion-samples`` samples drawn from the counter-based source of ``--seed``. Measured:
the profiler's tensor peak per rank beside the serial's, the wall time of each, and the errors of
the coordinates, pLDDT, PAE, pTM and ipTM against serial. The last stdout line is one JSON object
``{"op": "predict", "runs": [...]}``, each run with ``peak_ratio_vs_serial_over_p`` (the largest
rank's peak over serial / P).
"""

from __future__ import annotations

import argparse
import json
import os
from typing import Any

import torch

from twinshard.runtime import reports, run_ranks

__all__ = ["model_config", "predict_rank", "run_predict_bench"]

FIGURES = ("ptm", "iptm", "complex_plddt")


def model_config(o: dict[str, Any]) -> Any:
    """The ``ModelConfig`` of a run: the trunk of ``whole_trunk.trunk_config(o)``, a small score
    model and confidence module, ``boltz predict``'s Boltz-2 sampler parameters."""
    from twinshard.bench.whole_trunk import trunk_config
    from twinshard.pair.reference.model import ModelConfig
    from twinshard.pair.reference.sampler import BOLTZ2_DIFFUSION_PARAMS

    if o["bins"] != 64:
        raise ValueError(
            f"--op predict needs --bins 64 (the confidence module reads 64 distogram bins), got {o['bins']}"
        )
    pair = {"pairwise_head_width": o["pair_head_width"], "pairwise_num_heads": o["pair_heads"]}
    return ModelConfig(
        trunk=trunk_config(o),
        score_model_args={
            "sigma_data": 16,
            "dim_fourier": 16,
            "atom_encoder_depth": 1,
            "atom_encoder_heads": 2,
            "token_transformer_depth": 1,
            "token_transformer_heads": 2,
            "atom_decoder_depth": 1,
            "atom_decoder_heads": 2,
            "conditioning_transition_layers": 1,
        },
        diffusion_process_args=dict(BOLTZ2_DIFFUSION_PARAMS),
        confidence_model_args={
            "pairformer_args": {"num_blocks": 1, "num_heads": o["heads"], "dropout": 0.0, **pair},
            "num_dist_bins": 64,
            "max_dist": 22,
            "add_s_to_z_prod": True,
            "add_s_input_to_s": True,
            "add_z_input_to_z": True,
            "confidence_args": {
                "num_plddt_bins": 50,
                "num_pde_bins": 64,
                "num_pae_bins": 64,
                "use_separate_heads": True,
            },
        },
    )


def _features(tokens: int, o: dict[str, Any], dtype: torch.dtype, seed: int) -> dict[str, torch.Tensor]:
    """The trunk bench's synthetic complex plus ``frames_idx`` (each token's first, middle and last atom)."""
    from twinshard.bench.whole_trunk import features

    f = features(tokens, o, dtype, seed)
    a2t = f["atom_to_token"]
    b, a, n = a2t.shape
    idx = torch.arange(a)[None, :, None].expand(b, a, n)
    has = a2t > 0
    big = torch.full_like(idx, a)
    first = torch.where(has, idx, big).min(1).values
    last = torch.where(has, idx, torch.full_like(idx, -1)).max(1).values
    count = has.sum(1)
    mid = first + count // 2
    frames = torch.stack([first, mid, last], -1)
    f["frames_idx"] = torch.where((count > 0)[..., None], frames, torch.zeros_like(frames))
    return f


def build_model(cls: type, config: Any, dtype: torch.dtype, seed: int) -> torch.nn.Module:
    """``cls(config)`` (``Boltz2Model`` or ``CPBoltz2Model``) with random weights from ``seed``, the
    same on every rank and for both classes (every parameter + 0.1 N(0, 1): zero inits would leave
    parts idle), in eval mode."""
    torch.manual_seed(seed + 1)
    m = cls(config).to(dtype)
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for _, p in sorted(m.named_parameters()):
            p.add_(0.1 * torch.randn(p.shape, generator=g, dtype=torch.float64).to(dtype))
    return m.eval()


def rank_models(tokens: int, grid_shape: tuple[int, int], o: dict[str, Any], dtype_name: str, seed: int):
    """A bench rank's set-up: ``(grid, device, dtype, serial, cp, feats)``: the grid, the serial
    model and its CP twin with the same random weights (the twin on the world's device), and the
    synthetic complex's features (on the CPU)."""
    from twinshard.pair.layers.model import CPBoltz2Model
    from twinshard.pair.reference.model import Boltz2Model
    from twinshard.runtime import get_world, make_grid

    dtype = getattr(torch, dtype_name)
    grid = make_grid(tuple(grid_shape))
    device = get_world().device
    serial = build_model(Boltz2Model, model_config(o), dtype, seed)
    cp = CPBoltz2Model(model_config(o)).to(dtype)
    cp.load_state_dict(serial.state_dict())
    return grid, device, dtype, serial, cp.eval().to(device), _features(tokens, o, dtype, seed)


def predict_rank(
    tokens: int,
    grid_shape: tuple[int, int],
    o: dict[str, Any],
    dtype_name: str,
    steps: int,
    samples: int,
    seed: int,
    check_serial: bool,
) -> dict[str, Any]:
    """Run on every rank of a world of rows x cols ranks; returns this rank's figures."""
    import time

    from twinshard.memory import peak_memory_during
    from twinshard.pair.features import collect_tensor, distribute

    grid, device, dtype, serial, cp, feats = rank_models(tokens, grid_shape, o, dtype_name, seed)
    feats = {k: v.to(device) for k, v in feats.items()}
    fd = distribute(feats, grid)
    keep = check_serial and grid.rank == 0
    if not keep:
        feats = {}
    kw = dict(recycling_steps=o["recycling"], num_sampling_steps=steps, diffusion_samples=samples, seed=seed)

    def cp_run() -> Any:
        with torch.no_grad():
            return cp(fd, **kw)

    t0 = time.perf_counter()
    out, peak = peak_memory_during(cp_run, device)
    mine: dict[str, Any] = {
        "peak": peak,
        "seconds": time.perf_counter() - t0,
        "atoms": fd.layout.n_atoms,
        "padded_tokens": list(fd.layout.padded),
    }
    got = {k: collect_tensor(out[k]) for k in ("sample_atom_coords", "plddt", "pae")}
    got.update({k: out[k] for k in FIGURES})
    del out
    if not keep:
        return mine
    serial = serial.to(device)

    def ser_run() -> Any:
        with torch.no_grad():
            return serial(feats, **kw)

    t0 = time.perf_counter()
    ref, speak = peak_memory_during(ser_run, device)
    mine["serial_seconds"] = time.perf_counter() - t0
    mine["serial_peak"] = speak
    mine["errors"] = {
        k: {
            "max_abs": (got[k].double() - ref[k].double()).abs().max().item(),
            "ref_scale": ref[k].double().abs().max().item(),
        }
        for k in got
    }
    return mine


def run_predict_bench(
    args: argparse.Namespace, shapes: list[tuple[int, int]], tokens: list[int]
) -> dict[str, Any]:
    from twinshard.bench import whole_trunk as W

    o = W.options(args, msa=args.sequences)
    steps = int(getattr(args, "sampling_steps", 3))
    samples = int(getattr(args, "diffusion_samples", 1))
    if steps < 2 or samples < 1:
        raise ValueError("--sampling-steps must be >= 2 and --diffusion-samples >= 1")
    runs = []
    for n in tokens:
        for shape in shapes:
            nranks = shape[0] * shape[1]
            call = (n, shape, o, args.dtype, steps, samples, args.seed, True)
            t = float(getattr(args, "timeout", 3600.0))
            ranks = run_ranks(predict_rank, nranks, *call, option="--grid", deadline=t)
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
                    "padded_tokens": r0["padded_tokens"],
                    "sampling_steps": steps,
                    "diffusion_samples": samples,
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
    out = {"op": "predict", "runs": runs}
    if not getattr(args, "json", False):
        for r in runs:
            keys = ("tokens", "grid", "atoms", "peak_ratio_vs_serial_over_p", "serial_peak_memory_bytes")
            print(" ".join(f"{k}={r[k]}" for k in keys))
    print(json.dumps(out))
    return out
