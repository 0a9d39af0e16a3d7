"""A least-recently-used map with a bound: the one cache readers keep of mapped files and decoded blocks."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterator
from typing import Generic, TypeVar

K = TypeVar("K")
V = TypeVar("V")


class LRU(Generic[K, V]):
    """At most ``limit`` entries, or with ``weight`` at most ``limit`` in total weight (but always the newest entry);
    the least recently used go first, each handed to ``drop`` (to close its file). Not locked: its owner's lock
    guards it where threads share it."""

    def __init__(self, limit: int, drop: Callable[[V], object] | None = None,
                 weight: Callable[[V], int] | None = None) -> None:
        self.limit = limit
        self._drop = drop
        self._weight = weight
        self._items: OrderedDict[K, V] = OrderedDict()
        self._total = 0  # the entries' weight (their count without ``weight``)

    def get(self, key: K) -> V | None:
        """The value of ``key``, now the most recently used; None when it is not kept."""
        value = self._items.get(key)
        if value is not None:
            self._items.move_to_end(key)
        return value

    def put(self, key: K, value: V) -> V:
        """Keep ``value`` as the most recently used; drop the oldest entries beyond the bound. Returns ``value``."""
        old = self.pop(key)
        if old is not None and old is not value and self._drop is not None:
            self._drop(old)
        self._items[key] = value
        self._total += self._weigh(value)
        while len(self._items) > 1 and self._total > self.limit:
            _key, oldest = self._items.popitem(last=False)
            self._total -= self._weigh(oldest)
            if self._drop is not None:
                self._drop(oldest)
        return value

    def pop(self, key: K) -> V | None:
        """Forget ``key`` without dropping its value (the caller now owns it); None when it is not kept."""
        value = self._items.pop(key, None)
        if value is not None:
            self._total -= self._weigh(value)
        return value

    def clear(self) -> None:
        """Drop every entry."""
        items, self._items, self._total = list(self._items.values()), OrderedDict(), 0
        if self._drop is not None:
            for value in items:
                self._drop(value)

    def values(self) -> list[V]:
        return list(self._items.values())

    def __contains__(self, key: object) -> bool:
        return key in self._items

    def __iter__(self) -> Iterator[K]:
        return iter(list(self._items))

    def __len__(self) -> int:
        return len(self._items)

    def _weigh(self, value: V) -> int:
        return 1 if self._weight is None else self._weight(value)
