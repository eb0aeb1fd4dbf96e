"""The storage seam (atoms.parallel.storage): one factory, two types, one interface.

- ``scatter_storage("halo" | "graph", ...)`` returns a ``ShardedSystem`` / ``GraphSharded`` at 2
  ranks; every member of the ``Storage`` interface is there on both, with the values each storage
  means (owned rows cover the system once; graph storage: no halo rows, no migrations, no
  partition), and ``DistributedPotential.compute`` gives the same energy and forces from both
  (the path picked by the storage's type).
- Bad input raises on every rank: an unknown storage name, a load balance asked of graph storage.
"""

import pytest
import torch
import torch.distributed as dist

from twinshard.atoms.data import structures
from twinshard.atoms.parallel.distributed import DistributedPotential
from twinshard.atoms.parallel.graph_storage import GraphSharded
from twinshard.atoms.parallel.sharded import ShardedSystem
from twinshard.atoms.parallel.storage import STORAGES, Storage, scatter_storage
from twinshard.atoms.potentials.mpnn_plain import PlainMessagePassing
from twinshard.testing import assert_parity, run_on_world

MEMBERS = [
    n
    for n in list(Storage.__annotations__) + [k for k, v in vars(Storage).items() if not k.startswith("_")]
    if n not in ("__annotations__",)
]


def rattled():
    system = structures.fcc_argon(2)
    gen = torch.Generator().manual_seed(5)
    system.positions = system.positions + 0.2 * torch.randn(
        system.positions.shape, generator=gen, dtype=torch.float64
    )
    return system


def _rank():
    system = rattled() if dist.get_rank() == 0 else None
    out = {}
    for kind in STORAGES:
        model = PlainMessagePassing(species=(18,), cutoff=4.0, n_features=4, n_basis=4, n_layers=1, seed=2)
        model = model.to(torch.float64)
        st = scatter_storage(kind, system, 0, cutoff=4.0, skin=0.5)
        missing = [n for n in MEMBERS if not hasattr(st, n)]
        res = DistributedPotential(model, mode="dispatch").compute(st)
        out[kind] = {
            "type": type(st).__name__,
            "missing": missing,
            "n_halo": st.n_halo,
            "migrations": st.migrations,
            "partition": st.partition is None,
            "counts": st.counts(),
            "n_total": st.n_total,
            "energy": float(res.energy),
            "forces": dict(zip(st.ids.tolist(), res.forces.tolist())),
        }
    return out


def test_both_storages_one_interface():
    ranks = run_on_world(_rank, 2)
    for r, out in enumerate(ranks):
        assert out["halo"]["type"] == ShardedSystem.__name__ and out["graph"]["type"] == GraphSharded.__name__
        for kind in STORAGES:
            assert not out[kind]["missing"], f"rank {r}: {kind} storage lacks {out[kind]['missing']}"
            assert sum(out[kind]["counts"]) == out[kind]["n_total"] == 32
        assert out["graph"]["n_halo"] == 0 and out["graph"]["migrations"] == 0 and out["graph"]["partition"]
        assert out["halo"]["n_halo"] > 0 and not out["halo"]["partition"]
    for kind in STORAGES:
        forces = {}
        for out in ranks:
            forces.update(out[kind]["forces"])
        assert len(forces) == 32
        f = torch.tensor([forces[i] for i in sorted(forces)], dtype=torch.float64)
        assert float(f.abs().max()) > 1e-6, f"{kind}: vacuous forces (all zero)"
        if kind == "halo":
            f_halo = f
        else:
            e = [torch.tensor(ranks[0][k]["energy"], dtype=torch.float64) for k in STORAGES]
            assert_parity(e[1], e[0], what="graph vs halo storage energy")
            assert_parity(f, f_halo, what="graph vs halo storage forces")


def _bad(kind, kw):
    system = structures.fcc_argon(2) if dist.get_rank() == 0 else None
    scatter_storage(kind, system, 0, cutoff=4.0, skin=0.5, **kw)


@pytest.mark.parametrize(
    "kind,kw,match",
    [
        ("ghost", {}, "storage must be one of"),
        ("graph", {"balance": 1.1}, "graph storage splits atoms by index"),
    ],
)
def test_bad_storage_raises_everywhere(kind, kw, match):
    with pytest.raises(Exception, match=match):
        run_on_world(_bad, 2, kind, kw)
