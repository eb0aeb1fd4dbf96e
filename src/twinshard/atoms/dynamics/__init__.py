"""Dynamics: integrators, the MD loop and its files (checkpoints, provenance, torn-tail repair),
sanity checks, the rank body of ``twinshard md`` and ``run_md``."""
