"""Accuracy per precision mode of the Pairformer stack twin beside the serial module's, and the
per-rank peak memory in each mode (``python -m twinshard.bench.precision``; prints one JSON line).

For each mode (``twinshard.pair.precision``): the fp64 weights and inputs are rounded once to the
mode's dtypes; the serial ``PairformerStack`` and its twin ``CPPairformerStack`` run forward and
backward (random output gradients) in the mode; each result is compared with the fp64 serial
result: ``max |y - y64| / max |y64|`` for the outputs ``s``, ``z``, the input gradients and every
parameter gradient (the worst parameter reported, and each by name). Peak memory: tensor bytes
allocated above the start during the twin's forward and backward, per rank
(``twinshard.memory.peak_memory_during``: the CPU profiler, ``max_memory_allocated`` on CUDA).
"""

from __future__ import annotations

import argparse
import json
from typing import Any

import torch

from twinshard.pair.precision import MODES, precision

CONFIG = {"tokens": 8, "single": 8, "pair": 8, "layers": 1, "heads": 2, "pair_head_width": 4, "pair_heads": 2}


def build(cfg: dict[str, Any], cp: bool) -> torch.nn.Module:
    """fp64 weights (every one perturbed off its zero/one init), the same on every rank."""
    from twinshard.pair.layers.pairformer import CPPairformerStack
    from twinshard.pair.reference.pairformer import PairformerStack

    kw = dict(
        num_heads=cfg["heads"],
        dropout=0.0,
        pairwise_head_width=cfg["pair_head_width"],
        pairwise_num_heads=cfg["pair_heads"],
    )
    torch.manual_seed(11)
    serial = PairformerStack(cfg["single"], cfg["pair"], cfg["layers"], **kw).double()
    g = torch.Generator().manual_seed(12)
    with torch.no_grad():
        for p in serial.parameters():
            p.add_(0.2 * torch.randn(p.shape, generator=g, dtype=torch.float64))
    if not cp:
        return serial
    twin = CPPairformerStack(cfg["single"], cfg["pair"], cfg["layers"], **kw).double()
    twin.load_state_dict(serial.state_dict())
    return twin


def inputs(cfg: dict[str, Any]) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(13)
    n, cs, cz = cfg["tokens"], cfg["single"], cfg["pair"]

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g, dtype=torch.float64)

    mask = (torch.rand(1, n, generator=g) > 0.15).double()
    mask[:, 0] = 1
    return {
        "s": randn(1, n, cs),
        "z": randn(1, n, n, cz),
        "mask": mask,
        "pair_mask": mask[:, :, None] * mask[:, None, :],
        "gs": randn(1, n, cs),
        "gz": randn(1, n, n, cz),
    }


def _results(y: tuple, xs: dict, model: torch.nn.Module) -> dict[str, torch.Tensor]:
    out = {"s": y[0].detach().double(), "z": y[1].detach().double()}
    out |= {"grad_s": xs["s"].grad.double(), "grad_z": xs["z"].grad.double()}
    out |= {f"param:{k}": p.grad.double() for k, p in model.named_parameters() if p.grad is not None}
    return out


def serial_run(cfg: dict[str, Any], mode: str) -> dict[str, torch.Tensor]:
    """The serial stack in ``mode`` (fp64 weights and inputs rounded once to it)."""
    prec = precision(mode)
    model = prec.cast_module(build(cfg, False))
    x = prec.cast_inputs(inputs(cfg))
    xs = {k: x[k].clone().requires_grad_(True) for k in ("s", "z")}
    with prec.scope(agree=False):
        y = model(xs["s"], xs["z"], x["mask"], x["pair_mask"])
        ((y[0].float() * x["gs"].float()).sum() + (y[1].float() * x["gz"].float()).sum()).backward()
    return _results(y, xs, model)


def twin_rank(grid: Any, cfg: dict[str, Any], modes: list[str]) -> dict[str, Any]:
    """Every rank: the twin in each mode; collected outputs, input and parameter gradients, and
    this rank's peak tensor bytes during forward and backward."""
    from twinshard.memory import peak_memory_during
    from twinshard.pair.features import PairLayout, collect_tensor, shard_tensor
    from twinshard.pair.layers.boundary import to_dtensor
    from twinshard.runtime.world import get_world

    out: dict[str, Any] = {}
    place = {"s": "single", "z": "pair", "mask": "single", "pair_mask": "pair"}
    for mode in modes:
        prec = precision(mode)
        model = prec.cast_module(build(cfg, True))
        x = prec.cast_inputs(inputs(cfg))
        xs = {k: x[k].clone().requires_grad_(True) for k in ("s", "z")}
        layout = PairLayout.for_sizes(cfg["tokens"], grid)
        got: dict[str, Any] = {}

        def step(prec=prec, x=x, xs=xs, layout=layout, model=model, got=got) -> None:
            with prec.scope():
                d = {k: shard_tensor(x[k], place[k], grid, layout) for k in ("mask", "pair_mask")}
                d |= {k: to_dtensor(xs[k], place[k], grid, layout) for k in xs}  # full input grads
                y = model(d["s"], d["z"], d["mask"], d["pair_mask"])
                full = (collect_tensor(y[0]), collect_tensor(y[1]))
                loss = (full[0].float() * x["gs"].float()).sum() + (full[1].float() * x["gz"].float()).sum()
                loss.backward()
                got["y"] = full

        world = get_world()
        _, peak = peak_memory_during(step, world.device if world is not None else torch.device("cpu"))
        out[mode] = {"results": _results(got["y"], xs, model), "peak_bytes": int(peak)}
    return out


def error(a: torch.Tensor, ref: torch.Tensor) -> float:
    return float((a - ref).abs().max() / ref.abs().max().clamp(min=1e-300))


def compare(truth: dict, serial: dict, twin: dict) -> dict[str, Any]:
    """Per quantity: (serial error, twin error) against the fp64 serial result. Parameter
    gradients that are zero in exact arithmetic (fp64 max below 1e-9 of the largest parameter
    gradient: the LayerNorm bias in front of the pair-bias softmax, whose shift cancels) have no
    relative error and are left out."""
    scale = max(float(v.abs().max()) for k, v in truth.items() if k.startswith("param:"))
    keep = [k for k in truth if not k.startswith("param:") or float(truth[k].abs().max()) > 1e-9 * scale]
    return {k: (error(serial[k], truth[k]), error(twin[k], truth[k])) for k in keep}


def run(shape: tuple[int, int], modes: list[str], cfg: dict[str, Any] | None = None) -> dict[str, Any]:
    from twinshard.testing import run_on_grid

    cfg = dict(CONFIG if cfg is None else cfg)
    truth = serial_run(cfg, "fp64")
    ranks = run_on_grid(twin_rank, shape, cfg, modes)
    report: dict[str, Any] = {"grid": "x".join(map(str, shape)), "config": cfg, "modes": {}}
    for mode in modes:
        errs = compare(truth, serial_run(cfg, mode), ranks[0][mode]["results"])
        params = {k: v for k, v in errs.items() if k.startswith("param:")}
        worst = max(params, key=lambda k: params[k][1])
        report["modes"][mode] = {
            "errors": {
                k: {"serial": v[0], "twin": v[1]} for k, v in errs.items() if not k.startswith("param:")
            },
            "worst_param": {"name": worst, "serial": params[worst][0], "twin": params[worst][1]},
            "param_ratio_median": sorted(v[1] / max(v[0], 1e-300) for v in params.values())[len(params) // 2],
            "param_ratio_max": max(v[1] / max(v[0], 1e-300) for v in params.values()),
            "peak_bytes_per_rank": [r[mode]["peak_bytes"] for r in ranks],
        }
    return report


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--grid", default="2x2")
    p.add_argument("--precision", nargs="+", default=[m for m in MODES if m != "fp64"], choices=MODES)
    p.add_argument("--tokens", type=int, default=CONFIG["tokens"])
    p.add_argument("--channels", type=int, default=CONFIG["pair"], help="c_s = c_z")
    a = p.parse_args(argv)
    cfg = dict(CONFIG, tokens=a.tokens, single=a.channels, pair=a.channels)
    shape = tuple(int(v) for v in a.grid.split("x"))
    print(json.dumps(run(shape, list(a.precision), cfg)))  # noqa: T201


if __name__ == "__main__":
    main()
