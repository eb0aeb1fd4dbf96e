"""Serial references of the Pairformer trunk against naive loops written from the published equations.

Triangle attention (AF3 Alg. 14/15), attention with pair bias (Alg. 24, beta = 0), the Pairformer
layer and a 2-layer stack (Alg. 17, Boltz-2's dropout convention and AF3's), the distogram head and
loss: forward, the input gradients and every parameter gradient, fp64, random parameters, random
masks (with a fully masked row), random grad_output, B = 2 and uneven N, at the round-off gate of
``assert_parity``.
"""

from __future__ import annotations

import math

import pytest
import torch

from twinshard.pair.reference import (
    AttentionPairBias,
    DistogramHead,
    Dropout,
    PairformerLayer,
    PairformerStack,
    TriangleAttention,
    assign_dropout_streams,
    distogram_loss,
    distogram_target,
    dropout_mask,
)
from twinshard.testing import assert_parity, random_grad_output, random_mask, randomize_parameters, synthetic

B, N = 2, 5
F64 = torch.float64
ANALYTIC_ZERO = ("proj_z.0.bias",)  # gradients that vanish identically (see check_fwd_bwd)


# -- naive building blocks, one output element at a time ---------------------------------------
def ln(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor, eps: float = 1e-5) -> torch.Tensor:
    mu = x.mean(-1, keepdim=True)
    var = ((x - mu) ** 2).mean(-1, keepdim=True)
    return (x - mu) / torch.sqrt(var + eps) * w + b


def lin(x: torch.Tensor, layer: torch.nn.Linear) -> torch.Tensor:
    y = x @ layer.weight.T
    return y if layer.bias is None else y + layer.bias


def masked_softmax(logits: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """Softmax over the valid entries (zero elsewhere); over all entries if none is valid."""
    if not bool(valid.any()):
        valid = torch.ones_like(valid)
    e = torch.where(valid, torch.exp(logits - logits[valid].max()), torch.zeros_like(logits))
    return e / e.sum()


def naive_triangle_attention(m: TriangleAttention, z: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Alg. 14 (starting) / Alg. 15 (ending) with explicit loops over b, i, j, h."""
    hh, ch = m.no_heads, m.c_hidden
    x = ln(z, m.layer_norm.weight, m.layer_norm.bias)
    q = lin(x, m.mha.linear_q).unflatten(-1, (hh, ch))
    k = lin(x, m.mha.linear_k).unflatten(-1, (hh, ch))
    v = lin(x, m.mha.linear_v).unflatten(-1, (hh, ch))
    bias = lin(x, m.linear)  # [B, N, N, H]
    g = torch.sigmoid(lin(x, m.mha.linear_g)).unflatten(-1, (hh, ch))
    n = z.shape[1]
    rows = []
    for b in range(z.shape[0]):
        for i in range(n):
            for j in range(n):
                heads = []
                for h in range(hh):
                    if m.starting:  # a_ijk = softmax_k(q_ij . k_ik / sqrt(c) + b_jk), keys (i, k)
                        logits = (k[b, i, :, h] @ q[b, i, j, h]) / math.sqrt(ch) + bias[b, j, :, h]
                        a = masked_softmax(logits, mask[b, i, :] > 0)
                        heads.append(a @ v[b, i, :, h])
                    else:  # a_ijk = softmax_k(q_ij . k_kj / sqrt(c) + b_ki), keys (k, j)
                        logits = (k[b, :, j, h] @ q[b, i, j, h]) / math.sqrt(ch) + bias[b, :, i, h]
                        a = masked_softmax(logits, mask[b, :, j] > 0)
                        heads.append(a @ v[b, :, j, h])
                o = (g[b, i, j] * torch.stack(heads)).flatten()
                rows.append(lin(o, m.mha.linear_o))
    return torch.stack(rows).view(z.shape)


def naive_attention_pair_bias(m: AttentionPairBias, s, z, mask, k_in) -> torch.Tensor:
    """Alg. 24 with beta = 0: loops over b, i, h."""
    hh, d = m.num_heads, m.head_dim
    q = lin(s, m.proj_q).unflatten(-1, (hh, d))
    k = lin(k_in, m.proj_k).unflatten(-1, (hh, d))
    v = lin(k_in, m.proj_v).unflatten(-1, (hh, d))
    bias = lin(ln(z, m.proj_z[0].weight, m.proj_z[0].bias), m.proj_z[1])  # [B, N, N, H]
    g = torch.sigmoid(lin(s, m.proj_g)).unflatten(-1, (hh, d))
    out = []
    for b in range(s.shape[0]):
        for i in range(s.shape[1]):
            heads = []
            for h in range(hh):
                logits = (k[b, :, h] @ q[b, i, h]) / math.sqrt(d) + bias[b, i, :, h]
                heads.append(masked_softmax(logits, mask[b] > 0) @ v[b, :, h])
            out.append(lin((g[b, i] * torch.stack(heads)).flatten(), m.proj_o))
    return torch.stack(out).view(s.shape)


def naive_trimul(m, z: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Alg. 12 (outgoing: o_ij = sum_k a_ik b_jk) / Alg. 13 (incoming: o_ij = sum_k a_ki b_kj)."""
    x = ln(z, m.norm_in.weight, m.norm_in.bias)
    ab = lin(x, m.p_in) * torch.sigmoid(lin(x, m.g_in)) * mask.unsqueeze(-1)
    a, bb = ab[..., : m.hidden], ab[..., m.hidden :]
    n = z.shape[1]
    o = []
    for b in range(z.shape[0]):
        for i in range(n):
            for j in range(n):
                if m.direction == "outgoing":
                    o.append(sum(a[b, i, kk] * bb[b, j, kk] for kk in range(n)))
                else:
                    o.append(sum(a[b, kk, i] * bb[b, kk, j] for kk in range(n)))
    o = torch.stack(o).view(*z.shape[:3], m.hidden)
    return lin(ln(o, m.norm_out.weight, m.norm_out.bias), m.p_out) * torch.sigmoid(lin(x, m.g_out))


def naive_transition(m, x: torch.Tensor) -> torch.Tensor:
    x = ln(x, m.norm.weight, m.norm.bias)
    a, b = lin(x, m.fc1), lin(x, m.fc2)
    return lin(a * torch.sigmoid(a) * b, m.fc3)


def naive_dropout(site: Dropout, u: torch.Tensor, seed: int | None) -> torch.Tensor:
    """Multiply u[b, i, j, c] by the site's keep factor, indexed element by element as the
    convention says (boltz: one per row i / column j; af3: one per (j, c) / (i, c))."""
    if not site.active():
        return u
    full = dropout_mask(
        u.shape, site.p, seed=seed, stream=site.stream, columnwise=site.columnwise, convention=site.convention
    )
    bsz, n, _, c = u.shape
    f = torch.empty(u.shape, dtype=F64)
    for b in range(bsz):
        for i in range(n):
            for j in range(n):
                for ch in range(c):
                    if site.convention == "boltz":
                        f[b, i, j, ch] = full[b, 0, j, 0] if site.columnwise else full[b, i, 0, 0]
                    else:
                        f[b, i, j, ch] = full[b, i, 0, ch] if site.columnwise else full[b, 0, j, ch]
    return u * f


def naive_layer(m: PairformerLayer, s, z, mask, pair_mask, seed):
    """Alg. 17 (as Boltz-2): four dropped-out triangle updates, pair transition, then the single track."""
    z = z + naive_dropout(m.dropout_tri_mul_out, naive_trimul(m.tri_mul_out, z, pair_mask), seed)
    z = z + naive_dropout(m.dropout_tri_mul_in, naive_trimul(m.tri_mul_in, z, pair_mask), seed)
    z = z + naive_dropout(
        m.dropout_tri_att_start, naive_triangle_attention(m.tri_att_start, z, pair_mask), seed
    )
    z = z + naive_dropout(m.dropout_tri_att_end, naive_triangle_attention(m.tri_att_end, z, pair_mask), seed)
    z = z + naive_transition(m.transition_z, z)
    sn = ln(s, m.pre_norm_s.weight, m.pre_norm_s.bias)
    s = s + naive_attention_pair_bias(m.attention, sn, z, mask, sn)
    s = s + naive_transition(m.transition_s, s)
    if m.post_layer_norm:
        s = ln(s, m.s_post_norm.weight, m.s_post_norm.bias)
    return s, z


# -- helpers ------------------------------------------------------------------------------------
def check_fwd_bwd(module, fn_ref, fn_naive, inputs: list[torch.Tensor], what: str) -> None:
    """Forward parity, then the gradients of every input and parameter for one random grad_output."""
    out, exp = fn_ref(*inputs), fn_naive(*inputs)
    outs = out if isinstance(out, tuple) else (out,)
    exps = exp if isinstance(exp, tuple) else (exp,)
    for k, (o, e) in enumerate(zip(outs, exps)):
        assert o.dtype == F64
        assert_parity(o, e, what=f"{what} out{k}")
    # (random_grad_output cannot draw a 0-d tensor: draw one element and reshape.)
    gos = [random_grad_output(o.reshape(-1), seed=100 + k).reshape(o.shape) for k, o in enumerate(outs)]
    names = [f"input{k}" for k in range(len(inputs))] + [n for n, _ in module.named_parameters()]
    wrt = list(inputs) + [p for _, p in module.named_parameters()]
    ga = torch.autograd.grad(outs, wrt, gos, allow_unused=True)
    ge = torch.autograd.grad(exps, wrt, gos, allow_unused=True)
    scale = max(float(g.abs().max()) for g in ge if g is not None)
    for name, a, e in zip(names, ga, ge):
        assert e is not None and a is not None, f"{what}: no gradient for {name}"
        if name.endswith(ANALYTIC_ZERO):
            # The pair-bias LayerNorm's bias adds a per-head constant to every logit of a row,
            # which the softmax cancels: the gradient is zero, computed as cancelling terms.
            tol = 2.3e-13 * scale
            why = f"analytically zero: round-off of cancelling terms, 2.3e-13 x max|grad| {scale:.3g}"
            assert_parity(a, torch.zeros_like(e), what=f"{what} grad {name}", rtol=0.0, atol=tol, why=why)
            assert_parity(
                e, torch.zeros_like(e), what=f"{what} naive grad {name}", rtol=0.0, atol=tol, why=why
            )
            continue
        assert bool(e.abs().max() > 0), f"{what}: vacuous gradient for {name}"
        assert_parity(a, e, what=f"{what} grad {name}")


def pair_inputs(n: int = N, c: int = 4, seed: int = 0):
    z = synthetic(B, n, n, c, seed=seed).requires_grad_()
    mask = random_mask(B, n, n, seed=seed + 1)
    return z, mask


# -- triangle attention --------------------------------------------------------------------------
@pytest.mark.parametrize("starting", [True, False], ids=["start", "end"])
@pytest.mark.parametrize("n", [5, 6])
def test_triangle_attention_matches_loops(starting, n):
    torch.manual_seed(0)
    m = TriangleAttention(4, c_hidden=3, no_heads=2, starting=starting).double()
    randomize_parameters(m, seed=3)
    z, mask = pair_inputs(n)
    # A row (starting) / column (ending) with no valid key, and one with a single valid key.
    if starting:
        mask[0, 2, :] = 0
        mask[1, 3, :] = 0
        mask[1, 3, 1] = 1
    else:
        mask[0, :, 2] = 0
        mask[1, :, 3] = 0
        mask[1, 1, 3] = 1
    check_fwd_bwd(
        m, lambda z: m(z, mask), lambda z: naive_triangle_attention(m, z, mask), [z], f"triatt-{starting}"
    )


def test_triangle_attention_names_and_shapes():
    m = TriangleAttention(8, c_hidden=5, no_heads=3)
    assert [n for n, _ in m.named_parameters()] == [
        "layer_norm.weight",
        "layer_norm.bias",
        "linear.weight",
        "mha.linear_q.weight",
        "mha.linear_k.weight",
        "mha.linear_v.weight",
        "mha.linear_o.weight",
        "mha.linear_g.weight",
    ]
    assert m.mha.linear_q.weight.shape == (15, 8) and m.linear.weight.shape == (3, 8)
    assert not m.mha.linear_o.weight.any()  # "final": a fresh block adds nothing
    z = torch.randn(1, 4, 4, 8)
    assert not m(z).any()
    with pytest.raises(ValueError, match="pair tensor"):
        m(torch.randn(1, 4, 3, 8))


def test_triangle_attention_masked_keys_have_no_influence():
    """Changing z at masked keys leaves the valid rows' outputs bitwise unchanged (exact zeros)."""
    m = TriangleAttention(4, c_hidden=3, no_heads=2).double()
    randomize_parameters(m, seed=5)
    z, mask = pair_inputs()
    mask[:, :, 4] = 0  # key column 4 masked everywhere
    z2 = z.detach().clone()
    z2[:, :, 4] += 3.0
    out, out2 = m(z.detach(), mask), m(z2, mask)
    # Rows i read keys (i, k) and the bias b_jk from row j: changing column 4 changes only the
    # queries (i, 4) and the bias b_j4 of masked keys, so columns 0..3 of every row with a valid
    # key stay exactly the same; a row without one attends over all keys, column 4 included.
    rows = mask.amax(-1) > 0
    assert bool(rows.any() and (~rows).any())
    assert torch.equal(out[:, :, :4][rows], out2[:, :, :4][rows])
    assert not torch.equal(out[:, :, :4][~rows], out2[:, :, :4][~rows])


# -- attention with pair bias -------------------------------------------------------------------
@pytest.mark.parametrize("n", [5, 7])
def test_attention_pair_bias_matches_loops(n):
    m = AttentionPairBias(6, 4, num_heads=2).double()
    randomize_parameters(m, seed=4)
    s = synthetic(B, n, 6, seed=10).requires_grad_()
    kin = synthetic(B, n, 6, seed=11).requires_grad_()
    z = synthetic(B, n, n, 4, seed=12).requires_grad_()
    mask = random_mask(B, n, seed=13)
    mask[1, 0] = 0
    check_fwd_bwd(
        m,
        lambda s, z, kin: m(s, z, mask, k_in=kin),
        lambda s, z, kin: naive_attention_pair_bias(m, s, z, mask, kin),
        [s, z, kin],
        "attn-pair-bias",
    )


def test_attention_pair_bias_names():
    m = AttentionPairBias(8, 4, num_heads=2)
    assert [n for n, _ in m.named_parameters()] == [
        "proj_q.weight",
        "proj_q.bias",
        "proj_k.weight",
        "proj_v.weight",
        "proj_g.weight",
        "proj_z.0.weight",
        "proj_z.0.bias",
        "proj_z.1.weight",
        "proj_o.weight",
    ]
    with pytest.raises(ValueError, match="multiple of num_heads"):
        AttentionPairBias(7, 4, num_heads=2)


# -- dropout conventions -------------------------------------------------------------------------
@pytest.mark.parametrize("columnwise", [False, True])
def test_boltz_dropout_drops_whole_rows_or_columns(columnwise):
    p, shape = 0.3, (2, 9, 11, 6)
    m = dropout_mask(shape, p, seed=3, stream=1, columnwise=columnwise, convention="boltz")
    assert m.shape == ((2, 1, 11, 1) if columnwise else (2, 9, 1, 1))
    assert set(torch.unique(m).tolist()) == {0.0, 1.0 / (1.0 - p)}
    # Keyed by global index: a block at (row 4, col 6) draws the serial mask's slice.
    blk = dropout_mask(
        (2, 3, 4, 6),
        p,
        seed=3,
        stream=1,
        columnwise=columnwise,
        row_offset=4,
        col_offset=6,
        convention="boltz",
    )
    assert torch.equal(blk, m[:, :, 6:10] if columnwise else m[:, 4:7])
    # The af3 convention has the other shapes, and its draws along the same axis (the other
    # mode) differ: the boltz masks are keyed apart from every channel.
    af3 = dropout_mask(shape, p, seed=3, stream=1, columnwise=columnwise)
    assert af3.shape == ((2, 9, 1, 6) if columnwise else (2, 1, 11, 6))
    same_axis = dropout_mask(shape, p, seed=3, stream=1, columnwise=not columnwise)
    assert not torch.equal(m.flatten(), same_axis[..., 0].flatten())
    d = Dropout(p, columnwise=columnwise, stream=1, convention="boltz")
    x = torch.randn(shape, dtype=F64)
    assert torch.equal(d(x, seed=3), x * m)
    with pytest.raises(ValueError, match="convention"):
        Dropout(p, convention="openfold")


# -- Pairformer layer and stack ------------------------------------------------------------------
def trunk_inputs(n: int, cs: int = 4, cz: int = 4, seed: int = 20):
    s = synthetic(B, n, cs, seed=seed).requires_grad_()
    z = synthetic(B, n, n, cz, seed=seed + 1).requires_grad_()
    mask = random_mask(B, n, seed=seed + 2)
    pair_mask = random_mask(B, n, n, seed=seed + 3) * mask[:, :, None] * mask[:, None, :]
    return s, z, mask, pair_mask


def small_layer(convention: str, dropout: float, post_layer_norm: bool = False) -> PairformerLayer:
    return PairformerLayer(
        4,
        4,
        num_heads=2,
        dropout=dropout,
        pairwise_head_width=2,
        pairwise_num_heads=2,
        post_layer_norm=post_layer_norm,
        convention=convention,
    ).double()


@pytest.mark.parametrize(
    "convention,dropout,post",
    [("boltz", 0.0, False), ("boltz", 0.3, False), ("af3", 0.3, True)],
    ids=["no-dropout", "boltz-dropout", "af3-dropout-postnorm"],
)
def test_pairformer_layer_matches_loops(convention, dropout, post):
    layer = small_layer(convention, dropout, post)
    assign_dropout_streams(layer)
    randomize_parameters(layer, seed=6)
    layer.train()
    s, z, mask, pair_mask = trunk_inputs(5)
    seed = 17
    check_fwd_bwd(
        layer,
        lambda s, z: layer(s, z, mask, pair_mask, seed=seed),
        lambda s, z: naive_layer(layer, s, z, mask, pair_mask, seed),
        [s, z],
        f"pairformer-layer-{convention}-{dropout}",
    )


def test_pairformer_layer_names_match_boltz():
    layer = PairformerLayer(8, 4, num_heads=2, pairwise_head_width=2, pairwise_num_heads=2)
    prefixes = []
    for n, _ in layer.named_parameters():
        top = n.split(".")[0]
        if top not in prefixes:
            prefixes.append(top)
    assert prefixes == [
        "pre_norm_s",
        "attention",
        "tri_mul_out",
        "tri_mul_in",
        "tri_att_start",
        "tri_att_end",
        "transition_s",
        "transition_z",
    ]
    assert "s_post_norm.weight" in dict(PairformerLayer(8, 4, 2, post_layer_norm=True).named_parameters())
    layer.train()
    s, z = torch.randn(1, 3, 8), torch.randn(1, 3, 3, 4)
    with pytest.raises(ValueError, match="no stream"):
        layer(s, z, seed=1)


def test_pairformer_stack_matches_loops_and_checkpointing():
    stack = PairformerStack(
        4, 4, num_blocks=2, num_heads=2, dropout=0.3, pairwise_head_width=2, pairwise_num_heads=2
    ).double()
    randomize_parameters(stack, seed=8)
    stack.train()
    streams = assign_dropout_streams(stack)
    assert len(set(streams.values())) == 8  # every site its own stream
    s, z, mask, pair_mask = trunk_inputs(6, seed=30)
    seed = 5

    def naive_stack(s, z):
        for layer in stack.layers:
            s, z = naive_layer(layer, s, z, mask, pair_mask, seed)
        return s, z

    check_fwd_bwd(
        stack, lambda s, z: stack(s, z, mask, pair_mask, seed=seed), naive_stack, [s, z], "pairformer-stack"
    )

    # Activation checkpointing redraws the same keyed masks: the same outputs and gradients.
    ckpt = PairformerStack(
        4,
        4,
        num_blocks=2,
        num_heads=2,
        dropout=0.3,
        pairwise_head_width=2,
        pairwise_num_heads=2,
        activation_checkpointing=True,
    ).double()
    ckpt.load_state_dict(stack.state_dict())
    ckpt.train()
    assert assign_dropout_streams(ckpt) == streams
    gos = [random_grad_output(t, seed=200 + k) for k, t in enumerate((s, z))]
    results = []
    for model in (ckpt, stack):
        outs = model(s, z, mask, pair_mask, seed=seed)
        params = [p for _, p in model.named_parameters()]
        results.append((outs, torch.autograd.grad(outs, [s, z, *params], gos)))
    (outs_c, grads_c), (outs_s, grads_s) = results
    names = ["s", "z"] + [n for n, _ in stack.named_parameters()]
    for k in range(2):
        assert_parity(outs_c[k], outs_s[k], what=f"checkpointed stack out{k}")
    for name, a, e in zip(names, grads_c, grads_s):
        assert_parity(a, e, what=f"checkpointed stack grad {name}")


# -- distogram -----------------------------------------------------------------------------------
def naive_distogram_loss(head: DistogramHead, z, coords, mask, edges):
    bsz, n = z.shape[:2]
    per_sample = []
    for b in range(bsz):
        num = z.new_zeros(())
        den = 0.0
        for i in range(n):
            for j in range(n):
                logits = lin(z[b, i, j] + z[b, j, i], head.distogram)
                d = torch.sqrt(((coords[b, i] - coords[b, j]) ** 2).sum())
                target_bin = int(sum(float(d) > float(e) for e in edges))
                lse = torch.log(torch.exp(logits - logits.max()).sum()) + logits.max()
                w = float(mask[b, i] * mask[b, j]) * (i != j)
                num = num + w * (lse - logits[target_bin])
                den += w
        per_sample.append(num / (1e-5 + den))
    per_sample = torch.stack(per_sample)
    return per_sample.mean(), per_sample


@pytest.mark.parametrize("n", [5, 6])
def test_distogram_head_and_loss_match_loops(n):
    nb = 8
    head = DistogramHead(4, num_bins=nb).double()
    randomize_parameters(head, seed=9)
    z = synthetic(B, n, n, 4, seed=40).requires_grad_()
    coords = synthetic(B, n, 3, seed=41, scale=8.0)
    mask = random_mask(B, n, seed=42)
    target = distogram_target(coords, num_bins=nb)
    assert target.shape == (B, n, n, 1, nb) and target.dtype == F64
    edges = torch.linspace(2.0, 22.0, nb - 1, dtype=F64)

    logits = head(z)
    assert logits.shape == (B, n, n, 1, nb)
    assert_parity(logits, logits.transpose(1, 2), what="distogram logits symmetric")
    check_fwd_bwd(
        head,
        lambda z: distogram_loss(head(z), target, mask),
        lambda z: naive_distogram_loss(head, z, coords, mask, edges),
        [z],
        "distogram-loss",
    )


def test_distogram_target_conformers_are_averaged():
    coords = synthetic(1, 4, 2, 3, seed=3, scale=10.0)  # two conformers
    t = distogram_target(coords, num_bins=6)
    assert t.shape == (1, 4, 4, 2, 6)
    logits = synthetic(1, 4, 4, 6, seed=4)
    mask = torch.ones(1, 4)
    loss2, _ = distogram_loss(logits, t, mask)
    l0, _ = distogram_loss(logits, t[:, :, :, :1], mask)
    l1, _ = distogram_loss(logits, t[:, :, :, 1:], mask)
    # Cross-entropy is linear in the target distribution: the mixed target gives the mean loss.
    assert_parity(loss2, (l0 + l1) / 2, what="distogram loss of two conformers")
