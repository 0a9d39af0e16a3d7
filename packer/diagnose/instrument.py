"""``packer.instrument(dataset)``: each sample's time split into stages (read, decode, transform, getitem,
collate), summed across a DataLoader's workers or a ThreadLoader's threads; ``packer.profile`` words the result.

On a packer dataset, ``instrument`` attaches a clock (``StageTable``) to its batch pipeline and returns the dataset
itself, so everything that reads it (DataLoader workers, ``ThreadLoader``, ``get_batch``, DALI's source) times
exactly the loop training runs. Any other dataset is wrapped (``InstrumentedDataset``) and timed as one ``getitem``
stage. The table lives in shared memory (a ``torch`` tensor moved there: fork workers inherit it, spawn workers
receive it through torch's pickler); each process writes its own row (worker id + 1; row 0 the main process).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar, overload

import torch
from torch.utils.data import Dataset, get_worker_info
from torch.utils.data._utils.collate import default_collate

from packer.perprocess import PerProcess
from packer.read.dataset import PackedDataset

STAGES = ("read", "decode", "transform", "getitem", "collate")
_SAMPLES, _BATCHES = len(STAGES), len(STAGES) + 1
_READ, _DECODE, _TRANSFORM, _GETITEM, _COLLATE = range(len(STAGES))


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
        return max(ms, key=lambda k: ms[k]) if ms else None

    def to_dict(self) -> dict:
        return {"per_sample_ms": self.per_sample_ms(), "seconds": self.seconds, "samples": self.samples,
                "batches": self.batches, "processes": self.processes}


class StageTable:
    """The stage clock: seconds per stage and process in one shared table. A ``BatchPipeline``'s clock (``add``);
    ``collate`` times a collate function into it. Threads of one process (a ThreadLoader's) add under a lock."""

    def __init__(self, max_workers: int = 256) -> None:
        self.table = torch.zeros((max_workers + 1, len(STAGES) + 2), dtype=torch.float64).share_memory_()
        self._lock: PerProcess[threading.Lock] = PerProcess(threading.Lock)  # a forked worker's own, not a copy
        self._lock.get()  # made now, before any thread adds

    def add(self, read: float, decode: float, transform: float, samples: int) -> None:
        with self._lock.get():
            row = self.table[_row()]
            row[_READ] += read
            row[_DECODE] += decode
            row[_TRANSFORM] += transform
            row[_SAMPLES] += samples

    def add_stage(self, stage: int, seconds: float, samples: int = 0, batches: int = 0) -> None:
        """``seconds`` of one stage (``getitem``, ``collate``) and what they counted."""
        with self._lock.get():
            row = self.table[_row()]
            row[stage] += seconds
            row[_SAMPLES] += samples
            row[_BATCHES] += batches

    def collate(self, fn: Callable = default_collate) -> TimedCollate:
        """``fn`` timed into the collate stage: pass it as the DataLoader's ``collate_fn``."""
        return TimedCollate(self, fn)

    def totals(self) -> StageTotals:
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


class TimedCollate:
    """A collate function that adds its time to the stage table (picklable, for spawn workers)."""

    def __init__(self, clock: StageTable, fn: Callable = default_collate) -> None:
        self.clock = clock
        self.fn = fn

    def __call__(self, samples: list) -> Any:
        t0 = time.perf_counter()
        out = self.fn(samples)
        self.clock.add_stage(_COLLATE, time.perf_counter() - t0, batches=1)
        return out


class InstrumentedDataset(Dataset):
    """A dataset other than packer's, each sample's ``__getitem__`` timed as the ``getitem`` stage. A thin handle:
    the dataset itself is ``.dataset``, nothing else is forwarded."""

    def __init__(self, dataset: Dataset, max_workers: int = 256) -> None:
        self.dataset = dataset
        self.clock = StageTable(max_workers)

    def __len__(self) -> int:
        return len(self.dataset)  # type: ignore[arg-type]

    def __getitem__(self, i: int) -> Any:
        return self.__getitems__([i])[0]

    def __getitems__(self, indices: Sequence[int]) -> list:
        t0 = time.perf_counter()
        out = [self.dataset[i] for i in indices]
        self.clock.add_stage(_GETITEM, time.perf_counter() - t0, samples=len(out))
        return out

    def collate(self, fn: Callable = default_collate) -> TimedCollate:
        """``fn`` wrapped to record collate time: pass it as the DataLoader's ``collate_fn``."""
        return self.clock.collate(fn)


D = TypeVar("D", bound=PackedDataset)


@overload
def instrument(dataset: D, max_workers: int = 256) -> D: ...
@overload
def instrument(dataset: Dataset, max_workers: int = 256) -> InstrumentedDataset: ...


def instrument(dataset: Dataset, max_workers: int = 256) -> PackedDataset | InstrumentedDataset:
    """Time ``dataset``'s stages: a packer dataset gets a clock on its pipeline (read, decode, transform; any loader
    over it) and is returned; any other is wrapped (getitem). ``ds.collate()`` as collate_fn times collation too."""
    return _attach(dataset, max_workers)[0]


def _attach(dataset: Dataset, max_workers: int) -> tuple[PackedDataset | InstrumentedDataset, StageTable]:
    if isinstance(dataset, PackedDataset):
        clock = dataset.pipeline.clock = StageTable(max_workers)
        return dataset, clock
    wrapped = InstrumentedDataset(dataset, max_workers=max_workers)
    return wrapped, wrapped.clock


def clock_of(dataset: Any) -> StageTable | None:
    """The stage clock ``instrument`` gave ``dataset``, or None."""
    if isinstance(dataset, InstrumentedDataset):
        return dataset.clock
    if isinstance(dataset, PackedDataset) and isinstance(dataset.pipeline.clock, StageTable):
        return dataset.pipeline.clock
    return None


def timed(dataset: Any) -> tuple[Dataset, StageTable]:
    """``dataset`` with its stage clock: as ``instrument`` made it already, else instrumented now."""
    clock = clock_of(dataset)
    return (dataset, clock) if clock is not None else _attach(dataset, 256)
