"""Suite-wide settings: the test process runs serial twins beside the rank workers on the same
cores, so it takes one intra-op thread like they do (more threads only contend here)."""

import torch

torch.set_num_threads(1)
