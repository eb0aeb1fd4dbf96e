"""The CP twins against the ``boltz`` package's own modules (Boltz-2, boltz 2.2.1), on grids.

Each rank builds the Boltz module (parameters randomised from one seed, so identical on every
rank), turns it into its CP twin with ``twinshard.pair.interop.boltz.cp_twin_of`` (the Boltz
``state_dict`` loaded unchanged, strict), runs the twin on its tiles of padded inputs (uneven
N, random masks), gathers the output and backpropagates one random grad_output. The test
process runs the Boltz module itself on the full inputs in fp64 (Boltz's ``.float()`` casts kept
in fp64 only while a Boltz module runs: the ``boltz_fp64`` fixture of
``test_boltz_reference``) and ``check_twin`` compares forward, every input gradient and every
parameter gradient by name at the round-off gate, with its anti-vacuous checks (random
grad_output, non-zero parameters, same parameter names, replicated results, sharding active and
honest, gradients finite and non-zero).

What each test proves:
- ``test_parts_vs_boltz``: triangle multiplication (outgoing, incoming), triangle attention
  (starting, ending node), attention with pair bias (v2, keys from ``k_in``), outer product mean
  and transition equal Boltz's modules at 2x2 (N=7), 2x3 (N=9) and 3x3 (N=7), padding included.
- ``test_pairformer_vs_boltz``: the Pairformer layer and a 2-layer stack (``v2=True``) equal
  Boltz's ``PairformerLayer`` / ``PairformerModule`` on the same grids, with dropout off and
  with Boltz's dropout convention on (p = 0.25): Boltz's ``get_dropout_mask`` is patched, in the
  test process only, to hand out the serial reference's masks site by site (Boltz's row
  ``[B, N, 1, 1]`` and column ``[B, 1, N, 1]`` shapes checked), and the twin draws its own by
  global index, so equal outputs prove the twin's masks are Boltz-shaped and equal serial.
- ``test_unsupported_modules_raise``: Boltz-1's attention and other modules get a clear error.

Without ``boltz`` importable (the main environment) the file is skipped; CI runs it in
``.venv-boltz`` (tests/interop/README.md).
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("boltz", reason="the boltz package is not installed (see tests/interop/README.md)")

from boltz.model.layers import pairformer as boltz_pairformer  # noqa: E402
from boltz.model.layers.attentionv2 import AttentionPairBias as BoltzAttentionPairBias  # noqa: E402
from boltz.model.layers.outer_product_mean import OuterProductMean as BoltzOuterProductMean  # noqa: E402
from boltz.model.layers.transition import Transition as BoltzTransition  # noqa: E402
from boltz.model.layers.triangular_attention.attention import (  # noqa: E402
    TriangleAttentionEndingNode as BoltzTriAttEnd,
)
from boltz.model.layers.triangular_attention.attention import (  # noqa: E402
    TriangleAttentionStartingNode as BoltzTriAttStart,
)
from boltz.model.layers.triangular_mult import (  # noqa: E402
    TriangleMultiplicationIncoming as BoltzTriMulIn,
)
from boltz.model.layers.triangular_mult import (  # noqa: E402
    TriangleMultiplicationOutgoing as BoltzTriMulOut,
)
from test_boltz_reference import boltz_fp64, boltz_uses_our_masks  # noqa: E402,F401  (a fixture)

from twinshard.pair.features import PairLayout, collect_grad, collect_tensor, real_part, shard_tensor  # noqa: E402
from twinshard.pair.interop.boltz import cp_twin_of  # noqa: E402
from twinshard.pair.reference import Dropout, PairformerLayer, PairformerStack, assign_dropout_streams  # noqa: E402
from twinshard.testing import (  # noqa: E402
    TwinResult,
    check_twin,
    grid_id,
    parameter_signature,
    random_grad_output,
    random_mask,
    randomize_parameters,
    run_on_grid,
    serial_reference,
    synthetic,
)

F64 = torch.float64
CZ, CS, S = 4, 6, 5  # pair channels, single channels, MSA depth (uneven on 2 and 3 grid rows)
# the pair-bias LayerNorm's bias shifts a whole softmax row: its gradient is zero in exact
# arithmetic, round-off in both runs; checked against zero at the scale of the gradients
ANALYTIC_ZERO = "proj_z.0.bias"
# (grid, N, B): uneven N on each grid, every rank holding real data (no tile of padding only)
GRIDS = [((2, 2), 7, 2), ((2, 3), 9, 1), ((3, 3), 7, 1)]
PARTS = ("trimul-out", "trimul-in", "triatt-start", "triatt-end", "attn-pair-bias", "opm", "transition")
GRAD_SEED = 5
TIMEOUT = 900.0  # seconds per grid run: 9 ranks on a loaded 2-core machine take minutes


# -- cases: the Boltz module, its inputs (name -> (tensor, kind)), masks and the call ------------


def boltz_module(part: str) -> torch.nn.Module:
    """The Boltz module of a case, fp64, parameters randomised (the same on every rank)."""
    if part == "trimul-out":
        m = BoltzTriMulOut(CZ)
    elif part == "trimul-in":
        m = BoltzTriMulIn(CZ)
    elif part == "triatt-start":
        m = BoltzTriAttStart(CZ, 3, 2, inf=1e9)
    elif part == "triatt-end":
        m = BoltzTriAttEnd(CZ, 3, 2, inf=1e9)
    elif part == "attn-pair-bias":
        m = BoltzAttentionPairBias(CS, CZ, 2)
    elif part == "opm":
        m = BoltzOuterProductMean(CZ, 3, CZ)
    elif part == "transition":
        m = BoltzTransition(CZ, 3 * CZ)
    elif part.startswith(("layer", "stack")):
        dropout = 0.25 if part.endswith("dropout") else 0.0
        kw = dict(num_heads=2, dropout=dropout, pairwise_head_width=2, pairwise_num_heads=2, v2=True)
        if part.startswith("layer"):
            m = boltz_pairformer.PairformerLayer(CS, CZ, **kw)
        else:
            m = boltz_pairformer.PairformerModule(CS, CZ, 2, **kw)
    else:
        raise ValueError(part)
    m = m.double()
    randomize_parameters(m, seed=hash_seed(part))
    return m


def hash_seed(part: str) -> int:
    return 17 + sum(ord(ch) * (i + 1) for i, ch in enumerate(part)) % 1000


def pair_mask_with_diagonal(b: int, n: int, seed: int) -> torch.Tensor:
    """A random pair mask whose diagonal is kept (every row and column has a valid key)."""
    m = random_mask(b, n, n, seed=seed)
    m[:, torch.arange(n), torch.arange(n)] = 1.0
    return m


def case_inputs(part: str, b: int, n: int) -> tuple[dict[str, tuple[torch.Tensor, str]], dict[str, tuple]]:
    """``(inputs, masks)``: differentiable inputs and the masks, each with its feature kind."""
    z = (synthetic(b, n, n, CZ, seed=2), "pair")
    if part in ("trimul-out", "trimul-in"):
        return {"z": z}, {"mask": (random_mask(b, n, n, seed=3), "pair")}
    if part in ("triatt-start", "triatt-end"):
        return {"z": z}, {"mask": (pair_mask_with_diagonal(b, n, seed=6), "pair")}
    if part == "attn-pair-bias":
        s, kin = synthetic(b, n, CS, seed=11), synthetic(b, n, CS, seed=12)
        return {"s": (s, "single"), "z": z, "k_in": (kin, "single")}, {
            "mask": (random_mask(b, n, seed=14), "single")
        }
    if part == "opm":
        return {"m": (synthetic(b, S, n, CZ, seed=18), "msa")}, {
            "mask": (random_mask(b, S, n, seed=19), "msa")
        }
    if part == "transition":
        return {"z": z}, {}
    # the Pairformer layer and stack
    s = (synthetic(b, n, CS, seed=25), "single")
    masks = {
        "mask": (random_mask(b, n, seed=27), "single"),
        "pair_mask": (pair_mask_with_diagonal(b, n, 28), "pair"),
    }
    return {"s": s, "z": z}, masks


DROPOUT_SEED = 99


def call(part: str, module, x: dict, masks: dict):
    """The module's forward as the Boltz module and its twin both take it; a tuple of outputs."""
    if part in ("trimul-out", "trimul-in", "opm"):
        return (module(x[next(iter(x))], masks["mask"]),)
    if part in ("triatt-start", "triatt-end"):
        return (module(x["z"], mask=masks["mask"]),)
    if part == "attn-pair-bias":
        return (module(s=x["s"], z=x["z"], mask=masks["mask"], k_in=x["k_in"]),)
    if part == "transition":
        return (module(x["z"]),)
    raise ValueError(part)


def flat(outs) -> torch.Tensor:
    """Several outputs as one vector (one random grad_output covers them all)."""
    return torch.cat([o.reshape(-1) for o in outs])


# -- the ranks -----------------------------------------------------------------------------------


def _rank_parts(grid, parts, b, n):
    """Every rank: each part's twin from its Boltz module, on this rank's tiles; results per part."""
    layout = PairLayout.for_sizes(n, grid, n_seqs=S)
    results = {}
    for part in parts:
        theirs = boltz_module(part)
        twin = cp_twin_of(theirs)
        assert type(twin).__module__.startswith("twinshard.pair.layers"), type(twin)
        x, masks = case_inputs(part, b, n)
        leaves = {k: t.clone().requires_grad_(True) for k, (t, _) in x.items()}
        xd = {k: shard_tensor(leaves[k], kind, grid, layout) for k, (_, kind) in x.items()}
        md = {k: shard_tensor(t, kind, grid, layout) for k, (t, kind) in masks.items()}
        outs = run_twin(part, twin, xd, md)
        full = flat([collect_tensor(o) for o in outs])
        full.backward(random_grad_output(full, seed=GRAD_SEED))
        shards = {k: real_part(v) for k, v in xd.items() if not (x[k][1] == "single" and grid.rows == 1)}
        results[part] = TwinResult(
            out=full.detach(),
            grads_in={k: collect_grad(leaves[k].grad, kind, grid) for k, (_, kind) in x.items()},
            param_grads={k: p.grad for k, p in twin.named_parameters()},
            shards=shards,
            params=parameter_signature(twin),
        )
    return results


def run_twin(part: str, twin, xd: dict, md: dict):
    if part.startswith(("layer", "stack")):
        return twin(xd["s"], xd["z"], md["mask"], md["pair_mask"], seed=DROPOUT_SEED)
    return call(part, twin, xd, md)


# -- the check in the test process ---------------------------------------------------------------


def check_part(part, grid, b, n, results, run_boltz, what=None):
    theirs = boltz_module(part)
    x, masks = case_inputs(part, b, n)
    mask_t = {k: t for k, (t, _) in masks.items()}
    ref = serial_reference(
        theirs,
        lambda **leaves: flat(run_boltz(part, theirs, leaves, mask_t)),
        {k: t for k, (t, _) in x.items()},
        grad_seed=GRAD_SEED,
    )
    assert ref["serial_out"].dtype == F64
    what = what or f"{part} vs boltz N={n} B={b}"
    zero = tuple(k for k in ref["serial_param_grads"] if k.endswith(ANALYTIC_ZERO))
    return check_twin(what=what, grid=grid_id(grid), ranks=results, zero_grads=zero, **ref)


def _boltz_runner(boltz_fp64):  # noqa: F811
    def run(part, module, leaves, masks):
        with boltz_fp64():
            return call(part, module, leaves, masks)

    return run


@pytest.mark.parametrize("grid,n,b", GRIDS, ids=[f"{grid_id(g)}-N{n}" for g, n, _ in GRIDS])
def test_parts_vs_boltz(grid, n, b, boltz_fp64):  # noqa: F811
    ranks = run_on_grid(_rank_parts, grid, PARTS, b, n, timeout=TIMEOUT)
    run = _boltz_runner(boltz_fp64)
    for part in PARTS:
        check_part(part, grid, b, n, [r[part] for r in ranks], run)


# -- the Pairformer layer and stack --------------------------------------------------------------
TRUNKS = ("layer", "layer-dropout", "stack2", "stack2-dropout")


def serial_sites(part: str) -> list[Dropout]:
    """The serial reference's dropout sites of the same layer / stack, in Boltz's call order:
    the masks the serial model (and so, by global index, the twin) draws."""
    dropout = 0.25 if part.endswith("dropout") else 0.0
    kw = dict(num_heads=2, dropout=dropout, pairwise_head_width=2, pairwise_num_heads=2)
    if part.startswith("layer"):
        ref = PairformerLayer(CS, CZ, **kw)
        assign_dropout_streams(ref)
    else:
        ref = PairformerStack(CS, CZ, 2, **kw)
    return [m for m in ref.modules() if isinstance(m, Dropout)]


@pytest.mark.parametrize("grid,n,b", GRIDS, ids=[f"{grid_id(g)}-N{n}" for g, n, _ in GRIDS])
def test_pairformer_vs_boltz(grid, n, b, boltz_fp64, monkeypatch):  # noqa: F811
    ranks = run_on_grid(_rank_parts, grid, TRUNKS, b, n, timeout=TIMEOUT)
    for part in TRUNKS:
        sites = serial_sites(part)
        assert len(sites) == (4 if part.startswith("layer") else 8)

        def run(part, module, leaves, masks, sites=sites):
            module.train()
            with boltz_fp64(), boltz_uses_our_masks(monkeypatch, sites, DROPOUT_SEED):
                return module(leaves["s"], leaves["z"], masks["mask"], masks["pair_mask"])

        check_part(part, grid, b, n, [r[part] for r in ranks], run)
