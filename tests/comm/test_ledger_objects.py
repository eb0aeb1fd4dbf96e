"""The ledger records the torch.distributed object collectives (agreement steps, metadata), which
bypass twinshard.comm, with the bytes of their pickled payloads; its byte keys say "modelled"."""

import pickle

import torch.distributed as dist

from twinshard.comm import CommLedger
from twinshard.runtime import agree_step
from twinshard.testing import run_on_world


def _rank():
    r, n = dist.get_rank(), dist.get_world_size()
    original = dist.all_gather_object
    with CommLedger() as led:
        got = [None] * n
        dist.all_gather_object(got, "x" * (10 * r + 1))
        box = [{"a": 1}, "bb"] if r == 1 else [None, None]
        dist.broadcast_object_list(box, src=1)
        with agree_step("a check that passes"):  # runtime.agree: one all_gather_object
            pass
        wrapped = dist.all_gather_object is not original
    restored = dist.all_gather_object is original
    with CommLedger() as outside:  # nothing from before this window leaks in
        pass
    return led.summary(), wrapped, restored, outside.calls, got, box


def test_object_collectives_are_recorded_with_their_pickled_bytes():
    n = 3
    out = run_on_world(_rank, n)
    biggest = max(len(pickle.dumps("x" * (10 * r + 1))) for r in range(n))
    payload = 8 * 2 + len(pickle.dumps({"a": 1})) + len(pickle.dumps("bb"))
    for r, (summary, wrapped, restored, outside_calls, got, box) in enumerate(out):
        assert wrapped and restored and outside_calls == 0
        assert got == ["x" * (10 * k + 1) for k in range(n)] and box == [{"a": 1}, "bb"]
        ops = summary["ops"]
        assert "modelled" in summary["bytes_model"]
        assert summary["modelled_bytes_sent"] == summary["bytes_sent"] > 0
        assert ops["all_gather_object"]["calls"] == 2  # ours and the agreement step's
        ours = (8 + biggest) * (n - 1)
        assert ops["all_gather_object"]["modelled_bytes_recv"] >= ours
        b = ops["broadcast_object_list"]
        assert b["calls"] == 1
        expect = (payload * (n - 1), 0) if r == 1 else (0, payload)
        assert (b["modelled_bytes_sent"], b["modelled_bytes_recv"]) == expect
