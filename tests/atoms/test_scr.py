"""NPT with stochastic cell rescaling (issue 22): one step against the published equations written
here independently (iso, aniso, tri; the noise drawn from the counter-based RNG by step and
component); under halo decomposition on 1, 2 and 4 ranks equal to the serial run at round-off with
every thermostat and coupling (every thermo row: volume, pressure and the effective energy; the
final positions, velocities and cell) while the box breathes and atoms migrate; a run restarted at
another rank count equals the uninterrupted one (cell and chain in the checkpoint); ``twinshard md
--barostat scr --coupling``. Mutants (tools/mutations.py): the virial not all-reduced, the cell set
on one rank, the noise keyed by rank, the anisotropic coupling applying the isotropic mean."""

import json
import math

import pytest
import torch
import torch.distributed as dist
from ase import units

from twinshard import rng
from twinshard.atoms import run_md
from twinshard.atoms.data.structures import random_packing
from twinshard.atoms.dynamics.driver import DistributedEngine
from twinshard.atoms.dynamics.md import (
    SerialEngine,
    ThermoLog,
    check_restart,
    checkpoint_state,
    load_checkpoint,
    maxwell_boltzmann,
    simulate,
)
from twinshard.atoms.dynamics.scr import SCR_STREAM, StochasticCellRescaling
from twinshard.atoms.parallel.distributed import DistributedPotential
from twinshard.atoms.parallel.sharded import ShardedSystem
from twinshard.atoms.potentials import LennardJones
from twinshard.cli import main
from twinshard.testing import assert_parity, assert_shards_cover, rows_of, run_on_world

CUTOFF, SKIN, STEPS = 5.0, 0.6, 40
# a hot liquid (160 atoms from 200 K) at 400 K and 2000 bar with a fast barostat (pdamp 100 fs,
# beta_T 1e-4 / bar): the volume grows by > 10% within 40 steps, atoms migrate on 2 and 4 ranks
SCR = dict(dt=4.0, temperature=400.0, pressure=2000.0, pdamp=100.0, compressibility=1e-4)
THERMO = dict(friction=0.02, tdamp=40.0)
COLUMNS = ThermoLog.NPT_COLUMNS


def _start():
    s = random_packing(160, seed=1)
    s.velocities = maxwell_boltzmann(s.masses, s.ids, 200.0, seed=1)
    return s


def _table(log: ThermoLog) -> torch.Tensor:
    return torch.tensor([[row[c] for c in COLUMNS] for row in log.rows], dtype=torch.float64)


def _integ(thermostat: str, coupling: str) -> StochasticCellRescaling:
    return StochasticCellRescaling(**SCR, thermostat=thermostat, coupling=coupling, **THERMO, seed=3)


# ------------------------------------------------------------------ one step: the equations


class _FakeEngine:
    """A serial stand-in with a given virial (no potential): the barostat sees only this."""

    rank, n_ranks = 0, 1

    def __init__(self, cell, virial, n):
        self.cell, self.virial, self.n_atoms = cell, virial, n
        self.pbc = torch.tensor([True, True, True])
        self.need_virial = False

    def reduce_sum(self, x):
        return x

    def set_cell(self, cell):
        self.cell = cell


def _oracle_strain(coupling, p_tensor, p0, vol, beta, tau, dt, kT, xi):
    """The paper's increments, written out per component: iso d ln V = beta/tau (P - P0) dt +
    sqrt(2 kT beta dt / (V tau)) xi, E = d ln V / 3 I; aniso/tri E_ij = beta/(3 tau) (P_ij - P0
    delta_ij) dt + sqrt(2 kT beta dt / (3 V tau)) xi_ij on the diagonal / the lower triangle."""
    e = [[0.0] * 3 for _ in range(3)]
    if coupling == "iso":
        p = (p_tensor[0][0] + p_tensor[1][1] + p_tensor[2][2]) / 3.0
        dlnv = beta / tau * (p - p0) * dt + math.sqrt(2.0 * kT * beta * dt / (vol * tau)) * xi[0]
        for i in range(3):
            e[i][i] = dlnv / 3.0
        return e
    comps = (
        [(0, 0), (1, 1), (2, 2)] if coupling == "aniso" else [(0, 0), (1, 0), (1, 1), (2, 0), (2, 1), (2, 2)]
    )
    for k, (i, j) in enumerate(comps):
        pij = 0.5 * (p_tensor[i][j] + p_tensor[j][i]) - (p0 if i == j else 0.0)
        e[i][j] = beta / (3.0 * tau) * pij * dt + math.sqrt(2.0 * kT * beta * dt / (3.0 * vol * tau)) * xi[k]
    return e


@pytest.mark.parametrize("coupling", ["iso", "aniso", "tri"])
@pytest.mark.parametrize("temperature", [0.0, 300.0])
def test_one_step_equals_the_published_increments(coupling, temperature):
    """An anisotropic, sheared virial on a triclinic cell; the new cell, positions and velocities
    against the formulas above (at T = 0 the deterministic drift alone, so a coupling that used the
    isotropic mean of the pressure, or the wrong tensor components, is seen at once)."""
    cell = torch.tensor([[12.0, 0.0, 0.0], [1.5, 11.0, 0.0], [-0.8, 0.9, 13.0]], dtype=torch.float64)
    virial = torch.tensor([[3.0, 0.7, -0.4], [0.7, -2.0, 0.3], [-0.4, 0.3, 1.0]], dtype=torch.float64)
    n = 5
    g = torch.Generator().manual_seed(0)
    x = torch.rand(n, 3, generator=g, dtype=torch.float64) @ cell
    v = 0.01 * torch.randn(n, 3, generator=g, dtype=torch.float64)
    f = 0.1 * torch.randn(n, 3, generator=g, dtype=torch.float64)
    m = torch.full((n,), 40.0, dtype=torch.float64)
    ids = torch.arange(n)
    dt, step = 2.0, 7
    integ = StochasticCellRescaling(
        dt, temperature, 500.0, thermostat="none", pdamp=50.0, compressibility=3e-3, coupling=coupling, seed=5
    )
    eng = _FakeEngine(cell.clone(), virial, n)
    integ.bind(eng)
    x1, v1, _ = integ.first(x, v, f, m, ids, step)

    vh = v + 0.5 * dt * units.fs * f / m[:, None]
    mvv = (m[:, None, None] * vh[:, :, None] * vh[:, None, :]).sum(0)
    vol = float(torch.linalg.det(cell))
    p_tensor = ((virial + mvv) / vol).tolist()
    ncomp = {"iso": 1, "aniso": 3, "tri": 6}[coupling]
    xi = rng.normal(5, SCR_STREAM, step, torch.arange(ncomp)).tolist()
    e = torch.tensor(
        _oracle_strain(
            coupling,
            p_tensor,
            500.0 * units.bar,
            vol,
            3e-3 / units.bar,
            50.0 * units.fs,
            dt * units.fs,
            units.kB * temperature,
            xi,
        ),
        dtype=torch.float64,
    )
    mm = torch.linalg.matrix_exp(e)
    mi = torch.linalg.inv(mm).T
    want = {
        "cell": cell @ mm,
        "positions": x @ mm + 0.5 * dt * units.fs * vh @ (mm + mi),
        "velocities": vh @ mi,
    }
    got = {"cell": eng.cell, "positions": x1, "velocities": v1}
    for key in want:
        assert_parity(
            got[key], want[key], what=f"SCR {coupling} T={temperature} one step {key}", grid="serial"
        )
    # anti-vacuous: the cell moved, and shape moved only where the coupling allows it
    strain = (cell.inverse() @ eng.cell - torch.eye(3, dtype=torch.float64)).abs()
    assert float(strain.max()) > 1e-4
    diag = torch.diagonal(strain)
    if coupling == "iso":
        assert float(diag.max() - diag.min()) < 1e-12
    else:
        assert float(diag.max() - diag.min()) > 1e-5  # the axes respond to their own pressure
    off = strain - torch.diag(diag)
    assert (float(off.max()) > 1e-5) == (coupling == "tri")


def test_settings_checkpoint_and_bad_input():
    integ = _integ("nose-hoover", "tri")
    assert integ.dynamic == ("cell", "eta", "p_eta")
    integ.load_state({**integ.state(), "cell": [10.0, 0, 0, 0, 10, 0, 0, 0, 10], "eta": [0.1, 0, 0]})
    state = checkpoint_state(random_packing(20, seed=3), 7, integ, -0.25)
    assert state["integrator"]["cell"][0] == 10.0 and state["integrator"]["eta"][0] == 0.1
    check_restart(state, _integ("nose-hoover", "tri"))  # the variables are not settings
    for other, match in [
        (_integ("nose-hoover", "aniso"), "coupling: checkpoint 'tri', now 'aniso'"),
        (_integ("langevin", "tri"), "thermostat: checkpoint 'nose-hoover', now 'langevin'"),
    ]:
        with pytest.raises(ValueError, match=match):
            check_restart(state, other)
    with pytest.raises(ValueError, match="no stochastic-cell-rescaling state"):
        _integ("langevin", "iso").load_state({"cell": [1.0, 2.0]})
    for bad, match in [
        (dict(coupling="xyz"), "coupling must be one of"),
        (dict(thermostat="berendsen"), "thermostats with one of"),
        (dict(compressibility=0.0), "compressibility must be > 0"),
        (dict(pdamp=-1.0), "pdamp must be > 0"),
    ]:
        with pytest.raises(ValueError, match=match):
            StochasticCellRescaling(**{**SCR, **bad})


# ------------------------------------------------------------------ distributed == serial


def _rank_md(thermostat, coupling):
    s = _start() if dist.get_rank() == 0 else None
    grid = (2, 2, 1) if dist.get_world_size() == 4 else None  # more faces than slabs
    sh = ShardedSystem.scatter(s, cutoff=CUTOFF, skin=SKIN, grid=grid)
    engine = DistributedEngine(sh, DistributedPotential(LennardJones(cutoff=CUTOFF)))
    integ = _integ(thermostat, coupling)
    out = simulate(engine, integ, STEPS)
    return {
        "thermo": _table(out["thermo"]),
        "cell": sh.cell.clone(),
        "partition_cell": sh.partition.cell.clone(),
        "ids": sh.ids,
        "positions": sh.positions,
        "velocities": sh.velocities,
        "migrations": sh.migrations,
        "builds": sh.builds,
    }


_SERIAL: dict = {}


def _serial(thermostat, coupling):
    key = (thermostat, coupling)
    if key not in _SERIAL:
        engine = SerialEngine(LennardJones(cutoff=CUTOFF), _start(), skin=SKIN)
        out = simulate(engine, _integ(thermostat, coupling), STEPS)
        _SERIAL[key] = (_table(out["thermo"]), engine.system)
    return _SERIAL[key]


CASES = [
    (1, "langevin", "tri"),
    (2, "langevin", "tri"),
    (4, "langevin", "tri"),
    (2, "nose-hoover", "aniso"),
    (4, "none", "iso"),
]


@pytest.mark.parametrize(("ranks", "thermostat", "coupling"), CASES)
def test_scr_equals_serial_at_round_off(ranks, thermostat, coupling):
    res = run_on_world(_rank_md, ranks, thermostat, coupling)
    thermo, final = _serial(thermostat, coupling)
    where, grid = f"scr {thermostat}/{coupling} P={ranks}, {STEPS} steps", str(ranks)
    for j, name in enumerate(COLUMNS):  # every row: step 0, 1, ..., STEPS
        assert_parity(
            res[0]["thermo"][:, j], thermo[:, j], what=f"thermo {name} per step, {where}", grid=grid
        )
    for key in ("positions", "velocities"):
        pieces = [(r[key], rows_of(r["ids"], final.ids)) for r in res]
        assert_shards_cover(pieces, getattr(final, key), f"final owned {key} {where}", disjoint=ranks > 1)
    for r in res:
        assert_parity(r["cell"], final.cell, what=f"cell, {where}", grid=grid)
    for r in res[1:]:  # global values and the cell: identical on every rank
        assert torch.equal(r["thermo"], res[0]["thermo"]) and torch.equal(r["cell"], res[0]["cell"])
    for r in res:  # the partition follows the cell
        assert torch.equal(r["partition_cell"], r["cell"].to(r["partition_cell"].dtype))
    t = res[0]["thermo"]
    vol, cons, e = t[:, 6], t[:, 5], t[:, 2] + t[:, 3]
    # anti-vacuous: the box breathed; after the first violent steps of the hot random packing
    # (first-order cell moves of a few percent each), the effective energy moves far less than
    # the energy (measured: 0.02 eV against 2-6 eV over steps 10..40)
    assert abs(float(vol[-1] / vol[0]) - 1.0) > 0.05, vol
    cons, e = cons[10:], e[10:]
    assert float((cons - cons[0]).abs().max()) < 0.05 * float((e - e[0]).abs().max())
    if coupling == "tri":
        c = res[0]["cell"]
        assert float((c - torch.diag(torch.diagonal(c))).abs().max()) > 1e-3  # the cell sheared
    if ranks > 1:
        assert res[0]["migrations"] > 0, "no atom changed owner: this run does not exercise migration"


# ------------------------------------------------------------------ restart, run_md, the CLI


def test_restart_at_another_rank_count_equals_the_uninterrupted_run(tmp_path):
    """run_md: 40 steps on 4 ranks vs 20 on 4, checkpoint, 20 more on 2 (Nose-Hoover chain and
    triclinic cell restored; the noise of steps 21..40 keyed by the step)."""
    full_ck, ck, log = tmp_path / "full.pt", tmp_path / "ck.pt", tmp_path / "t.log"
    lj = LennardJones(cutoff=CUTOFF)
    kw = dict(thermostat="nose-hoover", barostat="scr", coupling="tri", seed=3, skin=SKIN, thermo_every=5)
    kw.update({k: SCR[k] for k in ("dt", "temperature", "pressure", "pdamp", "compressibility")})
    kw["tdamp"] = THERMO["tdamp"]
    full = run_md(_start(), lj, ranks=4, steps=40, checkpoint=full_ck, **kw)
    run_md(_start(), lj, ranks=4, steps=20, checkpoint=ck, thermo=log, **kw)
    saved = load_checkpoint(ck)["integrator"]
    assert saved["kind"] == "npt-scr" and abs(saved["p_eta"][0]) > 0 and abs(saved["cell"][3]) > 0
    second = run_md(None, lj, ranks=2, steps=40, restart=ck, thermo=log, **kw)
    assert second.start_step == 20 and second.ranks == 2
    grid = "4->2"
    for key in ("positions", "velocities", "cell"):
        assert_parity(getattr(second.system, key), getattr(full.system, key), what=f"SCR {key}", grid=grid)
    rows = [_table(r.thermo) for r in (full, second)]
    assert torch.equal(rows[0][4:, 0], rows[1][:, 0])  # steps 20, 25, ..., 40
    for j, name in enumerate(COLUMNS[2:], 2):
        assert_parity(rows[1][:, j], rows[0][4:, j], what=f"SCR thermo {name}, steps 20..40", grid=grid)
    text = log.read_text().splitlines()  # one header, rows 0..40 every 5
    assert text[0].split()[1:] == list(COLUMNS) and len(text) == 1 + 9
    assert full.info["final_volume"] == pytest.approx(float(full.thermo.rows[-1]["volume"]))


def test_cli_scr_check_serial_and_json(capsys):
    """``twinshard md --thermostat langevin --pressure 2000 --barostat scr --coupling aniso``."""
    argv = "md random_packing --atoms 160 --cutoff 5 --skin 0.6 --temperature 400 --dt 4 --seed 1"
    argv += " --thermostat langevin --friction 0.02 --pressure 2000 --barostat scr --coupling aniso"
    argv += " --pdamp 100 --compressibility 1e-4 --steps 20 --check-serial --json --thermo-every 5 --ranks 2"
    assert main(argv.split()) == 0
    r = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert r["barostat"] == "scr" and r["coupling"] == "aniso" and r["atoms_conserved"]
    assert r["energy_rel_error"] <= 1e-12 and r["max_position_error"] <= 1e-9, r
    assert r["final_volume"] > 0 and isinstance(r["mean_pressure"], float)
    for bad, match in [
        (" --compressibility -1", "compressibility must be > 0"),
        (" --barostat mtk", "--barostat mtk couples isotropically"),
    ]:
        assert main((argv + bad).split()) != 0  # the error on every rank, reported once
        assert match in capsys.readouterr().err
