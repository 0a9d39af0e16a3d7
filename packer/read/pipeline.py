"""The one batch loop: plan a batch, then run it chunk by chunk. Every loader reads through it.

``BatchPipeline`` joins a dataset's ``SampleSource`` (where payloads come from), its ``Decoding`` (payloads ->
pixels) and its ``Presenter`` (pixels -> samples). ``plan`` takes a batch whose reads were started (``start``):
its storage positions, batch slots (packer.read.slots), fused crops' windows (drawn in the batch's order) and its
chunks, each in the order its bytes arrive. ``run`` is the loop: wait for a chunk's bytes, take its payloads,
decode them into their slots, hand the samples out. DataLoader's ``__getitems__``, ``ds[i]``, ``get_batch``,
``BatchView`` and DALI's source run every chunk in their own thread (``load``); ``packer.ThreadLoader`` plans in
its feeder thread and runs the chunks in its decode threads. Timers run only with a ``clock`` attached
(``packer.instrument``).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal, Protocol

import numpy as np
import torch

from packer.images.decode import pixel_limit
from packer.layout.index import normalize_index, normalize_indices
from packer.layout.manifest import IMAGELESS
from packer.read.hints import Ahead, aheads_of
from packer.read.indexing import IndexMap
from packer.read.readahead import Pending
from packer.read.slots import BATCH_BLOCK_MAX, SlotMemory, Slots

if TYPE_CHECKING:
    from packer.images.crop import Window
    from packer.read.decoding import Decoding
    from packer.read.present import Presenter
    from packer.read.source import SampleSource

BULK_CHUNK = 8  # samples of a chunk run here: few enough to start decoding on early bytes, enough to share its costs
_READ_NOW = Pending.ready(1)  # the reads of one sample read now (``one``): nothing to wait for, shared
Output = Literal["samples", "pixels", "payloads"]  # what run hands out: present()ed samples, pixels, checked payloads


class StageClock(Protocol):
    """Receives each chunk's seconds per stage (packer.instrument's per-process table)."""

    def add(self, read: float, decode: float, transform: float, samples: int) -> None: ...

    def collate(self, fn: Callable) -> Callable:
        """``fn``, its time added to the collate stage."""
        ...


@dataclass(eq=False)
class Reads:
    """A batch whose reads are under way: its storage positions (batch order) and the read-ahead's handle."""

    positions: np.ndarray
    pending: Pending


@dataclass(eq=False)
class BatchPlan:
    """What ``run`` needs of one batch. ``chunks[k]``: the batch places of chunk ``k``'s samples in the order their
    bytes arrive; ``items[k]``: the read-ahead's items they are. ``slots``/``views``: per sample, the tensor and
    array its pixels go to (``stacked``: the (N, H, W, 3) tensor they are rows of); ``places``: the flat arrays raw
    payloads may be read straight into; ``copies``: memory for copies of the payloads (None: views)."""

    positions: np.ndarray
    pending: Pending
    chunks: list[list[int]]
    items: list[list[int]]
    output: Output = "samples"
    stacked: torch.Tensor | None = None
    slots: list[torch.Tensor] | None = None
    views: list[np.ndarray] | None = None
    places: list[np.ndarray] | None = None
    windows: list[Window] | None = None
    copies: Callable[[int], np.ndarray] | None = None
    missed: bool = False  # a sample was not decoded into its slot (another size than the index's): set by run


class BatchPipeline:
    """Batches of one dataset: positions from its ``index_map``, payloads from ``source``, pixels by ``decoding``,
    samples by ``presenter``."""

    def __init__(self, source: SampleSource, decoding: Decoding, presenter: Presenter, index_map: IndexMap) -> None:
        self.source, self.decoding, self.presenter, self.index_map = source, decoding, presenter, index_map
        self.images = source.manifest.payload != IMAGELESS
        self.clock: StageClock | None = None  # packer.instrument's: stage seconds of every chunk run

    def positions(self, indices: Sequence[int] | np.ndarray) -> np.ndarray:
        """Storage positions of public indices (negative from the end; IndexError out of range)."""
        return self.index_map.stored_many(normalize_indices(indices, self.source.manifest.num_samples))

    def start(self, positions: np.ndarray, ahead: Sequence[Ahead] = (), read_ahead: bool = True) -> Reads:
        """Start reading a batch's payloads (``read_ahead`` False: none, e.g. one sample read now)."""
        if read_ahead and self.images and len(positions):
            return Reads(positions, self.source.start(positions, ahead))
        return Reads(positions, Pending.ready(len(positions)))

    def slots(self, positions: np.ndarray, memory: SlotMemory, max_bytes: int = BATCH_BLOCK_MAX,
              output: Output = "samples") -> Slots | None:
        """Slots in ``memory`` for the samples at these positions; None where they don't apply: samples whose images
        are not handed out as decoded (other kinds, a transform), ``decode_size``, sizes the index lacks or the
        per-sample path would refuse (it names the problem), or more than ``max_bytes`` on the index's word."""
        crop = self.decoding.crop
        if not self.images or (output == "samples" and not self.presenter.as_decoded) or self.decoding.decode_size:
            return None
        if crop is not None:
            shapes = [(int(crop.size[0]), int(crop.size[1]))] * len(positions)
        else:
            h, w = (self.source.index.heights[positions].astype(np.int64),
                    self.source.index.widths[positions].astype(np.int64))
            if not len(h) or np.any(h <= 0) or np.any(w <= 0):
                return None
            if self.source.manifest.payload == "encoded":
                limit = pixel_limit()
                if limit is not None and np.any(h * w > limit):
                    return None
            elif np.any(self.source.index.nbytes[positions] != h * w * 3):
                return None
            shapes = list(zip(h.tolist(), w.tolist()))
        if sum(h * w * 3 for h, w in shapes) > max_bytes:
            return None
        return memory.slots(shapes, crop is not None)

    def plan(self, reads: Reads, chunks: int | None = None, memory: SlotMemory | None = None,
             copies: Callable[[int], np.ndarray] | None = None, output: Output = "samples") -> BatchPlan:
        """Plan a batch: slots in ``memory``, crops' windows in batch order, ``chunks`` chunks (None: of ``BULK_CHUNK``
        samples) in the order the bytes arrive; payloads copied into ``copies``."""
        pos, pending, n = reads.positions, reads.pending, len(reads.positions)
        clock, t0 = self.clock, time.perf_counter() if self.clock is not None else 0.0
        plan = BatchPlan(pos, pending, [], [], output, copies=copies)
        if self.images and output != "payloads":
            got = None if memory is None else self.slots(pos, memory, output=output)
            if got is not None:
                plan.stacked, plan.slots = got
                stacked = None if plan.stacked is None else plan.stacked.numpy()
                plan.views = [s.numpy() for s in plan.slots] if stacked is None else list(stacked)
                if self.decoding.crop is None:  # raw pixels may be read straight into them
                    plan.places = [v.reshape(-1) for v in plan.views] if stacked is None else \
                        list(stacked.reshape(n, -1))
            plan.windows = self.decoding.windows(pos)
        plan.chunks, plan.items = _chunks(pos, pending, chunks, BULK_CHUNK)
        if clock is not None:
            clock.add(time.perf_counter() - t0, 0.0, 0.0, 0)
        return plan

    def run(self, plan: BatchPlan, k: int) -> list:
        """THE loop, for chunk ``k`` of ``plan``: its bytes waited for, its payloads taken, decoded into their slots
        (``output`` "pixels": handed out so), samples made (``"samples"``); or its payloads as an external decoder
        takes them (``"payloads"``). In the chunk's order (``plan.chunks[k]``)."""
        clock, now = self.clock, time.perf_counter
        t0 = now() if clock is not None else 0.0
        places = plan.chunks[k]
        plan.pending.wait_all(plan.items[k])
        pos = plan.positions[places]
        payloads: list[Any] = self.source.payloads(
            pos, into=plan.copies, places=None if plan.places is None else [plan.places[j] for j in places]
        ) if self.images else [None] * len(places)
        t1 = now() if clock is not None else 0.0
        if plan.output == "payloads":
            out = [self.decoding.external(p, b, self.source.payload) for p, b in zip(pos.tolist(), payloads)]
            t2 = t3 = now() if clock is not None else 0.0
        else:
            views = None if plan.views is None else [plan.views[j] for j in places]
            arrs: list = self.source.decode(pos, payloads, self.decoding, views, None if plan.windows is None else
                                            [plan.windows[j] for j in places]) if self.images else payloads
            t2 = now() if clock is not None else 0.0
            if views is not None and any(a is not v for a, v in zip(arrs, views, strict=True)):
                plan.missed = True
            if plan.output == "pixels":
                out, t3 = arrs, t2
            else:
                tensors = [None] * len(places) if views is None else \
                    [plan.slots[j] if a is v else None  # type: ignore[index]
                     for j, a, v in zip(places, arrs, views, strict=True)]
                out = self.presenter.many(pos, arrs, tensors)
                t3 = now() if clock is not None else 0.0
        if clock is not None:
            clock.add(t1 - t0, t2 - t1, t3 - t2, len(places))
        return out

    def load(self, indices: Sequence[int] | np.ndarray, memory: SlotMemory | None = None, output: Output = "samples",
             chunks: int | None = None, read_ahead: bool = True) -> list:
        """A batch of public ``indices``, every chunk run in this thread, in the batch's order."""
        reads = self.start(self.positions(indices), aheads_of(indices), read_ahead)
        return self.collect(self.plan(reads, chunks, memory, output=output))

    def one(self, index: int) -> Any:
        """Sample ``index`` read now, without read-ahead (``ds[i]``): a plan of one, made here, run by ``run``."""
        pos = np.array([self.index_map.stored(normalize_index(index, self.source.manifest.num_samples))])
        plan = BatchPlan(pos, _READ_NOW, [[0]], [[0]], windows=self.decoding.windows(pos) if self.images else None)
        return self.run(plan, 0)[0]

    def collect(self, plan: BatchPlan) -> list:
        """Every chunk of ``plan`` run here, the results put in the batch's order."""
        out: list = [None] * len(plan.positions)
        for k, places in enumerate(plan.chunks):
            for j, item in zip(places, self.run(plan, k), strict=True):
                out[j] = item
        return out


def _chunks(positions: np.ndarray, pending: Pending, count: int | None, size: int
            ) -> tuple[list[list[int]], list[list[int]]]:
    """A batch cut into ``count`` chunks of about equal size (None: of ``size`` samples) in the order its bytes
    arrive: each chunk's batch places and read-ahead items (the items are the positions in file order)."""
    n = len(positions)
    if n <= 1:
        return [[0]] * n, [[0]] * n
    items = pending.arrival_order()
    arrival = np.argsort(positions, kind="stable")[items].tolist()
    if count is None:
        cuts = [*range(0, n, size), n]
    else:
        cuts = np.unique(np.linspace(0, n, min(n, max(count, 1)) + 1).astype(np.int64)).tolist()
    return [arrival[a:b] for a, b in zip(cuts[:-1], cuts[1:])], [items[a:b] for a, b in zip(cuts[:-1], cuts[1:])]
