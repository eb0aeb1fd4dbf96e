import pytest
import torch
import torch.distributed as dist

from twinshard.rng import normal, philox4x32, random_bits, uniform
from twinshard.testing import assert_shards_cover, rows_of, run_on_world


def _words(*ws):
    return [torch.tensor([w], dtype=torch.int64) for w in ws]


def test_philox_known_answers():
    # Known-answer vectors of Random123 for philox4x32-10.
    out = philox4x32(_words(0, 0, 0, 0), (0, 0))
    assert [int(x) for x in out] == [0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8]
    m = 0xFFFFFFFF
    out = philox4x32(_words(m, m, m, m), (m, m))
    assert [int(x) for x in out] == [0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD]
    out = philox4x32(_words(0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344), (0xA4093822, 0x299F31D0))
    assert [int(x) for x in out] == [0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1]


def test_draw_is_function_of_key_only():
    ids = torch.arange(1000)
    full = normal(7, 1, ids, 3)
    # Any subset, in any order, draws the same numbers: what a rank owning it would draw.
    perm = torch.randperm(1000, generator=torch.Generator().manual_seed(0))[:300]
    torch.testing.assert_close(normal(7, 1, perm, 3), full[perm], rtol=0, atol=0)
    assert not torch.equal(normal(8, 1, ids, 3), full)
    assert not torch.equal(normal(7, 2, ids, 3), full)
    assert not torch.equal(normal(7, 1, ids, 4), full)


def test_moments():
    x = normal(3, 0, torch.arange(200_000))
    assert abs(float(x.mean())) < 0.01 and abs(float(x.std()) - 1) < 0.01
    u = uniform(3, 0, torch.arange(200_000))
    assert float(u.min()) > 0 and float(u.max()) < 1 and abs(float(u.mean()) - 0.5) < 0.005


# ------------------------------------------------------------------ the whole key range
TOP = 2**32 - 1  # the largest seed, stream and key word
EDGES = (0, 1, 2**31, TOP)


def test_seeds_streams_and_keys_at_the_top_of_their_range():
    ids = torch.arange(TOP - 2999, TOP + 1)  # ids just below 2**32
    full = normal(TOP, TOP, ids, TOP)
    assert torch.isfinite(full).all() and full.unique().numel() == full.numel()
    perm = torch.randperm(3000, generator=torch.Generator().manual_seed(1))[:700]
    assert torch.equal(normal(TOP, TOP, ids[perm], TOP), full[perm])  # a function of the key only
    u = uniform(TOP, 0, ids)
    assert float(u.min()) > 0 and float(u.max()) < 1


@pytest.mark.parametrize(
    "call,what",
    [
        (lambda: normal(0, 0, torch.tensor([TOP + 1])), "keys"),
        (lambda: normal(0, 0, TOP + 1), "keys"),
        (lambda: normal(0, 0, torch.tensor([5, -1])), "keys"),
        (lambda: normal(0, 0, 3, -1), "keys"),
        (lambda: normal(TOP + 1, 0, 3), "seed"),
        (lambda: normal(-1, 0, 3), "seed"),
        (lambda: uniform(0, TOP + 1, 3), "stream"),
        (lambda: uniform(0, -5, 3), "stream"),
        (lambda: random_bits(0, 0, 3, block=TOP + 1), "block"),
        # once accepted, and the same stream as (7, 1): seed 7 + (0x9E3779B1 << 32), stream 0
        (lambda: normal(7 + (0x9E3779B1 << 32), 0, 3), "seed"),
    ],
)
def test_values_out_of_range_raise(call, what):
    with pytest.raises(ValueError, match=rf"random {what} must be (an )?integers? in \[0, 2\*\*32\)"):
        call()


def test_distinct_seeds_streams_and_keys_give_independent_streams():
    n = 4096
    ids = torch.arange(TOP - n + 1, TOP + 1)
    draws = {(s, t): normal(s, t, ids) for s in EDGES for t in EDGES}
    draws["key word 2"] = normal(0, 0, 0, ids)  # the same values in another key word
    draws["second word 1"] = normal(0, 0, ids, 1)  # (ids) is (ids, 0, 0): unused words are zero
    names = list(draws)
    x = torch.stack([draws[k] for k in names])
    x = (x - x.mean(1, keepdim=True)) / x.std(1, keepdim=True)
    corr = (x @ x.T) / (n - 1)
    off = corr - torch.eye(len(names), dtype=corr.dtype)
    worst = float(off.abs().max())
    i, j = divmod(int(off.abs().argmax()), len(names))
    # independent streams: sample correlations ~ N(0, 1/n); 6 sigma over ~170 pairs
    assert worst < 6 / n**0.5, f"streams {names[i]} and {names[j]} correlate: {worst:.3f}"


def _rank_draw(ids):
    r, p = dist.get_rank(), dist.get_world_size()
    mine = ids[r::p].contiguous()  # each rank draws only for the ids it owns, in its own order
    return mine, normal(TOP - 1, 2**31 + 5, mine[:, None], torch.arange(3)[None, :])


def test_distributed_draw_equals_serial_draw_near_2_32():
    ids = torch.arange(TOP - 999, TOP + 1)[torch.randperm(1000, generator=torch.Generator().manual_seed(2))]
    serial = normal(TOP - 1, 2**31 + 5, ids[:, None], torch.arange(3)[None, :])
    res = run_on_world(_rank_draw, 3, ids)
    pieces = [(draw, rows_of(mine, ids)) for mine, draw in res]
    why = "a counter-based draw is a pure function of its key: bitwise equal on any rank"
    assert_shards_cover(
        pieces, serial, "normal draws near 2**32 by owner", disjoint=True, rtol=0, atol=0, why=why
    )
