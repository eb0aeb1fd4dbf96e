"""`twinshard md` options a chemist needs: LJ parameters (--epsilon/--sigma/--no-shift, --lj per
species), --json-arrays (final positions, forces, stress), both memory figures, restart."""

import json

import torch

from twinshard.atoms.dynamics.driver import MDConfig, load_structure
from twinshard.atoms.potentials import LennardJones, evaluate
from twinshard.cli import main
from twinshard.testing import assert_parity

COMMON = ["--ranks", "2", "--skin", "0.5", "--json", "--json-arrays", "--seed", "0"]


def _run(capsys, argv):
    rc = main(["md", *argv])
    out = capsys.readouterr()
    assert rc == 0, out.err[-2000:]
    return json.loads(out.out.strip().splitlines()[-1])


def _check_arrays(r, structure, atoms, pot, what):
    system = load_structure(MDConfig(structure=structure, atoms=atoms, temperature=60.0, seed=0))
    ref = evaluate(pot, system)  # --steps 0: the final state is the start
    order = torch.argsort(system.ids)
    assert r["final_ids"] == system.ids[order].tolist()
    t = lambda k: torch.tensor(r[k], dtype=torch.float64)  # noqa: E731
    assert_parity(t("final_positions"), system.positions[order], what=f"{what} positions", grid="2")
    assert_parity(t("final_forces"), ref.forces[order], what=f"{what} forces", grid="2")
    assert_parity(t("final_stress"), ref.stress, what=f"{what} stress", grid="2")
    assert_parity(t("final_virial"), ref.virial, what=f"{what} virial", grid="2")
    assert_parity(torch.tensor(r["energy"], dtype=torch.float64), ref.energy, what=f"{what} energy", grid="2")
    return ref


def test_lj_parameters_and_json_arrays(capsys):
    argv = ["random_packing", "--atoms", "120", "--steps", "0", "--cutoff", "6", *COMMON]
    r = _run(capsys, argv + ["--epsilon", "0.02", "--sigma", "3.1", "--no-shift"])
    ref = _check_arrays(
        r, "random_packing", 120, LennardJones({18: (0.02, 3.1)}, cutoff=6.0, shift=False), "LJ"
    )
    shifted = evaluate(
        LennardJones({18: (0.02, 3.1)}, cutoff=6.0), load_structure(MDConfig("random_packing", 120))
    )
    assert abs(float(shifted.energy - ref.energy)) > 1e-3  # --no-shift changed the potential
    # both memory figures, and the ledger's bytes say they are modelled
    assert min(r["peak_memory_bytes_per_rank"]) > 0 and r["serial_peak_memory_bytes"] is None
    assert min(r["peak_rss_bytes_per_rank"]) >= min(r["rss_start_bytes_per_rank"]) > 0
    assert len(r["rss_reset_per_rank"]) == 2 and all(isinstance(v, bool) for v in r["rss_reset_per_rank"])
    assert "modelled" in r["comm_bytes_model"] and r["rss_source"]


def test_lj_per_species(capsys):
    argv = ["lj_mixture", "--atoms", "150", "--steps", "0", "--cutoff", "6.5", *COMMON]
    r = _run(capsys, argv + ["--lj", "Ar:0.011:3.3", "--lj", "Kr:0.016:3.7"])
    pot = LennardJones({18: (0.011, 3.3), 36: (0.016, 3.7)}, cutoff=6.5)
    _check_arrays(r, "lj_mixture", 150, pot, "LJ per species")


def test_option_errors_are_one_line(capsys):
    base = ["md", "--atoms", "32", "--steps", "1", "--ranks", "1"]
    assert main(base + ["--lj", "Xx:1:2"]) == 1
    assert "SYMBOL:EPSILON:SIGMA" in capsys.readouterr().err
    assert main(base + ["--potential", "mpnn", "--epsilon", "0.01"]) == 1
    assert "options of --potential lj" in capsys.readouterr().err


def test_checkpoint_and_restart_from_the_command_line(capsys, tmp_path):
    ck = str(tmp_path / "ck.pt")
    argv = ["random_packing", "--atoms", "160", "--cutoff", "5", "--skin", "0.6", "--ranks", "2", "--json"]
    full = _run(capsys, argv + ["--steps", "20", "--json-arrays"])
    first = _run(capsys, argv + ["--steps", "10", "--checkpoint", ck, "--checkpoint-every", "5"])
    assert first["checkpoint"] == ck and first["start_step"] == 0
    second = _run(capsys, argv + ["--steps", "20", "--restart", ck, "--json-arrays", "--ranks", "1"])
    assert second["start_step"] == 10 and second["steps"] == 20 and second["ranks"] == 1
    for k in ("final_positions", "final_velocities", "final_forces"):
        a, b = (torch.tensor(x[k], dtype=torch.float64) for x in (second, full))
        assert_parity(a, b, what=f"CLI restart {k}", grid="2->1")
    assert main(["md", *argv, "--steps", "20", "--restart", ck, "--thermostat", "langevin"]) == 1
    assert "other integrator settings" in capsys.readouterr().err
