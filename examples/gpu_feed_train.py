"""examples/gpu_feed.py's first part: is the GPU waiting? A real ResNet-50 training step fed by each loader.

The step: ResNet-50 (timm's where it imports, else examples/resnet50.py's, the same network), mixed precision
(float16 autocast + GradScaler), channels-last, SGD with momentum, batch 256, on random labels of the
dataset's classes. ``feed`` times it on one batch that stays on the GPU (the ceiling: no loader at all), then
fed by each loader through ``CUDAPrefetcher`` from pinned memory, after a warm-up, for a fixed time, while
``GpuSampler`` reads nvidia-smi's utilisation. Each loader's steps/s over the ceiling's is the fraction of
the GPU's own speed that loader delivers.
"""

from __future__ import annotations

import math
import sys
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import asdict
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader

sys.path.insert(0, str(Path(__file__).resolve().parent))
from resnet50 import ResNet50  # noqa: E402

import packer  # noqa: E402
from packer.diagnose.gpu import GpuSampler  # noqa: E402
from packer.diagnose.profile import LoopProfiler  # noqa: E402
from packer.images.crop import DRAWS, crop_params  # noqa: E402

MEAN = torch.tensor([0.485, 0.456, 0.406]).view(1, 3, 1, 1) * 255  # ImageNet's, as torchvision's Normalize
STD = torch.tensor([0.229, 0.224, 0.225]).view(1, 3, 1, 1) * 255
Step = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


class TorchRandomResizedCrop:
    """torchvision's ``RandomResizedCrop(size)`` + ``RandomHorizontalFlip()`` on a CHW uint8 tensor, without
    torchvision: the window drawn by torchvision's rule (``packer.images.crop.crop_params``) from torch's
    generator, resized by ``F.interpolate``'s antialiased bilinear (what torchvision's tensor resize calls), then
    flipped with p = 0.5. The unfused path: the whole image is decoded first."""

    def __init__(self, size: int = 224, scale: tuple[float, float] = (0.08, 1.0),
                 ratio: tuple[float, float] = (3 / 4, 4 / 3)) -> None:
        self.size, self.scale, self.ratio = size, scale, ratio

    def __call__(self, img: torch.Tensor) -> torch.Tensor:
        _, height, width = img.shape
        u = torch.rand(DRAWS, dtype=torch.float64).numpy()
        top, left, h, w = crop_params(height, width, self.scale, self.ratio, u)
        out = F.interpolate(img[None, :, top:top + h, left:left + w], size=(self.size, self.size), mode="bilinear",
                            antialias=True, align_corners=False)[0]
        return out.flip(-1) if u[-1] < 0.5 else out


def make_model(num_classes: int = 1000) -> tuple[nn.Module, str]:
    """timm's ResNet-50 where timm imports (it needs torchvision), else examples/resnet50.py's; and which."""
    try:
        import timm  # pyright: ignore[reportMissingImports]  # optional (it needs torchvision)

        return timm.create_model("resnet50", pretrained=False, num_classes=num_classes), f"timm {timm.__version__}"
    except Exception as exc:  # noqa: BLE001 - any failure of the optional import means: the built-in network
        return ResNet50(num_classes), f"examples/resnet50.py (timm: {type(exc).__name__}: {exc})"


def make_step(model: nn.Module, device: torch.device, lr: float = 0.01) -> Step:
    """One training step on a channels-last float batch: autocast (float16 on CUDA, bfloat16 on the CPU), loss,
    backward through GradScaler (CUDA), SGD with momentum. Returns the loss (not synchronised)."""
    model.to(device).train()
    model.to(memory_format=torch.channels_last)  # pyright: ignore[reportCallIssue]  # torch takes it; its stubs not
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9, weight_decay=5e-5)
    cuda = device.type == "cuda"
    scaler = torch.amp.GradScaler(device.type, enabled=cuda)
    loss_fn = nn.CrossEntropyLoss()

    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        with torch.autocast(device.type, dtype=torch.float16 if cuda else torch.bfloat16):
            loss = loss_fn(model(x), y)
        opt.zero_grad(set_to_none=True)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        return loss.detach()

    return step


_STATS: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}  # MEAN and STD on each device, copied once


def normalized(images: torch.Tensor) -> torch.Tensor:
    """A uint8 NCHW batch (any strides) on its device as the float, normalised, channels-last input."""
    if images.device not in _STATS:
        _STATS[images.device] = (MEAN.to(images.device), STD.to(images.device))
    mean, std = _STATS[images.device]
    return images.float().sub_(mean).div_(std).contiguous(memory_format=torch.channels_last)


def long_order(n: int, epochs: int, seed: int = 0) -> list[int]:
    """``epochs`` shuffled epochs of ``n`` indices one after the other: a sampler no timed run reaches the end of."""
    rng = np.random.default_rng(seed)
    return np.concatenate([rng.permutation(n) for _ in range(epochs)]).tolist()


def forever(make: Callable[[], Iterable]) -> Iterator:
    """Batches of ``make()``'s iterable, epoch after epoch."""
    while True:
        yield from make()


def uint8_batches(loader: Iterable, device: torch.device) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """(input, labels) on ``device`` from a loader of uint8 (images, labels), epoch after epoch: copied ahead by
    CUDAPrefetcher."""
    for images, labels in packer.CUDAPrefetcher(forever(lambda: loader), device):
        yield normalized(images), labels


def sources(path: Path, batch: int, workers: int, device: torch.device, epochs: int = 64
            ) -> dict[str, Callable[[], Iterator[tuple[torch.Tensor, torch.Tensor]]]]:
    """Each loader of the comparison, as a maker of an endless iterator of (input, labels) on ``device``."""
    pin = device.type == "cuda"

    def open_fused():
        return packer.open_dataset(path, image="tensor", crop=packer.RandomResizedCropDecode(224))

    def dataloader():
        ds = open_fused()
        return uint8_batches(DataLoader(ds, batch_size=batch, sampler=long_order(len(ds), epochs), drop_last=True,
                                        num_workers=workers, pin_memory=pin, collate_fn=packer.collate),
                            device)

    def threads(ds):
        return uint8_batches(packer.ThreadLoader(ds, batch_size=batch, sampler=long_order(len(ds), epochs),
                                                 drop_last=True, num_threads=workers, pin_memory=pin,
                                                 prefetch_batches=4), device)

    def dali():
        loader = packer.dali.loader(path, batch, device="gpu" if device.type == "cuda" else "cpu", augment="train",
                                    num_threads=workers, last_batch="drop")
        return ((x.contiguous(memory_format=torch.channels_last), y.to(device)) for x, y in forever(lambda: loader))

    return {
        f"DataLoader, {workers} workers, fused RandomResizedCropDecode": dataloader,
        f"ThreadLoader, {workers} threads, whole decode + torch RandomResizedCrop":
            lambda: threads(packer.open_dataset(path, image="tensor", transform=TorchRandomResizedCrop(224))),
        f"ThreadLoader, {workers} threads, fused RandomResizedCropDecode": lambda: threads(open_fused()),
        f"packer.dali device={'gpu' if device.type == 'cuda' else 'cpu'}, {workers} threads, train": dali,
    }


def synthetic(batch: int, classes: int, device: torch.device) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """One random uint8 batch made on the device, normalised anew each step as a loader's would be: the ceiling."""
    images = torch.randint(0, 256, (batch, 3, 224, 224), dtype=torch.uint8, device=device)
    labels = torch.randint(0, classes, (batch,), device=device)
    while True:
        yield normalized(images), labels


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed_steps(batches: Iterator[tuple[torch.Tensor, torch.Tensor]], step: Step, device: torch.device,
                warmup: int, seconds: float, gpu: bool = True) -> dict:
    """``warmup`` steps, then as many as fit in ``seconds``: steps/s (synchronised at both ends, never between
    steps, so the loop runs as training does), with nvidia-smi's utilisation over the timed steps."""
    sampler = GpuSampler() if gpu else None
    if sampler is not None:
        sampler.start()
    try:
        t_first = time.perf_counter()
        loss = None
        for _ in range(warmup):
            x, y = next(batches)
            loss = step(x, y)
        sync(device)
        warm_s = time.perf_counter() - t_first
        if sampler is not None:
            sampler.mark()
        t0, n = time.perf_counter(), 0
        while time.perf_counter() - t0 < seconds or n < 2:
            x, y = next(batches)
            loss = step(x, y)
            n += 1
        sync(device)
        elapsed = time.perf_counter() - t0
    finally:
        if sampler is not None:
            sampler.stop()
    batch = int(x.shape[0])
    out = {"steps": n, "seconds": elapsed, "steps_per_s": n / elapsed, "images_per_s": n * batch / elapsed,
           "warmup_steps": warmup, "warmup_s": warm_s, "loss": float(loss) if loss is not None else None,
           "gpu": [asdict(u) for u in sampler.usage(since_mark=True)] if sampler is not None else []}
    if sampler is not None and sampler.error is not None:
        out["gpu_error"] = sampler.error
    if out["loss"] is not None and not math.isfinite(out["loss"]):
        out["note"] = "the loss is not finite (random labels, float16): the step ran all the same"
    return out


def profiled(batches: Iterator[tuple[torch.Tensor, torch.Tensor]], step: Step, steps: int) -> dict:
    """``packer.profile`` over ``steps`` steps of one loader: its summary and verdict, GPU utilisation included."""
    prof = LoopProfiler((next(batches) for _ in range(steps)), warmup=max(2, steps // 5), progress=False)
    for x, y in prof:
        step(x, y)
    return {"steps": steps, "report": prof.report(), **prof.to_dict()}


def feed(path: Path, seconds: float, workers: int, device: torch.device, batch: int = 256,
         model: nn.Module | None = None, warmup: tuple[int, int] = (10, 5),
         log: Callable[[str], None] = print) -> dict:
    """The ceiling, then each loader: steps/s, its fraction of the ceiling, nvidia-smi's utilisation. ``model``
    replaces ResNet-50 (tests: a small network on the CPU); ``warmup``: steps before timing, for the ceiling
    (cuDNN's algorithm search) and for each loader (its start)."""
    ds = packer.open_dataset(path)
    classes = len(ds.classes)
    ds.close()
    model, model_source = make_model() if model is None else (model, type(model).__name__)
    step = make_step(model, device)
    makers = sources(path, batch, workers, device)
    per_run = seconds / (len(makers) + 1.5)  # each run's share; the rest for start-ups and the profile
    window = max(1.0, 0.6 * per_run)
    torch.backends.cudnn.benchmark = True
    log(f"feed: ceiling (a batch of {batch} on the {device.type}), {window:.0f} s")
    ceiling = timed_steps(synthetic(batch, classes, device), step, device, warmup=warmup[0], seconds=window)
    rows: dict[str, Any] = {}
    for name, make in makers.items():
        log(f"feed: {name}, {window:.0f} s")
        try:
            it = make()
            rows[name] = timed_steps(it, step, device, warmup=warmup[1], seconds=window)
            rows[name]["of_ceiling"] = rows[name]["steps_per_s"] / ceiling["steps_per_s"]
            del it
        except Exception as exc:  # noqa: BLE001 - one loader failing never loses the others' figures
            rows[name] = {"error": f"{type(exc).__name__}: {exc}"}
    fed = {k: v for k, v in rows.items() if "of_ceiling" in v}
    best = max(fed, key=lambda k: fed[k]["of_ceiling"]) if fed else None
    out = {"model": model_source, "batch_size": batch, "precision": "float16 autocast + GradScaler" if
           device.type == "cuda" else "bfloat16 autocast", "memory_format": "channels_last", "workers": workers,
           "device": str(device), "window_s": window, "ceiling": ceiling, "loaders": rows, "best": best}
    if best is not None and device.type == "cuda":
        log(f"feed: packer.profile over the best, {best}")
        try:
            out["profile_of_best"] = profiled(makers[best](), step, steps=max(10, int(window * 3)))
        except Exception as exc:  # noqa: BLE001
            out["profile_of_best"] = {"error": f"{type(exc).__name__}: {exc}"}
    return out
