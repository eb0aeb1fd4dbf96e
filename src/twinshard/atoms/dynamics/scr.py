"""NPT with stochastic cell rescaling (Bernetti and Bussi, J. Chem. Phys. 153, 114107 (2020); the
anisotropic and triclinic extension of Del Tatto, Raiteri, Bernetti and Bussi, Appl. Sci. 12, 1139
(2022)), with any thermostat: none, Langevin or a Nose-Hoover chain.

The cell is a first-order (overdamped) stochastic variable. Positions (rows) and the cell's rows are
deformed by ``M = exp(E)`` and velocities by ``M^-T`` (a canonical point transformation), with the
log-strain increment ``E`` of one of three couplings (row convention of
:mod:`twinshard.atoms.potentials.base`: ``x -> x M``):

- ``iso``: ``E = (e / 3) I`` with ``e = d ln V`` (the paper's equation):
  ``e = (beta_T / tau_p) (P - P0) dt + sqrt(2 kT beta_T dt / (V tau_p)) xi``,
  ``P = tr(W + sum m v v) / (3V)``;
- ``aniso``: ``E`` diagonal, three components (the box lengths along x, y, z);
- ``tri``: ``E`` lower triangular, six components (the cell keeps the lower-triangular form of
  LAMMPS/GROMACS if it has it, and never rotates),

the last two ``E_ij = (beta_T / (3 tau_p)) (P_ij - P0 delta_ij) dt + sqrt(2 kT beta_T dt /
(3 V tau_p)) xi_ij`` with the pressure tensor ``P = (W + sum m v v) / V`` (``W`` the virial), so a
uniform excess pressure relaxes ``ln V`` at the rate of ``iso``. These are Ito equations for an
overdamped cell whose stationary distribution is ``exp(-(U + K + P0 V) / kT)`` over the volume
(``iso``), the three box lengths (``aniso``) or the box lengths and the tilts as fractions of the
lengths they lean along (``tri``: the reference measure ``dH / (h_xx^2 h_yy)`` of the six entries of
a lower-triangular cell): for that choice the Jacobian terms and the Ito drift of the
volume-dependent noise cancel (derivation in the README's NPT section), so the drift is the pressure
difference alone, as in the paper.

One step (``first`` | forces | ``second``): ``T(dt/2) B(dt/2) C(dt) | B(dt/2) T(dt/2)``, with
``T`` the thermostat's half-step (none; Langevin's exact Ornstein-Uhlenbeck step, i.e. OBABO; the
Nose-Hoover chain's ``NHC(dt/2)``), ``B`` the half kick and ``C`` the drift fused with the cell move
as in the paper's time-reversible ("T") integrator: ``x <- x M + (dt/2) v (M + M^-T)``,
``v <- v M^-T``, ``cell <- cell M``. The drift of ``E`` is taken from the pressure before the move
(the virial of the last force evaluation and the kinetic tensor after the kick).

Effective energy (the conserved column): ``E_pot + E_kin + P0 V`` plus the heat of the thermostat
and the barostat's own balance. For a move ``b -> a`` with Gaussian increments the barostat adds
``kT ln[p(a -> b) / p(b -> a)]`` and the Jacobians; in closed form the "heat" this module returns is
``-P0 dV + kT (1 + n/2) d ln V + sum (E - c_b f_b dt)^2 / (4 c_b dt) - sum (E + c_a f_a dt)^2 /
(4 c_a dt)`` with ``n`` the number of components, ``f = V (P - P0)`` the generalized force (the
trace/3 for ``iso``) and ``c = beta_T / (n_f V tau_p)`` (``n_f`` = 1 iso, 3 otherwise), the first
three terms returned by ``first`` and the last by ``second`` (it needs the new forces). Exact
sampling would keep it constant; its drift measures the integration error, as for Bussi's
thermostat. (For ``iso`` it is the paper's effective energy written for the variable ``ln V``
instead of ``sqrt(V)``.)

Under decomposition every rank holds the same replicated values (the cell, the barostat draws, the
chain) and computes them from the same agreed numbers: the virial (all-reduced by the distributed
potential with the energy), and the global kinetic tensor ``sum m v v`` (one all-reduce of 9 numbers
before the move, one after it). The random increments are drawn from :mod:`twinshard.rng` keyed by
``(seed, SCR_STREAM, step, component)``: the same numbers on every rank and at any rank count; the
Langevin noise by ``(seed, LANGEVIN_STREAM, atom id, step, component + 3 half)``.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from ase import units

from twinshard import rng
from twinshard.atoms.dynamics.integrators import (
    LANGEVIN_STREAM,
    NoseHooverChain,
    VelocityVerlet,
    kinetic_energy,
)

__all__ = ["SCR_STREAM", "COUPLINGS", "StochasticCellRescaling"]

SCR_STREAM = 0x53435231  # "SCR1": the barostat's increments of the counter-based RNG
COUPLINGS = ("iso", "aniso", "tri")
THERMOSTATS = ("none", "langevin", "nose-hoover")
_LOWER = [(i, j) for i in range(3) for j in range(i + 1)]  # tri: (0,0) (1,0) (1,1) (2,0) (2,1) (2,2)


def _serial_sum(x: torch.Tensor) -> torch.Tensor:
    return x


class StochasticCellRescaling(VelocityVerlet):
    """NPT: stochastic cell rescaling with a thermostat (see the module docstring).

    Args:
        dt: time step in fs.
        temperature: bath temperature in K (the barostat's noise; the thermostat's bath). 0 gives a
            deterministic (Berendsen-like) cell.
        pressure: external pressure in bar (hydrostatic ``P0 I`` for every coupling).
        thermostat: ``"none"``, ``"langevin"`` or ``"nose-hoover"``.
        pdamp: the barostat's relaxation time ``tau_p`` in fs (default ``1000 dt``).
        compressibility: ``beta_T`` in 1/bar (default 4.5e-5, water's; only ``beta_T / tau_p``
            enters the dynamics, the sampled ensemble does not depend on it).
        coupling: ``"iso"``, ``"aniso"`` or ``"tri"``.
        friction: Langevin collision rate in 1/fs; ``tdamp``, ``chain``: the Nose-Hoover chain's
            time scale (default ``100 dt``) and length.
        seed: the barostat's and Langevin's noise seed.

    Placements: the per-atom tensors given to ``first``/``second`` are this rank's owned atoms
    (``Shard(0)``); the cell, ``E`` and the chain are replicated. Collectives per step: two
    all-reduces of 9 numbers (the kinetic tensor) plus the chain's two of one scalar; memory: the
    owned atoms' tensors only.
    """

    barostat = True

    def __init__(
        self,
        dt: float = 2.0,
        temperature: float = 300.0,
        pressure: float = 1.01325,
        thermostat: str = "langevin",
        pdamp: float | None = None,
        compressibility: float = 4.5e-5,
        coupling: str = "iso",
        friction: float = 0.01,
        tdamp: float | None = None,
        chain: int = 3,
        seed: int = 0,
    ) -> None:
        super().__init__(dt)
        pdamp = 1000.0 * self.dt_fs if pdamp is None else float(pdamp)
        if thermostat not in THERMOSTATS:
            raise ValueError(f"--barostat scr thermostats with one of {THERMOSTATS}, got {thermostat!r}")
        if coupling not in COUPLINGS:
            raise ValueError(f"the barostat's coupling must be one of {COUPLINGS}, got {coupling!r}")
        if not (pdamp > 0 and math.isfinite(pdamp)):
            raise ValueError(f"the pressure coupling time pdamp must be > 0 fs, got {pdamp}")
        if not (float(compressibility) > 0 and math.isfinite(float(compressibility))):
            raise ValueError(f"the compressibility must be > 0 (1/bar), got {compressibility}")
        if not math.isfinite(float(pressure)):
            raise ValueError(f"pressure must be a finite number of bar, got {pressure}")
        if not (float(temperature) >= 0 and math.isfinite(float(temperature))) or float(friction) < 0:
            raise ValueError(f"temperature and friction must be >= 0, got {temperature}, {friction}")
        self.temperature, self.pressure_bar = float(temperature), float(pressure)
        self.thermostat_kind, self.coupling = thermostat, coupling
        self.pdamp_fs, self.compressibility = pdamp, float(compressibility)
        self.friction, self.seed = float(friction), int(seed)
        self.kT = units.kB * self.temperature
        self.p_ext = self.pressure_bar * units.bar  # eV / A^3
        self.beta = self.compressibility / units.bar  # A^3 / eV
        self.tau = self.pdamp_fs * units.fs
        self.n_comp = {"iso": 1, "aniso": 3, "tri": 6}[coupling]
        self._comps = torch.arange(self.n_comp, dtype=torch.int64)
        self.thermostat = thermostat != "none"
        self.chain: NoseHooverChain | None = None
        if thermostat == "nose-hoover":
            self.chain = NoseHooverChain(dt, self.temperature, tdamp, chain)
        # Langevin's O(dt/2): v <- c1 v + c2 sqrt(kT/m) xi
        self.c1 = math.exp(-0.5 * self.friction * self.dt_fs)
        self.c2 = math.sqrt(1.0 - self.c1 * self.c1)
        self.cell_now = [0.0] * 9  # zeros: not set yet (bind takes the engine's cell)
        self.dynamic = ("cell",) + (("eta", "p_eta") if self.chain is not None else ())
        self._engine: Any = None
        self._reduce_sum: Any = _serial_sum
        self._rank = 0
        self._move: tuple[torch.Tensor, float] | None = None  # (E, V_b) of this step's cell move

    # ---------------------------------------------------------------- setup
    def bind(self, engine: Any) -> None:
        pbc = [bool(p) for p in torch.as_tensor(engine.pbc).tolist()]
        if not all(pbc):
            raise ValueError(
                f"a barostat needs a cell periodic along all three axes, got pbc={pbc}: run NVT/NVE "
                "(no --pressure) for a slab, wire or molecule"
            )
        if not getattr(engine, "cell_can_change", True):
            raise ValueError(
                f"a barostat changes the cell, which this engine ({type(engine).__name__}) cannot"
            )
        if not any(self.cell_now):  # a fresh run: the engine's cell; a restart loaded its own
            self.cell_now = [float(c) for c in engine.cell.detach().double().cpu().reshape(9).tolist()]
        if abs(float(torch.linalg.det(self.cell()))) == 0.0:
            raise ValueError("a barostat needs a cell with a volume (its lattice vectors are coplanar)")
        self._engine, self._reduce_sum, self._rank = engine, engine.reduce_sum, int(engine.rank)
        if self.chain is not None:
            self.chain.zero_momentum = self.zero_momentum  # its N_dof
            self.chain.bind(engine)
        engine.need_virial = True

    def cell(self) -> torch.Tensor:
        """The current cell (fp64, CPU; rows are lattice vectors), replicated."""
        return torch.tensor(self.cell_now, dtype=torch.float64).reshape(3, 3)

    def volume(self) -> float:
        return abs(float(torch.linalg.det(self.cell())))

    def energy(self) -> float:
        """The extended energy's terms beyond the particles' that are state functions: ``P0 V``
        and the Nose-Hoover chain's energy (eV)."""
        chain = self.chain.energy() if self.chain is not None else 0.0
        return self.p_ext * self.volume() + chain

    # ---------------------------------------------------------------- pieces
    def _kinetic_tensor(self, v: torch.Tensor, masses: torch.Tensor) -> torch.Tensor:
        """The GLOBAL ``sum m v v^T`` (fp64, CPU, replicated): one all-reduce of 9 numbers."""
        local = torch.einsum("n,ni,nj->ij", masses, v, v).reshape(9)
        return self._reduce_sum(local).detach().double().cpu().reshape(3, 3)

    def _force(self, mvv: torch.Tensor) -> tuple[torch.Tensor, float]:
        """The generalized forces ``V (P - P0)`` on the components of ``E`` (eV) and ``c``."""
        vir = self._engine.virial
        if vir is None:
            raise RuntimeError("the engine returned no virial: a barostat needs compute_stress")
        w = vir.detach().double().cpu()
        s = w + mvv
        vol = self.volume()
        if self.coupling == "iso":
            f = (torch.diagonal(s).sum() / 3.0 - self.p_ext * vol).reshape(1)
            return f, self.beta / (vol * self.tau)
        s = 0.5 * (s + s.T) - self.p_ext * vol * torch.eye(3, dtype=torch.float64)
        if self.coupling == "aniso":
            return torch.diagonal(s).clone(), self.beta / (3.0 * vol * self.tau)
        return torch.stack([s[i, j] for i, j in _LOWER]), self.beta / (3.0 * vol * self.tau)

    def _strain(self, e: torch.Tensor) -> torch.Tensor:
        """The 3x3 log-strain ``E`` of the components ``e``."""
        if self.coupling == "iso":
            return torch.eye(3, dtype=torch.float64) * (e[0] / 3.0)
        if self.coupling == "aniso":
            return torch.diag(e)
        out = torch.zeros(3, 3, dtype=torch.float64)
        for k, (i, j) in enumerate(_LOWER):
            out[i, j] = e[k]
        return out

    def _langevin(self, v: torch.Tensor, masses: torch.Tensor, ids: torch.Tensor, step: int, half: int):
        comp = torch.arange(3, dtype=torch.int64, device=ids.device)[None, :] + 3 * half
        xi = rng.normal(
            self.seed,
            LANGEVIN_STREAM,
            ids.to(torch.int64)[:, None],
            int(step),
            comp,
            dtype=v.dtype,
            device=v.device,
        )
        v_new = self.c1 * v + self.c2 * torch.sqrt(self.kT / masses[:, None]) * xi
        return v_new, kinetic_energy(v_new, masses) - kinetic_energy(v, masses)

    def _thermostat(
        self, v: torch.Tensor, masses: torch.Tensor, ids: torch.Tensor, step: int, half: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        zero = torch.zeros((), dtype=v.dtype, device=v.device)
        if self.thermostat_kind == "langevin":
            return self._langevin(v, masses, ids, step, half)
        if self.chain is not None:
            return self.chain.half_step(v, masses)
        return v, zero

    def _rank0(self, heat: float, like: torch.Tensor) -> torch.Tensor:
        return torch.tensor(heat if self._rank == 0 else 0.0, dtype=like.dtype, device=like.device)

    # ---------------------------------------------------------------- the step
    def first(
        self,
        positions: torch.Tensor,
        velocities: torch.Tensor,
        forces: torch.Tensor,
        masses: torch.Tensor,
        ids: torch.Tensor,
        step: int,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        v, heat_t = self._thermostat(velocities, masses, ids, step, 0)
        v = v + (0.5 * self.dt) * forces / masses[:, None]
        f_b, c_b = self._force(self._kinetic_tensor(v, masses))
        xi = rng.normal(self.seed, SCR_STREAM, int(step), self._comps, dtype=torch.float64)
        e = c_b * f_b * self.dt + math.sqrt(2.0 * self.kT * c_b * self.dt) * xi
        big = self._strain(e)
        m = torch.linalg.matrix_exp(big)
        m_it = torch.linalg.matrix_exp(-big.T)  # M^-T
        v_b = self.volume()
        self.cell_now = (self.cell() @ m).reshape(9).tolist()
        v_a = self.volume()
        md, mi = m.to(positions.dtype).to(positions.device), m_it.to(positions.dtype).to(positions.device)
        x = positions @ md + (0.5 * self.dt) * (v @ (md + mi))
        v = v @ mi
        self._engine.set_cell(self.cell().to(positions.dtype))  # every rank, the same cell
        dlnv = math.log(v_a / v_b)
        heat = -self.p_ext * (v_a - v_b) + self.kT * (1.0 + 0.5 * self.n_comp) * dlnv
        heat += float(((e - c_b * f_b * self.dt) ** 2).sum()) / (4.0 * c_b * self.dt)
        self._move = (e, v_b)
        return x, v, heat_t + self._rank0(heat, v)

    def second(
        self,
        velocities: torch.Tensor,
        forces: torch.Tensor,
        masses: torch.Tensor,
        ids: torch.Tensor,
        step: int,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if self._move is None:
            raise RuntimeError("StochasticCellRescaling.second before first")
        e, _ = self._move
        self._move = None
        f_a, c_a = self._force(self._kinetic_tensor(velocities, masses))
        heat = -float(((e + c_a * f_a * self.dt) ** 2).sum()) / (4.0 * c_a * self.dt)
        v = velocities + (0.5 * self.dt) * forces / masses[:, None]
        v, heat_t = self._thermostat(v, masses, ids, step, 1)
        return v, heat_t + self._rank0(heat, v)

    # ---------------------------------------------------------------- state
    def state(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "kind": "npt-scr",
            "dt_fs": self.dt_fs,
            **self._settings(),
            "temperature": self.temperature,
            "pressure_bar": self.pressure_bar,
            "thermostat": self.thermostat_kind,
            "coupling": self.coupling,
            "pdamp_fs": self.pdamp_fs,
            "compressibility": self.compressibility,
            "seed": self.seed,
            "cell": list(self.cell_now),
        }
        if self.thermostat_kind == "langevin":
            out["friction"] = self.friction
        if self.chain is not None:
            ch = self.chain.state()
            out.update(tdamp_fs=ch["tdamp_fs"], chain=ch["chain"], eta=ch["eta"], p_eta=ch["p_eta"])
        return out

    def load_state(self, state: dict[str, Any]) -> None:
        want = {"cell": 9}
        if self.chain is not None:
            want.update(eta=self.chain.chain, p_eta=self.chain.chain)
        got = {}
        for name, n in want.items():
            values = [float(v) for v in state.get(name, ())]
            if len(values) != n:
                raise ValueError(
                    f"the checkpoint holds no stochastic-cell-rescaling state ({name}: {len(values)} "
                    f"values, expected {n}): it was not written by this integrator"
                )
            got[name] = values
        self.cell_now = got.pop("cell")
        if self.chain is not None:
            self.chain.load_state(got)
