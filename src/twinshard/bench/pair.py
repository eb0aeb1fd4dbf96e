"""``twinshard bench pair``: CP triangle multiplication / outer product mean against serial.

Runs the serial module and its CP twin forward + backward on the same synthetic
features (random pair or MSA, random masked entries, padding when N does not divide
the grid) and prints one JSON object (the last stdout line) with the parity errors,
the memory saved for backward and the peak memory (per rank and serial), and the
forward communication per rank from the CommLedger beside the 2-D lower bound.

Measurements (per rank, forward + backward of one call):
- ``saved_bytes``: bytes of the distinct storages packed by
  ``torch.autograd.graph.saved_tensors_hooks`` during the forward (parameters and
  their synced copies included, the same rule for serial and CP);
  ``saved_activation_ratio_vs_serial_over_p``: the same ratio with the parameters' storages
  left out on both sides (every rank holds the parameters whole whether autograd saves them
  or not: a fixed per-rank amount that the ratio above counts P times over serial);
- ``peak_memory_bytes``: on CUDA, ``max_memory_allocated`` above the starting level;
  on CPU, the peak of the running sum of allocator events recorded by the profiler
  (it raises rather than report 0 when the profiler cannot measure);
- ``peak_rss_bytes``: the process's peak resident memory (VmHWM) over the same
  forward + backward, reset at its start where the kernel permits
  (``rss_reset_per_rank``); absolute, torch libraries and non-tensor memory included;
- ``comm_bytes``: ``max(bytes_sent, bytes_recv)`` of the forward's ledger (modelled
  bytes, see ``comm_bytes_model``); the
  backward's is reported separately. ``comm_lower_bound_bytes`` is
  ``2 B N^2 h / sqrt(P)`` elements for a triangle multiplication (h = channels of the
  contracted ``a``/``b``) and the analogous ``2 B S N h / sqrt(P)`` for the outer
  product mean (its operands are the S x N MSA projections).
- ``seconds_median``: forward + backward wall time, ``--repeats`` runs after ``--warmup``
  runs (a barrier before each), the slowest rank per run, median over runs;
  ``serial_seconds_median``: the serial module the same way in one process with
  ``--threads`` intra-op threads (the other ranks wait), i.e. the serial module given the
  same cores;
- ``flops_fwd_bwd``: the matmul flops of the module (projections and contraction, backward
  = 2 x forward), ``achieved_gflops`` (CP) and ``serial_gflops`` against ``matmul_gflops``,
  a square matmul in the bench dtype measured in one process with ``--threads`` threads on
  this machine (``*_fraction_of_matmul``: each figure as a fraction of that limit).

``pair_padding_factor``: ``Nr Nc / N^2``, what padding N up to a multiple of rows (and of
cols) adds to every pair-sized tensor (a floor under the memory ratios: 1.12 for N=25 on 2x3,
26 x 27 entries; no 2-D block tiling holds less per rank).

``--grid 1x1,2x2,2x3`` runs several grids (the last line is then ``{"runs": [...]}``);
``--plot FILE.png`` draws time and peak memory per rank against the number of ranks beside
the ideal curves (serial / P).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

from twinshard.bench.measure import measure, parse_grid, rank_figures  # re-exported: they lived here
from twinshard.bench.pair_ops import TRUNK_OPS, bench_rank_op, lower_bound_bytes
from twinshard.comm import CommLedger
from twinshard.comm.ledger import BYTES_MODEL
from twinshard.pair.layers.contraction import schedule_name
from twinshard.runtime import get_world, make_grid, reports, run_ranks

__all__ = ["OPS", "add_parser", "bench_rank", "measure", "parse_grid", "run"]

# the trunk ops: twinshard.bench.pair_ops; "trunk": the whole Boltz-2 trunk (bench.whole_trunk);
# "predict": the whole Boltz-2 inference forward (bench.predict_bench)
OPS = ("trimul-out", "trimul-in", "opm") + TRUNK_OPS + ("trunk", "predict", "train")


def parse_tokens(text: str) -> list[int]:
    """``--tokens``: N, or ``N,N,...`` (several only with ``--op trunk``)."""
    try:
        return [int(v) for v in str(text).split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"tokens must look like 24 or 64,128, got {text!r}") from None


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register ``pair`` under ``twinshard bench``."""
    p = subparsers.add_parser(
        "pair",
        help="a CP pair op vs serial (trimul, OPM, triangle attention, attention with pair bias, Pairformer)",
    )
    p.add_argument("--op", choices=OPS, default="trimul-out")
    p.add_argument(
        "--tokens",
        type=parse_tokens,
        default=[24],
        help="N (any value; padded internally); --op trunk takes a list, e.g. 64,128",
    )
    p.add_argument("--grid", default="2x2", help="rows x cols process grid, e.g. 2x2, 2x3")
    p.add_argument("--dtype", choices=("float64", "float32"), default="float64")
    p.add_argument("--channels", type=int, default=8, help="pair channels (trimul) / MSA channels")
    p.add_argument("--hidden", type=int, default=8, help="channels of a and b")
    p.add_argument("--sequences", type=int, default=6, help="MSA depth S (opm, trunk)")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--repeats", type=int, default=3, help="timed forward + backward runs (median)")
    p.add_argument("--warmup", type=int, default=1, help="untimed runs before the timed ones")
    p.add_argument(
        "--threads",
        type=int,
        default=None,
        help="threads of the serial yardstick and of the matmul rate (default: min(P, cores))",
    )
    p.add_argument(
        "--timeout",
        type=float,
        default=3600.0,
        help="seconds a rank may wait in one collective, and the whole run may take (the other "
        "ranks wait while rank 0 times the serial yardstick: minutes at N = 512)",
    )
    p.add_argument(
        "--backend",
        choices=("reference", "sdpa", "flex"),
        default="reference",
        help="attention backend of triangle attention and attention with pair bias (serial and CP)",
    )
    p.add_argument("--plot", default=None, help="FILE.png: time and memory per rank against ranks")
    p.add_argument("--json", action="store_true", help="print only the JSON line")
    from twinshard.bench.whole_trunk import add_trunk_options

    add_trunk_options(p, skip=("--msa",))  # --op trunk: the MSA depth is --sequences
    p.add_argument("--sampling-steps", type=int, default=3, help="--op predict: denoising steps")
    p.add_argument("--diffusion-samples", type=int, default=1, help="--op predict: samples per element")
    p.set_defaults(func=run)
    return p


# -- measurement -------------------------------------------------------------------------------


def matmul_gflops(dtype: torch.dtype, threads: int, size: int = 768, repeats: int = 5) -> float:
    """This machine's matmul rate (GFLOP/s) in one process with ``threads`` intra-op threads:
    median of ``repeats`` square ``size`` x ``size`` products after one warm-up."""
    saved = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        a = torch.randn(size, size, dtype=torch.float64).to(dtype)
        b = torch.randn(size, size, dtype=torch.float64).to(dtype)
        out = torch.empty_like(a)
        torch.mm(a, b, out=out)
        ts = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            torch.mm(a, b, out=out)
            ts.append(time.perf_counter() - t0)
    finally:
        torch.set_num_threads(saved)
    return 2 * size**3 / statistics.median(ts) / 1e9


def model_flops(op: str, batch: int, tokens: int, seqs: int, channels: int, hidden: int) -> float:
    """Matmul flops of one forward + backward (backward = 2 x forward) of the serial module."""
    n, c, h = tokens, channels, hidden
    if op == "opm":  # proj_a, proj_b on S x N; the s-contraction; proj_o (h^2 -> c) on N x N
        fwd = 2 * 2 * seqs * n * c * h + 2 * seqs * n * n * h * h + 2 * n * n * h * h * c
    else:  # p_in, g_in (c -> 2h), p_out (h -> c), g_out (c -> c) per entry; the k-contraction
        fwd = n * n * (2 * (2 * c * 2 * h) + 2 * h * c + 2 * c * c) + 2 * n**3 * h
    return 3.0 * batch * fwd


def _timed(step: Callable[[], None], warmup: int, repeats: int, sync: Callable[[], None]) -> list[float]:
    for _ in range(warmup):
        step()
    ts = []
    for _ in range(repeats):
        sync()
        t0 = time.perf_counter()
        step()
        ts.append(time.perf_counter() - t0)
    return ts


# -- one rank ----------------------------------------------------------------------------------


def _build(
    op: str, channels: int, hidden: int, dtype: torch.dtype, seed: int
) -> tuple[torch.nn.Module, torch.nn.Module]:
    from twinshard.pair.layers.outer_product import CPOuterProductMean
    from twinshard.pair.layers.triangle import CPTriangleMultiplication
    from twinshard.pair.reference.outer_product import OuterProductMean
    from twinshard.pair.reference.triangle import TriangleMultiplication

    if op == "opm":
        serial, cp = (
            OuterProductMean(channels, hidden, channels),
            CPOuterProductMean(channels, hidden, channels),
        )
    else:
        direction = "outgoing" if op == "trimul-out" else "incoming"
        serial = TriangleMultiplication(channels, direction, hidden)
        cp = CPTriangleMultiplication(channels, direction, hidden)
    serial = serial.to(dtype)
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():  # AF3 zero inits would make most gradients vanish: randomise all
        for p in serial.parameters():
            p.copy_(torch.randn(p.shape, generator=g, dtype=torch.float64).to(dtype) * 0.5 + 0.1)
    cp = cp.to(dtype)
    cp.load_state_dict(serial.state_dict())
    return serial, cp


def _inputs(
    op: str, batch: int, tokens: int, seqs: int, channels: int, dtype: torch.dtype, seed: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    lead = (batch, seqs, tokens) if op == "opm" else (batch, tokens, tokens)
    x = torch.randn(*lead, channels, generator=g, dtype=torch.float64).to(dtype)
    mask = (torch.rand(*lead, generator=g) > 0.15).to(dtype)
    gout = torch.randn(batch, tokens, tokens, channels, generator=g, dtype=torch.float64).to(dtype)
    return x, mask, gout


def bench_rank(
    op: str,
    tokens: int,
    grid_shape: tuple[int, int],
    dtype_name: str = "float64",
    channels: int = 8,
    hidden: int = 8,
    sequences: int = 6,
    batch: int = 1,
    seed: int = 0,
    repeats: int = 0,
    warmup: int = 0,
    threads: int = 1,
    backend: str = "reference",
) -> dict[str, Any]:
    """Run on every rank of a world of rows x cols ranks; returns this rank's figures.

    ``repeats`` > 0 adds the timed runs (``seconds_runs``, this rank's; serial and the matmul
    rate on rank 0 with ``threads`` threads while the others wait). ``backend``: the attention
    backend of the serial module and the twin (``twinshard.pair.reference.attention_backends``)."""
    from twinshard.pair.reference.attention_backends import attention_backend

    with attention_backend(backend):
        return _bench_rank(
            op,
            tokens,
            grid_shape,
            dtype_name,
            channels,
            hidden,
            sequences,
            batch,
            seed,
            repeats,
            warmup,
            threads,
        )


def _bench_rank(
    op: str,
    tokens: int,
    grid_shape: tuple[int, int],
    dtype_name: str,
    channels: int,
    hidden: int,
    sequences: int,
    batch: int,
    seed: int,
    repeats: int,
    warmup: int,
    threads: int,
) -> dict[str, Any]:
    if op in TRUNK_OPS:  # triangle attention, attention with pair bias, the Pairformer layer
        return bench_rank_op(op, tokens, grid_shape, dtype_name, channels, hidden, sequences, batch, seed)
    from twinshard.pair.features import PairLayout, with_layout
    from twinshard.pair.tiling import MSA, PAIR, from_local, local_block

    if op not in OPS:
        raise ValueError(f"op must be one of {OPS}, got {op!r}")
    dtype = getattr(torch, dtype_name)
    grid = make_grid(tuple(grid_shape))
    device = get_world().device
    serial, cp = _build(op, channels, hidden, dtype, seed)
    serial, cp = serial.to(device), cp.to(device)
    x, mask, gout = (t.to(device) for t in _inputs(op, batch, tokens, sequences, channels, dtype, seed))
    kind = "msa" if op == "opm" else "pair"
    layout = PairLayout.for_sizes(tokens, grid, sequences if op == "opm" else None)
    place = MSA if op == "opm" else PAIR

    # serial
    xs = x.clone().requires_grad_(True)
    held: list[torch.Tensor] = []

    def ser_fwd() -> torch.Tensor:
        held.append(serial(xs, mask))
        return held[-1]

    ser = measure(ser_fwd, lambda o: o.backward(gout), device, list(serial.parameters()))
    out_serial = held.pop().detach()

    # CP: the padded inputs' tiles; padding is masked out and its grad_output is zero
    xl = local_block(layout.pad(x, kind), grid, place).requires_grad_(True)
    ml = local_block(layout.pad(mask, kind), grid, place)
    gl = local_block(layout.pad(gout, "pair"), grid, PAIR)
    # the layout rides on the mask (no graph to rebuild per step; x's tiles are zero-padded)
    xd, md = from_local(xl, grid, place), with_layout(from_local(ml, grid, place), layout, kind)
    fwd_ledger, bwd_ledger = CommLedger(), CommLedger()

    def cp_fwd() -> torch.Tensor:
        with fwd_ledger:
            held.append(cp(xd, md))
        return held[-1]

    def cp_bwd(o: torch.Tensor) -> None:
        with bwd_ledger:
            o.to_local().backward(gl)

    cpm = measure(cp_fwd, cp_bwd, device, list(cp.parameters()))
    out_cp = held.pop().full_tensor()[:, :tokens, :tokens]
    gin_cp = from_local(xl.grad, grid, place).full_tensor()[
        :, : (sequences if op == "opm" else tokens), :tokens
    ]
    err_out = (out_cp - out_serial).abs().max().item()
    err_in = (gin_cp - xs.grad).abs().max().item()
    err_par = max((a.grad - b.grad).abs().max().item() for a, b in zip(serial.parameters(), cp.parameters()))
    f, b_ = fwd_ledger.summary(), bwd_ledger.summary()
    timing: dict[str, Any] = {"seconds_runs": [], "serial_seconds_runs": [], "matmul_gflops": None}
    if repeats > 0:
        import torch.distributed as dist

        sync = dist.barrier if dist.is_initialized() else (lambda: None)

        def cp_step() -> None:
            cp(xd, md).to_local().backward(gl)
            xl.grad = None
            cp.zero_grad(set_to_none=True)

        timing["seconds_runs"] = _timed(cp_step, warmup, repeats, sync)
        sync()
        if grid.rank == 0:  # the serial yardstick and the machine's rate, the other ranks idle

            def ser_step() -> None:
                serial(xs, mask).backward(gout)
                xs.grad = None
                serial.zero_grad(set_to_none=True)

            saved_threads = torch.get_num_threads()
            torch.set_num_threads(threads)
            try:
                timing["serial_seconds_runs"] = _timed(ser_step, warmup, repeats, lambda: None)
            finally:
                torch.set_num_threads(saved_threads)
            timing["matmul_gflops"] = matmul_gflops(dtype, threads)
        sync()
    return {**timing, **rank_figures(err_out, err_in, err_par, cpm, ser, f, b_, layout.padded)}


def _summarise(
    op: str, tokens: int, shape: tuple[int, int], a: argparse.Namespace, ranks: list[dict[str, Any]]
) -> dict[str, Any]:
    P = shape[0] * shape[1]
    item = torch.tensor([], dtype=getattr(torch, a.dtype)).element_size()
    if op == "opm":
        lower = 2 * a.batch * a.sequences * tokens * a.hidden / math.sqrt(P) * item
    else:
        lower = 2 * a.batch * tokens * tokens * a.hidden / math.sqrt(P) * item
    if op in TRUNK_OPS:
        lower = lower_bound_bytes(op, a.batch, tokens, a.channels, a.hidden, P, item)
    r0 = ranks[0]
    saved = [r["saved"] for r in ranks]
    comm = [r["comm_fwd"] for r in ranks]
    out: dict[str, Any] = {
        "op": op,
        "grid": f"{shape[0]}x{shape[1]}",
        "tokens": tokens,
        "dtype": a.dtype,
        "padded_tokens": r0["padded_tokens"],
        "channels": a.channels,
        "hidden": a.hidden,
        "sequences": a.sequences if op == "opm" else None,
        "batch": a.batch,
        "schedule": schedule_name(shape),
        "max_abs_error_out": max(r["err_out"] for r in ranks),
        "max_abs_error_grad_inputs": max(r["err_in"] for r in ranks),
        "max_abs_error_grad_params": max(r["err_par"] for r in ranks),
        "saved_bytes_per_rank": saved,
        "serial_saved_bytes": r0["serial_saved"],
        "saved_ratio_vs_serial_over_p": max(saved) / (r0["serial_saved"] / P),
        # the same without the parameters: every rank holds them whole whether autograd saves
        # them or not, so at small N they make the ratio above a count of replicas, not of tiles
        "saved_activation_ratio_vs_serial_over_p": (
            max(r["saved_activations"] for r in ranks) / (r0["serial_saved_activations"] / P)
            if r0.get("serial_saved_activations")
            else None
        ),
        "peak_memory_bytes_per_rank": [r["peak"] for r in ranks],
        "serial_peak_memory_bytes": r0["serial_peak"],
        "peak_rss_bytes_per_rank": [r["rss_peak"] for r in ranks],
        "rss_reset_per_rank": [r["rss_reset"] for r in ranks],
        "rss_source": r0["rss_source"],
        "serial_peak_rss_bytes": r0["serial_rss_peak"],
        "comm_bytes_model": BYTES_MODEL,
        "comm_bytes_per_rank": comm,
        "comm_bytes_sent_per_rank": [r["comm_fwd_sent"] for r in ranks],
        "comm_bytes_recv_per_rank": [r["comm_fwd_recv"] for r in ranks],
        "comm_backward_bytes_per_rank": [r["comm_bwd"] for r in ranks],
        "comm_lower_bound_bytes": lower,
        "comm_ratio_vs_lower_bound": max(comm) / lower if P > 1 else 0.0,
        "seconds_per_rank": [r["seconds"] for r in ranks],
        "serial_seconds": r0["serial_seconds"],
    }
    # peak tensor memory per rank against serial / P (the 1.3 x target) and the backward's bytes
    peaks = [r["peak"] for r in ranks if r["peak"] is not None]
    out["peak_ratio_vs_serial_over_p"] = (
        max(peaks) / (r0["serial_peak"] / P) if peaks and r0["serial_peak"] else None
    )
    # what padding alone adds to every pair-sized tensor (Nr Nc / N^2): a floor under both
    # ratios above that no schedule (and no 2-D block tiling) can remove
    nr, nc = r0["padded_tokens"]
    out["pair_padding_factor"] = nr * nc / tokens**2
    out["comm_backward_ratio_vs_lower_bound"] = max(r["comm_bwd"] for r in ranks) / lower if P > 1 else 0.0
    runs = [max(r["seconds_runs"][i] for r in ranks) for i in range(len(r0["seconds_runs"]))]
    flops = model_flops(op, a.batch, tokens, a.sequences if op == "opm" else tokens, a.channels, a.hidden)
    cp_t = statistics.median(runs) if runs else None
    ser_t = statistics.median(r0["serial_seconds_runs"]) if r0["serial_seconds_runs"] else None
    rate = r0["matmul_gflops"]
    out.update(
        {
            "repeats": len(runs),
            "seconds_runs": runs,
            "seconds_median": cp_t,
            "serial_threads": getattr(a, "threads_used", None),
            "serial_seconds_median": ser_t,
            "cp_over_serial_time": cp_t / ser_t if cp_t and ser_t else None,
            "flops_fwd_bwd": flops,
            "achieved_gflops": flops / cp_t / 1e9 if cp_t else None,
            "serial_gflops": flops / ser_t / 1e9 if ser_t else None,
            "matmul_gflops": rate,
            "achieved_fraction_of_matmul": flops / cp_t / 1e9 / rate if cp_t and rate else None,
            "serial_fraction_of_matmul": flops / ser_t / 1e9 / rate if ser_t and rate else None,
        }
    )
    return out


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Run the benchmark (spawning rows x cols local ranks unless already in such a world).

    Several grids (``--grid 1x1,2x2``): one run each, the last line ``{"runs": [...]}``."""
    shapes = [parse_grid(g) for g in str(args.grid).split(",")]
    if args.op not in OPS:
        raise ValueError(f"op must be one of {OPS}, got {args.op!r}")
    tokens = args.tokens if isinstance(args.tokens, list) else [args.tokens]
    if args.op == "trunk":
        from twinshard.bench.trunk_bench import run_trunk_bench

        return run_trunk_bench(args, shapes, tokens)
    if args.op == "predict":
        from twinshard.bench.predict_bench import run_predict_bench

        return run_predict_bench(args, shapes, tokens)
    if args.op == "train":  # one whole-model training step (bench.train_bench)
        from twinshard.bench.train_bench import run_train_bench

        return run_train_bench(args, shapes, tokens)
    if len(tokens) != 1:
        raise ValueError(f"several --tokens values ({tokens}) only with --op trunk or predict")
    args.tokens = tokens[0]
    if args.tokens < 1 or args.sequences < 1 or args.batch < 1:
        raise ValueError("tokens, sequences and batch must be positive")
    if getattr(args, "repeats", 0) < 0 or getattr(args, "warmup", 0) < 0:
        raise ValueError("repeats and warmup must not be negative")
    results = [_run_one(args, shape) for shape in shapes]
    quiet = not reports()  # under torchrun rank 0 prints
    plot = getattr(args, "plot", None)
    if plot and not quiet:
        plot_runs(results, plot)
        from twinshard.bench.pair_ops import plot_memory_and_bytes

        root, ext = os.path.splitext(plot)
        plot_memory_and_bytes(results, f"{root}-bytes{ext or '.png'}")  # memory and ledger bytes per rank
    if len(results) == 1:
        result = results[0]
    else:
        result = {"runs": results, "plot": plot}
    if quiet:
        return result
    if not getattr(args, "json", False):
        for res in results:
            for k, v in res.items():
                if not isinstance(v, list):
                    print(f"{k:32s} {v}")
    print(json.dumps(result))
    return result


def _run_one(args: argparse.Namespace, shape: tuple[int, int]) -> dict[str, Any]:
    nranks = shape[0] * shape[1]
    threads = getattr(args, "threads", None) or max(1, min(nranks, os.cpu_count() or 1))
    args.threads_used = threads
    call = (
        args.op,
        args.tokens,
        shape,
        args.dtype,
        args.channels,
        args.hidden,
        args.sequences,
        args.batch,
        args.seed,
        getattr(args, "repeats", 0),
        getattr(args, "warmup", 0),
        threads,
        getattr(args, "backend", "reference"),
    )
    t = float(getattr(args, "timeout", 3600.0))
    ranks = run_ranks(bench_rank, nranks, *call, option="--grid", deadline=t)
    if not reports():  # rank 0 of the world summarises
        return {}
    return {
        **_summarise(args.op, args.tokens, shape, args, ranks),
        "backend": getattr(args, "backend", "reference"),
    }


def plot_runs(results: list[dict[str, Any]], path: str) -> None:
    """Time and peak tensor memory per rank against the number of ranks, with serial / P."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rs = sorted(results, key=lambda r: r["saved_bytes_per_rank"].__len__())
    ps = [len(r["saved_bytes_per_rank"]) for r in rs]
    labels = [r["grid"] for r in rs]
    fig, (ax_t, ax_m) = plt.subplots(1, 2, figsize=(10, 4))
    t = [r["seconds_median"] if r.get("seconds_median") else r["seconds_per_rank"][0] for r in rs]
    ser = next((r["serial_seconds_median"] for r in rs if r.get("serial_seconds_median")), None)
    ser = ser or rs[0]["serial_seconds"]
    ax_t.plot(ps, t, "o-", label="CP forward + backward (median, slowest rank)")
    ax_t.plot(ps, [ser / p for p in ps], "k--", label="ideal: serial / P")
    ax_t.set_ylabel("seconds")
    mem = [max(r["peak_memory_bytes_per_rank"]) / 2**20 for r in rs]
    saved = [max(r["saved_bytes_per_rank"]) / 2**20 for r in rs]
    ser_m = rs[0]["serial_peak_memory_bytes"] / 2**20
    ax_m.plot(ps, mem, "o-", label="peak tensor memory per rank")
    ax_m.plot(ps, saved, "s-", label="saved for backward per rank")
    ax_m.plot(ps, [ser_m / p for p in ps], "k--", label="ideal: serial peak / P")
    ax_m.plot(ps, [rs[0]["serial_saved_bytes"] / 2**20 / p for p in ps], "k:", label="serial saved / P")
    ax_m.set_ylabel("MiB")
    r0 = rs[0]
    for ax in (ax_t, ax_m):
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xticks(ps, labels)
        ax.minorticks_off()
        ax.set_xlabel("grid (ranks)")
        ax.legend(fontsize=7)
    fig.suptitle(f"{r0['op']} N={r0['tokens']} c={r0['channels']} h={r0['hidden']} {r0['dtype']}")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
