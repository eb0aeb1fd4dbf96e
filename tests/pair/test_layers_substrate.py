"""CP Linear / LayerNorm / Transition / Dropout equal their serial twins on any grid and N.

Each rank builds the serial module from a seed, loads its state_dict into the
twin, takes its padded tile of the input, runs the twin, applies a random mask
that also covers the padding (``pointwise`` with the distributed mask), gathers
the output and backpropagates a random grad_output through the gather. The
test process runs the serial module and checks parity of output, input
gradient and every parameter gradient with ``check_twin``.
"""

from __future__ import annotations

import pytest
import torch

from twinshard.memory import SavedBytes
from twinshard.pair.features import PairLayout, collect_tensor, real_part, shard_tensor, with_layout
from twinshard.pair.layers import CPDropout, CPLayerNorm, CPLinear, CPTransition, pointwise, tokenwise
from twinshard.pair.layers import dropout as cp_dropout
from twinshard.pair.reference import Dropout, LayerNorm, Linear, Transition
from twinshard.testing import (
    TwinResult,
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

C = 4  # channels
SEED = 5  # dropout seed (a training step)

CASES = ("linear", "layernorm", "transition", "dropout_row", "dropout_col", "dropout_off")


def _serial(case: str) -> torch.nn.Module:
    """The serial model of a case; dropout cases wrap a Linear so parameters get gradients."""
    torch.manual_seed(11)
    if case == "linear":
        m = Linear(C, 3)
    elif case == "layernorm":
        m = LayerNorm(C)
    elif case == "transition":
        m = Transition(C, expansion=2)
    else:
        m = _LinearDropout(Linear, Dropout, case)
    m = m.double()
    perturb_zero_parameters(m)
    with torch.no_grad():  # LayerNorm starts at (1, 0): move off it so every term matters
        for p in m.parameters():
            p.add_(0.1 * torch.randn_like(p))
    return m


class _LinearDropout(torch.nn.Module):
    """``Dropout(Linear(x))``: dropout after a parameterised layer, as in AF3 residual branches."""

    def __init__(self, lin_cls: type, drop_cls: type, case: str):
        super().__init__()
        self.lin = lin_cls(C, C)
        self.drop = drop_cls(0.3, columnwise=case == "dropout_col", stream=3)
        if case == "dropout_off":
            self.drop.eval()

    def forward(self, x, seed=SEED):
        return self.drop(self.lin(x), seed=seed)


def _twin(case: str, serial: torch.nn.Module) -> torch.nn.Module:
    cls = {
        "linear": lambda: CPLinear(C, 3),
        "layernorm": lambda: CPLayerNorm(C),
        "transition": lambda: CPTransition(C, expansion=2),
    }
    twin = cls[case]() if case in cls else _LinearDropout(CPLinear, CPDropout, case)
    twin = twin.double()
    twin.load_state_dict(serial.state_dict())  # the serial checkpoint loads unchanged
    return twin


def _shape(kind: str, n: int, s: int) -> tuple[int, ...]:
    return {"pair": (2, n, n, C), "single": (2, n, C), "msa": (1, s, n, C)}[kind]


def _mask(kind: str, n: int, s: int) -> torch.Tensor:
    """Random 0/1 mask over positions (channels broadcast), ~25% masked."""
    return random_mask(*_shape(kind, n, s)[:-1], seed=17, keep=0.75)


def _inputs(kind: str, n: int, s: int):
    x = synthetic(*_shape(kind, n, s), seed=3)
    return x, _mask(kind, n, s)


def _rank_case(grid, case: str, kind: str, n: int, s: int, skip_reduction: bool) -> TwinResult:
    serial = _serial(case)
    twin = _twin(case, serial)
    twin.train()
    if case == "dropout_off":
        twin.drop.eval()
    layout = PairLayout.for_sizes(n, grid, s if kind == "msa" else None)
    x, mask = _inputs(kind, n, s)
    xl = shard_tensor(x, kind, grid, layout).detach().requires_grad_(True)  # a leaf (no layout)
    xd = with_layout(xl, layout, kind)
    md = shard_tensor(mask, kind, grid, layout)
    saved = tokenwise.replicated_params
    if skip_reduction:  # negative control: parameter gradients stay partial
        tokenwise.replicated_params = lambda params, like: list(params)
    try:
        yd = pointwise(lambda y, m: y * m[..., None], twin(xd), md)
        y = collect_tensor(yd, layout, kind)
        g = random_grad_output(y)
        y.backward(g)
    finally:
        tokenwise.replicated_params = saved
    return TwinResult(
        out=y.detach(),
        grads_in={"x": collect_tensor(xl.grad, layout, kind)},
        param_grads={k: p.grad for k, p in twin.named_parameters()},
        shards={"x": real_part(xd), "out": real_part(yd)},
        params=parameter_signature(twin),
    )


def _rank(grid, cases, kind, n, s, skip_reduction=False):
    return [_rank_case(grid, c, kind, n, s, skip_reduction) for c in cases]


def _check(shape, cases, kind, n, s, results):
    for case, ranks in zip(cases, zip(*results)):
        serial = _serial(case)
        serial.train()
        if case == "dropout_off":
            serial.drop.eval()
        x, mask = _inputs(kind, n, s)
        check_twin(
            what=f"{case} ({kind}, N={n})",
            grid=grid_id(shape),
            ranks=list(ranks),
            **serial_reference(serial, lambda x, f=serial, m=mask: f(x) * m[..., None], {"x": x}),
        )


# (grid, kind, N, S): every required grid; N divisible by lcm(rows, cols) and not
# (13 on 2x2 and 2x3, 7 on 3x3); one-token shards on 3x3 with N=7 -> 9 and on 2x3 with
# N=13 -> 18; no grid row or column with padding only; single (replicated along grid rows)
# and MSA kinds.
CONFIGS = [
    ((1, 1), "pair", 5, 0),
    ((1, 2), "pair", 7, 0),
    ((2, 2), "pair", 8, 0),
    ((2, 2), "pair", 13, 0),
    ((2, 2), "single", 13, 0),
    ((3, 3), "pair", 7, 0),
    ((3, 3), "msa", 7, 5),
    ((2, 3), "pair", 13, 0),
    ((2, 3), "single", 6, 0),
    ((2, 3), "msa", 6, 3),
]


@pytest.mark.parametrize("shape,kind,n,s", CONFIGS, ids=[f"{grid_id(c[0])}-{c[1]}-N{c[2]}" for c in CONFIGS])
def test_substrate_parity(shape, kind, n, s):
    results = run_on_grid(_rank, shape, CASES, kind, n, s)
    _check(shape, CASES, kind, n, s, results)


def test_negative_control_skipped_gradient_reduction():
    """Without the parameter-gradient all-reduce each rank keeps a partial sum: caught."""
    cases = ("transition",)
    results = run_on_grid(_rank, (2, 2), cases, "pair", 7, 0, skip_reduction=True)
    with pytest.raises(AssertionError, match="parameter gradients|param grad"):
        _check((2, 2), cases, "pair", 7, 0, results)


def _rank_masks(grid, n, local_keys=False):
    """Dropout masks drawn per tile (with padding) assemble to the serial mask."""
    layout = PairLayout.for_sizes(n, grid)
    out = {}
    saved = cp_dropout.local_offsets
    if local_keys:  # planted bug: key the mask by the tile-local index
        cp_dropout.local_offsets = lambda shape, mesh, placements: (0,) * len(shape)
    try:
        for col in (False, True):
            d = CPDropout(0.4, columnwise=col, stream=9).train()
            ones = shard_tensor(torch.ones(1, n, n, 3, dtype=torch.float64), "pair", grid, layout)
            out[col] = collect_tensor(d(ones, seed=21), layout, "pair")
    finally:
        cp_dropout.local_offsets = saved
    return out


def _check_masks(results, n):
    for got in results:
        for col in (False, True):
            ref = Dropout(0.4, columnwise=col, stream=9).train()(
                torch.ones(1, n, n, 3, dtype=torch.float64), seed=21
            )
            torch.testing.assert_close(got[col], ref, rtol=0, atol=0)


@pytest.mark.parametrize("shape", [(2, 3), (3, 3)], ids=grid_id)
def test_dropout_mask_equals_serial_bitwise(shape):
    _check_masks(run_on_grid(_rank_masks, shape, 7), 7)


def test_negative_control_dropout_keyed_by_local_index():
    """Masks keyed by tile-local instead of global indices repeat per tile: caught."""
    with pytest.raises(AssertionError, match="not equal"):
        _check_masks(run_on_grid(_rank_masks, (2, 2), 7, local_keys=True), 7)


def test_negative_control_reduction_over_replicated_axis():
    """Summing a single-representation gradient over the grid columns too (where every rank
    computed the same contribution) over-counts it three times on 2x3: caught."""
    cases = ("linear",)
    results = run_on_grid(_rank_overcount, (2, 3), cases, "single", 6, 0)
    with pytest.raises(AssertionError, match="param grad"):
        _check((2, 3), cases, "single", 6, 0, results)


def _rank_overcount(grid, cases, kind, n, s):
    saved = tokenwise.grad_group
    tokenwise.grad_group = lambda mesh, placements: None  # planted: reduce over the whole world
    try:
        return _rank(grid, cases, kind, n, s)
    finally:
        tokenwise.grad_group = saved


def _saved_bytes(fn) -> int:
    """Bytes of the distinct storages autograd saves for backward while ``fn`` runs."""
    with SavedBytes() as saved:
        fn()
    return saved.bytes


def _rank_saved(grid, n):
    serial = _serial("transition")
    twin = _twin("transition", serial)
    layout = PairLayout.for_sizes(n, grid)
    x = synthetic(1, n, n, C, seed=3)
    xd = shard_tensor(x, "pair", grid, layout).detach().requires_grad_(True)
    return _saved_bytes(lambda: twin(xd))


def test_transition_saved_bytes_per_rank():
    """What a CP transition saves for backward per rank is the serial amount / P (+ the
    replicated weights, which both save): <= 1.25 x serial / P on 2x2 and 3x3."""
    n = 18
    serial = _serial("transition")
    x = synthetic(1, n, n, C, seed=3).requires_grad_(True)
    serial_bytes = _saved_bytes(lambda: serial(x))
    for shape in ((2, 2), (3, 3)):
        p = shape[0] * shape[1]
        per_rank = run_on_grid(_rank_saved, shape, n)
        ratio = max(per_rank) / (serial_bytes / p)
        print(
            f"transition saved bytes {grid_id(shape)}: {per_rank} vs serial/P {serial_bytes / p:.0f} "
            f"(ratio {ratio:.3f})"
        )
        assert ratio <= 1.25, (shape, per_rank, serial_bytes)
