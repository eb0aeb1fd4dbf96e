"""``twinshard predict --checkpoint``'s loader on a checkpoint of boltz's own ``Boltz2`` (runs in
.venv-boltz): a random-weight ``Boltz2`` (``build_boltz2`` with a confidence module) saved as
Lightning saves one (``state_dict`` and ``hyper_parameters`` = the model's ``hparams``) loads
strict into ``Boltz2Model`` and ``CPBoltz2Model`` with every tensor equal, its trunk, score model
and confidence settings read from the hyperparameters, and Boltz-2's predict diffusion parameters
with steering off (as ``boltz predict`` loads the checkpoint).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("boltz", reason="boltz is not installed (the .venv-boltz environment)")
sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "pair"))

from boltz2_model import build_boltz2  # noqa: E402
from model_inputs import confidence_model_args  # noqa: E402

from twinshard.cli.predict import load_checkpoint  # noqa: E402
from twinshard.pair.layers.model import CPBoltz2Model  # noqa: E402
from twinshard.pair.reference.model import Boltz2Model, ModelConfig  # noqa: E402
from twinshard.pair.reference.sampler import BOLTZ2_DIFFUSION_PARAMS  # noqa: E402


def test_boltz2_checkpoint_loads_strict(tmp_path):
    boltz = build_boltz2(seed=2, num_bins=64, confidence_model_args=confidence_model_args())
    path = tmp_path / "boltz2.ckpt"
    torch.save(
        {
            "state_dict": boltz.state_dict(),
            "hyper_parameters": dict(boltz.hparams),
            "epoch": 0,
            "global_step": 0,
        },
        path,
    )
    want = ModelConfig.from_hparams(boltz.hparams)
    for cls in (Boltz2Model, CPBoltz2Model):
        cfg, model = load_checkpoint(path, cls)
        assert cfg.trunk == want.trunk and cfg.score_model_args == want.score_model_args
        assert cfg.confidence_model_args == want.confidence_model_args
        assert cfg.diffusion_process_args == dict(BOLTZ2_DIFFUSION_PARAMS) and cfg.steering_args is None
        got = model.state_dict()
        assert list(got) == list(boltz.state_dict())
        for k, v in boltz.state_dict().items():
            assert torch.equal(got[k], v), k
