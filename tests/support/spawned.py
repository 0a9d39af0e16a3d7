"""One spawned DataLoader for every spawn property of the session (tests/conftest.py's ``spawned`` fixture).

A spawned worker pays an interpreter start-up and a torch import, so the tests of what a
spawned worker does (every reader family unpickled in a fresh interpreter) do not start their own: each test module
registers a probe for its test (``probe_for``), and one DataLoader of two spawned workers runs the probes of every
selected test at once. Each worker unpickles every probe (so every reader family) and runs its share of every
probe's steps, and the test then asserts on what the workers returned, as it did on its own DataLoader's batches.
A probe that fails to build, pickle, unpickle or run fails only its own test, with its traceback.
"""

from __future__ import annotations

import os
import pickle
import traceback
from abc import ABC, abstractmethod
from bisect import bisect_right
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from multiprocessing.reduction import ForkingPickler
from pathlib import Path
from typing import Any

from torch.utils.data import Dataset


def _identity(x):
    return x


class Probe(ABC):
    """What spawned workers do for one test: ``run(j)`` for each step j < ``len(probe)``, in a worker. It is
    pickled to the workers with all it holds (datasets: their readers), as a DataLoader pickles its dataset."""

    @abstractmethod
    def __len__(self) -> int: ...

    @abstractmethod
    def run(self, j: int) -> Any: ...


class Fetch(Probe):
    """A DataLoader worker's fetch over ``batches``: ``collate(ds.__getitems__(batch))`` per batch of indices (the
    batch path a worker takes), or, with ``batched=False``, ``collate(ds[index])`` per index (batch_size=None)."""

    def __init__(self, ds, batches: Sequence, collate: Callable = _identity, batched: bool = True):
        self.ds, self.batches, self.collate, self.batched = ds, list(batches), collate, batched

    def __len__(self) -> int:
        return len(self.batches)

    def run(self, j: int) -> Any:
        index = self.batches[j]
        if not self.batched:
            return self.collate(self.ds[index])
        getitems = getattr(self.ds, "__getitems__", None)  # as torch's fetcher: a dataset without it, per sample
        return self.collate(getitems(list(index)) if getitems else [self.ds[i] for i in index])


class Cases(Dataset):
    """The samples of ``datasets`` one after another; sample k is ``(case, *datasets[case][j])``. Batches go to each
    dataset's own ``__getitems__`` (the batch path DataLoader workers take), a call per dataset a batch touches."""

    def __init__(self, datasets: Sequence):
        self.datasets = list(datasets)
        self.starts = [0]
        for ds in self.datasets:
            self.starts.append(self.starts[-1] + len(ds))

    def __len__(self) -> int:
        return self.starts[-1]

    def __getitems__(self, ks: Sequence[int]) -> list[tuple]:
        located = [(c := bisect_right(self.starts, k) - 1, k - self.starts[c]) for k in ks]
        read: dict[int, list] = {}
        for case in dict.fromkeys(c for c, _ in located):
            read[case] = list(self.datasets[case].__getitems__([j for c, j in located if c == case]))
        return [(case, *read[case].pop(0)) for case, _ in located]


def batches_of(n: int, size: int, order: Sequence[int] | None = None) -> list[list[int]]:
    """``order`` (default 0..n-1) cut into batches of ``size``, the last one shorter."""
    order = list(range(n)) if order is None else list(order)
    return [order[k:k + size] for k in range(0, len(order), size)]


Builder = Callable[[Any], tuple[Probe, Any]]
REGISTRY: dict[tuple[str, str], Builder] = {}


def probe_for(test: Callable) -> Callable[[Builder], Builder]:
    """Registers ``builder(tmp_path_factory) -> (probe, context)`` for ``test`` (a test function of the calling
    module): the session's spawned DataLoader runs the probe when the test is selected; the test gets the
    context (not sent to the workers) with the results."""
    def register(builder: Builder) -> Builder:
        REGISTRY[(test.__module__, test.__name__)] = builder
        return builder
    return register


@dataclass
class Failed:
    """A probe that could not be built, pickled, unpickled or run: where and the traceback."""
    where: str
    trace: str


@dataclass
class Outcome:
    """What the spawned workers returned for one test's probe."""
    context: Any = None
    results: list = field(default_factory=list)  # run(j) for each step j, in order
    pids: list[int] = field(default_factory=list)  # the worker that ran each step
    failed: Failed | None = None

    def values(self) -> list:
        """The results, or the test fails with the workers' traceback."""
        if self.failed is not None:
            raise AssertionError(f"the spawned probe failed to {self.failed.where}:\n{self.failed.trace}")
        return self.results


class Sealed:
    """A probe as it travels to a worker: pickled on its own each time the battery is (once per worker, as a
    DataLoader pickles its dataset for each worker: a tensor's shared memory is handed over once per pickle), and
    unpickled when first run, so that a probe that cannot be pickled or unpickled fails alone."""

    def __init__(self, probe: Probe):
        self.probe: Probe | Failed | None = probe
        self.blob: bytes | None = None

    def __getstate__(self):
        try:
            return {"probe": None, "blob": bytes(ForkingPickler.dumps(self.probe))}  # torch's reducers, as Process
        except Exception:  # noqa: BLE001  # the probe's test reports it
            return {"probe": Failed("pickle for the spawned worker", traceback.format_exc()), "blob": None}

    def get(self) -> Probe | Failed:
        if self.probe is None:
            try:
                self.probe = pickle.loads(self.blob or b"")
            except Exception:  # noqa: BLE001
                self.probe = Failed("unpickle in the spawned worker", traceback.format_exc())
        assert self.probe is not None
        return self.probe


class Battery(Dataset):
    """The probes' steps one after another; item k runs its probe's step in the worker and returns (probe, step,
    worker pid, result or Failed)."""

    def __init__(self, probes: Sequence[Probe]):
        self.probes = [Sealed(p) for p in probes]
        self.starts = [0]
        for p in probes:
            self.starts.append(self.starts[-1] + len(p))

    def __len__(self) -> int:
        return self.starts[-1]

    def __getitem__(self, k: int):
        case = bisect_right(self.starts, k) - 1
        j = k - self.starts[case]
        probe = self.probes[case].get()
        if isinstance(probe, Failed):
            return case, j, os.getpid(), probe
        try:
            return case, j, os.getpid(), probe.run(j)
        except Exception:  # noqa: BLE001
            return case, j, os.getpid(), Failed(f"run step {j} in the spawned worker", traceback.format_exc())


def run_all(builders: dict[tuple[str, str], Builder], tmp_path_factory, cwd: Path) -> dict[tuple[str, str], Outcome]:
    """Builds every probe, runs them all through one DataLoader of two spawned workers started in ``cwd``, and
    gives each its Outcome."""
    from torch.utils.data import DataLoader

    outcomes: dict[tuple[str, str], Outcome] = {}
    names, probes = [], []
    for name, build in builders.items():
        try:
            probe, context = build(tmp_path_factory)
        except Exception:  # noqa: BLE001
            outcomes[name] = Outcome(failed=Failed("build", traceback.format_exc()))
            continue
        outcomes[name] = Outcome(context)
        names.append(name)
        probes.append(probe)
    if not names:
        return outcomes
    loader = DataLoader(Battery(probes), batch_size=None, num_workers=2, multiprocessing_context="spawn",
                        collate_fn=_identity)
    here = os.getcwd()
    os.chdir(cwd)  # the workers start here: not where any dataset was opened by a relative path
    try:
        for case, _j, pid, result in loader:
            out = outcomes[names[case]]
            if isinstance(result, Failed):
                out.failed = out.failed or result
            out.results.append(result)
            out.pids.append(pid)
    except Exception:  # noqa: BLE001  # the DataLoader itself failed: every probe's test says so
        trace = traceback.format_exc()
        for name in names:
            outcomes[name].failed = outcomes[name].failed or Failed("run the spawned DataLoader", trace)
    finally:
        os.chdir(here)
    return outcomes
