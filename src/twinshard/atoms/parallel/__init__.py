"""The parallel layer of particles: partitions, halo plans, the halo and graph storages, the
distributed potential, and the tracer of ``twinshard validate``."""
