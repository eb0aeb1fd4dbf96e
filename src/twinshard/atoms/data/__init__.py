"""Particle data: systems, structure I/O, embedded structures, cells, neighbour lists."""
