"""twinshard: distributed twins of scientific PyTorch models that equal their serial selves."""

__version__ = "0.1.0"
