"""The ensembles by name: :func:`integrator_for` builds the integrator that ``twinshard md``'s
``--thermostat/--pressure/--barostat`` options and ``run_md``'s keywords describe (one mapping
from names to integrators for both)."""

from __future__ import annotations

from twinshard.atoms.dynamics.integrators import IsotropicMTK, Langevin, NoseHooverChain, VelocityVerlet
from twinshard.atoms.dynamics.scr import StochasticCellRescaling

__all__ = ["BAROSTATS", "THERMOSTATS", "integrator_for", "npt_integrator"]

THERMOSTATS = ("none", "langevin", "nose-hoover")  # "nve" is accepted as "none"


def integrator_for(
    thermostat: str,
    dt: float,
    temperature: float,
    friction: float = 0.01,
    seed: int = 0,
    tdamp: float | None = None,
    chain: int = 3,
    pressure: float | None = None,
    barostat: str = "mtk",
    pdamp: float | None = None,
    pchain: int = 3,
    coupling: str = "iso",
    compressibility: float = 4.5e-5,
) -> VelocityVerlet:
    """NVE (``"none"``), Langevin (BAOAB), a Nose-Hoover chain, or with ``pressure`` the NPT
    integrator of ``barostat`` (:func:`npt_integrator`)."""
    if pressure is not None:
        return npt_integrator(
            thermostat,
            barostat,
            dt,
            temperature,
            pressure,
            tdamp,
            pdamp,
            chain,
            pchain,
            coupling=coupling,
            compressibility=compressibility,
            friction=friction,
            seed=seed,
        )
    if thermostat in ("none", "nve"):
        return VelocityVerlet(dt)
    if thermostat == "langevin":
        return Langevin(dt, temperature, friction, seed=seed)
    if thermostat == "nose-hoover":
        return NoseHooverChain(dt, temperature, tdamp, chain)
    raise ValueError(f"unknown thermostat {thermostat!r}; choose 'none', 'langevin' or 'nose-hoover'")


BAROSTATS = ("mtk", "scr")  # isotropic MTK; stochastic cell rescaling (iso, aniso, tri)


def npt_integrator(
    thermostat: str,
    barostat: str,
    dt: float,
    temperature: float,
    pressure: float,
    tdamp: float | None = None,
    pdamp: float | None = None,
    chain: int = 3,
    pchain: int = 3,
    *,
    coupling: str = "iso",
    compressibility: float = 4.5e-5,
    friction: float = 0.01,
    seed: int = 0,
) -> VelocityVerlet:
    """The integrator of ``--pressure P --barostat B`` (the CLI's and ``run_md``'s). MTK couples the
    cell to Nose-Hoover chains, so it needs ``thermostat="nose-hoover"`` (the chain is part of it)
    and ``coupling="iso"``; stochastic cell rescaling (``scr``,
    :class:`~twinshard.atoms.dynamics.scr.StochasticCellRescaling`) works with any thermostat and
    couples ``iso``, ``aniso`` or ``tri``."""
    if barostat not in BAROSTATS:
        raise ValueError(
            f"barostat must be one of {BAROSTATS} (isotropic Martyna-Tobias-Klein, stochastic cell "
            f"rescaling), got {barostat!r}"
        )
    if barostat == "scr":
        return StochasticCellRescaling(
            dt,
            temperature,
            pressure,
            thermostat=thermostat,
            pdamp=pdamp,
            compressibility=compressibility,
            coupling=coupling,
            friction=friction,
            tdamp=tdamp,
            chain=chain,
            seed=seed,
        )
    if coupling != "iso":
        raise ValueError(
            f"--barostat mtk couples isotropically; for --coupling {coupling} use --barostat scr"
        )
    if thermostat != "nose-hoover":
        raise ValueError(
            f"--barostat mtk thermostats the particles with its own Nose-Hoover chain: give "
            f"--thermostat nose-hoover with --pressure (got {thermostat!r}; for Langevin or NVE "
            "use --barostat scr)"
        )
    return IsotropicMTK(dt, temperature, pressure, tdamp, pdamp, chain, pchain)
