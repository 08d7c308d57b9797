"""The operand cache's bookkeeping, shared by the worker and the coordinator's mirror."""

from __future__ import annotations

from common.block_cache import BlockCache


def test_blocks_are_kept_in_use_order_within_the_budget() -> None:
    cache: BlockCache[str, int] = BlockCache(30, int)
    cache.record([("a0", 10), ("b", 10)])
    cache.record([("a1", 10), ("b", None)])  # b referred to: most recent again
    cache.record([("a2", 10), ("b", None)])  # over budget: a0, the oldest, goes
    assert list(cache) == ["a1", "a2", "b"] and cache.bytes == 30
    cache.record([("gone", None)])  # neither held nor arrived: nothing to keep
    assert "gone" not in cache and len(cache) == 3
    cache.record([("big", 25)])  # bigger than what is left: the old ones make room
    assert list(cache) == ["big"] and cache.bytes == 25
    cache.clear()
    assert len(cache) == 0 and cache.bytes == 0


def test_a_zero_budget_keeps_nothing() -> None:
    cache: BlockCache[str, int] = BlockCache(0, int)
    assert not cache.keeps and BlockCache(1, int).keeps
    assert cache.record([("a", 1)]) == []  # nothing was kept, so nothing is let go
    assert len(cache) == 0 and cache.bytes == 0


def test_record_names_what_it_let_go_and_replace_keeps_the_order() -> None:
    cache: BlockCache[str, int] = BlockCache(30, int)
    assert cache.record([("a", 10), ("b", 10), ("c", 10)]) == []
    assert cache.record([("a", None), ("d", 15)]) == ["b", "c"]
    cache.replace("a", 10)
    assert list(cache) == ["a", "d"] and cache.bytes == 25


def test_holds_any_says_whether_one_of_the_blocks_is_held() -> None:
    cache: BlockCache[str, int] = BlockCache(30, int)
    assert not cache.holds_any(("a", "b"))  # empty
    cache.record([("a", 10), ("b", 10)])
    assert cache.holds_any(("x", "b")) and cache.holds_any(["a"])
    assert not cache.holds_any(("x", "y")) and not cache.holds_any(())
    cache.record([("c", 15)])  # a, the oldest, goes to make room
    assert not cache.holds_any(("a", "x")) and cache.holds_any(("a", "c"))
