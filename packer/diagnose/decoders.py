"""``packer bench --decoders``: images/s and megapixels/s per core of each decoder, full size and downscaled.

Everything runs in this one process on in-memory bytes, so the figures are per core and free of
IO; rates come from CPU time (``measure.decode_rate`` with the ``cpu`` clock), wall time is
reported too. ``measure_overhead`` compares ``open_dataset(..., image="numpy")`` with bare
libjpeg-turbo on the same bytes: packer's per-sample overhead. Figures: docs/decoding.md.
"""

from __future__ import annotations

import os
import platform
import sys
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TextIO

import numpy as np

from packer._version import __version__
from packer.diagnose.measure import available_backends, decode_rate, decoder, load_samples, timed
from packer.errors import PackerError
from packer.images.decode import TURBO_SAFE_COLORSPACES, scale_denominator, turbojpeg_available, turbojpeg_handle
from packer.images.magic import sniff


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
    pil = decoder("pil")
    mean_src_px = float(np.mean([np.prod(pil(d).shape[:2]) for d in samples]))  # true sizes; validates too
    results = []
    for backend in backends:
        fn = decoder(backend)
        for size in sizes:
            out_hw = np.array([fn(d, size).shape[:2] for d in samples], dtype=np.float64)  # warm-up, output sizes
            r = decode_rate(samples, backend, min_size=size, seconds=seconds, repeats=1, clock="cpu")
            t = r.timings[0]
            results.append({
                "backend": backend,
                "decode_size": size,
                "images": int(t.items),
                "cpu_s": round(t.cpu_s, 4),
                "wall_s": round(t.wall_s, 4),
                "img_per_s": r.value,
                "src_mp_per_s": r.value * mean_src_px / 1e6,
                "out_mp_per_s": r.value * float(np.mean(out_hw[:, 0] * out_hw[:, 1])) / 1e6,
                "mean_out_hw": [float(out_hw[:, 0].mean()), float(out_hw[:, 1].mean())],
            })
    return results


def _shape_only(arr: np.ndarray) -> tuple:
    """Stand-in transform: drops the decoded array at once, as a crop/resize transform would, at no cost."""
    return arr.shape


def _turbo_jpegs(ds, tj, limit: int) -> list[int]:
    """The first ``limit`` samples stored that libjpeg-turbo decodes itself (JPEG, not CMYK/YCCK): the same bytes
    both ways; as sample indices."""
    keep: list[int] = []
    for pos in range(len(ds)):
        if len(keep) >= limit:
            break
        d = ds.payload_at(pos)
        if sniff(d) == "jpeg" and tj.decode_header(d)[3] in TURBO_SAFE_COLORSPACES:
            keep.append(ds.index_map.public(pos))
    return keep


def _bare_decoder(tj, decode_size: int | None) -> Callable[[bytes], np.ndarray]:
    """``TurboJPEG.decode(bytes, RGB)``, at packer's scale for ``decode_size``."""
    from turbojpeg import TJPF_RGB

    def decode_bare(d: bytes) -> np.ndarray:
        if decode_size:
            w, h = tj.decode_header(d)[:2]
            den = scale_denominator(h, w, decode_size)
            return tj.decode(d, pixel_format=TJPF_RGB, scaling_factor=(1, den) if den > 1 else None)
        return tj.decode(d, pixel_format=TJPF_RGB)

    return decode_bare


def _interleaved_rates(fns: dict[str, Callable[[], int]], repeats: int, seconds: float) -> dict[str, list[float]]:
    """Items/s of CPU time of each pass function, alternated in ``repeats`` rounds so drift hits all alike."""
    for fn in fns.values():  # warm-up: page cache, LMDB map, allocator
        fn()
    rates: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            t = timed(fn, seconds / len(fns), clock="cpu")
            rates[name].append(t.items / t.cpu_s)
    return rates


def measure_overhead(dataset: str | os.PathLike, limit: int = 200, batch_size: int = 32,
                     seconds: float = 2.0, repeats: int = 3, decode_size: int | None = None) -> dict:
    """Packer's per-sample overhead: ``open_dataset`` (auto decoder) vs bare libjpeg-turbo, same bytes.

    Alternates the variants in ``repeats`` rounds (so drift hits all) and compares median rates:
    ``bare``: ``TurboJPEG.decode(bytes, RGB)`` over the payloads held in memory, each result dropped;
    ``packer``: ``ds.__getitems__(batch)`` (what DataLoader calls), ``image="numpy"``, with a
    transform that drops the array as a training crop would (the memory pattern of training);
    ``packer_item``: ``ds[i]`` one at a time, same transform;
    ``bare_held`` / ``packer_held``: full-size arrays kept until the batch is done (no transform).
    ``ratio`` = packer / bare (1.0: no overhead); ``ratio_held`` = packer_held / bare_held.
    """
    from packer.read.dataset import open_dataset

    tj = turbojpeg_handle()
    if tj is None:
        raise PackerError("libturbojpeg is not available: nothing to compare packer's decoding against")
    ds = open_dataset(dataset, image="numpy", decoder="auto", decode_size=decode_size, transform=_shape_only)
    held_ds = open_dataset(dataset, image="numpy", decoder="auto", decode_size=decode_size)
    try:
        if ds.manifest.payload != "encoded":
            raise PackerError(f"{dataset}: payload {ds.manifest.payload!r} holds no encoded images to decode")
        keep = _turbo_jpegs(ds, tj, limit)
        if not keep:
            raise PackerError(f"{dataset}: no JPEG that libjpeg-turbo decodes among its samples")
        n, data = len(keep), [bytes(ds.read_payload(i)) for i in keep]
        batches = [keep[s:s + batch_size] for s in range(0, n, batch_size)]
        decode_bare = _bare_decoder(tj, decode_size)

        def bare() -> int:
            for d in data:
                decode_bare(d)
            return n

        def bare_held() -> int:
            for s in range(0, n, batch_size):
                held = [decode_bare(d) for d in data[s:s + batch_size]]
                del held
            return n

        def packer_batch(ds=ds) -> int:
            for b in batches:
                ds.__getitems__(b)
            return n

        def packer_item() -> int:
            for i in keep:
                ds[i]
            return n

        rates = _interleaved_rates({"bare": bare, "packer": packer_batch, "packer_item": packer_item,
                                    "bare_held": bare_held, "packer_held": lambda: packer_batch(held_ds)},
                                   repeats, seconds)
    finally:
        ds.close()
        held_ds.close()
    med = {k: float(np.median(v)) for k, v in rates.items()}
    return {
        "dataset": str(dataset), "samples": n, "batch_size": batch_size, "decode_size": decode_size,
        "repeats": repeats, "img_per_s": med, "all_img_per_s": rates,
        "ratio": med["packer"] / med["bare"], "ratio_item": med["packer_item"] / med["bare"],
        "ratio_held": med["packer_held"] / med["bare_held"],
    }


def bench_decoders(path: str | os.PathLike | None, sizes: Sequence[int | None] = (None, 224),
                   backends: Sequence[str] | None = None, limit: int = 200, seconds: float = 2.0,
                   batch_size: int = 32, out: TextIO = sys.stdout) -> dict:
    """``packer bench --decoders``: each decoder's per-core rates on up to ``limit`` images of ``path`` (a dataset or
    a folder; None: photo-like JPEGs generated for the run), and packer's decode overhead where ``path`` is a packed
    dataset and libjpeg-turbo loads; what it does and the tables are written to ``out``. Returns the JSON document
    (``--json``)."""
    with tempfile.TemporaryDirectory(prefix="packer-bench-") as tmp:
        source = path
        if source is None:
            from packer.tools.sample import make_sample

            source = f"{tmp}/imgs"
            print(f"no DATASET|FOLDER given: generating {limit} photo-like JPEGs (about 500x375, q90)", file=out)
            make_sample(source, count=limit, classes=1, progress=False)
        samples = load_samples(source, limit=limit)
        mean_kb = sum(map(len, samples)) / len(samples) / 1e3
        print(f"{len(samples)} images from {source} (mean {mean_kb:.0f} KB); one process, rates per core from CPU "
              "time", file=out)
        results = measure_decoders(samples, backends=backends, sizes=sizes, seconds=seconds)
        print(decoder_table(results), file=out)
        overhead = None
        if (Path(source) / "manifest.json").exists() and turbojpeg_available():
            overhead = measure_overhead(source, limit=limit, batch_size=batch_size, seconds=seconds * 2)
            r = overhead["img_per_s"]
            print(f"open_dataset(image='numpy', decoder='auto') vs bare libjpeg-turbo on the same "
                  f"{overhead['samples']} JPEGs, batches of {batch_size} via __getitems__: "
                  f"{r['packer']:.0f} vs {r['bare']:.0f} img/s "
                  f"= {overhead['ratio']:.0%} (one sample at a time {overhead['ratio_item']:.0%}; "
                  f"holding full-size arrays per batch {r['packer_held']:.0f} vs {r['bare_held']:.0f} "
                  f"= {overhead['ratio_held']:.0%})", file=out)
    return {"packer": __version__, "python": platform.python_version(), "machine": platform.machine(),
            "cpu_count": os.cpu_count(), "path": None if path is None else os.fspath(path), "samples": len(samples),
            "decoders": results, "overhead": overhead}


def decoder_table(results: list[dict]) -> str:
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
