"""``twinshard predict``: the whole Boltz-2 inference on a grid, written in boltz's layout (small N,
fp64, a few denoising steps; the command runs in-process on the shared worker pool).

- ``test_predict_writes_the_serial_prediction`` (1x1 and 2x2, mmCIF; 1x1 PDB): the embedded
  defaults (synthetic complex, random weights) with 2 samples and a recycling step; the JSON's keys
  and ``--check-serial`` errors (fp64 round-off); every file of boltz's layout exists; gemmi reads
  each structure back with the complex's chains and atom count, and its coordinates equal the
  serial ``Boltz2Model``'s sample (built here, the same weights, features and draws) to the file's
  precision; the confidence JSON and npz hold the JSON line's figures and real-token arrays.
- ``test_predict_checkpoint``: a Boltz-2 Lightning checkpoint written here (``state_dict`` of a
  random-weight ``Boltz2Model`` of other widths than the embedded one, ``hyper_parameters``
  Boltz2's keyword arguments, plus Lightning's bookkeeping keys) loads strict and predicts on 2x2
  equal to serial; ``load_checkpoint`` gives back the written weights, with Boltz-2's predict
  diffusion parameters and steering off (as ``boltz predict`` loads).
- ``test_predict_feature_file``: a ``torch.save``'d feature dict of two complexes (no
  ``frames_idx``, extra entries of boltz's batch) gives one record per element, named by the stem.
- ``test_predict_precision_modes``: ``--precision bf16-mixed`` (Boltz-2's own mode: autocast, the
  sampler in fp32) and ``bf16`` (weights and activations) on 2x2 with ``--check-serial``: the mode
  in the JSON, structures gemmi reads with finite coordinates, and the CP prediction close to the
  serial one run in the same mode (a sanity bound, not parity: bf16 rounds at 4e-3 relative and
  the sampler's steps amplify it; measured 1.7% of the coordinates' scale).
- ``test_predict_bad_options``: a grid larger than the complex, a missing or malformed checkpoint,
  a checkpoint of other shapes, a missing feature file, bad step counts: one-line errors, exit 2.
"""

from __future__ import annotations

import json
from dataclasses import asdict, replace

import numpy as np
import pytest
import torch

from twinshard.cli import main
from twinshard.cli.predict import build_model, default_config, load_checkpoint, synthetic_features
from twinshard.pair.output import chain_name
from twinshard.pair.reference.model import Boltz2Model
from twinshard.pair.reference.sampler import BOLTZ2_DIFFUSION_PARAMS

gemmi = pytest.importorskip("gemmi", reason="gemmi is not installed: pip install -e '.[predict]'")

F64 = torch.float64
KEYS = {
    "command",
    "record",
    "grid",
    "ranks",
    "tokens",
    "atoms",
    "batch",
    "dtype",
    "precision",
    "format",
    "recycling_steps",
    "sampling_steps",
    "diffusion_samples",
    "max_parallel_samples",
    "seed",
    "checkpoint",
    "features",
    "out",
    "samples",
    "timings_s",
    "check_serial",
    "errors",
}
ERROR_KEYS = {"sample_atom_coords", "plddt", "pae", "pde", "ptm", "iptm", "complex_plddt"}
ROUND_OFF = 1e-10  # fp64 CP vs serial, relative to the output's scale (measured: below 1e-13)
POSITION = {"mmcif": 1e-7, "pdb": 6e-4}  # the file's precision (mmCIF 9 significant digits, PDB 8.3f)


def predict(capsys, *argv: str) -> dict:
    code = main(["predict", "--no-progress", "--json", *argv])
    out = capsys.readouterr()
    assert code == 0, out.err[-3000:]
    return json.loads(out.out.strip().splitlines()[-1])


def check_errors(result: dict) -> None:
    assert set(result["errors"]) == ERROR_KEYS
    for k, e in result["errors"].items():
        assert e["max_abs"] <= ROUND_OFF * max(e["ref_scale"], 1.0), (k, e)


def read_back(path) -> tuple[list[str], np.ndarray]:
    st = gemmi.read_structure(str(path))
    assert len(st) == 1
    chains = [ch.name for ch in st[0]]
    xyz = np.array([[a.pos.x, a.pos.y, a.pos.z] for ch in st[0] for res in ch for a in res])
    return chains, xyz


CASES = [((1, 1), "mmcif"), ((2, 2), "mmcif"), ((1, 1), "pdb")]


@pytest.mark.parametrize("grid,fmt", CASES, ids=[f"{g[0]}x{g[1]}-{f}" for g, f in CASES])
def test_predict_writes_the_serial_prediction(grid, fmt, tmp_path, capsys):
    n, m, steps, seed = 10, 2, 3, 5
    argv = [
        *("--grid", f"{grid[0]}x{grid[1]}", "--tokens", str(n), "--sampling-steps", str(steps)),
        *("--diffusion-samples", str(m), "--recycling-steps", "1", "--seed", str(seed), "--dtype", "float64"),
        *("--format", fmt, "--out", str(tmp_path), "--check-serial"),
    ]
    r = predict(capsys, *argv)
    assert set(r) == KEYS and r["command"] == "predict" and r["record"] == "synthetic"
    assert r["grid"] == f"{grid[0]}x{grid[1]}" and r["ranks"] == grid[0] * grid[1] and r["tokens"] == n
    assert r["sampling_steps"] == steps and r["diffusion_samples"] == m and r["check_serial"] is True
    assert set(r["timings_s"]) == {
        "setup",
        "trunk",
        "sampling",
        "confidence",
        "forward",
        "write",
        "serial",
        "total",
    }
    assert all(v >= 0 for v in r["timings_s"].values())
    check_errors(r)

    # the serial prediction, built here: the same weights, features and draws
    feats = synthetic_features(n, F64, seed)
    model = build_model(Boltz2Model, default_config(), F64, seed)
    with torch.no_grad():
        want = model(feats, recycling_steps=1, num_sampling_steps=steps, diffusion_samples=m, seed=seed)
    x = want["sample_atom_coords"]
    assert not torch.allclose(x[0], x[1]), "the samples should differ"
    real = feats["atom_pad_mask"][0] > 0
    asyms = sorted({int(a) for a in feats["asym_id"][0]})
    samples = r["samples"]
    assert sorted(s["sample"] for s in samples) == list(range(m))
    assert sorted(s["model"] for s in samples) == list(range(m))
    ext = ".pdb" if fmt == "pdb" else ".cif"
    for s in samples:
        j, k = s["sample"], s["model"]
        files = s["files"]
        assert set(files) == {"structure", "confidence", "plddt", "pae", "pde"}
        assert files["structure"].endswith(f"predictions/synthetic/synthetic_model_{k}{ext}")
        chains, xyz = read_back(files["structure"])
        assert chains == [chain_name(a) for a in asyms]
        assert xyz.shape == (int(real.sum()), 3)
        ref = x[j][real].numpy()
        scale = max(1.0, float(np.abs(ref).max()))
        err = float(np.abs(xyz - ref).max())
        assert err <= POSITION[fmt] * (scale if fmt == "mmcif" else 1.0), (
            f"{files['structure']}: the coordinates differ from serial sample {j}'s by up to {err:.3g} A "
            f"(scale {scale:.3g} A): not that sample, or not the serial prediction"
        )
        conf = json.loads(open(files["confidence"]).read())
        for key in ("confidence_score", "ptm", "iptm", "complex_plddt"):
            assert conf[key] == pytest.approx(s[key], rel=1e-12)
        assert conf["ptm"] == pytest.approx(float(want["ptm"][j]), rel=1e-9)
        assert "pair_chains_iptm" in conf and "chains_ptm" in conf
        plddt = np.load(files["plddt"])["plddt"]
        assert plddt.shape == (n,)
        np.testing.assert_allclose(plddt, want["plddt"][j].numpy(), rtol=1e-9, atol=1e-12)
        assert np.load(files["pae"])["pae"].shape == (n, n)
    best = min(samples, key=lambda s: s["model"])
    assert best["confidence_score"] == max(s["confidence_score"] for s in samples)


def hparams_of(cfg) -> dict:
    """Boltz2's ``__init__`` keyword arguments for a ``ModelConfig`` (as Lightning saves them)."""
    hp = asdict(cfg.trunk)
    hp.update(
        score_model_args=dict(cfg.score_model_args),
        diffusion_process_args=dict(cfg.diffusion_process_args),
        confidence_prediction=cfg.confidence_prediction,
        confidence_model_args=dict(cfg.confidence_model_args),
        token_level_confidence=cfg.token_level_confidence,
        steering_args={
            "fk_steering": False,
            "physical_guidance_update": False,
            "contact_guidance_update": False,
        },
        affinity_prediction=False,
        predict_bfactor=False,
        training_args={"recycling_steps": 3},  # keys the inference does not read
        ema=True,
    )
    return hp


def test_predict_checkpoint(tmp_path, capsys):
    from twinshard.bench.predict_bench import model_config
    from twinshard.cli.predict import DEFAULTS

    small = dict(
        DEFAULTS, single_channels=16, pair_channels=8, layers=1, heads=2, pair_heads=2, pair_head_width=4
    )
    cfg = model_config(small)  # the file's sampler parameters: boltz predict replaces them
    cfg = replace(cfg, diffusion_process_args=dict(cfg.diffusion_process_args, sigma_max=0.5, step_scale=1.0))
    model = build_model(Boltz2Model, cfg, F64, seed=11)
    path = tmp_path / "boltz2.ckpt"
    sd = model.state_dict()
    torch.save(
        {
            "state_dict": sd,
            "hyper_parameters": hparams_of(cfg),
            "epoch": 0,
            "global_step": 0,
            "pytorch-lightning_version": "2.5.0",
        },
        path,
    )
    got_cfg, got = load_checkpoint(path)
    assert got_cfg.trunk == cfg.trunk and got_cfg.score_model_args == cfg.score_model_args
    assert got_cfg.diffusion_process_args == BOLTZ2_DIFFUSION_PARAMS  # boltz predict's, not the file's
    assert got_cfg.steering_args is None
    for k, v in got.state_dict().items():
        assert torch.equal(v, sd[k]), k
    r = predict(
        capsys,
        *("--checkpoint", str(path), "--grid", "2x2", "--tokens", "9", "--sampling-steps", "2"),
        *("--recycling-steps", "0", "--dtype", "float64", "--out", str(tmp_path / "out"), "--check-serial"),
    )
    assert r["checkpoint"] == str(path.resolve())
    check_errors(r)
    assert len(r["samples"]) == 1 and (tmp_path / "out/predictions/synthetic/synthetic_model_0.cif").is_file()


def test_predict_feature_file(tmp_path, capsys):
    from twinshard.pair.synthetic import synthetic_complex

    f = synthetic_complex(
        8, atoms_per_token=(2, 5), msa_depth=2, templates=1, chains=3, batch=2, seed=3, dtype=F64
    )
    f["record"] = ["a", "b"]  # boltz's batch holds more than the model reads: dropped
    torch.save(f, tmp_path / "complex.pt")
    r = predict(
        capsys,
        *("--features", str(tmp_path / "complex.pt"), "--grid", "1x1", "--sampling-steps", "2"),
        *("--recycling-steps", "0", "--dtype", "float64", "--out", str(tmp_path / "out"), "--check-serial"),
    )
    check_errors(r)
    assert r["record"] == "complex" and r["batch"] == 2 and r["tokens"] == 8
    assert sorted(s["element"] for s in r["samples"]) == [0, 1]
    for b in (0, 1):
        path = tmp_path / f"out/predictions/complex_{b}/complex_{b}_model_0.cif"
        _, xyz = read_back(path)
        assert xyz.shape == (int((f["atom_pad_mask"][b] > 0).sum()), 3)


def fails(capsys, *argv: str) -> str:
    code = main(["predict", "--no-progress", "--json", *argv])
    err = capsys.readouterr().err
    assert code == 2, err
    assert "Traceback" not in err
    return err


@pytest.mark.parametrize("mode", ["bf16-mixed", "bf16"])
def test_predict_precision_modes(mode, tmp_path, capsys):
    argv = ("--grid", "2x2", "--tokens", "12", "--sampling-steps", "3", "--recycling-steps", "1")
    r = predict(capsys, *argv, "--precision", mode, "--check-serial", "--out", str(tmp_path))
    assert r["precision"] == mode and r["dtype"] == ("bfloat16" if mode == "bf16" else "float32")
    for s in r["samples"]:
        _, xyz = read_back(s["files"]["structure"])
        assert xyz.shape[0] > 0 and np.isfinite(xyz).all()
    e = r["errors"]["sample_atom_coords"]
    assert 0 < e["max_abs"] <= 0.05 * e["ref_scale"], e  # sanity, not parity (docstring)


def test_predict_bad_options(tmp_path, capsys):
    out = ("--out", str(tmp_path / "out"))
    assert "--grid 2x4 is larger than the complex: --tokens 3" in fails(
        capsys, "--tokens", "3", "--grid", "2x4", *out
    )
    assert "no such file" in fails(capsys, "--checkpoint", str(tmp_path / "none.ckpt"), *out)
    assert "no such file" in fails(capsys, "--features", str(tmp_path / "none.pt"), *out)
    torch.save({"weights": {}}, tmp_path / "bad.ckpt")
    assert "'state_dict' and 'hyper_parameters'" in fails(
        capsys, "--checkpoint", str(tmp_path / "bad.ckpt"), *out
    )
    (tmp_path / "text.ckpt").write_text("not a checkpoint")
    assert "not a torch checkpoint" in fails(capsys, "--checkpoint", str(tmp_path / "text.ckpt"), *out)
    cfg = default_config()
    sd = build_model(Boltz2Model, cfg, F64, seed=0).state_dict()
    sd.pop(next(iter(sd)))
    torch.save({"state_dict": sd, "hyper_parameters": hparams_of(cfg)}, tmp_path / "short.ckpt")
    err = fails(capsys, "--checkpoint", str(tmp_path / "short.ckpt"), *out)
    assert "does not load strict" in err and "missing ['input_embedder" in err
    assert "--sampling-steps must be >= 1" in fails(capsys, "--sampling-steps", "0", *out)
    assert "--dtype float64 contradicts --precision bf16-mixed" in fails(
        capsys, "--dtype", "float64", "--precision", "bf16-mixed", *out
    )
    assert "--diffusion-samples must be >= 1" in fails(capsys, "--diffusion-samples", "0", *out)
    assert not (tmp_path / "out").exists()
