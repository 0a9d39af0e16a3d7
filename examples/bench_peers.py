"""packer against the loaders users would pick instead, on the same photos in one run: images/s through each
tool's own loader (2 workers or threads, batch 64), medians of whole epochs including worker start-up.

    python examples/bench_peers.py PHOTOS/ --work /tmp/peers_work --json peers.json --markdown peers.md

PHOTOS is an ImageFolder of JPEGs (``packer sample PHOTOS --count 1500``). Settings: ``full`` decodes every
image whole to RGB uint8; ``train224`` is decode + RandomResizedCrop(224) + horizontal flip into a uint8 batch.
Orders: ``stored`` (file order) and ``training`` (packer's BlockShuffleSampler, FFCV's QUASI_RANDOM, DALI's and
the folder's uniform shuffle). Peers that do not import are skipped (FFCV, LitData, DALI; install recipe in
docs/results.md); a peer that fails is reported with its error, never stops the run.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import time
from collections.abc import Callable, Iterable
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import DataLoader

import packer
from packer.diagnose import measure
from packer.diagnose.bench_sources import FolderSamples, FolderTrain, list_collate
from packer.images.jpegregion import region_decode_available
from packer.write.scan import scan_folder

SETTINGS = ("full", "train224")
ORDERS = ("stored", "training")
Epoch = Callable[[], Iterable[int]]  # one epoch: yields each batch's sample count


# ------------------------------------------------------------------ timing


def _cpu_seconds() -> float:
    """CPU seconds of this process and its finished children (DataLoader workers are joined each epoch)."""
    t = os.times()
    return t.user + t.system + t.children_user + t.children_system


def time_epochs(epoch: Epoch, epochs: int) -> dict:
    """Median images/s over whole epochs (start-up included), the steady rate from the first batch, and images
    per CPU-second (this process and its workers): the figure that a machine shared with other work does not
    bend much (on an idle machine with c cores the rate is at most c times it)."""
    rates, steady, cpu_rates, samples = [], [], [], 0
    for _ in range(epochs):
        t0, c0 = time.perf_counter(), _cpu_seconds()
        first_at, first_n, samples = None, 0, 0
        for n in epoch():
            samples += n
            if first_at is None:
                first_at, first_n = time.perf_counter(), n
        end = time.perf_counter()
        rates.append(samples / (end - t0))
        cpu_rates.append(samples / max(_cpu_seconds() - c0, 1e-9))
        if first_at is not None and samples > first_n:
            steady.append((samples - first_n) / max(end - first_at, 1e-9))
    return {"samples": samples, "images_per_s": statistics.median(rates), "runs": rates,
            "steady_images_per_s": statistics.median(steady) if steady else None,
            "images_per_cpu_s": statistics.median(cpu_rates)}


def _count(loader) -> Iterable[int]:
    for images, _labels in loader:
        yield len(images)


# ------------------------------------------------------------------ packer and the loose folder


def folder_epochs(folder: Path, workers: int, batch: int) -> dict[tuple[str, str], Epoch]:
    scan = scan_folder(folder)
    paths = [str(folder / r) for r in scan.rel_paths]
    labels = [int(v) for v in scan.labels]
    out: dict[tuple[str, str], Epoch] = {}
    for setting, dataset in (("full", FolderSamples(paths, labels)), ("train224", FolderTrain(paths, labels))):
        collate = list_collate if setting == "full" else None
        for order, shuffle in (("stored", False), ("training", True)):
            out[(setting, order)] = lambda d=dataset, c=collate, s=shuffle: _count(
                DataLoader(d, batch_size=batch, shuffle=s, num_workers=workers, collate_fn=c))
    return out


def packer_epochs(path: Path, workers: int, batch: int, threads: bool = False, region: bool = True,
                  settings: Iterable[str] = SETTINGS) -> dict[tuple[str, str], Epoch]:
    """packer through a DataLoader with ``workers`` processes, or (``threads``) a ThreadLoader with as many threads;
    ``region=False``: train224 decodes whole JPEGs, then crops (the path without the compiled region decoder)."""
    out: dict[tuple[str, str], Epoch] = {}

    def loader(d, c, sampler=None):
        if threads:
            return packer.ThreadLoader(d, batch_size=batch, sampler=sampler, num_threads=workers)
        return DataLoader(d, batch_size=batch, sampler=sampler, num_workers=workers, collate_fn=c)

    for setting in settings:
        crop = packer.RandomResizedCropDecode(224, region=region) if setting == "train224" else None
        ds = packer.open_dataset(path, image="tensor", crop=crop)
        collate = list_collate if crop is None else None
        out[(setting, "stored")] = lambda d=ds, c=collate: _count(loader(d, c))

        def training(d=ds, c=collate):
            sampler = packer.BlockShuffleSampler(d, batch_size=batch, seed=0)  # its indices carry their blocks
            yield from _count(loader(d, c, sampler))
        out[(setting, "training")] = training
    return out


# ------------------------------------------------------------------ peers (each skipped when it does not import)


def dali_epochs(folder: Path, workers: int, batch: int) -> dict[tuple[str, str], Epoch]:
    from nvidia.dali import fn, pipeline_def, types

    @pipeline_def(batch_size=batch, num_threads=workers, device_id=None, prefetch_queue_depth=2)
    def pipe(train: bool, shuffle: bool):
        jpegs, labels = fn.readers.file(file_root=str(folder), random_shuffle=shuffle, name="files", seed=0)
        if train:  # DALI's own RandomResizedCrop: area (0.08, 1), aspect (3/4, 4/3)
            images = fn.decoders.image_random_crop(jpegs, device="cpu", output_type=types.RGB,
                                                   random_area=[0.08, 1.0], random_aspect_ratio=[3 / 4, 4 / 3])
            images = fn.resize(images, resize_x=224, resize_y=224)
            images = fn.flip(images, horizontal=fn.random.coin_flip())
        else:
            images = fn.decoders.image(jpegs, device="cpu", output_type=types.RGB)
        return images, labels

    def epoch(train: bool, shuffle: bool) -> Iterable[int]:
        p = pipe(train=train, shuffle=shuffle)
        p.build()
        left = p.epoch_size("files")
        while left > 0:
            images, _labels = p.run()
            if train:
                images.as_tensor()  # one dense uint8 batch, as the others deliver
            n = min(len(images), left)
            left -= n
            yield n

    return {(s, o): (lambda t=s == "train224", sh=o == "training": epoch(t, sh)) for s in SETTINGS for o in ORDERS}


def ffcv_epochs(folder: Path, work: Path, workers: int, batch: int) -> dict[tuple[str, str], Epoch]:
    from ffcv.fields import IntField, RGBImageField
    from ffcv.fields.decoders import CenterCropRGBImageDecoder, IntDecoder, RandomResizedCropRGBImageDecoder
    from ffcv.loader import Loader, OrderOption
    from ffcv.transforms import RandomHorizontalFlip, Squeeze, ToTensor, ToTorchImage
    from ffcv.writer import DatasetWriter

    beton = work / "photos.beton"
    if not beton.exists():
        scan = scan_folder(folder)
        from PIL import Image

        class Items(torch.utils.data.Dataset):
            def __len__(self):
                return len(scan.rel_paths)

            def __getitem__(self, i):
                return Image.open(folder / scan.rel_paths[i]).convert("RGB"), int(scan.labels[i])

        DatasetWriter(str(beton), {"image": RGBImageField(write_mode="jpg", jpeg_quality=90), "label": IntField()},
                      num_workers=workers).from_indexed_dataset(Items())

    loaders: dict = {}  # one Loader per setting, iterated each epoch, as FFCV is used (it compiles per Loader)

    def epoch(train: bool, order) -> Iterable[int]:
        if (train, order) not in loaders:
            loaders[(train, order)] = make_loader(train, order)
        yield from _count(loaders[(train, order)])

    def make_loader(train: bool, order):
        # FFCV has no whole-image decode of mixed sizes: "full" is its 384 centre crop
        decoder = RandomResizedCropRGBImageDecoder((224, 224)) if train else CenterCropRGBImageDecoder((384, 384), 1.0)
        image = [decoder, RandomHorizontalFlip()] if train else [decoder]
        return Loader(str(beton), batch_size=batch, num_workers=workers, order=order, os_cache=True, seed=0,
                      drop_last=False,
                      pipelines={"image": [*image, ToTensor(), ToTorchImage()],
                                 "label": [IntDecoder(), ToTensor(), Squeeze()]})

    orders = {"stored": OrderOption.SEQUENTIAL, "training": OrderOption.QUASI_RANDOM}
    return {(s, o): (lambda t=s == "train224", od=orders[o]: epoch(t, od)) for s in SETTINGS for o in ORDERS}


def litdata_epochs(folder: Path, work: Path, workers: int, batch: int) -> dict[tuple[str, str], Epoch]:
    from litdata import StreamingDataLoader, StreamingDataset, optimize

    out_dir = work / "photos.litdata"
    scan = scan_folder(folder)
    if not out_dir.exists():
        items = [(str(folder / r), int(v)) for r, v in zip(scan.rel_paths, scan.labels, strict=True)]
        optimize(fn=_litdata_item, inputs=items, output_dir=str(out_dir), chunk_bytes="64MB", num_workers=1)

    def epoch(shuffle: bool) -> Iterable[int]:
        ds = StreamingDataset(str(out_dir), shuffle=shuffle, seed=0)
        yield from _count(StreamingDataLoader(ds, batch_size=batch, num_workers=workers, collate_fn=_litdata_collate))

    return {("full", o): (lambda sh=o == "training": epoch(sh)) for o in ORDERS}


def _litdata_item(item):
    path, label = item
    return {"image": Path(path).read_bytes(), "label": label}


def _litdata_collate(items):
    from packer.images.decode import decode

    return [torch.from_numpy(decode(it["image"])).permute(2, 0, 1) for it in items], [it["label"] for it in items]


# ------------------------------------------------------------------ the run


def decode_limit(folder: Path, cores: int) -> float:
    """Bare libjpeg-turbo images/s on one core times ``cores``: the full-decode ceiling."""
    return cores * measure.decode_rate(measure.load_samples(folder, 100), "turbojpeg", seconds=1.0).value


def run(folder: Path, work: Path, epochs: int = 3, workers: int = 2, batch: int = 64,
        peers: Iterable[str] = ("dali", "ffcv", "litdata"), log: Callable[[str], None] = print,
        warmup: bool = True, settings: Iterable[str] = SETTINGS, orders: Iterable[str] = ORDERS) -> dict:
    """Every tool's ``settings`` in ``orders`` on ``folder`` (packed copies made under ``work`` once); the report."""
    work.mkdir(parents=True, exist_ok=True)
    settings, orders = tuple(settings), tuple(orders)
    tools: dict[str, Callable[[], dict]] = {"loose folder + Pillow": lambda: folder_epochs(folder, workers, batch)}
    for fmt in ("memmap", "lmdb"):
        out = work / f"photos.{fmt}"
        if not out.exists():
            packer.convert(folder, out, to=fmt, progress=False)
        tools[f"packer {fmt}"] = lambda o=out: packer_epochs(o, workers, batch)
        tools[f"packer {fmt}, ThreadLoader"] = lambda o=out: packer_epochs(o, workers, batch, threads=True)
        if fmt == "memmap":  # the fused crop without the region decoder: what it gains, in the same run
            tools["packer memmap, whole decode then crop"] = lambda o=out: packer_epochs(
                o, workers, batch, region=False, settings=("train224",))
    if region_decode_available():  # convert --jpeg-restarts: a crop decodes only its own MCUs (docs/decoding.md)
        out = work / "photos-restarts.lmdb"
        if not out.exists():
            packer.convert(folder, out, to="lmdb", jpeg_restarts=True, progress=False)
        tools["packer lmdb --jpeg-restarts, ThreadLoader"] = lambda o=out: packer_epochs(o, workers, batch,
                                                                                         threads=True)
    makers = {"dali": ("NVIDIA DALI CPU", lambda: dali_epochs(folder, workers, batch)),
              "ffcv": ("FFCV", lambda: ffcv_epochs(folder, work, workers, batch)),
              "litdata": ("LitData", lambda: litdata_epochs(folder, work, workers, batch))}
    report: dict = {"folder": str(folder), "epochs": epochs, "workers": workers, "batch_size": batch,
                    "cores": len(os.sched_getaffinity(0)), "rows": {}, "skipped": {}}
    report["decode_limit_images_per_s"] = decode_limit(folder, min(workers, report["cores"]))
    for name in peers:
        label, make = makers[name]
        tools[label] = make
    for label, make in tools.items():
        try:
            make_settings = make()
        except ImportError as exc:
            report["skipped"][label] = f"does not import: {exc}"
            log(f"{label}: skipped ({exc})")
            continue
        except Exception as exc:  # a peer's own failure: reported, the run goes on
            report["skipped"][label] = f"failed to set up: {type(exc).__name__}: {exc}"
            log(f"{label}: failed to set up ({type(exc).__name__}: {exc})")
            continue
        row = report["rows"].setdefault(label, {})
        for (setting, order), epoch in make_settings.items():
            if setting not in settings or order not in orders:
                continue
            try:
                if warmup:
                    next(iter(epoch()), None)  # imports, JIT, page cache
                row[f"{setting}/{order}"] = r = time_epochs(epoch, epochs)
                log(f"{label:<24} {setting:<8} {order:<8} {r['images_per_s']:8,.0f} img/s "
                    f"{r['images_per_cpu_s']:8,.0f} img/CPU-s")
            except Exception as exc:
                row[f"{setting}/{order}"] = {"error": f"{type(exc).__name__}: {exc}"}
                log(f"{label:<24} {setting:<8} {order:<8} failed: {type(exc).__name__}: {exc}")
    return report


def markdown(report: dict) -> str:
    cols = [(s, o) for s in SETTINGS for o in ORDERS]
    head = " | ".join(f"{s}, {o} order" for s, o in cols)
    lines = [f"| images/s (median of {report['epochs']} epochs; steady from the first batch) | {head} |",
             "|---|" + "---:|" * len(cols)]
    best = {c: max((r.get(f"{c[0]}/{c[1]}", {}).get("images_per_s") or 0) for r in report["rows"].values())
            for c in cols}
    for label, row in report["rows"].items():
        cells = []
        for c in cols:
            r = row.get(f"{c[0]}/{c[1]}")
            if r is None:
                cells.append("-")
            elif "error" in r:
                cells.append("failed")
            else:
                v = f"{r['images_per_s']:,.0f}" + (f" ({r['steady_images_per_s']:,.0f})" if r["steady_images_per_s"]
                                                   else "")
                cells.append(f"**{v}**" if math.isclose(r["images_per_s"], best[c]) else v)
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    lines.append(f"| bare libjpeg-turbo x {min(report['workers'], report['cores'])} cores (decode limit) | "
                 + " | ".join(f"{report['decode_limit_images_per_s']:,.0f}" if s == "full" else "-" for s, _ in cols)
                 + " |")
    lines += ["", f"| images per CPU-second (this process and its workers) | {head} |", "|---|" + "---:|" * len(cols)]
    for label, row in report["rows"].items():
        cells = [f"{row[k]['images_per_cpu_s']:,.0f}" if "images_per_cpu_s" in row.get(k, {}) else "-"
                 for k in (f"{s}/{o}" for s, o in cols)]
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    for label, why in report["skipped"].items():
        lines.append(f"\n{label}: {why}")
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("folder", type=Path)
    ap.add_argument("--work", type=Path, default=Path("peers_work"), help="where the packed copies go")
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--peers", default="dali,ffcv,litdata")
    ap.add_argument("--settings", default=",".join(SETTINGS), help="any of " + ", ".join(SETTINGS))
    ap.add_argument("--orders", default=",".join(ORDERS), help="any of " + ", ".join(ORDERS))
    ap.add_argument("--json", type=Path)
    ap.add_argument("--markdown", type=Path)
    a = ap.parse_args()
    torch.set_num_threads(1)
    np.seterr(all="ignore")
    report = run(a.folder, a.work, a.epochs, a.workers, a.batch_size, [p for p in a.peers.split(",") if p],
                 settings=a.settings.split(","), orders=a.orders.split(","))
    table = markdown(report)
    print(table)
    if a.json:
        a.json.write_text(json.dumps(report, indent=1))
    if a.markdown:
        a.markdown.write_text(table)


if __name__ == "__main__":
    main()
