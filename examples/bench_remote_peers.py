"""Training from object storage against the loaders users would pick instead, on the same photos, the same emulated
store and the same decode: time to the first batch, images/s, and what each asked of the store.

    python examples/bench_remote_peers.py [--count 2000] [--latency 0.02] [--mbit 1000] [--workers 2] [--batch 64]
        [--shard-size 8MB] [--peers packer,litdata,streaming,objects] [--json out.json]

Synthetic photos (packer's generator, 500x375 JPEGs) are written four ways under one folder, which packer's emulated
store (packer/storage/emulate.py: an S3 subset, --latency seconds before each response's first byte, one link of
--mbit Mbit/s for all connections) serves as bucket ``packer`` from its own process:

- packer: ``convert --to lmdb --shard-size``, read by ``open_dataset("s3://packer/ds.lmdb")`` (its default,
  ranged mode: the lmdb records its payloads' ranges; the node's downloader) with ``BlockShuffleSampler`` and a
  DataLoader;
- LitData: ``litdata.optimize`` (chunks of --shard-size holding the JPEG bytes and the label), read by
  ``litdata.StreamingDataset("s3://packer/litdata", shuffle=True)`` and ``StreamingDataLoader``, the endpoint in
  ``storage_options`` (boto3's ``endpoint_url``);
- MosaicML Streaming: ``MDSWriter`` (shards of --shard-size, uncompressed), read by
  ``StreamingDataset(remote="s3://packer/mds", shuffle=True)`` and a DataLoader, the endpoint in
  ``S3_ENDPOINT_URL``;
- one object per image: the JPEGs as they are, a Dataset doing one obstore GET per sample, uniform shuffle.

Every reader decodes with ``packer.images.decode.decode`` (libjpeg-turbo) into the same CHW uint8 tensor and hands
batches over as lists; every one starts from a new, empty cache directory (one epoch, cold), with --workers
DataLoader worker processes and --batch per batch. The store's own counters (GETs, HEADs, listings, body bytes)
say what each reader asked of it. Ratios are against packer, in this one run. Figures go to the README and
docs/remote.md with this command.

mosaicml-streaming's package ``__init__`` imports its vision and text modules, which need torchvision (not in
packer's environment); the script loads ``streaming.base`` alone, running only Streaming's own code.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shutil
import sys
import tempfile
import time
import types
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset, IterableDataset, RandomSampler

import packer
from packer.diagnose import measure
from packer.diagnose.link import EmulatedLink
from packer.images.decode import decode
from packer.tools.sample import make_sample
from packer.units import parse_bytes

PEERS = ("packer", "litdata", "objects", "streaming")
NAMES = {"packer": "packer lmdb, open_dataset(s3://) + BlockShuffleSampler", "litdata": "LitData StreamingDataset",
         "streaming": "MosaicML Streaming StreamingDataset", "objects": "one object per image (obstore GET each)"}
KEYS = {"aws_access_key_id": "testing", "aws_secret_access_key": "testing"}


def to_tensor(data: bytes | memoryview) -> torch.Tensor:
    """The one decode every reader uses: libjpeg-turbo to HWC uint8, as a CHW tensor (packer's image="tensor")."""
    return torch.from_numpy(decode(data)).permute(2, 0, 1)


START_METHOD = {"name": "fork"}  # run() sets it: how every reader's DataLoader workers start


def workers_kw(workers: int) -> dict[str, Any]:
    """DataLoader's worker keywords, the start method explicit: LitData's ``optimize`` sets the process-wide default
    to spawn, which would otherwise reach every reader measured after it."""
    return {"num_workers": workers, **({"multiprocessing_context": START_METHOD["name"]} if workers else {})}


def list_collate(batch):
    return [b[0] for b in batch], torch.tensor([int(b[1]) for b in batch])


def photos(folder: Path) -> list[tuple[Path, int]]:
    classes = sorted(p.name for p in folder.iterdir() if p.is_dir())
    return [(p, k) for k, c in enumerate(classes) for p in sorted((folder / c).glob("*.jpg"))]


# ------------------------------------------------------------------ writing each peer's layout


def write_packer(folder: Path, root: Path, shard_bytes: int) -> None:
    packer.convert(folder, root / "ds.lmdb", to="lmdb", shard_bytes=shard_bytes, progress=False)


def _litdata_item(item):
    path, label = item
    return {"image": Path(path).read_bytes(), "label": label}


def write_litdata(items: list[tuple[Path, int]], root: Path, shard_bytes: int) -> None:
    from litdata import optimize

    optimize(fn=_litdata_item, inputs=[(str(p), k) for p, k in items], output_dir=str(root / "litdata"),
             chunk_bytes=shard_bytes, num_workers=1, mode="overwrite")


def _streaming_package() -> None:
    """Register mosaicml-streaming's package without running its ``__init__.py`` (which imports torchvision for its
    vision datasets), so that ``streaming.base`` imports; done at import, so spawned DataLoader workers do it too."""
    spec = importlib.util.find_spec("streaming")
    if "streaming" in sys.modules or spec is None or spec.submodule_search_locations is None:
        return
    package = types.ModuleType("streaming")
    package.__path__ = list(spec.submodule_search_locations)
    sys.modules["streaming"] = package


_streaming_package()


def streaming_base() -> types.ModuleType:
    import streaming.base

    return streaming.base


def write_streaming(items: list[tuple[Path, int]], root: Path, shard_bytes: int) -> None:
    base = streaming_base()
    with base.MDSWriter(out=str(root / "mds"), columns={"image": "bytes", "label": "int"},
                        size_limit=shard_bytes) as writer:
        for p, k in items:
            writer.write({"image": p.read_bytes(), "label": k})


def write_objects(items: list[tuple[Path, int]], root: Path) -> None:
    for p, _ in items:
        dest = root / "objects" / p.parent.name / p.name
        dest.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(p, dest)


# ------------------------------------------------------------------ reading: each returns (loader, closer)


def read_packer(link: EmulatedLink, cache: Path, workers: int, batch: int, size: int):
    ds = packer.open_dataset(link.url("ds.lmdb"), cache_dir=cache, cache_limit=2 * size,
                             storage_options=link.storage_options, image="tensor")
    sampler = packer.BlockShuffleSampler(ds, batch_size=batch, seed=0)
    return DataLoader(ds, batch_size=batch, sampler=sampler, collate_fn=list_collate, **workers_kw(workers)), ds.close


def _litdata_decode(item):
    return to_tensor(item["image"]), item["label"]


def litdata_allow_http(_worker: int = 0) -> None:
    """LitData fetches chunks through an obstore S3Store it builds from the boto3 client's endpoint, with client
    options of its own that do not allow http:// ("BadScheme" against any http endpoint, moto's too): add
    ``allow_http`` to them, in the main process and in each DataLoader worker (a spawned worker imports LitData
    anew). Not needed against real S3 (https)."""
    from litdata.streaming import downloader

    downloader._OBSTORE_CLIENT_OPTIONS = {**downloader._OBSTORE_CLIENT_OPTIONS, "allow_http": True}  # type: ignore


def read_litdata(link: EmulatedLink, cache: Path, workers: int, batch: int, size: int):
    from litdata import StreamingDataLoader, StreamingDataset

    litdata_allow_http()
    ds = StreamingDataset("s3://packer/litdata", cache_dir=str(cache), shuffle=True, seed=0,
                          max_cache_size=2 * size, transform=_litdata_decode,
                          storage_options={"endpoint_url": link.endpoint, "region_name": "us-east-1", **KEYS})
    return StreamingDataLoader(ds, batch_size=batch, collate_fn=list_collate, worker_init_fn=litdata_allow_http,
                               **workers_kw(workers)), lambda: None


class StreamingDecoded(IterableDataset):
    """Streaming's dataset (an IterableDataset that partitions by worker itself) with each item decoded."""

    def __init__(self, inner) -> None:
        self.inner = inner

    def __len__(self) -> int:
        return len(self.inner)

    def __iter__(self):
        for item in self.inner:
            yield to_tensor(item["image"]), item["label"]


def read_streaming(link: EmulatedLink, cache: Path, workers: int, batch: int, size: int):
    base = streaming_base()
    from streaming.base.util import clean_stale_shared_memory

    clean_stale_shared_memory()
    os.environ["S3_ENDPOINT_URL"] = link.endpoint  # Streaming's boto3 client: the endpoint and keys from here
    os.environ.update({"AWS_ACCESS_KEY_ID": KEYS["aws_access_key_id"], "AWS_SECRET_ACCESS_KEY":
                       KEYS["aws_secret_access_key"], "AWS_DEFAULT_REGION": "us-east-1"})
    ds = base.StreamingDataset(remote="s3://packer/mds", local=str(cache), shuffle=True, shuffle_seed=0,
                               batch_size=batch, cache_limit=2 * size)
    loader = DataLoader(StreamingDecoded(ds), batch_size=batch, collate_fn=list_collate, **workers_kw(workers))
    return loader, lambda: None


class Objects(Dataset):
    """One GET per sample, through obstore, a store per worker process (made on its first sample)."""

    def __init__(self, endpoint: str, keys: list[tuple[str, int]]) -> None:
        self.endpoint, self.keys, self.pid = endpoint, keys, -1
        self.store: Any = None

    def __len__(self) -> int:
        return len(self.keys)

    def __getitem__(self, i: int):
        import obstore
        from obstore.store import S3Store

        if self.store is None or self.pid != os.getpid():
            self.store = S3Store("packer", endpoint=self.endpoint, region="us-east-1", skip_signature=True,
                                 client_options={"allow_http": True})
            self.pid = os.getpid()
        key, label = self.keys[i]
        return to_tensor(obstore.get(self.store, key).bytes().to_bytes()), label


def read_objects(link: EmulatedLink, cache: Path, workers: int, batch: int, size: int, items=()):
    keys = [(f"objects/{p.parent.name}/{p.name}", k) for p, k in items]
    ds = Objects(link.endpoint, keys)
    sampler = RandomSampler(range(len(ds)), generator=torch.Generator().manual_seed(0))
    return DataLoader(ds, batch_size=batch, sampler=sampler, collate_fn=list_collate, **workers_kw(workers)), \
        lambda: None


# ------------------------------------------------------------------ the run


def epoch(make: Callable[[], tuple[Iterable, Callable[[], None]]]) -> dict:
    """One cold pass from the dataset's construction: seconds to the first batch, images, img/s after it."""
    start = time.perf_counter()
    loader, close = make()
    first, count, after = None, 0, 0
    try:
        for images, _labels in loader:
            if first is None:
                first = time.perf_counter()
            else:
                after += len(images)
            count += len(images)
    finally:
        del loader
        close()
    end = time.perf_counter()
    assert first is not None
    return {"first_batch_s": round(first - start, 3), "images": count, "seconds": round(end - start, 3),
            "img_per_s": round(count / (end - start), 1), "steady_img_per_s": round(after / max(end - first, 1e-9), 1)}


def served(before: dict, after: dict) -> dict:
    return {k: int(after[k] - before[k]) for k in ("requests", "gets", "heads", "lists", "body_bytes")}


def short_error(exc: BaseException) -> str:
    """The exception's type and its last line (a DataLoader worker's error carries the worker's whole traceback,
    whose last line is the cause)."""
    lines = [line for line in str(exc).strip().splitlines() if line.strip()]
    return f"{type(exc).__name__}: {lines[-1].strip() if lines else ''}"[:300]


def run(count: int = 2000, latency: float = 0.02, mbit: float = 1000, workers: int = 2, batch: int = 64,
        shard_size: str = "8MB", peers: Iterable[str] = PEERS, log: Callable[[str], None] = print,
        start_methods: Iterable[str] = ("fork",)) -> dict:
    """Write the photos each peer's way, serve them, and read each once (cold) per start method; ``results``:
    per start method, per peer, with ratios against packer under the same start method."""
    peers, methods = list(peers), list(start_methods)
    shard_bytes = parse_bytes(shard_size)
    with tempfile.TemporaryDirectory(prefix="remote-peers-") as tmp:
        work = Path(tmp)
        make_sample(work / "imgs", count=count, progress=False)
        items = photos(work / "imgs")
        size = sum(p.stat().st_size for p, _ in items)
        root = work / "root"
        root.mkdir()
        writers = {"packer": lambda: write_packer(work / "imgs", root, shard_bytes),
                   "litdata": lambda: write_litdata(items, root, shard_bytes),
                   "streaming": lambda: write_streaming(items, root, shard_bytes),
                   "objects": lambda: write_objects(items, root)}
        readers = {"packer": read_packer, "litdata": read_litdata, "streaming": read_streaming,
                   "objects": lambda *a: read_objects(*a, items=items)}
        for name in peers:
            log(f"writing {name}")
            writers[name]()
        report: dict = {"command": "python examples/bench_remote_peers.py " + " ".join(sys.argv[1:]),
                        "images": len(items), "image_bytes": size, "latency_s": latency, "mbit_s": mbit,
                        "workers": workers, "start_methods": methods, "batch": batch, "shard_size": shard_size,
                        "cores": len(os.sched_getaffinity(0)), "link_img_per_s": round(mbit * 1e6 / 8 / (size / len(
                            items)), 1), "results": {}}
        report["decode_limit_img_per_s"] = round(min(max(workers, 1), report["cores"]) * measure.decode_rate(
            [p.read_bytes() for p, _ in items[:100]], "turbojpeg", seconds=1.0).value, 1)
        with EmulatedLink(root, latency, mbit * 1e6 / 8) as link:
            for method in methods:
                START_METHOD["name"] = method
                results: dict[str, dict[str, Any]] = {}
                for name in peers:
                    cache = work / f"cache-{name}-{method}"
                    cache.mkdir()
                    log(f"reading {name} ({method})")
                    before = link.stats()
                    result: dict[str, Any]
                    try:
                        result = epoch(lambda n=name, c=cache: readers[n](link, c, workers, batch, size))
                    except Exception as exc:  # a peer that cannot read from this store is reported, not hidden
                        result = {"error": short_error(exc)}
                        time.sleep(2)  # what its workers still had in flight ends before the next reader's count
                    result["store"] = served(before, link.stats())
                    result["fetched_per_image_byte"] = round(result["store"]["body_bytes"] / size, 3)
                    results[name] = result
                    log(f"  {json.dumps(result)}")
                    shutil.rmtree(cache, ignore_errors=True)
                base = results.get("packer", {})
                for result in results.values():
                    if "error" not in result and base and "error" not in base:
                        result["img_per_s_vs_packer"] = round(result["img_per_s"] / base["img_per_s"], 2)
                        result["first_batch_vs_packer"] = round(result["first_batch_s"] / base["first_batch_s"], 2)
                report["results"][method] = results
    return report


def markdown(report: dict) -> str:
    lines = [f"| reader ({report['images']:,} photos, {report['latency_s'] * 1e3:g} ms, {report['mbit_s']:g} Mbit/s, "
             f"{report['workers']} workers, cold) | workers start by | first batch (s) | img/s (x packer) | "
             "img/s after the first batch | GETs | bytes fetched / image bytes |", "|---|---|---:|---:|---:|---:|---:|"]
    for method, results in report["results"].items():
        for name, r in results.items():
            if "error" in r:
                lines.append(f"| {NAMES[name]} | {method} | failed: {r['error']} | | | | |")
                continue
            ratio = f" ({r['img_per_s_vs_packer']:.2f}x)" if name != "packer" and "img_per_s_vs_packer" in r else ""
            lines.append(f"| {NAMES[name]} | {method} | {r['first_batch_s']:.2f} | {r['img_per_s']:,.0f}{ratio} | "
                         f"{r['steady_img_per_s']:,.0f} | {r['store']['gets']:,} | "
                         f"{r['fetched_per_image_byte']:.2f} |")
    lines.append(f"| the link's limit ({report['mbit_s']:g} Mbit/s over the mean photo) | | - | "
                 f"{report['link_img_per_s']:,.0f} | - | - | - |")
    cores = min(max(report["workers"], 1), report["cores"])
    limit = report["decode_limit_img_per_s"]
    lines.append(f"| bare libjpeg-turbo x {cores} cores (decode limit) | | - | {limit:,.0f} | - | - | - |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    ap.add_argument("--count", type=int, default=2000)
    ap.add_argument("--latency", type=float, default=0.02)
    ap.add_argument("--mbit", type=float, default=1000)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--shard-size", default="8MB")
    ap.add_argument("--peers", default=",".join(PEERS))
    ap.add_argument("--start-methods", default="fork,spawn",
                    help="how the readers' DataLoader workers start, each in turn (default fork,spawn: Linux's "
                    "default, and the one MosaicML Streaming needs here)")
    ap.add_argument("--json", help="also write the figures here")
    args = ap.parse_args()
    report = run(args.count, args.latency, args.mbit, args.workers, args.batch, args.shard_size,
                 [p for p in args.peers.split(",") if p], log=lambda s: print(s, flush=True),
                 start_methods=[m for m in args.start_methods.split(",") if m])
    print(markdown(report))
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
