"""Graph storage at halo cost (issue 22, section 4): where every rank reads or adds only its own
rows (the receivers of graph storage: each rank's edges have owned receivers), the dispatch's
sharded gather and scatter take an agreed local path (one index_select / index_add, no copy through
the rows' all-to-all), and a one-rank group hands the model plain tensors. The results are the
general path's bit for bit; the rows' all-to-alls per evaluation drop from 12 to 5 (the sender
gathers only)."""

import pytest
import torch
import torch.distributed as dist

from twinshard.atoms.data import structures
from twinshard.atoms.parallel.distributed import DistributedPotential
from twinshard.atoms.parallel.graph_storage import GraphSharded, graph_compute
from twinshard.atoms.potentials.mpnn_plain import PlainMessagePassing
from twinshard.comm import CommLedger

KW = dict(species=(18,), cutoff=4.0, n_features=8, n_basis=6, n_layers=2, seed=3)


def _rank(general: bool):
    from twinshard.shard import sharded_handlers

    with pytest.MonkeyPatch.context() as mp:
        sharded_handlers._ROUTES.clear()
        if general:  # the general path everywhere: the routing never local
            mp.setattr(sharded_handlers, "_all_local", lambda *a: False)
        s = structures.fcc_argon(repeat=3, rattle=0.1, seed=1) if dist.get_rank() == 0 else None
        g = GraphSharded.scatter(s, 0, cutoff=KW["cutoff"], skin=0.5)
        dp = DistributedPotential(PlainMessagePassing(**KW), mode="dispatch")
        graph_compute(dp, g)  # routes built (and kept)
        with CommLedger() as ledger:
            res = graph_compute(dp, g, compute_stress=True)
        sharded_handlers._ROUTES.clear()
    rows = ledger.ops.get("sharded_storage:rows")
    return res.forces, res.energy, res.virial, 0 if rows is None else rows.calls


@pytest.mark.parametrize("ranks", [1, 2, 3])
def test_local_paths_equal_the_general_path_bit_for_bit(ranks):
    from twinshard.testing import run_on_world

    fast, slow = run_on_world(_rank, ranks, False), run_on_world(_rank, ranks, True)
    for (f, e, v, calls), (f0, e0, v0, calls0) in zip(fast, slow):
        assert torch.equal(f, f0) and torch.equal(e, e0) and torch.equal(v, v0)
        if ranks > 1:
            # measured 5 against 12: the sender gathers only (positions, two layers; the first
            # layer's features do not depend on the positions: no backward there)
            assert calls <= calls0 // 2 and calls > 0, (calls, calls0)


def _rank_mace_routes():
    from twinshard.atoms.potentials.mace import MaceAdapter, build_mace

    torch.manual_seed(0)
    adapter = MaceAdapter(build_mace())
    s = structures.fcc_argon(repeat=2, rattle=0.1, seed=2) if dist.get_rank() == 0 else None
    if s is not None:  # the default model's species
        s.numbers = torch.tensor([1, 6, 8, 29] * (s.n_atoms // 4))
    g = GraphSharded.scatter(s, 0, cutoff=float(adapter.cutoff), skin=0.5)
    dp = DistributedPotential(adapter, mode="dispatch")
    first = graph_compute(dp, g)  # routes built
    with CommLedger() as ledger:
        again = graph_compute(dp, g)
    built = {op: ledger.ops[op].calls for op in ("sharded_gather", "sharded_scatter") if op in ledger.ops}
    return torch.equal(first.forces, again.forces), built


def test_mace_routes_once_per_neighbour_list():
    """MACE through graph storage (issue 22: "route once per evaluation"): the adapter hands mace the
    same ``edge_index`` tensor while the neighbour list is unchanged, so a second evaluation builds
    no routing (no ids all-to-all of the sharded gather or scatter) and gives the same forces."""
    pytest.importorskip("mace")
    from twinshard.testing import run_on_world

    for same, built in run_on_world(_rank_mace_routes, 2):
        assert same and not built, f"a second evaluation rebuilt its routing: {built}"
