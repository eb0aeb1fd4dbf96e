"""The trunk ops of ``twinshard bench pair``: triangle attention, attention with pair bias, the
Pairformer layer (``--op triattn-start | triattn-end | attn-pair-bias | pairformer``).

:func:`bench_rank_op` returns, per rank, the figures ``twinshard.bench.pair.bench_rank`` returns
for the triangle multiplication (same keys, same measurement rules: saved bytes, peak tensor and
resident memory over forward + backward, the forward's and the backward's ledger bytes, errors
against the serial module run on every rank with the same weights and inputs). Sizes: ``N`` =
``--tokens`` (padded internally), ``c_z`` = ``--channels``; ``--hidden`` is the triangle
attention's head width (2 heads) and half the single width of the attention with pair bias
(``c_s = 2 h``, 2 heads); the Pairformer layer uses both (``token_s = 2 h``, ``token_z = c``,
dropout off). Inputs: random pair (and single) representations, a random pair mask with its
diagonal kept (triangle attention), a random token mask (attention with pair bias; the
Pairformer layer gets the pair mask it implies), one random grad_output per output.

:func:`plot_memory_and_bytes` draws, for runs on several grids, the peak tensor memory and
saved bytes per rank and the ledger bytes per rank (forward, backward) against the number of
ranks, beside the ideal curves: serial / P for memory and the 2-D bound ``~ N^2 / sqrt(P)``
(scaled to the first multi-rank run) for bytes.
"""

from __future__ import annotations

import math
from typing import Any

import torch

__all__ = ["TRUNK_OPS", "bench_rank_op", "plot_memory_and_bytes"]

TRUNK_OPS = ("triattn-start", "triattn-end", "attn-pair-bias", "pairformer")


def _build(op: str, c: int, h: int, dtype: torch.dtype, seed: int) -> tuple[torch.nn.Module, torch.nn.Module]:
    from twinshard.pair import layers as L
    from twinshard.pair import reference as R

    torch.manual_seed(seed + 1)  # the same weights on every rank
    if op in ("triattn-start", "triattn-end"):
        start = op == "triattn-start"
        serial = (R.TriangleAttentionStartingNode if start else R.TriangleAttentionEndingNode)(c, h, 2)
        cp = (L.CPTriangleAttentionStartingNode if start else L.CPTriangleAttentionEndingNode)(c, h, 2)
    elif op == "attn-pair-bias":
        serial, cp = R.AttentionPairBias(2 * h, c, 2), L.CPAttentionPairBias(2 * h, c, 2)
    elif op == "pairformer":
        from twinshard.pair.layers.pairformer import CPPairformerLayer

        kw = dict(num_heads=2, dropout=0.0, pairwise_head_width=h, pairwise_num_heads=2)
        serial, cp = R.PairformerLayer(2 * h, c, **kw), CPPairformerLayer(2 * h, c, **kw)
        R.assign_dropout_streams(serial)
        R.assign_dropout_streams(cp)
    else:
        raise ValueError(f"op must be one of {TRUNK_OPS}, got {op!r}")
    serial = serial.to(dtype)
    g = torch.Generator().manual_seed(seed + 2)
    with torch.no_grad():  # move off the zero (output, gate) and unit (norm) inits
        for p in serial.parameters():
            p.add_(0.2 * torch.randn(p.shape, generator=g, dtype=torch.float64).to(dtype))
    cp = cp.to(dtype)
    cp.load_state_dict(serial.state_dict())
    return serial, cp


def _inputs(
    op: str, b: int, n: int, c: int, h: int, dtype: torch.dtype, seed: int
) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g, dtype=torch.float64).to(dtype)

    x = {"z": randn(b, n, n, c)}
    if op in ("triattn-start", "triattn-end"):
        pm = (torch.rand(b, n, n, generator=g) > 0.15).to(dtype)
        pm[:, torch.arange(n), torch.arange(n)] = 1
        x |= {"pair_mask": pm, "g_out": randn(b, n, n, c)}
        return x
    x["s"] = randn(b, n, 2 * h)
    mask = (torch.rand(b, n, generator=g) > 0.15).to(dtype)
    mask[:, 0] = 1
    x["mask"] = mask
    x["g_s"] = randn(b, n, 2 * h)
    if op == "pairformer":
        x |= {"pair_mask": mask[:, :, None] * mask[:, None, :], "g_z": randn(b, n, n, c)}
    return x


KINDS = {
    "z": "pair",
    "pair_mask": "pair",
    "g_out": "pair",
    "g_z": "pair",
    "s": "single",
    "mask": "single",
    "g_s": "single",
}


def _call(op: str, m: torch.nn.Module, x: dict[str, Any]) -> tuple:
    if op in ("triattn-start", "triattn-end"):
        return (m(x["z"], x["pair_mask"]),)
    if op == "attn-pair-bias":
        return (m(x["s"], x["z"], x["mask"]),)
    return tuple(m(x["s"], x["z"], x["mask"], x["pair_mask"]))


def _grads(op: str) -> tuple[str, ...]:
    return {"attn-pair-bias": ("g_s",), "pairformer": ("g_s", "g_z")}.get(op, ("g_out",))


def bench_rank_op(
    op: str,
    tokens: int,
    grid_shape: tuple[int, int],
    dtype_name: str = "float64",
    channels: int = 8,
    hidden: int = 8,
    sequences: int = 6,
    batch: int = 1,
    seed: int = 0,
    *_: Any,
    **__: Any,
) -> dict[str, Any]:
    """This rank's figures for a trunk op (the keys of ``twinshard.bench.pair.bench_rank``; no
    timed repeats: ``seconds_runs`` is empty)."""
    from twinshard.bench.measure import measure, rank_figures
    from twinshard.comm import CommLedger
    from twinshard.pair.features import PairLayout, with_layout
    from twinshard.pair.tiling import PAIR, SINGLE, from_local, local_block
    from twinshard.runtime import get_world, make_grid

    dtype = getattr(torch, dtype_name)
    grid = make_grid(tuple(grid_shape))
    device = get_world().device
    serial, cp = (m.to(device) for m in _build(op, channels, hidden, dtype, seed))
    full = {k: v.to(device) for k, v in _inputs(op, batch, tokens, channels, hidden, dtype, seed).items()}
    diff = ("z",) if op.startswith("triattn") else ("s", "z")
    gnames = _grads(op)
    held: list[Any] = []

    # serial, on every rank
    leaves = {k: (v.clone().requires_grad_(True) if k in diff else v) for k, v in full.items()}

    def ser_fwd() -> Any:
        held.append(_call(op, serial, leaves))
        return held[-1]

    ser = measure(
        ser_fwd,
        lambda o: torch.autograd.backward(list(o), [full[g] for g in gnames]),
        device,
        list(serial.parameters()),
    )
    out_serial = [o.detach() for o in held.pop()]

    # CP: the padded inputs' tiles, with the layout attached (padding masked from it)
    layout = PairLayout.for_sizes(tokens, grid)

    def tile(v: torch.Tensor, kind: str) -> torch.Tensor:
        return local_block(layout.pad(v, kind), grid, PAIR if kind == "pair" else SINGLE)

    local = {k: tile(v, KINDS[k]) for k, v in full.items()}
    for k in diff:
        local[k].requires_grad_(True)

    def dt(k: str) -> Any:
        kind = KINDS[k]
        return with_layout(from_local(local[k], grid, PAIR if kind == "pair" else SINGLE), layout, kind)

    fwd_ledger, bwd_ledger = CommLedger(), CommLedger()

    def cp_fwd() -> Any:
        with fwd_ledger:
            held.append(_call(op, cp, {k: dt(k) for k in local if not k.startswith("g_")}))
        return held[-1]

    def cp_bwd(o: Any) -> None:
        with bwd_ledger:
            torch.autograd.backward([t.to_local() for t in o], [local[g] for g in gnames])

    cpm = measure(cp_fwd, cp_bwd, device, list(cp.parameters()))
    outs = held.pop()

    def gather(t: torch.Tensor, kind: str) -> torch.Tensor:
        f = from_local(t.detach(), grid, PAIR if kind == "pair" else SINGLE).full_tensor()
        return f[:, :tokens, :tokens] if kind == "pair" else f[:, :tokens]

    out_kinds = [KINDS[g] for g in gnames]
    err_out = max(
        (gather(o.to_local(), k) - e).abs().max().item() for o, k, e in zip(outs, out_kinds, out_serial)
    )
    err_in = max((gather(local[k].grad, KINDS[k]) - leaves[k].grad).abs().max().item() for k in diff)
    err_par = max((a.grad - b.grad).abs().max().item() for a, b in zip(serial.parameters(), cp.parameters()))
    f, b_ = fwd_ledger.summary(), bwd_ledger.summary()
    untimed = {"seconds_runs": [], "serial_seconds_runs": [], "matmul_gflops": None}
    return {**untimed, **rank_figures(err_out, err_in, err_par, cpm, ser, f, b_, layout.padded)}


def plot_memory_and_bytes(results: list[dict[str, Any]], path: str) -> None:
    """Per-rank peak memory, saved bytes and ledger bytes against the number of ranks (one
    ``twinshard bench pair`` result per grid), beside serial / P and ``N^2 / sqrt(P)``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rs = sorted(results, key=lambda r: len(r["saved_bytes_per_rank"]))
    ps = [len(r["saved_bytes_per_rank"]) for r in rs]
    mib = 2.0**20
    fig, (ax_m, ax_b) = plt.subplots(1, 2, figsize=(10, 4))
    ax_m.plot(
        ps,
        [max(r["peak_memory_bytes_per_rank"]) / mib for r in rs],
        "o-",
        label="peak tensor memory per rank",
    )
    ax_m.plot(
        ps, [max(r["saved_bytes_per_rank"]) / mib for r in rs], "s-", label="saved for backward per rank"
    )
    ser_peak, ser_saved = rs[0]["serial_peak_memory_bytes"], rs[0]["serial_saved_bytes"]
    if ser_peak:
        ax_m.plot(ps, [ser_peak / mib / p for p in ps], "k--", label="ideal: serial peak / P")
    if ser_saved:
        ax_m.plot(ps, [ser_saved / mib / p for p in ps], "k:", label="ideal: serial saved / P")
    ax_m.set_ylabel("MiB per rank")
    multi = [(p, r) for p, r in zip(ps, rs) if p > 1]  # one rank moves nothing
    if multi:
        mp = [p for p, _ in multi]
        ax_b.plot(
            mp,
            [max(r["comm_bytes_per_rank"]) / mib for _, r in multi],
            "o-",
            label="ledger bytes per rank, forward",
        )
        ax_b.plot(
            mp,
            [max(r["comm_backward_bytes_per_rank"]) / mib for _, r in multi],
            "s-",
            label="ledger bytes per rank, backward",
        )
        ax_b.plot(
            [p for p, _ in multi],
            [r["comm_lower_bound_bytes"] / mib for _, r in multi],
            "k--",
            label="2-D bound ~ N^2 / sqrt(P)",
        )
    ax_b.set_ylabel("MiB per rank")
    for ax in (ax_m, ax_b):
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xticks(ps, [r["grid"] for r in rs])
        ax.minorticks_off()
        ax.set_xlabel("grid (ranks)")
        ax.legend(fontsize=7)
    r0 = rs[0]
    fig.suptitle(f"{r0['op']} N={r0['tokens']} c={r0['channels']} h={r0['hidden']} {r0['dtype']}")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def lower_bound_bytes(
    op: str, batch: int, tokens: int, channels: int, hidden: int, p: int, item: int
) -> float:
    """The 2-D bound per rank used for these ops: ``2 B N^2 w / sqrt(P)`` elements, ``w`` the
    channels that travel (keys + values of the triangle attention, ``2 x 2 h``; the pair bias
    heads of the attention with pair bias, 2; both triangle multiplications of a layer, ``2 c``)."""
    w = {
        "triattn-start": 4 * hidden,
        "triattn-end": 4 * hidden,
        "attn-pair-bias": 2,
        "pairformer": 2 * channels,
    }[op]
    return 2 * batch * tokens * tokens * w / math.sqrt(p) * item
