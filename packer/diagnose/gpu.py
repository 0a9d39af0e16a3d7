"""What ``nvidia-smi`` says about the GPUs: names, utilisation and memory, asked once or sampled beside a run.

``query()`` asks once (index, name, utilisation, memory used and total); ``GpuSampler`` runs
``nvidia-smi --query-gpu=index,utilization.gpu,memory.used --format=csv,noheader,nounits -lms 200`` beside
a run, the way one watches a training job, and sums the samples up per GPU (``GpuUsage``). Utilisation is
nvidia-smi's: the share of its sample period in which at least one kernel ran. Without nvidia-smi, or when
it fails (no driver), both say why in one line and raise nothing: a machine without a GPU is a finding.
"""

from __future__ import annotations

import os
import pty
import shutil
import statistics
import subprocess
import threading
import time
from dataclasses import asdict, dataclass, field

QUERY = ("index", "name", "utilization.gpu", "memory.used", "memory.total")
SAMPLED = ("index", "utilization.gpu", "memory.used")
INTERVAL_MS = 200


def _number(text: str) -> float | None:
    """A CSV value of nvidia-smi as a number; None for ``[N/A]``, ``[Not Supported]`` and the like."""
    try:
        return float(text.strip())
    except ValueError:
        return None


def _command(fields: tuple[str, ...], executable: str) -> list[str]:
    return [executable, f"--query-gpu={','.join(fields)}", "--format=csv,noheader,nounits"]


@dataclass
class GpuFacts:
    """One GPU as nvidia-smi lists it (MiB; utilisation in percent, None where the GPU does not report it)."""

    index: int
    name: str
    utilization_pct: float | None
    memory_used_mib: float | None
    memory_total_mib: float | None


@dataclass
class SmiQuery:
    """The GPUs nvidia-smi lists, or why it could not be asked (``error``; then ``gpus`` is empty)."""

    gpus: list[GpuFacts] = field(default_factory=list)
    error: str | None = None

    def to_dict(self) -> dict:
        return {"gpus": [asdict(g) for g in self.gpus], "error": self.error}


def query(executable: str | None = None, timeout: float = 10.0) -> SmiQuery:
    """Ask nvidia-smi once; ``executable`` defaults to the one on PATH."""
    exe = executable or shutil.which("nvidia-smi")
    if exe is None:
        return SmiQuery(error="nvidia-smi is not on PATH (no NVIDIA driver installed here, or PATH lacks it)")
    try:
        out = subprocess.run(_command(QUERY, exe), capture_output=True, text=True, timeout=timeout)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return SmiQuery(error=f"nvidia-smi could not be run: {exc}")
    if out.returncode != 0:
        said = (out.stdout.strip() or out.stderr.strip() or "no output").splitlines()[0]
        return SmiQuery(error=f"nvidia-smi failed (exit {out.returncode}): {said}")
    gpus = []
    for line in out.stdout.splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) != len(QUERY) or _number(parts[0]) is None:
            continue
        gpus.append(GpuFacts(int(_number(parts[0]) or 0), parts[1], _number(parts[2]), _number(parts[3]),
                             _number(parts[4])))
    if not gpus:
        return SmiQuery(error=f"nvidia-smi listed no GPU ({out.stdout.strip()[:100]!r})")
    return SmiQuery(gpus)


@dataclass
class GpuUsage:
    """One GPU's samples summed up: utilisation mean, lowest, median and highest (percent), most memory used."""

    index: int
    samples: int
    utilization_mean: float | None
    utilization_min: float | None
    utilization_median: float | None
    utilization_max: float | None
    memory_used_max_mib: float | None

    def line(self, total_mib: float | None = None, name: str | None = None) -> str:
        """The usage in a few words, for reports (``total_mib`` and ``name``: the GPU's, from ``query``)."""
        util = ("utilisation not reported" if self.utilization_mean is None else
                f"busy {self.utilization_mean:.0f}% on average (lowest {self.utilization_min:.0f}%)")
        of = f" of {total_mib:,.0f}" if total_mib else ""
        mem = "" if self.memory_used_max_mib is None else f", up to {self.memory_used_max_mib:,.0f}{of} MiB used"
        named = f" ({name})" if name else ""
        samples = f"{self.samples} nvidia-smi sample" + ("" if self.samples == 1 else "s")
        return f"GPU {self.index}{named} {util}{mem} ({samples})"


class GpuSampler:
    """nvidia-smi's utilisation and memory every ``interval_ms`` while a block runs.

    ``with GpuSampler() as s: run()`` then ``s.usage()``; ``s.mark()`` during the run starts the
    samples ``usage(since_mark=True)`` sums up (to leave a warm-up out). ``error`` says why there are
    no samples (no nvidia-smi on PATH, or it failed); the sampler never raises for that.
    """

    def __init__(self, interval_ms: int = INTERVAL_MS, executable: str | None = None) -> None:
        if interval_ms < 1:
            raise ValueError(f"interval_ms must be positive, got {interval_ms}")
        self.interval_ms = int(interval_ms)
        self.executable = executable or shutil.which("nvidia-smi")
        self.error: str | None = None
        self.samples: list[tuple[float, int, float | None, float | None]] = []  # (monotonic, index, util, MiB)
        self._mark: float | None = None
        self._proc: subprocess.Popen | None = None
        self._reader: threading.Thread | None = None
        self._said: list[str] = []

    def __enter__(self) -> GpuSampler:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self) -> None:
        if self.executable is None:
            self.error = "nvidia-smi is not on PATH (no NVIDIA driver installed here, or PATH lacks it)"
            return
        # A terminal for its output: C programs buffer what they print into a pipe (4 KiB, minutes of samples
        # here) and lose it when stopped; to a terminal they write each line as it is made.
        master, slave = pty.openpty()
        try:
            self._proc = subprocess.Popen([*_command(SAMPLED, self.executable), "-lms", str(self.interval_ms)],
                                          stdin=subprocess.DEVNULL, stdout=slave, stderr=slave)
        except OSError as exc:
            os.close(master)
            self.error = f"nvidia-smi could not be run: {exc}"
            return
        finally:
            os.close(slave)
        self._reader = threading.Thread(target=self._read, args=(master,), name="packer-nvidia-smi", daemon=True)
        self._reader.start()

    def _read(self, fd: int) -> None:
        with open(fd, encoding="utf-8", errors="replace", newline=None) as lines:
            try:
                for line in lines:
                    self._take(line)
            except OSError:  # EIO: the terminal's other end closed when nvidia-smi ended
                pass

    def _take(self, line: str) -> None:
        parts = line.split(",")
        index = _number(parts[0]) if len(parts) == len(SAMPLED) else None
        if index is None:
            if line.strip():
                self._said.append(line.strip())  # a failure, in nvidia-smi's words
            return
        self.samples.append((time.monotonic(), int(index), _number(parts[1]), _number(parts[2])))

    def mark(self) -> None:
        """From now on: the samples ``usage(since_mark=True)`` counts."""
        self._mark = time.monotonic()

    def stop(self) -> None:
        proc, self._proc = self._proc, None
        if proc is None:
            return
        proc.terminate()
        try:
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        if self._reader is not None:
            self._reader.join(timeout=5)
        if not self.samples:
            self.error = f"nvidia-smi gave no samples: {self._said[0] if self._said else 'no output'}"

    def usage(self, since_mark: bool = False) -> list[GpuUsage]:
        """Per GPU, the samples so far (after ``mark()`` with ``since_mark``) summed up; [] without samples."""
        start = self._mark if since_mark and self._mark is not None else float("-inf")
        rows = [s for s in self.samples if s[0] >= start]
        out = []
        for index in sorted({s[1] for s in rows}):
            mine = [s for s in rows if s[1] == index]
            util = [s[2] for s in mine if s[2] is not None]
            mem = [s[3] for s in mine if s[3] is not None]
            out.append(GpuUsage(index, len(mine), statistics.fmean(util) if util else None,
                                min(util) if util else None, statistics.median(util) if util else None,
                                max(util) if util else None, max(mem) if mem else None))
        return out
