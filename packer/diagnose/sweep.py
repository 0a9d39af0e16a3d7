"""``packer profile``: sweep num_workers / batch_size / pin_memory against a simulated step.

For each setting a real ``DataLoader`` reads the dataset in shuffled order (as training does)
while the loop "computes" by sleeping ``step_ms`` per batch: a sleeping host is what a GPU
training loop looks like from the CPU's side, so the workers get every core. The smallest
worker count whose data wait stays under 10% of the step is the answer; when no setting gets
there the report says so, with the figures that make it impossible on this machine.
"""

from __future__ import annotations

import itertools
import math
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from torch.utils.data import DataLoader, RandomSampler
from torch.utils.data._utils.collate import default_collate

from packer.diagnose.profile import ADVICE, FED, InstrumentedDataset, LoopProfiler
from packer.errors import PackerError


def usable_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def default_workers() -> list[int]:
    """0, then powers of two up to the cores, and the core count itself."""
    cores = usable_cores()
    return sorted({0, cores, *(2 ** k for k in range(cores.bit_length()) if 2 ** k <= cores)})


class RandomCrop:
    """A ``size`` x ``size`` random crop of a CHW uint8 tensor (zero-padded when smaller): fixed shapes to collate."""

    def __init__(self, size: int) -> None:
        self.size = size

    def __call__(self, img: torch.Tensor) -> torch.Tensor:
        s = self.size
        _, h, w = img.shape
        if h < s or w < s:
            img = torch.nn.functional.pad(img, (0, max(0, s - w), 0, max(0, s - h)))
            _, h, w = img.shape
        y = int(torch.randint(0, h - s + 1, ()))
        x = int(torch.randint(0, w - s + 1, ()))
        return img[:, y:y + s, x:x + s].contiguous()


@dataclass
class SweepPoint:
    workers: int
    batch_size: int
    pin_memory: bool
    step_ms: float  # simulated step asked for
    iterations: int  # measured (after warm-up)
    warmup: int
    wait_ms: float  # mean per batch
    measured_step_ms: float
    h2d_ms: float
    wait_over_step: float
    samples_per_s: float
    first_batch_s: float
    per_sample_ms: dict[str, float] = field(default_factory=dict)

    @property
    def fed(self) -> bool:
        return self.wait_over_step < FED


@dataclass
class SweepResult:
    dataset: str
    cores: int
    step_ms: float
    points: list[SweepPoint]
    chosen: SweepPoint | None
    predicted_workers: int | None
    feasible: bool
    lines: list[str]
    notes: list[str]

    def to_dict(self) -> dict:
        d = asdict(self)
        for p, q in zip(d["points"], self.points, strict=True):
            p["fed"] = q.fed
        if self.chosen is not None:
            d["chosen"]["fed"] = True
        return d

    def table(self) -> str:
        head = f"{'workers':>7} {'batch':>5} {'pin':>3} {'wait ms':>8} {'step ms':>8} {'wait/step':>9} " \
               f"{'samples/s':>9}  fed  per-sample ms"
        rows = [head]
        for p in self.points:
            stages = " ".join(f"{k} {v:.2f}" for k, v in p.per_sample_ms.items())
            rows.append(f"{p.workers:>7} {p.batch_size:>5} {'on' if p.pin_memory else 'off':>3} {p.wait_ms:>8.1f} "
                        f"{p.measured_step_ms:>8.1f} {100 * p.wait_over_step:>8.0f}% {p.samples_per_s:>9,.0f}  "
                        f"{'yes' if p.fed else 'no ':<3}  {stages}")
        return "\n".join(rows)

    def report(self) -> str:
        return "\n".join([self.table(), "", *self.lines, *(f"note: {n}" for n in self.notes)])


def _measure(ds: InstrumentedDataset, workers: int, batch_size: int, pin_memory: bool, step_s: float,
             batches: int, warmup: int, device: torch.device | None, start_method: str | None,
             seed: int, progress: bool, collate: Callable | None) -> SweepPoint:
    total = warmup + batches
    gen = torch.Generator().manual_seed(seed)
    sampler = RandomSampler(ds, num_samples=total * batch_size, generator=gen)  # several epochs if needed
    kwargs: dict[str, Any] = {}
    if workers > 0 and start_method:
        kwargs["multiprocessing_context"] = start_method
    loader = DataLoader(ds, batch_size=batch_size, sampler=sampler, num_workers=workers, pin_memory=pin_memory,
                        collate_fn=ds.collate(collate or default_collate), drop_last=True, **kwargs)
    prof = LoopProfiler(loader, warmup=warmup, device=device, progress=progress,
                        desc=f"workers={workers} batch={batch_size} pin={'on' if pin_memory else 'off'}")
    ds.reset()
    for _ in prof:
        time.sleep(step_s)
    f = prof.stats.figures(steady=True)
    stages = ds.stage_totals()
    per_sample = stages.per_sample_ms()
    if f["h2d_s"]:
        per_sample["h2d"] = 1000 * f["h2d_s"] / max(f["samples"], 1)
    return SweepPoint(
        workers=workers, batch_size=batch_size, pin_memory=pin_memory, step_ms=1000 * step_s,
        iterations=f["iterations"], warmup=warmup, wait_ms=f["wait_ms_per_batch"],
        measured_step_ms=f["step_ms_per_batch"], h2d_ms=f["h2d_ms_per_batch"],
        wait_over_step=f["wait_over_step"], samples_per_s=f["samples_per_s"],
        first_batch_s=prof.stats.wait[0] if prof.stats.wait else 0.0, per_sample_ms=per_sample,
    )


def sweep(
    dataset: Any,
    workers: Sequence[int] = (0, 1, 2),
    batch_sizes: Sequence[int] = (64,),
    pin_memory: Sequence[bool] = (False,),
    step_ms: float = 40.0,
    batches: int = 30,
    warmup: int | None = None,
    device: torch.device | str | None = None,
    start_method: str | None = None,
    seed: int = 0,
    progress: bool = True,
    collate: Callable | None = None,
) -> SweepResult:
    """Run every (batch size, pin_memory, workers) setting; pick the smallest worker count that keeps the step fed.

    ``step_ms`` is the step for the first batch size; other sizes scale it in proportion (compute
    grows with the batch). ``warmup`` batches (default ``2 * workers + 2``: the first batch and the
    batches the workers queue up ahead) are left out of each measurement.
    """
    if not len(dataset):
        raise PackerError("profile: the dataset is empty")
    if step_ms < 0 or batches < 2:
        raise PackerError("profile: --step-ms must be >= 0 and --batches >= 2")
    if any(w < 0 for w in workers) or any(b < 1 for b in batch_sizes):
        raise PackerError("profile: worker counts must be >= 0 and batch sizes >= 1")
    dev = torch.device(device) if device is not None else None
    notes: list[str] = []
    pins = list(dict.fromkeys(bool(p) for p in pin_memory))
    if True in pins and not torch.cuda.is_available():
        pins = [p for p in pins if not p] or [False]
        notes.append("no CUDA here: pin_memory has no effect without a GPU, so only pin_memory=False was run")
    ds = dataset if isinstance(dataset, InstrumentedDataset) else InstrumentedDataset(dataset)
    cores = usable_cores()
    if max(workers) > cores:
        notes.append(f"with more workers than the {cores} cores, per-sample times include waiting for a core")
    points = []
    base_batch = batch_sizes[0]
    for b, pin, w in itertools.product(batch_sizes, pins, sorted(set(workers))):
        points.append(_measure(
            ds, w, b, pin, step_ms / 1000 * b / base_batch, batches,
            (2 * w + 2) if warmup is None else warmup, dev, start_method, seed, progress, collate))
    fed = [p for p in points if p.fed]
    chosen = min(fed, key=lambda p: (p.workers, batch_sizes.index(p.batch_size), p.pin_memory)) if fed else None

    # Prediction from the per-sample cost measured in the fewest worker processes (least contention;
    # workers run torch single-threaded as in training), or in the main process if no workers ran.
    ref = min(points, key=lambda p: (p.workers == 0, p.workers))
    cost_ms = sum(v for k, v in ref.per_sample_ms.items() if k != "h2d")
    need = base_batch * cost_ms / step_ms if step_ms else math.inf
    # num_workers=0 loads in series with the step: fed only if loading a batch takes < 10% of it.
    # W workers load in parallel with it: fed once W batches take no longer than W steps.
    if not math.isfinite(need):
        predicted = None
    else:
        predicted = 0 if need < FED / 2 else max(1, math.ceil(need))  # half: the main process has overheads
    zero = [p for p in points if p.workers == 0]
    if zero and ref.workers > 0 and cost_ms:
        cost0 = sum(v for k, v in zero[0].per_sample_ms.items() if k != "h2d")
        if cost0 > 2 * cost_ms:
            notes.append(
                f"with num_workers=0 a sample cost {cost0:.2f} ms against {cost_ms:.2f} ms in a worker: the main "
                f"process runs torch with {torch.get_num_threads()} intra-op threads (workers use 1), and on a busy "
                "or small machine those threads contend; torch.set_num_threads(1) helps if you must load in-process")
    lines = [f"step: {step_ms:g} ms per batch of {base_batch} (simulated); fed = data wait < {100 * FED:.0f}% of the step"]
    lines.append(
        f"one process loads a sample in {cost_ms:.2f} ms (measured with num_workers={ref.workers}), a batch of "
        f"{base_batch} in {base_batch * cost_ms:.0f} ms: keeping the step fed needs about {need:.1f} busy workers"
        + (f" -> predicted num_workers={predicted}" if predicted is not None else "") + f"; this machine has {cores} cores.")
    if chosen is not None:
        lines.append(
            f"smallest setting that keeps the step fed: num_workers={chosen.workers}, batch_size={chosen.batch_size}, "
            f"pin_memory={chosen.pin_memory} (waits {chosen.wait_ms:.1f} ms per {chosen.measured_step_ms:.0f} ms step, "
            f"{100 * chosen.wait_over_step:.0f}%; {chosen.samples_per_s:,.0f} samples/s).")
        if predicted is not None and predicted != chosen.workers:
            lines.append(f"(the prediction said {predicted}; the measured sweep decides.)")
        if chosen.per_sample_ms:
            stage = max(chosen.per_sample_ms, key=chosen.per_sample_ms.get)
            lines.append(f"there the loop is compute-bound; the largest loading cost is {stage} "
                         f"({chosen.per_sample_ms[stage]:.2f} ms per sample), the stage to cut if the step gets faster.")
        feasible = True
    else:
        best = min(points, key=lambda p: p.wait_over_step)
        stage = max(best.per_sample_ms, key=best.per_sample_ms.get) if best.per_sample_ms else None
        feasible = False
        if need > cores:
            why = f"The step would need about {need:.1f} busy workers but the machine has {cores} cores"
        elif best.workers >= math.ceil(need):
            load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
            why = (f"{best.workers} workers can load {1000 * best.workers / cost_ms:,.0f} samples/s against "
                   f"{1000 * base_batch / step_ms:,.0f} asked, so the {best.wait_ms:.1f} ms left per batch is "
                   f"hand-over cost in the main process (receiving each batch from a worker) or CPU contention "
                   f"(load {load:.1f} on {cores} cores); larger batches amortise the first")
        else:
            why = "No tested worker count was enough"
        lines.append(
            f"NOT FEASIBLE as tested: no setting keeps a {step_ms:g} ms step fed; the best, num_workers={best.workers}, "
            f"still waits {best.wait_ms:.1f} ms per step ({100 * best.wait_over_step:.0f}%). {why}.")
        if need <= cores and max(workers) < cores:
            lines.append(f"Try more workers (up to {cores}).")
        if stage:
            lines.append(f"the largest cost per sample is {stage} ({best.per_sample_ms[stage]:.2f} ms): {ADVICE[stage]}.")
    if cost_ms:
        per_core = 1000 / cost_ms
        lines.append(f"ceiling on this machine: about {per_core * cores:,.0f} samples/s "
                     f"({per_core:,.0f} per core x {cores} cores) against {1000 * base_batch / step_ms:,.0f} "
                     f"samples/s asked by the step." if step_ms else "")
    return SweepResult(dataset=str(getattr(dataset, "root", type(dataset).__name__)), cores=cores, step_ms=step_ms,
                       points=points, chosen=chosen, predicted_workers=predicted, feasible=feasible,
                       lines=[ln for ln in lines if ln], notes=notes)


def require_matplotlib() -> None:
    """Raise a clear error now (before minutes of measuring) if a plot can't be drawn."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise PackerError("--plot needs matplotlib, which is not installed: pip install 'packer[plot]' "
                          "(or pip install matplotlib)") from None


def plot_sweep(result: SweepResult, path: str | os.PathLike) -> None:
    """PNG: wait as % of step (and samples/s) against num_workers, one line per batch size / pin setting."""
    require_matplotlib()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.2))
    groups: dict[tuple[int, bool], list[SweepPoint]] = {}
    for p in result.points:
        groups.setdefault((p.batch_size, p.pin_memory), []).append(p)
    for (b, pin), pts in groups.items():
        pts.sort(key=lambda p: p.workers)
        label = f"batch {b}" + (", pinned" if pin else "")
        ax1.plot([p.workers for p in pts], [100 * p.wait_over_step for p in pts], "o-", label=label)
        ax2.plot([p.workers for p in pts], [p.samples_per_s for p in pts], "o-", label=label)
    ax1.axhline(100 * FED, color="red", ls="--", lw=1, label=f"fed: wait < {100 * FED:.0f}% of step")
    if result.chosen is not None:
        ax1.plot([result.chosen.workers], [100 * result.chosen.wait_over_step], "*", ms=16, color="green",
                 label=f"chosen: num_workers={result.chosen.workers}")
    ax1.set_yscale("symlog", linthresh=10)
    ax1.set_ylim(bottom=0)
    if result.chosen is None:
        ax1.text(0.5, 0.92, "no setting keeps the step fed", transform=ax1.transAxes, ha="center", color="red")
    base = result.points[0].batch_size if result.points else 0
    if result.step_ms > 0 and base:
        ax2.axhline(1000 * base / result.step_ms, color="red", ls="--", lw=1,
                    label=f"asked by the step (batch {base})")
    ax1.set_xlabel("num_workers")
    ax1.set_ylabel("data wait, % of step time")
    ax1.set_title(f"Does the loader feed a {result.step_ms:g} ms step?")
    ax1.legend(fontsize=8)
    ax2.axvline(result.cores, color="grey", ls=":", lw=1, label=f"{result.cores} cores")
    ax2.set_xlabel("num_workers")
    ax2.set_ylabel("samples/s")
    ax2.set_title("Loader throughput with the step running")
    ax2.legend(fontsize=8)
    from matplotlib.ticker import MaxNLocator

    for ax in (ax1, ax2):
        ax.grid(alpha=0.3)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    fig.suptitle(f"packer profile {result.dataset}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
