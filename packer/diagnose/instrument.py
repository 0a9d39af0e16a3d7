"""``packer.instrument(dataset)``: each sample's time split into stages (read, decode, transform, getitem,
collate), summed across the DataLoader's workers; ``packer.profile`` (profile.py) words the result.

``instrument`` sums the stages into a small table in shared memory (a ``torch`` tensor moved to shared
memory, which fork workers inherit and spawn workers receive through torch's multiprocessing pickler). Each
process writes only its own row (worker id + 1; row 0 is the main process), so no lock is needed. Packer
datasets (``read.staged.StagedDataset``: ``PackedDataset``, ``CachedDataset``) run their own batch loop with a
stage clock, so the profile times exactly what training runs (read-ahead counts as read); any other dataset is
one ``getitem`` stage.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils.data import Dataset, get_worker_info
from torch.utils.data._utils.collate import default_collate

from packer.read.staged import StagedDataset, load_batch

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
        return max(ms, key=lambda k: ms[k]) if ms else None

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


# What an instrumented dataset hands on from the one it wraps (samplers and user code read these).
_FORWARDED = frozenset({"classes", "class_to_idx", "targets", "samples", "imgs", "root", "index", "manifest",
                        "transform", "target_transform", "block_boundaries", "index_of",
                        "index_map", "indexing", "relpaths", "source_root", "find_classes", "loader", "extensions",
                        "transforms", "filename", "filenames"})


class _RowClock:
    """A StageClock adding one batch's stage seconds to this process's row of the shared table."""

    def __init__(self, row: torch.Tensor) -> None:
        self.row = row

    def add(self, read: float, decode: float, transform: float, samples: int) -> None:
        self.row[STAGES.index("read")] += read
        self.row[STAGES.index("decode")] += decode
        self.row[STAGES.index("transform")] += transform
        self.row[_SAMPLES] += samples


class InstrumentedDataset(Dataset):
    """``dataset`` with each sample's read/decode/transform time recorded (see module docstring)."""

    def __init__(self, dataset: Dataset, max_workers: int = 256) -> None:
        self.dataset = dataset
        self.table = torch.zeros((max_workers + 1, len(STAGES) + 2), dtype=torch.float64).share_memory_()

    def __len__(self) -> int:
        return len(self.dataset)  # type: ignore[arg-type]

    def __getattr__(self, name: str) -> Any:  # the ImageFolder surface of the wrapped dataset, by name
        if name in _FORWARDED:
            return getattr(self.dataset, name)
        raise AttributeError(f"{type(self).__name__} has no attribute {name!r} (the wrapped dataset: .dataset)")

    def collate(self, fn: Callable = default_collate) -> TimedCollate:
        """``fn`` wrapped to record collate time: pass it as the DataLoader's ``collate_fn``."""
        return TimedCollate(self.table, fn)

    def __getitem__(self, i: int) -> Any:
        return self.__getitems__([i])[0]

    def __getitems__(self, indices: Sequence[int]) -> list:
        """A packer dataset's batch through its own batch loop (read.staged.load_batch), timed per stage;
        any other dataset's samples timed as one ``getitem`` stage."""
        row = self.table[_row()]
        if isinstance(self.dataset, StagedDataset):
            return load_batch(self.dataset, indices, clock=_RowClock(row))
        t0 = time.perf_counter()
        out = [self.dataset[i] for i in indices]
        row[STAGES.index("getitem")] += time.perf_counter() - t0
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
