"""The files ``twinshard predict`` writes: structures (mmCIF or PDB, through gemmi) and confidence.

Serial and torch.distributed-free: the caller (rank 0) hands full tensors. The layout mirrors
boltz's own writer (boltz 2.2.1 ``data/write/writer.py`` ``BoltzWriter``), under ``out_dir``::

    predictions/<record>/<record>_model_<k>.cif        (or .pdb)
    predictions/<record>/confidence_<record>_model_<k>.json
    predictions/<record>/plddt_<record>_model_<k>.npz  (key "plddt")
    predictions/<record>/pae_<record>_model_<k>.npz    (key "pae", when given)
    predictions/<record>/pde_<record>_model_<k>.npz    (key "pde", when given)

where ``k`` is the sample's rank: samples sorted by ``confidence_score``, highest first (Boltz's
ranking; sample order when there is no score). The JSON holds Boltz's keys (those present, in
Boltz's order): ``confidence_score``, ``ptm``, ``iptm``, ``ligand_iptm``, ``protein_iptm``,
``complex_plddt``, ``complex_iplddt``, ``complex_pde``, ``complex_ipde``, ``chains_ptm`` (the
diagonal of ``pair_chains_iptm``) and ``pair_chains_iptm`` (chain index -> chain index -> value;
JSON writes the indices as strings, as Boltz's does). Two differences from Boltz: the npz arrays
are cut to the real tokens (Boltz writes them as padded; without padding tokens, as in a B = 1
prediction, they are the same), and files only hold what is given (Boltz needs every key).

The structure comes from the Boltz-2 feature dict (``twinshard.pair.feature_contract``) of one
batch element: chains from ``asym_id`` (asym id k is chain ``chain_name(k)``: A, B, ..., Z, AA,
AB, ...), residues from consecutive real tokens of one (``asym_id``, ``residue_index``) (every atom
token of a ligand shares one residue, as in Boltz's tokenizer), residue number
``residue_index + 1`` and name :data:`RESIDUE_NAMES` ``[argmax res_type]`` for polymer tokens, ``LIG``
for non-polymer ones (written HETATM; Boltz's PDB writer names every ligand ``LIG`` too: the
features do not carry CCD codes), atoms from ``atom_to_token`` in atom order with names decoded
from ``ref_atom_name_chars`` (4 characters one-hot over 64, ``ord(c) - 32``, 0 = end: Boltz's
``convert_atom_name``) and elements from ``ref_element`` (one-hot by atomic number); padding atoms
(``atom_pad_mask`` 0) and padding tokens are skipped. Entities follow ``entity_id`` (polymer type
from ``mol_type``). B-factor: pLDDT x 100 when given (per token as Boltz-2's confidence gives it, so
every atom of a token carries the token's value, as Boltz's writer does; or per atom), else 100.

Precision read back with gemmi 0.7.5: PDB coordinates to 3 decimals and B-factors to 2 (its
columns); mmCIF coordinates to 9 significant digits and B-factors to 6 (gemmi's number format).
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch

from twinshard.pair.feature_contract import ATOM_NAME_CHARS, ATOM_NAME_CLASSES, MOL_TYPE_IDS, NUM_TOKENS

__all__ = [
    "CONFIDENCE_KEYS",
    "LIGAND_NAME",
    "RESIDUE_NAMES",
    "chain_name",
    "confidence_score",
    "decode_atom_names",
    "encode_atom_name",
    "prediction_paths",
    "ranking",
    "summary_of",
    "write_arrays",
    "write_confidence",
    "write_prediction",
    "write_structure",
]

# Boltz's token classes (boltz.data.const.tokens, 33; tests/interop/test_output_const.py checks it):
# padding, gap, the 20 amino acids and UNK, RNA A G C U N, DNA DA DG DC DT DN.
# fmt: off
RESIDUE_NAMES: tuple[str, ...] = (
    "<pad>", "-",
    "ALA", "ARG", "ASN", "ASP", "CYS", "GLN", "GLU", "GLY", "HIS", "ILE",
    "LEU", "LYS", "MET", "PHE", "PRO", "SER", "THR", "TRP", "TYR", "VAL", "UNK",
    "A", "G", "C", "U", "N",
    "DA", "DG", "DC", "DT", "DN",
)
# fmt: on
assert len(RESIDUE_NAMES) == NUM_TOKENS
LIGAND_NAME = "LIG"
# The summary keys of Boltz's confidence JSON, in its order (then chains_ptm, pair_chains_iptm).
CONFIDENCE_KEYS = (
    "confidence_score",
    "ptm",
    "iptm",
    "ligand_iptm",
    "protein_iptm",
    "complex_plddt",
    "complex_iplddt",
    "complex_pde",
    "complex_ipde",
)
_ARRAYS = ("plddt", "pae", "pde")
_FORMATS = {"cif": ".cif", "mmcif": ".cif", "pdb": ".pdb"}


def _gemmi() -> Any:
    try:
        import gemmi
    except ImportError as e:  # an optional extra
        raise ImportError("writing structures needs gemmi: pip install -e '.[predict]' (gemmi==0.7.5)") from e
    return gemmi


def chain_name(asym_id: int) -> str:
    """Chain name of asym id k: A..Z, then AA, AB, ... (spreadsheet columns)."""
    if asym_id < 0:
        raise ValueError(f"asym_id must be >= 0, got {asym_id}")
    name, k = "", asym_id + 1
    while k:
        k, r = divmod(k - 1, 26)
        name = chr(ord("A") + r) + name
    return name


def encode_atom_name(name: str) -> list[int]:
    """Boltz's ``convert_atom_name``: stripped, 4 classes ``ord(c) - 32``, 0-padded (class ids)."""
    name = name.strip()
    if not 1 <= len(name) <= ATOM_NAME_CHARS or any(not 33 <= ord(c) < 32 + ATOM_NAME_CLASSES for c in name):
        raise ValueError(f"atom name {name!r} cannot be encoded (1-{ATOM_NAME_CHARS} characters ! .. _)")
    return [ord(c) - 32 for c in name] + [0] * (ATOM_NAME_CHARS - len(name))


def decode_atom_names(chars: torch.Tensor) -> list[str]:
    """Names from ``ref_atom_name_chars`` ``[A, 4, 64]`` one-hots (class 0 ends the name)."""
    if chars.dim() != 3 or tuple(chars.shape[1:]) != (ATOM_NAME_CHARS, ATOM_NAME_CLASSES):
        raise ValueError(
            f"ref_atom_name_chars must be [A, {ATOM_NAME_CHARS}, {ATOM_NAME_CLASSES}], got {list(chars.shape)}"
        )
    codes = chars.argmax(-1).tolist()
    return ["".join(chr(c + 32) for c in row).split(" ")[0] for row in codes]


def _as_tensor(x: Any, what: str) -> torch.Tensor:
    try:
        return torch.as_tensor(x).detach().cpu()
    except (TypeError, ValueError, RuntimeError) as e:
        raise TypeError(f"{what} must be a tensor or array, got {type(x).__name__}") from e


def _element_features(feats: Mapping[str, Any], element: int) -> dict[str, torch.Tensor]:
    need = (
        "token_pad_mask",
        "res_type",
        "residue_index",
        "asym_id",
        "entity_id",
        "mol_type",
        "atom_pad_mask",
        "atom_to_token",
        "ref_atom_name_chars",
        "ref_element",
    )
    missing = [k for k in need if k not in feats]
    if missing:
        raise KeyError(f"write_structure: the feature dict lacks {missing}")
    batch = int(feats["asym_id"].shape[0])
    if not 0 <= element < batch:
        raise IndexError(f"write_structure: batch element {element} out of range for a batch of {batch}")
    return {k: _as_tensor(feats[k], k)[element] for k in need}


class _Layout:
    """The atoms, residues and chains of one element, read from its features once."""

    def __init__(self, feats: Mapping[str, Any], element: int) -> None:
        f = _element_features(feats, element)
        real_tok = f["token_pad_mask"] > 0.5
        self.atoms = (f["atom_pad_mask"] > 0.5).nonzero()[:, 0]  # real atoms, in atom order
        self.n_atoms, self.n_tokens = int(f["atom_pad_mask"].shape[0]), int(real_tok.shape[0])
        a2t = f["atom_to_token"][self.atoms]
        if a2t.shape[-1] != self.n_tokens or (a2t.sum(-1) != 1).any():
            raise ValueError("atom_to_token: every real atom must map to exactly one token")
        self.token = a2t.argmax(-1)
        if not bool(real_tok[self.token].all()):
            raise ValueError("atom_to_token maps a real atom to a padding token")
        elem = f["ref_element"][self.atoms]
        if (elem.sum(-1) != 1).any() or (elem.argmax(-1) == 0).any():
            raise ValueError("ref_element: every real atom needs one element (atomic number >= 1)")
        self.element = elem.argmax(-1).tolist()
        self.name = decode_atom_names(f["ref_atom_name_chars"][self.atoms])
        if any(not n for n in self.name):
            raise ValueError("ref_atom_name_chars: a real atom has an empty name")
        self.res_type = f["res_type"].argmax(-1).tolist()
        for key in ("residue_index", "asym_id", "entity_id", "mol_type"):
            setattr(self, key, f[key].tolist())
        self.real_token = real_tok.tolist()

    def residues(self) -> list[tuple[int, int, list[int]]]:
        """(asym, first token, positions into self.atoms) per residue, in atom order."""
        out: list[tuple[int, int, list[int]]] = []
        key_prev = None
        for pos, t in enumerate(self.token.tolist()):
            key = (self.asym_id[t], self.residue_index[t], self.mol_type[t] == MOL_TYPE_IDS["NONPOLYMER"])
            if key != key_prev:
                out.append((self.asym_id[t], t, []))
                key_prev = key
            out[-1][2].append(pos)
        seen: set[tuple[int, int]] = set()
        for asym, t, _ in out:
            key = (asym, self.residue_index[t])
            if key in seen:
                raise ValueError(
                    f"the atoms of residue {self.residue_index[t]} of chain {chain_name(asym)} are not "
                    "contiguous (atoms must follow token order, as Boltz's featuriser lays them out)"
                )
            seen.add(key)
        return out


def _bfactors(plddt: Any, layout: _Layout, plddt_per: str | None) -> list[float]:
    p = _as_tensor(plddt, "plddt").to(torch.float64)
    if p.dim() != 1 or p.shape[0] not in (layout.n_tokens, layout.n_atoms):
        raise ValueError(
            f"plddt must be [N={layout.n_tokens}] (per token) or [A={layout.n_atoms}] (per atom), "
            f"got {list(p.shape)}"
        )
    if plddt_per is None:
        if layout.n_tokens == layout.n_atoms:
            raise ValueError(f"plddt of length {p.shape[0]} is ambiguous (N == A): pass plddt_per")
        plddt_per = "token" if p.shape[0] == layout.n_tokens else "atom"
    if plddt_per == "token":
        if p.shape[0] != layout.n_tokens:
            raise ValueError(f"plddt per token must be [N={layout.n_tokens}], got {list(p.shape)}")
        p = p[layout.token]
    elif plddt_per == "atom":
        if p.shape[0] != layout.n_atoms:
            raise ValueError(f"plddt per atom must be [A={layout.n_atoms}], got {list(p.shape)}")
        p = p[layout.atoms]
    else:
        raise ValueError(f"plddt_per must be 'token', 'atom' or None, got {plddt_per!r}")
    if not bool(torch.isfinite(p).all()):
        raise ValueError("plddt has non-finite values on real atoms")
    return (100.0 * p).tolist()


_POLYMER = {"PROTEIN": "PeptideL", "DNA": "Dna", "RNA": "Rna"}


def _structure(layout: _Layout, coords: torch.Tensor, bfac: list[float] | None, name: str) -> Any:
    gemmi = _gemmi()
    ligand = MOL_TYPE_IDS["NONPOLYMER"]
    xyz = coords[layout.atoms].tolist()
    model = gemmi.Model(1)
    chains: dict[int, Any] = {}
    entities: dict[int, Any] = {}
    for asym, t, positions in layout.residues():
        if asym not in chains:
            chains[asym] = gemmi.Chain(chain_name(asym))
        het = layout.mol_type[t] == ligand
        res = gemmi.Residue()
        res.name = LIGAND_NAME if het else RESIDUE_NAMES[layout.res_type[t]]
        res.seqid = gemmi.SeqId(layout.residue_index[t] + 1, " ")
        res.het_flag = "H" if het else "A"
        res.subchain = chain_name(asym)
        res.entity_type = gemmi.EntityType.NonPolymer if het else gemmi.EntityType.Polymer
        if not het:
            res.label_seq = layout.residue_index[t] + 1
        for pos in positions:
            atom = gemmi.Atom()
            atom.name = layout.name[pos]
            atom.element = gemmi.Element(layout.element[pos])
            atom.pos = gemmi.Position(*xyz[pos])
            atom.occ = 1.0
            atom.b_iso = 100.0 if bfac is None else bfac[pos]
            res.add_atom(atom)
        chains[asym].add_residue(res)
        ent = layout.entity_id[t]
        if ent not in entities:
            e = gemmi.Entity(str(ent + 1))
            e.entity_type = res.entity_type
            if not het:
                kind = next(k for k, v in MOL_TYPE_IDS.items() if v == layout.mol_type[t])
                e.polymer_type = getattr(gemmi.PolymerType, _POLYMER[kind])
            entities[ent] = (e, asym, [])
        e, first, seq = entities[ent]
        if asym == first:
            seq.append(res.name)
        if chain_name(asym) not in e.subchains:
            e.subchains = [*e.subchains, chain_name(asym)]
    for asym in sorted(chains):
        model.add_chain(chains[asym])
    st = gemmi.Structure()
    st.name = name
    st.add_model(model)
    for e, _, seq in entities.values():
        if e.entity_type == gemmi.EntityType.Polymer:
            e.full_sequence = seq
        st.entities.append(e)
    return st


def write_structure(
    path: str | Path,
    feats: Mapping[str, Any],
    coords: Any,
    plddt: Any = None,
    fmt: str = "cif",
    *,
    element: int = 0,
    plddt_per: str | None = None,
    name: str | None = None,
) -> Path:
    """Write one sample of batch element ``element`` as mmCIF (``fmt="cif"``) or PDB (``"pdb"``).

    ``feats``: a Boltz-2 feature dict ``[B, ...]``; ``coords``: ``[A, 3]`` (A the padded atom
    count; padding rows are ignored, real rows must be finite); ``plddt`` in [0, 1], ``[N]`` per
    token (Boltz-2's) or ``[A]`` per atom (``plddt_per`` says which when N == A); ``name`` the data
    block / structure name (default: the file stem). Returns the path.
    """
    if fmt not in _FORMATS:
        raise ValueError(f"fmt must be one of {sorted(_FORMATS)}, got {fmt!r}")
    return _write(Path(path), _Layout(feats, element), coords, plddt, fmt, plddt_per, name)


def _write(
    path: Path, layout: _Layout, coords: Any, plddt: Any, fmt: str, plddt_per: str | None, name: str | None
) -> Path:
    c = _as_tensor(coords, "coords")
    if c.dim() != 2 or tuple(c.shape) != (layout.n_atoms, 3):
        raise ValueError(f"coords must be [A={layout.n_atoms}, 3] (one sample), got {list(c.shape)}")
    c = c.to(torch.float64)
    if not bool(torch.isfinite(c[layout.atoms]).all()):
        raise ValueError("coords has non-finite values on real atoms")
    bfac = None if plddt is None else _bfactors(plddt, layout, plddt_per)
    st = _structure(layout, c, bfac, name or path.stem)
    if _FORMATS[fmt] == ".pdb":
        long = [ch.name for ch in st[0] if len(ch.name) > 2]
        if long:
            raise ValueError(f"PDB holds chain names of at most 2 characters, not {long[:3]}: use mmCIF")
        if any(not -1000 < v < 10000 for v in c[layout.atoms].flatten().tolist()):
            raise ValueError("PDB holds coordinates in (-1000, 10000) only (its 8.3f columns): use mmCIF")
        opts = _gemmi().PdbWriteOptions()
        opts.cryst1_record = False
        path.write_text(st.make_pdb_string(opts))
    else:
        groups = _gemmi().MmcifOutputGroups(True)
        groups.cell = groups.symmetry = False
        st.make_mmcif_document(groups).write_file(str(path))
    return path


# ---- confidence -------------------------------------------------------------------------------


def confidence_score(confidence: Mapping[str, Any]) -> torch.Tensor:
    """Boltz-2's ranking score per sample (``Boltz2.predict_step``): (4 complex_plddt + ipTM) / 5,
    with pTM in place of ipTM when ipTM is zero for every sample (a single chain)."""
    plddt = _as_tensor(confidence["complex_plddt"], "complex_plddt")
    iptm = _as_tensor(confidence["iptm"], "iptm")
    inter = iptm if not torch.allclose(iptm, torch.zeros_like(iptm)) else _as_tensor(confidence["ptm"], "ptm")
    return (4 * plddt + inter) / 5


def _samples(confidence: Mapping[str, Any]) -> int | None:
    """The common leading (sample) size of the confidence entries; None when there are none."""
    shapes = {k: _as_tensor(confidence[k], k).shape for k in (*CONFIDENCE_KEYS, *_ARRAYS) if k in confidence}
    for c1, row in (confidence.get("pair_chains_iptm") or {}).items():
        for c2, v in row.items():
            shapes[f"pair_chains_iptm[{c1}][{c2}]"] = _as_tensor(v, "pair_chains_iptm").shape
    counts = {k: (s[0] if len(s) else None) for k, s in shapes.items()}
    if None in counts.values() or len(set(counts.values())) > 1:
        raise ValueError(f"confidence: every entry needs the same leading sample dimension; got {counts}")
    return next(iter(counts.values()), None)


def ranking(confidence: Mapping[str, Any] | None, samples: int) -> list[int]:
    """``rank[j]``: the model number of sample j (0 = best ``confidence_score``; sample order
    without a score), as Boltz's writer ranks (a stable descending sort)."""
    if confidence and "confidence_score" in confidence:
        score = _as_tensor(confidence["confidence_score"], "confidence_score")
        if tuple(score.shape) != (samples,):
            raise ValueError(f"confidence_score must be [{samples}], got {list(score.shape)}")
        order = torch.argsort(score, descending=True, stable=True).tolist()
        return [order.index(j) for j in range(samples)]
    return list(range(samples))


def summary_of(confidence: Mapping[str, Any], sample: int) -> dict[str, Any]:
    """Boltz's confidence JSON dict of one sample: the scalars present (Boltz's order), then
    ``chains_ptm`` and ``pair_chains_iptm`` when ``pair_chains_iptm`` is given."""
    n = _samples(confidence)
    if n is None:
        raise ValueError(f"confidence holds none of {CONFIDENCE_KEYS + _ARRAYS} or pair_chains_iptm")
    if not 0 <= sample < n:
        raise IndexError(f"sample {sample} out of range: the confidence holds {n} samples")
    out: dict[str, Any] = {}
    for key in CONFIDENCE_KEYS:
        if key in confidence:
            v = _as_tensor(confidence[key], key)
            if v.dim() != 1:
                raise ValueError(f"confidence[{key!r}] must be [samples], got {list(v.shape)}")
            out[key] = float(v[sample])
    pci = confidence.get("pair_chains_iptm")
    if pci:
        out["chains_ptm"] = {int(c): float(_as_tensor(pci[c][c], "pair_chains_iptm")[sample]) for c in pci}
        out["pair_chains_iptm"] = {
            int(c1): {int(c2): float(_as_tensor(v, "pair_chains_iptm")[sample]) for c2, v in row.items()}
            for c1, row in pci.items()
        }
    return out


def write_confidence(path: str | Path, figures: Mapping[str, Any]) -> Path:
    """Write one sample's confidence figures (:func:`summary_of`) as Boltz's JSON (indent 4)."""

    def plain(v: Any) -> Any:
        if isinstance(v, Mapping):
            return {(k if isinstance(k, str) else int(k)): plain(x) for k, x in v.items()}
        f = float(v)
        if not math.isfinite(f):
            raise ValueError(f"confidence figures must be finite, got {f}")
        return f

    path = Path(path)
    path.write_text(json.dumps({k: plain(v) for k, v in figures.items()}, indent=4))
    return path


def write_arrays(path: str | Path, **arrays: Any) -> Path:
    """``np.savez_compressed(path, name=array, ...)`` of tensors or arrays (Boltz's npz files)."""
    if not arrays:
        raise ValueError("write_arrays needs at least one array")
    path = Path(path)
    np.savez_compressed(path, **{k: _as_tensor(v, k).numpy() for k, v in arrays.items()})
    return path


# ---- a whole prediction -----------------------------------------------------------------------


def prediction_paths(out_dir: str | Path, record: str, rank: int, fmt: str = "cif") -> dict[str, Path]:
    """The files of model ``rank`` of ``record`` under ``out_dir`` (Boltz's layout)."""
    if fmt not in _FORMATS:
        raise ValueError(f"fmt must be one of {sorted(_FORMATS)}, got {fmt!r}")
    d = Path(out_dir) / "predictions" / record
    tag = f"{record}_model_{rank}"
    paths = {"structure": d / f"{tag}{_FORMATS[fmt]}", "confidence": d / f"confidence_{tag}.json"}
    paths.update({key: d / f"{key}_{tag}.npz" for key in _ARRAYS})
    return paths


def write_prediction(
    out_dir: str | Path,
    record: str,
    feats: Mapping[str, Any],
    coords: Any,
    confidence: Mapping[str, Any] | None = None,
    fmt: str = "cif",
    *,
    element: int = 0,
) -> list[dict[str, Path]]:
    """Write every sample of batch element ``element`` in Boltz's layout (module doc).

    ``coords`` ``[samples, A, 3]``; ``confidence`` (optional) a dict of per-sample tensors with
    Boltz's keys: figures ``[samples]``, ``plddt`` ``[samples, N]`` (also the B-factors), ``pae``
    and ``pde`` ``[samples, N, N]``, ``pair_chains_iptm[c1][c2]`` ``[samples]``. Ranked by
    ``confidence_score`` when present (see :func:`confidence_score` to add it). Returns, per
    sample in input order, the paths written (keys ``structure``, ``confidence``, ``plddt``,
    ``pae``, ``pde``; only those written).
    """
    if not record or any(c in record for c in "/\\") or record in (".", ".."):
        raise ValueError(f"record must be a plain file name, got {record!r}")
    if fmt not in _FORMATS:
        raise ValueError(f"fmt must be one of {sorted(_FORMATS)}, got {fmt!r}")
    layout = _Layout(feats, element)
    c = _as_tensor(coords, "coords")
    if c.dim() != 3 or tuple(c.shape[1:]) != (layout.n_atoms, 3):
        raise ValueError(f"coords must be [samples, A={layout.n_atoms}, 3], got {list(c.shape)}")
    samples = int(c.shape[0])
    if samples < 1:
        raise ValueError("coords holds no sample")
    finite = torch.isfinite(c[:, layout.atoms]).flatten(1).all(1)
    if not bool(finite.all()):
        raise ValueError(
            f"coords has non-finite values on real atoms of samples {(~finite).nonzero()[:, 0].tolist()}"
        )
    conf = dict(confidence or {})
    n_conf = _samples(conf) if conf else None
    if n_conf is not None and n_conf != samples:
        raise ValueError(f"confidence holds {n_conf} samples, coords {samples}")
    n = layout.n_tokens
    for key, dims in (("plddt", (samples, n)), ("pae", (samples, n, n)), ("pde", (samples, n, n))):
        if key in conf and tuple(_as_tensor(conf[key], key).shape) != dims:
            raise ValueError(
                f"confidence[{key!r}] must be {list(dims)}, got {list(_as_tensor(conf[key], key).shape)}"
            )
    rank = ranking(conf, samples)
    real = torch.tensor(layout.real_token, dtype=torch.bool)
    written = []
    for j in range(samples):
        paths = prediction_paths(out_dir, record, rank[j], fmt)
        paths["structure"].parent.mkdir(parents=True, exist_ok=True)
        plddt = _as_tensor(conf["plddt"], "plddt")[j] if "plddt" in conf else None
        _write(paths["structure"], layout, c[j], plddt, fmt, "token", None)
        done = {"structure": paths["structure"]}
        if any(k in conf for k in CONFIDENCE_KEYS) or conf.get("pair_chains_iptm"):
            done["confidence"] = write_confidence(paths["confidence"], summary_of(conf, j))
        for key in _ARRAYS:
            if key in conf:
                a = _as_tensor(conf[key], key)[j]
                a = a[real] if key == "plddt" else a[real][:, real]
                done[key] = write_arrays(paths[key], **{key: a})
        written.append(done)
    return written
