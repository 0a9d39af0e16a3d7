"""Prefetchers: overlap getting the next batch with computing on the current one.

``BackgroundLoader(loader, depth=N)`` keeps N batches ready in a thread (useful with
``num_workers=0``, or to hide the main process's share of loading: unpickling, pinning).
``CUDAPrefetcher(loader, device)`` copies the next batch to the GPU on a side CUDA stream
while the current batch computes (the approach of NVIDIA Apex's ``data_prefetcher``); on a
machine without CUDA it passes batches through unchanged, so one script runs everywhere.
"""

from __future__ import annotations

import atexit
import copy
import queue
import threading
import warnings
import weakref
from collections.abc import Generator, Iterable, Iterator, Mapping
from typing import Any, cast

import torch

from packer.errors import OptionError, PackerError
from packer.read.resume import Stateful

_END = object()


class _Raised:
    """An exception from the loader, carried to the consumer to be raised there."""

    def __init__(self, exc: BaseException) -> None:
        self.exc = exc


def _produce(it: Iterator, out: queue.Queue, stop: threading.Event, loader: Stateful | None) -> None:
    """Thread body: pull batches into ``out`` until the loader ends, fails or we're told to stop.

    With a stateful ``loader``, each batch travels with the loader's state right after it.
    """
    try:
        while not stop.is_set():
            state = None
            try:
                item: Any = next(it)
                state = None if loader is None else copy.deepcopy(loader.state_dict())
            except StopIteration:
                item = _END
            except BaseException as exc:  # noqa: BLE001 - re-raised in the consumer
                item = _Raised(exc)
            while not stop.is_set():
                try:
                    out.put((item, state), timeout=0.1)
                    break
                except queue.Full:
                    continue
            if item is _END or isinstance(item, _Raised):
                return
    finally:
        del it  # drop the loader's iterator in this thread (DataLoader workers shut down with it)


EXIT_JOIN_S = 1.0  # how long a producer is waited for at interpreter exit (its thread is a daemon)


class Prefetcher:
    """``(item, state)`` for each item of ``it``, pulled up to ``depth`` ahead by a thread of its own (``state``:
    ``stateful.state_dict()`` taken right after the item was pulled; None without one).

    ``get`` raises the loader's exception again (with its traceback), and StopIteration at the end or once closed.
    ``close`` may be called from any thread, the producer's own included (it is not joined then): it stops and
    joins the thread, and a ``get`` waiting in another thread ends. Live ones are closed at interpreter exit, before
    the modules they need are torn down.
    """

    exiting = False  # set at interpreter exit: producers are waited for EXIT_JOIN_S at most

    def __init__(self, it: Iterator, depth: int, stateful: Stateful | None = None, join_timeout: float = 60.0,
                 name: str = "packer-prefetch") -> None:
        self.closed = True  # until made: nothing to close
        self.out: queue.Queue = queue.Queue(maxsize=depth)
        self.stop = threading.Event()
        self.ended = self.closed = False
        self.name, self.join_timeout = name, join_timeout
        self.thread = threading.Thread(target=_produce, args=(it, self.out, self.stop, stateful), name=name,
                                       daemon=True)
        del it
        self.thread.start()
        close_at_exit(self)

    def get(self) -> tuple[Any, Any]:
        if self.ended:
            raise StopIteration
        item, state = self.out.get()
        if item is _END or isinstance(item, _Raised):
            self.ended = True
            try:
                self.out.put_nowait((_END, None))  # a get waiting in another thread ends (the producer has returned)
            except queue.Full:  # close() put one there meanwhile
                pass
            if item is _END:
                raise StopIteration
            raise item.exc
        return item, state

    def close(self) -> None:
        if self.closed:  # once: at exit, the generator around it may close it again after the modules are gone
            return
        self.closed = True
        self.stop.set()
        self._drain()  # unblock a producer waiting on a full queue
        if self.thread is not threading.current_thread():
            # at exit, a producer stuck in its loader (a stalled stream) must not hold the interpreter for long
            self.thread.join(EXIT_JOIN_S if Prefetcher.exiting else self.join_timeout)
            if self.thread.is_alive() and not Prefetcher.exiting:
                warnings.warn(
                    f"{self.name}: the loader did not return a batch within {self.join_timeout:.0f} s "
                    "of being stopped; its thread is left to finish that batch", RuntimeWarning, stacklevel=2)
        self._drain()
        try:
            self.out.put_nowait((_END, None))  # a get waiting in another thread ends
        except queue.Full:  # the producer still runs (its own thread closed it, or it did not stop in time)
            pass

    def __del__(self) -> None:
        self.close()

    def _drain(self) -> None:
        while True:
            try:
                self.out.get_nowait()
            except queue.Empty:
                return


_AT_EXIT: weakref.WeakSet[Any] = weakref.WeakSet()


def close_at_exit(obj: Any) -> None:
    """``obj.close()`` at interpreter exit if it still lives (a loop left with its iterator still referenced):
    while the modules its threads need still work, producers waited for ``EXIT_JOIN_S`` at most."""
    _AT_EXIT.add(obj)


@atexit.register
def _close_live() -> None:
    Prefetcher.exiting = True
    for obj in list(_AT_EXIT):
        obj.close()


def prefetched(it: Iterator, depth: int, stateful: Stateful | None = None, join_timeout: float = 60.0,
               name: str = "packer-prefetch") -> Generator[tuple[Any, Any], None, None]:
    """``Prefetcher``'s items as a generator: its thread stops and is joined when ``it`` ends or raises (raised
    again here), and when this generator is closed or collected (the consumer broke out or raised)."""
    feed = Prefetcher(it, depth, stateful, join_timeout, name)
    del it
    try:
        while True:
            try:
                item, state = feed.get()
            except StopIteration:
                return
            yield item, state
    finally:
        feed.close()


class BackgroundLoader:
    """Iterate ``loader`` in a background thread that keeps up to ``depth`` batches ready.

    Each ``iter()`` starts one thread; it stops and is joined when the iteration ends, when the
    consumer breaks out or raises (the generator is closed or garbage-collected), or on
    ``close()``. An exception raised by the loader is raised again in the consumer, with its
    original traceback. Over a loader with ``state_dict()`` (torchdata's ``StatefulDataLoader``),
    ``state_dict()`` gives the loader's state after the last batch *handed out*, not after the
    ones prefetched, so a job resumed from it neither repeats nor skips a batch.

    Args:
        loader: any iterable of batches (a DataLoader, a ``ThreadLoader``, a ``StatefulDataLoader``).
        depth: batches kept ready ahead of the one handed out (at least 1; default 2).
        join_timeout: seconds to wait for the thread to stop when an iteration ends early (default 60).
    """

    def __init__(self, loader: Iterable, depth: int = 2, join_timeout: float = 60.0) -> None:
        if depth < 1:
            raise OptionError(f"depth must be at least 1, got {depth}")
        self.loader = loader
        self.depth = depth
        self.join_timeout = join_timeout
        self._live: weakref.WeakSet = weakref.WeakSet()
        self._state: dict[str, Any] | None = None  # the loader's state after the last batch handed out

    def __len__(self) -> int:
        return len(self.loader)  # type: ignore[arg-type]

    def __iter__(self) -> Iterator:
        gen = self._iterate()
        self._live.add(gen)
        return gen

    def _iterate(self) -> Iterator:
        stateful = self.loader if isinstance(self.loader, Stateful) else None
        if stateful is not None:
            try:
                self._state = copy.deepcopy(stateful.state_dict())  # where this iteration starts (a loaded state)
            except PackerError:  # it cannot save (a ThreadLoader over a plain sampler): iterated without states,
                stateful = None  # and state_dict() raises its error
        # iter() here, in the caller's thread (DataLoader workers are started from it); no reference kept
        for item, state in prefetched(iter(self.loader), self.depth, stateful, self.join_timeout,
                                      "packer-BackgroundLoader"):
            self._state = state
            yield item

    def close(self) -> None:
        """Stop every iteration still running (their threads are joined)."""
        for gen in list(self._live):
            gen.close()

    def state_dict(self) -> dict[str, Any]:
        """The wrapped loader's state after the last batch this loader handed out."""
        stateful = self._stateful()
        return {"loader": copy.deepcopy(stateful.state_dict() if self._state is None else self._state)}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Resume the next iteration after the last batch handed out when ``state_dict`` was saved."""
        self._stateful().load_state_dict(state_dict["loader"])
        self._state = copy.deepcopy(state_dict["loader"])

    def _stateful(self) -> Stateful:
        if not isinstance(self.loader, Stateful):
            raise PackerError(f"BackgroundLoader over a {type(self.loader).__name__} cannot save its position: wrap a "
                              "loader with state_dict()/load_state_dict(), e.g. torchdata's StatefulDataLoader")
        return self.loader

    def __enter__(self) -> BackgroundLoader:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def map_tensors(batch: Any, fn) -> Any:
    """Apply ``fn`` to every tensor in a batch made of tuples, lists, dicts and namedtuples."""
    if isinstance(batch, torch.Tensor):
        return fn(batch)
    if isinstance(batch, Mapping):
        mapped = {k: map_tensors(v, fn) for k, v in batch.items()}
        return mapped if type(batch) is dict else cast(Any, type(batch))(mapped)
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):  # namedtuple
        return cast(Any, type(batch))(*(map_tensors(v, fn) for v in batch))
    if isinstance(batch, (list, tuple)):
        return type(batch)(map_tensors(v, fn) for v in batch)
    return batch


def to_device(batch: Any, device: torch.device | str, non_blocking: bool = False) -> Any:
    """Every tensor of ``batch`` moved to ``device``."""
    return map_tensors(batch, lambda t: t.to(device, non_blocking=non_blocking))


def _pinned(t: torch.Tensor) -> torch.Tensor:
    return t if t.is_pinned() else t.pin_memory()


class CUDAPrefetcher:
    """Yield ``loader``'s batches already on ``device``, the copy of batch k+1 overlapping step k.

    On CUDA: each batch is copied from pinned host memory (pinned here if the DataLoader didn't,
    which costs a host copy: prefer ``pin_memory=True``) with ``non_blocking=True`` on a side
    stream. Before a batch is handed out, the compute stream waits for that copy
    (``wait_stream``), and each tensor is marked with ``record_stream`` so the caching allocator
    does not reuse its memory while the compute stream may still read it. On any other device
    (CPU), batches pass through untouched.

    Args:
        loader: any iterable of batches (tensors, or tuples, lists and dicts of them).
        device: where batches go (default: the current CUDA device, else the CPU).
    """

    def __init__(self, loader: Iterable, device: torch.device | str | None = None) -> None:
        self.loader = loader
        if device is None:
            device = "cuda" if torch.cuda.is_available() else "cpu"
        self.device = torch.device(device)
        if self.device.type == "cuda" and self.device.index is None and torch.cuda.is_available():
            self.device = torch.device("cuda", torch.cuda.current_device())

    @property
    def active(self) -> bool:
        """True when batches are really copied ahead on a CUDA side stream."""
        return self.device.type == "cuda"

    def __len__(self) -> int:
        return len(self.loader)  # type: ignore[arg-type]

    def __iter__(self) -> Iterator:
        if not self.active:
            yield from self.loader
            return
        if not torch.cuda.is_available():
            raise RuntimeError(f"CUDAPrefetcher: device {self.device} asked for, but CUDA is not available")
        side = torch.cuda.Stream(self.device)
        it = iter(self.loader)

        def preload() -> Any:
            try:
                batch = next(it)
            except StopIteration:
                return _END
            with torch.cuda.stream(side):
                return map_tensors(batch, lambda t: _pinned(t).to(self.device, non_blocking=True))

        nxt = preload()
        while nxt is not _END:
            compute = torch.cuda.current_stream(self.device)
            compute.wait_stream(side)  # the copy of this batch is done before compute uses it
            batch = nxt
            map_tensors(batch, lambda t, s=compute: t.record_stream(s))
            nxt = preload()  # enqueue the next copy; it runs while the caller computes on `batch`
            yield batch
