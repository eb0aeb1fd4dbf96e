"""CP Pairformer layer and stack against the serial references.

What each test proves:
- ``test_cp_pairformer_layer_matches_serial``: one layer in training mode with Boltz-convention
  dropout (p = 0.25) and random token and pair masks: both outputs, the gradients of ``s`` and
  ``z`` and every parameter gradient equal serial (fp64, round-off gate) on 1x1, 2x2, 3x3, 1x2,
  2x3 grids, even and uneven N; the output's padding stays exactly zero.
- ``test_cp_pairformer_layer_af3_no_masks``: AF3 convention, ``post_layer_norm``, masks from the
  layout only (mask=None) on padded input, 2x3 and 3x3.
- ``test_cp_pairformer_stack_matches_serial``: a 2-layer stack (and the same with activation
  checkpointing) at 2x2 and 3x3, uneven N; serial ``state_dict`` loads unchanged.
- ``test_saved_bytes_per_rank``: saved-for-backward bytes per rank <= 1.25 x serial / P for the
  layer at 2x2 and 3x3.
- ``test_checkpointing_peak_memory`` (strict xfail, the measured gap in ``PEAK_GAP``): with
  checkpointing, the per-rank tensor peak of a 4-layer stack's forward+backward at most one
  layer's peak plus the saved layer inputs. ``test_checkpointing_scaling``: what holds today.
- ``test_control_scalars_must_agree`` (one case per agreed scalar of the stack: depth,
  checkpointing, train mode, seed, grad mode, each site's dropout rate and convention, the masks'
  presence, token count, shapes, dtypes): the scalar differing on the last rank raises the same
  error on every rank, naming that scalar alone with both values and the ranks, before any layer
  runs. ``test_control_scalars_compare_exactly``: by repr (an ulp differs, NaN agrees).
- ``test_negative_controls``: planted from the test: a residual that skips the dropout of one
  site, and a dropout site whose stream differs from serial, each fail parity with the message
  named; a checkpointed stack whose recompute draws other masks fails too.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import re

import pytest
import torch
import torch.distributed as dist

from twinshard.memory import SavedBytes, peak_memory_during
from twinshard.pair.features import (
    PairLayout,
    collect_grad,
    collect_tensor,
    layout_of,
    padding_keep,
    real_part,
    shard_tensor,
)
from twinshard.pair.layers.pairformer import CPPairformerLayer, CPPairformerStack, agree_scalars
from twinshard.pair.reference import PairformerLayer, PairformerStack, assign_dropout_streams
from twinshard.testing import (
    TwinResult,
    assert_parity,
    assert_replicated,
    check_twin,
    grid_id,
    parameter_signature,
    perturb_zero_parameters,
    random_grad_output,
    random_mask,
    run_on_grid,
    run_on_world,
    serial_reference,
    synthetic,
)

CS, CZ, HEADS, PHW, PHEADS = 8, 6, 2, 4, 2
SEED = 11
P_DROP = 0.25
F64 = torch.float64
# The pair-bias LayerNorm's bias of attention with pair bias adds a per-head constant to every
# logit of a softmax row: its gradient is zero in exact arithmetic (test_attention_pair_bias).
ANALYTIC_ZERO = ".attention.proj_z.0.bias"


def _kw(convention="boltz", post_layer_norm=False, p=P_DROP):
    return dict(
        num_heads=HEADS,
        dropout=p,
        pairwise_head_width=PHW,
        pairwise_num_heads=PHEADS,
        post_layer_norm=post_layer_norm,
        convention=convention,
    )


def _perturb(m: torch.nn.Module) -> None:
    perturb_zero_parameters(m)
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for p in m.parameters():
            p.add_(0.1 * torch.randn(p.shape, generator=g, dtype=p.dtype))


def _serial(layers: int | None, **kw) -> torch.nn.Module:
    torch.manual_seed(17)
    if layers is None:
        m = PairformerLayer(CS, CZ, **_kw(**kw)).double()
        assign_dropout_streams(m)
    else:
        m = PairformerStack(CS, CZ, layers, **_kw(**kw)).double()
    _perturb(m)
    return m.train()


def _twin(serial: torch.nn.Module, layers: int | None, checkpointing=False, **kw) -> torch.nn.Module:
    if layers is None:
        twin = CPPairformerLayer(CS, CZ, **_kw(**kw)).double()
        assign_dropout_streams(twin)
    else:
        twin = CPPairformerStack(CS, CZ, layers, activation_checkpointing=checkpointing, **_kw(**kw)).double()
    twin.load_state_dict(serial.state_dict())  # the serial state_dict, unchanged
    return twin.train()


def _inputs(b: int, n: int):
    s = synthetic(b, n, CS, seed=3)
    z = synthetic(b, n, n, CZ, seed=4)
    mask = random_mask(b, n, seed=8, keep=0.75)
    mask[:, 0] = 1
    pair_mask = mask[:, :, None] * mask[:, None, :] * random_mask(b, n, n, seed=9, keep=0.9)
    return s, z, mask, pair_mask


def _flat(s: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
    return torch.cat([s.flatten(), z.flatten()])


def _padding_is_zero(y, kind) -> bool:
    keep = padding_keep(y, layout_of(y), kind)
    if keep is None:
        return True
    local = y.to_local()
    keep = keep.view(keep.shape + (1,) * (local.dim() - keep.dim())).expand(local.shape)
    return bool((local.masked_select(~keep) == 0).all())


def _rank_pairformer(grid, b, n, layers=None, masks=True, checkpointing=False, plant=None, **kw):
    layout = PairLayout.for_sizes(n, grid)
    twin = _twin(_serial(layers, **kw), layers, checkpointing, **kw)
    if plant is not None:
        plant(twin)
    s, z, mask, pair_mask = _inputs(b, n)
    s.requires_grad_(True)
    z.requires_grad_(True)
    sd, zd = shard_tensor(s, "single", grid, layout), shard_tensor(z, "pair", grid, layout)
    md = shard_tensor(mask, "single", grid, layout) if masks else None
    pmd = shard_tensor(pair_mask, "pair", grid, layout) if masks else None
    so, zo = twin(sd, zd, md, pmd, seed=SEED)
    full = _flat(collect_tensor(so), collect_tensor(zo))

    full.backward(random_grad_output(full, seed=6))
    return TwinResult(
        out=full.detach(),
        grads_in={"s": collect_grad(s.grad, "single", grid), "z": collect_grad(z.grad, "pair", grid)},
        param_grads={k: p.grad for k, p in twin.named_parameters()},
        shards={"z": real_part(zd)} | ({"s": real_part(sd)} if grid.rows > 1 else {}),
        params=parameter_signature(twin),
    ), (_padding_is_zero(so, "single") and _padding_is_zero(zo, "pair"))


def _check(grid, b, n, ranks, layers=None, masks=True, what="pairformer", **kw):
    serial = _serial(layers, **kw)
    s, z, mask, pair_mask = _inputs(b, n)
    m, pm = (mask, pair_mask) if masks else (None, None)
    ref = serial_reference(serial, lambda s, z: _flat(*serial(s, z, m, pm, seed=SEED)), {"s": s, "z": z}, 6)
    results = [r[0] for r in ranks]
    zero = [k for k in ref["serial_param_grads"] if k.endswith(ANALYTIC_ZERO) or k == ANALYTIC_ZERO[1:]]
    serial_zero = {k: ref["serial_param_grads"].pop(k) for k in zero}
    twin_zero = [{k: r.param_grads[k] for k in zero} for r in results]
    results = [
        dataclasses.replace(r, param_grads={k: v for k, v in r.param_grads.items() if k not in zero})
        for r in results
    ]
    what = f"{what} N={n} B={b}"
    check_twin(what=what, grid=grid_id(grid), ranks=results, **ref)
    scale = max(float(t.abs().max()) for t in ref["serial_param_grads"].values())
    eps = torch.finfo(F64).eps
    k0 = 2 * eps + 16 * 4096**0.5 * eps
    assert_replicated(twin_zero, f"{what}: analytically zero grads")
    for k in zero:
        for name, g in (("distributed", twin_zero[0][k]), ("serial", serial_zero[k])):
            assert_parity(
                g,
                torch.zeros_like(g),
                what=f"{what} {name} grad {k}",
                grid=grid_id(grid),
                rtol=0.0,
                atol=k0 * scale,
                why=f"analytically zero: round-off of cancelling terms, {k0:.2g} x max|grad| {scale:.3g}",
            )
    for r, (_, pad_zero) in enumerate(ranks):
        assert pad_zero, f"rank {r}: padding of an output is not exactly zero"


LAYER_CASES = [
    ((1, 1), 5, 2),
    ((2, 2), 6, 1),
    ((2, 2), 7, 1),
    ((3, 3), 6, 1),
    ((3, 3), 7, 1),
    ((1, 2), 4, 1),
    ((1, 2), 5, 1),
    ((2, 3), 6, 1),
    ((2, 3), 9, 1),
]


@pytest.mark.parametrize("grid,n,b", LAYER_CASES, ids=[f"{grid_id(g)}-N{n}" for g, n, _ in LAYER_CASES])
def test_cp_pairformer_layer_matches_serial(grid, n, b):
    ranks = run_on_grid(_rank_pairformer, grid, b, n)
    _check(grid, b, n, ranks, what="pairformer-layer boltz-dropout")


@pytest.mark.parametrize("grid", [(2, 3), (3, 2)], ids=grid_id)
def test_cp_pairformer_layer_with_tiles_of_padding_only(grid):
    """N = 4 on 2x3 pads z to 4 x 6 (3x2: 6 x 4): a whole block of the longer axis is padding, so
    some tiles and contraction pieces lie wholly beyond the other axis's extent. The harness's
    sharding check needs real data on every rank, so parity is checked directly here: output,
    input gradients and parameter gradients equal serial at round-off."""
    n = 4
    ranks = run_on_grid(_rank_pairformer, grid, 1, n)
    serial = _serial(None)
    s, z, mask, pair_mask = _inputs(1, n)
    ref = serial_reference(
        serial, lambda s, z: _flat(*serial(s, z, mask, pair_mask, seed=SEED)), {"s": s, "z": z}, 6
    )
    what, g = f"pairformer-layer N={n} padding-only tiles", grid_id(grid)
    for r, (res, pad_zero) in enumerate(ranks):
        assert pad_zero, f"rank {r}: padding of an output is not exactly zero"
        assert_parity(res.out, ref["serial_out"], what=f"{what} out", grid=g)
        for k, want in ref["serial_grads_in"].items():
            assert_parity(res.grads_in[k], want, what=f"{what} grad {k}", grid=g)
        for k, want in ref["serial_param_grads"].items():
            if not (k.endswith(ANALYTIC_ZERO) or k == ANALYTIC_ZERO[1:]):
                assert_parity(res.param_grads[k], want, what=f"{what} param grad {k}", grid=g)


@pytest.mark.parametrize("grid,n", [((2, 3), 9), ((3, 3), 8)], ids=["2x3-N9", "3x3-N8"])
def test_cp_pairformer_layer_af3_no_masks(grid, n):
    kw = dict(convention="af3", post_layer_norm=True)
    ranks = run_on_grid(_rank_pairformer, grid, 1, n, masks=False, **kw)
    _check(grid, 1, n, ranks, masks=False, what="pairformer-layer af3-dropout no-mask", **kw)


@pytest.mark.parametrize("checkpointing", [False, True], ids=["plain", "checkpointed"])
@pytest.mark.parametrize("grid,n", [((2, 2), 7), ((3, 3), 7)], ids=["2x2-N7", "3x3-N7"])
def test_cp_pairformer_stack_matches_serial(grid, n, checkpointing):
    ranks = run_on_grid(_rank_pairformer, grid, 1, n, layers=2, checkpointing=checkpointing)
    _check(grid, 1, n, ranks, layers=2, what=f"pairformer-stack2 ckpt={checkpointing}")


# -- memory --------------------------------------------------------------------------------------


def _saved_bytes(forward) -> int:
    with SavedBytes() as saved:
        out = forward()
    del out
    return saved.bytes


def _rank_saved(grid, b, n):
    layout = PairLayout.for_sizes(n, grid)
    serial = _serial(None)
    twin = _twin(serial, None)
    s, z, mask, pair_mask = _inputs(b, n)
    ss, zs = s.clone().requires_grad_(True), z.clone().requires_grad_(True)
    serial_bytes = _saved_bytes(lambda: serial(ss, zs, mask, pair_mask, seed=SEED))
    sd = shard_tensor(s, "single", grid, layout).detach().requires_grad_(True)
    zd = shard_tensor(z, "pair", grid, layout).detach().requires_grad_(True)
    md, pmd = shard_tensor(mask, "single", grid, layout), shard_tensor(pair_mask, "pair", grid, layout)
    twin_bytes = _saved_bytes(lambda: twin(sd, zd, md, pmd, seed=SEED))
    return serial_bytes, twin_bytes, sum(p.nbytes for p in serial.parameters())


@pytest.mark.parametrize("grid,n,b", [((2, 2), 8, 4), ((3, 3), 9, 6)], ids=["2x2-N8", "3x3-N9"])
def test_saved_bytes_per_rank(grid, n, b):
    """Distinct storages packed by saved_tensors_hooks during the forward; parameters (replicated,
    not divided by P) are counted on both sides, so B is large enough for activations to
    dominate at these tiny sizes; the ratio without them is checked as well."""
    ranks = run_on_grid(_rank_saved, grid, b, n)
    p = grid[0] * grid[1]
    serial, _, params = ranks[0]
    worst = max(t for _, t, _ in ranks)
    ratio = worst / (serial / p)
    ratio_act = (worst - params) / ((serial - params) / p)
    print(
        f"saved bytes pairformer-layer {grid_id(grid)} N={n} B={b}: serial {serial}, max per rank {worst}, "
        f"ratio {ratio:.3f}; without the {params} parameter bytes {ratio_act:.3f}"
    )
    assert ratio <= 1.25, f"saved bytes per rank {worst} > 1.25 x serial/P ({serial}/{p}): ratio {ratio:.3f}"
    assert ratio_act <= 1.25, f"saved activation bytes per rank: ratio {ratio_act:.3f} > 1.25"


def _rank_peak(grid, b, n, layers, checkpointing):
    layout = PairLayout.for_sizes(n, grid)
    twin = _twin(_serial(layers), layers, checkpointing)
    for p in twin.parameters():  # activation memory only: parameter gradients are a fixed cost per layer
        p.requires_grad_(False)
    s, z, mask, pair_mask = _inputs(b, n)
    sd = shard_tensor(s, "single", grid, layout).detach().requires_grad_(True)
    zd = shard_tensor(z, "pair", grid, layout).detach().requires_grad_(True)
    md, pmd = shard_tensor(mask, "single", grid, layout), shard_tensor(pair_mask, "pair", grid, layout)
    inputs = sd.to_local().nbytes + zd.to_local().nbytes
    tile = zd.to_local().nbytes
    # random output gradients, allocated before the measured window (the same in every run)
    gs, gz = (random_grad_output(t.to_local(), seed=5 + i) for i, t in enumerate((sd, zd)))

    def step():
        so, zo = twin(sd, zd, md, pmd, seed=SEED)
        torch.autograd.backward((so.to_local(), zo.to_local()), (gs, gz))

    step()  # warm-up: lazily built communication plans and caches
    sd.grad = zd.grad = None
    _, peak = peak_memory_during(step, torch.device("cpu"))
    return peak, inputs, tile


@functools.cache  # both checkpointing tests read the same three runs
def _peaks(grid, b, n):
    return {
        "one": run_on_grid(_rank_peak, grid, b, n, None, False),
        "four": run_on_grid(_rank_peak, grid, b, n, 4, True),
        "four_plain": run_on_grid(_rank_peak, grid, b, n, 4, False),
    }


def test_checkpointing_peak_memory():
    """Tensor peak per rank of forward+backward: a 4-layer checkpointed stack <= one (not
    checkpointed) layer + 4 saved layer inputs (the local tiles of s and z). Parameters are
    frozen in all three runs (their gradients, L x the parameter bytes, are not activations
    and do not shrink with checkpointing); the inputs require grad, so backward runs through
    every layer and every recompute.

    Allowance: one pair tile of z (the receive buffer of an overlapped ring shift: whether it is
    alive at the moment of the peak depends on message timing, measured 0-460 B over the strict
    bound across runs). Before torch's RNG state stopped being saved per layer
    (``preserve_rng_state=False``: dropout is counter-based) the excess was ~7.4 kB per layer."""
    peaks = _peaks((2, 2), 2, 8)
    for r, ((p1, inp, tile), (p4, _, _)) in enumerate(zip(peaks["one"], peaks["four"])):
        assert p4 <= p1 + 4 * inp + tile, (
            f"rank {r}: checkpointed 4-layer peak {p4} > one layer {p1} + 4 x inputs {inp} + one z tile {tile}"
        )


def test_checkpointing_scaling():
    """What holds today (2x2, N=8): the checkpointed 4-layer peak is at most 1.3 x one layer's and
    below 0.4 x the un-checkpointed 4-layer peak (which grows ~4x); the recompute runs layer by layer."""
    peaks = _peaks((2, 2), 2, 8)
    for r, ((p1, inp, _), (p4, _, _), (p4n, _, _)) in enumerate(
        zip(peaks["one"], peaks["four"], peaks["four_plain"])
    ):
        print(f"rank {r}: one layer {p1}, 4 layers checkpointed {p4}, 4 plain {p4n}, inputs {inp}")
        assert p4 <= 1.3 * p1, f"rank {r}: checkpointed 4-layer peak {p4} > 1.3 x one layer {p1}"
        assert p4 < 0.4 * p4n, f"rank {r}: checkpointing saved too little ({p4} vs {p4n})"
        assert p4n > 3 * p1, f"rank {r}: the un-checkpointed stack does not grow with layers: vacuous"


# -- control flow --------------------------------------------------------------------------------


# each case changes exactly one agreed scalar on the LAST rank of a 2x2 grid (N = 5, 2 layers):
# (rank 0's value, the last rank's value) as the error spells them
_SITES = 8  # dropout sites of 2 layers, in module order (4 a layer; the last: tri_att_end of layer 1)
STACK_SCALARS = {
    "num_blocks": (2, 3),
    "activation_checkpointing": (False, True),
    "training": (True, False),
    "seed": (SEED, SEED + 1),
    "grad_enabled": (True, False),
    "dropout_p": ((P_DROP,) * _SITES, (P_DROP,) * (_SITES - 1) + (0.3,)),
    "dropout_convention": (("boltz",) * _SITES, ("boltz", "af3") + ("boltz",) * (_SITES - 2)),
    "mask": (True, False),  # the last rank passes pair_mask only
    "pair_mask": (True, False),  # the last rank passes a token mask only (alone, a local error)
    "n_tokens": (5, 6),  # N = 6 pads to the same 6 x 6 tiles on 2x2: only the token count differs
    "shapes": (((1, 6, CS), (1, 6, 6, CZ)), ((2, 6, CS), (2, 6, 6, CZ))),  # B = 2
    "dtypes": (("torch.float64", "torch.float64"), ("torch.float64", "torch.float32")),
}


def _rank_disagree(grid, scalar):
    odd = grid.rank == grid.size - 1

    def pick(name, normal, other):
        return other if odd and scalar == name else normal

    layers, n, b = pick("num_blocks", 2, 3), pick("n_tokens", 5, 6), pick("shapes", 1, 2)
    twin = _twin(_serial(layers), layers)
    twin.activation_checkpointing = pick("activation_checkpointing", False, True)
    twin.train(pick("training", True, False))
    twin.layers[1].dropout_tri_att_end.p = pick("dropout_p", P_DROP, 0.3)
    twin.layers[0].dropout_tri_mul_in.convention = pick("dropout_convention", "boltz", "af3")
    layout = PairLayout.for_sizes(n, grid)
    s, z, mask, pair_mask = _inputs(b, n)
    z = pick("dtypes", z, z.float())
    args = [shard_tensor(x, k, grid, layout) for x, k in ((s, "single"), (z, "pair"))]
    args += [
        pick("mask", shard_tensor(mask, "single", grid, layout), None),
        pick("pair_mask", shard_tensor(pair_mask, "pair", grid, layout), None),
    ]
    try:
        with torch.set_grad_enabled(pick("grad_enabled", True, False)):
            twin(*args, seed=pick("seed", SEED, SEED + 1))
    except ValueError as e:
        return str(e)
    return "no error: the stack ran"


def _assert_disagreement(msgs, what, scalar, values, also=(), nranks=4):
    """The same error on every rank, naming this scalar (and only the ``also`` keys besides) with
    both values and the ranks holding each."""
    assert len(set(msgs)) == 1, f"{scalar}: the ranks raised different errors (or none): {msgs}"
    msg = msgs[0]
    head, tail = (
        f"{what}: control-flow scalars differ across ranks (",
        "); every rank must pass the same values",
    )
    assert msg.startswith(head) and msg.endswith(tail), msg
    named = re.findall(r"(?:^|; )'(\w+)'(?: at [][0-9]+)?: ", msg[len(head) : -len(tail)])
    assert named == sorted({scalar, *also}), f"{scalar}: the error names {named}: {msg}"
    normal, other = values
    assert (
        f"{scalar!r}: {normal!r} on ranks {list(range(nranks - 1))}, {other!r} on ranks [{nranks - 1}]" in msg
    ), msg


@pytest.mark.parametrize("scalar", sorted(STACK_SCALARS))
def test_control_scalars_must_agree(scalar):
    """One agreed scalar differs on the last rank: every rank raises the same error naming it, before
    any layer runs. Before these were agreed, a differing token mask's presence, dropout rate or
    convention, or token count gave a silent result; a missing pair mask or another dtype on one
    rank raised there alone and left the others waiting for the timeout; another batch size
    aborted the workers on a transport size mismatch."""
    msgs = run_on_grid(_rank_disagree, (2, 2), scalar, timeout=30)
    also = ("dropout_convention", "dropout_p") if scalar == "num_blocks" else ()  # one layer more: 4 sites
    _assert_disagreement(msgs, "CPPairformerStack", scalar, STACK_SCALARS[scalar], also)


def _rank_scalars(case):
    r = dist.get_rank()
    values = {
        "nan": {"p": float("nan"), "layers": 2},  # the same on every rank: agrees
        "ulp": {"p": 0.25 if r == 0 else math.nextafter(0.25, 1.0), "layers": 2},
    }[case]
    try:
        agree_scalars(values, "test")
    except ValueError as e:
        return str(e)
    return None


def test_control_scalars_compare_exactly():
    assert run_on_world(_rank_scalars, 2, "nan") == [None, None]
    for msg in run_on_world(_rank_scalars, 2, "ulp"):
        assert msg is not None and "control-flow scalars differ across ranks" in msg, msg


# -- negative controls ---------------------------------------------------------------------------


def _plant_skip_dropout(twin):
    """Planted: one site's dropout bypassed (the residual adds the undropped update)."""
    twin.dropout_tri_att_start.forward = lambda x, seed=None: x


def _plant_stream(twin):
    """Planted: one site draws from another stream than its serial twin (a per-rank seed would
    do the same); the masks no longer agree."""
    twin.dropout_tri_mul_in.stream = (twin.dropout_tri_mul_in.stream + 1) % 2**32


def _plant_recompute_stream(twin):
    """Planted: the checkpointed recompute of layer 0 draws other masks than its forward."""
    site = twin.layers[0].dropout_tri_mul_out
    calls = {"n": 0}
    orig = site.mask

    def mask(*a, **k):
        calls["n"] += 1
        if calls["n"] > 1:  # the recompute
            site.stream = (site.stream + 7) % 2**32
        return orig(*a, **k)

    site.mask = mask


CONTROLS = [
    (
        "skip_dropout",
        _plant_skip_dropout,
        None,
        r"parity of pairformer-layer N=6 B=1 output on grid 2x2 fails",
    ),
    ("stream", _plant_stream, None, r"parity of pairformer-layer N=6 B=1 output on grid 2x2 fails"),
    ("recompute_stream", _plant_recompute_stream, 2, r"parity of pairformer-layer N=6 B=1 d/d"),
]


@pytest.mark.parametrize("bug,plant,layers,match", CONTROLS, ids=[c[0] for c in CONTROLS])
def test_negative_controls(bug, plant, layers, match):
    grid = (2, 2)
    ranks = run_on_grid(
        _rank_pairformer, grid, 1, 6, layers=layers, checkpointing=layers is not None, plant=plant
    )
    with pytest.raises(AssertionError, match=match):
        _check(grid, 1, 6, ranks, layers=layers, what="pairformer-layer")
