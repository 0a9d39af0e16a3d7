"""System facts that ``packer bench``, ``packer doctor`` and ``packer profile`` report and act on.

The machine (CPU, cores this process may use, memory, kernel, load, library versions) and the
storage under a path (mount, filesystem and its kind, whole block device, rotational flag,
read-ahead, scheduler), read from /proc and /sys. Nothing here is timed: see ``measure``.
"""

from __future__ import annotations

import os
import platform
from pathlib import Path

from packer import sysinfo

usable_cores = sysinfo.usable_cores  # cores this process may run on (its CPU affinity)
fs_kind, mount_of = sysinfo.fs_kind, sysinfo.mount_of  # the mount holding a path: /proc is read in sysinfo


# ------------------------------------------------------------------ mounts and block devices


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
    """Filesystem type and kind, mount, device (major:minor, name), rotational flag and read-ahead of ``path``."""
    m = mount_of(path) or {}
    out = {
        "path": os.path.realpath(path), "mount_point": m.get("mount_point"), "fstype": m.get("fstype"),
        "kind": fs_kind(m.get("fstype")), "source": m.get("source"), "device": None, "major_minor": None,
        "rotational": None, "read_ahead_kb": None, "scheduler": None,
    }
    dev = block_device_of(path)
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


# ------------------------------------------------------------------ the machine


def _versions() -> dict:
    from importlib import metadata

    from packer._version import __version__
    from packer.images.decode import turbojpeg_available

    out: dict[str, str | None] = {"packer": __version__, "python": platform.python_version()}
    for dist in ("numpy", "torch", "Pillow", "lmdb", "h5py", "PyTurboJPEG", "matplotlib"):
        try:
            out[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            out[dist] = None
    out["libturbojpeg"] = "loaded" if turbojpeg_available() else "missing"
    return out


def _cpu_model() -> str:
    for line in (sysinfo.proc_text("cpuinfo") or "").splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def describe_machine() -> dict:
    """CPU model, cores (all and usable), memory, kernel, load, library versions."""
    return {
        "cpu": _cpu_model(),
        "cores": os.cpu_count(),
        "cores_usable": usable_cores(),
        "memory_bytes": sysinfo.meminfo().get("MemTotal"),
        "os": f"{platform.system()} {platform.release()}",
        "load_average": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
        "versions": _versions(),
    }
