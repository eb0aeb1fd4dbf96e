"""vesin neighbour lists against a brute-force image loop."""

import itertools

import pytest
import torch

from twinshard.atoms.data.neighbors import VerletList, neighbor_list
from twinshard.atoms.data.structures import triclinic_argon


def _brute(pos, cell, pbc, cutoff):
    reach = [4 if p else 0 for p in pbc]
    out = set()
    for s in itertools.product(*[range(-r, r + 1) for r in reach]):
        shift = torch.tensor(s, dtype=pos.dtype) @ cell
        d = (pos[None, :, :] + shift - pos[:, None, :]).norm(dim=-1)  # [i, j]
        for i, j in torch.nonzero(d < cutoff).tolist():
            if i == j and not any(s):
                continue
            out.add((j, i, s))
    return out


@pytest.mark.parametrize("pbc", [(True, True, True), (True, False, True), (False, False, False)])
def test_matches_brute_force_triclinic(pbc):
    s = triclinic_argon(2, rattle=0.4, seed=5)  # 8 atoms, a small cell: many images per atom
    s.positions = s.positions + torch.tensor([7.0, -11.0, 3.0], dtype=torch.float64)  # unwrapped
    cutoff = 8.0  # > |a1| = 7.44: every atom sees its own periodic images
    e = neighbor_list(s.positions, cutoff, s.cell, torch.tensor(pbc))
    got = {
        (j, i, tuple(c)) for j, i, c in zip(e.senders.tolist(), e.receivers.tolist(), e.cell_shifts.tolist())
    }
    want = _brute(s.positions, s.cell, pbc, cutoff)
    assert got == want and len(want) > 0
    r = e.vectors(s.positions).norm(dim=1)
    assert float(r.max()) < cutoff
    torch.testing.assert_close(e.shifts, e.cell_shifts.double() @ s.cell)
    if any(pbc):
        assert int((e.senders == e.receivers).sum()) > 0  # self images present
    # edges come sorted by receiver, then sender
    key = e.receivers * 1000 + e.senders
    assert bool((key[1:] >= key[:-1]).all())


def test_verlet_list_rebuilds_after_half_skin():
    s = triclinic_argon(3, rattle=0.1)
    vl = VerletList(cutoff=5.0, skin=1.0)
    _, rebuilt = vl.update(s.positions, s.cell, s.pbc)
    assert rebuilt and vl.n_builds == 1
    moved = s.positions.clone()
    moved[4, 0] += 0.49
    _, rebuilt = vl.update(moved, s.cell, s.pbc)
    assert not rebuilt
    moved[4, 0] += 0.02
    _, rebuilt = vl.update(moved, s.cell, s.pbc)
    assert rebuilt and vl.n_builds == 2
    with pytest.raises(ValueError, match="positive"):
        neighbor_list(s.positions, 0.0, s.cell, s.pbc)
