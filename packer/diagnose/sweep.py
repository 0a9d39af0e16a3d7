"""``packer profile``: sweep num_workers / batch_size / pin_memory against a simulated step.

For each setting a real ``DataLoader`` reads the dataset in shuffled order (as training does)
while the loop "computes" by sleeping ``step_ms`` per batch: a sleeping host is what a GPU
training loop looks like from the CPU's side, so the workers get every core. ``sweep`` measures
one ``SweepPoint`` per setting; ``word_sweep`` then picks the smallest worker count whose data
wait stays under 10% of the step, predicts one from the per-sample cost, and words the result;
when no setting is fed it says so, with the figures that make it impossible on this machine.
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

from packer.diagnose.gpu import GpuSampler
from packer.diagnose.instrument import StageTable, timed
from packer.diagnose.profile import ADVICE, FED, LoopProfiler
from packer.diagnose.system import usable_cores
from packer.errors import PackerError


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


def measure_point(ds: Any, clock: StageTable, workers: int, batch_size: int, pin_memory: bool, step_s: float,
                  batches: int, warmup: int, device: torch.device | None = None, start_method: str | None = None,
                  seed: int = 0, progress: bool | None = False, collate: Callable | None = None) -> SweepPoint:
    """One setting: a DataLoader over ``ds`` while the loop sleeps ``step_s`` per batch; ``warmup`` batches left out."""
    total = warmup + batches
    gen = torch.Generator().manual_seed(seed)
    sampler = RandomSampler(ds, num_samples=total * batch_size, generator=gen)  # several epochs if needed
    kwargs: dict[str, Any] = {}
    if workers > 0 and start_method:
        kwargs["multiprocessing_context"] = start_method
    loader = DataLoader(ds, batch_size=batch_size, sampler=sampler, num_workers=workers, pin_memory=pin_memory,
                        collate_fn=clock.collate(collate or default_collate), drop_last=True, **kwargs)
    prof = LoopProfiler(loader, warmup=warmup, device=device, progress=progress, gpu=False,
                        desc=f"workers={workers} batch={batch_size} pin={'on' if pin_memory else 'off'}")
    clock.reset()
    for _ in prof:
        time.sleep(step_s)
    f = prof.stats.figures(steady=True)
    per_sample = clock.totals().per_sample_ms()
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
    progress: bool | None = None,
    collate: Callable | None = None,
    gpu: bool | None = None,
) -> SweepResult:
    """Measure every (batch size, pin_memory, workers) setting, then pick and word the result (``word_sweep``).

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
    ds, clock = timed(dataset)
    cores = usable_cores()
    if max(workers) > cores:
        notes.append(f"with more workers than the {cores} cores, per-sample times include waiting for a core")
    sampler = GpuSampler() if (gpu or (gpu is None and torch.cuda.is_available())) else None
    if sampler is not None:
        sampler.start()
    try:
        points = [measure_point(ds, clock, w, b, pin, step_ms / 1000 * b / batch_sizes[0], batches,
                                (2 * w + 2) if warmup is None else warmup, dev, start_method, seed, progress, collate)
                  for b, pin, w in itertools.product(batch_sizes, pins, sorted(set(workers)))]
    finally:
        if sampler is not None:
            sampler.stop()
    if sampler is not None:
        notes += [f"nvidia-smi during the sweep (its step is simulated: a busy GPU or memory held is the copies' or "
                  f"another job's): {u.line()}" for u in sampler.usage()]
        if sampler.error is not None:
            notes.append(f"GPU not sampled: {sampler.error}")
    name = str(getattr(dataset, "root", type(dataset).__name__))
    return word_sweep(name, points, step_ms, cores, notes)


# ------------------------------------------------------------------ wording the result


def _loading_ms(p: SweepPoint) -> float:
    """Milliseconds one process spends loading a sample at this point (host-to-device copy left out)."""
    return sum(v for k, v in p.per_sample_ms.items() if k != "h2d")


def predict_workers(points: Sequence[SweepPoint], step_ms: float) -> tuple[SweepPoint, float, int | None]:
    """(reference point, busy workers needed, predicted num_workers) from the per-sample cost.

    The cost comes from the fewest worker processes (least contention; workers run torch
    single-threaded as in training), or the main process if no workers ran. num_workers=0 loads in
    series with the step: fed only if loading a batch takes < 10% of it; W workers load in
    parallel with it: fed once W batches take no longer than W steps.
    """
    ref = min(points, key=lambda p: (p.workers == 0, p.workers))
    need = points[0].batch_size * _loading_ms(ref) / step_ms if step_ms else math.inf
    if not math.isfinite(need):
        return ref, need, None
    return ref, need, 0 if need < FED / 2 else max(1, math.ceil(need))  # half: the main process has overheads


def _in_process_note(points: Sequence[SweepPoint], ref: SweepPoint) -> list[str]:
    zero = [p for p in points if p.workers == 0]
    cost, cost0 = _loading_ms(ref), _loading_ms(zero[0]) if zero else 0.0
    if not zero or ref.workers == 0 or not cost or cost0 <= 2 * cost:
        return []
    return [f"with num_workers=0 a sample cost {cost0:.2f} ms against {cost:.2f} ms in a worker: the main "
            f"process runs torch with {torch.get_num_threads()} intra-op threads (workers use 1), and on a busy "
            "or small machine those threads contend; torch.set_num_threads(1) helps if you must load in-process"]


def _fed_lines(chosen: SweepPoint, predicted: int | None) -> list[str]:
    lines = [f"smallest setting that keeps the step fed: num_workers={chosen.workers}, batch_size={chosen.batch_size}, "
             f"pin_memory={chosen.pin_memory} (waits {chosen.wait_ms:.1f} ms per "
             f"{chosen.measured_step_ms:.0f} ms step, "
             f"{100 * chosen.wait_over_step:.0f}%; {chosen.samples_per_s:,.0f} samples/s)."]
    if predicted is not None and predicted != chosen.workers:
        lines.append(f"(the prediction said {predicted}; the measured sweep decides.)")
    if chosen.per_sample_ms:
        stage = max(chosen.per_sample_ms, key=lambda k: chosen.per_sample_ms[k])
        lines.append(f"there the loop is compute-bound; the largest loading cost is {stage} "
                     f"({chosen.per_sample_ms[stage]:.2f} ms per sample), the stage to cut if the step gets faster.")
    return lines


def _not_fed_lines(points: Sequence[SweepPoint], step_ms: float, need: float, cost_ms: float, cores: int) -> list[str]:
    best = min(points, key=lambda p: p.wait_over_step)
    base = points[0].batch_size
    if need > cores:
        why = f"The step would need about {need:.1f} busy workers but the machine has {cores} cores"
    elif best.workers >= math.ceil(need):
        load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
        why = (f"{best.workers} workers can load {1000 * best.workers / max(cost_ms, 1e-9):,.0f} samples/s against "
               f"{1000 * base / step_ms:,.0f} asked, so the {best.wait_ms:.1f} ms left per batch is "
               f"hand-over cost in the main process (receiving each batch from a worker) or CPU contention "
               f"(load {load:.1f} on {cores} cores); larger batches amortise the first")
    else:
        why = "No tested worker count was enough"
    lines = [f"NOT FEASIBLE as tested: no setting keeps a {step_ms:g} ms step fed; the best, "
             f"num_workers={best.workers}, "
             f"still waits {best.wait_ms:.1f} ms per step ({100 * best.wait_over_step:.0f}%). {why}."]
    if need <= cores and max(p.workers for p in points) < cores:
        lines.append(f"Try more workers (up to {cores}).")
    if best.per_sample_ms:
        stage = max(best.per_sample_ms, key=lambda k: best.per_sample_ms[k])
        lines.append(f"the largest cost per sample is {stage} ({best.per_sample_ms[stage]:.2f} ms): {ADVICE[stage]}.")
    return lines


def word_sweep(dataset: str, points: list[SweepPoint], step_ms: float, cores: int,
               notes: Sequence[str] = ()) -> SweepResult:
    """The measured points judged: the chosen setting (smallest fed worker count), the prediction, and the words."""
    base = points[0].batch_size
    order = list(dict.fromkeys(p.batch_size for p in points))
    fed = [p for p in points if p.fed]
    chosen = min(fed, key=lambda p: (p.workers, order.index(p.batch_size), p.pin_memory)) if fed else None
    ref, need, predicted = predict_workers(points, step_ms)
    cost_ms = _loading_ms(ref)
    lines = [f"step: {step_ms:g} ms per batch of {base} (simulated); fed = data wait < {100 * FED:.0f}% of the step",
             f"one process loads a sample in {cost_ms:.2f} ms (measured with num_workers={ref.workers}), a batch of "
             f"{base} in {base * cost_ms:.0f} ms: keeping the step fed needs about {need:.1f} busy workers"
             + (f" -> predicted num_workers={predicted}" if predicted is not None else "")
             + f"; this machine has {cores} cores."]
    if chosen is not None:
        lines += _fed_lines(chosen, predicted)
    else:
        lines += _not_fed_lines(points, step_ms, need, cost_ms, cores)
    if cost_ms and step_ms:
        per_core = 1000 / cost_ms
        lines.append(f"ceiling on this machine: about {per_core * cores:,.0f} samples/s "
                     f"({per_core:,.0f} per core x {cores} cores) against {1000 * base / step_ms:,.0f} "
                     "samples/s asked by the step.")
    return SweepResult(dataset=dataset, cores=cores, step_ms=step_ms, points=points, chosen=chosen,
                       predicted_workers=predicted, feasible=chosen is not None, lines=lines,
                       notes=[*notes, *_in_process_note(points, ref)])
