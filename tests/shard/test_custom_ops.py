"""Custom-op adapters (``twinshard.shard.custom_ops``) and the halo moves as custom ops.

Three opaque kernels written for this test (``torch.library.custom_op``, each with a hand-registered
backward): ``density`` (a per-atom sum over edges that lands on both ends of each edge, so halo rows
hold partial sums: ``HALO_CORRECT``), ``pair_energy`` (per-receiver energies reading positions and
densities of both ends: ``HALO_PAD`` inputs, ``OWNED_ROWS`` output, a parameter) and ``total`` (a sum
over rows: ``ALL_REDUCE``), called by a plain model. Distributed at 1, 2 and 3 ranks (fcc argon,
108 atoms, periodic, ids shuffled) it equals the serial model to fp64 round-off: energy, per-atom
energies, forces, the parameter gradient, and the backward of a random grad_output. An ``Owned``
positions input padded with the scope's plan, and a ``GATHER`` kernel (``center``) on uneven sharded
storage with an empty rank, check the other transforms; a clustered open system gives a rank with
no halo rows and nothing to send, which still completes.

The halo custom ops satisfy the adjoint identity (``adjoint_pair``). Negative controls: a
``HALO_CORRECT`` or ``ALL_REDUCE`` declared ``AS_IS`` fails parity; a stale input declared ``AS_IS``
raises on every rank; a planted bug in the halo op's backward fails the adjoint check; without the
scope the op raises naming itself.
"""

import contextlib

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.func import functional_call

from twinshard.atoms.data import structures
from twinshard.atoms.data.system import System
from twinshard.atoms.parallel.plain_inputs import block_inputs, system_inputs
from twinshard.atoms.parallel.sharded import ShardedSystem
from twinshard.comm.adjoint import adjoint_pair
from twinshard.comm.ledger import CommLedger
from twinshard.comm.ops import sync_params
from twinshard.rng import normal
from twinshard.shard import custom_ops as C
from twinshard.shard.custom_ops import (
    ALL_REDUCE,
    AS_IS,
    GATHER,
    HALO_CORRECT,
    HALO_PAD,
    OWNED_ROWS,
    adapt,
    adapter_of,
    distributed_scope,
)
from twinshard.shard.dispatch import REGISTRY
from twinshard.shard.placements import HaloPadded, HaloState, Owned, ShardSpec
from twinshard.shard.shard_tensor import ShardTensor, UnhandledAtomOp, from_local, to_local
from twinshard.testing import (
    assert_grads_finite_nonzero,
    assert_parity,
    assert_random_grad_output,
    assert_replicated,
    assert_shards_cover,
    by_id,
    rows_of,
    run_on_world,
)

RC, SKIN = 4.0, 0.5
GRIDS = {1: None, 2: (2, 1, 1), 3: (3, 1, 1)}


# ---------------------------------------------------------------------- the opaque kernels
def _fc(d):
    return torch.clamp(1 - (d / RC) ** 2, min=0) ** 2  # exactly zero beyond RC (the skin's edges)


def _dist(pos, senders, receivers, shifts):
    return (pos.index_select(0, senders) + shifts - pos.index_select(0, receivers)).norm(dim=1)


def _density_math(pos, senders, receivers, shifts):
    w = (
        0.5
        * torch.exp(-0.5 * _dist(pos, senders, receivers, shifts))
        * _fc(_dist(pos, senders, receivers, shifts))
    )
    return pos.new_zeros(pos.shape[0]).index_add(0, receivers, w).index_add(0, senders, w)


def _pair_math(pos, q, senders, receivers, shifts, coef):
    d = _dist(pos, senders, receivers, shifts)
    phi = coef[0] * torch.exp(-coef[1] * d) * _fc(d) * (1 + coef[2] * q[senders] * q[receivers])
    return pos.new_zeros(pos.shape[0]).index_add(0, receivers, 0.5 * phi)


@torch.library.custom_op("twinshard_test::density", mutates_args=())
def density(
    pos: torch.Tensor, senders: torch.Tensor, receivers: torch.Tensor, shifts: torch.Tensor
) -> torch.Tensor:
    return _density_math(pos, senders, receivers, shifts)


@torch.library.custom_op("twinshard_test::pair_energy", mutates_args=())
def pair_energy(
    pos: torch.Tensor,
    q: torch.Tensor,
    senders: torch.Tensor,
    receivers: torch.Tensor,
    shifts: torch.Tensor,
    coef: torch.Tensor,
) -> torch.Tensor:
    return _pair_math(pos, q, senders, receivers, shifts, coef)


@torch.library.custom_op("twinshard_test::total", mutates_args=())
def total(e: torch.Tensor) -> torch.Tensor:
    return e.sum()


@torch.library.custom_op("twinshard_test::center", mutates_args=())
def center(x: torch.Tensor) -> torch.Tensor:
    return x - x.mean(0, keepdim=True)


@torch.library.custom_op("twinshard_test::moments", mutates_args=())
def moments(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return x * x, x.sum(0)


@torch.library.custom_op("twinshard_test::twice", mutates_args=())
def twice(x: torch.Tensor) -> torch.Tensor:
    return 2 * x


def _save(ctx, inputs, output):
    ctx.save_for_backward(*[t for t in inputs if isinstance(t, torch.Tensor)])


def _density_bw(ctx, g):
    pos, s, r, sh = ctx.saved_tensors
    _, vjp = torch.func.vjp(lambda p: _density_math(p, s, r, sh), pos)
    return vjp(g)[0], None, None, None


def _pair_bw(ctx, g):
    pos, q, s, r, sh, coef = ctx.saved_tensors
    _, vjp = torch.func.vjp(lambda p, qq, c: _pair_math(p, qq, s, r, sh, c), pos, q, coef)
    gp, gq, gc = vjp(g)
    return gp, gq, None, None, None, gc


def _total_bw(ctx, g):
    (e,) = ctx.saved_tensors
    return g.expand(e.shape).contiguous()


def _center_bw(ctx, g):
    return g - g.mean(0, keepdim=True)


def _moments_bw(ctx, g_sq, g_sum):
    (x,) = ctx.saved_tensors
    return 2 * x * g_sq + g_sum


density.register_autograd(_density_bw, setup_context=_save)
moments.register_autograd(_moments_bw, setup_context=_save)
twice.register_autograd(lambda ctx, g: 2 * g, setup_context=lambda ctx, inputs, output: None)
pair_energy.register_autograd(_pair_bw, setup_context=_save)
total.register_autograd(_total_bw, setup_context=_save)
center.register_autograd(_center_bw, setup_context=lambda ctx, inputs, output: None)

DECLARED = {
    "density": (density, {"pos": HALO_PAD}, [HALO_CORRECT]),
    "pair_energy": (pair_energy, {"pos": HALO_PAD, "q": HALO_PAD}, [OWNED_ROWS]),
    "total": (total, {"e": OWNED_ROWS}, [ALL_REDUCE]),
    "center": (center, {"x": GATHER}, [OWNED_ROWS]),
    "moments": (moments, {"x": OWNED_ROWS}, [OWNED_ROWS, ALL_REDUCE]),
    "twice": (twice, {"x": HALO_PAD}, [AS_IS]),
}
for _op, _ins, _outs in DECLARED.values():
    adapt(_op, inputs=_ins, outputs=_outs)


@contextlib.contextmanager
def declared(name, inputs=None, outputs=None):
    """The adapter of ``name`` redeclared inside the block (negative controls), then restored."""
    op, ins, outs = DECLARED[name]
    adapt(op, inputs=ins if inputs is None else inputs, outputs=outs if outputs is None else outputs)
    try:
        yield
    finally:
        adapt(op, inputs=ins, outputs=outs)


class OpaquePairModel(nn.Module):
    """Plain PyTorch calling the opaque kernels; no twinshard calls."""

    def __init__(self):
        super().__init__()
        self.coef = nn.Parameter(torch.tensor([0.8, 0.7, 0.4], dtype=torch.float64))

    def forward(self, pos, senders, receivers, shifts):
        q = torch.ops.twinshard_test.density(pos, senders, receivers, shifts)
        e = torch.ops.twinshard_test.pair_energy(pos, q, senders, receivers, shifts, self.coef)
        return e, torch.ops.twinshard_test.total(e)


def make_system():
    s = structures.fcc_argon(repeat=3, rattle=0.25, seed=1)  # 108 atoms, periodic
    ids = torch.randperm(s.n_atoms, generator=torch.Generator().manual_seed(7)) + 1000
    return System(positions=s.positions, numbers=s.numbers, cell=s.cell, pbc=s.pbc, ids=ids)


def clusters():
    """Open box, two clusters: at 3 slabs along x, rank 0 owns the small one and has no halo."""
    g = torch.Generator().manual_seed(3)
    a = torch.rand(6, 3, generator=g, dtype=torch.float64) * 3 + torch.tensor([1.0, 8, 8])
    b = torch.rand(16, 3, generator=g, dtype=torch.float64) * torch.tensor([9.0, 4, 4]) + torch.tensor(
        [16.0, 7, 7]
    )
    cell = torch.diag(torch.tensor([30.0, 20, 20], dtype=torch.float64))
    ids = torch.randperm(22, generator=g) + 50
    return System(
        positions=torch.cat([a, b]),
        numbers=torch.full((22,), 18),
        cell=cell,
        pbc=torch.zeros(3, dtype=torch.bool),
        ids=ids,
    )


SYSTEMS = {"fcc": make_system, "clusters": clusters}


def _go(ids):
    return normal(5, 1, ids.to(torch.int64))


# ---------------------------------------------------------------------- model: serial and distributed
def _serial(system_name="fcc"):
    system = SYSTEMS[system_name]()
    model = OpaquePairModel()
    data = system_inputs(system, RC)
    x = system.positions.detach().clone().requires_grad_(True)
    e, E = model(x, data["senders"], data["receivers"], data["shifts"])
    gx_E, gc_E = torch.autograd.grad(E, [x, model.coef], retain_graph=True)
    gx_g, gc_g = torch.autograd.grad(e, [x, model.coef], _go(system.ids))
    return {
        "system": system,
        "energy": E.detach(),
        "per_atom": e.detach(),
        "forces": -gx_E,
        "coef": gc_E,
        "grad_x": gx_g,
        "coef_g": gc_g,
    }


def _rank_model(nranks, variant=None, system_name="fcc", scope=True):
    system = SYSTEMS[system_name]() if dist.get_rank() == 0 else None
    grid = (3, 1, 1) if system_name == "clusters" else GRIDS[nranks]
    sh = ShardedSystem.scatter(system, cutoff=RC, skin=SKIN, grid=grid)
    model = OpaquePairModel()
    (coef,) = sync_params([model.coef], sh.group)  # replicated parameter: gradients all-reduced
    x = sh.positions.detach().requires_grad_(True)
    data = block_inputs(sh, x, wrap=True)  # the dispatch itself, at 1 rank too
    pos, plan = data["positions"], None
    if variant == "owned_positions":  # HALO_PAD of an Owned input: the scope's plan pads it
        pos, plan = from_local(x, ShardSpec(Owned(), group=sh.group)), sh.plan
    ctx = {
        None: contextlib.nullcontext(),
        "owned_positions": contextlib.nullcontext(),
        "density_as_is": declared("density", outputs=[AS_IS]),
        "total_as_is": declared("total", outputs=[AS_IS]),
        "stale_pos_as_is": declared("pair_energy", inputs={"pos": AS_IS, "q": HALO_PAD}),
    }[variant]
    args = (pos, data["senders"], data["receivers"], data["shifts"])
    ledger = CommLedger()
    try:
        with ledger, ctx, distributed_scope(plan) if scope else contextlib.nullcontext():
            e, E = functional_call(model, {"coef": coef}, args)
            installed = C.HANDLER_NAME in REGISTRY.names()
    except (ValueError, UnhandledAtomOp) as exc:
        return {"error": f"{type(exc).__name__}: {exc}"}
    with ledger:  # backward outside the scope: the plans travel in the autograd context
        gx_E, gc_E = torch.autograd.grad(E, [x, model.coef], retain_graph=True)
        e_own = to_local(e)
        gx_g, gc_g = torch.autograd.grad(e_own, [x, model.coef], _go(sh.ids))
    return {
        "ids": sh.ids,
        "n_halo": sh.n_halo,
        "n_sent": sh.plan.n_sent,
        "e_placement": repr(e.placement),
        "installed": (installed, C.HANDLER_NAME in REGISTRY.names()),
        "calls": {k: v.calls for k, v in ledger.ops.items() if k.startswith("halo_")},
        "live_plans": len(C._PLANS),  # handles live for one call only
        "energy": E.detach(),
        "per_atom": e_own.detach(),
        "forces": -gx_E,
        "coef": gc_E,
        "grad_x": gx_g,
        "coef_g": gc_g,
    }


def _check_model(res, s, where, gid):
    system = s["system"]
    assert all("error" not in r for r in res), [r.get("error") for r in res]
    assert all(r["installed"] == (True, False) for r in res), "adapters installed in the scope only"
    assert all(r["live_plans"] == 0 for r in res), "plan handles outlived their calls"
    assert all(r["e_placement"] == "Owned()" for r in res)
    if len(res) > 1:
        # forward: density pads pos and corrects its output, pair_energy pads pos again (q is
        # fresh: no exchange), each after one vote; backward (two passes): each one's adjoint
        want = {
            "halo_forward:grad_agree": 3,
            "halo_reverse:grad_agree": 1,
            "halo_forward:backward": 6,
            "halo_reverse:backward": 2,
        }
        for r in res:
            mine = dict(want)
            if r["n_halo"] == 0 and r["n_sent"] == 0:  # nothing to exchange: it still votes
                mine.update({"halo_forward:backward": 0, "halo_reverse:backward": 0})
            got = {k: r["calls"].get(k, 0) for k in mine}
            assert got == mine, f"halo custom-op calls {where}: {got}, expected {mine}"
    assert_replicated([r["energy"] for r in res], f"energy {where}")
    assert_replicated([r["coef"] for r in res], f"dE/dcoef {where}")
    assert float(s["forces"].abs().max()) > 1e-3
    assert_parity(res[0]["energy"], s["energy"], grid=gid, what=f"energy {where}")
    for key in ("per_atom", "forces", "grad_x"):
        pieces = [(r[key], rows_of(r["ids"], system.ids)) for r in res]
        assert_shards_cover(pieces, s[key], f"{key} {where}", disjoint=True)
        assert_parity(by_id(res, key, system.ids), s[key], grid=gid, what=f"{key} {where}")
    assert_random_grad_output(res[0]["grad_x"])
    assert_grads_finite_nonzero({"coef": res[0]["coef"], "coef (g)": res[0]["coef_g"]}, where)
    assert_parity(res[0]["coef"], s["coef"], grid=gid, what=f"dE/dcoef {where}")
    assert_parity(res[0]["coef_g"], s["coef_g"], grid=gid, what=f"d<g, e>/dcoef {where}")


@pytest.mark.parametrize("nranks", [1, 2, 3])
def test_opaque_kernels_match_serial(nranks):
    s = _serial()
    res = run_on_world(_rank_model, nranks, nranks)
    if nranks > 1:
        assert all(r["n_halo"] > 0 for r in res)
    _check_model(res, s, f"opaque pair model P={nranks}", str(nranks))


def test_owned_input_padded_with_the_scope_plan():
    s = _serial()
    res = run_on_world(_rank_model, 2, 2, "owned_positions")
    _check_model(res, s, "opaque pair model, Owned positions P=2", "2")


def test_rank_without_halo_completes():
    s = _serial("clusters")
    res = run_on_world(_rank_model, 3, 3, None, "clusters", timeout=120)
    assert (res[0]["n_halo"], res[0]["n_sent"]) == (0, 0), "rank 0 should neither receive nor send"
    assert res[1]["n_halo"] > 0 and res[2]["n_halo"] > 0
    _check_model(res, s, "opaque pair model, clusters, rank 0 without halo P=3", "3")


# ---------------------------------------------------------------------- negative controls
@pytest.mark.parametrize("variant,what", [("density_as_is", "per_atom"), ("total_as_is", "energy")])
def test_negative_control_output_declared_as_is_fails_parity(variant, what):
    s = _serial()
    res = run_on_world(_rank_model, 2, 2, variant)
    actual = res[0][what] if what == "energy" else by_id(res, what, s["system"].ids)
    with pytest.raises(AssertionError, match=f"parity of {what} with {variant} .* fails"):
        assert_parity(actual, s[what], grid="2", what=f"{what} with {variant}")


def test_negative_control_stale_input_as_is_raises_on_every_rank():
    res = run_on_world(_rank_model, 2, 2, "stale_pos_as_is")
    for r in res:
        assert "twinshard_test::pair_energy" in r["error"] and "'pos' is declared AS_IS" in r["error"]
        assert "STALE halo-padded" in r["error"], r["error"]


def test_unadapted_outside_the_scope():
    """Plain tensors: the serial op, in or out of the scope. ShardTensors outside the scope (or an
    op without adapter inside it): UnhandledAtomOp naming the op, on every rank."""
    pos = torch.randn(4, 3, dtype=torch.float64)
    s, r = torch.tensor([0, 1, 2]), torch.tensor([1, 2, 3])
    sh = torch.zeros(3, 3, dtype=torch.float64)
    want = _density_math(pos, s, r, sh)
    with distributed_scope():
        inside = density(pos, s, r, sh)
    assert torch.equal(density(pos, s, r, sh), want) and torch.equal(inside, want)
    assert C.HANDLER_NAME not in REGISTRY.names()
    for msg in [r["error"] for r in run_on_world(_rank_model, 2, 2, None, "fcc", False)]:
        assert "custom op twinshard_test::density is an opaque kernel" in msg, msg
        assert msg.startswith("UnhandledAtomOp")
    x = ShardTensor.wrap(torch.ones(3, 2, dtype=torch.float64), ShardSpec(Owned()))
    saved = C.remove_adapter(center)
    try:
        with distributed_scope(), pytest.raises(UnhandledAtomOp, match="twinshard_test::center is an opaque"):
            center(x)
    finally:
        adapt(center, inputs={"x": GATHER}, outputs=[OWNED_ROWS])
    assert saved is not None and adapter_of(center) is not None


def test_declarations_are_checked():
    with pytest.raises(ValueError, match="has no argument 'positions'"):
        adapt(density, inputs={"positions": HALO_PAD})
    with pytest.raises(ValueError, match="returns 1 values, 2 output moves"):
        adapt(density, outputs=[HALO_CORRECT, AS_IS])
    with pytest.raises(ValueError, match="is not one of"):
        adapt(density, inputs={"pos": HALO_CORRECT})
    with pytest.raises(TypeError, match="expected a custom op"):
        adapt(len)
    assert adapter_of(density).outputs == (HALO_CORRECT,)


# ---------------------------------------------------------------------- GATHER / OWNED_ROWS on storage
COUNTS = {1: [7], 2: [5, 0], 3: [4, 1, 6]}


def _table(n):
    return torch.randn(n, 3, generator=torch.Generator().manual_seed(4), dtype=torch.float64)


def _rank_gather(bad=False):
    me, p = dist.get_rank(), dist.get_world_size()
    counts = COUNTS[p]
    off = sum(counts[:me])
    spec = ShardSpec(Owned(tuple(counts)))
    local = _table(sum(counts))[off : off + counts[me]].clone()
    try:
        with distributed_scope(), declared("center", outputs=[AS_IS]) if bad else contextlib.nullcontext():
            got = center(from_local(local, spec))
            adj = adjoint_pair(lambda t: to_local(center(from_local(t, spec))), local, seed=30 + me)
    except ValueError as exc:
        return str(exc)
    return {
        "got": to_local(got).detach(),
        "placement": repr(got.placement),
        "adj": adj,
        "rows": (off, counts[me]),
    }


@pytest.mark.parametrize("nranks", [1, 2, 3])
def test_gather_input_owned_rows_output(nranks):
    res = run_on_world(_rank_gather, nranks)
    full = _table(sum(COUNTS[nranks]))
    ref = full - full.mean(0, keepdim=True)
    for r in res:
        off, n = r["rows"]
        assert r["placement"] == f"Owned(counts={COUNTS[nranks]})"
        assert_parity(
            r["got"], ref[off : off + n], grid=str(nranks), what=f"center GATHER -> OWNED_ROWS P={nranks}"
        )
        _assert_adjoint(*r["adj"], f"center adapter P={nranks}")


def test_gather_with_replicated_output_raises():
    for msg in run_on_world(_rank_gather, 2, True):
        assert "every per-atom input is gathered" in msg and "not AS_IS" in msg, msg


# ---------------------------------------------------------------------- PARTIAL inputs, two outputs
def _table_of(ids):
    return normal(9, 3, ids[:, None].to(torch.int64), torch.arange(3)[None, :]).to(torch.float64)


def _rank_partial(plant=False):
    system = make_system() if dist.get_rank() == 0 else None
    sh = ShardedSystem.scatter(system, cutoff=RC, skin=SKIN, grid=GRIDS[dist.get_world_size()])
    plan, me = sh.plan, dist.get_rank()
    b = torch.randn(plan.n_halo, 3, generator=torch.Generator().manual_seed(me), dtype=torch.float64)
    # partial sums whose totals are the table: owned a plus the halo partials b of every rank
    x = torch.cat([_table_of(sh.ids) - plan.reverse(b), b])
    spec = ShardSpec(HaloPadded(plan), HaloState.PARTIAL, sh.group)
    saved = C._owned_of
    if plant:  # one-line bug: a PARTIAL tensor's halo sums never reach their owners
        C._owned_of = lambda v: to_local(v)[: v.n_owned]
    try:
        with distributed_scope():
            sq, tot = moments(from_local(x, spec))
    finally:
        C._owned_of = saved
    with distributed_scope():
        tw = twice(from_local(x, spec))
        adj_tw = adjoint_pair(lambda t: to_local(twice(from_local(t, spec))), x, seed=50 + me)
        adj_tot = adjoint_pair(lambda t: moments(from_local(t, spec))[1], x, seed=7)  # replicated dy
    return {
        "ids": sh.ids,
        "block_ids": torch.cat([sh.ids, plan.halo_ids]),
        "sq": (to_local(sq).detach(), repr(sq.placement)),
        "tot": tot.detach(),
        "tw": (to_local(tw).detach(), repr(tw.spec)),
        "adj": (adj_tw, adj_tot),
    }


@pytest.mark.parametrize("nranks", [2, 3])
def test_partial_inputs_and_two_outputs(nranks):
    """A PARTIAL input is completed (halo sums onto owners) before OWNED_ROWS and HALO_PAD; a
    kernel with two outputs gets one move each (OWNED_ROWS, ALL_REDUCE); AS_IS of a block output is
    STALE."""
    res = run_on_world(_rank_partial, nranks)
    full = _table_of(make_system().ids)
    g = str(nranks)
    for r in res:
        sq, placement = r["sq"]
        assert placement == "Owned()"
        assert_parity(
            sq, _table_of(r["ids"]) ** 2, grid=g, what=f"moments[0] OWNED_ROWS of PARTIAL P={nranks}"
        )
        assert_parity(r["tot"], full.sum(0), grid=g, what=f"moments[1] ALL_REDUCE P={nranks}")
        tw, spec = r["tw"]
        assert "stale" in spec, spec
        assert_parity(tw, 2 * _table_of(r["block_ids"]), grid=g, what=f"twice HALO_PAD of PARTIAL P={nranks}")
        _assert_adjoint(*r["adj"][0], f"twice adapter P={nranks}")
        lhs, rhs = r["adj"][1]
        _assert_adjoint(lhs, nranks * rhs, f"moments[1] adapter (replicated: lhs = P rhs) P={nranks}")


def test_negative_control_partial_not_completed_fails_parity():
    r = run_on_world(_rank_partial, 2, True)[0]
    with pytest.raises(AssertionError, match="parity of moments.0. with a planted bug .* fails"):
        assert_parity(r["sq"][0], _table_of(r["ids"]) ** 2, grid="2", what="moments[0] with a planted bug")


# ---------------------------------------------------------------------- the halo custom ops
def _assert_adjoint(lhs, rhs, what):
    gap = abs(lhs - rhs) / max(abs(lhs), abs(rhs), 1e-300)
    assert gap < 1e-12, f"adjoint of {what}: <dy, f(x)> = {lhs} but <f*(dy), x> = {rhs} (gap {gap:.2e})"


def _rank_halo_ops(plant=False):
    system = make_system() if dist.get_rank() == 0 else None
    sh = ShardedSystem.scatter(system, cutoff=RC, skin=SKIN, grid=GRIDS[dist.get_world_size()])
    plan, me = sh.plan, dist.get_rank()
    x = normal(8, 3, sh.ids[:, None].to(torch.int64), torch.arange(3)[None, :]).to(torch.float64)
    y = torch.randn(plan.n_halo, 3, generator=torch.Generator().manual_seed(me), dtype=torch.float64)
    saved = C._backward_of_forward
    if plant:  # one-line bug: the halo gradient never reaches its owners
        C._backward_of_forward = lambda ctx, g: (
            g.new_zeros((ctx.plan.n_owned,) + tuple(g.shape[1:])),
            None,
            None,
        )
    try:
        adj_f = adjoint_pair(lambda t: C.halo_forward(t, plan), x, seed=10 + me)
        adj_r = adjoint_pair(lambda t: C.halo_reverse(t, plan), y, seed=20 + me)
    finally:
        C._backward_of_forward = saved
    w = torch.randn(plan.n_halo, 3, generator=torch.Generator().manual_seed(40 + me), dtype=torch.float64)

    def second(fwd):  # d/dx <v, d/dx <w, F(x)^2>>: the backward of the backward
        xx = x.clone().requires_grad_(True)
        (g1,) = torch.autograd.grad((w * fwd(xx) ** 2).sum(), xx, create_graph=True)
        return torch.autograd.grad((x * g1).sum(), xx)[0]

    return {
        "double": (second(lambda t: C.halo_forward(t, plan)), second(plan.forward)),
        "fwd": (C.halo_forward(x, plan), plan.forward(x)),
        "rev": (C.halo_reverse(y, plan), plan.reverse(y)),
        "halo_ids": plan.halo_ids,
        "adj": (adj_f, adj_r),
    }


@pytest.mark.parametrize("nranks", [1, 2, 3])
def test_halo_custom_ops(nranks):
    res = run_on_world(_rank_halo_ops, nranks)
    for r in res:
        (got, ref), (rgot, rref) = r["fwd"], r["rev"]
        assert torch.equal(got, ref) and torch.equal(rgot, rref), "the custom ops are the plan's exchanges"
        want = normal(8, 3, r["halo_ids"][:, None].to(torch.int64), torch.arange(3)[None, :]).to(
            torch.float64
        )
        assert_parity(got, want, grid=str(nranks), what=f"twinshard::halo_forward P={nranks}")
        _assert_adjoint(*r["adj"][0], f"twinshard::halo_forward P={nranks}")
        _assert_adjoint(*r["adj"][1], f"twinshard::halo_reverse P={nranks}")
        got2, ref2 = r["double"]
        if nranks == 1:  # a periodic block of one rank has no halo rows (images are edge shifts)
            assert r["halo_ids"].numel() == 0 and not bool(ref2.any())
        else:
            assert float(ref2.abs().max()) > 0
        assert_parity(
            got2, ref2, grid=str(nranks), what=f"double backward of twinshard::halo_forward P={nranks}"
        )


def test_negative_control_planted_halo_backward_fails_adjoint():
    (r, *_) = run_on_world(_rank_halo_ops, 2, True)
    with pytest.raises(AssertionError, match="adjoint of twinshard::halo_forward with a planted bug"):
        _assert_adjoint(*r["adj"][0], "twinshard::halo_forward with a planted bug")
