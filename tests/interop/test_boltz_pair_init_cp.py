"""``cp_twin_of`` of Boltz-2's pair-initialisation parts, template modules and distogram head
against the ``boltz`` modules themselves, on a 2x2 grid (uneven N).

Each rank builds the Boltz module (parameters randomised from one seed), turns it into its CP twin
with ``cp_twin_of`` (state_dict strict, same names and order), runs it on the ``distribute``d
features and collects the output; the test process runs the Boltz module on the full features in
fp64 (``.float()`` kept in fp64 while Boltz runs) and ``check_twin`` compares the output, the
gradient of ``z`` where there is one and every trainable parameter gradient by name.

What each test proves: ``RelativePositionEncoder`` (r_max 4, s_max 1, fix_sym_check,
cyclic_pos_enc: batch 1, Boltz's cyclic broadcast), ``ContactConditioning``, ``TemplateV2Module``
and ``TemplateModule`` (three templates, the last padded), and ``DistogramModule`` (its z + z^T and
``[B, N, N, num_distograms, num_bins]`` reshape are ``CPDistogramHead``'s) equal Boltz's.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("boltz", reason="the boltz package is not installed (see tests/interop/README.md)")

from boltz.model.modules.encodersv2 import RelativePositionEncoder as BoltzRelPos  # noqa: E402
from boltz.model.modules.trunkv2 import ContactConditioning as BoltzContact  # noqa: E402
from boltz.model.modules.trunkv2 import DistogramModule as BoltzDistogram  # noqa: E402
from boltz.model.modules.trunkv2 import TemplateModule as BoltzTemplateV1  # noqa: E402
from boltz.model.modules.trunkv2 import TemplateV2Module as BoltzTemplateV2  # noqa: E402
from test_boltz_pair_init import boltz_all_fp64  # noqa: E402,F401  (a fixture)

from twinshard.pair.features import collect_grad, collect_tensor, distribute, real_part, shard_tensor  # noqa: E402
from twinshard.pair.interop.boltz import cp_twin_of  # noqa: E402
from twinshard.testing import (  # noqa: E402
    TwinResult,
    check_twin,
    grid_id,
    parameter_signature,
    random_grad_output,
    random_mask,
    randomize_parameters,
    run_on_grid,
    synthetic,
)
from twinshard.testing.pair_features import template_features, token_pair_features  # noqa: E402

CZ, TD, N = 4, 5, 7
TKW = dict(template_blocks=1, dropout=0.0, pairwise_head_width=2, pairwise_num_heads=2)
PARTS = ("relpos", "contact", "template-v2", "template-v1", "distogram")


def boltz_module(part: str) -> torch.nn.Module:
    if part == "relpos":
        m = BoltzRelPos(CZ, r_max=4, s_max=1, fix_sym_check=True, cyclic_pos_enc=True)
    elif part == "contact":
        m = BoltzContact(CZ, 4.0, 20.0)
    elif part == "template-v2":
        m = BoltzTemplateV2(CZ, TD, **TKW)
    elif part == "template-v1":
        m = BoltzTemplateV1(CZ, TD, **TKW)
    else:
        m = BoltzDistogram(CZ, 6)
    m = m.double().eval()
    randomize_parameters(m, seed=50 + PARTS.index(part), scale=0.3)
    return m


def inputs(part: str):
    """``(b, feats, z or None)``: the full features (Boltz names) and the pair input."""
    b = 1 if part == "relpos" else 2
    feats = token_pair_features(b, N, seed=61)
    feats = {k: v for k, v in feats.items() if k != "type_bonds"}
    if part.startswith("template"):
        feats |= template_features(b, 3, N, seed=62)
        pm = random_mask(b, N, N, seed=63, keep=0.85)
        pm[:, torch.arange(N), torch.arange(N)] = 1
        feats["pair_mask"] = pm
    z = synthetic(b, N, N, CZ, seed=64) if part.startswith(("template", "distogram")) else None
    return b, feats, z


def call(part, module, feats, z):
    if part in ("relpos", "contact"):
        return module(feats)
    if part.startswith("template"):
        return module(z, feats, feats["pair_mask"])
    return module(z)


def _rank(grid, part):
    theirs = boltz_module(part)
    twin = cp_twin_of(theirs)
    assert type(twin).__module__.startswith("twinshard.pair.layers"), type(twin)
    _, feats, z = inputs(part)
    fd = distribute(feats, grid)
    zd = None
    if z is not None:
        z = z.requires_grad_(True)
        zd = shard_tensor(z, "pair", grid, fd.layout)
    out = collect_tensor(call(part, twin, fd, zd))
    out.backward(random_grad_output(out, seed=65))
    return TwinResult(
        out=out.detach(),
        grads_in={} if z is None else {"z": collect_grad(z.grad, "pair", grid)},
        param_grads={k: p.grad for k, p in twin.named_parameters() if p.requires_grad},
        shards={"contact_threshold": real_part(fd["contact_threshold"])}
        | ({} if zd is None else {"z": real_part(zd)}),
        params=parameter_signature(twin),
    )


@pytest.mark.parametrize("part", PARTS)
def test_cp_twin_of_vs_boltz(part, boltz_all_fp64):  # noqa: F811
    grid = (2, 2)
    ranks = run_on_grid(_rank, grid, part)
    theirs = boltz_module(part)
    _, feats, z = inputs(part)
    leaf = None if z is None else z.clone().requires_grad_(True)
    with boltz_all_fp64():
        out = call(part, theirs, feats, leaf)
    g = random_grad_output(out, seed=65)
    out.backward(g)
    check_twin(
        what=f"cp_twin_of(boltz {part}) N={N}",
        grid=grid_id(grid),
        serial_module=theirs,
        serial_out=out.detach(),
        serial_grads_in={} if leaf is None else {"z": leaf.grad},
        serial_param_grads={k: p.grad for k, p in theirs.named_parameters() if p.requires_grad},
        ranks=ranks,
        grad_output=g,
        serial_inputs={"contact_threshold": feats["contact_threshold"]} | ({} if z is None else {"z": z}),
    )
