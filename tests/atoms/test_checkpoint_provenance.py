"""A checkpoint records what produced it and a checksum of its payload (issue 18).

A restart with another potential (class, cutoff, LJ table, weights) refuses in one line naming
what differs, with the same error on every rank, unless the change is allowed on purpose; another
structure always refuses; a checkpoint whose payload was changed after writing (one position one
ulp off) is refused as corrupted; a version-1 checkpoint still loads. A restart at another rank
count or storage with the same options is allowed (that it equals the uninterrupted run is
tests/atoms/test_restart.py's).
"""

import re

import pytest
import torch

from twinshard.atoms.dynamics.driver import MDConfig, md_rank
from twinshard.atoms.dynamics.md import load_checkpoint, save_checkpoint
from twinshard.atoms.dynamics.provenance import potential_provenance
from twinshard.atoms.potentials import LennardJones, MessagePassingPotential
from twinshard.runtime import RankFailure
from twinshard.testing import run_on_world

BASE = dict(structure="fcc_argon", atoms=108, cutoff=5.0, skin=0.5, seed=2, thermo_every=2)
CUT, STEPS = 4, 6
BUILD = "md: build the potential"
SETUP = "md: load the structure and check the options"
LJ = "twinshard.atoms.potentials.lj.LennardJones"
MPNN = "twinshard.atoms.potentials.mpnn.MessagePassingPotential"


@pytest.fixture(scope="module")
def ck(tmp_path_factory):
    """A 2-rank LJ run's checkpoint at step CUT."""
    path = tmp_path_factory.mktemp("prov") / "ck.pt"
    run_on_world(md_rank, 2, MDConfig(steps=CUT, checkpoint=str(path), **BASE))
    return path


def _restart_error(cfg):
    try:
        md_rank(cfg)
    except RankFailure as exc:
        return exc.step, exc.message()
    return "no error"


CHANGES = {
    "cutoff": ({"cutoff": 6.0}, "cutoff 5.0 -> 6.0; restart with the same --potential/"),
    "epsilon": ({"epsilon": 0.02}, "lj Ar:0.0104:3.405 -> Ar:0.02:3.405, parameters digest"),
    "potential": ({"potential": "mpnn"}, f"class {LJ} -> {MPNN}"),
}


@pytest.mark.parametrize("ranks", [1, 2])
@pytest.mark.parametrize("change", sorted(CHANGES))
def test_restart_with_another_potential_is_refused_on_every_rank(ck, change, ranks):
    opts, what = CHANGES[change]
    errs = run_on_world(_restart_error, ranks, MDConfig(steps=STEPS, restart=str(ck), **{**BASE, **opts}))
    assert all(e == errs[0] for e in errs) and errs[0][0] == BUILD, errs  # the same error on each rank
    msg = errs[0][1]
    assert len(msg.splitlines()) == 1, msg
    assert msg.startswith(f"ValueError: checkpoint '{ck}' was written by another potential: "), msg
    assert what in msg and "--allow-changed-potential" in msg, msg


def test_the_override_continues_with_the_new_potential(ck, tmp_path):
    end = tmp_path / "end.pt"
    cfg = MDConfig(
        steps=STEPS,
        restart=str(ck),
        checkpoint=str(end),
        allow_changed_potential=True,
        **{**BASE, "cutoff": 6.0},
    )
    out = run_on_world(md_rank, 2, cfg)[0]
    assert out["start_step"] == CUT and "cutoff 5.0 -> 6.0" in out["potential_notice"]
    assert load_checkpoint(end)["provenance"]["potential"]["cutoff"] == 6.0  # the new run's record


def test_the_same_options_at_another_rank_count_restart(ck):
    out = run_on_world(md_rank, 1, MDConfig(steps=STEPS, restart=str(ck), **BASE))[0]
    assert out["start_step"] == CUT and out["potential_notice"] is None


def test_mpnn_restarts_with_another_storage(tmp_path):
    """The plain twin (graph storage) records the same potential as the halo storage's."""
    path = tmp_path / "ck.pt"
    opts = {**BASE, "potential": "mpnn"}
    run_on_world(md_rank, 2, MDConfig(steps=2, checkpoint=str(path), **opts))
    assert load_checkpoint(path)["provenance"]["potential"]["class"] == MPNN
    out = run_on_world(md_rank, 1, MDConfig(steps=3, restart=str(path), storage="graph", **opts))[0]
    assert out["start_step"] == 2 and out["potential_notice"] is None


def test_another_structure_is_refused_without_override(ck):
    cfg = MDConfig(steps=STEPS, restart=str(ck), allow_changed_potential=True, **{**BASE, "atoms": 256})
    errs = run_on_world(_restart_error, 2, cfg)
    assert errs[0] == errs[1] and errs[0][0] == SETUP, errs
    assert f"checkpoint '{ck}' holds another structure than the one given (atoms 108 -> 256" in errs[0][1]


def test_command_line_error_is_one_line(ck, capsys):
    from twinshard.cli import main

    argv = ["md", "fcc_argon", "--atoms", "108", "--skin", "0.5", "--seed", "2", "--steps", "6"]
    assert main([*argv, "--cutoff", "6", "--restart", str(ck), "--ranks", "2"]) == 1
    err = [ln for ln in capsys.readouterr().err.splitlines() if "error" in ln]
    assert len(err) == 1 and "cutoff 5.0 -> 6.0" in err[0], err


def test_run_md_refuses_another_parametrization(tmp_path):
    from twinshard.atoms import fcc_argon, run_md

    path = tmp_path / "ck.pt"
    system = fcc_argon(n_atoms=32, rattle=0.05, seed=1)
    run_md(system, LennardJones(cutoff=4.0), ranks=1, steps=2, checkpoint=path)
    other = LennardJones({18: (0.011, 3.405)}, cutoff=4.0)
    with pytest.raises(RankFailure, match=r"another potential: lj Ar:0\.0104:3\.405 -> Ar:0\.011:3\.405"):
        run_md(None, other, ranks=1, steps=4, restart=path)
    out = run_md(None, other, ranks=1, steps=4, restart=path, allow_changed_potential=True)
    assert out.start_step == 2 and "Ar:0.011:3.405" in out.info["potential_notice"]


def test_run_md_sees_other_weights(tmp_path):
    """Same class and hyperparameters, other weights: only the state_dict digest differs."""
    from twinshard.atoms import fcc_argon, run_md

    path = tmp_path / "ck.pt"
    run_md(fcc_argon(n_atoms=32), MessagePassingPotential(cutoff=4.0), ranks=1, steps=1, checkpoint=path)
    with pytest.raises(RankFailure, match=r"another potential: parameters digest [0-9a-f]{12}\.\. -> "):
        run_md(None, MessagePassingPotential(cutoff=4.0, seed=1), ranks=1, steps=2, restart=path)


def test_parameters_digest_sees_one_ulp():
    a, b = LennardJones(cutoff=5.0), LennardJones(cutoff=5.0)
    assert potential_provenance(a) == potential_provenance(b)  # deterministic
    with torch.no_grad():
        b.sigma.copy_(torch.nextafter(b.sigma, torch.tensor(10.0, dtype=b.sigma.dtype)))
    # the table prints sigma's repr, which also shows the ulp; the digest must see it on its own
    pa, pb = potential_provenance(a), potential_provenance(b)
    assert pa["parameters_sha256"] != pb["parameters_sha256"]


def _flip_position(state):
    x = state["system"]["positions"]
    x[3, 1] = torch.nextafter(x[3, 1], torch.tensor(float("inf"), dtype=x.dtype))  # one ulp


def _edit_cutoff(state):
    state["provenance"]["potential"]["cutoff"] = 6.0


@pytest.mark.parametrize("edit", [_flip_position, _edit_cutoff], ids=["position", "provenance"])
def test_an_edited_payload_is_refused_as_corrupted(ck, tmp_path, edit):
    bad = tmp_path / "bad.pt"
    state = torch.load(ck, weights_only=True)
    edit(state)
    torch.save(state, bad)  # the checksum is not updated: what a flipped bit on disk looks like
    with pytest.raises(ValueError, match=re.escape(f"checkpoint '{bad}' is corrupted: its payload does not")):
        load_checkpoint(bad)
    errs = run_on_world(_restart_error, 2, MDConfig(steps=STEPS, restart=str(bad), **BASE))
    assert errs[0] == errs[1] and errs[0][0] == SETUP and "is corrupted" in errs[0][1], errs
    save_checkpoint(bad, state)  # rewritten through the writer: a new checksum, loads
    load_checkpoint(bad)


def test_a_version_1_checkpoint_loads(ck, tmp_path, capsys):
    old = tmp_path / "v1.pt"
    state = torch.load(ck, weights_only=True)
    for key in ("checksum", "provenance"):
        del state[key]
    state["version"] = 1
    torch.save(state, old)
    st = load_checkpoint(old)
    assert st["step"] == CUT and st["system"].n_atoms == 108
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "has version 1" in err[0] and "cannot be checked" in err[0], err
    out = run_on_world(md_rank, 1, MDConfig(steps=STEPS, restart=str(old), **BASE))[0]
    assert out["start_step"] == CUT and out["potential_notice"] is None


def test_restart_with_another_mace_model_file_is_refused(tmp_path):
    pytest.importorskip("mace")
    from twinshard.atoms.potentials.mace import build_mace

    files = [tmp_path / f"m{seed}.model" for seed in (0, 1)]
    for seed, path in enumerate(files):
        torch.save(build_mace(species=[18], seed=seed), path)  # as mace-torch saves a model
    ck = tmp_path / "ck.pt"
    opts = dict(structure="fcc_argon", atoms=32, potential="mace", skin=0.5)
    run_on_world(md_rank, 1, MDConfig(steps=1, checkpoint=str(ck), model=str(files[0]), **opts))
    errs = run_on_world(_restart_error, 1, MDConfig(steps=2, restart=str(ck), model=str(files[1]), **opts))
    assert errs[0][0] == BUILD and "model file digest" in errs[0][1], errs
    assert re.search(
        r"another potential: model file digest \w{12}\.\. -> \w{12}\.\., parameters digest", errs[0][1]
    )
