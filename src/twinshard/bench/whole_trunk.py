"""The whole Boltz-2 trunk, measured: ``twinshard trunk`` (its default mode) and ``twinshard bench
pair --op trunk``.

One random-weight ``CPBoltz2Trunk`` (``twinshard.pair.layers.trunk``; Boltz-2's modules at the
widths given, dropout off, weights from ``--seed``: Boltz2's initialisation moved by ``0.1 N(0,
1)`` so that the zero-initialised projections and gates carry gradients) runs forward and backward
on the synthetic complex of ``twinshard.pair.synthetic.synthetic_complex`` (N tokens in three
chains, the last a ligand; protein tokens with ``K - 2 .. K + 2`` atoms, ligand tokens one; an MSA
of S sequences with deletions; T templates), placed by the production
``twinshard.pair.features.distribute`` (``src=None``: ``ref_pos`` is a leaf that requires grad,
its full gradient summed over the grid by ``collect_grad``). One random grad_output each for
``s``, ``z`` and ``pdistogram``. Per rank:

- ``saved``/``peak``/``rss_peak``: ``twinshard.bench.pair.measure`` over forward + backward
  (saved-for-backward bytes, the profiler's tensor peak above the window's start, VmHWM); the
  features' tiles and grad_output tiles are built before the window opens;
- the forward's and the backward's ``CommLedger`` (totals and per op name), and beside the
  forward's, :func:`model_bytes`: the bytes each new collective should receive on this rank;
- with ``check_serial``: the serial ``Boltz2Trunk`` with the same weights on rank 0 on the full
  features (outputs ``s_inputs, s, z, pdistogram``, the gradient of ``ref_pos``, every parameter
  gradient by name), measured the same way;
- with ``repeats``: the wall time of forward + backward without the profiler (slowest rank) and
  of the serial trunk on rank 0 given ``threads`` intra-op threads while the other ranks wait.
"""

from __future__ import annotations

import argparse
import math
import statistics
import time
from typing import Any

import torch

__all__ = [
    "add_trunk_options",
    "features",
    "model_bytes",
    "options",
    "summarise",
    "trunk_config",
    "whole_rank",
]

# (flag, default, help); dest is the flag without dashes, "-" -> "_"
TRUNK_OPTIONS: tuple[tuple[str, int, str], ...] = (
    ("--atoms-per-token", 8, "mean atoms of a protein token K (drawn from K-2 .. K+2; ligand tokens: 1)"),
    ("--msa", 8, "MSA depth S"),
    ("--templates", 2, "templates T (0 is valid)"),
    ("--chains", 3, "chains of the synthetic complex (the last a ligand when >= 2)"),
    ("--recycling", 0, "recycling steps (gradients through the last cycle only, as Boltz)"),
    ("--layers", 2, "Pairformer blocks"),
    ("--msa-blocks", 1, "MSA module blocks"),
    ("--template-blocks", 1, "template module Pairformer blocks"),
    ("--atom-blocks", 1, "atom encoder depth (atom transformer layers)"),
    ("--single-channels", 64, "c_s (token_s)"),
    ("--pair-channels", 32, "c_z (token_z)"),
    ("--atom-channels", 32, "atom_s"),
    ("--atom-pair-channels", 8, "atom_z"),
    ("--msa-channels", 16, "msa_s"),
    ("--template-channels", 16, "template_dim"),
    ("--bins", 64, "distogram bins"),
    ("--heads", 4, "heads of the attention with pair bias"),
    ("--pair-heads", 4, "triangle attention heads"),
    ("--pair-head-width", 16, "triangle attention head width"),
    ("--atom-heads", 2, "atom attention heads"),
    ("--msa-heads", 4, "pair-weighted averaging heads"),
    ("--msa-head-width", 8, "pair-weighted averaging head width"),
    ("--opm-hidden", 8, "outer product mean hidden channels"),
)


def _dest(flag: str) -> str:
    return flag.lstrip("-").replace("-", "_")


def add_trunk_options(p: argparse.ArgumentParser, skip: tuple[str, ...] = ()) -> None:
    """Add the whole trunk's size and width options (those in ``skip`` or already there excepted)."""
    have = {a.dest for a in p._actions}
    for flag, default, text in TRUNK_OPTIONS:
        if flag in skip or _dest(flag) in have:
            continue
        p.add_argument(flag, type=int, default=default, help=f"{text} (whole trunk; default {default})")


def options(a: argparse.Namespace, msa: int | None = None) -> dict[str, Any]:
    """The whole trunk's settings from parsed arguments, checked (ValueError: a one-line message)."""
    o = {_dest(flag): getattr(a, _dest(flag), None) for flag, _, _ in TRUNK_OPTIONS}
    if msa is not None:
        o["msa"] = msa
    o["batch"] = getattr(a, "batch", 1)
    o["checkpointing"] = bool(getattr(a, "checkpointing", False))
    for k, v in o.items():
        if k == "checkpointing":
            continue
        low = 0 if k in ("templates", "recycling") else 1
        if not isinstance(v, int) or v < low:
            raise ValueError(f"--{k.replace('_', '-')} must be an integer >= {low}, got {v!r}")
    if o["atoms_per_token"] > 24:
        raise ValueError(
            f"--atoms-per-token must be at most 24 (a protein residue), got {o['atoms_per_token']}"
        )
    for width, heads in (("single_channels", "heads"), ("atom_channels", "atom_heads")):
        if o[width] % o[heads]:
            raise ValueError(
                f"--{width.replace('_', '-')} {o[width]} must be a multiple of --{heads.replace('_', '-')} {o[heads]}"
            )
    return o


def trunk_config(o: dict[str, Any]) -> Any:
    """The ``TrunkConfig`` (Boltz-2's structure: template v2, cyclic positions, bond types, the
    embedder's method/modified/cyclic/mol-type conditionings) at the widths of ``o``."""
    from twinshard.pair.reference.trunk import TrunkConfig

    ckpt = o["checkpointing"]
    tri = {"pairwise_head_width": o["pair_head_width"], "pairwise_num_heads": o["pair_heads"]}
    return TrunkConfig(
        atom_s=o["atom_channels"],
        atom_z=o["atom_pair_channels"],
        token_s=o["single_channels"],
        token_z=o["pair_channels"],
        num_bins=o["bins"],
        atom_feature_dim=388,
        embedder_args={
            "atom_encoder_depth": o["atom_blocks"],
            "atom_encoder_heads": o["atom_heads"],
            "add_method_conditioning": True,
            "add_modified_flag": True,
            "add_cyclic_flag": True,
            "add_mol_type_feat": True,
        },
        msa_args={
            "msa_s": o["msa_channels"],
            "msa_blocks": o["msa_blocks"],
            "msa_dropout": 0.0,
            "z_dropout": 0.0,
            "use_paired_feature": True,
            "pwa_heads": o["msa_heads"],
            "pwa_head_width": o["msa_head_width"],
            "opm_hidden": o["opm_hidden"],
            "activation_checkpointing": ckpt,
            **tri,
        },
        pairformer_args={
            "num_blocks": o["layers"],
            "num_heads": o["heads"],
            "dropout": 0.0,
            "post_layer_norm": False,
            "v2": True,
            "activation_checkpointing": ckpt,
            **tri,
        },
        template_args={
            "template_dim": o["template_channels"],
            "template_blocks": o["template_blocks"],
            "dropout": 0.0,
            "activation_checkpointing": ckpt,
            **tri,
        },
        use_templates=True,
        use_templates_v2=True,
        fix_sym_check=True,
        cyclic_pos_enc=True,
        bond_type_feature=True,
    )


def features(tokens: int, o: dict[str, Any], dtype: torch.dtype, seed: int) -> dict[str, torch.Tensor]:
    """The synthetic complex of the run (module docstring)."""
    from twinshard.pair.synthetic import synthetic_complex

    k = o["atoms_per_token"]
    return synthetic_complex(
        tokens,
        atoms_per_token=(max(1, k - 2), min(24, k + 2)),
        msa_depth=o["msa"],
        templates=o["templates"],
        chains=min(o["chains"], tokens),
        batch=o["batch"],
        seed=seed,
        dtype=dtype,
    )


def _build(o: dict[str, Any], dtype: torch.dtype, seed: int):
    from twinshard.pair.layers.trunk import CPBoltz2Trunk
    from twinshard.pair.reference.trunk import Boltz2Trunk

    cfg = trunk_config(o)
    torch.manual_seed(seed + 1)  # the same initial weights on every rank (the twin loads them)
    serial = Boltz2Trunk(cfg).to(dtype)
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():  # zero inits (output projections, gates) would hide most of the backward
        for p in serial.parameters():
            p.add_(0.1 * torch.randn(p.shape, generator=g, dtype=torch.float64).to(dtype))
    cp = CPBoltz2Trunk(cfg).to(dtype)
    cp.load_state_dict(serial.state_dict())
    return serial, cp


OUTS = ("s", "z", "pdistogram")
KIND = {"s_inputs": "single", "s": "single", "z": "pair", "pdistogram": "pair"}


def _grad_outputs(tokens: int, o: dict[str, Any], dtype: torch.dtype, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed + 7)
    b, n = o["batch"], tokens

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g, dtype=torch.float64).to(dtype)

    return {
        "s": randn(b, n, o["single_channels"]),
        "z": randn(b, n, n, o["pair_channels"]),
        "pdistogram": randn(b, n, n, 1, o["bins"]),
    }


# -- the byte model of the trunk's new collectives ---------------------------------------------


def _column_rows(grid_shape: tuple[int, int], coords: tuple[int, int], padded: tuple[int, int]) -> int:
    """Rows a rank receives in one column move (``pair.layers.moves``): its column block J_c of
    the single track, from the rows' owners (a, (r + c) mod C), less the rows it sends itself
    and the padding rows beyond Nr that no single block holds."""
    (R, C), (r, c) = grid_shape, coords
    nI, nJ = padded[0] // R, padded[1] // C
    rows = 0
    for a in range(R):
        if a == r and (r + c) % C == c:
            continue  # the sender is this rank: a local copy
        rows += max(0, min((a + 1) * nI, (c + 1) * nJ) - max(a * nI, c * nJ))
    return rows


def _halo_atoms(layout: Any, row: int, w: int = 32, h: int = 128) -> int:
    """Atoms grid row ``row`` receives per halo exchange: the keys of its atoms' windows (window
    k: queries [W k, W k + W), keys [W k - m, W k + W + m), m = (H - W) / 2, clipped to [0, A))
    less its own atoms, summed over the batch."""
    m = (h - w) // 2
    total = 0
    for b in range(len(layout.atom_starts)):
        s, n = layout.atom_starts[b][row], layout.atom_counts[b][row]
        if n == 0:
            continue
        lo, hi = max(0, w * (s // w) - m), min(layout.n_atoms, w * ((s + n - 1) // w) + w + m)
        total += (hi - lo) - max(0, min(hi, s + n) - max(lo, s))
    return total


def model_bytes(
    o: dict[str, Any],
    layout: Any,
    grid_shape: tuple[int, int],
    coords: tuple[int, int],
    item: int,
    cyclic: bool,
) -> dict[str, dict[str, Any]]:
    """The forward bytes this rank should RECEIVE per new collective of the trunk (op name ->
    ``{"recv": bytes, "model": formula}``); ``item`` the float dtype's size. Cycles: R + 1."""
    R, C = grid_shape
    B, T, cyc = o["batch"], o["templates"], o["recycling"] + 1
    rows = _column_rows(grid_shape, coords, layout.padded)
    nr, nc = layout.padded
    sp = layout.s_padded
    out: dict[str, dict[str, Any]] = {}
    if R > 1:
        halo = _halo_atoms(layout, coords[0])
        ch = 5 + o["atom_channels"] + o["atom_blocks"] * o["atom_channels"]
        out["embed:halo"] = {
            "recv": halo * ch * item,
            "model": "halo atoms x (5 + atom_s [static keys] + depth x atom_s [one per layer]) x item; "
            "halo = keys of my windows (32 queries, 128 keys) not mine",
            "halo_atoms": halo,
        }
    col = "J_c rows not sent by myself x B x "
    out["z_init:columns"] = {"recv": rows * B * o["pair_channels"] * item, "model": col + "token_z x item"}
    out["relpos:columns"] = {"recv": rows * B * 5 * 8, "model": col + "5 int64 indices"}
    if cyclic:
        out["relpos:cyclic_period"] = {"recv": rows * B * item, "model": col + "1 x item"}
        out["relpos:cyclic_any"] = {
            "recv": 2 * (R - 1) * 4 // R,
            "model": "ring all-reduce of 1 fp32 along the column",
        }
    out["msa:s_proj"] = {
        "recv": cyc * rows * B * o["msa_channels"] * item,
        "model": "cycles x " + col + "msa_s x item",
    }
    out["msa:token_mask"] = {"recv": cyc * rows * B * item, "model": "cycles x " + col + "1 x item"}
    out["template:columns"] = {
        "recv": cyc * rows * B * T * 51 * item,
        "model": "cycles x "
        + col
        + "T x 51 (frame 9, origin 3, CB 3, 2 masks, 33 restype, visibility) x item",
    }
    out["template:counted"] = {
        "recv": cyc * (2 * (R - 1) * B * T * 4 // R),
        "model": "cycles x ring all-reduce of [B, T] fp32 along the column",
    }
    H, ch = o["msa_heads"], o["msa_head_width"]
    out["pwa (contraction)"] = {
        "recv": cyc * o["msa_blocks"] * B * H * (sp * ch * nc // R + nr * nc // C) * item,
        "model": "cycles x blocks x B H (S c_h Nc / R + Nr Nc / C) x item (the contraction's M K / R + K N / C)",
        "ops_prefix": "pwa:",
        "ops_exclude": ("pwa:logit_max", "pwa:mask_max", "pwa:normaliser"),
    }
    return out


# -- one rank ----------------------------------------------------------------------------------


def whole_rank(
    tokens: int,
    grid_shape: tuple[int, int],
    o: dict[str, Any],
    dtype_name: str,
    check_serial: bool,
    seed: int,
    repeats: int = 0,
    warmup: int = 0,
    threads: int = 1,
) -> dict[str, Any]:
    """Run on every rank of a world of rows x cols ranks; returns this rank's figures."""
    from twinshard.bench.measure import measure
    from twinshard.comm import CommLedger
    from twinshard.pair.features import collect_grad, collect_tensor, distribute, shard_tensor
    from twinshard.runtime import get_world, make_grid

    dtype = getattr(torch, dtype_name)
    grid = make_grid(tuple(grid_shape))
    device = get_world().device
    serial, cp = _build(o, dtype, seed)
    cp = cp.to(device)
    feats = {k: v.to(device) for k, v in features(tokens, o, dtype, seed).items()}
    n_atoms = feats["ref_pos"].shape[1]
    real_atoms = int(feats["atom_pad_mask"].sum())
    cyclic = bool((feats["cyclic_period"] > 0).any())
    pos = feats["ref_pos"].clone().requires_grad_(True)
    fd = distribute(feats | {"ref_pos": pos}, grid)
    layout = fd.layout
    gfull = {k: v.to(device) for k, v in _grad_outputs(tokens, o, dtype, seed).items()}
    gl = {k: shard_tensor(v, KIND[k], grid, layout).to_local() for k, v in gfull.items()}
    keep = check_serial and grid.rank == 0
    if not keep:
        feats, gfull = {}, {}  # the window measures the CP run only: no full-size tensors kept
    fwd_ledger, bwd_ledger = CommLedger(), CommLedger()
    held: list[Any] = []
    R = o["recycling"]

    def cp_fwd() -> Any:
        with fwd_ledger:
            held.append(cp(fd, recycling_steps=R))
        return held[-1]

    def cp_bwd(out: Any) -> None:
        with bwd_ledger:
            torch.autograd.backward([out[k].to_local() for k in OUTS], [gl[k] for k in OUTS])

    cpm = measure(cp_fwd, cp_bwd, device, list(cp.parameters()))
    out = held.pop()
    f, b_ = fwd_ledger.summary(), bwd_ledger.summary()
    item = torch.tensor([], dtype=dtype).element_size()
    mine: dict[str, Any] = {
        "saved": cpm["saved_bytes"],
        "saved_activations": cpm["saved_activation_bytes"],
        "peak": cpm["peak_bytes"],
        "rss_peak": cpm["rss_peak_bytes"],
        "rss_reset": cpm["rss_reset"],
        "rss_source": cpm["rss_source"],
        "seconds": cpm["seconds"],
        "comm_fwd": max(f["bytes_sent"], f["bytes_recv"]),
        "comm_fwd_sent": f["bytes_sent"],
        "comm_fwd_recv": f["bytes_recv"],
        "comm_bwd": max(b_["bytes_sent"], b_["bytes_recv"]),
        "ops_fwd": {k: [v["bytes_sent"], v["bytes_recv"], v["calls"]] for k, v in f["ops"].items()},
        "ops_bwd": {k: [v["bytes_sent"], v["bytes_recv"], v["calls"]] for k, v in b_["ops"].items()},
        "model": model_bytes(o, layout, tuple(grid_shape), tuple(grid.coords), item, cyclic),
        "padded_tokens": list(layout.padded),
        "s_padded": layout.s_padded,
        "atoms": n_atoms,
        "real_atoms": real_atoms,
        "atom_block": layout.atom_block,
        "params": sum(p.numel() for p in cp.parameters()),
    }
    # gather (collectives on every rank; outside the measured window and the ledgers)
    if check_serial:
        got = {k: collect_tensor(v.detach(), layout, KIND[k], what=k) for k, v in out.items()}
        gpos = collect_grad(pos.grad, "atom", grid)
    del out, held[:]
    cp_grads = {k: p.grad for k, p in cp.named_parameters()} if keep else {}  # before any timed run
    if repeats > 0:
        runs = (repeats, warmup, threads)
        _timed_runs(mine, cp, gl, tokens, o, dtype, seed, serial, feats, gfull, grid, device, runs, keep)
    if not keep:
        return mine
    serial = serial.to(device)
    spos = feats["ref_pos"].clone().requires_grad_(True)
    sfeats = feats | {"ref_pos": spos}

    def ser_fwd() -> Any:
        held.append(serial(sfeats, recycling_steps=R))
        return held[-1]

    def ser_bwd(res: Any) -> None:
        torch.autograd.backward([res[k] for k in OUTS], [gfull[k] for k in OUTS])

    ser = measure(ser_fwd, ser_bwd, device, list(serial.parameters()))
    ref = {k: v.detach() for k, v in held.pop().items()}
    err_par, scale_par = 0.0, 0.0
    for k, p in serial.named_parameters():
        a, c = p.grad, cp_grads[k]
        if a is None and c is None:
            continue
        a = torch.zeros_like(p) if a is None else a
        c = torch.zeros_like(p) if c is None else c
        err_par = max(err_par, (a - c).abs().max().item())
        scale_par = max(scale_par, a.abs().max().item())
    mine.update(
        err_out=max((got[k] - ref[k]).abs().max().item() for k in ref),
        err_out_by_output={k: (got[k] - ref[k]).abs().max().item() for k in ref},
        err_in=(gpos - spos.grad).abs().max().item(),
        err_par=err_par,
        ref_scale=max(ref[k].abs().max().item() for k in ref),
        ref_scale_grad_inputs=spos.grad.abs().max().item(),
        ref_scale_grad_params=scale_par,
        serial_saved=ser["saved_bytes"],
        serial_saved_activations=ser["saved_activation_bytes"],
        serial_peak=ser["peak_bytes"],
        serial_rss_peak=ser["rss_peak_bytes"],
        serial_seconds=ser["seconds"],
    )
    return mine


def _timed_runs(
    mine: dict[str, Any],
    cp: Any,
    gl: dict[str, torch.Tensor],
    tokens: int,
    o: dict[str, Any],
    dtype: torch.dtype,
    seed: int,
    serial: Any,
    feats: dict[str, torch.Tensor],
    gfull: dict[str, torch.Tensor],
    grid: Any,
    device: torch.device,
    runs: tuple[int, int, int],
    keep: bool,
) -> None:
    """Wall time of forward + backward without the profiler: CP on every rank (features
    distributed afresh before each run, a barrier, then the clock), then the serial trunk on rank
    0 with ``threads`` threads while the others wait. ``runs``: (repeats, warmup, threads)."""
    import torch.distributed as dist

    from twinshard.pair.features import distribute

    repeats, warmup, threads = runs
    cp.zero_grad(set_to_none=True)  # the measured run's gradients stay with the caller's snapshot
    sync = dist.barrier if dist.is_initialized() else (lambda: None)
    R = o["recycling"]

    def cp_step() -> float:
        f = {k: v.to(device) for k, v in features(tokens, o, dtype, seed).items()}
        f["ref_pos"].requires_grad_(True)
        fd = distribute(f, grid)
        del f
        sync()
        t0 = time.perf_counter()
        out = cp(fd, recycling_steps=R)
        torch.autograd.backward([out[k].to_local() for k in OUTS], [gl[k] for k in OUTS])
        dt = time.perf_counter() - t0
        cp.zero_grad(set_to_none=True)
        return dt

    mine["seconds_runs"] = [cp_step() for _ in range(warmup + repeats)][warmup:]
    sync()
    mine["serial_seconds_runs"] = []
    if keep:
        ser = serial.to(device)

        def ser_step() -> float:
            sf = feats | {"ref_pos": feats["ref_pos"].clone().requires_grad_(True)}
            t0 = time.perf_counter()
            res = ser(sf, recycling_steps=R)
            torch.autograd.backward([res[k] for k in OUTS], [gfull[k] for k in OUTS])
            dt = time.perf_counter() - t0
            ser.zero_grad(set_to_none=True)
            return dt

        before = torch.get_num_threads()
        torch.set_num_threads(threads)
        try:
            mine["serial_seconds_runs"] = [ser_step() for _ in range(warmup + repeats)][warmup:]
        finally:
            torch.set_num_threads(before)
    sync()


# -- the JSON object -----------------------------------------------------------------------------


def _ledger_table(ranks: list[dict[str, Any]], key: str) -> dict[str, dict[str, list[int]]]:
    names = sorted({k for r in ranks for k in r[key]})
    return {
        k: {
            "sent": [r[key].get(k, [0, 0, 0])[0] for r in ranks],
            "recv": [r[key].get(k, [0, 0, 0])[1] for r in ranks],
            "calls": [r[key].get(k, [0, 0, 0])[2] for r in ranks],
        }
        for k in names
    }


def _ledger_recv(ops: dict[str, list[int]], name: str, prefix: str | None, excl: tuple[str, ...]) -> int:
    """Bytes received by the op ``name`` (or by every op starting with ``prefix``, less ``excl``)."""
    if prefix is None:
        return ops.get(name, [0, 0, 0])[1]
    return sum(v[1] for k, v in ops.items() if k.startswith(prefix) and k not in excl)


def _models(ranks: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per new collective: the model's bytes received per rank beside the ledger's."""
    out = {}
    for name, m0 in ranks[0]["model"].items():
        prefix, excl = m0.get("ops_prefix"), tuple(m0.get("ops_exclude", ()))

        model = [r["model"][name]["recv"] for r in ranks]
        got = [_ledger_recv(r["ops_fwd"], name, prefix, excl) for r in ranks]
        out[name] = {
            "model": m0["model"],
            "model_bytes": model,
            "ledger_recv_bytes": got,
            "ratio_max": (max(got) / max(model)) if max(model) else None,
        }
        if "halo_atoms" in m0:
            out[name]["halo_atoms"] = [r["model"][name]["halo_atoms"] for r in ranks]
    return out


def _lower_bound(o: dict[str, Any], tokens: int, P: int, item: int) -> float:
    """The triangle multiplications' 2-D bound (``2 B N^2 h / sqrt(P)`` elements each): two per
    Pairformer, MSA and template block (the template ones on B T pair tensors of template_dim)
    per cycle; the other parts' traffic is on top."""
    b, n, cyc = o["batch"], tokens, o["recycling"] + 1
    per = 2 * b * n * n / math.sqrt(P) * item
    z = 2 * (o["layers"] + o["msa_blocks"]) * o["pair_channels"]
    t = 2 * o["template_blocks"] * o["templates"] * o["template_channels"]
    return cyc * per * (z + t)


def summarise(
    tokens: int,
    shape: tuple[int, int],
    o: dict[str, Any],
    dtype_name: str,
    ranks: list[dict[str, Any]],
    threads: int,
) -> dict[str, Any]:
    """The JSON object: the keys ``twinshard trunk`` has always printed (op ``trunk``) plus the
    whole trunk's sizes, per-op ledger bytes per rank and the byte models."""
    from twinshard.comm.ledger import BYTES_MODEL
    from twinshard.pair.layers.contraction import schedule_name

    P = shape[0] * shape[1]
    item = torch.tensor([], dtype=getattr(torch, dtype_name)).element_size()
    lower = _lower_bound(o, tokens, P, item)
    r0 = ranks[0]
    saved = [r["saved"] for r in ranks]
    comm = [r["comm_fwd"] for r in ranks]
    peaks = [r["peak"] for r in ranks]
    s_saved, s_peak = r0.get("serial_saved"), r0.get("serial_peak")
    s_act = r0.get("serial_saved_activations")
    runs = [max(r["seconds_runs"][i] for r in ranks) for i in range(len(r0.get("seconds_runs", [])))]
    cp_t = statistics.median(runs) if runs else None
    ser_runs = r0.get("serial_seconds_runs") or []
    ser_t = statistics.median(ser_runs) if ser_runs else None
    nr, nc = r0["padded_tokens"]
    return {
        "op": "trunk",
        "grid": f"{shape[0]}x{shape[1]}",
        "tokens": tokens,
        "dtype": dtype_name,
        "padded_tokens": r0["padded_tokens"],
        "channels": o["pair_channels"],
        "hidden": None,
        "sequences": o["msa"],
        "sequences_padded": r0["s_padded"],
        "templates": o["templates"],
        "atoms_per_token": o["atoms_per_token"],
        "atoms": r0["atoms"],
        "real_atoms": r0["real_atoms"],
        "atom_block_per_rank": r0["atom_block"],
        "atom_block_vs_atoms_over_rows": r0["atom_block"] / (r0["atoms"] / shape[0]),
        "recycling": o["recycling"],
        "batch": o["batch"],
        "schedule": schedule_name(shape),
        "layers": o["layers"],
        "msa_blocks": o["msa_blocks"],
        "template_blocks": o["template_blocks"],
        "atom_blocks": o["atom_blocks"],
        "single_channels": o["single_channels"],
        "atom_channels": o["atom_channels"],
        "atom_pair_channels": o["atom_pair_channels"],
        "msa_channels": o["msa_channels"],
        "template_channels": o["template_channels"],
        "bins": o["bins"],
        "heads": o["heads"],
        "pair_head_width": o["pair_head_width"],
        "pair_heads": o["pair_heads"],
        "atom_heads": o["atom_heads"],
        "msa_heads": o["msa_heads"],
        "msa_head_width": o["msa_head_width"],
        "opm_hidden": o["opm_hidden"],
        "parameters": r0["params"],
        "checkpointing": o["checkpointing"],
        "train_step": False,
        "check_serial": s_saved is not None,
        "max_abs_error_out": r0.get("err_out"),
        "max_abs_error_out_by_output": r0.get("err_out_by_output"),
        "max_abs_error_grad_inputs": r0.get("err_in"),
        "max_abs_error_grad_params": r0.get("err_par"),
        "reference_max_abs_out": r0.get("ref_scale"),
        "reference_max_abs_grad_inputs": r0.get("ref_scale_grad_inputs"),
        "reference_max_abs_grad_params": r0.get("ref_scale_grad_params"),
        "grad_inputs": "ref_pos (distribute src=None, collect_grad kind atom)",
        "saved_bytes_per_rank": saved,
        "serial_saved_bytes": s_saved,
        "saved_ratio_vs_serial_over_p": max(saved) / (s_saved / P) if s_saved else None,
        "saved_activation_ratio_vs_serial_over_p": (
            max(r["saved_activations"] for r in ranks) / (s_act / P) if s_act else None
        ),
        "peak_memory_bytes_per_rank": peaks,
        "serial_peak_memory_bytes": s_peak,
        "peak_ratio_vs_serial_over_p": max(peaks) / (s_peak / P) if s_peak else None,
        "pair_padding_factor": nr * nc / tokens**2,
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
        "ledger_forward_by_op": _ledger_table(ranks, "ops_fwd"),
        "ledger_backward_by_op": _ledger_table(ranks, "ops_bwd"),
        "model_bytes": _models(ranks),
        "comm_lower_bound_bytes": lower,
        "comm_ratio_vs_lower_bound": max(comm) / lower if P > 1 else 0.0,
        "seconds_per_rank": [r["seconds"] for r in ranks],
        "serial_seconds": r0.get("serial_seconds"),
        "seconds_runs": runs,
        "seconds_median": cp_t,
        "serial_threads": threads,
        "serial_seconds_median": ser_t,
        "cp_over_serial_time": cp_t / ser_t if cp_t and ser_t else None,
    }
