"""Slow-storage emulation with the kernel's block-IO controller: real throttling, not sleeps.

``throttled(paths, read_iops, read_bps)`` creates a child cgroup, limits reads from the block device(s) holding
``paths`` (cgroup v1 ``blkio.throttle.*``, or v2 ``io.max``) and moves this process into it (workers started later
inherit it); on the way out (exit, exception, Ctrl-C or SIGTERM) it moves every process back and removes the limits
and the cgroup, and cgroups a killed earlier run left are removed on entry. Only reads that reach the device are
throttled, as on slow storage; a network filesystem's per-open latency is not emulated. The presets (``PRESETS``)
and their sources: docs/bench.md.
"""

from __future__ import annotations

import os
import signal
import sys
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from packer.diagnose.system import block_device_of
from packer.errors import PackerError
from packer.sysinfo import pid_alive, proc_text

# The kernel's block-IO throttle meters each cgroup in slices of HZ/10 (blk-throttle's ``throtl_slice``): a pass may
# run up to a slice's budget ahead of the limit (at a slice's start) or wait up to a slice behind it.
SLICE_SECONDS = 0.1


@dataclass(frozen=True)
class Preset:
    read_iops: int
    read_bps: int
    source: str


PRESETS: dict[str, Preset] = {
    "hdd": Preset(150, 150_000_000, "7200 rpm disk: 80-200 random IOPS, 150-200 MB/s sequential"),
    "nfs": Preset(1000, 110_000_000, "NFS on 1 GbE: ~110 MB/s, ~1 ms per request (IO only, not open latency)"),
    "ssd": Preset(20000, 500_000_000, "SATA SSD: 500-550 MB/s sequential, 10-90k random 4K IOPS"),
}

V1_ROOT = Path("/sys/fs/cgroup/blkio")
V2_ROOTS = (Path("/sys/fs/cgroup/unified"), Path("/sys/fs/cgroup"))
CGROUP_PREFIX = "packer-bench-"


class ThrottleUnavailable(PackerError):
    """Emulation is impossible here (not root, no controller, not Linux, no block device)."""


@dataclass
class Controller:
    """One cgroup hierarchy able to throttle reads: ``version`` 1 (blkio) or 2 (io)."""

    version: int
    root: Path

    def limit_lines(self, devices: Sequence[tuple[int, int]], iops: int | None,
                    bps: int | None) -> dict[str, list[str]]:
        """File name -> lines to write to set the limits (0/None = unlimited)."""
        if self.version == 1:
            return {
                "blkio.throttle.read_iops_device": [f"{a}:{b} {int(iops or 0)}" for a, b in devices],
                "blkio.throttle.read_bps_device": [f"{a}:{b} {int(bps or 0)}" for a, b in devices],
            }
        return {"io.max": [f"{a}:{b} riops={int(iops) if iops else 'max'} rbps={int(bps) if bps else 'max'}"
                           for a, b in devices]}

    def clear_lines(self, devices: Sequence[tuple[int, int]]) -> dict[str, list[str]]:
        return self.limit_lines(devices, None, None)

    def own_cgroup(self) -> Path:
        """This process's cgroup in this hierarchy (from /proc/self/cgroup)."""
        text = proc_text("self/cgroup")
        if text is None:
            return self.root
        for line in text.splitlines():
            hid, controllers, rel = line.split(":", 2)
            if (self.version == 1 and "blkio" in controllers.split(",")) or (self.version == 2 and hid == "0"):
                p = self.root / rel.lstrip("/")
                return p if p.is_dir() else self.root
        return self.root


def _v2_has_io(root: Path) -> bool:
    ctl = root / "cgroup.controllers"
    try:
        return "io" in ctl.read_text().split()
    except OSError:
        return False


def find_controller(v1_root: Path | None = None, v2_roots: Sequence[Path] | None = None) -> Controller:
    """The hierarchy that can throttle reads here, or ThrottleUnavailable saying why not."""
    v1_root = Path(v1_root or V1_ROOT)
    v2_roots = [Path(p) for p in (v2_roots or V2_ROOTS)]
    if not sys.platform.startswith("linux"):
        raise ThrottleUnavailable(f"storage emulation needs Linux's block-IO cgroup controller; this is {sys.platform}")
    if (v1_root / "blkio.throttle.read_iops_device").exists():
        ctl = Controller(1, v1_root)
    else:
        ctl = next((Controller(2, r) for r in v2_roots if _v2_has_io(r)), None)
        if ctl is None:
            raise ThrottleUnavailable(
                f"no block-IO cgroup controller: neither cgroup v1 blkio ({v1_root}) nor cgroup v2 with the io "
                f"controller ({', '.join(map(str, v2_roots))}) is mounted and enabled"
            )
    if os.geteuid() != 0 or not os.access(ctl.root, os.W_OK):
        raise ThrottleUnavailable(
            f"storage emulation writes to {ctl.root} (kernel block-IO throttle) and needs root; run as root "
            f"or without --emulate/--read-iops/--read-bps"
        )
    return ctl


def devices_of(paths: Sequence[str | os.PathLike]) -> list[tuple[int, int, str]]:
    """The distinct block devices holding ``paths``, or ThrottleUnavailable naming the path that has none."""
    out: dict[tuple[int, int], str] = {}
    for p in paths:
        dev = block_device_of(p)
        if dev is None:
            raise ThrottleUnavailable(
                f"{p}: not on a block device (network, memory or virtual filesystem), so the block-IO "
                f"throttle cannot act on its reads"
            )
        out[(dev[0], dev[1])] = dev[2]
    return [(a, b, n) for (a, b), n in out.items()]


def _write(path: Path, lines: list[str]) -> None:
    for line in lines:  # the kernel takes one rule per write
        with open(path, "w") as fh:
            fh.write(line)


def _pids(cg: Path) -> list[int]:
    try:
        return [int(x) for x in (cg / "cgroup.procs").read_text().split()]
    except (OSError, ValueError):
        return []


def remove_cgroup(ctl: Controller, cg: Path, back_to: Path, devices: Sequence[tuple[int, int]] = ()) -> None:
    """Move every process in ``cg`` to ``back_to``, clear its limits, remove it. Idempotent."""
    if not cg.is_dir():
        return
    for pid in _pids(cg):
        try:
            _write(back_to / "cgroup.procs", [str(pid)])
        except OSError:
            pass  # exited meanwhile
    for name, lines in ctl.clear_lines(devices).items():
        try:
            _write(cg / name, lines)
        except OSError:
            pass
    cg.rmdir()


def remove_stale(ctl: Controller) -> list[Path]:
    """Remove cgroups left by packer runs whose process is gone (killed with SIGKILL, power lost).

    Never a live run's: one whose owner runs (or whose pid this process can't see, e.g. from
    another pid namespace, while processes are still in it) is left alone.
    """
    removed = []
    for cg in sorted(ctl.root.glob(CGROUP_PREFIX + "*")):
        try:
            owner = int(cg.name[len(CGROUP_PREFIX):])
        except ValueError:
            continue
        if (owner != os.getpid() and pid_alive(owner)) or _pids(cg):
            continue
        try:
            remove_cgroup(ctl, cg, ctl.root, _limited_devices(ctl, cg))
            removed.append(cg)
        except OSError:
            pass
    return removed


def _limited_devices(ctl: Controller, cg: Path) -> list[tuple[int, int]]:
    names = ["blkio.throttle.read_iops_device", "blkio.throttle.read_bps_device"] if ctl.version == 1 else ["io.max"]
    devs = set()
    for name in names:
        try:
            for line in (cg / name).read_text().splitlines():
                a, _, b = line.split()[0].partition(":")
                devs.add((int(a), int(b)))
        except (OSError, ValueError, IndexError):
            pass
    return sorted(devs)


@dataclass
class Throttle:
    """What ``throttled`` set up; ``active`` is False once it has been removed."""

    controller: Controller
    cgroup: Path
    devices: list[tuple[int, int, str]]
    read_iops: int | None
    read_bps: int | None
    active: bool = True
    stale_removed: list[str] = field(default_factory=list)

    def read_counters(self) -> tuple[int, int]:
        """(read IOs, bytes read) that reached the throttled devices from this cgroup so far."""
        wanted = {f"{a}:{b}" for a, b, _ in self.devices}
        ios = nbytes = 0
        try:
            if self.controller.version == 1:
                for name in ("blkio.throttle.io_serviced", "blkio.throttle.io_service_bytes"):
                    for line in (self.cgroup / name).read_text().splitlines():
                        f = line.split()
                        if len(f) == 3 and f[0] in wanted and f[1] == "Read":
                            if name.endswith("serviced"):
                                ios += int(f[2])
                            else:
                                nbytes += int(f[2])
            else:
                for line in (self.cgroup / "io.stat").read_text().splitlines():
                    f = line.split()
                    if f and f[0] in wanted:
                        kv = dict(x.split("=", 1) for x in f[1:] if "=" in x)
                        ios += int(kv.get("rios", 0))
                        nbytes += int(kv.get("rbytes", 0))
        except (OSError, ValueError):
            pass
        return ios, nbytes

    def describe(self) -> dict:
        return {
            "controller": f"cgroup v{self.controller.version} ({self.controller.root})",
            "cgroup": str(self.cgroup),
            "devices": [f"{a}:{b} ({n})" for a, b, n in self.devices],
            "read_iops": self.read_iops,
            "read_bps": self.read_bps,
        }


def _sigterm_to_interrupt(signum, frame):
    raise KeyboardInterrupt(f"signal {signum}")


@contextmanager
def throttled(
    paths: Sequence[str | os.PathLike],
    read_iops: int | None = None,
    read_bps: int | None = None,
    v1_root: Path | None = None,
    v2_roots: Sequence[Path] | None = None,
) -> Iterator[Throttle]:
    """Throttle this process's (and its future children's) reads from the devices holding ``paths``."""
    if not read_iops and not read_bps:
        raise PackerError("storage emulation needs a read IOPS or a read bandwidth limit")
    for name, v in (("read IOPS", read_iops), ("read bytes/s", read_bps)):
        if v is not None and v < 0:
            raise PackerError(f"{name} limit must be positive, got {v}")
    ctl = find_controller(Path(v1_root or V1_ROOT), [Path(p) for p in (v2_roots or V2_ROOTS)])
    devices = devices_of(paths)
    stale = remove_stale(ctl)
    home = ctl.own_cgroup()
    cg = ctl.root / f"{CGROUP_PREFIX}{os.getpid()}"
    pairs = [(a, b) for a, b, _ in devices]
    old_term = signal.getsignal(signal.SIGTERM) if _main_thread() else None
    try:
        cg.mkdir(exist_ok=True)
        try:
            for name, lines in ctl.limit_lines(pairs, read_iops, read_bps).items():
                _write(cg / name, lines)
        except OSError as exc:
            raise ThrottleUnavailable(
                f"the kernel refused the limit on {', '.join(f'{a}:{b} ({n})' for a, b, n in devices)}: {exc}"
            ) from exc
        if old_term is not None:
            signal.signal(signal.SIGTERM, _sigterm_to_interrupt)
        _write(cg / "cgroup.procs", [str(os.getpid())])
        thr = Throttle(ctl, cg, devices, read_iops, read_bps, stale_removed=[str(p) for p in stale])
        yield thr
    finally:
        # No Ctrl-C half way through the clean-up: block SIGINT/SIGTERM while undoing.
        blocked = _block_signals()
        try:
            try:
                _write(home / "cgroup.procs", [str(os.getpid())])
            except OSError:
                _write(ctl.root / "cgroup.procs", [str(os.getpid())])
            remove_cgroup(ctl, cg, home, pairs)
        finally:
            if old_term is not None:
                signal.signal(signal.SIGTERM, old_term)
            _unblock_signals(blocked)
        if "thr" in locals():
            thr.active = False


def _main_thread() -> bool:
    import threading

    return threading.current_thread() is threading.main_thread()


def _block_signals():
    if hasattr(signal, "pthread_sigmask"):
        return signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGTERM})
    return None


def _unblock_signals(old) -> None:
    if old is not None:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)


def resolve_limits(emulate: str | None, read_iops: int | None,
                   read_bps: int | None) -> tuple[int | None, int | None, str]:
    """(iops, bytes/s, description) from a preset and/or explicit limits (explicit ones win)."""
    if emulate is not None and emulate not in PRESETS:
        raise PackerError(f"unknown --emulate preset {emulate!r} (choose {', '.join(PRESETS)})")
    iops, bps, desc = None, None, "custom"
    if emulate:
        p = PRESETS[emulate]
        iops, bps, desc = p.read_iops, p.read_bps, f"{emulate}: {p.source}"
    if read_iops is not None:
        iops = read_iops
    if read_bps is not None:
        bps = read_bps
    return iops, bps, desc
