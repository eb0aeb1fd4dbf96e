"""The prediction writer (``twinshard.pair.output``), read back with gemmi (main environment).

The expected chains, residues, atoms, names, elements, coordinates and B-factors are derived here
from the feature dict directly (not through the writer's own layout code); the residue-name table
itself is checked against boltz in tests/interop/test_output_const.py.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from twinshard.pair.output import (
    RESIDUE_NAMES,
    chain_name,
    confidence_score,
    prediction_paths,
    ranking,
    summary_of,
    write_confidence,
    write_prediction,
    write_structure,
)
from twinshard.pair.synthetic import synthetic_complex

gemmi = pytest.importorskip("gemmi", reason="gemmi is not installed: pip install -e '.[predict]'")

NONPOLYMER = 3


def expected_atoms(f: dict, b: int = 0) -> list[dict]:
    """One dict per real atom, in atom order, straight from the features."""
    out = []
    for i in (f["atom_pad_mask"][b] > 0).nonzero()[:, 0].tolist():
        t = int(f["atom_to_token"][b, i].argmax())
        het = int(f["mol_type"][b, t]) == NONPOLYMER
        codes = f["ref_atom_name_chars"][b, i].argmax(-1).tolist()
        out.append(
            {
                "index": i,
                "token": t,
                "chain": chain_name(int(f["asym_id"][b, t])),
                "seqid": int(f["residue_index"][b, t]) + 1,
                "resname": "LIG" if het else RESIDUE_NAMES[int(f["res_type"][b, t].argmax())],
                "het": het,
                "name": "".join(chr(c + 32) for c in codes if c),
                "element": gemmi.Element(int(f["ref_element"][b, i].argmax())).name.upper(),
            }
        )
    return out


def read_atoms(path) -> tuple[object, list[dict]]:
    st = gemmi.read_structure(str(path))
    assert len(st) == 1, "one model per file"
    rows = []
    for ch in st[0]:
        for res in ch:
            for at in res:
                rows.append(
                    {
                        "chain": ch.name,
                        "seqid": res.seqid.num,
                        "resname": res.name,
                        "het": res.het_flag == "H",
                        "name": at.name,
                        "element": at.element.name.upper(),
                        "xyz": (at.pos.x, at.pos.y, at.pos.z),
                        "b": at.b_iso,
                    }
                )
    return st, rows


# (coordinates: |read - written| / max(1, |written|); B-factors: absolute), the formats' precision
TOL = {"cif": (1e-8, 1e-4), "pdb": (5e-4, 5e-3)}  # measured: cif 3.7e-9, 4.8e-5; pdb 4.9e-4, 4.4e-3


def coord_error(xyz: torch.Tensor, ref: torch.Tensor) -> float:
    return ((xyz - ref).abs() / ref.abs().clamp_min(1.0)).max().item()


@pytest.mark.parametrize("fmt", ["cif", "pdb"])
@pytest.mark.parametrize("element", [0, 1])
def test_structure_round_trip(tmp_path, fmt, element):
    f = synthetic_complex(11, (3, 9), msa_depth=1, templates=0, chains=4, batch=2, seed=3)
    g = torch.Generator().manual_seed(7)
    a, n = f["atom_pad_mask"].shape[1], f["token_pad_mask"].shape[1]
    coords = torch.randn(a, 3, generator=g, dtype=torch.float64) * 30
    plddt = torch.rand(n, generator=g, dtype=torch.float64)
    path = write_structure(tmp_path / f"x.{fmt}", f, coords, plddt, fmt, element=element)
    st, got = read_atoms(path)
    want = expected_atoms(f, element)
    assert element == 0 or int((f["token_pad_mask"][element] == 0).sum()) > 0, "element 1 has padding tokens"

    chains = sorted({w["chain"] for w in want})
    assert [ch.name for ch in st[0]] == chains == [chain_name(k) for k in range(len(chains))]
    for ch in st[0]:  # residues per chain: one per (chain, residue number), names in order
        res_want = []
        for w in want:
            if w["chain"] == ch.name and (w["seqid"], w["resname"]) not in res_want:
                res_want.append((w["seqid"], w["resname"]))
        assert [(r.seqid.num, r.name) for r in ch] == res_want, ch.name
    assert len(got) == len(want) == int(f["atom_pad_mask"][element].sum())
    for key in ("chain", "seqid", "resname", "het", "name", "element"):
        assert [r[key] for r in got] == [w[key] for w in want], key
    xyz = torch.tensor([r["xyz"] for r in got], dtype=torch.float64)
    ref = coords[[w["index"] for w in want]]
    tol_x, tol_b = TOL[fmt]
    err = coord_error(xyz, ref)
    assert err <= tol_x, f"coordinates read back differ by {err:.2e} (> {tol_x})"
    b = torch.tensor([r["b"] for r in got], dtype=torch.float64)
    b_ref = 100 * plddt[[w["token"] for w in want]]
    assert (b - b_ref).abs().max().item() <= tol_b
    # ligands are HETATM in one residue per ligand chain; polymers are ATOM
    assert any(w["het"] for w in want) and not all(w["het"] for w in want)
    if fmt == "cif":
        ents = {e.name: e for e in st.entities}
        assert {e.entity_type for e in ents.values()} == {
            gemmi.EntityType.Polymer,
            gemmi.EntityType.NonPolymer,
        }


def test_per_atom_plddt_and_no_plddt(tmp_path):
    f = synthetic_complex(6, 4, msa_depth=1, templates=0, chains=2, seed=1)
    a = f["atom_pad_mask"].shape[1]
    coords = torch.randn(a, 3, dtype=torch.float64)
    atom_plddt = torch.linspace(0, 1, a, dtype=torch.float64)
    _, got = read_atoms(write_structure(tmp_path / "a.cif", f, coords, atom_plddt, plddt_per="atom"))
    idx = [w["index"] for w in expected_atoms(f)]
    # mmCIF's B_iso_or_equiv as gemmi writes it: a decimal text rounded well inside 1e-4 (measured
    # 4.8e-5 at most on 0..100); the file format's precision, not a computation's round-off
    assert np.allclose([r["b"] for r in got], 100 * atom_plddt[idx].numpy(), atol=1e-4, rtol=0)
    _, got = read_atoms(write_structure(tmp_path / "n.pdb", f, coords, fmt="pdb"))
    assert all(r["b"] == 100.0 for r in got)


def test_nucleic_acid_chain(tmp_path):
    """An RNA chain (mol_type 2, residues A/G/C/U) is written as an RNA polymer."""
    f = synthetic_complex(6, 3, msa_depth=1, templates=0, chains=2, seed=2)
    prot = f["mol_type"][0] == 0
    names = ("A", "G", "C", "U")
    f["mol_type"][0, prot] = 2
    ids = [RESIDUE_NAMES.index(names[k % 4]) for k in range(int(prot.sum()))]
    f["res_type"][0, prot] = torch.nn.functional.one_hot(torch.tensor(ids), len(RESIDUE_NAMES))
    a = f["atom_pad_mask"].shape[1]
    st, got = read_atoms(write_structure(tmp_path / "r.cif", f, torch.zeros(a, 3)))
    assert [r.name for r in st[0]["A"]] == [names[k % 4] for k in range(int(prot.sum()))]
    poly = [e for e in st.entities if e.entity_type == gemmi.EntityType.Polymer]
    assert [e.polymer_type for e in poly] == [gemmi.PolymerType.Rna]


def _confidence(samples: int, n: int, chains: int, g: torch.Generator) -> dict:
    conf = {
        k: torch.rand(samples, generator=g, dtype=torch.float64)
        for k in ("ptm", "iptm", "ligand_iptm", "protein_iptm", "complex_plddt", "complex_iplddt")
    }
    conf["complex_pde"] = 10 * torch.rand(samples, generator=g, dtype=torch.float64)
    conf["complex_ipde"] = 10 * torch.rand(samples, generator=g, dtype=torch.float64)
    conf["plddt"] = torch.rand(samples, n, generator=g, dtype=torch.float64)
    conf["pae"] = 32 * torch.rand(samples, n, n, generator=g, dtype=torch.float64)
    conf["pde"] = 32 * torch.rand(samples, n, n, generator=g, dtype=torch.float64)
    conf["pair_chains_iptm"] = {
        c1: {c2: torch.rand(samples, generator=g, dtype=torch.float64) for c2 in range(chains)}
        for c1 in range(chains)
    }
    conf["confidence_score"] = confidence_score(conf)
    return conf


@pytest.mark.parametrize("fmt", ["cif", "pdb"])
def test_write_prediction_layout_and_confidence(tmp_path, fmt):
    f = synthetic_complex(9, (3, 6), msa_depth=1, templates=0, chains=3, batch=2, seed=5)
    g = torch.Generator().manual_seed(11)
    samples, a, n = 3, f["atom_pad_mask"].shape[1], f["token_pad_mask"].shape[1]
    coords = torch.randn(samples, a, 3, generator=g, dtype=torch.float64) * 10
    conf = _confidence(samples, n, 3, g)
    written = write_prediction(tmp_path, "complex1", f, coords, conf, fmt, element=1)

    order = torch.argsort(conf["confidence_score"], descending=True).tolist()
    rank = ranking(conf, samples)
    assert [order.index(j) for j in range(samples)] == rank
    real = f["token_pad_mask"][1] > 0
    assert int((~real).sum()) == 1, "element 1 has one padding token"
    ext = ".cif" if fmt == "cif" else ".pdb"
    files = sorted(p.relative_to(tmp_path).as_posix() for p in tmp_path.rglob("*") if p.is_file())
    expect = []
    for k in range(samples):
        tag = f"complex1_model_{k}"
        expect += [f"predictions/complex1/{tag}{ext}", f"predictions/complex1/confidence_{tag}.json"]
        expect += [f"predictions/complex1/{key}_{tag}.npz" for key in ("plddt", "pae", "pde")]
    assert files == sorted(expect)
    want = expected_atoms(f, 1)
    for j in range(samples):
        paths = prediction_paths(tmp_path, "complex1", rank[j], fmt)
        assert written[j] == paths
        # JSON: Boltz's keys in Boltz's order, values round trip (JSON floats are exact)
        data = json.loads(paths["confidence"].read_text())
        assert list(data) == [
            "confidence_score", "ptm", "iptm", "ligand_iptm", "protein_iptm", "complex_plddt",
            "complex_iplddt", "complex_pde", "complex_ipde", "chains_ptm", "pair_chains_iptm",
        ]  # fmt: skip
        for key in list(data)[:9]:
            assert data[key] == conf[key][j].item(), key
        assert data["chains_ptm"] == {str(c): conf["pair_chains_iptm"][c][c][j].item() for c in range(3)}
        assert data["pair_chains_iptm"] == {
            str(c1): {str(c2): conf["pair_chains_iptm"][c1][c2][j].item() for c2 in range(3)}
            for c1 in range(3)
        }
        assert data == json.loads(json.dumps(summary_of(conf, j)))
        # arrays cut to the real tokens
        assert np.array_equal(np.load(paths["plddt"])["plddt"], conf["plddt"][j][real].numpy())
        for key in ("pae", "pde"):
            assert np.array_equal(np.load(paths[key])[key], conf[key][j][real][:, real].numpy())
        # the structure is sample j's, B-factors its pLDDT
        _, got = read_atoms(paths["structure"])
        xyz = torch.tensor([r["xyz"] for r in got], dtype=torch.float64)
        assert coord_error(xyz, coords[j][[w["index"] for w in want]]) <= TOL[fmt][0]
        b_ref = 100 * conf["plddt"][j][[w["token"] for w in want]]
        assert torch.allclose(
            torch.tensor([r["b"] for r in got], dtype=torch.float64), b_ref, atol=TOL[fmt][1]
        )


def test_without_confidence_and_boltz_score(tmp_path):
    f = synthetic_complex(5, 2, msa_depth=1, templates=0, chains=1, seed=4)
    coords = torch.randn(2, f["atom_pad_mask"].shape[1], 3)
    written = write_prediction(tmp_path, "mono", f, coords)
    assert [sorted(w) for w in written] == [["structure"], ["structure"]]
    assert [w["structure"].name for w in written] == ["mono_model_0.cif", "mono_model_1.cif"]
    # Boltz's score: ipTM, or pTM when ipTM is zero for every sample
    c = {"complex_plddt": torch.tensor([0.5, 1.0]), "ptm": torch.tensor([0.3, 0.1]), "iptm": torch.zeros(2)}
    assert torch.allclose(confidence_score(c), (4 * c["complex_plddt"] + c["ptm"]) / 5)
    c["iptm"] = torch.tensor([0.0, 0.2])
    assert torch.allclose(confidence_score(c), (4 * c["complex_plddt"] + c["iptm"]) / 5)
    assert ranking({"confidence_score": torch.tensor([0.1, 0.9, 0.5])}, 3) == [2, 0, 1]


def test_bad_input(tmp_path):
    f = synthetic_complex(6, 3, msa_depth=1, templates=0, chains=2, seed=0)
    a, n = f["atom_pad_mask"].shape[1], f["token_pad_mask"].shape[1]
    x = torch.zeros(a, 3)
    for bad in (torch.zeros(1, a, 3), torch.zeros(a, 2), torch.zeros(a - 1, 3)):
        with pytest.raises(ValueError, match=rf"coords must be \[A={a}, 3\]"):
            write_structure(tmp_path / "x.cif", f, bad)
    with pytest.raises(ValueError, match=r"coords must be \[samples, A="):
        write_prediction(tmp_path, "r", f, x)
    nan = x.clone()
    nan[0, 0] = float("nan")
    with pytest.raises(ValueError, match="non-finite"):
        write_structure(tmp_path / "x.cif", f, nan)
    with pytest.raises(IndexError, match="batch element 1 out of range"):
        write_structure(tmp_path / "x.cif", f, x, element=1)
    with pytest.raises(ValueError, match="fmt must be one of"):
        write_structure(tmp_path / "x.xyz", f, x, fmt="xyz")
    with pytest.raises(ValueError, match=r"PDB holds coordinates in \(-1000, 10000\)"):
        write_structure(tmp_path / "x.pdb", f, x - 1000, fmt="pdb")
    write_structure(tmp_path / "x.cif", f, x - 1000)  # mmCIF has no such limit
    with pytest.raises(ValueError, match="plddt must be"):
        write_structure(tmp_path / "x.cif", f, x, torch.rand(n + 1))
    g = torch.Generator().manual_seed(0)
    conf = _confidence(2, n, 2, g)
    with pytest.raises(IndexError, match="sample 2 out of range: the confidence holds 2 samples"):
        summary_of(conf, 2)
    with pytest.raises(IndexError, match="sample -1 out of range"):
        summary_of(conf, -1)
    with pytest.raises(ValueError, match="confidence holds 2 samples, coords 3"):
        write_prediction(tmp_path, "r", f, torch.zeros(3, a, 3), conf)
    short = dict(conf, ptm=conf["ptm"][:1])
    with pytest.raises(ValueError, match="same leading sample dimension"):
        summary_of(short, 0)
    with pytest.raises(ValueError, match=r"confidence\['pae'\] must be"):
        write_prediction(tmp_path, "r", f, torch.zeros(2, a, 3), dict(conf, pae=conf["pae"][:, :-1]))
    with pytest.raises(ValueError, match="record must be a plain file name"):
        write_prediction(tmp_path, "../r", f, torch.zeros(2, a, 3))
    with pytest.raises(ValueError, match="must be finite"):
        write_confidence(tmp_path / "c.json", {"ptm": float("inf")})
    broken = dict(f, atom_to_token=f["atom_to_token"].clone())
    broken["atom_to_token"][0, 0] = 0
    with pytest.raises(ValueError, match="atom_to_token: every real atom"):
        write_structure(tmp_path / "x.cif", broken, x)
