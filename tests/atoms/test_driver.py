"""The MD driver: 4-rank trajectories equal serial ones; `twinshard md --json`; clear errors.

Bounds are the issue's: energy relative error <= 1e-12, forces and stress <= 1e-10 (max abs),
positions after 200 steps <= 1e-9 A.
"""

import argparse
import json

import pytest
import torch

from twinshard.atoms.data.io import read_trajectory, write
from twinshard.atoms.data.structures import random_packing
from twinshard.atoms.dynamics.driver import MDConfig, md_rank, result_keys
from twinshard.cli.md import add_md_parser, run_md
from twinshard.runtime import RankFailure
from twinshard.testing import assert_parity, run_on_world, tolerance

# a small hot liquid: atoms cross subdomain faces within 200 steps (migrations > 0)
ARGS = [
    "md",
    "random_packing",
    "--atoms",
    "160",
    "--cutoff",
    "5.0",
    "--skin",
    "0.6",
    "--temperature",
    "200",
    "--dt",
    "4",
    "--steps",
    "200",
    "--ranks",
    "4",
    "--seed",
    "1",
    "--check-serial",
    "--thermo-every",
    "50",
]


def _parse(argv):
    parser = argparse.ArgumentParser()
    add_md_parser(parser.add_subparsers())
    return parser.parse_args(argv)


def _check(r, ranks=4):
    assert r["ranks"] == ranks and r["atoms"] == 160 and r["steps"] == 200
    assert r["energy_rel_error"] <= 1e-12
    assert r["max_force_error"] <= 1e-10 and r["max_stress_error"] <= 1e-10
    assert r["max_position_error"] <= 1e-9
    assert r["migrations"] > 0 and r["atoms_conserved"]
    assert sum(r["owned_atoms_per_rank"]) == 160 and max(r["owned_atoms_per_rank"]) < 160
    assert len(r["halo_atoms_per_rank"]) == ranks and min(r["halo_atoms_per_rank"]) > 0


def test_cli_json_nve_on_4_ranks_equals_serial(capsys, tmp_path):
    traj, thermo = tmp_path / "traj.extxyz", tmp_path / "thermo.txt"
    extra = ["--json", "--trajectory", str(traj), "--trajectory-every", "100", "--thermo", str(thermo)]
    args = _parse(ARGS + extra)
    out = run_md(args)
    last = capsys.readouterr().out.strip().splitlines()[-1]
    r = json.loads(last)
    assert set(result_keys()) <= set(r) and r == json.loads(json.dumps(out))
    _check(r)
    assert r["potential"] == "lj" and r["thermostat"] == "none"
    assert abs(r["conserved_drift"]) < 0.05 * abs(r["energy"] - r["final_potential"]) + 1e-3
    frames = read_trajectory(traj)  # gathered on rank 0 at steps 0, 100, 200
    assert len(frames) == 3 and all(torch.equal(f.ids, torch.arange(160)) for f in frames)
    assert len(thermo.read_text().splitlines()) == 1 + 5  # header + steps 0, 50, ..., 200


def test_cli_arrays_of_4_ranks_equal_the_serial_cli_run(capsys):
    """The 4-rank CLI run against the serial CLI run through the harness: final positions,
    velocities and forces by atom id, energies, stress (evidence lines, round-off gate)."""
    runs = {}
    for ranks in ("4", "1"):
        argv = [a for a in ARGS if a != "--check-serial"] + ["--json", "--json-arrays"]
        argv[argv.index("--ranks") + 1] = ranks
        run_md(_parse(argv))
        runs[ranks] = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    dist_, ser = runs["4"], runs["1"]
    assert dist_["migrations"] > 0 and dist_["ranks"] == 4 and ser["ranks"] == 1
    assert dist_["final_ids"] == ser["final_ids"] == list(range(160))

    def f64(x):  # JSON numbers are Python floats (fp64): keep them so
        return torch.tensor(x, dtype=torch.float64)

    for key in ("final_positions", "final_velocities", "final_forces", "final_stress"):
        what = f"md CLI 4 ranks vs serial, 200 steps: {key}"
        assert_parity(f64(dist_[key]), f64(ser[key]), what=what, grid="4")
    for key in ("energy", "final_potential", "final_temperature"):
        assert_parity(f64(dist_[key]), f64(ser[key]), what=f"md CLI {key}", grid="4")
    # the drift is a difference of two conserved energies: its round-off scales with theirs
    scale = max(abs(ser["energy"]), abs(ser["final_potential"]), 1.0)
    budget = tolerance(torch.float64, scale).atol
    why = f"difference of two energies of magnitude <= {scale:.3g}: twice their round-off budget"
    assert_parity(
        f64(dist_["conserved_drift"]),
        f64(ser["conserved_drift"]),
        what="md CLI conserved_drift",
        grid="4",
        rtol=0.0,
        atol=2 * budget,
        why=why,
    )


def test_langevin_on_4_ranks_equals_serial():
    cfg = MDConfig(
        structure="random_packing",
        atoms=160,
        cutoff=5.0,
        skin=0.6,
        temperature=200.0,
        dt=4.0,
        steps=200,
        seed=1,
        thermostat="langevin",
        friction=0.05,
        check_serial=True,
        thermo_every=50,
    )
    r = run_on_world(md_rank, 4, cfg)[0]
    _check(r)
    assert r["thermostat"] == "langevin"


def _bad_file(tmp_path, kind):
    s = random_packing(40, seed=0)
    path = tmp_path / f"{kind}.extxyz"
    if kind == "nan":
        s.positions[3, 1] = float("nan")  # System refuses NaN: write through ASE directly
        atoms = random_packing(40, seed=0).to_ase()
        atoms.positions[3, 1] = float("nan")
        atoms.write(path)
    elif kind == "mass":
        atoms = s.to_ase()
        atoms.numbers[5] = 0
        del atoms.arrays["masses"]
        atoms.write(path)
    elif kind == "unreadable":
        path.write_text("garbage\n")
    else:
        write(path, s)
    return str(path)


@pytest.mark.parametrize(
    "kind, match",
    [
        ("missing", "does not exist"),
        ("unreadable", "cannot read structure file"),
        ("nan", "NaN"),
        ("mass", "missing mass"),
        ("small", "box is too small for 3 ranks"),  # 40 atoms in a ~12 A box, ghost width 6 A
    ],
)
def test_errors_reach_every_rank(tmp_path, kind, match):
    path = "/nonexistent/x.extxyz" if kind == "missing" else _bad_file(tmp_path, kind)
    cfg = MDConfig(structure=path, steps=2, cutoff=5.0)
    with pytest.raises(RankFailure, match=match) as info:
        run_on_world(md_rank, 3 if kind == "small" else 2, cfg)
    if kind != "small":  # rank 0 read the file; its error is raised on every rank
        assert "rank 0" in str(info.value)
