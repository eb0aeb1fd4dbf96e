"""CP input embedder (atom encoder, window halo, atom attention encoder) against the serial reference.

What each test proves:
- ``test_cp_input_embedder_matches_serial``: ``s_inputs``, the gradient of ``ref_pos`` and every
  parameter gradient equal serial (fp64, round-off gate) on 1x1, 2x2, 2x1, 2x3, 3x2 grids, uneven N
  (10-12 tokens, 3-8 atoms per token, A not a multiple of the blocks), B = 2 with a padding token,
  Boltz's 32 x 128 windows and small 8 x 32 ones whose windows straddle several token blocks; every
  optional feature path on (and a plain configuration); ``atom_enc_proj_z.0.bias`` (a softmax
  shift) checked against zero.
- ``test_halo_moves_exactly_the_halo``: the ledger's bytes of the halo exchange, forward and
  backward, equal the halo's size per rank (the atoms the windows of my atoms read that are not
  mine, counted here from the window definition) x channels x 8, in 1 + depth exchanges; on the
  case below this is far less than all atoms.
"""

from __future__ import annotations

import pytest
from embed_inputs import atom_complex, embedder_config

from twinshard.comm import CommLedger
from twinshard.pair.atoms import atom_parts
from twinshard.pair.features import collect_grad, collect_tensor, distribute, real_part
from twinshard.pair.layers.input_embedder import CPInputEmbedder
from twinshard.pair.reference.input_embedder import InputEmbedder
from twinshard.testing import (
    TwinResult,
    check_twin,
    grid_id,
    parameter_signature,
    random_grad_output,
    randomize_parameters,
    run_on_grid,
    serial_reference,
)

ANALYTIC_ZERO = "atom_enc_proj_z.0.bias"
PLAIN = {
    "use_no_atom_char": True,
    "use_atom_backbone_feat": False,
    "use_residue_feats_atoms": False,
    "add_method_conditioning": False,
    "add_cyclic_flag": False,
}


def _serial(cfg: dict) -> InputEmbedder:
    m = InputEmbedder(**cfg).double()
    randomize_parameters(m, seed=11)  # the zero-initialised gates and conditionings included
    return m


def _case(w: int, h: int, plain: bool, n: int, seed: int):
    cfg = embedder_config(w, h, **(PLAIN if plain else {}))
    return cfg, atom_complex(2, n, (3, 8), seed=seed, w=w)


def _rank_embed(grid, w, h, plain, n, seed):
    cfg, feats = _case(w, h, plain, n, seed)
    twin = CPInputEmbedder(**cfg).double()
    twin.load_state_dict(_serial(cfg).state_dict())
    pos = feats["ref_pos"].clone().requires_grad_()
    d = distribute(feats | {"ref_pos": pos}, grid)
    with CommLedger() as fwd:
        out = twin(d)
    full = collect_tensor(out)
    with CommLedger() as bwd:
        full.backward(random_grad_output(full, seed=6))
    shards = {"ref_pos": atom_parts(d["ref_pos"])}
    if grid.rows > 1:
        shards["out"] = real_part(out)
    res = TwinResult(
        out=full.detach(),
        grads_in={"ref_pos": collect_grad(pos.grad, "atom", grid)},
        param_grads={k: p.grad for k, p in twin.named_parameters()},
        shards=shards,
        params=parameter_signature(twin),
    )
    lay = d.layout
    return res, fwd.summary(), bwd.summary(), (lay.atom_starts, lay.atom_counts, lay.n_atoms), grid.coords


def _check(grid, w, h, plain, n, seed, ranks):
    cfg, feats = _case(w, h, plain, n, seed)
    serial = _serial(cfg)
    ref = serial_reference(
        serial, lambda ref_pos: serial(feats | {"ref_pos": ref_pos}), {"ref_pos": feats["ref_pos"]}, 6
    )
    results = [r[0] for r in ranks]
    what = f"input-embedder {w}x{h}{' plain' if plain else ''} N={n}"
    # atom_enc_proj_z's LayerNorm bias shifts a whole softmax row: analytically zero gradient
    check_twin(what=what, grid=grid_id(grid), ranks=results, zero_grads=(ANALYTIC_ZERO,), **ref)


CASES = [
    ((1, 1), 8, 32, False, 11, 1),
    ((2, 2), 8, 32, False, 11, 2),
    ((2, 1), 8, 32, True, 10, 3),
    ((2, 3), 8, 32, False, 12, 4),
    ((3, 2), 8, 32, False, 11, 5),
    ((2, 2), 32, 128, False, 11, 6),
    ((3, 2), 32, 128, True, 12, 7),
]


@pytest.mark.parametrize(
    "grid,w,h,plain,n,seed",
    CASES,
    ids=[f"{grid_id(c[0])}-W{c[1]}-N{c[4]}{'-plain' if c[3] else ''}" for c in CASES],
)
def test_cp_input_embedder_matches_serial(grid, w, h, plain, n, seed):
    ranks = run_on_grid(_rank_embed, grid, w, h, plain, n, seed)
    _check(grid, w, h, plain, n, seed, ranks)


def _expected_halo(starts, counts, n_atoms, row, w, h) -> int:
    """Atoms the windows of row ``row``'s atoms read as keys that row ``row`` does not hold."""
    m, total = (h - w) // 2, 0
    for st, cn in zip(starts, counts):
        mine = set(range(st[row], st[row] + cn[row]))
        keys = set()
        for k in {g // w for g in mine}:
            keys |= set(range(max(0, w * k - m), min(n_atoms, w * k + w + m)))
        total += len(keys - mine)
    return total


@pytest.mark.parametrize("grid", [(3, 2), (2, 2)], ids=["3x2", "2x2"])
def test_halo_moves_exactly_the_halo(grid):
    w, h, n = 8, 32, 12
    ranks = run_on_grid(_rank_embed, grid, w, h, False, n, 4)
    cfg = embedder_config(w, h)
    depth, atom_s = cfg["atom_encoder_depth"], cfg["atom_s"]
    channels = (5 + atom_s) + depth * atom_s  # the static key features, then each layer's keys' input
    n_atoms = ranks[0][3][2]
    partial = False
    for rank, (_, fwd, bwd, (starts, counts, _), coords) in enumerate(ranks):
        halo = _expected_halo(starts, counts, n_atoms, coords[0], w, h)
        want = halo * channels * 8
        got_f, got_b = fwd["ops"].get("embed:halo", {}), bwd["ops"].get("embed:halo:backward", {})
        assert got_f.get("calls") == 1 + depth, (
            f"rank {rank}: {got_f.get('calls')} halo exchanges, want {1 + depth}"
        )
        assert got_f.get("bytes_recv") == want, (
            f"rank {rank}: the halo exchange received {got_f.get('bytes_recv')} bytes, the halo is {halo} atoms x "
            f"{channels} channels x 8 = {want} bytes"
        )
        assert got_b.get("bytes_sent") == want, (
            f"rank {rank}: the halo adjoint sent {got_b.get('bytes_sent')} bytes, want {want} (the halo's gradient)"
        )
        mine = sum(c[coords[0]] for c in counts)
        partial |= 0 < halo < sum(n_atoms for _ in counts) - mine
    assert partial, "no rank's halo is a strict part of the other rows' atoms: the case proves nothing"
