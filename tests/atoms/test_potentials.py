"""Reference potentials: independent checks of energies, forces and stress.

Finite-difference tolerances are derived, not defaults: central differences
with step h = 1e-4 (fp64) have truncation error ~ h^2 |E'''| / 6 ~ 1e-9 for
these smooth potentials and round-off ~ 1e-16 |E| / h ~ 1e-11, so atol=1e-7
leaves two orders of margin while still failing on any sign or factor error
(forces are ~1e-2 eV/A).
"""

import itertools
import math

import numpy as np
import pytest
import torch

from twinshard.atoms.data.neighbors import neighbor_list
from twinshard.atoms.data.structures import fcc_argon, lj_mixture, lj_mixture_parameters, triclinic_argon
from twinshard.atoms.data.system import System
from twinshard.atoms.potentials import (
    Graph,
    LennardJones,
    MessagePassingPotential,
    evaluate,
    graph_from_system,
    make_potential,
)
from twinshard.atoms.potentials.base import energy_forces_stress
from twinshard.testing import assert_parity, assert_shards_cover

FD_H = 1e-4
FD_TOL = {"atol": 1e-7, "rtol": 0.0}


def _mixture_triclinic(n_rep=3, seed=0):
    s = triclinic_argon(n_rep, rattle=0.15, seed=seed)
    numbers = s.numbers.clone()
    numbers[::3] = 36
    return System(positions=s.positions, numbers=numbers, cell=s.cell, pbc=True)


def _lj_pair_loop(s, params, cutoff):
    """Independent LJ: numpy loop over pairs and periodic images."""
    pos, cell = s.positions.numpy(), s.cell.numpy()
    z = s.numbers.numpy()
    n = len(pos)
    e_atom, forces, virial = np.zeros(n), np.zeros((n, 3)), np.zeros((3, 3))
    reach = 3
    for i in range(n):
        for j in range(n):
            for img in itertools.product(range(-reach, reach + 1), repeat=3):
                if i == j and img == (0, 0, 0):
                    continue
                d = pos[j] + np.array(img) @ cell - pos[i]
                r = np.linalg.norm(d)
                if r >= cutoff:
                    continue
                (ei, si), (ej, sj) = params[z[i]], params[z[j]]
                eps, sig = math.sqrt(ei * ej), 0.5 * (si + sj)
                phi = (
                    4 * eps * ((sig / r) ** 12 - (sig / r) ** 6 - (sig / cutoff) ** 12 + (sig / cutoff) ** 6)
                )
                dphi = 4 * eps * (-12 * sig**12 / r**13 + 6 * sig**6 / r**7)
                e_atom[i] += 0.5 * phi
                forces[i] += dphi * d / r  # -dphi/dr along -d: attraction pulls i to j
                virial += 0.5 * dphi * np.outer(d, d) / r
    return e_atom, forces, virial / abs(np.linalg.det(cell))


def test_lj_against_independent_pair_loop():
    s = _mixture_triclinic(2)
    params = lj_mixture_parameters()
    lj = LennardJones(params, cutoff=7.0)
    res = evaluate(lj, s)
    e_atom, forces, stress = _lj_pair_loop(s, params, 7.0)
    torch.testing.assert_close(res.per_atom, torch.from_numpy(e_atom))
    torch.testing.assert_close(res.energy, torch.tensor(e_atom.sum(), dtype=torch.float64))
    torch.testing.assert_close(res.forces, torch.from_numpy(forces))
    torch.testing.assert_close(res.stress, torch.from_numpy(stress))
    assert float(res.forces.abs().max()) > 1e-3


def test_lj_matches_ase_calculator():
    from ase.calculators.lj import LennardJones as AseLJ
    from ase.stress import full_3x3_to_voigt_6_stress

    s = fcc_argon(2, rattle=0.1)
    res = evaluate(LennardJones(), s)
    atoms = s.to_ase()
    atoms.calc = AseLJ(sigma=3.405, epsilon=0.0104, rc=2.5 * 3.405)
    torch.testing.assert_close(res.energy.item(), atoms.get_potential_energy())
    torch.testing.assert_close(res.forces, torch.from_numpy(atoms.get_forces()))
    torch.testing.assert_close(
        torch.from_numpy(full_3x3_to_voigt_6_stress(res.stress.numpy())),
        torch.from_numpy(atoms.get_stress()),
    )


def _potentials():
    return {
        "lj": LennardJones(lj_mixture_parameters(), cutoff=6.0),
        "mpnn": MessagePassingPotential(species=(18, 36), cutoff=5.0, n_layers=3, seed=4),
    }


@pytest.mark.parametrize("name", ["lj", "mpnn"])
def test_forces_are_minus_gradient_by_finite_differences(name):
    pot = _potentials()[name]
    s = _mixture_triclinic(2, seed=1)
    res = evaluate(pot, s)
    assert float(res.forces.abs().max()) > 1e-3
    for atom, comp in [(0, 0), (3, 1), (5, 2), (7, 0)]:
        plus, minus = s.clone(), s.clone()
        plus.positions[atom, comp] += FD_H
        minus.positions[atom, comp] -= FD_H
        fd = -(evaluate(pot, plus).energy - evaluate(pot, minus).energy) / (2 * FD_H)
        torch.testing.assert_close(res.forces[atom, comp], fd, **FD_TOL)


@pytest.mark.parametrize("name", ["lj", "mpnn"])
def test_stress_by_finite_strain(name):
    pot = _potentials()[name]
    s = _mixture_triclinic(2, seed=2)
    res = evaluate(pot, s)
    v = s.volume
    for a, b in [(0, 0), (1, 2), (2, 1), (2, 2)]:
        e = []
        for sign in (1, -1):
            eps = torch.zeros(3, 3, dtype=torch.float64)
            eps[a, b] += sign * FD_H / 2
            eps[b, a] += sign * FD_H / 2
            d = s.clone()
            d.positions = s.positions @ (torch.eye(3, dtype=torch.float64) + eps)
            d.cell = s.cell @ (torch.eye(3, dtype=torch.float64) + eps)
            e.append(evaluate(pot, d).energy)
        fd = (e[0] - e[1]) / (2 * FD_H) / v
        # stress is ~1e-4 eV/A^3; FD error scales down by V ~ 3e2 A^3 as well
        torch.testing.assert_close(res.stress[a, b], fd, atol=1e-9, rtol=0)
    torch.testing.assert_close(res.stress, res.stress.T)
    assert float(res.stress.abs().max()) > 1e-6


def test_mpnn_invariances_and_dtype():
    pot = _potentials()["mpnn"]
    s = _mixture_triclinic(2, seed=3)
    res = evaluate(pot, s)
    assert res.energy.dtype == torch.float64
    # rotation + translation of positions and cell: same energies, rotated forces
    q, _ = torch.linalg.qr(torch.randn(3, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(0)))
    r = s.clone()
    r.positions = s.positions @ q.T + torch.tensor([1.0, -2.0, 0.5], dtype=torch.float64)
    r.cell = s.cell @ q.T
    rr = evaluate(pot, r)
    torch.testing.assert_close(rr.per_atom, res.per_atom)
    torch.testing.assert_close(rr.forces, res.forces @ q.T)
    # permutation equivariance
    perm = torch.randperm(s.n_atoms, generator=torch.Generator().manual_seed(1))
    rp = evaluate(pot, s.select(perm))
    torch.testing.assert_close(rp.per_atom, res.per_atom[perm])
    torch.testing.assert_close(rp.forces, res.forces[perm])
    # fp32 parameters with fp64 positions still compute in fp64
    pot32 = MessagePassingPotential(species=(18, 36), n_layers=3, seed=4, dtype=torch.float32)
    assert evaluate(pot32, s).energy.dtype == torch.float64
    # every parameter gets a non-zero finite gradient
    g = graph_from_system(s, pot.cutoff)
    e = pot(g)
    e.backward(torch.randn(e.shape, dtype=e.dtype, generator=torch.Generator().manual_seed(2)))
    for name, p in pot.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all() and p.grad.abs().sum() > 0, name


@pytest.mark.parametrize("name", ["lj", "mpnn"])
def test_skin_edges_contribute_nothing_and_cutoff_is_smooth(name):
    pot = _potentials()[name]
    s = _mixture_triclinic(2, seed=4)
    exact = evaluate(pot, s, neighbor_list(s.positions, pot.cutoff, s.cell, s.pbc))
    skinned = evaluate(pot, s, neighbor_list(s.positions, pot.cutoff + 2.0, s.cell, s.pbc))
    torch.testing.assert_close(skinned.per_atom, exact.per_atom)
    torch.testing.assert_close(skinned.forces, exact.forces)
    # a dimer across the cutoff: the energy is continuous (LJ is shifted to 0)
    z = torch.tensor([18, 36])
    e = []
    for r in (pot.cutoff - 1e-9, pot.cutoff + 1e-9):
        d = System(positions=torch.tensor([[0.0, 0, 0], [r, 0, 0]], dtype=torch.float64), numbers=z)
        e.append(evaluate(pot, d, neighbor_list(d.positions, pot.cutoff + 1.0)).energy)
    assert abs(float(e[0] - e[1])) < 1e-8


def _halo_block(s, owned, cutoff):
    """The block [owned | halo] of one would-be rank, built serially as an open box.

    Halo = every periodic image (j, shift) that is a sender to an owned atom,
    excluding the owned atoms themselves at zero shift.
    """
    e = neighbor_list(s.positions, cutoff, s.cell, s.pbc)
    owned_set = set(owned.tolist())
    halo = []
    for j, i, c in zip(e.senders.tolist(), e.receivers.tolist(), e.cell_shifts.tolist()):
        if i in owned_set and not (j in owned_set and c == [0, 0, 0]):
            halo.append((j, tuple(c)))
    halo = sorted(set(halo))
    src = torch.tensor([j for j, _ in halo], dtype=torch.int64)
    shift = torch.tensor([c for _, c in halo], dtype=torch.float64) @ s.cell
    pos = torch.cat([s.positions[owned], s.positions[src] + shift])
    num = torch.cat([s.numbers[owned], s.numbers[src]])
    be = neighbor_list(pos, cutoff)  # open boundary on the padded block
    return pos, num, be, src


@pytest.mark.parametrize("name", ["lj", "mpnn"])
def test_contract_two_blocks_sum_to_the_serial_energy(name):
    """The contract A2's distributed wrapper builds on: owned energies over disjoint blocks
    with a one-cutoff halo add up to the serial energy; the MPNN needs `refresh`."""
    pot = _potentials()[name]
    s = _mixture_triclinic(3, seed=5)
    recorded = []

    def record(h):
        recorded.append(h.detach().clone())
        return h

    full = pot(
        Graph(
            **{k: v for k, v in vars(graph_from_system(s, pot.cutoff)).items() if k != "refresh"},
            refresh=record,
        )
    )
    blocks = [torch.arange(0, 11), torch.arange(11, s.n_atoms)]
    total, total_plain, pieces = 0.0, 0.0, []
    for owned in blocks:
        pos, num, be, src = _halo_block(s, owned, pot.cutoff)
        calls = []
        n_own = len(owned)

        def refresh(h, n_own=n_own, src=src, calls=calls):
            # the owners' current features overwrite the halo rows (what the halo exchange does)
            t = len(calls)
            calls.append(t)
            return torch.cat([h[:n_own], recorded[t][src].to(h.dtype)])

        g = Graph(pos, num, be.senders, be.receivers, be.shifts, n_owned=n_own, refresh=refresh)
        e = pot(g)[:n_own]
        pieces.append((e.detach(), owned))
        total = total + e.sum()
        g_plain = Graph(pos, num, be.senders, be.receivers, be.shifts, n_owned=n_own)
        total_plain = total_plain + pot(g_plain)[:n_own].sum()
        if name == "mpnn":
            assert len(calls) == pot.n_layers  # refresh before each interaction layer
    assert_shards_cover(pieces, full.detach(), f"{name} owned energies of two halo blocks", disjoint=True)
    what = f"{name} energy summed over two halo blocks"
    assert_parity(total.detach(), full.sum().detach(), what=what)
    if name == "mpnn":  # negative control: without refresh the halo rows go stale
        with pytest.raises(AssertionError, match=f"parity of {what} on grid - fails"):
            assert_parity(total_plain.detach(), full.sum().detach(), what=what)


def test_errors_and_factory():
    s = lj_mixture(20)
    with pytest.raises(ValueError, match="no parameters for atomic numbers \\[36\\]"):
        evaluate(LennardJones(), s)
    with pytest.raises(ValueError, match="no parameters for atomic numbers \\[36\\]"):
        evaluate(MessagePassingPotential(), s)
    assert make_potential("lj", species=[18, 36]).species == [18, 36]
    assert make_potential("mpnn", species=[18, 36]).species == [18, 36]
    with pytest.raises(ValueError, match="unknown potential"):
        make_potential("eam")
    # an open box without a cell: energies and forces, no stress
    o = System(positions=s.positions[:6], numbers=torch.full((6,), 18))
    res = evaluate(LennardJones(), o)
    assert res.stress is None and res.forces.shape == (6, 3)
    r = energy_forces_stress(LennardJones(), graph_from_system(o, 8.5), volume=None)
    torch.testing.assert_close(r.forces, res.forces)


def test_one_factory_builds_every_kind(tmp_path):
    """``make_potential`` is the one factory (md, validate, the benches): the plain MPNN has the
    hook MPNN's draws, a model file loads into it, the default MACE knows the structure's species
    (argon included), a saved MACE that does not raises naming them; options of another kind
    raise."""
    from twinshard.atoms.potentials.mpnn_plain import PlainMessagePassing

    hook = make_potential("mpnn", species=[18, 36], seed=4)
    plain = make_potential("mpnn", species=[18, 36], plain=True, seed=4)
    assert isinstance(plain, PlainMessagePassing)
    for (n, a), (m, b) in zip(hook.state_dict().items(), plain.state_dict().items()):
        assert n == m and torch.equal(a, b), n
    f = tmp_path / "mpnn.pt"
    other = make_potential("mpnn", species=[18, 36], plain=True, seed=5)
    torch.save(other.state_dict(), f)
    loaded = make_potential("mpnn", species=[18, 36], plain=True, seed=4, model=str(f))
    assert all(torch.equal(a, b) for a, b in zip(loaded.state_dict().values(), other.state_dict().values()))
    with pytest.raises(ValueError, match="model file is an option of the mpnn and mace"):
        make_potential("lj", model=str(f))
    with pytest.raises(ValueError, match="plain-PyTorch form"):
        make_potential("lj", plain=True)
    pytest.importorskip("mace")
    mace = make_potential("mace", species=[18])
    assert 18 in mace.species and 1 in mace.species
    saved = tmp_path / "mace.model"
    torch.save(make_potential("mace").model, saved)
    with pytest.raises(ValueError, match=r"no parameters for atomic numbers \[18\]"):
        make_potential("mace", species=[18], model=str(saved))
    with pytest.raises(ValueError, match="takes no options"):
        make_potential("mace", cutoff=4.0)
