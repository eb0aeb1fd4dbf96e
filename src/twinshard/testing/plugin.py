"""pytest plugin for twinshard parity tests (filled in by the foundation work)."""
