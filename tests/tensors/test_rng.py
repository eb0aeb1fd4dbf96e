import torch

from twinshard.tensors.rng import normal, philox4x32, uniform


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
