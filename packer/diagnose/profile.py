"""``packer.profile(loader)`` and ``packer.instrument(dataset)``: where a training loop waits, and why.

    ds = packer.instrument(dataset)              # per-sample stage times, summed across workers
    loader = DataLoader(ds, ..., collate_fn=ds.collate())
    prof = packer.profile(loader)                # wraps any iterable of batches
    for x, y in prof:
        train_step(x, y)                         # your step; nothing else changes
    print(prof.report())                         # summary + verdict

The profiler takes timestamps when the loop asks for a batch, when the batch arrives and when
the loop asks for the next one, so wait + step add up to the loop's wall time. When CUDA is in
use it calls ``torch.cuda.synchronize()`` before each timestamp, so a step's asynchronous GPU
work counts in that step rather than in the next wait. With ``device=`` it moves each batch to
the device itself and times that copy as the host-to-device stage. Where CUDA is in use (or with
``gpu=True``) nvidia-smi samples the GPUs' utilisation and memory meanwhile (``packer.diagnose.gpu``);
the steady batches' samples go into the summary and the verdict. ``instrument`` (instrument.py) times
the stages inside the loader, and the verdict names the one that limits.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Iterable, Iterator, Sequence, Sized
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset

from packer.diagnose.gpu import GpuSampler, GpuUsage
from packer.diagnose.instrument import InstrumentedDataset, StageTable, StageTotals, clock_of
from packer.images.magic import sniff
from packer.progress import bar as progress_bar
from packer.read.dataset import PackedDataset
from packer.read.loaders import to_device
from packer.read.threaded import ThreadLoader

# ------------------------------------------------------------------ the loop profiler


FED = 0.10  # the step is fed when it waits for data less than 10% of its own time

ADVICE = {
    "read": "reads (IO) are the limit: pack the folder (packer convert), cache it in RAM "
    "(open_dataset(path, cache='ram')) if it fits, or move it to faster storage",
    "decode": "decoding is the limit: more workers (up to the cores), libjpeg-turbo, decode at reduced size, "
    "or store decoded pixels (--payload raw / cache='ram-decoded') if they fit",
    "transform": "the transform is the limit: cheaper augmentations, or move them to the GPU after the copy",
    "getitem": "the dataset's __getitem__ is the limit: more workers, or pack the data with packer",
    "collate": "collation is the limit: hand out tensors of one shape (not PIL images or lists), "
    "or collate fewer, larger arrays",
    "h2d": "the host-to-device copy is the limit: pin_memory=True and packer.CUDAPrefetcher "
    "to overlap the copy with compute",
}


def batch_len(batch: Any) -> int:
    """Samples in a batch: the first dimension of its first tensor or array, else its length."""
    if isinstance(batch, (torch.Tensor, np.ndarray)):
        return int(batch.shape[0]) if batch.ndim else 1
    if isinstance(batch, dict):
        return batch_len(next(iter(batch.values()))) if batch else 0
    if isinstance(batch, (list, tuple)) and batch:
        first = batch[0]
        if isinstance(first, (torch.Tensor, np.ndarray, dict)) or (
                isinstance(first, (list, tuple)) and isinstance(batch, tuple)):
            return batch_len(first)
        return len(batch)
    return 1


def _cuda_in_use() -> bool:
    return torch.cuda.is_available() and torch.cuda.is_initialized()


@dataclass
class LoopStats:
    """Per-iteration seconds of one profiled pass; ``warmup`` first iterations left out of ``steady``."""

    wait: list[float] = field(default_factory=list)
    step: list[float] = field(default_factory=list)
    h2d: list[float] = field(default_factory=list)
    samples: list[int] = field(default_factory=list)
    total_s: float = 0.0  # from the first request to the end of the last complete step
    warmup: int = 1

    @property
    def iterations(self) -> int:
        return len(self.step)

    def figures(self, steady: bool = True) -> dict:
        k = min(self.warmup, max(self.iterations - 1, 0)) if steady else 0
        w, s, h = (float(np.sum(a[k:])) for a in (self.wait, self.step, self.h2d))
        n = int(np.sum(self.samples[k:]))
        its = self.iterations - k
        busy = w + s + h
        return {
            "iterations": its, "samples": n, "seconds": busy,
            "wait_s": w, "step_s": s, "h2d_s": h,
            "wait_ms_per_batch": 1000 * w / max(its, 1),
            "step_ms_per_batch": 1000 * s / max(its, 1),
            "h2d_ms_per_batch": 1000 * h / max(its, 1),
            "wait_fraction": w / busy if busy else 0.0,  # share of wall time spent waiting
            "wait_over_step": w / s if s else math.inf,  # the < 10% criterion
            "samples_per_s": n / busy if busy else 0.0,
        }

    def to_dict(self) -> dict:
        return {
            "iterations": self.iterations, "samples": int(sum(self.samples)), "total_s": self.total_s,
            "first_wait_s": self.wait[0] if self.wait else 0.0, "warmup": self.warmup,
            "all": self.figures(steady=False), "steady": self.figures(steady=True),
        }


@dataclass
class Verdict:
    """Input-bound or compute-bound, the limiting stage, and advice that names its figures."""

    bound: str  # "input" | "compute" | "unknown"
    limit: str | None
    lines: list[str]
    figures: dict

    def __str__(self) -> str:
        return "\n".join(self.lines)


def decode_advice(dataset: Any) -> str | None:
    """What a packed dataset of JPEGs can do to decode less: a fused crop, its region decode, or ``--jpeg-restarts``
    for it (None where none applies: other payloads or image formats, Pillow as the decoder)."""
    if (not isinstance(dataset, PackedDataset) or dataset.manifest.payload != "encoded" or len(dataset) == 0
            or dataset.decoder == "pil" or sniff(dataset.store.read(0)) != "jpeg"):
        return None
    if dataset.crop is None:
        return ("a fused crop (open_dataset(..., crop=packer.RandomResizedCropDecode(224))) decodes only the "
                "crop's region (docs/decoding.md)")
    if not dataset.crop.region:
        return "this crop decodes whole images (region=False): region=True, the default, decodes only the crop's region"
    if not dataset.manifest.options.get("jpeg_restarts"):
        return ("this dataset was converted without --jpeg-restarts: converted with it (the same pixels), a crop "
                "decodes only its own part of each JPEG, 1.3-1.45x faster per core (docs/decoding.md)")
    return None


GPU_BUSY = 90.0  # percent: below it, a loop that does not wait for data still leaves the GPU idle


def gpu_lines(usage: Sequence[GpuUsage], bound: str) -> list[str]:
    """What nvidia-smi's utilisation during the steady batches says beside the wait/step split."""
    lines = []
    for u in usage:
        if u.utilization_mean is None:
            continue
        busy = f"GPU {u.index} was busy {u.utilization_mean:.0f}% of the time (nvidia-smi, {u.samples} samples)"
        if bound == "input":
            lines.append(f"{busy}: the rest of it, it waited for data.")
        elif u.utilization_mean < GPU_BUSY:
            lines.append(f"{busy}, though the loop hardly waited for data: the idle time is the loop's own (CPU work "
                         "between kernels: launches, synchronisation, logging, small kernels); the loader is not the "
                         "limit.")
        else:
            lines.append(f"{busy}: kept fed.")
    return lines


def verdict(stats: LoopStats, stages: StageTotals | None = None, workers: int | None = None,
            cores: int | None = None, dataset: Any = None, threaded: bool = False,
            gpu: Sequence[GpuUsage] = ()) -> Verdict:
    """Judge a profiled pass (steady state): is the step fed, and if not, which stage limits it (``dataset``: its
    own ways to decode less are named; ``threaded``: a ThreadLoader fed it (no collate_fn to time); ``gpu``: the
    GPUs' utilisation meanwhile, as nvidia-smi sampled it)."""
    f = stats.figures(steady=True)
    if f["iterations"] == 0:
        return Verdict("unknown", None, ["not enough iterations to judge (profile at least 2 batches)"], f)
    ratio, wait_ms, step_ms = f["wait_over_step"], f["wait_ms_per_batch"], f["step_ms_per_batch"]
    lines = []
    per_sample = stages.per_sample_ms() if stages and stages.samples else {}
    h2d_ms_sample = 1000 * f["h2d_s"] / max(f["samples"], 1)
    if h2d_ms_sample > 0:
        per_sample = {**per_sample, "h2d": h2d_ms_sample}
    if ratio < FED:
        bound, limit = "compute", None
        lines.append(f"compute-bound: each step waits {wait_ms:.1f} ms for data against {step_ms:.1f} ms of work "
                     f"({100 * ratio:.0f}% < {100 * FED:.0f}%): the input pipeline keeps up "
                     f"({f['samples_per_s']:,.0f} samples/s).")
    else:
        bound = "input"
        lines.append(f"input-bound: each step waits {wait_ms:.1f} ms for data against {step_ms:.1f} ms of work "
                     f"({100 * ratio:.0f}% of the step; fed means < {100 * FED:.0f}%); "
                     f"{f['samples_per_s']:,.0f} samples/s.")
        limit = max(per_sample, key=lambda k: per_sample[k]) if per_sample else None
        if limit is None:
            lines.append("wrap the dataset with packer.instrument(dataset)" + ("" if threaded else
                         " (and collate_fn=ds.collate())") + " to see which stage (read, decode, transform, "
                         "collate) is the limit.")
        else:
            parts = ", ".join(f"{k} {v:.2f}" for k, v in per_sample.items())
            lines.append(f"per sample (ms): {parts}; the largest is {limit} "
                         f"({per_sample[limit]:.2f} ms): {ADVICE[limit]}.")
            own = decode_advice(dataset) if limit == "decode" else None
            if own is not None:
                lines.append(f"for this dataset: {own}.")
    if stages and stages.samples and f["iterations"]:
        cost = stages.sample_seconds  # seconds of one process per sample
        batch = f["samples"] / f["iterations"]
        need = batch * cost / (f["step_s"] / f["iterations"]) if f["step_s"] else math.inf
        w = 0 if workers is None else workers
        lines.append(f"loading costs {1000 * cost:.2f} ms per sample in one process, {batch * cost * 1000:.0f} ms "
                     f"per batch of {batch:.0f}: keeping a {step_ms:.0f} ms step fed takes about "
                     f"{math.ceil(need)} busy worker(s)" + (f"; this loader has num_workers={w}" if workers is not None
                                                          else "") + (f", the machine {cores} cores" if cores else "")
                     + ".")
        f["workers_needed"] = math.ceil(need) if math.isfinite(need) else None
        if cores and need > cores:
            lines.append(f"that is more than this machine's {cores} cores: CPU loading cannot feed this step here; "
                         "cut the per-sample cost (see above) or the decode work (smaller or decoded payloads).")
    lines += gpu_lines(gpu, bound)
    busy = [u.utilization_mean for u in gpu if u.utilization_mean is not None]
    if busy:
        f["gpu_utilization_mean"] = statistics.fmean(busy)
    return Verdict(bound, limit, lines, {**f, "per_sample_ms": per_sample})


def _find(obj: Any, attr: str, kind: type, depth: int = 4) -> Any:
    """``obj.attr``, or ``obj.loader.attr`` through wrappers such as the prefetchers, if of ``kind``."""
    for _ in range(depth):
        value = getattr(obj, attr, None)
        if isinstance(value, kind):
            return value
        obj = getattr(obj, "loader", None)
        if obj is None:
            return None
    return None


class LoopProfiler:
    """Iterate a loader, timing the wait for each batch and the step that follows (see module doc)."""

    def __init__(self, loader: Iterable, *, warmup: int = 1, device: torch.device | str | None = None,
                 sync: bool | None = None, progress: bool | None = None, desc: str = "profile",
                 instrumented: Any = None, gpu: bool | None = None) -> None:
        self.loader = loader
        self.gpu = gpu
        self.gpu_usage: list[GpuUsage] = []  # nvidia-smi's, over the steady batches of the last pass
        self.gpu_error: str | None = None  # why the GPU was not sampled, where it was asked for
        self.device = torch.device(device) if device is not None else None
        self.sync = sync
        self.progress = progress
        self.desc = desc
        self.stats = LoopStats(warmup=warmup)
        # the dataset packer.instrument timed (given, or the loader's): where the stage totals come from
        self.instrumented: Any = instrumented if instrumented is not None else _find(loader, "dataset", Dataset)
        self.clock: StageTable | None = clock_of(self.instrumented)
        workers = _find(loader, "num_workers", int)
        self.num_workers: int | None = workers if workers is not None else None

    def __len__(self) -> int:
        return len(self.loader)  # type: ignore[arg-type]

    def _sync(self) -> None:
        if self.sync or (self.sync is None and _cuda_in_use()):
            torch.cuda.synchronize()

    def _gpu_sampler(self) -> GpuSampler | None:
        """nvidia-smi sampling for this pass: asked for (``gpu=True``), or by default where CUDA is in use."""
        if not (self.gpu or (self.gpu is None and _cuda_in_use())):
            return None
        sampler = GpuSampler()
        sampler.start()
        return sampler

    def __iter__(self) -> Iterator:
        st = self.stats = LoopStats(warmup=self.stats.warmup)
        if self.clock is not None:
            self.clock.reset()
        self.gpu_usage, self.gpu_error = [], None
        sampler = self._gpu_sampler()
        total = len(self.loader) if isinstance(self.loader, Sized) else None
        bar = progress_bar(total=total, desc=self.desc, unit="batch", progress=self.progress, mininterval=0.5,
                           leave=True)
        clock = time.perf_counter
        start = mark = clock()
        it = iter(self.loader)
        try:
            while True:
                try:
                    batch = next(it)
                except StopIteration:
                    break
                got = clock()
                h2d = 0.0
                if self.device is not None:
                    batch = to_device(batch, self.device)
                    self._sync()
                    h2d = clock() - got
                    got = clock()
                yield batch
                self._sync()
                end = clock()
                st.wait.append(got - mark - h2d)
                st.h2d.append(h2d)
                st.step.append(end - got)
                st.samples.append(batch_len(batch))
                st.total_s = end - start
                mark = end
                if sampler is not None and st.iterations == st.warmup:
                    sampler.mark()  # the steady batches start
                if not bar.disable:
                    f = st.figures(steady=True)
                    bar.set_postfix_str(f"wait {100 * f['wait_over_step']:.0f}% of step, "
                                        f"{f['samples_per_s']:,.0f} samples/s", refresh=False)
                    bar.update(1)
        finally:
            del it
            bar.close()
            if sampler is not None:
                sampler.stop()
                self.gpu_usage, self.gpu_error = sampler.usage(since_mark=True), sampler.error
                if not self.gpu_usage and self.gpu_error is None:
                    self.gpu_error = (f"no nvidia-smi sample during the steady batches (after {st.warmup} warm-up "
                                      "batch(es)): profile more batches")

    def stage_totals(self) -> StageTotals | None:
        return self.clock.totals() if self.clock is not None else None

    def verdict(self, cores: int | None = None) -> Verdict:
        timed = self.instrumented if self.clock is not None else None  # stages come from it alone
        dataset = timed.dataset if isinstance(timed, InstrumentedDataset) else timed
        return verdict(self.stats, self.stage_totals(), workers=self.num_workers, cores=cores, dataset=dataset,
                       threaded=_find(self, "loader", ThreadLoader) is not None, gpu=self.gpu_usage)

    def summary(self) -> str:
        """A few lines: iterations, wait vs step, throughput, and the stage breakdown when known."""
        s = self.stats
        f = s.figures(steady=True)
        lines = [
            f"{s.iterations} batches, {sum(s.samples):,} samples in {s.total_s:.2f} s; first batch after "
            f"{s.wait[0] if s.wait else 0:.2f} s (worker start-up; left out below with {s.warmup} warm-up batch(es))",
            f"per batch: wait {f['wait_ms_per_batch']:.1f} ms, step {f['step_ms_per_batch']:.1f} ms"
            + (f", host-to-device {f['h2d_ms_per_batch']:.1f} ms" if f["h2d_s"] else "")
            + f"; waiting {100 * f['wait_fraction']:.0f}% of the time; {f['samples_per_s']:,.0f} samples/s",
        ]
        stages = self.stage_totals()
        if stages is not None and stages.samples:
            parts = ", ".join(f"{k} {v:.2f}" for k, v in stages.per_sample_ms().items())
            lines.append(f"inside the loader, per sample (ms, {stages.processes} process(es)): {parts}")
        lines += [f"during the steady batches: {u.line()}" for u in self.gpu_usage]
        if self.gpu_error is not None:
            lines.append(f"GPU not sampled: {self.gpu_error}")
        return "\n".join(lines)

    def report(self, cores: int | None = None) -> str:
        return self.summary() + "\n" + str(self.verdict(cores))

    def to_dict(self) -> dict:
        stages = self.stage_totals()
        return {"loop": self.stats.to_dict(), "stages": stages.to_dict() if stages else None,
                "gpu": {"usage": [asdict(u) for u in self.gpu_usage], "error": self.gpu_error},
                "verdict": {"bound": (v := self.verdict()).bound, "limit": v.limit, "lines": v.lines}}


def profile(loader: Iterable, **kwargs: Any) -> LoopProfiler:
    """Wrap ``loader`` to time wait-for-batch against the loop's own step (see ``LoopProfiler``)."""
    return LoopProfiler(loader, **kwargs)
