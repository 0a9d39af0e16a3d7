"""A RAM cache of a packed dataset that every DataLoader worker shares: one copy, not one per worker.

``open_dataset(path, cache="ram")`` keeps the stored payloads (encoded bytes: no more IO, still
decoded per sample); ``cache="ram-decoded"`` keeps decoded pixels (no IO, no decoding; about
10x the bytes). The cache is one file in /dev/shm (tmpfs, i.e. RAM), filled once by the process
that creates it and memory-mapped read-only by every process that reads it: fork workers
inherit the mapping, spawn workers map the file by name, other ranks on the node can
``CachedDataset.attach`` it. The page-cache pages are shared, so N workers cost one copy
(caches kept in Python objects are copied into each worker as they are touched, which is
how per-worker caches blow up memory).

File layout: a 64-byte header (magic, mode, sample count, data offset, ready flag), ``int64``
offsets ``[N+1]``, ``int64`` shapes ``[N, 3]``, then the samples back to back from a page boundary.

Clean-up, crash included (why not ``multiprocessing.shared_memory``: on Python < 3.13 every
process that attaches a segment registers it with its resource tracker, which unlinks it when
*that* process exits, so a spawn worker ending would delete the cache under everyone else):
 1. ``close()``, garbage collection and interpreter exit unlink the file in the creating process
    (never in workers: they check the creator's pid);
 2. a tiny janitor process, started with the cache as the creator's child, unlinks the file when
    its parent changes (the creator died in any way, SIGKILL and segfaults included; checked 4
    times a second) or the creator writes to its pipe (``close()``). It does not wait for the pipe
    to close: forked DataLoader workers hold it too, and orphaned workers can outlive the creator;
 3. files are named ``packer-cache-<pid>-<start time>-<random>.bin``; creating a cache first
    removes files whose creator is no longer running (the start time tells a reused pid apart),
    which covers the janitor itself being killed.
"""

from __future__ import annotations

import copy
import os
import secrets
import struct
import subprocess
import sys
import time
import weakref
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from packer import sysinfo
from packer.errors import DatasetError, OptionError, PackerError
from packer.images.decode import copy_into
from packer.layout.fields import FieldStore
from packer.layout.index import Index
from packer.layout.manifest import Manifest
from packer.progress import bar as progress_bar
from packer.read.indexing import IndexMap
from packer.read.staged import StagedDataset
from packer.read.surface import FolderSurface
from packer.units import human_bytes

if TYPE_CHECKING:
    from packer.images.crop import CropDecode, Window

CACHE_MODES = ("ram", "ram-decoded")
PREFIX = "packer-cache-"
_MAGIC = b"PKRCACHE"
_HEADER = struct.Struct("<8sqqqq")  # magic, mode (0 payload, 1 decoded), samples, data offset, ready
_HEADER_BYTES = 64
_PAGE = 4096
_HEADROOM = 0.05  # of total RAM left free after caching, at least 256 MB

# The janitor: unlinks argv[1] once its parent (the creator) exits or writes to / closes the pipe.
# It watches the parent's pid itself rather than waiting for the pipe to close: DataLoader workers
# forked from the creator hold the pipe too and may outlive it (orphans), and the file must not.
_JANITOR = (
    "import os, select, signal, sys\n"
    "for s in (signal.SIGINT, signal.SIGHUP): signal.signal(s, signal.SIG_IGN)\n"
    "creator = int(sys.argv[2])\n"
    "poll = select.poll()\n"
    "poll.register(0, select.POLLIN)\n"
    "while os.getppid() == creator and not poll.poll(250):\n"
    "    pass\n"
    "try: os.unlink(sys.argv[1])\n"
    "except FileNotFoundError: pass\n"
)


# ----------------------------------------------------------------------------- memory figures

def memory_available() -> int | None:
    """MemAvailable in bytes (a function so tests can fake it)."""
    return sysinfo.memory_available()


def check_fits(needed: int, shm_dir: Path) -> None:
    """Refuse, with the figures, a cache that would not fit in free RAM or in the shm filesystem."""
    avail = memory_available()
    total = sysinfo.meminfo().get("MemTotal", 0)
    headroom = max(int(_HEADROOM * total), 256 << 20)
    space = sysinfo.disk_space(shm_dir)
    problems = []
    if avail is not None and needed + headroom > avail:
        problems.append(f"{human_bytes(avail)} of RAM is available (MemAvailable), and "
                        f"{human_bytes(headroom)} must stay free for everything else")
    if space is not None and needed > space[0]:
        problems.append(f"{shm_dir} has {human_bytes(space[0])} free of {human_bytes(space[1])} "
                        "(in a container: docker run --shm-size=...)")
    if problems:
        raise PackerError(f"RAM cache refused: it needs {human_bytes(needed)}, but " + "; ".join(problems)
                          + ". Use cache='ram' (stored bytes, smaller) instead of 'ram-decoded', or no cache.")


# ----------------------------------------------------------------------------- file lifetime

def _cache_name() -> str:
    pid = os.getpid()
    return f"{PREFIX}{pid}-{sysinfo.process_start_time(pid) or 0}-{secrets.token_hex(4)}.bin"


def sweep_stale(shm_dir: Path = sysinfo.SHM_DIR) -> list[Path]:
    """Remove cache files whose creating process is gone (killed before it could clean up)."""
    removed = []
    try:
        names = [n for n in os.listdir(shm_dir) if n.startswith(PREFIX) and n.endswith(".bin")]
    except OSError:
        return removed
    for name in names:
        try:
            pid_s, start_s = name[len(PREFIX):-4].split("-")[:2]
            pid, start = int(pid_s), int(start_s)
        except ValueError:
            continue
        if sysinfo.process_start_time(pid) == start:
            continue  # its creator still runs
        try:
            os.unlink(shm_dir / name)
            removed.append(shm_dir / name)
        except OSError:
            pass  # another user's, or already gone
    return removed


def _start_janitor(path: Path) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-I", "-S", "-c", _JANITOR, str(path), str(os.getpid())], stdin=subprocess.PIPE,
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True, close_fds=True,
    )


def _release(path: str, owner_pid: int, janitor: subprocess.Popen | None) -> None:
    """Unlink the cache file, in the creating process only; then let the janitor go."""
    if os.getpid() != owner_pid:
        return
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
    if janitor is not None:
        try:
            janitor.stdin.write(b"x")  # type: ignore[union-attr]  # closing alone: forked workers hold the pipe too
            janitor.stdin.close()  # type: ignore[union-attr]
            janitor.wait(timeout=5)
        except (OSError, subprocess.TimeoutExpired):
            pass


# ----------------------------------------------------------------------------- filling

def _sizes(ds: Any, decoded: bool) -> tuple[np.ndarray, np.ndarray]:
    """Bytes and (h, w, c) shape of each sample as it will be cached, from the dataset's index."""
    if not isinstance(ds, StagedDataset):
        raise OptionError(f"the RAM cache works on packer datasets (open_dataset), not {type(ds).__name__}")
    if decoded and not ds.has_images:
        raise OptionError("this dataset's samples have no image to decode: use cache='ram'")
    index = ds.index
    h, w = index.heights.astype(np.int64), index.widths.astype(np.int64)
    shapes = np.stack([h, w, np.full_like(h, 3)], axis=1)
    if decoded or ds.manifest.payload == "raw":
        return h * w * 3, shapes
    return index.nbytes.astype(np.int64), shapes


def _fill_range(ds: Any, path: str, base: int, offsets: np.ndarray, start: int, decoded: bool,
                chunk: int = 256) -> None:
    """Write the samples stored at ``start, start+1, ...`` at ``base + offsets[k]`` of the cache file (in the pool
    too)."""
    mm = np.memmap(path, dtype=np.uint8, mode="r+")
    try:
        count = len(offsets) - 1
        for a in range(0, count, chunk):
            idx = list(range(start + a, start + min(count, a + chunk)))
            for k, (i, payload) in enumerate(zip(idx, ds.payloads_at(idx), strict=True), start=a):
                item = ds.pixels_at(i, payload) if decoded else payload
                if isinstance(item, np.ndarray):
                    buf = np.ascontiguousarray(item).reshape(-1)
                else:
                    buf = np.frombuffer(item, dtype=np.uint8)
                lo, hi = base + int(offsets[k]), base + int(offsets[k + 1])
                if buf.size != hi - lo:
                    raise DatasetError(f"{ds.root}: sample {i} has {buf.size} bytes, the index says {hi - lo} "
                                       "(decode-time resizing can't be cached decoded; use cache='ram')")
                mm[lo:hi] = buf
        mm.flush()
    finally:
        del mm


# ----------------------------------------------------------------------------- the dataset

class CachedDataset(FolderSurface):
    """``dataset`` served from one shared-memory copy (see the module docstring), in storage order; its
    indices, ``samples`` and ImageFolder surface are the wrapped dataset's. ``open_dataset(p, cache=...)``
    makes one.

    Args:
        dataset: a packer dataset (``open_dataset``): its transforms, image kind and decoder stay in use.
        mode: ``"ram"`` caches the stored payloads (no more IO, still decoded per sample), ``"ram-decoded"``
            the decoded pixels (no decoding either, several times larger).
        workers: processes that decode while filling a ``"ram-decoded"`` cache (default: all cores).
        progress: a progress bar while filling: None (default) when stderr is a terminal, True, False.
        shm_dir: the shared-memory folder (a tmpfs; default ``/dev/shm``): it must hold the whole copy.
    """

    def __init__(self, dataset: Any, mode: str = "ram", *, workers: int | None = None, progress: bool | None = None,
                 shm_dir: str | os.PathLike = sysinfo.SHM_DIR) -> None:
        if mode not in CACHE_MODES:
            raise OptionError(f"unknown cache {mode!r} (choose {' or '.join(CACHE_MODES)})")
        self.dataset = dataset
        self.mode = mode
        self.decoded = mode == "ram-decoded"
        shm = Path(shm_dir)
        if not shm.is_dir():
            raise PackerError(f"RAM cache: {shm} does not exist (it needs a tmpfs such as /dev/shm)")
        sizes, shapes = _sizes(dataset, self.decoded)
        n = len(sizes)
        offsets = np.zeros(n + 1, dtype=np.int64)
        np.cumsum(sizes, out=offsets[1:])
        data_at = -(-(_HEADER_BYTES + 8 * (n + 1) + 24 * n) // _PAGE) * _PAGE
        total = data_at + int(offsets[-1])
        sweep_stale(shm)
        check_fits(total, shm)

        self.path = shm / _cache_name()
        self.num_samples, self.data_at, self.total_bytes = n, data_at, total
        self.owner_pid = os.getpid()
        try:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        except OSError as exc:
            raise PackerError(f"RAM cache: cannot create {self.path} ({exc.strerror})") from exc
        janitor = None
        try:
            janitor = _start_janitor(self.path)
            try:  # reserve the pages now: a full tmpfs then fails here, not with SIGBUS while filling
                os.posix_fallocate(fd, 0, total)
            except OSError as exc:
                raise PackerError(f"RAM cache: cannot reserve {human_bytes(total)} in {shm} ({exc.strerror})") from exc
            self._finalizer = weakref.finalize(self, _release, str(self.path), self.owner_pid, janitor)
            self._fill(fd, offsets, shapes, workers, progress)
        except BaseException:
            os.close(fd)
            _release(str(self.path), self.owner_pid, janitor)
            raise
        os.close(fd)
        self._mm: np.memmap | None = None

    @classmethod
    def attach(cls, dataset: Any, path: str | os.PathLike, timeout: float = 600.0) -> CachedDataset:
        """Map a cache another process (e.g. local rank 0) created for the same dataset; waits until it is filled."""
        self = cls.__new__(cls)
        self.dataset, self.path, self.owner_pid = dataset, Path(path), -1
        deadline = time.monotonic() + timeout
        while True:
            try:
                with open(self.path, "rb") as fh:
                    magic, mode, n, data_at, ready = _HEADER.unpack(fh.read(_HEADER.size))
            except (OSError, struct.error) as exc:
                raise PackerError(f"{path}: not a readable packer RAM cache ({exc})") from exc
            if magic not in (_MAGIC, bytes(8)):  # zeros: created, header not written yet
                raise PackerError(f"{path}: not a packer RAM cache")
            if (ready and magic == _MAGIC) or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        if not ready:
            raise PackerError(f"{path}: the RAM cache was not filled within {timeout:.0f} s")
        if n != len(dataset):
            raise PackerError(f"{path}: caches {n} samples but the dataset has {len(dataset)}")
        self.mode, self.decoded = CACHE_MODES[mode], bool(mode)
        self.num_samples, self.data_at = n, data_at
        self.total_bytes = os.path.getsize(self.path)
        self._finalizer = None
        self._mm = None
        return self

    def _fill(self, fd: int, offsets: np.ndarray, shapes: np.ndarray, workers: int | None,
              progress: bool | None) -> None:
        n, data_at = self.num_samples, self.data_at
        head = np.memmap(self.path, dtype=np.uint8, mode="r+", shape=(data_at,))
        head[_HEADER_BYTES:_HEADER_BYTES + 8 * (n + 1)] = offsets.view(np.uint8)
        shapes_at = _HEADER_BYTES + 8 * (n + 1)
        head[shapes_at:shapes_at + 24 * n] = shapes.astype(np.int64).view(np.uint8).reshape(-1)
        head[:_HEADER.size] = np.frombuffer(_HEADER.pack(_MAGIC, int(self.decoded), n, data_at, 0), dtype=np.uint8)
        head.flush()
        del head
        # Plain copy of the wrapped dataset without transforms: what fill processes need, picklable.
        src = copy.copy(self.dataset)
        src.transform = src.target_transform = None
        procs = workers if workers is not None else (os.cpu_count() or 1)
        step = min(1024, max(16, -(-n // (4 * procs))))
        ranges = [(a, min(n, a + step)) for a in range(0, n, step)]
        bar = progress_bar(total=n, desc=f"caching in RAM ({human_bytes(self.total_bytes)})", progress=progress)
        jobs = [(src, str(self.path), data_at + int(offsets[a]), offsets[a:b + 1] - offsets[a], a, self.decoded)
                for a, b in ranges]
        if self.decoded and procs > 1 and len(ranges) > 1:  # decoding is CPU work: spread it
            with ProcessPoolExecutor(min(procs, len(ranges))) as pool:
                for (a, b), fut in zip(ranges, [pool.submit(_fill_range, *job) for job in jobs], strict=True):
                    fut.result()
                    bar.update(b - a)
        else:  # stored bytes: one sequential pass reads fastest
            for (a, b), job in zip(ranges, jobs, strict=True):
                _fill_range(*job)
                bar.update(b - a)
        bar.close()
        os.pwrite(fd, _HEADER.pack(_MAGIC, int(self.decoded), n, data_at, 1), 0)

    # ------------------------------------------------------------ reading (any process)

    def _map(self) -> np.memmap:
        if self._mm is None:  # fork children inherit the parent's (shared) mapping; spawn ones map here
            self._mm = np.memmap(self.path, dtype=np.uint8, mode="r")
            n = self.num_samples
            self._offsets = self._mm[_HEADER_BYTES:_HEADER_BYTES + 8 * (n + 1)].view(np.int64)
            shapes_at = _HEADER_BYTES + 8 * (n + 1)
            self._shapes = self._mm[shapes_at:shapes_at + 24 * n].view(np.int64).reshape(n, 3)
        return self._mm

    def __len__(self) -> int:
        return self.num_samples

    # The wrapped dataset's state, delegated one name at a time (never blanket forwarding); the
    # ImageFolder surface built on it (targets, samples, ...) is FolderSurface's, as the wrapped dataset's.
    @property
    def classes(self) -> list[str]:  # pyright: ignore[reportIncompatibleVariableOverride]
        return self.dataset.classes

    @property
    def class_to_idx(self) -> dict[str, int]:  # pyright: ignore[reportIncompatibleVariableOverride]
        return self.dataset.class_to_idx

    @property
    def source_root(self) -> str | None:  # pyright: ignore[reportIncompatibleVariableOverride]
        return self.dataset.source_root

    @property
    def index(self) -> Index:  # pyright: ignore[reportIncompatibleVariableOverride]
        return self.dataset.index

    @property
    def manifest(self) -> Manifest:  # pyright: ignore[reportIncompatibleVariableOverride]
        return self.dataset.manifest

    @property
    def field_store(self) -> FieldStore:  # pyright: ignore[reportIncompatibleVariableOverride]
        return self.dataset.field_store

    @property
    def index_map(self) -> IndexMap:  # pyright: ignore[reportIncompatibleVariableOverride]
        return self.dataset.index_map

    root = property(lambda self: self.dataset.root)
    image = property(lambda self: self.dataset.image)

    @property
    def transform(self):
        return self.dataset.transform

    @transform.setter
    def transform(self, fn) -> None:
        self.dataset.transform = fn

    @property
    def target_transform(self):
        return self.dataset.target_transform

    @target_transform.setter
    def target_transform(self, fn) -> None:
        self.dataset.target_transform = fn

    def block_boundaries(self) -> np.ndarray | None:
        return self.dataset.block_boundaries()

    def payload_at(self, i: int) -> Any:
        """The sample stored at ``i``, from the cache: stored bytes (``ram``) or a read-only HWC array
        (``ram-decoded``)."""
        mm = self._map()
        a, b = self.data_at + int(self._offsets[i]), self.data_at + int(self._offsets[i + 1])
        if self.decoded:
            return mm[a:b].reshape(tuple(int(v) for v in self._shapes[i]))
        return mm[a:b].tobytes()

    def pixels_at(self, i: int, payload: Any = None, strict: bool = False, out: np.ndarray | None = None,
                  window: Window | None = None) -> np.ndarray:
        if payload is None:
            payload = self.payload_at(i)
        return copy_into(payload, out) if self.decoded else self.dataset.pixels_at(i, payload, strict, out, window)

    def crop_windows(self, idx: Sequence[int]) -> list[Window] | None:
        return None if self.decoded else self.dataset.crop_windows(idx)

    def crop_stream(self) -> CropDecode | None:
        return None if self.decoded else self.dataset.crop_stream()

    def present_at(self, i: int, arr: np.ndarray, tensor: torch.Tensor | None = None) -> Any:
        return self.dataset.present_at(i, arr, tensor)

    def batch_slots(self, idx: Sequence[int]) -> list[torch.Tensor] | None:
        """The wrapped dataset's shared batch block (it depends only on the samples' sizes); no disk read-ahead."""
        return self.dataset.batch_slots(idx)

    def __getstate__(self) -> dict:
        state = self.__dict__.copy()
        for k in ("_mm", "_offsets", "_shapes", "_finalizer"):
            state.pop(k, None)
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)  # pyright: ignore[reportAttributeAccessIssue]
        self._mm, self._finalizer = None, None

    def close(self) -> None:
        """Unmap, and in the creating process delete the cache (workers that still map it keep their view)."""
        self._mm = None
        if self._finalizer is not None:
            self._finalizer()

    def __repr__(self) -> str:
        return (f"CachedDataset({self.dataset!r}, mode={self.mode!r}, {human_bytes(self.total_bytes)} "
                f"in {self.path})")
