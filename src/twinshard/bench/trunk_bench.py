"""``twinshard bench pair --op trunk``: the whole Boltz-2 trunk's memory per rank against N.

For every N of ``--tokens N,N,...`` and every grid of ``--grid``, the CP trunk and the serial trunk
(rank 0, the same weights) run forward + backward on the synthetic complex of that size
(``twinshard.bench.whole_trunk``: ``--atoms-per-token K``, ``--sequences`` S, ``--templates`` T,
the widths and blocks of ``twinshard trunk``), measured as ``twinshard trunk --check-serial``
measures: per-rank saved bytes, profiler tensor peak and resident peak beside the serial's, the
ledger's bytes per rank per op (forward and backward) and the byte model of each new collective
(``model_bytes``: model beside ledger per rank). The last stdout line is one JSON object:
``{"op": "trunk", "runs": [...], "ratios": [...], "plot": FILE}``, ``ratios`` one row per run
with ``peak_ratio_vs_serial_over_p`` (the issue's target: <= 1.25 at fp32, N >= 128, A ~ 8N,
S = 64, T = 2, on 2x2 and 2x3), the saved ratios and the padding factor. ``--plot FILE.png``
draws the peak tensor memory per rank against N for each grid beside serial / P.
``--repeats R`` adds wall times without the profiler (CP slowest rank, serial with
``--threads``).
"""

from __future__ import annotations

import argparse
import json
import os
from typing import Any

from twinshard.runtime import reports, run_ranks

__all__ = ["plot_trunk_memory", "run_trunk_bench"]


def run_trunk_bench(
    args: argparse.Namespace, shapes: list[tuple[int, int]], tokens: list[int]
) -> dict[str, Any]:
    from twinshard.bench import whole_trunk as W

    if any(n < 1 for n in tokens) or args.sequences < 1 or args.batch < 1:
        raise ValueError("tokens, sequences and batch must be positive")
    if getattr(args, "repeats", 0) < 0 or getattr(args, "warmup", 0) < 0:
        raise ValueError("repeats and warmup must not be negative")
    o = W.options(args, msa=args.sequences)
    results = []
    for n in tokens:
        for shape in shapes:
            nranks = shape[0] * shape[1]
            threads = getattr(args, "threads", None) or max(1, min(nranks, os.cpu_count() or 1))
            call = (n, shape, o, args.dtype, True, args.seed, args.repeats, args.warmup, threads)
            t = float(getattr(args, "timeout", 3600.0))
            ranks = run_ranks(W.whole_rank, nranks, *call, option="--grid", deadline=t)
            if reports():
                results.append(W.summarise(n, shape, o, args.dtype, ranks, threads))
    if not reports():
        return {}
    ratios = [
        {
            "tokens": r["tokens"],
            "grid": r["grid"],
            "atoms": r["atoms"],
            "peak_ratio_vs_serial_over_p": r["peak_ratio_vs_serial_over_p"],
            "saved_ratio_vs_serial_over_p": r["saved_ratio_vs_serial_over_p"],
            "saved_activation_ratio_vs_serial_over_p": r["saved_activation_ratio_vs_serial_over_p"],
            "pair_padding_factor": r["pair_padding_factor"],
            "max_peak_memory_bytes_per_rank": max(r["peak_memory_bytes_per_rank"]),
            "serial_peak_memory_bytes": r["serial_peak_memory_bytes"],
            "seconds_median": r["seconds_median"],
            "serial_seconds_median": r["serial_seconds_median"],
        }
        for r in results
    ]
    plot = getattr(args, "plot", None)
    if plot:
        plot_trunk_memory(results, plot)
    out = {"op": "trunk", "runs": results, "ratios": ratios, "plot": plot}
    if not getattr(args, "json", False):
        for row in ratios:
            print(" ".join(f"{k}={v}" for k, v in row.items()))
    print(json.dumps(out))
    return out


def plot_trunk_memory(results: list[dict[str, Any]], path: str) -> None:
    """Peak tensor memory and saved bytes per rank against N, one line per grid, beside serial / P."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    mib = 2.0**20
    fig, (ax_m, ax_s) = plt.subplots(1, 2, figsize=(10, 4))
    for grid in sorted({r["grid"] for r in results}):
        rs = sorted((r for r in results if r["grid"] == grid), key=lambda r: r["tokens"])
        p = len(rs[0]["peak_memory_bytes_per_rank"])
        ns = [r["tokens"] for r in rs]
        line = ax_m.plot(
            ns, [max(r["peak_memory_bytes_per_rank"]) / mib for r in rs], "o-", label=f"{grid}: per rank"
        )
        ax_m.plot(
            ns,
            [r["serial_peak_memory_bytes"] / mib / p for r in rs],
            "--",
            color=line[0].get_color(),
            label=f"{grid}: serial / {p}",
        )
        line = ax_s.plot(
            ns, [max(r["saved_bytes_per_rank"]) / mib for r in rs], "s-", label=f"{grid}: per rank"
        )
        ax_s.plot(
            ns,
            [r["serial_saved_bytes"] / mib / p for r in rs],
            "--",
            color=line[0].get_color(),
            label=f"{grid}: serial / {p}",
        )
    ax_m.set_title("peak tensor memory (forward + backward)", fontsize=9)
    ax_s.set_title("saved for backward", fontsize=9)
    for ax in (ax_m, ax_s):
        ax.set_xscale("log")
        ax.set_yscale("log")
        ns = sorted({r["tokens"] for r in results})
        ax.set_xticks(ns, [str(n) for n in ns])
        ax.minorticks_off()
        ax.set_xlabel("tokens N")
        ax.set_ylabel("MiB per rank")
        ax.legend(fontsize=7)
    r0 = results[0]
    fig.suptitle(
        f"Boltz-2 trunk, {r0['dtype']}: A ~ {r0['atoms'] / r0['tokens']:.1f} N, S={r0['sequences']}, "
        f"T={r0['templates']}, c_s={r0['single_channels']}, c_z={r0['channels']}"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
