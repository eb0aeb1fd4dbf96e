"""Partitioners and ghost selection as pure geometry (no communication).

The ghost-coverage tests emulate every rank of a plan in one process (boxes,
neighbour sets, ghost selection) and check the padded blocks against a serial
periodic neighbour list: every neighbour image within the ghost width of an
owned atom is present exactly once, nothing is duplicated.
"""

import math

import numpy as np
import pytest
import torch
from vesin import NeighborList

from twinshard.atoms.parallel.halo import frame_coordinates, neighbour_ranks, rank_box, select_ghosts
from twinshard.atoms.parallel.partition import (
    BlockPartition,
    PartitionError,
    SpatialPartition,
    cell_heights,
    rank_grid_shapes,
)

TRICLINIC = torch.tensor([[11.0, 0.0, 0.0], [3.0, 10.0, 0.0], [-2.0, 1.5, 12.0]], dtype=torch.float64)
CUBE = torch.eye(3, dtype=torch.float64) * 12.0


def test_rank_grid_shapes_cover_all_factorisations():
    shapes = rank_grid_shapes(12)
    assert len(shapes) == len(set(shapes)) == 18
    assert all(a * b * c == 12 for a, b, c in shapes)
    assert rank_grid_shapes(1) == [(1, 1, 1)]


def test_cell_heights_triclinic():
    h = cell_heights(TRICLINIC)
    vol = abs(float(torch.linalg.det(TRICLINIC)))
    for a in range(3):
        b, c = TRICLINIC[(a + 1) % 3], TRICLINIC[(a + 2) % 3]
        assert math.isclose(float(h[a]), vol / float(torch.linalg.cross(b, c).norm()), rel_tol=1e-14)


def test_grid_minimises_halo_volume():
    # A long box along x: 4 ranks should all go along x.
    cell = torch.diag(torch.tensor([40.0, 10.0, 10.0], dtype=torch.float64))
    part = SpatialPartition.build(cell, (True, True, True), 4, ghost_width=3.0)
    assert part.grid == (4, 1, 1)
    # 24 A periodic cube, w = 3, 8 ranks: an unsplit periodic axis imports nothing (its images are
    # edge shifts), so 24x12x6 subdomains (halo 24*18*12 - 1728 = 3456 A^3) or 24x24x3 slabs
    # (576*9 - 1728 = 3456) beat 12^3 cubes (18^3 - 1728 = 4104)
    cube = SpatialPartition.build(CUBE * 2, (True, True, True), 8, ghost_width=3.0)
    assert sorted(cube.grid) in ([1, 2, 4], [1, 1, 8]), cube.grid
    # Open slab: a split open axis has end slabs with one inner face, a split periodic one two.
    slab = torch.diag(torch.tensor([20.0, 20.0, 20.0], dtype=torch.float64))
    # Cutting the open axis of a 20 A slab in two imports one 3 A layer per rank (20*20*3), cutting
    # a periodic one two (20*20*6): the open axis is cut
    part = SpatialPartition.build(slab, (True, True, False), 2, ghost_width=3.0)
    assert part.grid == (1, 1, 2), part.grid


def test_thin_subdomain_error_names_axis_and_fit():
    cell = torch.diag(torch.tensor([10.0, 10.0, 10.0], dtype=torch.float64))
    with pytest.raises(PartitionError, match=r"axis 0.*slabs 2\.5 thick.*ghost width 4.*at most 2"):
        SpatialPartition.build(cell, (True,) * 3, 4, ghost_width=4.0, grid=(4, 1, 1))
    with pytest.raises(
        PartitionError, match=r"too small for 16 ranks.*at most \[2, 2, 2\] ranks fit.*at most 8 ranks"
    ):
        SpatialPartition.build(cell, (True,) * 3, 16, ghost_width=4.0)
    # Fits when the factorisation avoids the thin axis.
    assert SpatialPartition.build(cell, (True,) * 3, 8, ghost_width=4.0).grid == (2, 2, 2)


def test_bad_grid_arguments():
    with pytest.raises(PartitionError, match="does not multiply"):
        SpatialPartition.build(CUBE, (True,) * 3, 4, ghost_width=1.0, grid=(3, 1, 1))
    with pytest.raises(PartitionError, match="ghost width must be positive"):
        SpatialPartition.build(CUBE, (True,) * 3, 4, ghost_width=float("nan"))
    with pytest.raises(PartitionError, match="zero lattice vector"):
        SpatialPartition.build(torch.zeros(3, 3), (True,) * 3, 1, ghost_width=1.0)


def test_owner_wraps_and_open_axes_extend():
    part = SpatialPartition.build(CUBE, (True, True, False), 8, ghost_width=2.0, grid=(2, 2, 2))
    frac = torch.tensor(
        [
            [0.1, 0.1, 0.1],
            [1.1, -0.9, 0.1],  # same as the first, periodic images
            [0.6, 0.1, 0.1],
            [0.1, 0.1, -3.0],  # far below the open axis: first slab
            [0.1, 0.1, 7.0],  # far above: last slab
            [0.999999999999, 0.5, 0.5],
        ],
        dtype=torch.float64,
    )
    own = part.owner_of(frac).tolist()
    assert own[0] == own[1] == 0
    assert own[2] == part.rank_of((1, 0, 0))
    assert own[3] == part.rank_of((0, 0, 0)) and own[4] == part.rank_of((0, 0, 1))
    assert own[5] == part.rank_of((1, 1, 1))


def test_owner_hysteresis_keeps_atoms_near_a_face():
    part = SpatialPartition.build(CUBE, (True,) * 3, 2, ghost_width=2.0, grid=(2, 1, 1))
    # Just past the face x = 0.5 (6 A): 0.1 A over, and 1 A over; also across the periodic face.
    frac = torch.tensor(
        [[0.5 + 0.1 / 12, 0.5, 0.5], [0.5 + 1 / 12, 0.5, 0.5], [-0.1 / 12, 0.5, 0.5]],
        dtype=torch.float64,
    )
    cur = torch.tensor([0, 0, 0])
    assert part.owner_of(frac).tolist() == [1, 1, 1]
    assert part.owner_of(frac, current=cur, hysteresis=0.5).tolist() == [0, 1, 0]


def test_block_partition_by_id():
    part = BlockPartition.build(CUBE, (True,) * 3, 3, ghost_width=2.0, natoms=10)
    assert part.offsets == (0, 4, 7, 10)
    ids = torch.arange(10)
    assert part.owner_of(torch.zeros(10, 3), ids).tolist() == [0] * 4 + [1] * 3 + [2] * 3
    with pytest.raises(PartitionError, match="global ids"):
        part.owner_of(torch.zeros(10, 3))


# ---------------------------------------------------------------- ghost coverage
def emulate_halos(part, positions, ids, owners):
    """Per rank: (owned ids, owned total shifts, halo [(id, total shift)]) as a serial emulation."""
    nranks = part.nranks
    frac = part.fractional(positions)
    margin = part.ghost_width / part.heights()
    frames, shifts, boxes = [], [], []
    for r in range(nranks):
        mine = owners == r
        fr, sh = frame_coordinates(frac[mine], part.frame_center(r), part.pbc)
        frames.append(fr)
        shifts.append(sh)
        boxes.append(rank_box(fr, part.region(r)))
    boxes = torch.stack(boxes)
    out = []
    for q in range(nranks):
        peers_q = neighbour_ranks(boxes, margin, part.pbc, q)
        halo = []
        for r in sorted(peers_q):
            assert q in neighbour_ranks(boxes, margin, part.pbc, r), "neighbour relation not symmetric"
            idx, s = select_ghosts(frames[r], boxes[q], margin, part.pbc, exclude_self=(r == q))
            rid = ids[owners == r].tolist()
            for i, sv in zip(idx.tolist(), (s + shifts[r][idx]).tolist()):
                halo.append((rid[i], tuple(sv)))
        mine = owners == q
        out.append((ids[mine].tolist(), shifts[q], halo))
    return out


def check_coverage(part, positions, cell, pbc, cutoff, owners=None):
    n = positions.shape[0]
    ids = torch.arange(n)
    if owners is None:
        owners = part.owner_of(part.fractional(positions), ids)
    blocks = emulate_halos(part, positions, ids, owners)
    nl = NeighborList(cutoff=cutoff, full_list=True)
    cell_np = cell.numpy() if any(pbc) else np.zeros((3, 3))
    i, j, S = nl.compute(positions.numpy(), cell_np, list(pbc), "ijS")
    total_halo = 0
    for owned_ids, owned_shift, halo in blocks:
        images = {(a, tuple(s)) for a, s in zip(owned_ids, owned_shift.tolist())}
        assert len(set(halo)) == len(halo), "an image appears twice in one block"
        assert not images & set(halo), "an owned atom reappears unshifted in its own halo"
        images |= set(halo)
        total_halo += len(halo)
        pos_of = {a: s for a, s in zip(owned_ids, owned_shift.tolist())}
        sel = np.isin(i, owned_ids)
        for a, b, s in zip(i[sel], j[sel], S[sel]):
            need = (int(b), tuple(int(u) for u in np.asarray(pos_of[int(a)]) + s))
            assert need in images, f"rank misses neighbour image {need} of atom {a}"
    return blocks, total_halo


def random_positions(cell, n, seed, spread=1.0):
    g = torch.Generator().manual_seed(seed)
    frac = (torch.rand(n, 3, generator=g, dtype=torch.float64) - 0.5) * spread + 0.5
    return frac @ cell


@pytest.mark.parametrize(
    "cell,pbc,nranks,grid",
    [
        (CUBE, (True, True, True), 1, None),  # one rank borders itself on every axis
        (CUBE, (True, True, True), 2, (2, 1, 1)),
        (TRICLINIC, (True, True, True), 4, (2, 2, 1)),
        (TRICLINIC, (True, True, True), 3, None),
        (CUBE, (False, False, False), 8, (2, 2, 2)),
        (TRICLINIC, (True, False, True), 2, (1, 2, 1)),
    ],
)
def test_ghosts_cover_every_neighbour_once(cell, pbc, nranks, grid):
    w = 4.0
    # unwrapped positions (some outside the cell) must work as MD leaves them
    pos = random_positions(cell, 150, seed=nranks, spread=1.6 if any(pbc) else 0.9)
    part = SpatialPartition.build(cell, pbc, nranks, ghost_width=w, grid=grid)
    check_coverage(part, pos, cell, pbc, cutoff=w - 1e-9)


def test_small_cell_several_images_of_one_atom():
    # A 3 A cube, ghost width 4 A: each atom has many images in the one rank's halo.
    cell = torch.eye(3, dtype=torch.float64) * 3.0
    pos = random_positions(cell, 4, seed=3)
    part = SpatialPartition.build(cell, (True,) * 3, 1, ghost_width=4.0)
    blocks, nhalo = check_coverage(part, pos, cell, (True,) * 3, cutoff=3.999)
    per_atom = {}
    for a, _ in blocks[0][2]:
        per_atom[a] = per_atom.get(a, 0) + 1
    assert min(per_atom.values()) >= 26


def test_hysteresis_owned_atoms_beyond_region_still_covered():
    part = SpatialPartition.build(CUBE, (True,) * 3, 2, ghost_width=3.0, grid=(2, 1, 1))
    pos = random_positions(CUBE, 120, seed=5)
    fr = part.fractional(pos)
    owners = part.owner_of(fr)
    # Keep atoms within 1 A of their old slab with their old owner (as after a migration step).
    moved = pos + torch.tensor([0.8, 0.0, 0.0], dtype=torch.float64)
    owners2 = part.owner_of(part.fractional(moved), current=owners, hysteresis=1.0)
    assert (owners2 != part.owner_of(part.fractional(moved))).any()
    check_coverage(part, moved, CUBE, (True,) * 3, cutoff=2.999, owners=owners2)


def test_block_partition_coverage():
    pos = random_positions(TRICLINIC, 90, seed=7)
    part = BlockPartition.build(TRICLINIC, (True,) * 3, 3, ghost_width=3.5, natoms=90)
    check_coverage(part, pos, TRICLINIC, (True,) * 3, cutoff=3.499)


def test_halo_size_near_ghost_shell_estimate():
    # Uniform density, 8 cubic subdomains: halo per rank ~ ((L + 2w)^3 - L^3) * density.
    cell = torch.eye(3, dtype=torch.float64) * 20.0
    n, w = 2000, 2.5
    pos = random_positions(cell, n, seed=11)
    part = SpatialPartition.build(cell, (True,) * 3, 8, ghost_width=w, grid=(2, 2, 2))
    _, total = check_coverage(part, pos, cell, (True,) * 3, cutoff=w - 1e-9)
    side, rho = 10.0, n / 20.0**3
    est = ((side + 2 * w) ** 3 - side**3) * rho
    assert 0.8 * est < total / 8 < 1.25 * est


def test_coverage_check_catches_a_too_thin_halo():
    # Negative control: ghosts selected for 2.5 A cannot serve a 3.5 A cutoff.
    pos = random_positions(CUBE, 150, seed=2)
    part = SpatialPartition.build(CUBE, (True,) * 3, 2, ghost_width=2.5, grid=(2, 1, 1))
    with pytest.raises(AssertionError, match="misses neighbour image"):
        check_coverage(part, pos, CUBE, (True,) * 3, cutoff=3.5)
