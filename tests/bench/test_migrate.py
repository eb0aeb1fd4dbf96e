"""`twinshard bench migrate` (the migration soak): a short run conserves every id, and a planted
migration that drops an atom is caught on every rank."""

import argparse

import pytest

from twinshard.bench.migrate import run_migrate, soak_rank
from twinshard.runtime import RankFailure
from twinshard.testing import run_on_world

SMALL = dict(
    migrations=40, atoms=400, temperature=5000.0, friction=0.05, dt=5.0, cutoff=5.0, skin=0.6,
    chunk=20, max_steps=2000, seed=0,
)  # fmt: skip


def test_short_soak_conserves_ids(capsys):
    args = argparse.Namespace(ranks=4, timeout=600.0, json=True, **SMALL)
    res = run_migrate(args)
    assert res["migrations"] >= 40 and res["atoms_conserved"] and res["id_checks"] >= 1
    assert sum(res["owned_atoms_per_rank"]) == 400 and res["ranks"] == 4
    assert capsys.readouterr().out.strip().startswith("{")


def _lossy_soak(opts):
    """Planted bug: rank 1 drops one owned atom after its first migration."""
    from twinshard.atoms.parallel import sharded

    original = sharded.ShardedSystem._migrate

    def lossy(self):
        original(self)
        if self.rank == 1 and self.migrations and not getattr(self, "_dropped", False) and self.n_owned:
            self._set_fields({n: t[:-1] for n, t in self._fields().items()})
            self._dropped = True

    sharded.ShardedSystem._migrate = lossy
    try:
        return soak_rank(opts)
    finally:  # the pool's workers are reused: leave no patch behind
        sharded.ShardedSystem._migrate = original


def test_soak_catches_a_lost_atom():
    with pytest.raises(RankFailure, match="1 atoms lost"):
        run_on_world(_lossy_soak, 4, SMALL)
