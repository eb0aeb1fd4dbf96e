"""Dropout streams: every site draws its own mask; no site silently shares stream 0."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from twinshard.pair.layers import CPDropout
from twinshard.pair.reference import Dropout, assign_dropout_streams, stream_id


class _Block(nn.Module):
    """Two dropout sites, as after AF3's two triangle multiplications."""

    def __init__(self, cls: type, **kw):
        super().__init__()
        self.drop_out = cls(0.4, **kw)
        self.drop_in = cls(0.4, **kw)


def test_a_site_without_stream_raises_in_training():
    x = torch.ones(1, 4, 4, 3, dtype=torch.float64)
    with pytest.raises(ValueError, match=r"this Dropout site has no stream, and sites sharing one draw"):
        Dropout(0.4).train()(x, seed=1)
    assert torch.equal(Dropout(0.4).eval()(x), x)  # eval mode draws nothing, needs nothing


def test_streams_derived_from_qualified_names_are_distinct_and_shared_with_the_twin():
    serial, twin = _Block(Dropout), _Block(CPDropout)
    streams = assign_dropout_streams(serial)
    assert streams == {"drop_out": stream_id("drop_out"), "drop_in": stream_id("drop_in")}
    assert streams["drop_out"] != streams["drop_in"]
    assert assign_dropout_streams(twin) == streams  # same names, same streams: same masks
    x = torch.ones(1, 6, 6, 8, dtype=torch.float64)
    a, b = serial.drop_out.train()(x, seed=3), serial.drop_in.train()(x, seed=3)
    assert not torch.equal(a, b), "two sites drew the same mask"
    assert stream_id("drop_out") == stream_id("drop_out") < 2**32  # stable, in the key range


def test_named_streams_and_collisions():
    assert Dropout(0.1, stream="pair_stack.0.drop").stream == stream_id("pair_stack.0.drop")
    with pytest.raises(ValueError, match=r"dropout sites 'drop_out' and 'drop_in' share stream 5"):
        assign_dropout_streams(_Block(Dropout, stream=5))
    with pytest.raises(ValueError, match=r"dropout stream must be in \[0, 2\*\*32\)"):
        Dropout(0.1, stream=-1)
