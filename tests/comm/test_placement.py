"""The GPU path without a GPU: every collective payload and per-atom tensor stays on world.device.

On a GPU world, host tensors are the ones created without ``device=`` (the default device is
the CPU) while the data lives on ``world.device``. Here the roles are emulated on the CPU: the
world's device is the CPU and, while the checked code runs, the *default* device is ``meta``.
A tensor that the code creates without saying where it goes lands on ``meta``, exactly where a
forgotten ``device=`` would land it (the host) on a GPU run, and ``check_placement`` (active
in every primitive of ``twinshard.comm.primitives``) fails on the first payload not on the
world's device; a per-step tensor mixed with device data fails in torch as it would on CUDA.
"""

from contextlib import contextmanager

import pytest
import torch

from twinshard.comm import CommLedger
from twinshard.comm import primitives as prim
from twinshard.comm.placement import PlacementError, check_placement
from twinshard.runtime import RankFailure, get_world
from twinshard.testing import run_on_world


@contextmanager
def _host_is_elsewhere():
    """Factories without ``device=`` go to ``meta`` (the stand-in for the host of a GPU run)."""
    torch.set_default_device("meta")
    try:
        with check_placement():
            yield
    finally:
        torch.set_default_device(None)


def _md_steps(plant: bool = False, analytic: bool = True):
    from twinshard.atoms.data.structures import fcc_argon
    from twinshard.atoms.dynamics.driver import DistributedEngine
    from twinshard.atoms.dynamics.md import Langevin, maxwell_boltzmann, simulate
    from twinshard.atoms.parallel.distributed import DistributedPotential
    from twinshard.atoms.parallel.sharded import ShardedSystem
    from twinshard.atoms.potentials import LennardJones

    world = get_world()
    system = None
    if world.rank == 0:
        system = fcc_argon(3, rattle=0.05, seed=1)  # 108 atoms
        system.velocities = maxwell_boltzmann(system.masses, system.ids, 300.0, seed=1)
    sharded = ShardedSystem.scatter(system, 0, cutoff=5.0, skin=0.5)
    potential = DistributedPotential(LennardJones(cutoff=5.0).to(world.device), analytic=analytic)
    engine = DistributedEngine(sharded, potential)

    def every_step(step, engine):
        engine.sharded.update(force=True)  # migration, halo plan and neighbour list every step
        if plant:  # a payload created without device=: the bug this test exists to catch
            prim.all_reduce(torch.ones(1), op="planted")

    with CommLedger() as ledger, _host_is_elsewhere():
        out = simulate(
            engine,
            Langevin(4.0, 300.0, 0.05, seed=2),
            3,
            callback=every_step,
        )
        final = sharded.gather_all()
    per_atom = [sharded.positions, sharded.velocities, sharded.masses, sharded.ids, sharded.numbers]
    per_atom += [final.positions, sharded.halo_numbers, sharded.plan.halo_shift]
    return {
        "devices": sorted({str(t.device) for t in per_atom}),
        "world": str(world.device),
        "ops": sorted(ledger.ops),
        "energy": out["energy"],
        "atoms": final.n_atoms,
    }


@pytest.mark.parametrize("analytic", [True, False], ids=["analytic-lj", "autograd-lj"])
def test_halo_md_keeps_payloads_and_atoms_on_the_world_device(analytic):
    res = run_on_world(_md_steps, 2, False, analytic)
    # the fast path sums halo forces with a plain reverse exchange; autograd runs the adjoint
    backward = "halo_reverse" if analytic else "halo_forward:backward"
    for r in res:
        assert r["devices"] == [r["world"]], r
        assert r["atoms"] == 108
        # the check was exercised on every kind of collective the step loop issues
        for op in ("halo_forward", backward, "halo_plan", "migrate", "update", "thermo"):
            assert op in r["ops"], (op, r["ops"])
    assert res[0]["energy"] == res[1]["energy"]


def test_planted_host_payload_is_named():
    with pytest.raises(RankFailure, match=r"comm planted: a payload of shape \(1,\) .* is on meta"):
        run_on_world(_md_steps, 2, True)


def _on_host(build):
    """A module as a GPU run's user builds it: on the host (here ``meta``), movable to the world's
    device with ``.to(world.device)`` (here: restored from a real CPU copy built beside it)."""
    torch.set_default_device(None)
    try:
        real = build()
    finally:
        torch.set_default_device("meta")
    host = build()  # parameters and buffers on meta: unusable until moved

    class OnHost(type(host)):
        def _apply(self, fn, recurse=True):
            if fn(torch.zeros((), device="cpu")).device.type == "cpu":
                self.__dict__.update(real.__dict__)
                return self
            return super()._apply(fn, recurse)

    host.__class__ = OnHost
    return host


def _whole_md_rank_and_run_md(tmp):
    """``twinshard md``'s md_rank and ``run_md`` end to end (setup broadcasts, scatter, Langevin
    steps with a trajectory and a checkpoint, final stress, json arrays, stats gather) with the
    host elsewhere: a payload or potential left off the world's device fails here."""
    import twinshard.atoms as ta
    from twinshard.atoms.data.structures import fcc_argon
    from twinshard.atoms.dynamics import driver

    world = get_world()
    system = fcc_argon(3, rattle=0.05, seed=1)  # 108 atoms, built on the host before the check
    system.velocities = ta.maxwell_boltzmann(system.masses, system.ids, 300.0, seed=1)
    saved = driver.load_structure, driver.potential_from_config
    build_potential = driver.potential_from_config
    driver.load_structure = lambda cfg: system.clone()
    driver.potential_from_config = lambda cfg, species: _on_host(lambda: build_potential(cfg, species))
    cfg = driver.MDConfig(
        steps=3, dt=4.0, thermostat="langevin", temperature=300.0, friction=0.05, cutoff=5.0, skin=0.5,
        thermo_every=1, trajectory=f"{tmp}/md.extxyz", trajectory_every=2, checkpoint=f"{tmp}/md.pt",
        checkpoint_every=2, json_arrays=True,
    )  # fmt: skip
    try:
        with CommLedger() as ledger, _host_is_elsewhere():
            res = driver.md_rank(cfg)
            out = ta.run_md(
                system, _on_host(lambda: ta.LennardJones(cutoff=5.0)), steps=3, thermostat="langevin",
                temperature=300.0, friction=0.05, dt=4.0, skin=0.5, thermo_every=1,
            )  # fmt: skip
    finally:
        driver.load_structure, driver.potential_from_config = saved
    assert ledger.calls > 0
    if world.rank != 0:
        return None
    return res["atoms"], res["final_potential"], out.system.n_atoms, out.thermo.rows[-1]["potential"]


def test_whole_md_rank_and_run_md_keep_payloads_and_potential_on_the_world_device(tmp_path):
    res = run_on_world(_whole_md_rank_and_run_md, 2, str(tmp_path))
    atoms, e_md, n, e_api = res[0]
    assert atoms == n == 108 and e_md == e_api  # the two entry points ran the same trajectory


def _pair_twins():
    from twinshard.pair.demo import _modules
    from twinshard.pair.features import PairLayout, collect_tensor, shard_tensor
    from twinshard.runtime import make_grid

    grid = make_grid((2, 2))
    n, s, c = 7, 3, 8
    done = []
    for op in ("outgoing", "opm"):
        _, twin = _modules(op)
        kind = "msa" if op == "opm" else "pair"
        g = torch.Generator().manual_seed(5)
        x = torch.randn(1, s if op == "opm" else n, n, c, generator=g, dtype=torch.float64)
        gout = torch.randn(1, n, n, c, generator=g, dtype=torch.float64)
        layout = PairLayout.for_sizes(n, grid, n_seqs=s if op == "opm" else None)
        xc = x.clone().requires_grad_(True)
        xs, gs = shard_tensor(xc, kind, grid, layout), shard_tensor(gout, "pair", grid, layout)
        with CommLedger() as ledger, _host_is_elsewhere():
            out = twin(xs)
            out.to_local().backward(gs.to_local())
            full = collect_tensor(out.detach(), layout, "pair")
        assert ledger.calls > 0 and full.device == xc.grad.device == torch.device("cpu")
        grads = [p.grad for p in twin.parameters()]
        assert all(gr is not None and gr.device.type == "cpu" for gr in grads)
        done.append(op)
    return done


def test_trimul_and_opm_forward_backward_keep_payloads_on_the_world_device():
    assert run_on_world(_pair_twins, 4) == [["outgoing", "opm"]] * 4


def _wrong_expected():
    with check_placement("meta"):
        prim.all_gather(torch.ones(2, 3), 0, op="probe")


def test_expected_device_override_is_checked():
    with pytest.raises(
        RankFailure,
        match=r"comm probe: a payload of shape \(2, 3\) .* is on cpu, but the world works on meta",
    ):
        run_on_world(_wrong_expected, 2)


def test_check_is_off_outside_the_context():
    # a payload on any device passes when no check is active (the production default)
    from twinshard.comm.placement import check_payload, expected_device

    assert expected_device() is None
    check_payload("probe", torch.ones(1, device="meta"))
    with check_placement("meta"), pytest.raises(PlacementError, match="is on cpu"):
        check_payload("probe", torch.ones(1))


def _comm_selftest_rows():
    from twinshard.comm.adjoint import demo_rows

    with CommLedger() as ledger, _host_is_elsewhere():
        rows = demo_rows()
    assert ledger.calls > 0
    return [r["max_abs_error"] for r in rows]


def test_selftest_comm_rows_build_their_tensors_on_the_world_device():
    errs = run_on_world(_comm_selftest_rows, 4)
    assert len(errs[0]) == 6 and max(errs[0]) < 1e-12
