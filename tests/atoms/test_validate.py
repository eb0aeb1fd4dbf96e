"""``twinshard validate``: serial vs distributed (dispatch) errors with the keys of ``md --json``; a
deliberately broken handler (planted from the test on every rank) makes it fail and name the
first diverging op and the handler that ran it; the CLI exits non-zero beyond tolerance."""

import json

import pytest
import torch

from twinshard.atoms.parallel.validate import TOLERANCES, ValidateConfig, run_validate
from twinshard.atoms.potentials.mace import build_mace, build_scaleshift_mace
from twinshard.cli import main
from twinshard.shard import dispatch as D
from twinshard.shard import registry as R
from twinshard.shard.shard_tensor import to_local


def broken_refresh():
    """halo_refresh replaced by a gather on local rows (the stale halo is never refreshed)."""

    def run(f, a, k):
        c = D.parse_index_call(f, a, k)
        return R.local_gather(c, to_local(c.target), R.plain_index(c.index))

    pred = next(h.predicate for h in D._shipped() if h.name == "halo_refresh")
    return D.REGISTRY.installed(D.Handler("halo_refresh", pred, run), first=False)


def test_validate_passes_and_reports_md_keys():
    rep = run_validate(ValidateConfig(potential="mpnn", ranks=2))
    assert rep["passed"] and rep["first_divergence"] is None
    for k, tol in TOLERANCES.items():
        assert rep[k] is not None and rep[k] <= tol, (k, rep[k])


def test_validate_names_the_op_of_a_broken_handler():
    rep = run_validate(ValidateConfig(potential="mpnn", ranks=2, setup=broken_refresh))
    assert not rep["passed"] and rep["max_force_error"] > 1e-6
    div = rep["first_divergence"]
    assert div is not None and div["op"] == "Tensor.index_select" and div["handler"] == "halo_refresh", div


def test_validate_cli_json(capsys):
    assert main(["validate", "--potential", "mpnn", "--ranks", "2", "--json"]) == 0
    rep = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert rep["passed"] and set(TOLERANCES) <= set(rep)


# ---------------------------------------------------------------------- MACE: its own path as oracle
@pytest.fixture(scope="module")
def mace_files(tmp_path_factory):
    root = tmp_path_factory.mktemp("validate_mace")
    files = {
        "scaleshift": build_scaleshift_mace(),  # its stack of per-layer node energies (<= 32 rows a rank)
        "fp32": build_mace(dtype=torch.float32),  # a published-style fp32 model file
    }
    for name, model in files.items():
        torch.save(model, root / f"{name}.model")
    return {name: str(root / f"{name}.model") for name in files}


@pytest.mark.parametrize("name", ["scaleshift", "fp32"])
def test_validate_mace_models_against_their_calculator(mace_files, name, capsys):
    """``validate --potential mace --model FILE`` on the models users save: the serial side is
    mace's calculator, the serial trace mace's own batch through its module; an fp32 model is
    gated at its own round-off budget (reported), fp64 at the issue's bounds. --timeout and --skin
    are options."""
    argv = ["validate", "--potential", "mace", "--model", mace_files[name], "--ranks", "2"]
    argv += ["--storage", "graph"] if name == "scaleshift" else []  # 16 rows a rank: a [2, 16] stack
    assert main(argv + ["--skin", "1.0", "--timeout", "120", "--json"]) == 0
    rep = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert rep["passed"] and rep["first_divergence"] is None
    expected = 1026 * torch.finfo(torch.float32).eps if name == "fp32" else TOLERANCES["max_force_error"]
    assert rep["tolerances"]["max_force_error"] == pytest.approx(expected)
    assert 0 < rep["max_force_error"] <= rep["tolerances"]["max_force_error"]


def test_validate_names_the_op_of_a_broken_handler_in_mace():
    """The serial trace (mace's own batch through its module) lines up with the distributed trace
    inside the adapter: the first diverging op is MACE's first gather of the sender positions."""
    rep = run_validate(ValidateConfig(potential="mace", ranks=2, setup=broken_refresh))
    assert not rep["passed"] and rep["max_force_error"] > 1e-6
    div = rep["first_divergence"]
    assert div is not None and div["op"] == "Tensor.__getitem__" and div["handler"] == "halo_refresh", div
