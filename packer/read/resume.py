"""Mid-epoch positions: what a sampler saves so that a killed job resumes at its next batch.

The protocol is torchdata's ``Stateful`` (``state_dict()`` / ``load_state_dict()``), which its
``StatefulDataLoader`` and Lightning's checkpoints call on samplers and loaders. A state holds
plain ints and bools only, so it goes into JSON or ``torch.save`` as it is.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from typing import Any, Protocol, runtime_checkable

from packer.errors import OptionError


@runtime_checkable
class Stateful(Protocol):
    """An object whose progress can be saved and restored (torchdata's protocol of the same name)."""

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state_dict: dict[str, Any]) -> None: ...


class _Cursor:
    """Samples one iteration has handed out (each iteration counts its own)."""

    def __init__(self, yielded: int) -> None:
        self.yielded = yielded


def _walk(order: Sequence[int], cursor: _Cursor) -> Iterator[int]:
    for k in range(cursor.yielded, len(order)):
        cursor.yielded += 1  # counted before the consumer gets it: a state taken then includes it
        yield order[k]


class EpochPosition:
    """How far the latest iteration of an epoch's order got, and where a loaded state resumes it."""

    def __init__(self, resume_at: int | None = None) -> None:
        self._resume_at = resume_at
        self._cursor = _Cursor(0)

    @property
    def yielded(self) -> int:
        """Samples handed out in this epoch (a loaded position counts until iteration starts)."""
        return self._cursor.yielded if self._resume_at is None else self._resume_at

    def iterate(self, order: Sequence[int]) -> Iterator[int]:
        """Iterate ``order`` from the loaded position, once; from its start afterwards."""
        self._cursor = _Cursor(self._resume_at or 0)
        self._resume_at = None
        return _walk(order, self._cursor)


def resume_position(state: Mapping[str, Any], order_key: Mapping[str, Any], per_epoch: int) -> tuple[int, int]:
    """``(epoch, yielded)`` from a sampler's saved state, checked against the sampler loading it.

    A position is only meaningful in the same order: a state saved with another seed, dataset,
    block layout or number of ranks is refused, naming what differs.
    """
    if not isinstance(state, Mapping) or not {"epoch", "yielded", "order"} <= set(state):
        got = ", ".join(sorted(map(str, state))) if isinstance(state, Mapping) else type(state).__name__
        raise OptionError(f"not a BlockShuffleSampler state: expected the keys epoch, yielded and order, got {got}")
    saved = state["order"]
    differ = sorted(k for k in set(saved) | set(order_key) if saved.get(k) != order_key.get(k))
    if differ:
        raise OptionError("the saved sampler state is for another order: "
                          + "; ".join(f"{k} {saved.get(k)!r} saved, {order_key.get(k)!r} here" for k in differ))
    epoch, yielded = state["epoch"], state["yielded"]
    if not isinstance(epoch, int) or not isinstance(yielded, int) or epoch < 0 or not 0 <= yielded <= per_epoch:
        raise OptionError(f"the saved sampler state's position is out of range: epoch {epoch!r}, "
                          f"{yielded!r} samples of {per_epoch} handed out")
    return epoch, yielded
