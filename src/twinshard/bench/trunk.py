"""``twinshard trunk``: the random-weight Boltz-2 trunk on a rows x cols grid, measured.

By default the WHOLE trunk (``CPBoltz2Trunk`` against ``Boltz2Trunk``) on the synthetic complex:
``twinshard.bench.whole_trunk`` (``--tokens``, ``--atoms-per-token``, ``--msa``, ``--templates``,
``--recycling``, widths, blocks and heads; the JSON keys below plus the whole trunk's: errors per
output, the ``ref_pos`` gradient's error, per-op ledger bytes and the byte models).

``--pairformer-only`` (and ``--train-step``) run the Pairformer stack alone, as the command did
before the whole trunk existed: it runs the CP Pairformer stack (``twinshard.pair.layers.pairformer.CPPairformerStack``, random
weights from ``--seed``, Boltz-2's layer structure at the widths given) forward and backward on
synthetic features (random single and pair representations, a random token mask and the pair
mask it implies, padding when N does not divide the grid) with one random grad_output for ``s``
and ``z``, and prints one JSON object (the last stdout line) with the keys of ``twinshard bench
pair`` plus ``layers`` (and the trunk's widths and options):

- parity (``--check-serial``): the serial ``PairformerStack`` with the same weights runs on rank 0
  on the full inputs; ``max_abs_error_out`` (``s`` and ``z``), ``..._grad_inputs`` and
  ``..._grad_params`` (every parameter by name) are its differences from the gathered CP results,
  and ``serial_*`` its own saved bytes, peak memory and time; without it those keys are null;
- ``saved_bytes_per_rank``, ``peak_memory_bytes_per_rank`` (tensors: the profiler's allocator
  peak on CPU, ``max_memory_allocated`` on CUDA) and ``peak_rss_bytes_per_rank`` (resident):
  the rules of ``twinshard bench pair`` (``twinshard.bench.pair.measure``) over forward +
  backward; the inputs' tiles are built before the window opens, the full inputs are freed;
- ``comm_bytes_per_rank`` (forward) and ``comm_backward_bytes_per_rank`` from the CommLedger,
  ``ledger_bytes_per_rank`` their sum (sent or received, whichever is more, per phase);
  ``comm_lower_bound_bytes`` is the triangle multiplications' 2-D bound, ``2 B N^2 c_z /
  sqrt(P)`` elements for each of the ``2 x layers`` of them (the other parts' traffic is on top).

``--checkpointing`` recomputes each layer in backward (both the CP and the serial stack).
``--train-step`` measures one training step instead (``twinshard.pair.train``: the stack, the
distogram head and its loss, backward and an AdamW update; ``CPTrunk`` against ``Trunk``, Boltz-2
dropout p = 0.25 keyed by global index): the whole step's ledger bytes are reported as the
forward's (``comm_backward_bytes_per_rank`` 0), ``max_abs_error_out`` is the loss's error and
``max_abs_error_grad_params`` the largest difference of a weight after the update (input
gradients: null). The pair-bias LayerNorm bias (``attention.proj_z.0.bias``, analytically zero
gradient, round-off that AdamW would scale up to a full step) is frozen on both sides.
``--dp K`` splits the batch over K replicas; ``--shard-optimizer`` shards the AdamW state and the
gradients (``twinshard.optim.ShardedAdamW``), ``--shard-grads during`` (default: each gradient
taken into the rank's send buffer as backward accumulates it) or ``after`` (the full gradients
held to the end of backward, then reduce-scattered); the JSON's ``shard_grads`` says which.
"""

from __future__ import annotations

import argparse
import json
import math
from typing import Any

import torch

from twinshard.bench.measure import measure, parse_grid
from twinshard.bench.whole_trunk import add_trunk_options
from twinshard.comm import CommLedger
from twinshard.comm.ledger import BYTES_MODEL
from twinshard.pair.layers.contraction import schedule_name
from twinshard.pair.precision import add_precision_options, dtype_default, run_in_mode
from twinshard.runtime import get_world, make_grid, reports, run_ranks

__all__ = ["add_parser", "run", "trunk_rank", "summarise"]


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register ``trunk`` as a top-level ``twinshard`` command."""
    p = subparsers.add_parser(
        "trunk",
        help="the random-weight CP Boltz-2 trunk on a synthetic complex: parity, memory, bytes (JSON)",
    )
    p.add_argument("--tokens", type=int, default=24, help="N (any value; padded internally)")
    p.add_argument("--grid", default="2x2", help="rows x cols process grid, e.g. 2x2, 2x3")
    p.add_argument("--layers", type=int, default=2, help="Pairformer layers")
    p.add_argument(
        "--pairformer-only",
        action="store_true",
        help="the Pairformer stack alone on random s and z (the command's mode before the whole trunk)",
    )
    p.add_argument(
        "--train-step",
        action="store_true",
        help="one training step (Pairformer stack + distogram loss + AdamW) instead of forward + backward",
    )
    p.add_argument(
        "--dp",
        type=int,
        default=1,
        help="with --train-step: data-parallel replicas, each a --grid CP grid (dp x rows x cols ranks; "
        "the --batch structures split over them)",
    )
    p.add_argument(
        "--shard-optimizer",
        action="store_true",
        help="with --train-step: AdamW state and gradients sharded over all ranks (twinshard.optim.ShardedAdamW)",
    )
    p.add_argument(
        "--shard-grads",
        choices=("during", "after"),
        default="during",
        help="with --shard-optimizer: take each gradient into the rank's shard during backward (ZeRO-2, "
        "p.grad freed as it arrives) or reduce-scatter the full gradients after backward",
    )
    p.add_argument(
        "--check-serial", action="store_true", help="run the serial trunk (or stack) on rank 0 and compare"
    )
    p.add_argument(
        "--checkpointing",
        action="store_true",
        help="activation checkpointing per layer (Pairformer, MSA and template blocks)",
    )
    add_precision_options(p, "; the serial check runs in the same mode")
    p.add_argument("--single-channels", type=int, default=64, help="c_s (token_s)")
    p.add_argument("--pair-channels", type=int, default=32, help="c_z (token_z)")
    p.add_argument("--heads", type=int, default=4, help="heads of the attention with pair bias")
    p.add_argument("--pair-head-width", type=int, default=16, help="triangle attention head width")
    p.add_argument("--pair-heads", type=int, default=4, help="triangle attention heads")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", action="store_true", help="print only the JSON line")
    p.add_argument("--timeout", type=float, default=3600.0, help="seconds the local ranks may take")
    p.add_argument(
        "--repeats",
        type=int,
        default=0,
        help="timed forward + backward runs without the profiler (whole trunk)",
    )
    add_trunk_options(p)
    p.set_defaults(func=run)
    return p


def _stacks(cfg: dict[str, Any], dtype: torch.dtype, seed: int):
    from twinshard.pair.layers.pairformer import CPPairformerStack
    from twinshard.pair.reference.pairformer import PairformerStack

    kw = dict(
        num_heads=cfg["heads"],
        dropout=0.0,
        pairwise_head_width=cfg["pair_head_width"],
        pairwise_num_heads=cfg["pair_heads"],
        activation_checkpointing=cfg["checkpointing"],
    )
    torch.manual_seed(seed + 1)  # the same initial weights on every rank (the twin loads them)
    serial = PairformerStack(cfg["single"], cfg["pair"], cfg["layers"], **kw).to(dtype)
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():  # zero inits (output projections, gates) would hide most of the backward
        for p in serial.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=g, dtype=torch.float64).to(dtype))
    cp = CPPairformerStack(cfg["single"], cfg["pair"], cfg["layers"], **kw).to(dtype)
    cp.load_state_dict(serial.state_dict())
    return serial, cp


def _inputs(cfg: dict[str, Any], n: int, dtype: torch.dtype, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    b = cfg["batch"]

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g, dtype=torch.float64).to(dtype)

    s, z = randn(b, n, cfg["single"]), randn(b, n, n, cfg["pair"])
    mask = (torch.rand(b, n, generator=g) > 0.1).to(dtype)
    mask[:, 0] = 1
    return {
        "s": s,
        "z": z,
        "mask": mask,
        "pair_mask": mask[:, :, None] * mask[:, None, :],
        "gs": randn(b, n, cfg["single"]),
        "gz": randn(b, n, n, cfg["pair"]),
    }


def trunk_rank(
    tokens: int,
    grid_shape: tuple[int, int],
    cfg: dict[str, Any],
    dtype_name: str,
    check_serial: bool,
    seed: int,
) -> dict[str, Any]:
    """Run on every rank of a world of rows x cols ranks; returns this rank's figures."""
    from twinshard.pair.features import PairLayout, with_layout
    from twinshard.pair.tiling import PAIR, SINGLE, from_local, local_block

    dtype = getattr(torch, dtype_name)
    grid = make_grid(tuple(grid_shape))
    device = get_world().device
    serial, cp = _stacks(cfg, dtype, seed)
    cp = cp.to(device)
    full = {k: v.to(device) for k, v in _inputs(cfg, tokens, dtype, seed).items()}
    layout = PairLayout.for_sizes(tokens, grid)

    def tile(x: torch.Tensor, kind: str) -> torch.Tensor:
        return local_block(layout.pad(x, kind), grid, PAIR if kind == "pair" else SINGLE)

    kinds = {"s": "single", "z": "pair", "mask": "single", "pair_mask": "pair", "gs": "single", "gz": "pair"}
    local = {k: tile(v, kinds[k]) for k, v in full.items()}
    if not check_serial or grid.rank != 0:
        full = {}  # the window below measures the CP run only: no full-size inputs kept around
    sl, zl = local["s"].requires_grad_(True), local["z"].requires_grad_(True)

    def dt(x: torch.Tensor, kind: str):
        return with_layout(from_local(x, grid, PAIR if kind == "pair" else SINGLE), layout, kind)

    fwd_ledger, bwd_ledger = CommLedger(), CommLedger()
    held: list[Any] = []

    def cp_fwd() -> Any:
        with fwd_ledger:
            out = cp(
                dt(sl, "single"), dt(zl, "pair"), dt(local["mask"], "single"), dt(local["pair_mask"], "pair")
            )
        held.append(out)
        return out

    def cp_bwd(out: Any) -> None:
        with bwd_ledger:
            torch.autograd.backward([out[0].to_local(), out[1].to_local()], [local["gs"], local["gz"]])

    cpm = measure(cp_fwd, cp_bwd, device)
    s_out, z_out = held.pop()
    f, b_ = fwd_ledger.summary(), bwd_ledger.summary()
    mine: dict[str, Any] = {
        "saved": cpm["saved_bytes"],
        "peak": cpm["peak_bytes"],
        "rss_peak": cpm["rss_peak_bytes"],
        "rss_reset": cpm["rss_reset"],
        "rss_source": cpm["rss_source"],
        "seconds": cpm["seconds"],
        "comm_fwd": max(f["bytes_sent"], f["bytes_recv"]),
        "comm_fwd_sent": f["bytes_sent"],
        "comm_fwd_recv": f["bytes_recv"],
        "comm_bwd": max(b_["bytes_sent"], b_["bytes_recv"]),
        "padded_tokens": list(layout.padded),
    }
    if not check_serial:
        return mine

    # gather the CP results (collectives on every rank; outside the measured window and ledgers)
    def gather(x: torch.Tensor, kind: str) -> torch.Tensor:
        t = from_local(x.detach(), grid, PAIR if kind == "pair" else SINGLE).full_tensor()
        return t[:, :tokens, :tokens] if kind == "pair" else t[:, :tokens]

    got = {
        "s": gather(s_out.to_local(), "single"),
        "z": gather(z_out.to_local(), "pair"),
        "ds": gather(sl.grad, "single"),
        "dz": gather(zl.grad, "pair"),
    }
    if grid.rank != 0:
        return mine
    serial = serial.to(device)
    ss, zs = full["s"].clone().requires_grad_(True), full["z"].clone().requires_grad_(True)

    def ser_fwd() -> Any:
        held.append(serial(ss, zs, full["mask"], full["pair_mask"]))
        return held[-1]

    def ser_bwd(out: Any) -> None:
        torch.autograd.backward(list(out), [full["gs"], full["gz"]])

    ser = measure(ser_fwd, ser_bwd, device)
    s_ref, z_ref = (t.detach() for t in held.pop())
    cp_grads = dict(cp.named_parameters())
    mine.update(
        err_out=max((got["s"] - s_ref).abs().max().item(), (got["z"] - z_ref).abs().max().item()),
        err_in=max((got["ds"] - ss.grad).abs().max().item(), (got["dz"] - zs.grad).abs().max().item()),
        err_par=max((p.grad - cp_grads[k].grad).abs().max().item() for k, p in serial.named_parameters()),
        ref_scale=max(s_ref.abs().max().item(), z_ref.abs().max().item()),
        serial_saved=ser["saved_bytes"],
        serial_peak=ser["peak_bytes"],
        serial_rss_peak=ser["rss_peak_bytes"],
        serial_seconds=ser["seconds"],
    )
    return mine


FROZEN = "attention.proj_z.0.bias"
BINS = 16


def train_rank(
    tokens: int,
    grid_shape: tuple[int, int],
    cfg: dict[str, Any],
    dtype_name: str,
    check_serial: bool,
    seed: int,
) -> dict[str, Any]:
    """One training step of ``CPTrunk`` on every rank (``--train-step``); this rank's figures."""
    import torch.distributed as dist

    from twinshard.optim import ShardedAdamW
    from twinshard.pair.data_parallel import distribute_batch, dp_train_step
    from twinshard.pair.features import PairLayout, shard_tensor
    from twinshard.pair.reference.distogram import distogram_target
    from twinshard.pair.tiling import padded_tokens
    from twinshard.pair.train import CPTrunk, Trunk, train_step
    from twinshard.runtime.mesh import make_dp_mesh

    dtype = getattr(torch, dtype_name)
    dp_mode = cfg.get("dp", 1) > 1 or cfg.get("shard_optimizer", False)
    mesh = make_dp_mesh(cfg.get("dp", 1), *grid_shape) if dp_mode else None
    grid = mesh.grid if mesh is not None else make_grid(tuple(grid_shape))
    rank0 = dist.get_rank() == 0
    device = get_world().device
    kw = dict(
        num_heads=cfg["heads"],
        dropout=0.25,
        pairwise_head_width=cfg["pair_head_width"],
        pairwise_num_heads=cfg["pair_heads"],
        activation_checkpointing=cfg["checkpointing"],
    )

    def build(cls: type) -> torch.nn.Module:
        torch.manual_seed(seed + 1)  # the same initial weights on every rank
        return cls(cfg["single"], cfg["pair"], cfg["layers"], num_bins=BINS, **kw).to(dtype)

    serial = build(Trunk)
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for p in serial.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=g, dtype=torch.float64).to(dtype))
    cp = build(CPTrunk).to(device)
    cp.load_state_dict(serial.state_dict())
    for m in (serial, cp):
        for k, p in m.named_parameters():
            p.requires_grad_(not k.endswith(FROZEN))
        m.train()
    x = _inputs(cfg, tokens, dtype, seed)
    coords = torch.randn(
        cfg["batch"], tokens, 3, generator=torch.Generator().manual_seed(seed + 3), dtype=torch.float64
    )
    batch = {
        "s": x["s"],
        "z": x["z"],
        "target": distogram_target(coords * 6.0, num_bins=BINS, max_dist=12.0).to(dtype),
        "mask": x["mask"],
        "pair_mask": x["pair_mask"],
    }
    batch = {k: v.to(device) for k, v in batch.items()}
    if mesh is not None:
        sharded = distribute_batch(batch, mesh, n_tokens=tokens)
    else:
        layout = PairLayout.for_sizes(tokens, grid)
        kinds = dict(s="single", z="pair", target="pair", mask="single", pair_mask="pair")
        sharded = {k: shard_tensor(v, kinds[k], grid, layout) for k, v in batch.items()}
    if not check_serial or not rank0:
        batch = {}

    def optimizer(m: torch.nn.Module) -> torch.optim.Optimizer:
        return torch.optim.AdamW([p for p in m.parameters() if p.requires_grad], lr=1e-3, weight_decay=0.05)

    if mesh is not None and cfg.get("shard_optimizer", False):
        opt: Any = ShardedAdamW(
            cp.parameters(),
            mesh,
            lr=1e-3,
            weight_decay=0.05,
            shard_grads_in_backward=cfg.get("shard_grads", "during") == "during",
        )
    else:
        opt = optimizer(cp)
    ledger = CommLedger()
    held: list[torch.Tensor] = []

    def cp_step() -> torch.Tensor:
        with ledger:
            if mesh is not None:
                held.append(dp_train_step(cp, opt, sharded, seed=seed + 100, mesh=mesh))
            else:
                held.append(train_step(cp, opt, sharded, seed=seed + 100))
        return held[-1]

    cpm = measure(cp_step, lambda loss: None, device)
    loss_cp = held.pop()
    f = ledger.summary()
    mine: dict[str, Any] = {
        "saved": cpm["saved_bytes"],
        "peak": cpm["peak_bytes"],
        "rss_peak": cpm["rss_peak_bytes"],
        "rss_reset": cpm["rss_reset"],
        "rss_source": cpm["rss_source"],
        "seconds": cpm["seconds"],
        "comm_fwd": max(f["bytes_sent"], f["bytes_recv"]),
        "comm_fwd_sent": f["bytes_sent"],
        "comm_fwd_recv": f["bytes_recv"],
        "comm_bwd": 0,
        "padded_tokens": list(padded_tokens(tokens, grid)),
        "parameter_bytes": sum(p.numel() * p.element_size() for p in cp.parameters()),
    }
    if not check_serial or not rank0:
        return mine
    serial = serial.to(device)
    sopt = optimizer(serial)
    ser = measure(
        lambda: held.append(train_step(serial, sopt, batch, seed=seed + 100)) or held[-1],
        lambda loss: None,
        device,
    )
    loss_ser = held.pop()
    cp_w = dict(cp.named_parameters())
    mine.update(
        err_out=abs(float(loss_cp) - float(loss_ser)),
        err_in=None,
        err_par=max((p.detach() - cp_w[k].detach()).abs().max().item() for k, p in serial.named_parameters()),
        ref_scale=abs(float(loss_ser)),
        serial_saved=ser["saved_bytes"],
        serial_peak=ser["peak_bytes"],
        serial_rss_peak=ser["rss_peak_bytes"],
        serial_seconds=ser["seconds"],
    )
    return mine


def summarise(
    tokens: int,
    shape: tuple[int, int],
    cfg: dict[str, Any],
    a: argparse.Namespace,
    ranks: list[dict[str, Any]],
) -> dict[str, Any]:
    """The JSON object: ``twinshard bench pair``'s keys (op ``pairformer``) plus the trunk's."""
    P = shape[0] * shape[1] * cfg.get("dp", 1)
    item = torch.tensor([], dtype=getattr(torch, a.dtype)).element_size()
    lower = 2 * cfg["layers"] * 2 * cfg["batch"] * tokens * tokens * cfg["pair"] / math.sqrt(P) * item
    r0 = ranks[0]
    saved = [r["saved"] for r in ranks]
    comm = [r["comm_fwd"] for r in ranks]
    serial_saved = r0.get("serial_saved")
    return {
        "op": "pairformer",
        "grid": f"{shape[0]}x{shape[1]}",
        "tokens": tokens,
        "dtype": a.dtype,
        "padded_tokens": r0["padded_tokens"],
        "channels": cfg["pair"],
        "hidden": cfg["pair_head_width"] * cfg["pair_heads"],
        "sequences": None,
        "batch": cfg["batch"],
        "schedule": schedule_name(shape),
        "layers": cfg["layers"],
        "single_channels": cfg["single"],
        "heads": cfg["heads"],
        "pair_head_width": cfg["pair_head_width"],
        "pair_heads": cfg["pair_heads"],
        "checkpointing": cfg["checkpointing"],
        "train_step": cfg.get("train_step", False),
        "dp": cfg.get("dp", 1),
        "shard_optimizer": cfg.get("shard_optimizer", False),
        "shard_grads": cfg.get("shard_grads") if cfg.get("shard_optimizer", False) else None,
        "parameter_bytes": r0.get("parameter_bytes"),
        "check_serial": serial_saved is not None,
        "max_abs_error_out": r0.get("err_out"),
        "max_abs_error_grad_inputs": r0.get("err_in"),
        "max_abs_error_grad_params": r0.get("err_par"),
        "reference_max_abs_out": r0.get("ref_scale"),
        "saved_bytes_per_rank": saved,
        "serial_saved_bytes": serial_saved,
        "saved_ratio_vs_serial_over_p": max(saved) / (serial_saved / P) if serial_saved else None,
        "peak_memory_bytes_per_rank": [r["peak"] for r in ranks],
        "serial_peak_memory_bytes": r0.get("serial_peak"),
        "peak_rss_bytes_per_rank": [r["rss_peak"] for r in ranks],
        "rss_reset_per_rank": [r["rss_reset"] for r in ranks],
        "rss_source": r0["rss_source"],
        "serial_peak_rss_bytes": r0.get("serial_rss_peak"),
        "comm_bytes_model": BYTES_MODEL,
        "comm_bytes_per_rank": comm,
        "comm_bytes_sent_per_rank": [r["comm_fwd_sent"] for r in ranks],
        "comm_bytes_recv_per_rank": [r["comm_fwd_recv"] for r in ranks],
        "comm_backward_bytes_per_rank": [r["comm_bwd"] for r in ranks],
        "ledger_bytes_per_rank": [r["comm_fwd"] + r["comm_bwd"] for r in ranks],
        "comm_lower_bound_bytes": lower,
        "comm_ratio_vs_lower_bound": max(comm) / lower if P > 1 else 0.0,
        "seconds_per_rank": [r["seconds"] for r in ranks],
        "serial_seconds": r0.get("serial_seconds"),
    }


def config(a: argparse.Namespace) -> dict[str, Any]:
    cfg = {
        "single": a.single_channels,
        "pair": a.pair_channels,
        "heads": a.heads,
        "pair_head_width": a.pair_head_width,
        "pair_heads": a.pair_heads,
        "layers": a.layers,
        "batch": a.batch,
        "checkpointing": bool(a.checkpointing),
    }
    for k, v in cfg.items():
        if k not in ("checkpointing", "train_step") and (not isinstance(v, int) or v < 1):
            raise ValueError(f"--{k.replace('_', '-')} must be a positive integer, got {v!r}")
    if cfg["single"] % cfg["heads"]:
        raise ValueError(f"--single-channels {cfg['single']} must be a multiple of --heads {cfg['heads']}")
    return cfg


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Run the trunk (spawning rows x cols local ranks unless already in such a world): the
    whole Boltz-2 trunk, or with ``--pairformer-only`` / ``--train-step`` the Pairformer stack."""
    shape = parse_grid(args.grid)
    if args.tokens < 1:
        raise ValueError("--tokens must be positive")
    mode = dtype_default(args.dtype, getattr(args, "precision", None), "fp32")
    args.precision, args.dtype = mode.name, str(mode.param_dtype).removeprefix("torch.")
    if not (getattr(args, "pairformer_only", False) or getattr(args, "train_step", False)):
        return run_whole(args, shape)
    cfg = config(args)
    cfg["train_step"] = bool(getattr(args, "train_step", False))
    dp, shard = int(getattr(args, "dp", 1)), bool(getattr(args, "shard_optimizer", False))
    if (dp != 1 or shard) and not cfg["train_step"]:
        raise ValueError("--dp and --shard-optimizer apply to --train-step")
    if dp < 1 or dp > cfg["batch"]:
        raise ValueError(
            f"--dp must be between 1 and --batch ({cfg['batch']}): each replica takes >= 1 structure"
        )
    grads = getattr(args, "shard_grads", "during")
    if grads != "during" and not shard:
        raise ValueError("--shard-grads applies to --shard-optimizer")
    if cfg["train_step"]:
        cfg.update(dp=dp, shard_optimizer=shard, shard_grads=grads)
    call = (args.tokens, shape, cfg, args.dtype, bool(args.check_serial), args.seed)
    fn = train_rank if cfg["train_step"] else trunk_rank
    option = "--grid" if dp == 1 else "--dp x --grid"
    ranks = run_ranks(
        run_in_mode, dp * shape[0] * shape[1], args.precision, fn, *call, option=option, deadline=args.timeout
    )
    if not reports():  # rank 0 of the world summarises and prints
        return {}
    result = summarise(args.tokens, shape, cfg, args, ranks) | {"precision": args.precision}
    if not getattr(args, "json", False):
        for k, v in result.items():
            if not isinstance(v, list):
                print(f"{k:32s} {v}")
        print(f"{'peak_memory_bytes_per_rank':32s} {result['peak_memory_bytes_per_rank']}")
    print(json.dumps(result))
    return result


def run_whole(args: argparse.Namespace, shape: tuple[int, int]) -> dict[str, Any]:
    """The whole Boltz-2 trunk (``twinshard.bench.whole_trunk``) on rows x cols ranks."""
    import os

    from twinshard.bench import whole_trunk as W

    o = W.options(args)
    if args.repeats < 0:
        raise ValueError("--repeats must not be negative")
    nranks = shape[0] * shape[1]
    threads = max(1, min(nranks, os.cpu_count() or 1))
    call = (args.tokens, shape, o, args.dtype, bool(args.check_serial), args.seed, args.repeats, 0, threads)
    ranks = run_ranks(
        run_in_mode, nranks, args.precision, W.whole_rank, *call, option="--grid", deadline=args.timeout
    )
    if not reports():
        return {}
    result = W.summarise(args.tokens, shape, o, args.dtype, ranks, threads) | {"precision": args.precision}
    if not getattr(args, "json", False):
        for k, v in result.items():
            if not isinstance(v, (list, dict)):
                print(f"{k:36s} {v}")
        print(f"{'peak_memory_bytes_per_rank':36s} {result['peak_memory_bytes_per_rank']}")
    print(json.dumps(result))
    return result
