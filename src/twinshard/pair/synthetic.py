"""One synthetic Boltz-2 feature dict: the shared data source of every trunk test.

:func:`synthetic_complex` draws a complex from one seed (a ``torch.Generator``) and returns the
feature dict Boltz-2's featuriser and collate would hand the trunk, under Boltz's names and
dtypes (integer and bool features as Boltz has them, floating ones in ``dtype``), with exactly the
sizes asked for: ``[B, N]`` tokens, ``[B, A]`` atoms (A padded to a multiple of ``window``, the
same for every batch element), ``[B, S, N]`` MSA, ``[B, T, N]`` templates. It passes
:func:`twinshard.pair.feature_contract.check_features` with every trunk feature present.

What mirrors Boltz (boltz 2.2.1 data/feature/featurizerv2.py, data/tokenize/boltz2.py, collate):

- tokens: a polymer residue is one token, each ligand atom is one token (res_type UNK, mol_type
  NONPOLYMER, one residue_index for the whole ligand, one ref_space_uid); token_index counts the
  real tokens; asym_id per chain, entity_id per distinct molecule, sym_id the copy number within
  an entity (chains 0 and 1 are two copies of one protein when there are three or more chains);
- atoms: contiguous per token in token order, padding atoms last (``atom_pad_mask`` 0, all-zero
  one-hots, ``ref_space_uid`` 0); ``atom_to_token`` / ``token_to_rep_atom`` one-hots (the
  representative atom is CB, CA for residues of fewer than five atoms, the atom of a ligand token);
  ``atom_backbone_feat`` 1-4 for N, CA, C, O of protein residues; atom names encoded as 4
  characters one-hot of ``ord(c) - 32``; ``ref_element`` one-hot by atomic number; ``ref_pos`` a
  conformer per residue, centred, randomly rotated and shifted by N(0, 1) (Boltz's
  ``center_random_augmentation``);
- MSA: row 0 is the query; ligand columns repeat the query; ``has_deletion = d > 0``,
  ``deletion_value = pi/2 * arctan(d / 3)``, ``profile`` and ``deletion_mean`` the means over the
  real sequences; padding (sequences or tokens) is class 0 with ``msa_mask`` 0, as collate pads;
- templates: covered tokens get the template residue, CA/CB coordinates, frame and masks;
  ``visibility_ids`` are the template id on covered chains and ``-1 - asym_id`` elsewhere;
  uncovered tokens are zero with ``template_restype`` class 0; a padding template is Boltz's dummy
  template (every mask 0);
- ``type_bonds`` = 1 + bond type id (0: no bond), ``token_bonds`` its 0/1 indicator
  ``[B, N, N, 1]``; ``cyclic_period`` the chain length on a cyclic chain; ``method_feature`` one
  method id on every real token; padded tokens are zero everywhere (``token_pad_mask`` 0).

What is synthetic: residue types, atom counts (``atoms_per_token``: fixed, or a range over which
each residue type has its own count, so copies of an entity agree), names, elements, charges and
conformers (random walks of 1.5 A steps); the "true" backbone behind the templates (a random walk
of 3.8 A steps per chain, chains 10 A apart) and template noise; MSA substitutions, gaps,
deletions and pairing flags; which chains a template covers; the bonds (ligand atoms bonded in
a chain, one covalent ligand-protein bond, the closing bond of the cyclic chain);
``modified`` flags; and the contact classes, drawn per token pair as a mix of UNSELECTED,
UNSPECIFIED and the three constraint classes (with thresholds in [4, 20] A) so that every branch of
Boltz's ``ContactConditioning`` is exercised (Boltz's featuriser gives either all UNSPECIFIED or
UNSELECTED plus chosen pairs).

:func:`synthetic_sharded` hands out the same dict and its distributed form on a pair grid, placed
by the production :func:`twinshard.pair.features.distribute` (no second placement path).

Batch elements are different complexes of the same padded sizes: element b > 0 has ``b`` padding
tokens at the end (at most N // 4, never fewer real tokens than chains) when ``pad_tokens``, and
``max(1, S - b)`` real MSA sequences; with T >= 2 the last template of every even element is a
padding template. Element 0 is always complete (no padding tokens, S real sequences).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch
from torch.nn.functional import one_hot

from twinshard.pair.feature_contract import (
    AMINO_ACID_IDS,
    ATOM_NAME_CHARS,
    ATOM_NAME_CLASSES,
    BOND_TYPE_IDS,
    CONTACT_IDS,
    METHOD_IDS,
    MOL_TYPE_IDS,
    NUM_BACKBONE_FEATS,
    NUM_CONTACT_CLASSES,
    NUM_ELEMENTS,
    NUM_TOKENS,
    TOKEN_IDS,
)
from twinshard.pair.features import ShardedFeatures, distribute
from twinshard.runtime import ProcessGrid

__all__ = ["synthetic_complex", "synthetic_sharded", "synthetic_training_features"]

_PROTEIN_ATOMS = (
    "N", "CA", "C", "O", "CB", "CG", "CD", "NE", "CZ", "NH1", "NH2", "OD1", "ND2", "CE",
    "NZ", "OG", "SD", "CG1", "CG2", "CD1", "CD2", "CE1", "CE2", "OH",
)  # fmt: skip
_ELEMENT = {"N": 7, "C": 6, "O": 8, "S": 16}
_LIGAND_ELEMENTS = (6, 6, 6, 7, 8, 15, 16, 9, 17)
_LIGAND_SYMBOL = {6: "C", 7: "N", 8: "O", 15: "P", 16: "S", 9: "F", 17: "CL"}
_METHODS = tuple(METHOD_IDS.values())
_UNK = TOKEN_IDS["UNK"]


def _name_chars(name: str) -> list[int]:
    codes = [ord(c) - 32 for c in name[:ATOM_NAME_CHARS]]
    return codes + [0] * (ATOM_NAME_CHARS - len(codes))


def _rotation(g: torch.Generator) -> torch.Tensor:
    q, r = torch.linalg.qr(torch.randn(3, 3, generator=g, dtype=torch.float64))
    q = q * torch.sign(torch.diagonal(r))
    return q if torch.det(q) > 0 else -q


def _walk(n: int, step: float, g: torch.Generator) -> torch.Tensor:
    d = torch.randn(n, 3, generator=g, dtype=torch.float64)
    d = d / d.norm(dim=-1, keepdim=True) * step
    d[0] = 0.0
    return d.cumsum(0)


def _chain_plan(n_real: int, chains: int, g: torch.Generator) -> list[dict]:
    """Chains as dicts: kind, length, entity, sym. Sums to n_real exactly."""
    if n_real < chains:
        raise ValueError(f"synthetic_complex: {n_real} real tokens cannot hold {chains} chains")
    if chains == 1:
        return [{"kind": "protein", "length": n_real, "entity": 0, "sym": 0}]
    n_prot = chains - 1
    lig = min(4, max(1, n_real // 5))
    budget = n_real - lig
    while budget < n_prot:  # small n: shrink the ligand
        lig -= 1
        budget += 1
    plan = []
    if n_prot >= 2:
        length = budget // n_prot
        plan += [{"kind": "protein", "length": length, "entity": 0, "sym": 0}]
        plan += [{"kind": "protein", "length": length, "entity": 0, "sym": 1}]
        rest, others = budget - 2 * length, n_prot - 2
        for k in range(others):
            share = rest // others + (1 if k < rest % others else 0)
            plan.append({"kind": "protein", "length": share, "entity": k + 1, "sym": 0})
        if others == 0:
            lig += rest
    else:
        plan.append({"kind": "protein", "length": budget, "entity": 0, "sym": 0})
    plan.append({"kind": "ligand", "length": lig, "entity": len({c["entity"] for c in plan}), "sym": 0})
    return plan


def _atom_count(res: int, lo: int, hi: int) -> int:
    return lo + (res * 7 + 3) % (hi - lo + 1)


def _element(chains: int, n_tok: int, g: torch.Generator, lo: int, hi: int) -> dict:
    """One complex with n_tok real tokens (lists and small tensors, unpadded)."""
    plan = _chain_plan(n_tok, chains, g)
    sequences: dict[int, list[int]] = {}
    tok: dict[str, list] = {k: [] for k in ("res", "resid", "asym", "entity", "sym", "mol", "chain_pos")}
    for asym, ch in enumerate(plan):
        if ch["kind"] == "protein":
            if ch["entity"] not in sequences:
                ids = torch.randint(AMINO_ACID_IDS.start, AMINO_ACID_IDS.stop, (ch["length"],), generator=g)
                sequences[ch["entity"]] = ids.tolist()
            res, resid, mol = sequences[ch["entity"]], list(range(ch["length"])), MOL_TYPE_IDS["PROTEIN"]
        else:
            res, resid, mol = [_UNK] * ch["length"], [0] * ch["length"], MOL_TYPE_IDS["NONPOLYMER"]
        tok["res"] += res
        tok["resid"] += resid
        tok["asym"] += [asym] * ch["length"]
        tok["entity"] += [ch["entity"]] * ch["length"]
        tok["sym"] += [ch["sym"]] * ch["length"]
        tok["mol"] += [mol] * ch["length"]
        tok["chain_pos"] += list(range(ch["length"]))
    # atoms
    atoms: dict[str, list] = {k: [] for k in ("token", "name", "element", "charge", "backbone", "uid")}
    rep, uid_of = [], {}
    for t in range(n_tok):
        protein = tok["mol"][t] == MOL_TYPE_IDS["PROTEIN"]
        key = (tok["asym"][t], tok["resid"][t])
        uid = uid_of.setdefault(key, len(uid_of))
        start = len(atoms["token"])
        if protein:
            count = _atom_count(tok["res"][t], lo, hi)
            names = list(_PROTEIN_ATOMS[:count])
            elements = [_ELEMENT[nm[0]] for nm in names]
            backbone = [i + 1 if i < 4 else 0 for i in range(count)]
            rep.append(start + (4 if count >= 5 else min(1, count - 1)))
        else:
            count = 1
            z = _LIGAND_ELEMENTS[int(torch.randint(len(_LIGAND_ELEMENTS), (1,), generator=g))]
            names, elements, backbone = [f"{_LIGAND_SYMBOL[z]}{tok['chain_pos'][t] + 1}"], [z], [0]
            rep.append(start)
        charge = torch.multinomial(torch.tensor([0.05, 0.9, 0.05]), count, True, generator=g) - 1
        atoms["token"] += [t] * count
        atoms["name"] += names
        atoms["element"] += elements
        atoms["charge"] += charge.tolist()
        atoms["backbone"] += backbone
        atoms["uid"] += [uid] * count
    # conformers: one per residue (ref_space_uid), centred, rotated, shifted
    uid_t = torch.tensor(atoms["uid"])
    pos = torch.zeros(len(atoms["uid"]), 3, dtype=torch.float64)
    for u in range(len(uid_of)):
        sel = (uid_t == u).nonzero()[:, 0]
        walk = _walk(len(sel), 1.5, g)
        walk = (walk - walk.mean(0)) @ _rotation(g).T
        pos[sel] = walk + torch.randn(1, 3, generator=g, dtype=torch.float64)
    atoms["pos"] = pos
    return {"plan": plan, "tok": tok, "atoms": atoms, "rep": rep}


def _true_backbone(plan: list[dict], g: torch.Generator) -> torch.Tensor:
    parts = []
    for k, ch in enumerate(plan):
        parts.append(_walk(ch["length"], 3.8, g) + torch.tensor([10.0 * k, 0.0, 0.0], dtype=torch.float64))
    return torch.cat(parts)


def synthetic_complex(
    n_tokens: int,
    atoms_per_token: int | tuple[int, int] = (5, 14),
    msa_depth: int = 4,
    templates: int = 2,
    chains: int = 3,
    batch: int = 1,
    seed: int = 0,
    dtype: torch.dtype = torch.float64,
    window: int = 32,
    *,
    n_atoms: int | None = None,
    pad_tokens: bool = True,
    cyclic: bool | None = None,
) -> dict[str, torch.Tensor]:
    """A valid Boltz-2 trunk feature dict for ``batch`` synthetic complexes (see the module doc).

    ``n_tokens`` N (per element, padding included), ``atoms_per_token`` the atoms of a protein
    token (an int, or an inclusive ``(lo, hi)`` range; ligand tokens have one atom),
    ``msa_depth`` S >= 1, ``templates`` T >= 0, ``chains`` >= 1 (one protein chain; with two or
    more the last chain is a ligand; with three or more chains 0 and 1 are copies of one
    protein), ``window`` the atom padding multiple (Boltz's 32 query window), ``n_atoms`` a
    padded atom count (a multiple of ``window``, at least the largest element's atoms; default
    the smallest such), ``pad_tokens`` whether elements b > 0 end with padding tokens, ``cyclic``
    whether the last protein chain (of three or more tokens) is cyclic (default: only when
    ``batch == 1``, because boltz 2.2.1's ``RelativePositionEncoder`` with ``cyclic_pos_enc``
    fails to broadcast ``cyclic_period`` for B > 1 as soon as any period is non-zero).
    Deterministic in ``seed``.
    """
    cyclic = batch == 1 if cyclic is None else cyclic
    lo, hi = (atoms_per_token, atoms_per_token) if isinstance(atoms_per_token, int) else atoms_per_token
    if not 1 <= lo <= hi <= len(_PROTEIN_ATOMS):
        raise ValueError(f"atoms_per_token must lie in [1, {len(_PROTEIN_ATOMS)}], got {atoms_per_token}")
    if msa_depth < 1 or templates < 0 or batch < 1 or chains < 1 or n_tokens < chains:
        raise ValueError(
            f"synthetic_complex needs msa_depth >= 1, templates >= 0, batch >= 1, chains >= 1 and "
            f"n_tokens >= chains; got {msa_depth}, {templates}, {batch}, {chains}, {n_tokens}"
        )
    g = torch.Generator().manual_seed(seed)
    n, s_max, t_max = n_tokens, msa_depth, templates
    elements = []
    for b in range(batch):
        pad = min(b, n // 4, n - chains) if pad_tokens else 0
        elements.append(_element(chains, n - pad, g, lo, hi))
    most = max(len(e["atoms"]["token"]) for e in elements)
    a_pad = -(-most // window) * window
    if n_atoms is not None:
        if n_atoms % window or n_atoms < most:
            raise ValueError(
                f"n_atoms={n_atoms} must be a multiple of {window} and >= {most} (the largest element)"
            )
        a_pad = n_atoms

    f = _allocate(batch, n, a_pad, s_max, t_max, dtype)
    for b, el in enumerate(elements):
        _fill_tokens(f, b, el, g, cyclic, dtype)
        _fill_atoms(f, b, el)
        _fill_msa(f, b, el, max(1, s_max - b), g)
        true_ca = _true_backbone(el["plan"], g)
        for t in range(t_max):
            if t_max >= 2 and t == t_max - 1 and b % 2 == 0:
                n_real = len(el["tok"]["res"])
                f["template_restype"][b, t, :n_real, 0] = 1  # Boltz's dummy template
                continue
            _fill_template(f, b, t, el, true_ca, g)
    return f


def synthetic_sharded(
    grid: ProcessGrid,
    n_tokens: int,
    *args: Any,
    src: int | None = None,
    kinds: Mapping[str, str] | None = None,
    **kwargs: Any,
) -> tuple[dict[str, torch.Tensor] | None, ShardedFeatures]:
    """``(serial dict, ShardedFeatures)``: :func:`synthetic_complex` (same arguments, same seed)
    and its placement on ``grid`` by :func:`twinshard.pair.features.distribute` (collective: call
    it on every rank of ``grid``).

    ``src=None``: every rank draws the dict (deterministic in ``seed``, so every rank holds the
    same) and slices its tiles; every rank returns it. ``src=k``: only rank k draws it and sends
    each rank its tiles; the other ranks never hold a full tensor and return ``None`` as the
    serial dict. ``collect(sharded)`` gives the serial dict back on every rank.
    """
    held = synthetic_complex(n_tokens, *args, **kwargs) if src is None or grid.rank == src else None
    return held, distribute(held, grid, src=src, kinds=kinds)


def _allocate(b: int, n: int, a: int, s: int, t: int, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    i64, z = torch.int64, torch.zeros
    return {
        "token_pad_mask": z(b, n, dtype=dtype),
        "res_type": z(b, n, NUM_TOKENS, dtype=i64),
        "token_index": z(b, n, dtype=i64),
        "residue_index": z(b, n, dtype=i64),
        "asym_id": z(b, n, dtype=i64),
        "entity_id": z(b, n, dtype=i64),
        "sym_id": z(b, n, dtype=i64),
        "mol_type": z(b, n, dtype=i64),
        "method_feature": z(b, n, dtype=i64),
        "modified": z(b, n, dtype=i64),
        "cyclic_period": z(b, n, dtype=dtype),
        "profile": z(b, n, NUM_TOKENS, dtype=dtype),
        "deletion_mean": z(b, n, dtype=dtype),
        "token_bonds": z(b, n, n, 1, dtype=dtype),
        "type_bonds": z(b, n, n, dtype=i64),
        "contact_conditioning": z(b, n, n, NUM_CONTACT_CLASSES, dtype=i64),
        "contact_threshold": z(b, n, n, dtype=dtype),
        "atom_pad_mask": z(b, a, dtype=dtype),
        "ref_pos": z(b, a, 3, dtype=dtype),
        "ref_charge": z(b, a, dtype=dtype),
        "ref_element": z(b, a, NUM_ELEMENTS, dtype=i64),
        "ref_atom_name_chars": z(b, a, ATOM_NAME_CHARS, ATOM_NAME_CLASSES, dtype=i64),
        "ref_space_uid": z(b, a, dtype=i64),
        "atom_backbone_feat": z(b, a, NUM_BACKBONE_FEATS, dtype=i64),
        "atom_to_token": z(b, a, n, dtype=i64),
        "token_to_rep_atom": z(b, n, a, dtype=i64),
        "msa": z(b, s, n, dtype=i64),
        "has_deletion": z(b, s, n, dtype=torch.bool),
        "deletion_value": z(b, s, n, dtype=dtype),
        "msa_paired": z(b, s, n, dtype=dtype),
        "msa_mask": z(b, s, n, dtype=i64),
        "template_restype": z(b, t, n, NUM_TOKENS, dtype=i64),
        "template_frame_rot": z(b, t, n, 3, 3, dtype=dtype),
        "template_frame_t": z(b, t, n, 3, dtype=dtype),
        "template_mask_frame": z(b, t, n, dtype=dtype),
        "template_cb": z(b, t, n, 3, dtype=dtype),
        "template_ca": z(b, t, n, 3, dtype=dtype),
        "template_mask_cb": z(b, t, n, dtype=dtype),
        "template_mask": z(b, t, n, dtype=dtype),
        "visibility_ids": z(b, t, n, dtype=dtype),
    }


def _chain_ranges(plan: list[dict]) -> list[tuple[int, int]]:
    out, start = [], 0
    for ch in plan:
        out.append((start, start + ch["length"]))
        start += ch["length"]
    return out


def _fill_tokens(f: dict, b: int, el: dict, g: torch.Generator, cyclic: bool, dtype: torch.dtype) -> None:
    tok, plan = el["tok"], el["plan"]
    m = len(tok["res"])
    f["token_pad_mask"][b, :m] = 1
    f["res_type"][b, :m] = one_hot(torch.tensor(tok["res"]), NUM_TOKENS)
    f["token_index"][b, :m] = torch.arange(m)
    for key, name in (("resid", "residue_index"), ("asym", "asym_id"), ("entity", "entity_id")):
        f[name][b, :m] = torch.tensor(tok[key])
    f["sym_id"][b, :m] = torch.tensor(tok["sym"])
    f["mol_type"][b, :m] = torch.tensor(tok["mol"])
    f["method_feature"][b, :m] = _METHODS[int(torch.randint(len(_METHODS), (1,), generator=g))]
    protein = torch.tensor(tok["mol"]) == MOL_TYPE_IDS["PROTEIN"]
    f["modified"][b, :m] = ((torch.rand(m, generator=g) < 0.15) & protein).long()
    ranges = _chain_ranges(plan)
    prot = [k for k, ch in enumerate(plan) if ch["kind"] == "protein"]
    cyc = prot[-1] if cyclic and prot and plan[prot[-1]]["length"] >= 3 else None
    # bonds: ligand atoms in a chain, one covalent ligand-protein bond, the cyclic closure
    bonds = []
    for k, ch in enumerate(plan):
        lo, hi = ranges[k]
        if ch["kind"] == "ligand":
            for i in range(lo, hi - 1):
                kind = ("SINGLE", "DOUBLE", "AROMATIC")[int(torch.randint(3, (1,), generator=g))]
                bonds.append((i, i + 1, BOND_TYPE_IDS[kind]))
            if prot:
                p = int(torch.randint(ranges[prot[0]][0], ranges[prot[0]][1], (1,), generator=g))
                bonds.append((p, lo, BOND_TYPE_IDS["COVALENT"]))
    if cyc is not None:
        lo, hi = ranges[cyc]
        f["cyclic_period"][b, lo:hi] = hi - lo
        bonds.append((lo, hi - 1, BOND_TYPE_IDS["COVALENT"]))
    for i, j, kind in bonds:
        f["type_bonds"][b, i, j] = f["type_bonds"][b, j, i] = kind + 1
        f["token_bonds"][b, i, j, 0] = f["token_bonds"][b, j, i, 0] = 1
    # contact classes: UNSELECTED, some UNSPECIFIED, a few constraint classes (pair-symmetric:
    # POCKET>BINDER at (i, j) is BINDER>POCKET at (j, i), CONTACT stays CONTACT)
    r = torch.rand(m, m, generator=g)
    r = torch.minimum(r, r.T)
    cls = torch.full((m, m), CONTACT_IDS["UNSELECTED"])
    cls[r < 0.25] = CONTACT_IDS["UNSPECIFIED"]
    upper = torch.triu(torch.ones(m, m, dtype=torch.bool), 1)
    pick = (r < 0.12) & (upper | upper.T)
    up = torch.randint(2, 5, (m, m), generator=g)
    low = torch.where(up.T == 4, up.T, 5 - up.T)
    cls = torch.where(pick, torch.where(upper, up, low), cls)
    thr = torch.rand(m, m, generator=g, dtype=torch.float64) * 16 + 4
    thr = torch.where(upper, thr, thr.T)
    f["contact_conditioning"][b, :m, :m] = one_hot(cls, NUM_CONTACT_CLASSES)
    f["contact_threshold"][b, :m, :m] = torch.where(pick, thr, torch.zeros_like(thr)).to(dtype)


def _fill_atoms(f: dict, b: int, el: dict) -> None:
    at = el["atoms"]
    k = len(at["token"])
    f["atom_pad_mask"][b, :k] = 1
    f["ref_pos"][b, :k] = at["pos"].to(f["ref_pos"].dtype)
    f["ref_charge"][b, :k] = torch.tensor(at["charge"], dtype=f["ref_charge"].dtype)
    f["ref_element"][b, :k] = one_hot(torch.tensor(at["element"]), NUM_ELEMENTS)
    chars = torch.tensor([_name_chars(nm) for nm in at["name"]])
    f["ref_atom_name_chars"][b, :k] = one_hot(chars, ATOM_NAME_CLASSES)
    f["ref_space_uid"][b, :k] = torch.tensor(at["uid"])
    f["atom_backbone_feat"][b, :k] = one_hot(torch.tensor(at["backbone"]), NUM_BACKBONE_FEATS)
    f["atom_to_token"][b, torch.arange(k), torch.tensor(at["token"])] = 1
    m = len(el["rep"])
    f["token_to_rep_atom"][b, torch.arange(m), torch.tensor(el["rep"])] = 1


def _fill_msa(f: dict, b: int, el: dict, s_real: int, g: torch.Generator) -> None:
    tok, plan = el["tok"], el["plan"]
    m = len(tok["res"])
    query = torch.tensor(tok["res"])
    protein = torch.tensor(tok["mol"]) == MOL_TYPE_IDS["PROTEIN"]
    msa = query.expand(s_real, m).clone()
    u = torch.rand(s_real, m, generator=g)
    rnd = torch.randint(AMINO_ACID_IDS.start, AMINO_ACID_IDS.stop, (s_real, m), generator=g)
    msa = torch.where((u < 0.25) & protein, rnd, msa)
    msa = torch.where((u > 0.9) & protein, torch.full_like(msa, TOKEN_IDS["-"]), msa)
    dels = torch.randint(1, 11, (s_real, m), generator=g) * (
        (torch.rand(s_real, m, generator=g) < 0.2) & protein
    )
    msa[0], dels[0] = query, 0
    ranges = _chain_ranges(plan)
    paired = torch.zeros(s_real, m)
    for k, ch in enumerate(plan):
        flag = (torch.rand(s_real, 1, generator=g) < 0.5).float() if ch["kind"] == "protein" else 0.0
        paired[:, ranges[k][0] : ranges[k][1]] = flag
    paired[0] = 1.0
    dv = math.pi / 2 * torch.atan(dels.to(torch.float64) / 3)
    dt = f["deletion_value"].dtype
    f["msa"][b, :s_real, :m] = msa
    f["has_deletion"][b, :s_real, :m] = dels > 0
    f["deletion_value"][b, :s_real, :m] = dv.to(dt)
    f["msa_paired"][b, :s_real, :m] = paired.to(dt)
    f["msa_mask"][b, :s_real, :m] = 1
    f["profile"][b, :m] = one_hot(msa, NUM_TOKENS).to(torch.float64).mean(0).to(dt)
    f["deletion_mean"][b, :m] = dv.mean(0).to(dt)


def _fill_template(f: dict, b: int, t: int, el: dict, true_ca: torch.Tensor, g: torch.Generator) -> None:
    tok, plan = el["tok"], el["plan"]
    ranges = _chain_ranges(plan)
    prot = [k for k, ch in enumerate(plan) if ch["kind"] == "protein"]
    take = torch.rand(len(prot), generator=g) < 0.7
    if not bool(take.any()):
        take[int(torch.randint(len(prot), (1,), generator=g))] = True
    covered_chains = [k for k, keep in zip(prot, take.tolist()) if keep]
    m = len(tok["res"])
    dt = f["template_ca"].dtype
    restype = torch.zeros(m, dtype=torch.int64)
    vis = torch.tensor([-1.0 - a for a in tok["asym"]], dtype=torch.float64)
    for k in covered_chains:
        lo, hi = ranges[k]
        length = hi - lo
        start = int(torch.randint(0, max(1, length // 3), (1,), generator=g))
        stop = hi - int(torch.randint(0, max(1, length // 3), (1,), generator=g))
        vis[lo:hi] = float(t)
        for i in range(lo + start, max(stop, lo + start + 1)):
            mutate = bool(torch.rand(1, generator=g) < 0.2)
            aa = int(torch.randint(AMINO_ACID_IDS.start, AMINO_ACID_IDS.stop, (1,), generator=g))
            restype[i] = aa if mutate else tok["res"][i]
            ca = true_ca[i] + 0.5 * torch.randn(3, generator=g, dtype=torch.float64)
            n_at = ca + _unit(g) * 1.46
            c_at = ca + _unit(g) * 1.52
            e1 = (c_at - ca) / (c_at - ca).norm()
            u2 = (n_at - ca) - ((n_at - ca) @ e1) * e1
            e2 = u2 / u2.norm()
            rot = torch.stack([e1, e2, torch.linalg.cross(e1, e2)], dim=-1)
            f["template_frame_rot"][b, t, i] = rot.to(dt)
            f["template_frame_t"][b, t, i] = ca.to(dt)
            f["template_ca"][b, t, i] = ca.to(dt)
            f["template_cb"][b, t, i] = (ca + _unit(g) * 1.53).to(dt)
            f["template_mask_frame"][b, t, i] = float(torch.rand(1, generator=g) < 0.9)
            f["template_mask_cb"][b, t, i] = float(torch.rand(1, generator=g) < 0.9)
            f["template_mask"][b, t, i] = 1.0
    f["template_restype"][b, t, :m] = one_hot(restype, NUM_TOKENS)
    f["visibility_ids"][b, t, :m] = vis.to(dt)


def _unit(g: torch.Generator) -> torch.Tensor:
    v = torch.randn(3, generator=g, dtype=torch.float64)
    return v / v.norm()


def synthetic_training_features(
    feats: Mapping[str, torch.Tensor],
    seed: int = 0,
    unresolved: float = 0.15,
    num_bins: int = 64,
) -> dict[str, torch.Tensor]:
    """The training features Boltz-2's featuriser adds to a :func:`synthetic_complex` dict
    ``feats`` (returned as a new dict of the EXTRA keys only, Boltz's shapes and dtypes):

    - ``coords [B, K=1, A, 3]``: a true structure (chains as 3.8 A random walks 10 A apart, a
      token's atoms within ~1.5 A of it; a ligand chain a 1.5 A walk), with Boltz's centring on
      the resolved atoms; unresolved atoms sit at the origin before the centring, padding at 0;
    - ``atom_resolved_mask [B, A]`` bool: each real atom unresolved with probability
      ``unresolved``, but ligand chains: all resolved for 3 atoms (a valid recomputed frame),
      exactly one unresolved for 4 or more; one protein centre atom always unresolved (where
      the element has two or more); padding False;
    - ``token_to_center_atom [B, N, A]``: CA (a protein token's second atom; its only atom for a
      one-atom token), a ligand token's atom;
    - ``r_set_to_rep_atom [B, N, A]``: one row per resolved polymer token (centre atom resolved)
      in token order, holding its centre atom; zero rows after them (N_R padded to N);
    - ``frames_idx [B, K=1, N, 3]`` and ``frame_resolved_mask [B, K=1, N]`` (bool): a protein
      token of >= 3 atoms has the frame (N, CA, C) = its atoms 0, 1, 2; other tokens (start,
      start, start); a non-polymer chain of >= 3 atoms gets the nearest-resolved-neighbour
      frames of the true coordinates (Boltz's ``compute_frames_nonpolymer``); resolved where
      the three frame atoms are resolved (0 for the degenerate ones) and the frame is not
      collinear on the true coordinates; padding tokens 0;
    - ``disto_target [B, N, N, K=1, num_bins]``: one-hot distance bins (2-22 A) of the true
      representative atoms (``token_to_rep_atom``), zero on padding tokens;
      ``token_disto_mask [B, N]``: real tokens whose representative atom is resolved.

    Deterministic in ``seed``. Works on any dict with Boltz's token/atom features (the mol_type
    may name DNA/RNA chains: their tokens are polymer tokens)."""
    from twinshard.pair.reference.confidence import NONPOLYMER, collinear_mask, compute_frame_pred
    from twinshard.pair.reference.distogram import distogram_target

    g = torch.Generator().manual_seed(seed)
    a2t = feats["atom_to_token"]
    bsz, a, n = a2t.shape
    dt = feats["ref_pos"].dtype
    mol, asym = feats["mol_type"], feats["asym_id"]
    real_tok, real_atom = feats["token_pad_mask"] > 0, feats["atom_pad_mask"] > 0
    coords = torch.zeros(bsz, a, 3, dtype=torch.float64)
    resolved = torch.zeros(bsz, a, dtype=torch.bool)
    center = torch.zeros(bsz, n, a, dtype=torch.int64)
    frames = torch.zeros(bsz, n, 3, dtype=torch.int64)
    for b in range(bsz):
        owner = torch.where(real_atom[b], a2t[b].argmax(-1), -1)
        chains = torch.unique(asym[b][real_tok[b]]).tolist()
        for k, cid in enumerate(chains):
            toks = ((asym[b] == cid) & real_tok[b]).nonzero()[:, 0].tolist()
            ligand = int(mol[b, toks[0]]) == NONPOLYMER
            walk = _walk(len(toks), 1.5 if ligand else 3.8, g) + torch.tensor(
                [10.0 * k, 0.0, 0.0], dtype=torch.float64
            )
            for i, t in enumerate(toks):
                atoms = (owner == t).nonzero()[:, 0]
                coords[b, atoms] = walk[i] + (
                    0.0 if ligand else 1.5 * torch.randn(len(atoms), 3, generator=g, dtype=torch.float64)
                )
                s0 = int(atoms[0])
                center[b, t, s0 + (1 if len(atoms) >= 2 and not ligand else 0)] = 1
                if not ligand and len(atoms) >= 3:
                    frames[b, t] = torch.tensor([s0, s0 + 1, s0 + 2])
                else:
                    frames[b, t] = s0
        resolved[b] = real_atom[b] & (torch.rand(a, generator=g) >= unresolved)
        for cid in chains:  # ligand chains: 3 atoms all resolved (a valid recomputed frame), more
            own = real_atom[b] & (asym[b].gather(0, owner.clamp(min=0)) == cid)  # atoms: one not
            atoms = own.nonzero()[:, 0]
            if int(mol[b, int(owner[atoms[0]])]) == NONPOLYMER:
                resolved[b, atoms] = True
                if len(atoms) >= 4:
                    resolved[b, atoms[int(torch.randint(len(atoms), (1,), generator=g))]] = False
        ca = center[b].argmax(-1)[real_tok[b] & (mol[b] != NONPOLYMER)]
        if len(ca) >= 2:
            resolved[b, ca[int(torch.randint(len(ca), (1,), generator=g))]] = False
    coords = coords * resolved[..., None]
    mean = (coords * resolved[..., None]).sum(1) / resolved.sum(1).clamp(min=1)[:, None]
    coords = (coords - mean[:, None]) * real_atom[..., None]
    # non-polymer chains of >= 3 atoms: frames from the true coordinates (nearest resolved)
    f = {k: feats[k] for k in ("asym_id", "atom_to_token", "token_pad_mask", "atom_pad_mask", "mol_type")}
    f["frames_idx"] = frames
    redone, _ = compute_frame_pred(coords, f, 1, resolved=resolved)
    polymer3 = frames[..., 0] != frames[..., 1]  # the (N, CA, C) frames set above
    lig = mol == NONPOLYMER
    chain_atoms = a2t.sum(1)  # [B, N]: atoms per token
    for b in range(bsz):
        for cid in torch.unique(asym[b][real_tok[b]]).tolist():
            sel = (asym[b] == cid) & real_tok[b]
            if not bool(lig[b, sel].all()) or int(chain_atoms[b, sel].sum()) < 3:
                lig[b, sel] = False  # a ligand chain of < 3 atoms keeps its degenerate frames
    bi = torch.arange(bsz)[:, None, None]
    frame_ok = resolved[bi, redone].all(-1) & (polymer3 | lig)
    fx = coords[bi, redone]
    frame_ok = frame_ok & collinear_mask(fx[:, :, 1] - fx[:, :, 0], fx[:, :, 1] - fx[:, :, 2]) & real_tok
    # the R set: resolved polymer tokens' centre atoms, in token order, padded to N rows
    rset = torch.zeros(bsz, n, a, dtype=torch.int64)
    for b in range(bsz):
        rows = [
            t
            for t in range(n)
            if real_tok[b, t] and int(mol[b, t]) != NONPOLYMER and bool(resolved[b, center[b, t].argmax()])
        ]
        for k, t in enumerate(rows):
            rset[b, k] = center[b, t]
    rep = feats["token_to_rep_atom"].to(torch.float64) @ coords  # [B, N, 3]
    disto = distogram_target(rep, num_bins) * (real_tok[:, :, None] & real_tok[:, None, :])[..., None, None]
    rep_res = (feats["token_to_rep_atom"].to(torch.float64) @ resolved[..., None].to(torch.float64))[..., 0]
    return {
        "coords": coords.to(dt)[:, None],
        "atom_resolved_mask": resolved,
        "token_to_center_atom": center,
        "r_set_to_rep_atom": rset,
        "frames_idx": redone[:, None],
        "frame_resolved_mask": frame_ok[:, None],
        "disto_target": disto.to(dt),
        "token_disto_mask": ((rep_res > 0) & real_tok).to(dt),
    }
