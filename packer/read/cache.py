"""A RAM cache of a packed dataset that every DataLoader worker shares: one copy, not one per worker.

``RamCache`` is a ``SampleSource`` (``open_dataset(path, cache=...)``): ``"ram"`` keeps the stored payloads,
``"ram-decoded"`` decoded pixels. It is one file in /dev/shm, filled once by its creator and mapped read-only by every
reader (fork workers inherit the mapping, spawn workers and other ranks map it by name), so N workers share its pages.
The file is removed when its creator closes it or dies in any way (a janitor child process; stale files swept by pid
and start time): docs/diagnose.md "Clean-up, crash included" says how, and why not ``multiprocessing.shared_memory``.

File layout: a 64-byte header (magic, mode, sample count, data offset, ready flag), ``int64`` offsets ``[N+1]``,
``int64`` shapes ``[N, 3]``, then the samples back to back from a page boundary.
"""

from __future__ import annotations

import os
import secrets
import struct
import subprocess
import sys
import time
import weakref
from collections.abc import Callable, Sequence
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import numpy as np

from packer import sysinfo
from packer.errors import DatasetError, OptionError, PackerError
from packer.layout.manifest import IMAGELESS
from packer.progress import bar as progress_bar
from packer.read.decoding import Decoding
from packer.read.hints import Ahead
from packer.read.readahead import Pending
from packer.read.source import SampleSource
from packer.units import human_bytes

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

def _sizes(source: SampleSource, decoded: bool) -> tuple[np.ndarray, np.ndarray]:
    """Bytes and (h, w, c) shape of each sample as it will be cached, from the source's index."""
    if decoded and source.manifest.payload == IMAGELESS:
        raise OptionError("this dataset's samples have no image to decode: use cache='ram'")
    index = source.index
    h, w = index.heights.astype(np.int64), index.widths.astype(np.int64)
    shapes = np.stack([h, w, np.full_like(h, 3)], axis=1)
    if decoded or source.payload == "raw":
        return h * w * 3, shapes
    return index.nbytes.astype(np.int64), shapes


def _fill_range(source: SampleSource, decoding: Decoding | None, path: str, base: int, offsets: np.ndarray,
                start: int, chunk: int = 256) -> None:
    """Write the samples stored at ``start, start+1, ...`` at ``base + offsets[k]`` of the cache file, decoded where
    ``decoding`` is given (in the pool too)."""
    mm = np.memmap(path, dtype=np.uint8, mode="r+")
    try:
        count = len(offsets) - 1
        for a in range(0, count, chunk):
            idx = np.arange(start + a, start + min(count, a + chunk))
            for k, (i, payload) in enumerate(zip(idx.tolist(), source.payloads(idx, source.start(idx)), strict=True),
                                             start=a):
                item = payload if decoding is None else decoding.pixels(i, payload, source.payload)
                if isinstance(item, np.ndarray):
                    buf = np.ascontiguousarray(item).reshape(-1)
                else:
                    buf = np.frombuffer(item, dtype=np.uint8)
                lo, hi = base + int(offsets[k]), base + int(offsets[k + 1])
                if buf.size != hi - lo:
                    raise DatasetError(f"{decoding.root if decoding else path}: sample {i} has {buf.size} bytes, the "
                                       f"index says {hi - lo} (decode-time resizing can't be cached decoded; use "
                                       "cache='ram')")
                mm[lo:hi] = buf
        mm.flush()
    finally:
        del mm


# ----------------------------------------------------------------------------- the source

class RamCache(SampleSource):
    """The samples of ``source`` from one shared-memory copy (see the module docstring), filled now in storage order;
    its metadata is ``source``'s. ``decoding``: how ``"ram-decoded"`` decodes them (the dataset's decoder and
    ``decode_size``); ``workers``, ``progress``, ``shm_dir``: as ``CachedDataset``'s."""

    def __init__(self, source: SampleSource, mode: str, decoding: Decoding, *, workers: int | None = None,
                 progress: bool | None = None, shm_dir: str | os.PathLike = sysinfo.SHM_DIR) -> None:
        if mode not in CACHE_MODES:
            raise OptionError(f"unknown cache {mode!r} (choose {' or '.join(CACHE_MODES)})")
        self._meta(source, mode)
        shm = Path(shm_dir)
        if not shm.is_dir():
            raise PackerError(f"RAM cache: {shm} does not exist (it needs a tmpfs such as /dev/shm)")
        sizes, shapes = _sizes(source, self.decoded)
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
            self._fill(fd, source, decoding if self.decoded else None, offsets, shapes, workers, progress)
        except BaseException:
            os.close(fd)
            _release(str(self.path), self.owner_pid, janitor)
            raise
        os.close(fd)
        self._mm: np.memmap | None = None

    def _meta(self, source: SampleSource, mode: str) -> None:
        self.manifest, self.index, self.fields = source.manifest, source.index, source.fields
        self.mode, self.decoded = mode, mode == "ram-decoded"
        self.payload = "raw" if self.decoded else source.payload

    @classmethod
    def attach(cls, source: SampleSource, path: str | os.PathLike, timeout: float = 600.0) -> RamCache:
        """Map a cache another process (e.g. local rank 0) created for the same dataset; waits until it is filled."""
        self = cls.__new__(cls)
        self.path, self.owner_pid = Path(path), -1
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
        if n != source.manifest.num_samples:
            raise PackerError(f"{path}: caches {n} samples but the dataset has {source.manifest.num_samples}")
        self._meta(source, CACHE_MODES[mode])
        self.num_samples, self.data_at = n, data_at
        self.total_bytes = os.path.getsize(self.path)
        self._finalizer = None
        self._mm = None
        return self

    def _fill(self, fd: int, source: SampleSource, decoding: Decoding | None, offsets: np.ndarray,
              shapes: np.ndarray, workers: int | None, progress: bool | None) -> None:
        n, data_at = self.num_samples, self.data_at
        head = np.memmap(self.path, dtype=np.uint8, mode="r+", shape=(data_at,))
        head[_HEADER_BYTES:_HEADER_BYTES + 8 * (n + 1)] = offsets.view(np.uint8)
        shapes_at = _HEADER_BYTES + 8 * (n + 1)
        head[shapes_at:shapes_at + 24 * n] = shapes.astype(np.int64).view(np.uint8).reshape(-1)
        head[:_HEADER.size] = np.frombuffer(_HEADER.pack(_MAGIC, int(self.decoded), n, data_at, 0), dtype=np.uint8)
        head.flush()
        del head
        procs = workers if workers is not None else (os.cpu_count() or 1)
        step = min(1024, max(16, -(-n // (4 * procs))))
        ranges = [(a, min(n, a + step)) for a in range(0, n, step)]
        bar = progress_bar(total=n, desc=f"caching in RAM ({human_bytes(self.total_bytes)})", progress=progress)
        jobs = [(source, decoding, str(self.path), data_at + int(offsets[a]), offsets[a:b + 1] - offsets[a], a)
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

    def start(self, positions: np.ndarray, ahead: Sequence[Ahead] = (), skip_cached: bool = True) -> Pending:
        """In memory already: nothing to read ahead."""
        return Pending.ready(len(positions))

    def payloads(self, positions: Sequence[int] | np.ndarray, pending: Pending | None = None,
                 into: Callable[[int], np.ndarray] | None = None,
                 places: Sequence[np.ndarray | None] | None = None) -> list:
        """From the cache: stored bytes (``ram``, copies) or read-only HWC arrays of the shared file (``ram-decoded``,
        which nothing truncates while it is mapped)."""
        mm = self._map()
        out = []
        for i in np.asarray(positions, dtype=np.int64).tolist():
            a, b = self.data_at + int(self._offsets[i]), self.data_at + int(self._offsets[i + 1])
            out.append(mm[a:b].reshape(tuple(int(v) for v in self._shapes[i])) if self.decoded else mm[a:b].tobytes())
        return out

    def __getstate__(self) -> dict:
        state = self.__dict__.copy()
        for k in ("_mm", "_offsets", "_shapes", "_finalizer"):
            state.pop(k, None)
        return state

    def __setstate__(self, state: dict) -> None:
        vars(self).update(state)
        self._mm, self._finalizer = None, None

    def close(self) -> None:
        """Unmap, and in the creating process delete the cache (workers that still map it keep their view)."""
        self._mm = None
        if self._finalizer is not None:
            self._finalizer()
