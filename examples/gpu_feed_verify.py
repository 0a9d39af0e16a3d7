"""examples/gpu_feed.py's third part: the GPU paths verified.

``prefetch``: examples/check_cuda_prefetch.py's two checks (imported, not copied): the prefetcher's batches
summed against the CPU's, and the copy hidden behind compute, with the share of the copy the prefetcher hides.

``dali_parity``: ``packer.dali.pipeline(..., augment="none")`` on each device (``"gpu"``: nvJPEG, ``mixed``;
``"cpu"``: libjpeg-turbo) against ``open_dataset(..., image="numpy")`` for every sample: the same indices, labels
and shapes, and pixels within the tolerance NVIDIA DALI's own tests allow between its nvJPEG and libjpeg-turbo
decoders (``TOLERANCE``); then each device's img/s on the train augmentation.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import check_cuda_prefetch  # noqa: E402

import packer  # noqa: E402
from packer.read.dali import import_dali  # noqa: E402

# NVIDIA DALI's test of its decoders' consistency (dali/test/python/decoder/test_image.py,
# _testimpl_image_decoder_consistency) compares device="cpu" (libjpeg-turbo) and "mixed" (nvJPEG) RGB outputs of
# JPEGs with eps=4, and check_batch (dali/test/python/test_utils.py) fails a sample whose MEAN absolute
# difference exceeds eps; single pixels may differ more (nvJPEG upsamples chroma without libjpeg's "fancy"
# filter and rounds its IDCT its own way).
TOLERANCE = {"mean_abs_diff": 4.0, "source": "NVIDIA DALI dali/test/python/decoder/test_image.py "
             "(_testimpl_image_decoder_consistency: eps=4 for JPEG, cpu vs mixed) with test_utils.check_batch "
             "(the mean absolute difference per sample)"}


def prefetch() -> dict:
    """Both checks on the GPU: per-batch wrong sums (must be 0) and ms per batch, with the copy's share hidden."""
    dev = torch.device("cuda")
    checked = check_cuda_prefetch.correctness(dev)
    timed = check_cuda_prefetch.overlap(dev)
    ms = {(r["pin_memory"], r["loader"]): r["ms"] for r in timed["ms_per_batch"]}
    step = timed["step_alone_ms"]
    hidden = {}
    for pin in (False, True):
        copy = ms[(pin, "plain .to(device)")] - step  # what the copy adds when nothing hides it
        left = ms[(pin, "CUDAPrefetcher")] - step
        hidden[f"pin_memory={pin}"] = 1 - left / copy if copy > 0 else None
    return {"correctness": checked, "ok": all(r["wrong_sums"] == 0 for r in checked), **timed,
            "copy_hidden": hidden}


def compare(ds, i: int, got: np.ndarray, label: int) -> tuple[int, bool, bool, float, int]:
    """(index, label equal, shape equal, mean and max |difference|) of one DALI output against open_dataset's."""
    want, want_label = ds[i]
    if got.shape != want.shape:
        return i, label == want_label, False, float("inf"), 255
    diff = np.abs(got.astype(np.int16) - want.astype(np.int16))
    return i, label == want_label, True, float(diff.mean()), int(diff.max())


def parity(path: Path, device: str, threads: int, batch: int = 64) -> dict:
    """packer.dali on ``device`` against open_dataset, every sample once (no shuffle, no augmentation); the
    references decoded and compared on ``threads`` threads (libjpeg-turbo and numpy leave the GIL)."""
    ds = packer.open_dataset(path, image="numpy")
    pipe = packer.dali.pipeline(path, batch, device=device, augment="none", shuffle=False,  # type: ignore[arg-type]
                                num_threads=threads)
    rows: list[tuple[int, bool, bool, float, int]] = []
    with ThreadPoolExecutor(threads) as pool:
        while True:
            try:
                images, labels, indices = pipe.run()
            except StopIteration:
                break
            if device == "gpu":
                images, labels = images.as_cpu(), labels.as_cpu()
            got = [(i, np.array(images[k]), int(labels.as_array()[k]))
                   for k, i in enumerate(indices.as_array().tolist())]
            rows += pool.map(lambda a: compare(ds, *a), got)
    seen = [r[0] for r in rows]
    missing = sorted(set(range(len(ds))) - set(seen))
    labels_wrong = [r[0] for r in rows if not r[1]]
    shapes_wrong = [r[0] for r in rows if not r[2]]
    over = [r[0] for r in rows if r[2] and r[3] > TOLERANCE["mean_abs_diff"]]
    sized = [r for r in rows if r[2]]
    return {"device": device, "samples": len(ds), "seen": len(seen), "missing": missing[:20],
            "duplicates": len(seen) - len(set(seen)), "labels_wrong": labels_wrong[:20],
            "shapes_wrong": shapes_wrong[:20], "over_tolerance": over[:20], "over_tolerance_count": len(over),
            "exact": sum(r[4] == 0 for r in sized), "worst_mean_abs_diff": max((r[3] for r in sized), default=0.0),
            "worst_max_abs_diff": max((r[4] for r in sized), default=0),
            "ok": not missing and len(seen) == len(ds) and not labels_wrong and not shapes_wrong and not over}


def train_rate(path: Path, device: str, threads: int, batch: int, seconds: float) -> dict:
    """Images/s of packer.dali's train pipeline (crop, flip, normalise) on ``device``, after one warm-up batch."""
    pipe = packer.dali.pipeline(path, batch, device=device, augment="train", num_threads=threads)  # type: ignore
    n, t0 = 0, None
    while t0 is None or time.perf_counter() - t0 < seconds:
        try:
            out = pipe.run()
        except StopIteration:
            pipe.reset()
            continue
        if t0 is None:
            t0 = time.perf_counter()
        else:
            n += len(out[1])
    if device == "gpu":
        torch.cuda.synchronize()  # every stream of the device: DALI's last batch is done
    return {"device": device, "threads": threads, "batch_size": batch, "images_per_s": n / (time.perf_counter() - t0)}


def dali_parity(path: Path, seconds: float, threads: int, cuda: bool,
                log: Callable[[str], None] = print) -> dict:
    """Parity on each device DALI can use here, then the train rates side by side."""
    import_dali()  # a one-line PackerError when DALI does not import
    devices = ["cpu", "gpu"] if cuda else ["cpu"]
    out: dict = {"tolerance": TOLERANCE, "parity": {}, "train_rate": {}}
    if not cuda:
        out["gpu_skipped"] = "no CUDA device: only DALI's CPU path was checked"
    for device in devices:
        log(f"dali_parity: every sample through packer.dali device={device!r}")
        try:
            out["parity"][device] = parity(path, device, threads)
        except Exception as exc:  # noqa: BLE001 - one device failing never loses the other's figures
            out["parity"][device] = {"device": device, "ok": False, "error": f"{type(exc).__name__}: {exc}"}
    for device in devices:
        log(f"dali_parity: train img/s, device={device!r}, {seconds / (2 * len(devices)):.1f} s")
        try:
            out["train_rate"][device] = train_rate(path, device, threads, 256, seconds / (2 * len(devices)))
        except Exception as exc:  # noqa: BLE001
            out["train_rate"][device] = {"device": device, "error": f"{type(exc).__name__}: {exc}"}
    return out
