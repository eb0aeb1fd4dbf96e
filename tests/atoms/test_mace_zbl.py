"""MACE with ZBL pair repulsion (``pair_repulsion=True`` and the Agnesi distance transform: the
MACE-MP foundation-model recipe), unmodified, through the ShardTensor dispatch.

mace's ``ZBLBasis`` sums its per-edge energies into a fresh plain ``torch.zeros(n_local)``
(``scatter_sum(..., dim_size=node_attrs.size(0))``): a plain per-row tensor that meets per-atom
ShardTensors in ``scatter_sum(pair_node_energy, batch)`` (MACE: ``plain_rows_reduce``) and in
``torch.stack`` of the node energies (ScaleShiftMACE: ``stack_then_sum``; MACE stacks along the
last dim, the default path). Small random-weight models (two residual interactions,
``8x0e + 8x1o``, four species, fp64) built here; a 32-atom periodic box with three pairs pulled
to 0.9-1.4 A, so the ZBL term moves the energy by ~1 eV and the forces by several eV/A. Oracle:
mace-torch's own ASE calculator (``mace_native``).
At 1, 2 and 4 ranks in halo storage (``ShardedSystem``, skin 1.0) and graph storage
(``GraphSharded``): energy, per-atom energies, forces, stress at fp64 round-off (``assert_parity``).
Negative control: ``plain_rows_reduce`` switched off -> the ``UnhandledAtomOp`` refusal.
"""

import copy

import ase.data
import mace.modules  # noqa: F401 - the mace extra must be installed (CI installs it)
import numpy as np
import pytest
import torch
import torch.distributed as dist

from twinshard.atoms.data import structures
from twinshard.atoms.data.system import System
from twinshard.atoms.parallel.distributed import DistributedPotential
from twinshard.atoms.parallel.graph_storage import GraphSharded
from twinshard.atoms.parallel.sharded import ShardedSystem
from twinshard.atoms.potentials.mace import MaceAdapter, build_mace, mace_native
from twinshard.shard.dispatch import REGISTRY
from twinshard.shard.shard_tensor import UnhandledAtomOp
from twinshard.testing import (
    assert_parity,
    assert_replicated,
    assert_shards_cover,
    by_id,
    rows_of,
    run_on_world,
)

GRIDS = {1: (1, 1, 1), 2: (2, 1, 1), 4: (2, 2, 1)}
SPECIES = (1, 6, 8, 29)
CLOSE = ((0, 1, 1.1), (5, 9, 1.4), (12, 20, 0.9))  # (i, j, |r_ij| in A): pulled inside ZBL's range
KINDS = ("MACE", "ScaleShiftMACE")
_MODELS: dict[str, torch.nn.Module] = {}


def build_zbl_mace(kind: str, seed: int = 0) -> torch.nn.Module:
    """A small random-weight mace ``MACE`` / ``ScaleShiftMACE`` with ZBL and the Agnesi transform."""
    scale_shift = (1.7, -0.3) if kind == "ScaleShiftMACE" else None
    return build_mace(seed=seed, scale_shift=scale_shift, pair_repulsion=True, distance_transform="Agnesi")


def _model(kind):
    if kind not in _MODELS:  # built once per worker process (seeded: the same weights everywhere)
        _MODELS[kind] = build_zbl_mace(kind)
    return _MODELS[kind]


def make_system():
    s = structures.fcc_argon(repeat=2, rattle=0.25, seed=1)  # 32 atoms, 10.5 A periodic box
    numbers = torch.tensor(SPECIES)[torch.randperm(s.n_atoms, generator=torch.Generator().manual_seed(3)) % 4]
    x = s.positions.clone()
    for i, j, d in CLOSE:
        v = x[j] - x[i]
        x[j] = x[i] + d * v / v.norm()
    ids = torch.randperm(s.n_atoms, generator=torch.Generator().manual_seed(7)) + 500
    return System(positions=x, numbers=numbers, cell=s.cell, pbc=s.pbc, ids=ids)


def _calc(model, atoms):
    got = mace_native(model, atoms)  # mace's own calculator
    return {
        "energy": got["energy"][0],
        "per_atom": got["node_energy"],
        "forces": got["forces"],
        "stress": got["stress"],
    }


@pytest.fixture(scope="module")
def oracle():
    """mace's own calculator, with ZBL and (to show the term matters) without it."""
    system = make_system()
    atoms = system.to_ase()
    refs = {}
    for kind in KINDS:
        model = build_zbl_mace(kind)
        off = copy.deepcopy(model)
        del off.pair_repulsion  # mace's forward tests hasattr(self, "pair_repulsion")
        refs[kind] = (_calc(model, atoms), _calc(off, atoms))
    return system, refs


def _close_pairs(system):
    """Global ids of the atom pairs inside ZBL's range (the sum of their covalent radii)."""
    atoms = system.to_ase()
    d = atoms.get_all_distances(mic=True)
    r = ase.data.covalent_radii[atoms.numbers]
    i, j = np.nonzero(np.triu(d < r[:, None] + r[None, :], k=1))
    return [(int(system.ids[a]), int(system.ids[b])) for a, b in zip(i, j)]


def _rank(nranks, storage):
    me = dist.get_rank()
    out = {}
    for kind in KINDS:
        model = _model(kind)
        system = make_system() if me == 0 else None
        if storage == "halo":
            st = ShardedSystem.scatter(system, cutoff=float(model.r_max), skin=1.0, grid=GRIDS[nranks])
        else:
            st = GraphSharded.scatter(system, cutoff=float(model.r_max), skin=1.0)
        res = DistributedPotential(MaceAdapter(model), mode="dispatch").compute(st)
        out[kind] = {
            "ids": st.ids,
            "n_halo": st.n_halo,
            "energy": res.energy,
            "per_atom": res.per_atom,
            "forces": res.forces,
            "stress": res.stress,
        }
    return out


def test_zbl_term_matters(oracle):
    """Not vacuous: with these close pairs ZBL moves the energy by > 0.1 eV and a force by > 1 eV/A."""
    system, refs = oracle
    assert len(_close_pairs(system)) >= 3
    for kind, (on, off) in refs.items():
        assert float((on["energy"] - off["energy"]).abs()) > 0.1, kind
        assert float((on["forces"] - off["forces"]).abs().max()) > 1.0, kind
        assert float((on["stress"] - off["stress"]).abs().max()) > 1e-4, kind


@pytest.mark.parametrize("storage", ["halo", "graph"])
@pytest.mark.parametrize("nranks", [1, 2, 4])
def test_mace_zbl_through_dispatch(oracle, storage, nranks):
    system, refs = oracle
    res = run_on_world(_rank, nranks, nranks, storage)
    gid = str(nranks)
    if nranks > 1:  # some ZBL pair has its atoms on two ranks: the term crosses a boundary
        owner = {int(i): k for k, r in enumerate(res) for i in r["MACE"]["ids"]}
        assert any(owner[a] != owner[b] for a, b in _close_pairs(system))
        if storage == "halo":
            assert all(r["MACE"]["n_halo"] > 0 for r in res)
    for kind in KINDS:
        ref = refs[kind][0]
        rk = [r[kind] for r in res]
        where = f"{kind} with ZBL, {storage} storage P={nranks}"
        assert_replicated([r["energy"] for r in rk], f"energy {where}")
        assert_replicated([r["stress"] for r in rk], f"stress {where}")
        for key in ("per_atom", "forces"):
            pieces = [(r[key], rows_of(r["ids"], system.ids)) for r in rk]
            assert_shards_cover(pieces, ref[key], f"{key} {where}", disjoint=True)
        energy = rk[0]["energy"].reshape(())
        assert_parity(energy, ref["energy"], grid=gid, what=f"energy {where}")
        assert_parity(
            by_id(rk, "per_atom", system.ids), ref["per_atom"], grid=gid, what=f"node energy {where}"
        )
        assert_parity(by_id(rk, "forces", system.ids), ref["forces"], grid=gid, what=f"forces {where}")
        assert_parity(rk[0]["stress"], ref["stress"], grid=gid, what=f"stress {where}")


def _rank_disabled(storage):
    model = _model("MACE")
    system = make_system() if dist.get_rank() == 0 else None
    if storage == "halo":
        st = ShardedSystem.scatter(system, cutoff=float(model.r_max), skin=1.0, grid=GRIDS[2])
    else:
        st = GraphSharded.scatter(system, cutoff=float(model.r_max), skin=1.0)
    try:
        with REGISTRY.disabled("plain_rows_reduce"):
            DistributedPotential(MaceAdapter(model), mode="dispatch").compute(st)
    except UnhandledAtomOp as exc:
        return str(exc)
    return "no error"


@pytest.mark.parametrize("storage", ["halo", "graph"])
def test_without_the_handler_zbl_is_refused(storage):
    """Negative control: without ``plain_rows_reduce`` the per-system sum of ZBL's plain node
    energies is refused on every rank, naming the op (never a silently local sum)."""
    for msg in run_on_world(_rank_disabled, 2, storage):
        assert "aten.scatter_add" in msg and "no dispatch handler" in msg, msg
