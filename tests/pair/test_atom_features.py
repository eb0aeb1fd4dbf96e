"""Atom features on the pair grid (kinds atom, atom_token, token_atom; twinshard.pair.atoms).

- round trip: ``collect(distribute(f))`` gives Boltz's serial tensors back exactly (dtype, A, N)
  with ``src=None`` and ``src=k`` on 1x1, 2x3, 3x2; tiles are ``[B, A_blk, ...]``,
  ``[B, A_blk, Nr/R]``, ``[B, Nr/R, A_blk]`` (no rank holds A x N), the rows partition [0, A) in
  token order and every real atom's tile row maps to its own token, remapped to the block;
- gradients: ``collect_tensor`` of an atom feature is differentiable and ``collect_grad`` of the
  caller's ``x.grad`` (``src=None``) is the serial gradient;
- bad input raises on every rank, naming the feature: a mapping beyond N, a real atom mapped to
  no token or to two, atoms out of token order, A inconsistent, a representative atom not of its
  token (the feature contract, run by distribute), a token-to-atom map outside the contract
  (``token_to_center_atom``) linking another token block (the placement's check).
"""

from __future__ import annotations

import pytest
import torch
from embed_inputs import atom_complex

from twinshard.pair.atoms import atom_parts
from twinshard.pair.features import collect, collect_grad, collect_tensor, distribute
from twinshard.runtime import RankFailure
from twinshard.testing import assert_parity, grid_id, random_grad_output, run_on_grid
from twinshard.testing.checks import assert_shards_cover


def _rank_roundtrip(grid, src):
    f = atom_complex(2, 10, (3, 8), seed=1, w=8)
    d = distribute(f if src is None or grid.rank == src else None, grid, src=src)
    back = collect(d)
    lay = d.layout
    r = grid.coords[0]
    a2t = d["atom_to_token"].to_local()
    nI = lay.padded[0] // grid.rows
    # every real atom of my tile maps to exactly one token of my block (local index)
    tile_ok = all(
        bool(
            (
                a2t[b, : lay.atom_counts[b][r]].sum(-1)
                == f["atom_pad_mask"][b, lay.atom_starts[b][r] :][: lay.atom_counts[b][r]]
            ).all()
        )
        for b in range(2)
    )
    return {
        "equal": {k: bool(torch.equal(back[k], f[k])) and back[k].dtype == f[k].dtype for k in f},
        "shapes": {
            k: tuple(d[k].to_local().shape) for k in ("ref_pos", "atom_to_token", "token_to_rep_atom")
        },
        "meta": (lay.n_atoms, lay.atom_block, lay.atom_starts, lay.atom_counts, nI),
        "tile_ok": tile_ok,
        "pieces": atom_parts(d["ref_pos"]),
        "a2t_pieces": [(p.double(), i) for p, i in atom_parts(d["atom_to_token"])],
    }


@pytest.mark.parametrize("src", [None, 0], ids=["all", "src0"])
@pytest.mark.parametrize("shape", [(1, 1), (2, 3), (3, 2)], ids=grid_id)
def test_atom_features_round_trip(shape, src):
    f = atom_complex(2, 10, (3, 8), seed=1, w=8)
    res = run_on_grid(_rank_roundtrip, shape, src)
    for rank, r in enumerate(res):
        assert all(r["equal"].values()), f"rank {rank}: collect(distribute(f)) differs at {r['equal']}"
        assert r["tile_ok"], f"rank {rank}: a real atom of the tile does not map to one token of its block"
        n_atoms, a_blk, starts, counts, nI = r["meta"]
        assert n_atoms == f["ref_pos"].shape[1]
        assert r["shapes"] == {
            "ref_pos": (2, a_blk, 3),
            "atom_to_token": (2, a_blk, nI),
            "token_to_rep_atom": (2, nI, a_blk),
        }
        for st, cn in zip(starts, counts):
            assert (
                st[0] == 0
                and st[-1] + cn[-1] == n_atoms
                and all(st[i] + cn[i] == st[i + 1] for i in range(len(st) - 1))
            )
    if shape != (1, 1):
        assert_shards_cover([r["pieces"] for r in res], f["ref_pos"], "ref_pos", allow_empty=True)
        # atom_to_token's tiles are its diagonal blocks (the rest is zero and held by no rank)
        for rank, r in enumerate(res):
            for piece, index in r["a2t_pieces"]:
                assert torch.equal(piece, f["atom_to_token"][index].double()), f"rank {rank}: tile at {index}"
            assert all(p.numel() < f["atom_to_token"][0].numel() for p, _ in r["a2t_pieces"])


def _rank_grad(grid):
    f = atom_complex(2, 11, (3, 8), seed=2, w=8)
    pos = f["ref_pos"].clone().requires_grad_()
    d = distribute(f | {"ref_pos": pos}, grid)
    full = collect_tensor(d["ref_pos"])
    (full**2).backward(random_grad_output(full, seed=3))
    return collect_grad(pos.grad, "atom", grid)


@pytest.mark.parametrize("shape", [(2, 2), (3, 2)], ids=grid_id)
def test_atom_collect_is_differentiable(shape):
    f = atom_complex(2, 11, (3, 8), seed=2, w=8)
    want = 2 * f["ref_pos"] * random_grad_output(f["ref_pos"], seed=3)
    for rank, g in enumerate(run_on_grid(_rank_grad, shape)):
        assert_parity(g, want, what=f"collect_grad of ref_pos (rank {rank})", grid=grid_id(shape))


def _rank_bad(grid, case, src):
    f = atom_complex(2, 10, (3, 6), seed=4, w=8)
    a2t = f["atom_to_token"]
    if case == "beyond_n":
        extra = torch.zeros(2, a2t.shape[1], 1, dtype=a2t.dtype)
        extra[0, 3, 0], a2t[0, 3] = 1, 0
        f["atom_to_token"] = torch.cat([a2t, extra], dim=2)
    elif case == "no_token":
        a2t[1, 5] = 0
    elif case == "two_tokens":
        a2t[0, 2, 7] = 1
    elif case == "order":
        a2t[0, [0, 8]] = a2t[0, [8, 0]]
    elif case == "atom_count":
        f["ref_pos"] = torch.zeros(2, a2t.shape[1] + 8, 3, dtype=torch.float64)
    elif case == "center_atom":  # not in the contract: the placement's own check
        f["token_to_center_atom"] = f["token_to_rep_atom"].clone()
        f["token_to_center_atom"][0, 0] = 0
        f["token_to_center_atom"][0, 0, int(f["atom_pad_mask"][0].sum()) - 1] = 1
    elif case == "rep_atom":
        f["token_to_rep_atom"][0, 0] = 0
        f["token_to_rep_atom"][0, 0, int(f["atom_pad_mask"][0].sum()) - 1] = 1
    distribute(f if src is None or grid.rank == src else None, grid, src=src)


# (case, src, message, step): the values of Boltz's atom maps are the feature contract's checks
# (run by distribute where the data is); what the placement adds is pair.atoms.plan_atoms'.
_CONTRACT, _ATOMS = "pair.features.distribute", "pair.features.distribute (atoms)"
BAD = [
    (
        "beyond_n",
        None,
        r"feature 'atom_to_token': dim 2 \(N\) is 11 but 'token_pad_mask' has N=10.*atom 3 of batch "
        r"element 0 is mapped to token 10 >= N = 10",
        _CONTRACT,
    ),
    (
        "no_token",
        0,
        r"feature 'atom_to_token': real atom 5 of batch element 1 maps to no token \(atom_pad_mask is 1\)",
        _CONTRACT,
    ),
    (
        "two_tokens",
        None,
        "feature 'atom_to_token': real atom 2 of batch element 0 maps to 2 tokens",
        _CONTRACT,
    ),
    ("order", None, "feature 'atom_to_token': real atoms must be contiguous per token", _CONTRACT),
    ("atom_count", 0, r"feature 'ref_pos': dim 1 \(A\) is .* inconsistent A", _CONTRACT),
    (
        "rep_atom",
        None,
        "feature 'token_to_rep_atom': token 0 of batch element 0 has representative atom",
        _CONTRACT,
    ),
    ("center_atom", None, r"token_to_center_atom links token 0 of sample 0 \(grid row 0\) with atom", _ATOMS),
]


@pytest.mark.parametrize("case,src,match,step", BAD, ids=[c[0] for c in BAD])
def test_bad_atom_input_fails_on_every_rank(case, src, match, step):
    with pytest.raises(RankFailure, match=match) as info:
        run_on_grid(_rank_bad, (2, 2), case, src)
    assert info.value.step == step
    assert not info.value.stuck
