"""Measurement primitives shared by ``packer bench`` and ``packer doctor``.

Page-cache eviction of files (fsync + ``posix_fadvise(DONTNEED)``) verified with ``mincore``,
the machine's ceilings (cold sequential read of a large file on the data's filesystem, memory
copy bandwidth, per-core decode rate), the cold small-file read rate, and a description of the
machine and of the storage under a path (device, filesystem, rotational) read from /proc and /sys.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import platform
import sys
import tempfile
import time
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from packer import sysinfo

PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


# ------------------------------------------------------------------ page cache


def _libc():
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        libc.mmap.restype = ctypes.c_void_p
        libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
        libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
        libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.POINTER(ctypes.c_ubyte)]
        return libc
    except (OSError, AttributeError):
        return None


_LIBC = _libc()
_MAP_FAILED = ctypes.c_void_p(-1).value


def resident_pages(path: str | os.PathLike) -> tuple[int, int] | None:
    """(pages of ``path`` in the page cache, pages in all), by ``mincore``; None when it can't tell.

    The file is mapped without touching it (mapping faults nothing in), asked, and unmapped.
    """
    if _LIBC is None or not hasattr(os, "posix_fadvise"):
        return None
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return None
    try:
        size = os.fstat(fd).st_size
        if size == 0:
            return (0, 0)
        pages = (size + PAGE - 1) // PAGE
        addr = _LIBC.mmap(None, size, 1, 1, fd, 0)  # PROT_READ, MAP_SHARED
        if addr is None or addr == _MAP_FAILED:
            return None
        try:
            vec = (ctypes.c_ubyte * pages)()
            if _LIBC.mincore(addr, size, vec) != 0:
                return None
            return int((np.frombuffer(vec, dtype=np.uint8) & 1).sum()), pages
        finally:
            _LIBC.munmap(addr, size)
    finally:
        os.close(fd)


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


# ------------------------------------------------------------------ ceilings


@dataclass
class Rate:
    """One measured rate; ``seconds`` of each repeat, figures from the median repeat."""

    name: str
    unit: str  # what ``value`` counts per second: "MB/s" or "img/s"
    value: float  # median
    low: float
    high: float
    seconds: list[float]
    detail: str = ""

    def to_dict(self) -> dict:
        return asdict(self)


def _rate(name: str, unit: str, amount: float, seconds: list[float], detail: str = "") -> Rate:
    rates = sorted(amount / max(s, 1e-9) for s in seconds)
    return Rate(name, unit, float(np.median(rates)), rates[0], rates[-1], seconds, detail)


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


def read_file(path: str | os.PathLike, block: int = 8 << 20) -> int:
    """Read a whole file with large reads; returns the bytes read."""
    total = 0
    buf = bytearray(block)
    view = memoryview(buf)
    with open(path, "rb", buffering=0) as fh:
        while True:
            n = fh.readinto(view)
            if not n:
                return total
            total += n


def sequential_read_ceiling(directory: str | os.PathLike, nbytes: int = 256 << 20, repeats: int = 3) -> Rate:
    """Cold sequential read bandwidth (MB/s) of a ``nbytes`` scratch file written in ``directory``.

    Same filesystem as the data, page cache evicted before each repeat (mincore-checked), the
    scratch file removed afterwards. Under a block-IO throttle this is the emulated device's ceiling.
    """
    path = _write_scratch(Path(directory), nbytes)
    try:
        seconds = []
        unverified = False
        for _ in range(repeats):
            res = evict([path])
            if not res.verified or (res.fraction or 0) > 0.01:
                unverified = True
            t = time.perf_counter()
            read_file(path)
            seconds.append(time.perf_counter() - t)
    finally:
        os.unlink(path)
    detail = f"{nbytes / 1e6:.0f} MB file in {directory}, 8 MB reads" + (", eviction NOT verified" if unverified else "")
    return _rate("sequential read (cold)", "MB/s", nbytes / 1e6, seconds, detail)


def memory_copy_ceiling(nbytes: int = 128 << 20, repeats: int = 5) -> Rate:
    """Memory copy bandwidth (MB/s copied), one core: the ceiling of a warm (page-cache) read."""
    src = np.random.default_rng(0).integers(0, 255, nbytes, dtype=np.uint8)
    dst = np.empty_like(src)
    np.copyto(dst, src)  # fault the pages in first
    seconds = []
    for _ in range(repeats):
        t = time.perf_counter()
        np.copyto(dst, src)
        seconds.append(time.perf_counter() - t)
    return _rate("memory copy", "MB/s", nbytes / 1e6, seconds, f"{nbytes >> 20} MiB numpy copy, one core")


def decode_ceiling(samples: Sequence[bytes], backend: str, min_seconds: float = 1.0, repeats: int = 3) -> Rate:
    """Per-core decode rate (img/s) of ``packer.images.decode.decode(data, backend)`` on in-memory samples."""
    from packer.images.decode import decode

    if not samples:
        raise ValueError("decode_ceiling needs at least one sample")
    for data in samples[: min(4, len(samples))]:
        decode(data, backend)  # load the library, fail early
    seconds, counts = [], []
    for _ in range(repeats):
        n, t = 0, time.perf_counter()
        while True:
            for data in samples:
                decode(data, backend)
            n += len(samples)
            dt = time.perf_counter() - t
            if dt >= min_seconds / repeats:
                break
        seconds.append(dt)
        counts.append(n)
    per = [c / s for c, s in zip(counts, seconds, strict=False)]
    mean_kb = sum(len(s) for s in samples) / len(samples) / 1e3
    srt = sorted(per)
    return Rate(f"decode {backend} (1 core)", "img/s", float(np.median(per)), srt[0], srt[-1], seconds,
                f"{len(samples)} samples of {mean_kb:.0f} KB on average, in memory")


def small_file_read_rate(paths: Sequence[str | os.PathLike]) -> tuple[float, float, Residency]:
    """Cold open+read of each file in order: (files/s, MB/s, residency after eviction)."""
    res = evict(paths)
    total = 0
    t = time.perf_counter()
    for p in paths:
        with open(p, "rb") as fh:
            total += len(fh.read())
    dt = max(time.perf_counter() - t, 1e-9)
    return len(paths) / dt, total / 1e6 / dt, res


# ------------------------------------------------------------------ machine and storage


def _mountinfo() -> list[dict]:
    out = []
    try:
        with open("/proc/self/mountinfo") as fh:
            for line in fh:
                left, _, right = line.partition(" - ")
                f = left.split()
                r = right.split()
                out.append({
                    "dev": f[2], "root": f[3], "mount_point": _unescape(f[4]),
                    "fstype": r[0] if r else "", "source": _unescape(r[1]) if len(r) > 1 else "",
                    "super_options": r[2] if len(r) > 2 else "",
                })
    except OSError:
        pass
    return out


def _unescape(s: str) -> str:
    return s.replace("\\040", " ").replace("\\011", "\t").replace("\\012", "\n").replace("\\134", "\\")


def mount_of(path: str | os.PathLike) -> dict | None:
    """The /proc/self/mountinfo entry of the mount holding ``path`` (longest matching mount point)."""
    real = os.path.realpath(path)
    best = None
    for m in _mountinfo():
        mp = m["mount_point"]
        if real == mp or real.startswith(mp.rstrip("/") + "/") or mp == "/":
            if best is None or len(mp) >= len(best["mount_point"]):
                best = m
    return best


def _sys_block(major: int, minor: int) -> Path | None:
    p = Path(f"/sys/dev/block/{major}:{minor}")
    return p.resolve() if p.exists() else None


def block_device_of(path: str | os.PathLike, _depth: int = 0) -> tuple[int, int, str] | None:
    """(major, minor, name) of the whole block device holding ``path``; None if there is none.

    Partitions resolve to their disk (the throttle works per disk). Overlay filesystems resolve
    through their upper directory; filesystems on anonymous devices (btrfs subvolumes) through the
    mount's source device. Network and memory filesystems (nfs, tmpfs) have no block device.
    """
    st = os.stat(path)
    major, minor = os.major(st.st_dev), os.minor(st.st_dev)
    sys_dev = _sys_block(major, minor)
    if sys_dev is None and _depth < 4:
        m = mount_of(path)
        if m is None:
            return None
        if m["fstype"] == "overlay":
            for opt in m["super_options"].split(","):
                if opt.startswith("upperdir="):
                    return block_device_of(opt.split("=", 1)[1], _depth + 1)
            return None
        if m["source"].startswith("/dev/") and os.path.exists(m["source"]):
            rdev = os.stat(m["source"]).st_rdev
            major, minor = os.major(rdev), os.minor(rdev)
            sys_dev = _sys_block(major, minor)
    if sys_dev is None:
        return None
    if (sys_dev / "partition").exists():  # a partition: the throttle and queue facts live on its disk
        sys_dev = sys_dev.parent
        try:
            major, minor = (int(v) for v in (sys_dev / "dev").read_text().split(":"))
        except (OSError, ValueError):
            return None
    return major, minor, sys_dev.name


def _read(path: str | Path) -> str | None:
    try:
        return Path(path).read_text().strip()
    except OSError:
        return None


def describe_storage(path: str | os.PathLike) -> dict:
    """Filesystem type, mount, device (major:minor, name), rotational flag and read-ahead of ``path``."""
    m = mount_of(path) or {}
    dev = block_device_of(path)
    out = {
        "path": os.path.realpath(path),
        "mount_point": m.get("mount_point"),
        "fstype": m.get("fstype"),
        "source": m.get("source"),
        "device": None,
        "major_minor": None,
        "rotational": None,
        "read_ahead_kb": None,
        "scheduler": None,
    }
    if dev is not None:
        major, minor, name = dev
        queue = Path(f"/sys/block/{name}/queue")
        rot = _read(queue / "rotational")
        sched = _read(queue / "scheduler")
        ra = _read(queue / "read_ahead_kb")
        out.update({
            "device": name, "major_minor": f"{major}:{minor}",
            "rotational": None if rot is None else rot == "1",
            "read_ahead_kb": int(ra) if ra and ra.isdigit() else None,
            "scheduler": sched.split("[")[1].split("]")[0] if sched and "[" in sched else sched,
        })
    return out


def _versions() -> dict:
    from importlib import metadata

    from packer._version import __version__

    out = {"packer": __version__, "python": platform.python_version()}
    for dist in ("numpy", "torch", "Pillow", "lmdb", "h5py", "PyTurboJPEG", "matplotlib"):
        try:
            out[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            out[dist] = None
    from packer.images.decode import turbojpeg_available

    out["libturbojpeg"] = "loaded" if turbojpeg_available() else "missing"
    return out


def describe_machine() -> dict:
    """CPU model, cores usable, memory, kernel, load, library versions."""
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as fh:
            for line in fh:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    mem = sysinfo.meminfo().get("MemTotal")
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "cores_usable": usable,
        "memory_bytes": mem,
        "os": f"{platform.system()} {platform.release()}",
        "load_average": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
        "versions": _versions(),
    }
