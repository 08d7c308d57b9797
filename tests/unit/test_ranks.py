"""A rank's slice of each global batch, and the error for a batch that does not split."""

from __future__ import annotations

import pytest
import torch

from coordinator.run import public_url
from coordinator.step.ranks import BatchSplitError, Ranks, _buckets


def test_each_rank_takes_its_rows_of_every_tensor_and_the_rows_cover_the_batch() -> None:
    x, y = torch.arange(24).view(6, 4), torch.arange(6)
    batch = ({"tokens": x, "lengths": [3, 4]}, y)
    parts = [Ranks(r, 3).slice(batch) for r in range(3)]
    assert [p[0]["tokens"].shape[0] for p in parts] == [2, 2, 2]
    assert torch.equal(torch.cat([p[0]["tokens"] for p in parts]), x)
    assert torch.equal(torch.cat([p[1] for p in parts]), y)
    assert all(p[0]["lengths"] == [3, 4] for p in parts)  # not a tensor: as it was


def test_a_batch_that_does_not_split_evenly_names_its_sizes() -> None:
    with pytest.raises(BatchSplitError) as caught:
        Ranks(0, 4).slice((torch.zeros(6, 8), torch.zeros(6)))
    text = str(caught.value)
    assert "6 rows" in text and "(6, 8)" in text and "multiple of 4" in text


def test_a_collective_bucket_holds_each_dtype_flat_and_scatters_back_in_place() -> None:
    a, b, c = torch.ones(2, 3), torch.arange(4, dtype=torch.int64), torch.full((5,), 2.0)
    buckets = _buckets([a, b, c])
    assert [bk.flat.dtype for bk in buckets] == [torch.float32, torch.int64]
    assert buckets[0].flat.shape == (11,) and buckets[1].flat.shape == (4,)
    for bk in buckets:
        bk.flat.mul_(10)
        bk.scatter()
    assert torch.equal(a, torch.full((2, 3), 10.0)) and torch.equal(c, torch.full((5,), 20.0))
    assert torch.equal(b, torch.arange(4) * 10)


def test_the_url_a_rank_tells_the_others_is_the_one_workers_reach_or_none() -> None:
    assert public_url("10.0.0.5", None, 8766, tls=False) == "ws://10.0.0.5:8766/ws"
    assert public_url("0.0.0.0", None, 8766, tls=False) == ""  # not known: no one sent here
    assert public_url("0.0.0.0", "cleave.example.org", 8766, tls=True) == (
        "wss://cleave.example.org:8766/ws"
    )
    assert public_url("::", "2001:db8::7", 8765, tls=False) == "ws://[2001:db8::7]:8765/ws"
