"""packer.lru.LRU: the one bounded cache of mapped files and decoded blocks (pagecache, n5, mosaic)."""

from __future__ import annotations

import numpy as np

from packer.lru import LRU


def test_the_least_recently_used_go_first_and_are_dropped():
    dropped: list[str] = []
    lru: LRU[int, str] = LRU(2, drop=dropped.append)
    lru.put(1, "a")
    lru.put(2, "b")
    assert lru.get(1) == "a"  # 1 now the most recent
    lru.put(3, "c")
    assert list(lru) == [1, 3] and dropped == ["b"] and 2 not in lru and lru.get(2) is None
    assert lru.pop(1) == "a" and dropped == ["b"] and len(lru) == 1  # popped: the caller owns it, not dropped
    lru.put(3, "C")  # a new value for a kept key: the old one is dropped
    assert lru.values() == ["C"] and dropped == ["b", "c"]
    lru.clear()
    assert len(lru) == 0 and dropped == ["b", "c", "C"]


def test_a_weight_bound_keeps_at_least_the_newest():
    lru: LRU[int, np.ndarray] = LRU(100, weight=lambda a: a.nbytes)
    lru.put(0, np.zeros(60, np.uint8))
    lru.put(1, np.zeros(30, np.uint8))
    assert list(lru) == [0, 1]
    lru.put(2, np.zeros(20, np.uint8))  # 110 bytes: the oldest goes
    assert list(lru) == [1, 2]
    lru.put(3, np.zeros(500, np.uint8))  # larger than the bound alone: kept, all others go
    assert list(lru) == [3]
