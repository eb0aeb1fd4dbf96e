"""Attention backends (``sdpa``, ``flex``) against the reference path, serial and CP twins.

What each test proves:
- ``test_serial_backend_matches_reference``: the serial modules (attention with pair bias,
  triangle attention starting and ending node) with backend ``sdpa`` / ``flex`` equal the same
  modules on the ``reference`` backend in fp64 at the round-off gate: output, input gradients
  and every parameter gradient (torch 2.13's CPU SDPA flash kernel and eager FlexAttention both
  run in fp64).
- ``test_cp_backend_matches_reference``: the CP twins on a backend equal the serial module on
  the reference backend (fp64, round-off gate) on 1x1, 2x2 and 2x3 with uneven N (padding, and
  on 2x2/2x3 several key blocks merged by their log-sum-exp), with a random mask (fully masked
  rows / samples), forward and backward (input gradients and every parameter gradient).
- ``test_cp_backend_fp32``: the same in fp32 against the fp32 serial reference-path module,
  within ``FP32_WHY``: both sides are fp32 evaluations of the same function that differ only in
  summation order (fused kernel blocks, log-sum-exp merge, recomputed backward), so the budget is
  the harness's fp32 round-off formula ``2 eps + 16 sqrt(n) eps`` with ``n = B N^2`` (the longest
  sum behind any compared value: a parameter gradient over every pair entry) times the largest
  reference magnitude. The measured error is printed (the harness's evidence line).
- ``test_backend_disagreement_raises``: one rank on another backend raises the same ValueError
  on every rank (the backend changes the rounding, so it is agreed), before any buffer moves.
- ``test_serial_backend_bf16_within_reference_error``: bf16 parameters and activations: each
  backend's error against the fp64 module, per output / gradient, within 2 x the reference
  path's own error (``BF16_WHY``).
- ``test_unknown_backend_refused``: a backend name not in the list is refused, naming the choices.

Planted bugs (tools/mutations.py): the SDPA path dropping the mask bias, the log-sum-exp merge
shifting by the block's own maximum instead of the row's, the backend agreement removed.
"""

from __future__ import annotations

import pytest
import torch

from twinshard.pair.features import PairLayout, collect_grad, collect_tensor, real_part, shard_tensor
from twinshard.pair.layers import CPAttentionPairBias
from twinshard.pair.layers.triangle_attention import (
    CPTriangleAttentionEndingNode,
    CPTriangleAttentionStartingNode,
)
from twinshard.pair.reference.attention import AttentionPairBias
from twinshard.pair.reference.attention_backends import BACKENDS, attention_backend
from twinshard.pair.reference.triangle_attention import (
    TriangleAttentionEndingNode,
    TriangleAttentionStartingNode,
)
from twinshard.testing import (
    TwinResult,
    assert_parity,
    check_twin,
    grid_id,
    parameter_signature,
    perturb_zero_parameters,
    random_grad_output,
    random_mask,
    run_on_grid,
    serial_reference,
    synthetic,
)

CS, CZ, HEADS = 8, 6, 2  # attention with pair bias: single and pair channels, heads
C, CH = 6, 4  # triangle attention: pair channels, per-head width (HEADS heads)
OPS = ("apb", "tri-start", "tri-end")
FAST = ("sdpa", "flex")
_DTYPES = {"float64": torch.float64, "float32": torch.float32}
# The pair-bias LayerNorm's bias shifts a whole softmax row: its gradient is zero in exact
# arithmetic (as in test_attention_pair_bias), checked against zero by the harness.
ZERO_GRADS = {"apb": ("proj_z.0.bias",), "tri-start": (), "tri-end": ()}


def _serial(op: str, dtype: torch.dtype, backend: str | None = None):
    torch.manual_seed(17)
    if op == "apb":
        m = AttentionPairBias(CS, CZ, HEADS, backend=backend)
    else:
        cls = TriangleAttentionStartingNode if op == "tri-start" else TriangleAttentionEndingNode
        m = cls(C, c_hidden=CH, no_heads=HEADS, backend=backend)
    m = m.double()
    perturb_zero_parameters(m)
    with torch.no_grad():
        for p in m.parameters():
            p.add_(0.1 * torch.randn_like(p))
    return m.to(dtype)


def _twin(op: str, serial, backend: str):
    dtype = next(serial.parameters()).dtype
    if op == "apb":
        twin = CPAttentionPairBias(CS, CZ, HEADS, backend=backend)
    else:
        cls = CPTriangleAttentionStartingNode if op == "tri-start" else CPTriangleAttentionEndingNode
        twin = cls(C, c_hidden=CH, no_heads=HEADS, backend=backend)
    twin = twin.to(dtype)
    twin.load_state_dict(serial.state_dict())
    return twin


def _inputs(op: str, b: int, n: int, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    if op == "apb":
        mask = random_mask(b, n, seed=8, keep=0.7).to(dtype)
        mask[0, 0] = 1
        if b > 1:
            mask[1] = 0  # a fully masked sample: no mask bias (the reference's rule)
        return {
            "s": synthetic(b, n, CS, seed=3, dtype=dtype),
            "z": synthetic(b, n, n, CZ, seed=4, dtype=dtype),
            "mask": mask,
        }
    mask = random_mask(b, n, n, seed=7, keep=0.75).to(dtype)
    mask[0, 1, :] = 0  # a fully masked row (starting-node frame)
    mask[-1, :, n - 2] = 0  # a fully masked column (ending-node frame)
    return {"z": synthetic(b, n, n, C, seed=1, dtype=dtype), "mask": mask}


def _serial_call(op: str, m, x: dict[str, torch.Tensor]):
    return (lambda s, z: m(s, z, x["mask"])) if op == "apb" else (lambda z: m(z, x["mask"]))


def _diff(op: str, x: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: x[k] for k in (("s", "z") if op == "apb" else ("z",))}


# -- serial ---------------------------------------------------------------------------------


@pytest.mark.parametrize("backend", FAST)
@pytest.mark.parametrize("op", OPS)
def test_serial_backend_matches_reference(op, backend):
    b, n = 2, 7
    x = _inputs(op, b, n, torch.float64)
    ref_m, fast_m = _serial(op, torch.float64), _serial(op, torch.float64, backend)
    ref = serial_reference(ref_m, _serial_call(op, ref_m, x), _diff(op, x), grad_seed=6)
    got = serial_reference(fast_m, _serial_call(op, fast_m, x), _diff(op, x), grad_seed=6)
    what = f"serial {op} backend={backend} float64 N={n} B={b}"
    assert_parity(got["serial_out"], ref["serial_out"], what=f"{what} out")
    for k, g in ref["serial_grads_in"].items():
        assert_parity(got["serial_grads_in"][k], g, what=f"{what} d/d{k}")
    scale = max(float(g.abs().max()) for g in ref["serial_param_grads"].values())
    for k, g in ref["serial_param_grads"].items():
        if k in ZERO_GRADS[op]:  # analytically zero: both at round-off of the largest gradient
            assert float(got["serial_param_grads"][k].abs().max()) <= 1e-12 * scale, f"{what}: {k} not ~0"
            continue
        assert_parity(got["serial_param_grads"][k], g, what=f"{what} param grad {k}")


# -- CP twins ---------------------------------------------------------------------------------


def _rank(grid, op, backend, b, n, dtype_name="float64", mine=None):
    """Every rank: the twin on ``backend`` (``mine``: this rank's own backend, for the
    disagreement test) on its padded tiles, output gathered, random grad_output back."""
    dtype = _DTYPES[dtype_name]
    layout = PairLayout.for_sizes(n, grid)
    x = _inputs(op, b, n, dtype)
    twin = _twin(op, _serial(op, dtype), None if mine is not None else backend)
    leaves = {k: v.clone().requires_grad_(True) for k, v in _diff(op, x).items()}
    kind = {"s": "single", "z": "pair"}
    shards = {k: shard_tensor(v, kind[k], grid, layout) for k, v in leaves.items()}
    mask = shard_tensor(x["mask"], "single" if op == "apb" else "pair", grid, layout)
    try:
        with attention_backend(mine or "reference"):
            out = twin(shards["s"], shards["z"], mask) if op == "apb" else twin(shards["z"], mask)
    except ValueError as e:
        if mine is None:
            raise
        return str(e)
    full = collect_tensor(out)
    full.backward(random_grad_output(full, seed=6))
    pieces = {"z": real_part(shards["z"])}
    if op != "apb" or grid.rows > 1:
        pieces["out"] = real_part(out)
    return TwinResult(
        out=full.detach(),
        grads_in={k: collect_grad(v.grad, kind[k], grid) for k, v in leaves.items()},
        param_grads={k: p.grad for k, p in twin.named_parameters()},
        shards=pieces,
        params=parameter_signature(twin),
    )


FP32_WHY = (
    "fp32, both sides fp32 evaluations of one function differing in summation order only: the "
    "harness round-off formula 2 eps + 16 sqrt(n) eps (eps = 1.2e-7) with n = B N^2, the longest "
    "sum behind any compared value (a parameter gradient over every pair entry), times the "
    "largest reference magnitude over output and gradients"
)


def _check(grid, op, backend, b, n, ranks, dtype_name="float64"):
    dtype = _DTYPES[dtype_name]
    serial = _serial(op, dtype)  # the reference path
    x = _inputs(op, b, n, dtype)
    ref = serial_reference(serial, _serial_call(op, serial, x), _diff(op, x), grad_seed=6)
    tol = {}
    if dtype == torch.float32:
        eps = torch.finfo(dtype).eps
        k = 2 * eps + 16 * (b * n * n) ** 0.5 * eps
        scale = max(
            float(t.abs().max())
            for t in [
                ref["serial_out"],
                *ref["serial_grads_in"].values(),
                *ref["serial_param_grads"].values(),
            ]
        )
        tol = {"rtol": 0.0, "atol": k * scale, "why": f"{FP32_WHY} = {k:.2g} x {scale:.3g}"}
    check_twin(
        what=f"{op} backend={backend} mask {dtype_name} N={n} B={b}",
        grid=grid_id(grid),
        ranks=ranks,
        zero_grads=ZERO_GRADS[op],
        **tol,
        **ref,
    )


# (grid, N, B): 1x1 (one key block: the whole row in one kernel call); 2x2 and 2x3 with uneven N
# (padding; several key blocks merged by their log-sum-exp, the ring's online merge for triangles).
CASES = [((1, 1), 5, 2), ((2, 2), 7, 2), ((2, 3), 9, 1)]


@pytest.mark.parametrize("backend", FAST)
@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("grid,n,b", CASES, ids=[f"{grid_id(g)}-N{n}" for g, n, _ in CASES])
def test_cp_backend_matches_reference(grid, n, b, op, backend):
    ranks = run_on_grid(_rank, grid, op, backend, b, n)
    _check(grid, op, backend, b, n, ranks)


@pytest.mark.parametrize("op", OPS)
def test_cp_backend_fp32(op):
    grid, n, b = (2, 3), 9, 1
    ranks = run_on_grid(_rank, grid, op, "sdpa", b, n, "float32")
    _check(grid, op, "sdpa", b, n, ranks, "float32")


# -- agreement and bad input --------------------------------------------------------------------


@pytest.mark.parametrize("op", ("apb", "tri-start"))
def test_backend_disagreement_raises(op):
    """Rank 1 on ``sdpa`` while the others are on ``reference``: every rank raises the same error."""
    grid = (1, 2)

    ranks = run_on_grid(_rank_disagree, grid, op)
    assert all(isinstance(r, str) for r in ranks), (
        f"{op}: a rank on another attention backend went unnoticed: the backend is not agreed across ranks"
    )
    assert len(set(ranks)) == 1 and "attention backend" in ranks[0] and "sdpa" in ranks[0], ranks


def _rank_disagree(grid, op):
    return _rank(grid, op, None, 1, 4, "float64", mine="sdpa" if grid.rank == 1 else "reference")


def _stack_disagree(grid):
    """A CP Pairformer stack (attention with pair bias and both triangle attentions inside, no
    per-call agreement there) with rank 1 in the ``sdpa`` context: the stack's one agreement of its
    control scalars names the backends."""
    from twinshard.pair.features import shard_tensor
    from twinshard.pair.layers.pairformer import CPPairformerStack
    from twinshard.pair.layout import PairLayout
    from twinshard.pair.reference.attention_backends import attention_backend

    torch.manual_seed(0)
    stack = CPPairformerStack(8, 4, 1, num_heads=2, pairwise_head_width=2, pairwise_num_heads=2).double()
    lay = PairLayout.for_sizes(4, grid)
    g = torch.Generator().manual_seed(1)
    s = shard_tensor(torch.randn(1, 4, 8, generator=g, dtype=torch.float64), "single", grid, lay)
    z = shard_tensor(torch.randn(1, 4, 4, 4, generator=g, dtype=torch.float64), "pair", grid, lay)
    with attention_backend("sdpa" if grid.rank == 1 else "reference"):
        try:
            stack(s, z)
        except ValueError as exc:
            return str(exc)
    return None


def test_backend_disagreement_in_a_stack_raises():
    ranks = run_on_grid(_stack_disagree, (1, 2))
    assert all(isinstance(r, str) for r in ranks), (
        f"a rank on another backend went unnoticed in a stack: {ranks}"
    )
    assert len(set(ranks)) == 1 and "attention_backends" in ranks[0] and "sdpa" in ranks[0], ranks


def test_unknown_backend_refused():
    with pytest.raises(ValueError, match=r"attention backend must be one of \('reference', 'sdpa', 'flex'\)"):
        AttentionPairBias(CS, CZ, HEADS, backend="flash")
    with pytest.raises(ValueError, match="attention backend must be one of"):
        with attention_backend("cudnn"):
            pass
    assert BACKENDS == ("reference", "sdpa", "flex")


BF16_WHY = (
    "bf16 (parameters and activations): a backend differs from the reference path only inside "
    "the fp32 attention region (both cast q, k, v and the bias to fp32 first), by fp32 round-off "
    "far below one bf16 ulp; after the casts back to bf16 it can only flip roundings the reference "
    "path also makes, so its error against the fp64 module is at most the reference path's own "
    "error plus one more of the same size: <= 2 x the reference path's error, per compared tensor"
)


@pytest.mark.parametrize("backend", FAST)
@pytest.mark.parametrize("op", OPS)
def test_serial_backend_bf16_within_reference_error(op, backend):
    b, n = 2, 7
    x64 = _inputs(op, b, n, torch.float64)
    x16 = {k: v.to(torch.bfloat16) for k, v in x64.items()}
    truth_m = _serial(op, torch.float64)
    truth = serial_reference(truth_m, _serial_call(op, truth_m, x64), _diff(op, x64), grad_seed=6)
    runs = {}
    for name in ("reference", backend):
        m = _serial(op, torch.bfloat16, name)
        runs[name] = serial_reference(m, _serial_call(op, m, x16), _diff(op, x16), grad_seed=6)

    def errors(run):
        out = {"out": run["serial_out"]} | {f"d/d{k}": g for k, g in run["serial_grads_in"].items()}
        out |= {k: g for k, g in run["serial_param_grads"].items() if k not in ZERO_GRADS[op]}
        want = {"out": truth["serial_out"]} | {f"d/d{k}": g for k, g in truth["serial_grads_in"].items()}
        want |= {k: g for k, g in truth["serial_param_grads"].items() if k not in ZERO_GRADS[op]}
        return {k: float((out[k].double() - want[k]).abs().max()) for k in want}

    ref_err, got_err = errors(runs["reference"]), errors(runs[backend])
    worst = max(got_err[k] / max(ref_err[k], 1e-30) for k in ref_err)
    print(
        f"bf16 {op} backend={backend}: worst error ratio to the reference path's {worst:.3f} (budget 2; {BF16_WHY})"
    )
    for k in ref_err:
        assert got_err[k] <= 2 * ref_err[k], (
            f"bf16 {op} backend={backend} {k}: error {got_err[k]:.3g} vs fp64 > 2 x the reference path's "
            f"{ref_err[k]:.3g} ({BF16_WHY})"
        )
