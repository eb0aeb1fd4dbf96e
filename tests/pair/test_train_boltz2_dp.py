"""The whole-model Boltz-2 training step under data x context parallelism
(``Boltz2Training(..., mesh=DPCPMesh)``) against the serial step on the WHOLE batch (main env;
the helpers are tests/pair/test_train_boltz2.py's).

- ``test_dp_step_matches_serial`` ((dp, rows, cols) = (2, 1, 1) with B = 2, m = 2 and (2, 1, 2)
  with an uneven B = 3 on dp = 2, m = 1; the distogram, diffusion and confidence losses, 2
  confidence samples, counter-based draws, Boltz-convention dropout 0.25 in the MSA, template and
  Pairformer modules): two steps on (2, 1, 1), one on (2, 1, 2); the whole batch's loss of each step, every
  parameter gradient of the first step by name (after the dp reduction), every weight after each
  AdamW update and the EMA weights equal the serial step's on the whole batch (fp64, round-off
  gate), identical on every rank; each replica's noise levels are the serial rows of its elements
  (the structure module's draws keyed by the element's index in the whole batch).
- ``test_dp_step_must_agree``: a rank with another seed, a rank whose batch differs in size from
  its replica peer's, a batch smaller than dp: the same error on every rank, before any model work.
"""

from __future__ import annotations

import re
from dataclasses import replace

import pytest
from model_inputs import model_config
from test_train_boltz2 import HOOKS, _args, _feats, _model, _run, compare_steps

from twinshard.pair.layers.model import CPBoltz2Model
from twinshard.pair.reference.model import Boltz2Model
from twinshard.pair.train_boltz2 import Boltz2Training
from twinshard.testing import assert_parity, assert_replicated, run_on_world

TIMEOUT = 600.0
DROPOUT = 0.25  # Boltz's convention, masks keyed by the element's index in the whole batch


def _config():
    """The whole-model tests' config with dropout in the MSA module, the template module and the
    Pairformer (the training step's masks differ per element: a replica keying its elements by
    their local index would draw another element's masks)."""
    cfg = model_config()
    t = cfg.trunk
    trunk = replace(
        t,
        msa_args={**t.msa_args, "msa_dropout": DROPOUT, "z_dropout": DROPOUT},
        pairformer_args={**t.pairformer_args, "dropout": DROPOUT},
        template_args={**t.template_args, "dropout": DROPOUT},
    )
    return replace(cfg, trunk=trunk)


# the second step (optimizer state, EMA over steps) on (2,1,1); the uneven 4-rank case one step
CASES = [((2, 1, 1), dict(n=7, b=2, m=2, seed=4, steps=2)), ((2, 1, 2), dict(n=6, b=3, m=1, seed=5, steps=1))]


def _id(shape, c):
    return f"dp{'x'.join(map(str, shape))}-B{c['b']}-N{c['n']}-m{c['m']}"


def _rank_dp(shape, c, steps):
    from twinshard.pair.data_parallel import distribute_features
    from twinshard.runtime.mesh import make_dp_mesh

    mesh = make_dp_mesh(*shape)
    model = _model(CPBoltz2Model, c["seed"], _config())
    feats = distribute_features(_feats(c["n"], c["seed"], batch=c["b"]), mesh)
    run = Boltz2Training(model, _args(c), seed=c["seed"], losses=HOOKS, mesh=mesh)
    res = []
    for i in range(steps):
        got = run.step(feats)
        rec = {"loss": got["loss"]}
        if i == 0:
            rec["grads"] = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
            rec["sigmas"] = got["out"]["sigmas"].detach()
        rec["params"] = {n: p.detach().clone() for n, p in model.named_parameters()}
        rec["ema"] = {k: v.clone() for k, v in run.ema.ema_weights.items()}
        res.append(rec)
    return res, feats.split, feats.offset


@pytest.mark.parametrize("shape,c", CASES, ids=[_id(*x) for x in CASES])
def test_dp_step_matches_serial(shape, c):
    steps = c["steps"]
    want = _run(_model(Boltz2Model, c["seed"], _config()), _feats(c["n"], c["seed"], batch=c["b"]), c, steps)
    out = run_on_world(_rank_dp, shape[0] * shape[1] * shape[2], shape, c, steps, timeout=TIMEOUT)
    g, m = _id(shape, c), c["m"]
    assert len(want[0]["grads"]) > 200
    for r, (got, split, offset) in enumerate(out):
        assert sum(split) == c["b"] and len(split) == shape[0]
        rows = slice(offset * m, (offset + split[r // (shape[1] * shape[2])]) * m)
        assert_parity(got[0]["sigmas"], want[0]["sigmas"][rows], what=f"rank {r} sigmas", grid=g)
        compare_steps(got, want, steps, f"dp training rank {r}", g)
    ranks = [o[0] for o in out]
    assert_replicated([got[0]["grads"] for got in ranks], f"{g}: gradients after the dp reduction")
    for i in range(steps):
        assert_replicated([got[i]["loss"] for got in ranks], f"{g}: loss of step {i}")
        assert_replicated([got[i]["params"] for got in ranks], f"{g}: weights after step {i}")
        assert_replicated([got[i]["ema"] for got in ranks], f"{g}: EMA weights after step {i}")


# -- disagreement: raised on every rank before the forward ---------------------------------------


def _rank_disagree(hows):
    import torch.distributed as dist

    from twinshard.pair.data_parallel import split_batch
    from twinshard.runtime.mesh import make_dp_mesh

    c = dict(n=6, m=1, seed=3)
    last = dist.get_rank() == dist.get_world_size() - 1
    mesh = make_dp_mesh(2, 1, 2)
    model = _model(Boltz2Model, 3)
    msgs = {}
    for how in hows:  # each raises before any model work, so the next one starts clean
        try:
            feats = _feats(c["n"], c["seed"], batch=1 if how == "tiny" else 3)
            local = split_batch(feats, mesh)  # replica 1 holds 1 element
            if how == "size" and last:  # this rank took 2 elements, its replica peer 1
                local = {k: v[:2] for k, v in feats.items()}
            seed = c["seed"] + (1 if how == "seed" and last else 0)
            Boltz2Training(model, _args(c), seed=seed, losses=HOOKS, mesh=mesh).step(local)
            msgs[how] = "no error: the step ran"
        except Exception as e:
            msgs[how] = f"{type(e).__name__}: {e}"
    return msgs


DISAGREE = {
    "seed": r"Boltz2Training.step: control-flow scalars differ across ranks \('seed': 3 on ranks \[0, 1, 2\], "
    r"4 on ranks \[3\]",
    "size": r"Boltz2Training.step: the ranks of a replica hold batches of different sizes \(\{1: \[1, 2\]\}\)",
    "tiny": r"a batch of 1 structures cannot be split over dp = 2 replicas",
}


def test_dp_step_must_agree():
    out = run_on_world(_rank_disagree, 4, sorted(DISAGREE), timeout=120)
    for how, want in DISAGREE.items():
        msgs = [o[how] for o in out]
        assert all("no error" not in m for m in msgs), msgs
        assert len({m.split(": ", 1)[0] for m in msgs}) == 1, msgs
        for m in msgs:
            assert re.search(want, m), f"{how}: {m}"
