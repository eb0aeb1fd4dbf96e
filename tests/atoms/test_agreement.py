"""Rank-local inputs that used to leave peers hanging are agreed: bad ids, a forced rebuild."""

import torch.distributed as dist

from twinshard.atoms.data.structures import fcc_argon
from twinshard.atoms.parallel.sharded import ShardedSystem
from twinshard.runtime import RankFailure
from twinshard.testing import run_on_world


def _scatter_with_ids(offset):
    s = None
    if dist.get_rank() == 0:
        s = fcc_argon(3, rattle=0.05, seed=1)  # 108 atoms
        s.ids = s.ids + offset
    try:
        ShardedSystem.scatter(s, 0, cutoff=5.0, skin=0.5)
    except RankFailure as exc:
        return str(exc)
    return "no error"


def test_ids_beyond_32_bits_raise_on_every_rank_at_scatter():
    msgs = run_on_world(_scatter_with_ids, 2, 2**32 - 100, timeout=30)
    for r, msg in enumerate(msgs):
        assert "atom ids must be in [0, 2**32)" in msg and "rank 0 failed in step 'scatter" in msg, (r, msg)
    # the largest valid id is accepted (the boundary, not just a small id)
    assert run_on_world(_scatter_with_ids, 2, 2**32 - 108, timeout=30) == ["no error"] * 2


def _forced_on_one_rank():
    s = fcc_argon(3, rattle=0.05, seed=1) if dist.get_rank() == 0 else None
    sh = ShardedSystem.scatter(s, 0, cutoff=5.0, skin=0.5)
    before = sh.builds
    rebuilt = sh.update(force=dist.get_rank() == 1)  # only rank 1 asks; nothing moved
    quiet = sh.update(force=False)
    return rebuilt, sh.builds - before, quiet


def test_forced_rebuild_is_agreed():
    assert run_on_world(_forced_on_one_rank, 2, timeout=30) == [(True, 1, False)] * 2
