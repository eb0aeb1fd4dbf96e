"""The CP Boltz-2 trunk (``CPBoltz2Trunk``) against its serial reference (``Boltz2Trunk``), in the main
environment (the comparison with boltz's own ``Boltz2`` is tests/interop/test_boltz2_trunk_cp.py).

- ``test_cp_trunk_matches_serial``: forward and backward on 1x1, 2x2, 2x3 (batch 2) and 3x2, uneven
  N and atom counts, recycling 0 and 2, in training mode with Boltz's dropout convention on every
  site (p = 0.25: the Pairformer, the MSA module's rows and pair stack, the template stack), so the
  per-cycle dropout seeds and the streams keyed by global index are exercised; every parameter
  gradient and ``ref_pos``'s.
- ``test_only_the_last_cycle_keeps_activations``: recycling 2 saves no more for backward than
  recycling 0 (the earlier cycles run without gradients, as in Boltz): a trunk that kept the graph
  of every cycle would save about three times as much.
- ``test_ranks_that_disagree_on_recycling_raise``: a rank asked for another recycling count raises
  the same error on every rank (no hang, no silent mix).
"""

from __future__ import annotations

import pytest
import torch

from twinshard.pair.atoms import atom_parts
from twinshard.pair.features import collect_grad, collect_tensor, distribute
from twinshard.pair.layers.trunk import CPBoltz2Trunk
from twinshard.pair.reference.trunk import Boltz2Trunk, TrunkConfig
from twinshard.pair.synthetic import synthetic_complex
from twinshard.testing import (
    TwinResult,
    check_twin,
    grid_id,
    parameter_signature,
    randomize_parameters,
    run_on_grid,
    serial_reference,
)

F64 = torch.float64
SEED = 7  # dropout seed
OUTPUTS = ("s", "z", "pdistogram")


def config(dropout: float) -> TrunkConfig:
    """A small Boltz-2 trunk with the released checkpoint's flags (templates v2, bond types, ...)."""
    pair = {"pairwise_head_width": 4, "pairwise_num_heads": 2}
    return TrunkConfig(
        atom_s=8,
        atom_z=4,
        token_s=8,
        token_z=8,
        num_bins=8,
        atom_feature_dim=388,
        atoms_per_window_queries=8,  # windows of 8 x 32 atoms: several straddle every token block
        atoms_per_window_keys=32,
        embedder_args={
            "atom_encoder_depth": 1,
            "atom_encoder_heads": 2,
            "add_method_conditioning": True,
            "add_modified_flag": True,
            "add_cyclic_flag": True,
            "add_mol_type_feat": True,
        },
        msa_args={"msa_s": 8, "msa_blocks": 1, "msa_dropout": dropout, "z_dropout": dropout, **pair},
        pairformer_args={"num_blocks": 1, "num_heads": 2, "dropout": dropout, "v2": True, **pair},
        template_args={"template_dim": 8, "template_blocks": 1, "dropout": dropout, **pair},
        use_templates=True,
        use_templates_v2=True,
        fix_sym_check=True,
        cyclic_pos_enc=True,
        bond_type_feature=True,
    )


def build(cls: type, dropout: float) -> torch.nn.Module:
    m = cls(config(dropout)).to(F64)
    randomize_parameters(m, seed=3, scale=0.3, shift=0.05)  # the zero-initialised gates included
    return m.train()


def features(case: dict) -> dict[str, torch.Tensor]:
    return synthetic_complex(
        case["n"],
        atoms_per_token=(2, 6),
        msa_depth=case["msa"],
        templates=case["templates"],
        chains=3,
        batch=case.get("batch", 1),
        seed=case["n"],
        window=8,
    )


def flat(out: dict) -> torch.Tensor:
    return torch.cat([out[k].reshape(-1) for k in OUTPUTS])


def zero_grads(model: torch.nn.Module, feats: dict, recycling: int) -> tuple[str, ...]:
    """Parameter gradients zero in exact arithmetic: LayerNorm biases in front of a softmax, the
    recycling norms' weights at recycling 0 (they normalise zeros), the cyclic conditioning without
    a cyclic token, the template module without a real template."""
    names = [k for k, p in model.named_parameters() if p.requires_grad]
    shift = (".attention.proj_z.0.bias", ".pair_weighted_averaging.norm_z.bias", "atom_enc_proj_z.0.bias")
    zero = [k for k in names if k.endswith(shift)]
    if recycling == 0:
        zero += ["s_norm.weight", "z_norm.weight"]
    if not bool((feats["cyclic_period"] > 0).any()):
        zero += [k for k in names if k.startswith("input_embedder.cyclic_conditioning_init")]
    if not bool(feats["template_mask"].any()):  # no real template: the template module adds zero
        zero += [k for k in names if k.startswith("template_module.")]
    return tuple(zero)


def _rank(grid, case):
    twin = build(CPBoltz2Trunk, case["dropout"])
    feats = features(case)
    pos = feats["ref_pos"].clone().requires_grad_(True)
    fd = distribute(feats | {"ref_pos": pos}, grid)
    out = twin(fd, case["recycling"], seed=SEED)
    full = flat({k: collect_tensor(out[k]) for k in OUTPUTS})
    from twinshard.testing import random_grad_output

    full.backward(random_grad_output(full, seed=4))
    return TwinResult(
        out=full.detach(),
        grads_in={"ref_pos": collect_grad(pos.grad, "atom", grid)},
        param_grads={k: p.grad for k, p in twin.named_parameters() if p.requires_grad},
        shards={"ref_pos": atom_parts(fd["ref_pos"])} if grid.rows > 1 else {},
        params=parameter_signature(twin),
    )


CASES = [
    ((1, 1), dict(n=9, msa=3, templates=2, recycling=2, dropout=0.25)),
    ((2, 2), dict(n=11, msa=1, templates=2, recycling=0, dropout=0.25)),
    ((2, 3), dict(n=10, msa=5, templates=1, recycling=2, dropout=0.25, batch=2)),
    ((3, 2), dict(n=13, msa=4, templates=0, recycling=0, dropout=0.0)),
]


@pytest.mark.parametrize("grid,case", CASES, ids=[grid_id(g) for g, _ in CASES])
def test_cp_trunk_matches_serial(grid, case):
    ranks = run_on_grid(_rank, grid, case)
    serial = build(Boltz2Trunk, case["dropout"])
    feats = features(case)
    ref = serial_reference(
        serial,
        lambda ref_pos: flat(serial(feats | {"ref_pos": ref_pos}, case["recycling"], seed=SEED)),
        {"ref_pos": feats["ref_pos"]},
        grad_seed=4,
    )
    ref["serial_param_grads"] = {k: p.grad for k, p in serial.named_parameters() if p.requires_grad}
    check_twin(
        what=f"CPBoltz2Trunk {case}",
        grid=grid_id(grid),
        ranks=ranks,
        zero_grads=zero_grads(serial, feats, case["recycling"]),
        **ref,
    )


def saved_bytes(trunk: torch.nn.Module, feats: dict, recycling: int) -> int:
    total = 0

    def pack(t: torch.Tensor) -> torch.Tensor:
        nonlocal total
        total += t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        trunk(feats, recycling)
    return total


def test_only_the_last_cycle_keeps_activations():
    trunk = build(Boltz2Trunk, 0.0)
    feats = features(dict(n=9, msa=3, templates=2))
    once, thrice = saved_bytes(trunk, feats, 0), saved_bytes(trunk, feats, 2)
    assert once > 0
    assert thrice <= 1.1 * once, (
        f"recycling 2 saved {thrice} bytes for backward, recycling 0 {once}: the earlier cycles kept "
        "their graphs (Boltz runs them without gradients)"
    )


def _disagree(grid):
    twin = build(CPBoltz2Trunk, 0.0)
    fd = distribute(features(dict(n=9, msa=3, templates=1)), grid)
    try:
        twin(fd, recycling_steps=grid.rank % 2)
    except Exception as exc:  # the same error, on every rank
        return f"{type(exc).__name__}: {exc}"
    return None


def test_ranks_that_disagree_on_recycling_raise():
    errors = run_on_grid(_disagree, (2, 2))
    assert all(e is not None and "recycling_steps" in e for e in errors), errors
    assert len({e.split("rank")[0] for e in errors}) == 1, errors


def _one_rank_negative(grid):
    twin = build(CPBoltz2Trunk, 0.0)
    fd = distribute(features(dict(n=9, msa=3, templates=1)), grid)
    try:
        twin(fd, recycling_steps=-1 if grid.rank == 2 else 0)
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"
    return None


def test_a_bad_recycling_count_on_one_rank_raises_on_every_rank():
    errors = run_on_grid(_one_rank_negative, (2, 2))
    assert all(e is not None and "recycling_steps must be an integer >= 0, got -1" in e for e in errors), (
        errors
    )
