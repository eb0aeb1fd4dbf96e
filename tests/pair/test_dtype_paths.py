"""Dtype paths of every autograd Function of the pair vertical and of the comm ops (issue 21, s. 1).

End-to-end parity cannot see a cast that is made and undone inside a Function (bf16 rounding in an
fp32 run shows only as a larger error, hidden in a bf16 run), nor a wire buffer whose dtype depends
on one rank's autocast state. Here each Function's body is audited (``twinshard.comm.amp.
DtypeAudit``): the dtype of every tensor an op creates inside it (a dispatch mode around the body,
so a reverted cast shows), of what it saves for backward (``saved_tensors_hooks``), of its inputs
and outputs, and of every buffer the comm primitives put on the wire, with the peer or group (the
audit also agrees each buffer's dtype with the other end first, so a mismatch is reported, not
hung on). Intermediates of the modules are observed with forward PRE-hooks (a post-hook misses
the recompute under activation checkpointing) and compared with the serial module's in the same
mode.

Drivers (tiny: N = 6, c <= 8, one Pairformer layer): the training trunk (``CPTrunk``: Pairformer
layer with both triangle multiplications, both triangle attentions, attention with pair bias,
transitions, the distogram loss and the single-track sum), the outer product mean, and the comm
ops driven directly (the ones the pair layers use and the rest of ``twinshard.comm.ops``), on 1x1
and 2x2, each over activation dtype {bf16, fp32} x mask dtype {bf16, fp32, bool} x autocast {on,
off}. Pruned: the comm driver has no mask (the mask dimension is one case, "none"); bf16
activations with autocast on (bf16 weights under an autocast region: no mode makes it, but a user
can) are kept. Not driven here (atom-level, run by the whole-model tests): ``_KeyFrame``,
``_ZBand``; every Function is still checked to carry the rule (``test_every_function_carries_the_rule``).

Per Function and phase the checks are: (1) every floating dtype created, saved or returned inside
is one of its inputs' dtypes or their promotion to >= fp32 (a bf16 tensor inside an fp32 run, or
fp64 anywhere but an fp64 run, is an unintended cast); (2) a ``cast="compute"`` Function (Boltz's
fp32 regions) gets only >= fp32 inputs under autocast; (3) across ranks: every collective's (op,
dtype) sequence is identical on all ranks of its group, every message's dtype is the same at the
sender and the receiver, and no mismatch was noted; (4) sums over ranks run in >= fp32; (5) the
twin's output dtype and every submodule's input activation dtype (pre-hooks) equal the serial
module's in the same mode, and every parameter gradient has its parameter's dtype.
"""

from __future__ import annotations

import importlib
import inspect
import pkgutil
from contextlib import nullcontext

import pytest
import torch

import twinshard.comm as comm_pkg
import twinshard.pair as pair_pkg
from twinshard import comm
from twinshard.comm.amp import DtypeAudit
from twinshard.pair.features import PairLayout, collect_tensor, shard_tensor
from twinshard.pair.layers.outer_product import CPOuterProductMean
from twinshard.pair.reference import distogram_target
from twinshard.pair.reference.outer_product import OuterProductMean
from twinshard.pair.train import CPTrunk, Trunk
from twinshard.testing import perturb_zero_parameters, random_grad_output, random_mask, run_on_grid, synthetic

N, CS, CZ, BINS, S = 6, 8, 8, 4, 3
KW = dict(num_heads=2, dropout=0.0, pairwise_head_width=4, pairwise_num_heads=2, convention="boltz")
ACTS = {"bf16": torch.bfloat16, "fp32": torch.float32}
MASKS = ("bf16", "fp32", "bool")
CASES = [
    (driver, act, mask, ac)
    for driver in ("trunk", "opm", "comm")
    for act in ACTS
    for mask in (MASKS if driver != "comm" else ("none",))
    for ac in (True, False)
]
GRIDS = [(1, 1), (2, 2)]
FLOAT = {"float64", "float32", "bfloat16", "float16"}
WIDTH = {"bfloat16": 16, "float16": 16, "float32": 32, "float64": 64}


def _mask_dtype(kind: str) -> torch.dtype:
    return {"bf16": torch.bfloat16, "fp32": torch.float32, "bool": torch.bool}[kind]


def _first_dtype(args) -> str | None:
    for a in args:
        if isinstance(a, torch.Tensor):
            return str(a.dtype).removeprefix("torch.")
    return None


def _prehooks(model: torch.nn.Module, out: dict) -> list:
    """Forward PRE-hooks on every submodule: the dtype of the first tensor argument (the
    activation) each one receives, by qualified name."""

    def hook(name):
        def fn(mod, args, kwargs=None):
            d = _first_dtype(args)
            if d is not None:
                out.setdefault(name, set()).add(d)

        return fn

    return [m.register_forward_pre_hook(hook(n)) for n, m in model.named_modules() if n]


def _build(cls, dt):
    torch.manual_seed(5)
    m = cls(CS, CZ, 1, num_bins=BINS, single_weight=0.1, **KW).double()
    perturb_zero_parameters(m)
    return m.to(dt)


def _trunk_inputs(act, mask_kind):
    dt = ACTS[act]
    g = torch.Generator().manual_seed(3)
    coords = torch.randn(1, N, 3, generator=g, dtype=torch.float64) * 6.0
    return {
        "s": synthetic(1, N, CS, seed=1).to(dt),
        "z": synthetic(1, N, N, CZ, seed=2).to(dt),
        "target": distogram_target(coords, num_bins=BINS, max_dist=12.0).to(dt),
        "mask": random_mask(1, N, seed=7, keep=0.8).to(_mask_dtype(mask_kind)),
        "pair_mask": random_mask(1, N, N, seed=8, keep=0.8).to(_mask_dtype(mask_kind)),
    }


PLACE = {"s": "single", "z": "pair", "target": "pair", "mask": "single", "pair_mask": "pair"}


def _run_trunk(grid, act, mask_kind, autocast):
    dt = ACTS[act]
    ctx = torch.autocast("cpu", dtype=torch.bfloat16) if autocast else nullcontext()
    x = _trunk_inputs(act, mask_kind)
    serial_pre: dict = {}
    serial = _build(Trunk, dt)
    hooks = _prehooks(serial, serial_pre)
    with ctx:
        s_loss, _ = serial(**x, seed=0)
    for h in hooks:
        h.remove()
    twin = _build(CPTrunk, dt)
    layout = PairLayout.for_sizes(N, grid)
    xd = {k: shard_tensor(v, PLACE[k], grid, layout) for k, v in x.items()}
    twin_pre: dict = {}
    hooks = _prehooks(twin, twin_pre)
    with DtypeAudit() as audit, ctx:
        loss, _ = twin(**xd, seed=0)
        loss.backward()
    for h in hooks:
        h.remove()
    grads = {k: (str(p.dtype), str(p.grad.dtype)) for k, p in twin.named_parameters() if p.grad is not None}
    return {
        "audit": audit.summary(),
        "out": (str(loss.dtype), str(s_loss.dtype)),
        "pre": ({k: sorted(v) for k, v in twin_pre.items()}, {k: sorted(v) for k, v in serial_pre.items()}),
        "grads": grads,
    }


def _run_opm(grid, act, mask_kind, autocast):
    dt = ACTS[act]
    ctx = torch.autocast("cpu", dtype=torch.bfloat16) if autocast else nullcontext()
    m = synthetic(1, S, N, CZ, seed=1).to(dt)
    mask = random_mask(1, S, N, seed=7, keep=0.8).to(_mask_dtype(mask_kind))
    torch.manual_seed(4)
    serial = OuterProductMean(CZ, 4, CZ).double()
    perturb_zero_parameters(serial)
    serial = serial.to(dt)
    twin = CPOuterProductMean(CZ, 4, CZ).to(dt)
    twin.load_state_dict(serial.state_dict())
    serial_pre: dict = {}
    twin_pre: dict = {}
    hooks = _prehooks(serial, serial_pre)
    with ctx:
        ref = serial(m, mask)
    for h in hooks:
        h.remove()
    layout = PairLayout.for_sizes(N, grid, n_seqs=S)
    hooks = _prehooks(twin, twin_pre)
    with DtypeAudit() as audit, ctx:
        y = twin(shard_tensor(m, "msa", grid, layout), shard_tensor(mask, "msa", grid, layout))
        full = collect_tensor(y)
        full.backward(random_grad_output(full))  # in the output's dtype, as a loss's gradient arrives
    for h in hooks:
        h.remove()
    grads = {k: (str(p.dtype), str(p.grad.dtype)) for k, p in twin.named_parameters() if p.grad is not None}
    return {
        "audit": audit.summary(),
        "out": (str(full.dtype), str(ref.dtype)),
        "pre": ({k: sorted(v) for k, v in twin_pre.items()}, {k: sorted(v) for k, v in serial_pre.items()}),
        "grads": grads,
    }


def _run_comm(grid, act, mask_kind, autocast):
    """The comm ops on activation-dtype tensors (a linear's output: bf16 under autocast)."""
    dt = ACTS[act]
    ctx = torch.autocast("cpu", dtype=torch.bfloat16) if autocast else nullcontext()
    w = torch.nn.Parameter(torch.ones(4, 4, dtype=dt))
    base = torch.randn(2, 4, generator=torch.Generator().manual_seed(grid.rank), dtype=torch.float64)
    with DtypeAudit() as audit, ctx:
        x = torch.nn.functional.linear(base.to(dt), w)
        n = grid.size
        parts = [
            comm.all_reduce(x),
            comm.sync_grad(x),
            comm.all_gather(x, 0),
            comm.reduce_scatter(torch.cat([x] * n), 0),
            comm.all_to_all(torch.cat([x] * n), [2] * n, [2] * n),
            comm.broadcast(x, 0),
            comm.permute(x, grid.rank, grid.rank),
            comm.ring_shift(x, grid, "cols"),
            comm.transpose_tiles(x.view(1, 2, 2, 2), grid).reshape(2, 4),
            comm.sync_params([w])[0].sum() * x,
        ]
        total = sum((p.float() * (i + 1)).sum() for i, p in enumerate(parts))
        total.backward()
    return {
        "audit": audit.summary(),
        "out": None,
        "pre": ({}, {}),
        "grads": {"w": (str(w.dtype), str(w.grad.dtype))},
    }


RUNNERS = {"trunk": _run_trunk, "opm": _run_opm, "comm": _run_comm}


def _rank_all(grid, cases, plant=None):
    out = {}
    for case in cases:
        driver, act, mask, ac = case
        if plant == "ring_logits":  # a cast to bf16 and back inside _RingAttention's body
            from twinshard.pair.layers import triangle_attention as ta

            orig = ta._logits

            def planted(q, *a, orig=orig):
                return orig(q.to(torch.bfloat16).to(q.dtype), *a)

            ta._logits = planted
            try:
                out[case] = RUNNERS[driver](grid, act, mask, ac)
            finally:
                ta._logits = orig
        else:
            out[case] = RUNNERS[driver](grid, act, mask, ac)
    return out


# ----------------------------------------------------------------------------- the checks


def _promote(d: str) -> str:
    return d if WIDTH.get(d, 0) >= 32 else "float32"


def function_violations(summary: dict) -> list[str]:
    """Rule checks (1), (2) of the module docstring on one rank's audit."""
    bad: list[str] = []
    events, ops, saved = summary["events"], summary["ops"], summary["saved"]
    fns = {k.rsplit(".", 1)[0] for k in events}
    for fn in sorted(fns):
        keys = [f"{fn}.forward", f"{fn}.backward"]
        inputs = {d for k in keys for what, dts in events.get(k, []) if what == "inputs" for d in dts}
        allowed = {d for d in inputs if d in FLOAT} | {_promote(d) for d in inputs if d in FLOAT}
        for k in keys:
            made = {d for d in ops.get(k, {}) if d in FLOAT}
            kept = {d for d in saved.get(k, []) if d in FLOAT}
            outs = {d for what, dts in events.get(k, []) if what == "outputs" for d in dts if d in FLOAT}
            for label, got in (("created", made), ("saved", kept), ("returned", outs)):
                extra = sorted(got - allowed)
                if extra:
                    which = {d: ops[k][d] for d in extra} if label == "created" else extra
                    bad.append(
                        f"{k}: {label} {which} outside its inputs' dtypes and their >= fp32 "
                        f"promotion {sorted(allowed)} (an unintended cast)"
                    )
    return bad


def wire_violations(summaries: list[dict]) -> list[str]:
    """Checks (3), (4) across the ranks of one case."""
    bad: list[str] = []
    for rank, s in enumerate(summaries):
        bad += [f"rank {rank}: wire dtype mismatch: {m}" for m in s["mismatches"]]
        for op, dtype, kind, _peer, fn in s["wire"]:
            if kind in ("all_reduce", "reduce_scatter", "reduce") and dtype in FLOAT and WIDTH[dtype] < 32:
                bad.append(f"rank {rank}: {op} ({kind}, in {fn}) sums in {dtype}, below fp32")
    groups: dict = {}
    for rank, s in enumerate(summaries):
        for op, dtype, kind, peer, _fn in s["wire"]:
            if kind in ("send", "recv"):
                continue
            groups.setdefault(tuple(peer), {}).setdefault(rank, []).append((op, dtype))
    for ranks, seqs in groups.items():
        first = seqs.get(ranks[0], [])
        for r in ranks:
            if seqs.get(r, []) != first:
                bad.append(f"group {ranks}: rank {r} sent {seqs.get(r, [])} but rank {ranks[0]} {first}")
    for a, s in enumerate(summaries):
        for b, t in enumerate(summaries):
            sent = [(op, d) for op, d, kind, peer, _ in s["wire"] if kind == "send" and peer == b]
            got = [(op, d) for op, d, kind, peer, _ in t["wire"] if kind == "recv" and peer == a]
            if sent != got:
                bad.append(f"messages {a} -> {b}: sent as {sent}, received as {got}")
    return bad


def module_violations(res: dict, case: tuple) -> list[str]:
    """Check (5): output dtype, pre-hook intermediates against the serial module, gradient dtypes."""
    bad: list[str] = []
    if res["out"] is not None and res["out"][0] != res["out"][1]:
        bad.append(f"output {res['out'][0]}, serial {res['out'][1]}")
    twin_pre, serial_pre = res["pre"]
    for name in sorted(set(twin_pre) & set(serial_pre)):
        if twin_pre[name] != serial_pre[name]:
            bad.append(
                f"{name} receives {twin_pre[name]} in the twin, {serial_pre[name]} in the serial module"
            )
    for name, (p, g) in res["grads"].items():
        if p != g:
            bad.append(f"{name}.grad is {g}, the parameter {p}")
    return bad


@pytest.fixture(scope="module", params=GRIDS, ids=lambda g: f"{g[0]}x{g[1]}")
def audits(request):
    return request.param, run_on_grid(_rank_all, request.param, CASES)


def _id(case):
    return "-".join(str(c) if not isinstance(c, bool) else ("autocast" if c else "plain") for c in case)


@pytest.mark.parametrize("case", CASES, ids=[_id(c) for c in CASES])
def test_dtype_paths(audits, case):
    shape, ranks = audits
    results = [r[case] for r in ranks]
    bad = []
    for rank, res in enumerate(results):
        bad += [f"rank {rank}: {v}" for v in function_violations(res["audit"])]
        bad += [f"rank {rank}: {v}" for v in module_violations(res, case)]
    bad += wire_violations([r["audit"] for r in results])
    fns = {k.rsplit(".", 1)[0] for k in results[0]["audit"]["events"]}
    assert fns, f"{_id(case)}: no audited Function ran (vacuous)"
    assert not bad, f"{_id(case)} on {shape[0]}x{shape[1]}:\n" + "\n".join(bad[:20])


# ops that may make a tensor narrower than fp32 inside a compute Function: data movement only
MOVES = {
    "_to_copy",
    "copy_",
    "clone",
    "view",
    "_unsafe_view",
    "reshape",
    "transpose",
    "permute",
    "t",
    "expand",
    "slice",
    "select",
    "narrow",
    "unsqueeze",
    "squeeze",
    "cat",
    "stack",
    "split",
    "split_with_sizes",
    "unbind",
    "empty",
    "new_empty",
    "empty_like",
    "zeros",
    "new_zeros",
    "zeros_like",
    "zero_",
    "fill_",
    "detach",
    "alias",
    "as_strided",
    "lift_fresh",
    "_pad0",
    "constant_pad_nd",
    "index",
    "index_put_",
    "masked_fill",
    "slice_scatter",
    "empty_strided",
}


# Stated exceptions to rule 2, with the reason: the distogram head's own ops (the symmetrisation
# z + z^T and the logits linear, forward and their recomputation and adjoint in backward) run in
# the activation dtype, as the serial DistogramHead computes them (Boltz's head runs under autocast
# too); the loss after them is the fp32 region.
HEAD_OPS = {"DistogramLossFunction": {"add", "addmm", "mm", "linear"}}


def narrow_math(summary: dict, compute: set[str]) -> list[str]:
    """Rule 2: inside a ``cast="compute"`` Function no arithmetic op returns a tensor narrower
    than fp32 (copies, casts and views may: a bf16 tile stored or sent as bf16)."""
    bad = []
    for key, by_dtype in summary["ops"].items():
        if key.rsplit(".", 1)[0] not in compute:
            continue
        for d, names in by_dtype.items():
            if d in FLOAT and WIDTH[d] < 32:
                fn = key.rsplit(".", 1)[0]
                ok = MOVES | HEAD_OPS.get(fn, set())
                math = sorted(n for n in names if n.split(".")[0] not in ok)
                if math:
                    bad.append(f"{key}: {math} computed in {d} (an fp32 region)")
    return bad


def test_compute_functions_do_math_in_fp32(audits):
    """Rule 2 (Boltz's fp32 regions): in every case, the arithmetic inside each ``cast="compute"``
    Function runs in >= fp32, and each of them ran in some case."""
    shape, ranks = audits
    compute = {c.__name__ for c in _functions() if getattr(c, "_autocast_rule", "missing") == "compute"}
    seen, bad = set(), []
    for case in CASES:
        for res in (r[case] for r in ranks):
            seen |= {k.rsplit(".", 1)[0] for k in res["audit"]["events"]} & compute
            bad += [f"{_id(case)}: {v}" for v in narrow_math(res["audit"], compute)]
    assert {"_GridContract", "_RingAttention", "DistogramLossFunction", "_LayerNormFn"} <= seen, seen
    assert not bad, "\n".join(sorted(set(bad))[:20])


def _functions() -> list[type]:
    out = []
    for pkg in (comm_pkg, pair_pkg):
        for info in pkgutil.walk_packages(pkg.__path__, pkg.__name__ + "."):
            if ".interop" in info.name:
                continue
            mod = importlib.import_module(info.name)
            for _, obj in inspect.getmembers(mod, inspect.isclass):
                if (
                    issubclass(obj, torch.autograd.Function)
                    and obj.__module__ == mod.__name__
                    and obj is not torch.autograd.Function
                ):
                    out.append(obj)
    return out


def test_every_function_carries_the_rule():
    """Every autograd Function under twinshard.comm and twinshard.pair carries ``autocast_rule``
    and states its dtype path in its docstring."""
    fns = _functions()
    assert len(fns) >= 20, [f.__name__ for f in fns]
    missing = [f"{f.__module__}.{f.__name__}" for f in fns if not hasattr(f, "_autocast_rule")]
    undocumented = [f"{f.__module__}.{f.__name__}" for f in fns if "Dtype path" not in (f.__doc__ or "")]
    assert not missing, f"Functions without the autocast rule: {missing}"
    assert not undocumented, f"Functions whose docstring states no dtype path: {undocumented}"


def test_planted_cast_inside_a_function_is_caught():
    """Negative control: a cast to bf16 and back, inserted inside ``_RingAttention``'s body in an
    fp32 run. The output dtype is unchanged (fp32), so nothing outside the Function sees it; the
    audit does."""
    case = ("trunk", "fp32", "bool", False)
    (res,) = run_on_grid(_rank_all, (1, 1), [case], plant="ring_logits")
    bad = function_violations(res[case]["audit"])
    assert module_violations(res[case], case) == [], "the planted cast changed a dtype outside"
    assert any(v.startswith("_RingAttention.") and "bfloat16" in v for v in bad), bad
