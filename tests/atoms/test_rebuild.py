"""The Verlet rebuild decision, checked directly in both storages, and graph-storage MD across
several rebuilds.

A list built with ``cutoff + skin`` holds every pair within ``cutoff`` until some atom moved
``skin / 2`` (two atoms closing in then moved ``skin`` together). The decision is taken from one
agreed maximum: an atom that moves on ONE rank only must rebuild EVERY rank, exactly when its
displacement since the last build passes ``skin / 2`` and not before (a later rebuild misses
pairs; an earlier one is only slower, which no parity test sees: hence this test).
"""

import pytest
import torch
import torch.distributed as dist

from twinshard.atoms.data import structures
from twinshard.atoms.parallel.graph_storage import GraphSharded
from twinshard.atoms.parallel.sharded import ShardedSystem
from twinshard.atoms.potentials.mpnn_plain import PlainMessagePassing
from twinshard.testing import assert_parity, run_on_world

SKIN = 0.4


def make_system():
    return structures.random_packing(n_atoms=40, seed=3)


def _decision_rank(storage: str) -> list[tuple[float, bool, int]]:
    system = make_system() if dist.get_rank() == 0 else None
    if storage == "graph":
        st = GraphSharded.scatter(system, cutoff=3.0, skin=SKIN)
    else:
        st = ShardedSystem.scatter(system, cutoff=3.0, skin=SKIN, grid=(2, 1, 1))
    mover = dist.get_world_size() - 1  # only the last rank's atom moves
    out = []
    start = None
    for total in (
        0.45 * SKIN,
        0.499 * SKIN,
        0.501 * SKIN,
        0.501 * SKIN + 0.45 * SKIN,
        0.501 * SKIN + 0.51 * SKIN,
    ):
        if dist.get_rank() == mover:
            x = st.positions.clone()
            if start is None:
                start = x[0].clone()
            x[0] = start + torch.tensor([total, 0.0, 0.0], dtype=x.dtype)
            st.positions = x
        out.append((total, st.update(), st.builds))
    return out


@pytest.mark.parametrize("storage", ["halo", "graph"])
def test_rebuild_exactly_past_half_the_skin_on_every_rank(storage):
    """One atom on the last rank moves 0.45, 0.499, 0.501 skin (rebuild), then 0.45 and 0.51 skin
    past that build (rebuild): every rank takes the same decision at the same step."""
    res = run_on_world(_decision_rank, 2, storage)
    assert res[0] == res[1], f"the ranks disagree on the rebuild decision: {res}"
    rebuilt = [r for _, r, _ in res[0]]
    assert rebuilt == [False, False, True, False, True], f"{storage}: rebuilds at {res[0]}"
    builds = [b for _, _, b in res[0]]
    assert builds[1] == builds[0] and builds[2] == builds[0] + 1 and builds[4] == builds[0] + 2, builds


def _model():
    return PlainMessagePassing(species=[18], cutoff=3.0, n_features=8, n_basis=6, n_layers=2, seed=3)


def test_graph_storage_md_across_several_rebuilds():
    """NVE in graph storage at 3 ranks with a small skin over enough steps for several list
    rebuilds of the replicated geometry: positions, velocities and forces equal the serial engine."""
    from twinshard.atoms import SerialEngine, VelocityVerlet, maxwell_boltzmann, run_md, simulate
    from twinshard.atoms.parallel.plain_inputs import evaluate_plain

    system, model, steps = make_system(), _model(), 24
    out = run_md(
        system,
        model,
        ranks=3,
        steps=steps,
        dt=4.0,
        storage="graph",
        skin=0.05,
        initial_temperature=600.0,
        seed=4,
    )
    start = system.clone()
    start.velocities = maxwell_boltzmann(start.masses, start.ids, 600.0, seed=4)
    eng = SerialEngine(model, start, skin=0.05)
    simulate(eng, VelocityVerlet(4.0), steps)
    assert eng.rebuilds >= 4, f"only {eng.rebuilds} list builds: the run must cross several"
    order = torch.argsort(eng.system.ids)
    for key in ("positions", "velocities"):
        want = getattr(eng.system, key)[order]
        assert_parity(
            getattr(out.system, key), want, what=f"graph storage MD {key}, {eng.rebuilds} builds", grid="3"
        )
    assert_parity(
        out.forces, evaluate_plain(model, eng.system).forces[order], what="graph storage MD forces", grid="3"
    )
