"""Measurement primitives of ``packer bench``, ``packer doctor`` and ``packer bench --decoders``: one of each.

- page cache: residency (``pagecache.resident_pages``), eviction by fsync + ``posix_fadvise(DONTNEED)``, checked;
- the timer (``timed``: a wall or CPU clock), the rate made of repeated timings (``Rate``), and a thread's time
  on a CPU and waiting for one (``thread_cpu``);
- the cold reader (``cold_read``: evict, then read files in large reads, bounded in bytes and time);
- the ceilings: cold sequential read of a scratch file on the data's filesystem, memory copy;
- the decode rate (``decode_rate``: one core, in-memory samples, any decoder) and the decoders;
- the sample picker (``load_samples``: encoded images spread evenly over a dataset or a folder).
"""

from __future__ import annotations

import os
import tempfile
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from packer.errors import PackerError
from packer.pagecache import resident_pages
from packer.sysinfo import proc_text

COLD = 0.01  # a read counts as cold when under 1% of the files' pages stayed cached after eviction
READ_BLOCK = 8 << 20  # bytes per read() of the cold reader


# ------------------------------------------------------------------ page cache


@dataclass
class Residency:
    """How much of a set of files is in the page cache; ``verified`` False when mincore was unavailable."""

    files: int
    pages: int
    resident: int
    verified: bool

    @property
    def fraction(self) -> float | None:
        if not self.verified:
            return None
        return self.resident / self.pages if self.pages else 0.0


def residency(paths: Iterable[str | os.PathLike]) -> Residency:
    files = pages = resident = 0
    verified = True
    for p in paths:
        files += 1
        r = resident_pages(p)
        if r is None:
            verified = False
            continue
        resident += r[0]
        pages += r[1]
    return Residency(files, pages, resident, verified)


def evict(paths: Iterable[str | os.PathLike]) -> Residency:
    """Drop the files' pages from the page cache (fsync, then ``POSIX_FADV_DONTNEED``) and check with mincore.

    Pages still mapped by a live process (an open LMDB environment, a numpy memmap) cannot be
    dropped: close readers first. The residency returned says what stayed.
    """
    paths = [os.fspath(p) for p in paths]
    can_advise = hasattr(os, "posix_fadvise")
    for p in paths:
        try:
            fd = os.open(p, os.O_RDONLY)
        except OSError:
            continue
        try:
            try:
                os.fsync(fd)  # dirty pages can't be dropped: write them first
            except OSError:
                pass
            if can_advise:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
    res = residency(paths)
    if not can_advise:
        res.verified = False
    return res


def tree_files(path: str | os.PathLike) -> list[str]:
    """Every regular file below ``path`` (or ``path`` itself), sorted."""
    path = os.fspath(path)
    if os.path.isfile(path):
        return [path]
    out = []
    for root, _dirs, files in os.walk(path):
        out.extend(os.path.join(root, f) for f in files if os.path.isfile(os.path.join(root, f)))
    return sorted(out)


# ------------------------------------------------------------------ the timer


CLOCKS: dict[str, Callable[[], float]] = {"wall": time.perf_counter, "cpu": time.process_time}


@dataclass
class Timing:
    """What one timed measurement did: ``items`` (images, bytes, ...) in CPU and in wall seconds."""

    items: float
    cpu_s: float
    wall_s: float

    def seconds(self, clock: str) -> float:
        return self.cpu_s if clock == "cpu" else self.wall_s


def timed(fn: Callable[[], float], seconds: float = 0.0, clock: str = "wall", min_passes: int = 1) -> Timing:
    """Call ``fn`` (one pass; returns the items it did) ``min_passes`` times, then until ``seconds`` have passed.

    ``clock``: ``wall`` (``perf_counter``) or ``cpu`` (this process's user + system time, page
    faults included, which other processes on a shared machine disturb far less than wall time).
    """
    if clock not in CLOCKS:
        raise ValueError(f"clock {clock!r}: choose {', '.join(CLOCKS)}")
    now = CLOCKS[clock]
    items, passes = 0.0, 0
    c0, w0 = time.process_time(), time.perf_counter()
    start = now()
    while passes < min_passes or now() - start < seconds:
        items += fn()
        passes += 1
    return Timing(items, time.process_time() - c0, time.perf_counter() - w0)


def thread_cpu() -> tuple[float, float] | None:
    """(seconds on a CPU, seconds runnable but waiting for one) of the calling thread so far, from the
    scheduler's own count (``/proc/thread-self/schedstat``); None where the kernel does not give it. The rest of
    a pass's wall time the thread was blocked: on the disk, for a cold read. The wait says the machine was busy."""
    try:
        on_cpu, waiting = (proc_text("thread-self/schedstat") or "").split()[:2]
        return int(on_cpu) / 1e9, int(waiting) / 1e9
    except ValueError:  # none (unpacking fails too), or not numbers
        return None


@dataclass
class Rate:
    """One measured rate: the median over repeated timings (``value``), their lowest and highest."""

    name: str
    unit: str  # what ``value`` counts per second: "MB/s" or "img/s"
    value: float
    low: float
    high: float
    timings: list[Timing]
    clock: str = "wall"
    detail: str = ""

    def to_dict(self) -> dict:
        return asdict(self)


def rate_of(name: str, unit: str, timings: Sequence[Timing], clock: str = "wall", detail: str = "",
            scale: float = 1.0) -> Rate:
    """The rate of ``timings`` on ``clock``, ``scale`` units per item (1e-6 makes bytes MB)."""
    rates = sorted(t.items * scale / max(t.seconds(clock), 1e-9) for t in timings)
    return Rate(name, unit, float(np.median(rates)), rates[0], rates[-1], list(timings), clock, detail)


# ------------------------------------------------------------------ the cold reader


def read_file(path: str | os.PathLike, block: int = READ_BLOCK, max_bytes: int | None = None,
              until: float | None = None, buf: memoryview | None = None) -> int:
    """Read a file with ``block``-sized reads (into ``buf`` if given: many small files then share one buffer,
    which a per-file allocation would otherwise slow down), to its end, ``max_bytes`` or the ``perf_counter``
    time ``until``; returns the bytes read."""
    total = 0
    view = buf if buf is not None else memoryview(bytearray(block))
    with open(path, "rb", buffering=0) as fh:
        while max_bytes is None or total < max_bytes:
            n = fh.readinto(view)
            if not n:
                break
            total += n
            if until is not None and time.perf_counter() >= until:
                break
    return total


@dataclass
class ColdRead:
    """One cold read: files and bytes read (``timing.items``) and the files' residency just after eviction."""

    files: int
    timing: Timing
    residency: Residency

    @property
    def cold(self) -> bool:
        """The eviction was verified (mincore) and under ``COLD`` of the pages stayed cached."""
        return self.residency.verified and (self.residency.fraction or 0.0) < COLD

    @property
    def files_per_s(self) -> float:
        return self.files / max(self.timing.wall_s, 1e-9)

    @property
    def mb_per_s(self) -> float:
        return self.timing.items / 1e6 / max(self.timing.wall_s, 1e-9)


def cold_read(paths: Sequence[str | os.PathLike], max_bytes: int | None = None, seconds: float | None = None,
              block: int = READ_BLOCK) -> ColdRead:
    """Evict ``paths`` from the page cache, then read them in order until done, ``max_bytes`` or ``seconds``."""
    res = evict(paths)
    files, buf = 0, memoryview(bytearray(block))

    def read_all() -> int:
        nonlocal files
        total, until = 0, None if seconds is None else time.perf_counter() + seconds
        for p in paths:
            total += read_file(p, block, None if max_bytes is None else max_bytes - total, until, buf)
            files += 1
            if (max_bytes is not None and total >= max_bytes) or (until is not None and time.perf_counter() >= until):
                break
        return total

    timing = timed(read_all)
    return ColdRead(files, timing, res)


# ------------------------------------------------------------------ ceilings


def _write_scratch(directory: Path, nbytes: int) -> Path:
    fd, name = tempfile.mkstemp(prefix=".packer-ceiling-", dir=directory)
    rng = np.random.default_rng()
    chunk = 8 << 20
    try:
        with os.fdopen(fd, "wb") as fh:
            left = nbytes
            while left > 0:
                fh.write(rng.bytes(min(chunk, left)))  # incompressible: no host-side shortcut
                left -= chunk
            fh.flush()
            os.fsync(fh.fileno())
    except BaseException:
        os.unlink(name)
        raise
    return Path(name)


def sequential_read_ceiling(directory: str | os.PathLike, nbytes: int = 256 << 20, repeats: int = 3) -> Rate:
    """Cold sequential read bandwidth (MB/s) of a ``nbytes`` scratch file written in ``directory``.

    Same filesystem as the data, page cache evicted before each repeat (mincore-checked), the
    scratch file removed afterwards. Under a block-IO throttle this is the emulated device's ceiling.
    """
    path = _write_scratch(Path(directory), nbytes)
    try:
        reads = [cold_read([path]) for _ in range(repeats)]
    finally:
        os.unlink(path)
    detail = (f"{nbytes / 1e6:.0f} MB file in {directory}, {READ_BLOCK >> 20} MB reads"
              + ("" if all(r.cold for r in reads) else ", eviction NOT verified"))
    return rate_of("sequential read (cold)", "MB/s", [r.timing for r in reads], detail=detail, scale=1e-6)


def memory_copy_ceiling(nbytes: int = 128 << 20, repeats: int = 5) -> Rate:
    """Memory copy bandwidth (MB/s copied), one core: the ceiling of a warm (page-cache) read."""
    src = np.arange(nbytes // 8, dtype=np.uint64).view(np.uint8)  # every page written and unlike the others
    dst = np.empty_like(src)
    np.copyto(dst, src)  # fault the pages in first

    def copy() -> int:
        np.copyto(dst, src)
        return nbytes

    timings = [timed(copy) for _ in range(repeats)]
    return rate_of("memory copy", "MB/s", timings, detail=f"{nbytes >> 20} MiB numpy copy, one core", scale=1e-6)


# ------------------------------------------------------------------ decoders and the decode rate


OPTIONAL_BACKENDS = ("simplejpeg",)  # measured when importable, never a dependency (docs/decoding.md)


def _simplejpeg_decoder() -> Callable | None:
    try:
        import simplejpeg  # pyright: ignore[reportMissingImports]  (optional, not a dependency)
    except ImportError:
        return None
    from packer.images.decode import scaled_shape

    def run(data: bytes, min_size: int | None = None) -> np.ndarray:
        if not min_size:
            return simplejpeg.decode_jpeg(data, colorspace="rgb")
        h, w = simplejpeg.decode_jpeg_header(data)[:2]
        th, tw = scaled_shape(h, w, min_size)  # the smallest scale giving >= this is packer's own scale
        return simplejpeg.decode_jpeg(data, colorspace="rgb", min_height=th, min_width=tw)

    return run


def available_backends(include_optional: bool = True) -> list[str]:
    """Decoders that work here: ``turbojpeg`` (if libturbojpeg loads), ``pil``, optional extras."""
    from packer.images.decode import turbojpeg_handle

    names = (["turbojpeg"] if turbojpeg_handle() is not None else []) + ["pil"]
    if include_optional and _simplejpeg_decoder() is not None:
        names.append("simplejpeg")
    return names


def decoder(backend: str) -> Callable[..., np.ndarray]:
    """``fn(data, min_size=None)`` decoding as a dataset does (``auto``, ``turbojpeg``, ``pil``) or with an extra."""
    from packer.images.decode import decode

    if backend in ("auto", "turbojpeg", "pil"):
        return lambda data, min_size=None: decode(data, backend, strict=False, min_size=min_size)
    fn = _simplejpeg_decoder() if backend == "simplejpeg" else None
    if fn is None:
        raise PackerError(f"decoder {backend!r} is not available here (available: {', '.join(available_backends())})")
    return fn


def decode_rate(samples: Sequence[bytes], backend: str, min_size: int | None = None, seconds: float = 1.0,
                repeats: int = 3, clock: str = "wall") -> Rate:
    """Images/s of one core decoding in-memory ``samples`` with ``backend``: ``repeats`` timings of
    ``seconds / repeats``."""
    if not samples:
        raise PackerError("no samples to measure decoding on")
    fn = decoder(backend)
    for data in samples[:4]:
        fn(data, min_size)  # load the library, fail early

    def one_pass() -> int:
        for data in samples:
            fn(data, min_size)
        return len(samples)

    timings = [timed(one_pass, seconds / repeats, clock) for _ in range(repeats)]
    mean_kb = sum(len(s) for s in samples) / len(samples) / 1e3
    size = "" if not min_size else f", decode_size {min_size}"
    return rate_of(f"decode {backend} (1 core)", "img/s", timings, clock,
                   f"{len(samples)} samples of {mean_kb:.0f} KB on average, in memory{size}")


# ------------------------------------------------------------------ the sample picker


def spread(n: int, k: int) -> list[int]:
    """Up to ``k`` indices spread evenly over ``range(n)``, first and last included."""
    return np.unique(np.linspace(0, n - 1, min(k, n)).astype(np.int64)).tolist() if n > 0 and k > 0 else []


def load_samples(where: str | os.PathLike | Sequence[str], limit: int = 200) -> list[bytes]:
    """Up to ``limit`` encoded images spread evenly (every class represented) over a packed dataset
    (encoded payloads), a folder of images, or a list of image files (unreadable ones are skipped)."""
    if isinstance(where, (str, os.PathLike)):
        p = Path(where)
        if (p / "manifest.json").exists():
            from packer.read.dataset import open_dataset

            ds = open_dataset(p)
            try:
                if ds.manifest.payload != "encoded":
                    raise PackerError(f"{p}: payload {ds.manifest.payload!r} holds decoded pixels; "
                                      "decoders need encoded images")
                return [bytes(b) for b in ds.read_payloads(spread(len(ds), limit))]
            finally:
                ds.close()
        if not p.is_dir():
            raise PackerError(f"{p}: neither a packed dataset nor a folder of images")
        from packer.write.scan import scan_folder

        where = [str(p / rel) for rel in scan_folder(p).rel_paths]
    out = []
    for i in spread(len(where), limit):
        try:
            out.append(Path(where[i]).read_bytes())
        except OSError:
            pass
    return out
