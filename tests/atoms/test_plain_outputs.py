"""A per-atom result a model computes outside the dispatch is refused, never silently wrong.

A LAMMPS-style force head (SevenNet's ``ForceStressOutputFromEdge``) takes the gradient of the
energy with respect to the edge vectors and scatters it onto both ends of every edge into a fresh
plain ``torch.zeros(n_local, 3)``: every operand is plain, so no handler sees the scatter, and in
halo storage the partial forces on halo rows never reach their owners. The model below does just
that; its serial forces are right (checked), and at 2 ranks the plain forces it returns from
ShardTensor inputs are refused on every rank with a message naming the fix.
"""

import pytest
import torch
import torch.distributed as dist

from twinshard.atoms.data import structures
from twinshard.atoms.parallel.distributed import DistributedPotential
from twinshard.atoms.parallel.graph_storage import GraphSharded
from twinshard.atoms.parallel.plain_inputs import evaluate_plain
from twinshard.atoms.parallel.sharded import ShardedSystem
from twinshard.testing import assert_parity, run_on_world


class EdgeHeadLJ(torch.nn.Module):
    """Lennard-Jones as a plain model whose forces come from edge gradients scattered into a plain
    buffer of the block's rows (the pattern of an edge force head)."""

    plain_contract = True

    def __init__(self, cutoff: float = 6.0) -> None:
        super().__init__()
        self.cutoff = cutoff
        self.sigma = torch.nn.Parameter(torch.tensor(3.4, dtype=torch.float64))

    def forward(self, data, compute_forces=True, compute_stress=False, training=False):  # noqa: ANN001, ANN201
        x, s, r = data["positions"], data["senders"], data["receivers"]
        vec = (x[s] + data["shifts"] - x[r]).detach().requires_grad_(True)  # plain per-edge vectors
        d = vec.norm(dim=1)
        e_edge = 0.5 * 0.0104 * 4 * ((self.sigma / d) ** 12 - (self.sigma / d) ** 6)
        n = data["numbers"].shape[0]
        node = torch.zeros(n, dtype=x.dtype).index_add(0, r.contiguous(), e_edge)  # plain rows
        out = {"node_energy": node, "energy": node.sum()[None]}
        if compute_forces:
            (g,) = torch.autograd.grad(e_edge.sum(), vec)
            f = torch.zeros(n, 3, dtype=x.dtype)
            f.index_add_(0, s, -g).index_add_(0, r, g)  # onto both ends: halo rows get partial sums
            out["forces"] = f
        return out


def make_system():
    return structures.fcc_argon(repeat=3, rattle=0.1, seed=2)


def test_edge_head_is_right_serially():
    """Serially the edge head is exact: its forces are minus the gradient of its energy."""
    from twinshard.atoms.parallel.plain_inputs import system_inputs

    system, model = make_system(), EdgeHeadLJ()
    got = evaluate_plain(model, system, compute_stress=False)
    data = system_inputs(system, model.cutoff)
    x = data["positions"].clone().requires_grad_(True)
    data["positions"] = x
    vec = x[data["senders"]] + data["shifts"] - x[data["receivers"]]
    d = vec.norm(dim=1)
    sig = model.sigma.detach()
    energy = (0.5 * 0.0104 * 4 * ((sig / d) ** 12 - (sig / d) ** 6)).sum()
    (grad,) = torch.autograd.grad(energy, x)
    assert float(grad.abs().max()) > 1e-3
    assert_parity(got.forces, -grad, what="edge-head LJ serial forces vs -dE/dx")


def _rank(storage):
    system = make_system() if dist.get_rank() == 0 else None
    if storage == "graph":
        st = GraphSharded.scatter(system, cutoff=6.0, skin=0.5)
    else:
        st = ShardedSystem.scatter(system, cutoff=6.0, skin=0.5, grid=(2, 1, 1))
    DistributedPotential(EdgeHeadLJ(), mode="dispatch").compute(st, compute_stress=False)


@pytest.mark.parametrize("storage", ["halo"])
def test_plain_per_atom_forces_from_shard_inputs_are_refused(storage):
    with pytest.raises(Exception, match=r"(?s)returned its per-atom 'node_energy' as a plain"):
        run_on_world(_rank, 2, storage)
