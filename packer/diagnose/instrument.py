"""Per-sample stage timing inside DataLoader workers: read, decode, transform, collate.

``instrument(dataset)`` wraps a dataset so that every sample's time is split into stages and
summed into a small table in shared memory (a ``torch`` tensor moved to shared memory, which
fork workers inherit and spawn workers receive through torch's multiprocessing pickler). Each
process writes only its own row (worker id + 1; row 0 is the main process), so no lock is
needed, and the main process reads the totals at any time with ``stage_totals()``.

Stages are split for datasets that expose packer's staged reading (``read_payload``,
``pixels``, ``present``; ``prefetch`` counts as read: ``PackedDataset`` and ``CachedDataset``); any other dataset is timed
as a single ``getitem`` stage.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils.data import Dataset, get_worker_info
from torch.utils.data._utils.collate import default_collate

STAGES = ("read", "decode", "transform", "getitem", "collate")
_SAMPLES, _BATCHES = len(STAGES), len(STAGES) + 1


def _row() -> int:
    info = get_worker_info()
    return 0 if info is None else info.id + 1


@dataclass
class StageTotals:
    """Seconds spent per stage, summed over all processes, and what was counted."""

    seconds: dict[str, float] = field(default_factory=dict)
    samples: int = 0
    batches: int = 0
    processes: int = 0  # rows that did any work (main process and/or workers)

    def per_sample_ms(self) -> dict[str, float]:
        """Mean milliseconds per sample of each stage that ran (collate spread over samples)."""
        n = max(self.samples, 1)
        return {k: 1000 * v / n for k, v in self.seconds.items() if v > 0}

    @property
    def sample_seconds(self) -> float:
        """Seconds of one process's work per sample, all stages."""
        return sum(self.seconds.values()) / max(self.samples, 1)

    def slowest(self) -> str | None:
        ms = self.per_sample_ms()
        return max(ms, key=ms.get) if ms else None

    def to_dict(self) -> dict:
        return {"per_sample_ms": self.per_sample_ms(), "seconds": self.seconds, "samples": self.samples,
                "batches": self.batches, "processes": self.processes}


class TimedCollate:
    """A collate function that adds its time to the stage table (picklable, for spawn workers)."""

    def __init__(self, table: torch.Tensor, fn: Callable = default_collate) -> None:
        self.table = table
        self.fn = fn

    def __call__(self, samples: list) -> Any:
        t0 = time.perf_counter()
        out = self.fn(samples)
        row = self.table[_row()]
        row[STAGES.index("collate")] += time.perf_counter() - t0
        row[_BATCHES] += 1
        return out


class InstrumentedDataset(Dataset):
    """``dataset`` with each sample's read/decode/transform time recorded (see module docstring)."""

    def __init__(self, dataset: Dataset, max_workers: int = 256) -> None:
        self.dataset = dataset
        self.staged = all(hasattr(dataset, a) for a in ("read_payload", "pixels", "present"))
        self.table = torch.zeros((max_workers + 1, len(STAGES) + 2), dtype=torch.float64).share_memory_()

    def __len__(self) -> int:
        return len(self.dataset)  # type: ignore[arg-type]

    def __getattr__(self, name: str) -> Any:  # classes, targets, ... of the wrapped dataset
        if name in ("dataset", "table", "staged"):
            raise AttributeError(name)
        return getattr(self.dataset, name)

    def collate(self, fn: Callable = default_collate) -> TimedCollate:
        """``fn`` wrapped to record collate time: pass it as the DataLoader's ``collate_fn``."""
        return TimedCollate(self.table, fn)

    def __getitem__(self, i: int) -> Any:
        return self.__getitems__([i])[0]

    def __getitems__(self, indices: Sequence[int]) -> list:
        row = self.table[_row()]
        clock = time.perf_counter
        if not self.staged:
            t0 = clock()
            out = [self.dataset[i] for i in indices]
            row[STAGES.index("getitem")] += clock() - t0
            row[_SAMPLES] += len(out)
            return out
        ds: Any = self.dataset
        n = len(ds)
        idx = [int(i) + n if int(i) < 0 else int(i) for i in indices]
        read = decode = transform = 0.0
        # The same path as PackedDataset.__getitems__: read ahead in the background, wait for each
        # sample's bytes (read time) and decode it in file order.
        pending = None
        if hasattr(ds, "prefetch"):
            t0 = clock()
            pending = ds.prefetch(idx)
            read += clock() - t0
        slots = ds.batch_slots(idx) if hasattr(ds, "batch_slots") else None
        out: list = [None] * len(idx)
        file_order = sorted(range(len(idx)), key=idx.__getitem__)
        for k in pending.arrival_order() if pending is not None else range(len(idx)):
            j = file_order[k]
            i = idx[j]
            a = clock()
            if pending is not None:
                pending.wait(k)
            payload = ds.read_payload(i)
            b = clock()
            if slots is None:
                arr, tensor = ds.pixels(i, payload), None
            else:
                arr, tensor = ds.pixels_in_slot(i, payload, slots[j])
            c = clock()
            out[j] = ds.present(i, arr) if tensor is None else ds.present(i, arr, tensor)
            d = clock()
            read += b - a
            decode += c - b
            transform += d - c
        row[STAGES.index("read")] += read
        row[STAGES.index("decode")] += decode
        row[STAGES.index("transform")] += transform
        row[_SAMPLES] += len(out)
        return out

    def stage_totals(self) -> StageTotals:
        """Totals so far, summed over the main process and every worker."""
        t = self.table.clone()
        busy = t[:, : len(STAGES)].sum(1) > 0
        sums = t.sum(0).tolist()
        return StageTotals(
            seconds={s: sums[k] for k, s in enumerate(STAGES) if sums[k] > 0},
            samples=int(sums[_SAMPLES]), batches=int(sums[_BATCHES]), processes=int(busy.sum()),
        )

    def reset(self) -> None:
        self.table.zero_()


def instrument(dataset: Dataset, max_workers: int = 256) -> InstrumentedDataset:
    """Wrap ``dataset`` to time its stages; use ``.collate()`` as collate_fn to time collation too."""
    return InstrumentedDataset(dataset, max_workers=max_workers)
