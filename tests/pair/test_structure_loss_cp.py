"""The CP diffusion loss against the serial one (fp64, round-off gate): ``CPAtomDiffusion.compute_loss``
equals ``AtomDiffusion.compute_loss`` (which ``tests/interop/test_boltz_structure_loss.py`` proves
equal to Boltz-2's).

Inputs (``structure_loss_inputs.py``): B = 2 elements of N = 10 or 11 tokens with 1-4 atoms each
(protein, DNA, RNA and ligand tokens; a padding token in element 1; Boltz's padding atoms at the end,
noisy in the denoised coordinates; unresolved atoms), so A, every grid row's atom count and the
column pieces are uneven.

What each test proves:
- ``test_cp_loss_matches_serial``: the loss, its two parts and the gradient w.r.t. the denoised
  coordinates equal serial on 1x1, 2x2, 2x3 and 3x3 grids, multiplicity 1 and 3, with the pLDDT
  filter and other loss weights, with the lDDT off, and with true coordinates on an integer lattice
  with pairs exactly at 15 A and 30 A (the strict ``<`` of serial). The loss has the same bits on
  every rank; each rank's tile gradient is complete, identical along its grid row and equal to
  serial on its atoms (the ``collect_grad`` of the test sums the grid rows only); sharding is
  active (a strict part of the atoms per rank); no tensor autograd saves is ``A x A``: the largest
  2-D one is the rank's pair tile ``A_blk x L``, below ``A x A`` and within 2 ``A^2 / P``.
- ``test_atom_columns_cover_pairs``: the column pieces of a grid column tile ``[0, A)`` and each
  rank's piece holds exactly the serial atoms ``[c L, c L + L)`` (the values moved are right).
- ``test_smooth_lddt_cutoff_is_strict``: a hand-computed case (no code shared with the loss): a
  protein atom pair exactly 15 A apart and a nucleotide pair exactly 30 A apart are not scored,
  pairs just below are; the cutoff is the row atom's.
- ``test_bad_input_raises_together``: denoised coordinates of another multiplicity, true
  coordinates placed on another layout, and sigmas that differ across ranks raise the same
  error on every rank, naming the input.
- ``test_collected_coords_roundtrip``: the tests' placement of ``[B m, A, 3]`` coordinates on the
  sample layout collects back to the serial tensor.
"""

from __future__ import annotations

import math

import pytest
import torch
from diffusion_inputs import conditioning_config, module_config
from structure_loss_inputs import exact_cutoff_pairs, loss_case

from twinshard.pair.atoms import atom_parts, atom_tile
from twinshard.pair.features import ShardedFeatures, collect_grad, collect_tensor, distribute
from twinshard.pair.layers.diffusion import sample_layout
from twinshard.pair.layers.sampler import CPAtomDiffusion
from twinshard.pair.layers.structure_loss import atom_columns, column_atoms
from twinshard.pair.layout import with_layout
from twinshard.pair.reference.sampler import AtomDiffusion
from twinshard.pair.reference.structure_loss import smooth_lddt_loss
from twinshard.pair.tiling import SINGLE, from_local
from twinshard.testing import assert_parity, assert_replicated, grid_id, run_on_grid

F64 = torch.float64


def _module(cp: bool):
    cfg = module_config(conditioning_config(8, 32))
    return (CPAtomDiffusion if cp else AtomDiffusion)(cfg).double()


def _atoms(full: torch.Tensor, lay, grid):
    return with_layout(
        from_local(atom_tile(full, "atom", lay, grid.coords[0]), grid.mesh, SINGLE), lay, "atom"
    )


def _case(c):
    return loss_case(2, c["n"], c["m"], seed=c["seed"], lattice=c.get("lattice", False))


def _serial(c):
    case = _case(c)
    den = case["out"]["denoised_atom_coords"].clone().requires_grad_()
    got = _module(False).compute_loss(
        dict(case["feats"], coords=case["coords"]),
        dict(case["out"], denoised_atom_coords=den),
        multiplicity=c["m"],
        **c["kw"],
    )
    got["loss"].backward()
    parts = got["loss_breakdown"]
    return got["loss"].detach(), parts["mse_loss"].detach(), parts["smooth_lddt_loss"].detach(), den.grad


def _rank(grid, c):
    case = _case(c)
    m = c["m"]
    d = distribute(case["feats"], grid)
    lay_m = sample_layout(d.layout, m)
    leaf = case["out"]["denoised_atom_coords"].clone().requires_grad_()
    den = _atoms(leaf, lay_m, grid)
    feats = ShardedFeatures(dict(d, coords=_atoms(case["coords"], lay_m, grid)), d.layout)
    out = {
        "denoised_atom_coords": den,
        "sigmas": case["out"]["sigmas"],
        "aligned_true_atom_coords": _atoms(case["out"]["aligned_true_atom_coords"], lay_m, grid),
    }
    saved: list[tuple[int, ...]] = []

    def pack(t):
        saved.append(tuple(t.shape))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        got = _module(True).compute_loss(feats, out, multiplicity=m, **c["kw"])
    got["loss"].backward()
    parts = got["loss_breakdown"]
    values = (got["loss"].detach(), parts["mse_loss"].detach(), parts["smooth_lddt_loss"].detach())
    plan = atom_columns(lay_m, grid)
    pair_tiles = [s for s in saved if len(s) == 2]
    return {
        "values": values,
        "grad": collect_grad(leaf.grad, "atom", grid),
        "tile_grad": atom_tile(leaf.grad, "atom", lay_m, grid.coords[0]),
        "coords": grid.coords,
        "parts": atom_parts(_atoms(leaf.grad, lay_m, grid)) if grid.rows > 1 else [],
        "pair_tile": max(pair_tiles, key=math.prod) if pair_tiles else None,
        "a_blk_l": (lay_m.atom_block, plan.length),
    }


CASES = [
    ((1, 1), dict(n=10, m=1, seed=1, kw={})),
    ((2, 2), dict(n=10, m=3, seed=2, kw={})),
    ((2, 2), dict(n=11, m=1, seed=3, kw={}, lattice=True)),
    (
        (2, 3),
        dict(
            n=11,
            m=3,
            seed=4,
            kw=dict(filter_by_plddt=0.3, nucleotide_loss_weight=2.0, ligand_loss_weight=7.0),
        ),
    ),
    ((2, 3), dict(n=10, m=1, seed=5, kw=dict(add_smooth_lddt_loss=False))),
    ((3, 3), dict(n=11, m=3, seed=6, kw={}, lattice=True)),
]
NAMES = ("loss", "mse_loss", "smooth_lddt_loss")


@pytest.mark.parametrize(
    "grid,c",
    CASES,
    ids=[
        f"{grid_id(g)}-N{c['n']}-m{c['m']}-s{c['seed']}{'-lattice' if c.get('lattice') else ''}"
        for g, c in CASES
    ],
)
def test_cp_loss_matches_serial(grid, c):
    want = _serial(c)
    case = _case(c)
    a = case["coords"].shape[1]
    if c.get("lattice"):
        assert exact_cutoff_pairs(case, 15.0) > 0 and exact_cutoff_pairs(case, 30.0) > 0, (
            "no pair at a cutoff"
        )
    lddt_on = c["kw"].get("add_smooth_lddt_loss", True)
    ranks = run_on_grid(_rank, grid, c)
    g = grid_id(grid)
    what = f"diffusion loss N={c['n']} A={a} m={c['m']} {c['kw']}"
    for r, got in enumerate(ranks):
        for name, x, w in zip(NAMES, got["values"], want):
            assert_parity(x, w.to(F64), what=f"{what}: {name} rank {r}", grid=g)
        assert_parity(got["grad"], want[3], what=f"{what}: d loss / d denoised rank {r}", grid=g)
        for local, index in got["parts"]:  # sharding active: a strict part of the atoms, complete there
            assert local.shape[1] < a, f"rank {r} holds every atom: sharding is not active"
            assert_parity(
                local.reshape(-1), want[3][index].reshape(-1), what=f"{what}: tile grad rank {r}", grid=g
            )
        if lddt_on:
            ab, ln = got["a_blk_l"]
            assert got["pair_tile"] == (ab, ln), f"rank {r}: largest saved 2-D tensor {got['pair_tile']}"
            if math.prod(grid) > 1:
                assert ab * ln < a * a, f"rank {r}: pair tile {ab} x {ln} is not below A x A = {a} x {a}"
                assert ab * ln <= 2.0 * a * a / math.prod(grid), f"rank {r}: pair tile {ab} x {ln} vs A^2/P"
    assert float(want[3].abs().max()) > 0, "vacuous gradient"
    assert_replicated([torch.stack(got["values"]) for got in ranks], "diffusion loss (every rank)")
    for row in range(grid[0]):
        assert_replicated(
            [got["tile_grad"] for got in ranks if got["coords"][0] == row], f"tile grad, grid row {row}"
        )


def _columns_rank(grid):
    case = loss_case(2, 11, 2, seed=8)
    d = distribute(case["feats"], grid)
    lay_m = sample_layout(d.layout, 2)
    full = (
        torch.arange(case["coords"].numel() // 3, dtype=F64).reshape(case["coords"].shape[:2])[..., None] + 1
    )
    plan = atom_columns(lay_m, grid)
    piece = column_atoms(atom_tile(full, "atom", lay_m, grid.coords[0]), plan)
    return plan.piece, plan.length, piece


@pytest.mark.parametrize("grid", [(2, 2), (2, 3)], ids=grid_id)
def test_atom_columns_cover_pairs(grid):
    case = loss_case(2, 11, 2, seed=8)
    a = case["coords"].shape[1]
    full = (
        torch.arange(case["coords"].numel() // 3, dtype=F64).reshape(case["coords"].shape[:2])[..., None] + 1
    )
    got = run_on_grid(_columns_rank, grid)
    pieces = sorted({(p, ln) for p, ln, _ in got})
    assert [p for p, _ in pieces] == list(range(grid[1])), pieces
    for p, ln, piece in got:
        lo, hi = p * ln, min(p * ln + ln, a)
        want = torch.zeros(full.shape[0], ln, 1, dtype=F64)
        want[:, : hi - lo] = full[:, lo:hi]
        assert torch.equal(piece, want), f"column piece {p} holds other atoms than [{lo}, {hi})"


def test_smooth_lddt_cutoff_is_strict():
    # atoms 0, 1: protein (cutoff 15) at exactly 15 A; atoms 2, 3: nucleotide at exactly 30 A;
    # atoms 4, 5: protein at 14 A. Predicted: 4-5 1 A off, the pairs at the cutoffs 10 A off (were
    # they scored, the mean would drop far below the hand value).
    true = torch.tensor(
        [[0, 0, 0], [15, 0, 0], [100, 0, 0], [100, 30, 0], [200, 0, 0], [200, 14, 0]], dtype=F64
    )[None]
    pred = true.clone()
    pred[0, 1, 0] = 25.0
    pred[0, 3, 1] = 40.0
    pred[0, 5, 1] = 15.0
    nuc = torch.tensor([[0, 0, 1, 0, 0, 0]], dtype=F64)  # atom 2 is a nucleotide, atom 3 not
    mask = torch.ones(1, 6, dtype=F64)
    got = smooth_lddt_loss(pred, true, nuc, mask)

    def eps(diff):
        return sum(1 / (1 + math.exp(-(t - diff))) for t in (0.5, 1.0, 2.0, 4.0)) / 4

    # scored (row, col): (2, 3) (nucleotide row 2 at 30 A: 30 < 30 is false -> not scored);
    # (4, 5), (5, 4) at 14 A; (2, 3)'s mirror (3, 2) has a protein row: 30 >= 15, not scored.
    # Pairs among the far groups are >= 85 A. So exactly 2 pairs, |D - d| ~ 1 (pred |. + 1e-6|).
    d45 = math.sqrt(1e-12 + (-15 + 1e-6) ** 2 + 1e-12)
    d54 = math.sqrt(1e-12 + (15 + 1e-6) ** 2 + 1e-12)
    want = 1 - (eps(abs(14 - d45)) + eps(abs(14 - d54))) / (2 + 1e-5)
    assert abs(float(got) - want) < 1e-12, (
        f"smooth lDDT {float(got)!r}, hand value {want!r} (2 pairs at 14 A; pairs exactly at 15 A and "
        "30 A must not be scored: strict <)"
    )


def _bad_rank(grid, which):
    c = dict(n=10, m=3, seed=2, kw={})
    case = _case(c)
    d = distribute(case["feats"], grid)
    lay_m = sample_layout(d.layout, 3)
    den = _atoms(case["out"]["denoised_atom_coords"], lay_m, grid)
    coords = _atoms(case["coords"], lay_m, grid)
    sig = case["out"]["sigmas"]
    m = 3
    if which == "multiplicity":
        m = 1
    elif which == "layout":
        other = distribute(loss_case(2, 11, 3, seed=7)["feats"], grid)
        coords = _atoms(loss_case(2, 11, 3, seed=7)["coords"], sample_layout(other.layout, 3), grid)
    elif which == "sigmas":
        sig = sig + grid.rank
    feats = ShardedFeatures(dict(d, coords=coords), d.layout)
    out = {"denoised_atom_coords": den, "sigmas": sig, "aligned_true_atom_coords": den}
    try:
        _module(True).compute_loss(feats, out, multiplicity=m)
    except Exception as exc:
        return type(exc).__name__, str(exc)
    return None


@pytest.mark.parametrize("which", ["multiplicity", "layout", "sigmas"])
def test_bad_input_raises_together(which):
    got = run_on_grid(_bad_rank, (2, 2), which)
    assert got[0] is not None, f"{which}: the loss ran on"
    assert all(g == got[0] for g in got), f"{which}: ranks raised different errors: {got}"
    want = {"multiplicity": "denoised_atom_coords", "layout": "feats['coords']", "sigmas": "'sigmas'"}
    assert want[which] in got[0][1], got[0]


def test_collected_coords_roundtrip():
    """The test's own placement helper puts the serial coordinates where ``collect_tensor`` finds them."""
    got = run_on_grid(_roundtrip_rank, (2, 3))
    case = loss_case(2, 11, 3, seed=4)
    for x in got:
        assert torch.equal(x, case["coords"])


def _roundtrip_rank(grid):
    case = loss_case(2, 11, 3, seed=4)
    d = distribute(case["feats"], grid)
    return collect_tensor(_atoms(case["coords"], sample_layout(d.layout, 3), grid))
