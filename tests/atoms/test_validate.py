"""``twinshard validate``: serial vs distributed (dispatch) errors with the keys of ``md --json``; a
deliberately broken handler (planted from the test on every rank) makes it fail and name the
first diverging op and the handler that ran it; the CLI exits non-zero beyond tolerance."""

import json

from twinshard.atoms.validate import TOLERANCES, ValidateConfig, run_validate
from twinshard.cli import main
from twinshard.tensors import dispatch as D
from twinshard.tensors.shard_tensor import to_local


def broken_refresh():
    """halo_refresh replaced by a gather on local rows (the stale halo is never refreshed)."""

    def run(f, a, k):
        c = D.parse_index_call(f, a, k)
        return D._local_gather(c, to_local(c.target), D._plain(c.index))

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
