"""``common.scratch.Scratch``: one buffer per key, reused while it is large enough and of
the dtype asked for, replaced otherwise."""

from __future__ import annotations

import torch

from common.scratch import Scratch


def test_a_key_reuses_its_buffer_and_grows_it_when_asked_for_more() -> None:
    scratch = Scratch()
    first = scratch.take("a", torch.Size([4, 8]), torch.float32)
    assert first.shape == (4, 8) and first.dtype == torch.float32 and first.is_contiguous()
    smaller = scratch.take("a", torch.Size([3, 2]), torch.float32)
    assert smaller.shape == (3, 2) and smaller.data_ptr() == first.data_ptr()
    larger = scratch.take("a", torch.Size([10, 10]), torch.float32)
    assert larger.shape == (10, 10) and larger.numel() == 100
    again = scratch.take("a", torch.Size([5, 5]), torch.float32)
    assert again.data_ptr() == larger.data_ptr()


def test_keys_and_dtypes_get_buffers_of_their_own() -> None:
    scratch = Scratch()
    a = scratch.take("a", torch.Size([16]), torch.float32)
    b = scratch.take("b", torch.Size([16]), torch.float32)
    assert a.data_ptr() != b.data_ptr()
    a.fill_(1.0)
    b.fill_(2.0)
    assert bool((a == 1.0).all())  # writing one key's buffer leaves the other's alone
    wide = scratch.take("a", torch.Size([16]), torch.float64)
    assert wide.dtype == torch.float64 and wide.shape == (16,)
