"""Decoder benchmark: images/s and megapixels/s per core for each backend, full size and downscaled.

Everything runs in this one process on in-memory bytes, so the figures are per core and free
of IO. Rates come from the process's CPU time (user + system, page faults included), which
other processes on a shared machine disturb far less than wall time; wall time is reported too.

``measure_overhead`` answers issue 5's target: the rate of the ``auto`` decoder through
``open_dataset(..., image="numpy")`` (LMDB read, decode, label, batch as a DataLoader asks for
it) as a fraction of bare libjpeg-turbo decoding of the same bytes in the same run.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np

from packer.decode import (
    TURBO_SAFE_COLORSPACES,
    decode,
    scale_denominator,
    scaled_shape,
    sniff,
    turbojpeg_handle,
)
from packer.errors import PackerError

# Bench-only extra: measured when importable, never a dependency (see the report on simplejpeg).
OPTIONAL_BACKENDS = ("simplejpeg",)


def _simplejpeg_decoder() -> Callable | None:
    try:
        import simplejpeg
    except ImportError:
        return None

    def run(data: bytes, min_size: int | None) -> np.ndarray:
        if not min_size:
            return simplejpeg.decode_jpeg(data, colorspace="rgb")
        h, w = simplejpeg.decode_jpeg_header(data)[:2]
        th, tw = scaled_shape(h, w, min_size)  # the smallest scale giving >= this is packer's own scale
        return simplejpeg.decode_jpeg(data, colorspace="rgb", min_height=th, min_width=tw)

    return run


def available_backends(include_optional: bool = True) -> list[str]:
    """Backends that work here: ``turbojpeg`` (if libturbojpeg loads), ``pil``, optional extras."""
    names = (["turbojpeg"] if turbojpeg_handle() is not None else []) + ["pil"]
    if include_optional and _simplejpeg_decoder() is not None:
        names.append("simplejpeg")
    return names


def _decoder(backend: str) -> Callable[[bytes, int | None], np.ndarray]:
    if backend in ("auto", "turbojpeg", "pil"):
        return lambda data, min_size: decode(data, backend, strict=False, min_size=min_size)
    if backend == "simplejpeg":
        fn = _simplejpeg_decoder()
        if fn is not None:
            return fn
    raise PackerError(f"decoder {backend!r} is not available here (available: {', '.join(available_backends())})")


def _timed_passes(fn: Callable[[], int], seconds: float, min_passes: int = 1) -> tuple[int, float, float]:
    """Call ``fn`` (one pass, returns items done) until ``seconds`` of CPU time; (items, cpu_s, wall_s)."""
    items, c0, w0 = 0, time.process_time(), time.perf_counter()
    passes = 0
    while passes < min_passes or time.process_time() - c0 < seconds:
        items += fn()
        passes += 1
    return items, time.process_time() - c0, time.perf_counter() - w0


def measure_decoders(
    samples: Sequence[bytes],
    backends: Sequence[str] | None = None,
    sizes: Sequence[int | None] = (None, 224),
    seconds: float = 2.0,
) -> list[dict]:
    """Decode ``samples`` repeatedly with each backend at each decode size; one dict per pair.

    Each dict: backend, decode_size (None = full), images, cpu_s, wall_s, img_per_s (per core,
    from CPU time), src_mp_per_s (source megapixels decoded per second), out_mp_per_s (output
    megapixels per second), mean_out_hw. A warm-up pass precedes each measurement.
    """
    if not samples:
        raise PackerError("no samples to benchmark")
    if not 0 < seconds < float("inf") or any(s is not None and s < 1 for s in sizes):
        raise PackerError(f"seconds {seconds!r} must be positive and decode sizes {list(sizes)} 'full' or >= 1")
    backends = list(backends) if backends is not None else available_backends()
    src_px = []
    for data in samples:
        h, w = decode(data, "pil").shape[:2]  # true size; reference decode doubles as validation
        src_px.append(h * w)
    mean_src_px = float(np.mean(src_px))
    results = []
    for backend in backends:
        fn = _decoder(backend)
        for size in sizes:
            out_px = [fn(d, size).shape[:2] for d in samples]  # warm-up, and the output sizes

            def one_pass(fn=fn, size=size) -> int:
                for d in samples:
                    fn(d, size)
                return len(samples)

            n, cpu, wall = _timed_passes(one_pass, seconds)
            rate = n / cpu
            results.append({
                "backend": backend,
                "decode_size": size,
                "images": n,
                "cpu_s": round(cpu, 4),
                "wall_s": round(wall, 4),
                "img_per_s": rate,
                "src_mp_per_s": rate * mean_src_px / 1e6,
                "out_mp_per_s": rate * float(np.mean([h * w for h, w in out_px])) / 1e6,
                "mean_out_hw": [float(np.mean([h for h, _ in out_px])), float(np.mean([w for _, w in out_px]))],
            })
    return results


def _shape_only(arr: np.ndarray) -> tuple:
    """Stand-in transform: drops the decoded array at once, as a crop/resize transform would, at no cost."""
    return arr.shape


def measure_overhead(dataset: str | os.PathLike, limit: int = 200, batch_size: int = 32,
                     seconds: float = 2.0, repeats: int = 3, decode_size: int | None = None) -> dict:
    """Packer's per-sample overhead: ``open_dataset`` (auto decoder) vs bare libjpeg-turbo, same bytes.

    Alternates the variants in ``repeats`` rounds (so drift hits all) and compares median rates:
    ``bare``: ``TurboJPEG.decode(bytes, RGB)`` over the payloads held in memory, each result dropped;
    ``packer``: ``ds.__getitems__(batch)`` (what DataLoader calls), ``image="numpy"``, with a
    transform that drops the array as a training crop would (the memory pattern of training);
    ``packer_item``: ``ds[i]`` one at a time, same transform;
    ``bare_held`` / ``packer_held``: full-size arrays kept until the batch is done (no transform).
    ``ratio`` = packer / bare (issue 5's target: >= 0.90); ``ratio_held`` = packer_held / bare_held.
    """
    from packer.datasets import open_dataset

    tj = turbojpeg_handle()
    if tj is None:
        raise PackerError("libturbojpeg is not available: nothing to compare packer's decoding against")
    ds = open_dataset(dataset, image="numpy", decoder="auto", decode_size=decode_size, transform=_shape_only)
    held_ds = open_dataset(dataset, image="numpy", decoder="auto", decode_size=decode_size)
    if ds.manifest.payload != "encoded":
        raise PackerError(f"{dataset}: payload {ds.manifest.payload!r} holds no encoded images to decode")
    # The first ``limit`` samples that libjpeg-turbo decodes itself (JPEG, not CMYK/YCCK): the same bytes both ways.
    keep: list[int] = []
    for i in range(len(ds)):
        if len(keep) >= limit:
            break
        d = ds.read_payload(i)
        if sniff(d) == "jpeg" and tj.decode_header(d)[3] in TURBO_SAFE_COLORSPACES:
            keep.append(i)
    if not keep:
        raise PackerError(f"{dataset}: no JPEG that libjpeg-turbo decodes among its samples")
    n = len(keep)
    data = [bytes(ds.read_payload(i)) for i in keep]
    batches = [keep[s:s + batch_size] for s in range(0, n, batch_size)]
    from turbojpeg import TJPF_RGB

    def decode_bare(d: bytes) -> np.ndarray:
        if decode_size:
            w, h = tj.decode_header(d)[:2]
            den = scale_denominator(h, w, decode_size)
            return tj.decode(d, pixel_format=TJPF_RGB, scaling_factor=(1, den) if den > 1 else None)
        return tj.decode(d, pixel_format=TJPF_RGB)

    def bare() -> int:
        for d in data:
            decode_bare(d)
        return n

    def bare_held() -> int:
        for s in range(0, n, batch_size):
            held = [decode_bare(d) for d in data[s:s + batch_size]]
            del held
        return n

    def packer_batch() -> int:
        for b in batches:
            ds.__getitems__(b)
        return n

    def packer_held() -> int:
        for b in batches:
            held_ds.__getitems__(b)
        return n

    def packer_item() -> int:
        for i in keep:
            ds[i]
        return n

    fns = {"bare": bare, "packer": packer_batch, "packer_item": packer_item,
           "bare_held": bare_held, "packer_held": packer_held}
    for fn in fns.values():  # warm-up: page cache, LMDB map, allocator
        fn()
    rates: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            items, cpu, _wall = _timed_passes(fn, seconds / len(fns))
            rates[name].append(items / cpu)
    med = {k: float(np.median(v)) for k, v in rates.items()}
    ds.close()
    held_ds.close()
    return {
        "dataset": str(dataset), "samples": n, "batch_size": batch_size, "decode_size": decode_size,
        "repeats": repeats, "img_per_s": med, "all_img_per_s": rates,
        "ratio": med["packer"] / med["bare"], "ratio_item": med["packer_item"] / med["bare"],
        "ratio_held": med["packer_held"] / med["bare_held"],
    }


def load_samples(path: str | os.PathLike, limit: int = 200) -> list[bytes]:
    """Up to ``limit`` encoded images from a packed dataset (encoded payload) or a folder of images.

    Spread evenly over the dataset so every class is represented.
    """
    p = Path(path)
    if (p / "manifest.json").exists():
        from packer.datasets import open_dataset

        ds = open_dataset(p)
        if ds.manifest.payload != "encoded":
            raise PackerError(f"{p}: payload {ds.manifest.payload!r} holds decoded pixels; decoders need encoded images")
        picks = np.unique(np.linspace(0, len(ds) - 1, min(limit, len(ds))).astype(np.int64))
        out = [bytes(b) for b in ds.read_payloads(picks.tolist())]
        ds.close()
        return out
    if p.is_dir():
        from packer.scan import scan_folder

        scan = scan_folder(p)
        picks = np.unique(np.linspace(0, len(scan) - 1, min(limit, len(scan))).astype(np.int64))
        return [(p / scan.rel_paths[i]).read_bytes() for i in picks.tolist()]
    raise PackerError(f"{p}: neither a packed dataset nor a folder of images")


def format_table(results: list[dict]) -> str:
    """The results as an aligned text table, with each row's speed-up over Pillow at full size."""
    base = next((r["img_per_s"] for r in results if r["backend"] == "pil" and r["decode_size"] is None), None)
    lines = [f"{'backend':<11} {'decode size':>11} {'out HxW':>9} {'img/s/core':>10} {'src MP/s':>9} "
             f"{'out MP/s':>9} {'vs pil':>7}"]
    for r in results:
        hw = f"{r['mean_out_hw'][0]:.0f}x{r['mean_out_hw'][1]:.0f}"
        size = "full" if r["decode_size"] is None else f">={r['decode_size']}"
        rel = f"{r['img_per_s'] / base:.2f}x" if base else "-"
        lines.append(f"{r['backend']:<11} {size:>11} {hw:>9} {r['img_per_s']:>10.0f} {r['src_mp_per_s']:>9.1f} "
                     f"{r['out_mp_per_s']:>9.1f} {rel:>7}")
    return "\n".join(lines)
