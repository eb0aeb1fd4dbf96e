"""``twinshard predict``: the whole Boltz-2 inference on a rows x cols grid, written as boltz writes it.

Runs ``twinshard.pair.layers.model.CPBoltz2Model`` (trunk with recycling, diffusion conditioning,
the sampler over ``--sampling-steps`` denoising steps for ``--diffusion-samples`` samples, the
confidence module) on ``--grid RxC`` ranks (local ranks of the shared pool, or the world torchrun
launched: ``torchrun --nproc-per-node R*C -m twinshard predict --grid RxC ...``). Rank 0 gathers
the coordinates and the confidence (``collect_tensor``) and writes, per sample, in boltz's layout
(``twinshard.pair.output.write_prediction``) under ``--out DIR``::

    predictions/<record>/<record>_model_<k>.cif   (--format pdb: .pdb)
    predictions/<record>/confidence_<record>_model_<k>.json
    predictions/<record>/{plddt,pae,pde}_<record>_model_<k>.npz

``k`` ranks the samples by Boltz-2's ``confidence_score`` (best first).

Inputs. Without options everything is embedded, nothing is downloaded: the synthetic complex of
``--tokens`` tokens (``twinshard.pair.synthetic``: 3 chains, the last a ligand; MSA, templates;
``frames_idx`` each token's first, middle and last atom) and a random-weight Boltz-2 at small
widths (``twinshard.bench.predict_bench.model_config`` on the whole trunk's default widths, 2
Pairformer blocks; weights drawn from ``--seed``), record name ``synthetic``.
``--checkpoint FILE``: a Boltz-2 Lightning checkpoint (a ``torch.save``'d dict with ``state_dict``,
the Boltz2 model's, and ``hyper_parameters``, Boltz2's init keyword arguments; a pickle, loaded as
Lightning loads it, so only a trusted file): ``ModelConfig.from_hparams`` and a strict load; as
``boltz predict`` does, the sampler's parameters are replaced by Boltz-2's predict parameters
(``BOLTZ2_DIFFUSION_PARAMS``) and steering is off. ``--features FILE.pt``: a ``torch.save``'d
Boltz-2 feature dict ``[B, ...]`` (the featuriser's names; tensors the feature contract does not
know are dropped; ``frames_idx`` computed as above when absent), record name the file's stem
(``<stem>_<b>`` per batch element when B > 1).

``--precision`` (``twinshard.pair.precision``; default ``fp32``, or what ``--dtype`` says): the
parameters in the mode's dtype, the features' floating tensors in its activation dtype, the forward
inside its scope (``bf16-mixed``: autocast with Boltz's fp32 regions; the mode is agreed by every
rank first); outputs are written in >= fp32.

``--check-serial``: rank 0 also runs the serial ``Boltz2Model`` with the same weights, features
and draws (the counter-based source of ``--seed``: the same sample on any grid) and reports the
largest differences of the coordinates, pLDDT, PAE, PDE, pTM, ipTM and complex pLDDT.

Output: a progress line per denoising step on stderr (rank 0; tqdm when installed; ``--no-progress``
silences it); then (rank 0) the files written and each sample's pTM / ipTM / complex pLDDT, and as
the last stdout line one JSON object (``--json``: only that line) with the keys ``command``,
``record``, ``grid``, ``ranks``, ``tokens``, ``atoms``, ``batch``, ``dtype``, ``precision``, ``format``,
``recycling_steps``, ``sampling_steps``, ``diffusion_samples``, ``max_parallel_samples``, ``seed``,
``checkpoint``, ``features``, ``out``, ``samples`` (per sample: ``element``, ``sample``, ``model``
(its rank k), ``files``, ``confidence_score``, ``ptm``, ``iptm``, ``complex_plddt``), ``timings_s``
(rank 0: ``setup``, ``trunk`` (trunk and diffusion conditioning), ``sampling``, ``confidence``,
``forward``, ``write``, ``serial``, ``total``), ``check_serial`` and ``errors`` (per output
``max_abs`` and ``ref_scale``; null without ``--check-serial``).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import torch

from twinshard.bench.predict_bench import build_model
from twinshard.pair.output import CONFIDENCE_KEYS
from twinshard.pair.precision import add_precision_options, dtype_default, precision
from twinshard.runtime import reports, run_ranks

__all__ = [
    "DEFAULTS",
    "add_parser",
    "build_model",
    "default_config",
    "frames_idx",
    "load_checkpoint",
    "load_features",
    "predict_rank",
    "run",
    "synthetic_features",
]

GATHERED = ("sample_atom_coords", "plddt", "pae", "pde")
FIGURES = ("ptm", "iptm", "complex_plddt")
SIGMA_MAX = 1.0  # the embedded model's initial noise, in units of sigma_data (16 A)
SUMMARY = CONFIDENCE_KEYS[1:]  # the model's summary figures (confidence_score is computed here)
# the embedded model's trunk widths and the synthetic complex (whole_trunk's option defaults)
DEFAULTS: dict[str, Any] = {
    "atoms_per_token": 8,
    "msa": 8,
    "templates": 2,
    "chains": 3,
    "recycling": 0,
    "layers": 2,
    "msa_blocks": 1,
    "template_blocks": 1,
    "atom_blocks": 1,
    "single_channels": 64,
    "pair_channels": 32,
    "atom_channels": 32,
    "atom_pair_channels": 8,
    "msa_channels": 16,
    "template_channels": 16,
    "bins": 64,
    "heads": 4,
    "pair_heads": 4,
    "pair_head_width": 16,
    "atom_heads": 2,
    "msa_heads": 4,
    "msa_head_width": 8,
    "opm_hidden": 8,
    "batch": 1,
    "checkpointing": False,
}


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register ``predict`` as a top-level ``twinshard`` command."""
    p = subparsers.add_parser(
        "predict",
        help="Boltz-2 inference on a grid: structures (mmCIF/PDB) and confidence in boltz's layout",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--out", default="twinshard_predict", help="output directory (default ./twinshard_predict)"
    )
    p.add_argument("--grid", default="2x2", help="rows x cols process grid (default 2x2)")
    p.add_argument("--tokens", type=int, default=24, help="tokens of the synthetic complex (default 24)")
    p.add_argument(
        "--recycling-steps", type=int, default=3, help="trunk recycling steps (default 3, as boltz)"
    )
    p.add_argument("--sampling-steps", type=int, default=200, help="denoising steps (default 200, as boltz)")
    p.add_argument("--diffusion-samples", type=int, default=1, help="samples (default 1)")
    p.add_argument(
        "--max-parallel-samples", type=int, default=None, help="samples denoised at once (boltz's chunks)"
    )
    p.add_argument("--seed", type=int, default=0, help="draws (and the embedded weights and complex)")
    p.add_argument("--format", choices=("mmcif", "pdb"), default="mmcif", help="structure format")
    add_precision_options(p, "; the serial check (--check-serial) runs in the same mode")
    p.add_argument("--checkpoint", default=None, help="a Boltz-2 Lightning checkpoint (.ckpt)")
    p.add_argument("--features", default=None, help="a torch.save'd Boltz-2 feature dict (.pt)")
    p.add_argument("--check-serial", action="store_true", help="run the serial model on rank 0 and compare")
    p.add_argument("--no-progress", action="store_true", help="no progress line over denoising steps")
    p.add_argument("--json", action="store_true", help="print only the JSON line")
    p.add_argument("--timeout", type=float, default=3600.0, help="seconds the local ranks may take")
    p.set_defaults(func=run)
    return p


# ---- the model ------------------------------------------------------------------------------------


def default_config() -> Any:
    """The embedded model's ``ModelConfig`` (module docstring): Boltz-2's predict diffusion
    parameters but ``sigma_max`` :data:`SIGMA_MAX` (a random-weight score model does not pull
    Boltz's 160 x 16 A of initial noise together: its samples would stay ~1000 A across)."""
    from dataclasses import replace

    from twinshard.bench.predict_bench import model_config

    cfg = model_config(DEFAULTS)
    return replace(cfg, diffusion_process_args=dict(cfg.diffusion_process_args, sigma_max=SIGMA_MAX))


def _read_checkpoint(path: str | Path) -> tuple[Any, dict[str, torch.Tensor]]:
    from twinshard.pair.reference.model import ModelConfig
    from twinshard.pair.reference.sampler import BOLTZ2_DIFFUSION_PARAMS

    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"--checkpoint {path}: no such file")
    try:  # a Lightning checkpoint is a pickle (hyper_parameters may hold any object), as Lightning loads it
        ckpt = torch.load(path, map_location="cpu", weights_only=False)
    except Exception as exc:
        raise ValueError(
            f"--checkpoint {path}: not a torch checkpoint ({type(exc).__name__}: {exc})"
        ) from exc
    if not isinstance(ckpt, dict) or "state_dict" not in ckpt or "hyper_parameters" not in ckpt:
        keys = sorted(ckpt)[:8] if isinstance(ckpt, dict) else type(ckpt).__name__
        raise ValueError(
            f"--checkpoint {path}: a Boltz-2 Lightning checkpoint holds 'state_dict' and "
            f"'hyper_parameters'; this one holds {keys}"
        )
    hp = dict(ckpt["hyper_parameters"])
    for key in ("score_model_args", "atom_s", "atom_z", "token_s", "token_z"):
        if key not in hp:
            raise ValueError(
                f"--checkpoint {path}: hyper_parameters lack {key!r} (not a Boltz-2 checkpoint?)"
            )
    # boltz predict: load_from_checkpoint(diffusion_process_args=Boltz2DiffusionParams, steering off)
    hp["diffusion_process_args"] = dict(BOLTZ2_DIFFUSION_PARAMS)
    hp["steering_args"] = None
    try:
        cfg = ModelConfig.from_hparams(hp)
    except NotImplementedError as exc:
        raise ValueError(f"--checkpoint {path}: {exc}") from exc
    except (TypeError, KeyError) as exc:
        raise ValueError(
            f"--checkpoint {path}: hyper_parameters do not build a Boltz-2 model: {exc}"
        ) from exc
    if not cfg.confidence_prediction:
        raise ValueError(
            f"--checkpoint {path}: the model has no confidence module (confidence_prediction=False)"
        )
    sd = ckpt["state_dict"]
    if not isinstance(sd, dict) or not all(isinstance(v, torch.Tensor) for v in sd.values()):
        raise ValueError(f"--checkpoint {path}: 'state_dict' must map names to tensors")
    return cfg, sd


def load_checkpoint(path: str | Path, cls: type | None = None) -> tuple[Any, torch.nn.Module]:
    """``(ModelConfig, model)``: ``cls`` (default ``Boltz2Model``) built from the checkpoint's
    ``hyper_parameters`` with its ``state_dict`` loaded strict, in eval mode, in the checkpoint's
    dtype. Raises ``FileNotFoundError`` / ``ValueError`` naming what is wrong (a missing or
    unexpected parameter, a shape)."""
    from twinshard.pair.reference.model import Boltz2Model

    cfg, sd = _read_checkpoint(path)
    with torch.device("meta"):
        shell = (cls or Boltz2Model)(cfg)
    want = shell.state_dict()
    missing = [k for k in want if k not in sd]
    extra = [k for k in sd if k not in want]
    shapes = [
        f"{k} {list(sd[k].shape)} != {list(v.shape)}"
        for k, v in want.items()
        if k in sd and sd[k].shape != v.shape
    ]
    if missing or extra or shapes:
        raise ValueError(
            f"--checkpoint {path}: the state_dict does not load strict into Boltz2 of its hyper_parameters: "
            f"missing {missing[:5]}{' ...' if len(missing) > 5 else ''} ({len(missing)}), unexpected "
            f"{extra[:5]}{' ...' if len(extra) > 5 else ''} ({len(extra)}), shapes {shapes[:3]}"
        )
    dtype = next((v.dtype for v in sd.values() if v.is_floating_point()), torch.float32)
    model = (cls or Boltz2Model)(cfg).to(dtype)
    model.load_state_dict(sd, strict=True)
    return cfg, model.eval()


# ---- the features ---------------------------------------------------------------------------------


def frames_idx(atom_to_token: torch.Tensor) -> torch.Tensor:
    """``[B, N, 3]``: each token's first, middle and last atom (global atom indices; 0 for a token
    without atoms), from ``atom_to_token`` ``[B, A, N]``."""
    b, a, n = atom_to_token.shape
    idx = torch.arange(a)[None, :, None].expand(b, a, n)
    has = atom_to_token > 0
    first = torch.where(has, idx, torch.full_like(idx, a)).min(1).values
    last = torch.where(has, idx, torch.full_like(idx, -1)).max(1).values
    count = has.sum(1)
    frames = torch.stack([first, first + count // 2, last], -1)
    return torch.where((count > 0)[..., None], frames, torch.zeros_like(frames))


def synthetic_features(tokens: int, dtype: torch.dtype, seed: int) -> dict[str, torch.Tensor]:
    """The embedded complex (module docstring) with ``frames_idx``."""
    from twinshard.bench.whole_trunk import features

    f = features(tokens, DEFAULTS, dtype, seed)
    f["frames_idx"] = frames_idx(f["atom_to_token"])
    return f


def load_features(path: str | Path, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """A ``torch.save``'d Boltz-2 feature dict: the tensors the feature contract knows (floating
    ones cast to ``dtype``), ``frames_idx`` added when absent. Raises naming what is wrong."""
    from twinshard.pair.features import PLACEMENT_TABLE

    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"--features {path}: no such file")
    try:
        raw = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:
        raise ValueError(
            f"--features {path}: not a torch.save'd dict of tensors ({type(exc).__name__}: {exc})"
        ) from exc
    if not isinstance(raw, dict):
        raise ValueError(f"--features {path}: holds a {type(raw).__name__}, not a feature dict")
    known = {"frames_idx", *PLACEMENT_TABLE}
    f = {k: v for k, v in raw.items() if k in known and isinstance(v, torch.Tensor)}
    need = ("atom_to_token", "atom_pad_mask", "token_pad_mask", "res_type", "asym_id")
    missing = [k for k in need if k not in f]
    if missing:
        raise ValueError(f"--features {path}: lacks {missing} (a Boltz-2 feature dict [B, ...])")
    f = {k: v.to(dtype) if v.is_floating_point() else v for k, v in f.items()}
    if "frames_idx" not in f:
        f["frames_idx"] = frames_idx(f["atom_to_token"])
    return f


# ---- the rank body --------------------------------------------------------------------------------


class _Clock:
    """Rank 0's timings and progress: hooks on the score model (each call one chunk of one
    denoising step) and on the confidence module."""

    def __init__(self, model: torch.nn.Module, steps: int, chunks: int, progress: bool):
        self.t: dict[str, float] = {}
        self.calls, self.steps, self.chunks = 0, steps, chunks
        self.bar: Any = None  # a tqdm bar (tqdm compares by value: test it with `is`)
        self.lines = False
        if progress:
            try:
                from tqdm import tqdm

                self.bar = tqdm(total=steps, desc="denoising", unit="step", file=sys.stderr, leave=True)
            except ImportError:
                self.lines = True
        self.handles = [
            model.structure_module.score_model.register_forward_hook(self._score),
            model.confidence_module.register_forward_pre_hook(self._confidence),
        ]

    def _score(self, *_: Any) -> None:
        self.t.setdefault("sampling_start", time.perf_counter())
        self.calls += 1
        if self.calls % self.chunks:
            return
        step = self.calls // self.chunks
        if self.lines:
            sys.stderr.write(f"twinshard predict: denoising step {step}/{self.steps}\n")
            sys.stderr.flush()
        elif self.bar is not None:
            self.bar.update(1)

    def _confidence(self, *_: Any) -> None:
        self.t.setdefault("confidence_start", time.perf_counter())

    def close(self) -> None:
        for h in self.handles:
            h.remove()
        if self.bar is not None:
            self.bar.close()


def _slice(conf: dict[str, Any], rows: slice) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in conf.items():
        if k == "pair_chains_iptm":
            out[k] = {c1: {c2: x[rows] for c2, x in row.items()} for c1, row in v.items()}
        elif isinstance(v, torch.Tensor):
            out[k] = v[rows]
    return out


def _errors(got: dict[str, Any], ref: dict[str, Any]) -> dict[str, dict[str, float]]:
    return {
        k: {
            "max_abs": (got[k].double() - ref[k].double().cpu()).abs().max().item(),
            "ref_scale": ref[k].double().abs().max().item(),
        }
        for k in (*GATHERED, *FIGURES)
    }


def _written(x: torch.Tensor) -> torch.Tensor:
    """An output on the CPU, in >= fp32 (a bf16 run's coordinates and confidences are written, and
    compared, as fp32: the structure files and JSON hold text)."""
    return x.cpu().to(torch.promote_types(x.dtype, torch.float32))


def predict_rank(spec: dict[str, Any]) -> dict[str, Any]:
    """Run on every rank of a world of rows x cols ranks; rank 0 writes the files and returns the
    result (module docstring), the others ``{}``."""
    from twinshard.pair.features import collect_tensor, distribute
    from twinshard.pair.layers.model import CPBoltz2Model
    from twinshard.pair.output import confidence_score, ranking, write_prediction
    from twinshard.pair.reference.model import Boltz2Model
    from twinshard.pair.reference.sampler import boltz_sample_chunks
    from twinshard.runtime import get_world, make_grid
    from twinshard.runtime.agree import raise_together

    t0 = time.perf_counter()
    mode = precision(spec["precision"])
    dtype = mode.param_dtype
    grid = make_grid(tuple(spec["grid"]))
    device = get_world().device
    lead = grid.rank == 0
    if spec["checkpoint"]:
        cfg, serial = load_checkpoint(spec["checkpoint"])
        serial = serial.to(dtype)
        cp = CPBoltz2Model(cfg).to(dtype)
        cp.load_state_dict(serial.state_dict(), strict=True)
        cp.eval()
    else:
        cfg = default_config()
        serial = build_model(Boltz2Model, cfg, dtype, spec["seed"])
        cp = CPBoltz2Model(cfg).to(dtype).eval()
        cp.load_state_dict(serial.state_dict(), strict=True)
    if not (spec["check_serial"] and lead):
        serial = None
    cp = cp.to(device)
    if spec["features"]:
        feats = load_features(spec["features"], mode.activation_dtype)
    else:
        feats = synthetic_features(spec["tokens"], mode.activation_dtype, spec["seed"])
    feats = {k: v.to(device) for k, v in feats.items()}
    n = int(feats["token_pad_mask"].shape[1])
    rows, cols = spec["grid"]
    if max(rows, cols) > n:
        raise ValueError(
            f"--grid {rows}x{cols} is larger than the complex: {n} tokens (each grid row and column needs one)"
        )
    fd = distribute(feats, grid)
    m = spec["diffusion_samples"]
    kw = dict(
        recycling_steps=spec["recycling_steps"],
        num_sampling_steps=spec["sampling_steps"],
        diffusion_samples=m,
        max_parallel_samples=spec["max_parallel_samples"],
        seed=spec["seed"],
    )
    chunks = len(boltz_sample_chunks(m, spec["max_parallel_samples"]))
    clock = _Clock(cp, spec["sampling_steps"], chunks, lead and spec["progress"]) if lead else None
    t1 = time.perf_counter()
    try:
        with torch.no_grad(), mode.scope(device.type, what="twinshard predict"):
            out = cp(fd, **kw)
    finally:
        if clock is not None:
            clock.close()
    t2 = time.perf_counter()
    got = {k: _written(collect_tensor(out[k])) for k in GATHERED}
    conf: dict[str, Any] = {k: _written(out[k].detach()) for k in SUMMARY if k in out}
    conf["pair_chains_iptm"] = {
        c1: {c2: _written(x.detach()) for c2, x in row.items()} for c1, row in out["pair_chains_iptm"].items()
    }
    del out
    if not lead:
        raise_together(None)
        return {}
    conf.update(plddt=got["plddt"], pae=got["pae"], pde=got["pde"])
    conf["confidence_score"] = confidence_score(conf)
    cpu_feats = {k: v.cpu() for k, v in feats.items()}
    batch = int(feats["token_pad_mask"].shape[0])
    samples: list[dict[str, Any]] = []
    err: BaseException | None = None
    try:
        for b in range(batch):
            record = spec["record"] if batch == 1 else f"{spec['record']}_{b}"
            sl = slice(b * m, (b + 1) * m)
            part = _slice(conf, sl)
            fmt = "pdb" if spec["format"] == "pdb" else "cif"
            written = write_prediction(
                spec["out"], record, cpu_feats, got["sample_atom_coords"][sl], part, fmt, element=b
            )
            order = ranking(part, m)
            for j, files in enumerate(written):
                samples.append(
                    {
                        "element": b,
                        "sample": j,
                        "model": order[j],
                        "files": {k: str(v) for k, v in files.items()},
                        "confidence_score": float(part["confidence_score"][j]),
                        **{k: float(part[k][j]) for k in FIGURES},
                    }
                )
    except Exception as exc:  # every rank raises it (the others wait in raise_together)
        err = exc
    raise_together(err)
    t3 = time.perf_counter()
    errors = None
    if serial is not None:
        serial = serial.to(device)
        with torch.no_grad(), mode.scope(device.type, agree=False):
            ref = serial(feats, **kw)
        got.update({k: conf[k] for k in FIGURES})
        errors = _errors(got, ref)
    t4 = time.perf_counter()
    ct = clock.t if clock else {}
    s0, c0 = ct.get("sampling_start", t2), ct.get("confidence_start", t2)
    return {
        "atoms": int(feats["atom_pad_mask"].shape[1]),
        "batch": batch,
        "tokens": n,
        "samples": samples,
        "errors": errors,
        "timings_s": {
            "setup": t1 - t0,
            "trunk": s0 - t1,
            "sampling": c0 - s0,
            "confidence": t2 - c0,
            "forward": t2 - t1,
            "write": t3 - t2,
            "serial": (t4 - t3) if serial is not None else None,
            "total": t4 - t0,
        },
    }


# ---- the command ----------------------------------------------------------------------------------


def _spec(args: argparse.Namespace) -> dict[str, Any]:
    from twinshard.bench.measure import parse_grid

    shape = parse_grid(args.grid)
    if args.tokens < 1:
        raise ValueError(f"--tokens must be a positive integer, got {args.tokens}")
    if args.recycling_steps < 0:
        raise ValueError(f"--recycling-steps must be >= 0, got {args.recycling_steps}")
    if args.sampling_steps < 1:
        raise ValueError(f"--sampling-steps must be >= 1, got {args.sampling_steps}")
    if args.diffusion_samples < 1:
        raise ValueError(f"--diffusion-samples must be >= 1, got {args.diffusion_samples}")
    if args.max_parallel_samples is not None and args.max_parallel_samples < 1:
        raise ValueError(f"--max-parallel-samples must be >= 1, got {args.max_parallel_samples}")
    features = args.features
    if features is None:
        need = max(shape)
        if args.tokens < need:
            raise ValueError(
                f"--grid {shape[0]}x{shape[1]} is larger than the complex: --tokens {args.tokens} < {need} "
                "(each grid row and column needs a token)"
            )
        if args.tokens < DEFAULTS["chains"]:
            raise ValueError(
                f"--tokens must be at least {DEFAULTS['chains']} (the synthetic complex's chains)"
            )
    elif not Path(features).is_file():
        raise FileNotFoundError(f"--features {features}: no such file")
    checkpoint = args.checkpoint
    if checkpoint is not None:
        load_checkpoint(checkpoint)  # a clear error here, before any rank starts (the ranks load it again)
    record = "synthetic" if features is None else Path(features).stem
    mode = dtype_default(args.dtype, args.precision, "fp32")
    return {
        "grid": shape,
        "tokens": args.tokens,
        "recycling_steps": args.recycling_steps,
        "sampling_steps": args.sampling_steps,
        "diffusion_samples": args.diffusion_samples,
        "max_parallel_samples": args.max_parallel_samples,
        "seed": args.seed,
        "format": args.format,
        "precision": mode.name,
        "dtype": str(mode.param_dtype).removeprefix("torch."),
        "checkpoint": None if checkpoint is None else str(Path(checkpoint).resolve()),
        "features": None if features is None else str(Path(features).resolve()),
        "check_serial": bool(args.check_serial),
        "progress": not args.no_progress,
        "out": str(Path(args.out).resolve()),
        "record": record,
    }


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Run the prediction on rows x cols ranks (spawning local ranks unless in such a world);
    rank 0 prints (module docstring)."""
    spec = _spec(args)
    rows, cols = spec["grid"]
    ranks = run_ranks(predict_rank, rows * cols, spec, option="--grid", deadline=args.timeout)
    if not reports():
        return {}
    r0 = ranks[0]
    result = {
        "command": "predict",
        "record": spec["record"],
        "grid": f"{rows}x{cols}",
        "ranks": rows * cols,
        "tokens": r0["tokens"],
        "atoms": r0["atoms"],
        "batch": r0["batch"],
        "dtype": spec["dtype"],
        "precision": spec["precision"],
        "format": spec["format"],
        "recycling_steps": spec["recycling_steps"],
        "sampling_steps": spec["sampling_steps"],
        "diffusion_samples": spec["diffusion_samples"],
        "max_parallel_samples": spec["max_parallel_samples"],
        "seed": spec["seed"],
        "checkpoint": spec["checkpoint"],
        "features": spec["features"],
        "out": spec["out"],
        "samples": r0["samples"],
        "timings_s": r0["timings_s"],
        "check_serial": spec["check_serial"],
        "errors": r0["errors"],
    }
    if not args.json:
        for s in sorted(result["samples"], key=lambda s: (s["element"], s["model"])):
            figs = " ".join(f"{k}={s[k]:.4f}" for k in ("confidence_score", *FIGURES))
            print(f"model {s['model']} (sample {s['sample']}): {figs}")
            for path in s["files"].values():
                print(f"  {path}")
        t = result["timings_s"]
        print(" ".join(f"{k}={v:.2f}s" for k, v in t.items() if v is not None))
        if result["errors"]:
            worst = max(e["max_abs"] / max(e["ref_scale"], 1e-30) for e in result["errors"].values())
            print(f"check-serial: largest relative error {worst:.3g}")
    print(json.dumps(result))
    return result
