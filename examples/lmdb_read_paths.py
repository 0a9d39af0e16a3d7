"""LMDB read paths: packer's own reader (header and B-tree read with pread, values as views of its own map, where
the spans file says) against py-lmdb (``txn.get`` in one long read transaction) on the same shard.

    packer sample imgs/ --count 2000 && packer convert imgs/ --to lmdb -o imgs.lmdb
    python examples/lmdb_read_paths.py imgs.lmdb --repeats 5

Paths, each timed as the median of ``--repeats`` (warm page cache unless said; one process, one thread):

- ``single``: one value at a time, in a uniform shuffled order: the reader alone (``Reader.read``, py-lmdb
  ``txn.get`` copying, and with ``buffers=True``: a view valid only inside the transaction, for reference) and
  through the dataset (``ds.read_payload``, size checks and the index map included);
- ``batch``: batches of ``--batch-size`` shuffled indices: ``Reader.read_many`` against py-lmdb's
  ``Cursor.getmulti`` and a ``txn.get`` loop; ``ds.read_payloads`` (read-ahead spans planned, page cache asked);
- ``cold batch``: ``ds.read_payloads`` over every batch, every byte then read (crc32, as a decoder reads it),
  after evicting the shards from the page cache: packer's read-ahead thread reads the spans of a batch in file
  order; py-lmdb has no spans, its values fault in one by one (the same crc32 on warm batches for comparison);
- ``ThreadLoader``: one epoch of decoded batches (``ThreadLoader(ds, batch_size, num_threads=2)``, decode
  included) with each reader;
- ``open``: opening a shard and reading one value: packer's ``Reader`` (header, spans file checked against the
  B-tree, map) against py-lmdb's ``lmdb.open`` and first ``txn.get``.

The py-lmdb reader is swapped into the same dataset (``ds.store.readers``), so both go through the same checks.
"""

from __future__ import annotations

import argparse
import statistics
import time
import zlib
from collections.abc import Callable
from pathlib import Path

import lmdb
import numpy as np

from packer import ThreadLoader, open_dataset
from packer.diagnose.measure import evict, tree_files
from packer.formats import get_format
from packer.formats.base import ShardReader
from packer.formats.lmdb.values import key
from packer.perprocess import PerProcess


class PyLmdbReader(ShardReader):
    """A shard read through py-lmdb: one read-only environment and one long read transaction per process (py-lmdb
    opens a file once per process: close one reader before another opens the same shard)."""

    def __init__(self, path: Path, count: int) -> None:
        self.path, self.count = path, count
        self._txn: PerProcess = PerProcess()

    def __len__(self) -> int:
        return self.count

    def _open(self):
        env = lmdb.open(str(self.path), subdir=False, readonly=True, lock=False, readahead=True, max_dbs=0)
        return env, env.begin(), env.begin(buffers=True)

    def read(self, pos: int):
        return self._txn.get(self._open)[1].get(key(pos))

    def view(self, pos: int):
        return self._txn.get(self._open)[2].get(key(pos))

    def read_many(self, positions: list[int]) -> list:
        txn = self._txn.get(self._open)[1]
        return [txn.get(key(p)) for p in positions]

    def getmulti(self, positions: list[int]) -> list:
        with self._txn.get(self._open)[1].cursor() as cur:
            return [v for _k, v in cur.getmulti([key(p) for p in positions])]

    def close(self) -> None:
        self._txn.close(lambda h: (h[1].abort(), h[2].abort(), h[0].close()))


def compare(fns: dict[str, Callable[[], object]], repeats: int) -> dict[str, float]:
    """Seconds of each call, the median of ``repeats``, the calls taking turns (a drift in the machine's load
    then moves every median alike): each called once first, untimed."""
    times: dict[str, list[float]] = {name: [] for name in fns}
    for fn in fns.values():
        fn()
    for _ in range(repeats):
        for name, fn in fns.items():
            t = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t)
    return {name: statistics.median(ts) for name, ts in times.items()}


def with_readers(path: str, readers: list | None = None, **kw):
    """The dataset, its shards read by packer's readers, or by ``readers`` (py-lmdb's) where given."""
    ds = open_dataset(path, **kw)
    if readers is not None:
        ds.store.readers = readers
    return ds


def consumed(ds, batches: list[list[int]]) -> None:
    """``ds.read_payloads`` of each batch, every byte then read (crc32), as a decoder would: a view is handed out
    before its pages are in memory, a copy only after."""
    for b in batches:
        for p in ds.read_payloads(b):
            zlib.crc32(p)


def cold_pass(ds, batches: list[list[int]], files: list[str]) -> tuple[float, bool]:
    """Seconds of ``consumed`` after evicting ``files`` (the readers opened before)."""
    ds.read_payloads(batches[0][:1])
    gone = evict(files)
    t = time.perf_counter()
    consumed(ds, batches)
    return time.perf_counter() - t, bool(gone.verified)


def report(title: str, rows: dict[str, float], per: int, unit: str = "us/sample", scale: float = 1e6) -> None:
    print(title)
    for name, seconds in rows.items():
        print(f"  {name:<48} {seconds / per * scale:>9.2f} {unit}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("dataset")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--batch-size", type=int, default=64)
    args = ap.parse_args()
    mine = open_dataset(args.dataset)
    shards = mine.manifest.shards
    theirs_readers = [PyLmdbReader(mine.root / s.files[0].name, s.num_samples) for s in shards]
    theirs = with_readers(args.dataset, theirs_readers)
    n, count = len(mine), shards[0].num_samples
    order = np.random.default_rng(0).permutation(count).tolist()  # shard 0's samples, shuffled
    batches = [order[k:k + args.batch_size] for k in range(0, count, args.batch_size)]
    public = mine.index_map.public_many(np.asarray(order)).tolist()
    public_batches = [mine.index_map.public_many(np.asarray(b)).tolist() for b in batches]
    print(f"{args.dataset}: {n} samples ({float(mine.index.nbytes.mean()) / 1000:.0f} KB on average), {len(shards)} "
          f"shard(s), shard 0's {count} read; medians of {args.repeats}, the paths compared taking turns")
    ours, their = mine.store.readers[0], theirs_readers[0]
    report("single reads (shuffled), the reader alone", compare({
        "packer Reader.read (a view of its map)": lambda: [ours.read(p) for p in order],
        "py-lmdb txn.get (a copy)": lambda: [their.read(p) for p in order],
        "py-lmdb txn.get, buffers=True (view inside txn)": lambda: [their.view(p) for p in order]},
        args.repeats), count)
    report(f"batches of {args.batch_size} (shuffled), the reader alone", compare({
        "packer Reader.read_many": lambda: [ours.read_many(b) for b in batches],
        "py-lmdb txn.get loop": lambda: [their.read_many(b) for b in batches],
        "py-lmdb Cursor.getmulti": lambda: [their.getmulti(b) for b in batches]}, args.repeats), count)
    report("through the dataset (index map, size checks; batches: read-ahead planned)", compare({
        "ds.read_payload, packer reader": lambda: [mine.read_payload(i) for i in public],
        "ds.read_payload, py-lmdb reader": lambda: [theirs.read_payload(i) for i in public],
        "ds.read_payloads (batches), packer reader": lambda: [mine.read_payloads(b) for b in public_batches],
        "ds.read_payloads (batches), py-lmdb reader": lambda: [theirs.read_payloads(b) for b in public_batches],
        "ds.read_payloads + every byte read, packer reader": lambda: consumed(mine, public_batches),
        "ds.read_payloads + every byte read, py-lmdb reader": lambda: consumed(theirs, public_batches)},
        args.repeats), count)
    files = tree_files(args.dataset)
    cold: dict[str, list[float]] = {"packer reader": [], "py-lmdb reader": []}
    verified = True
    for _ in range(args.repeats):
        for name, ds in (("packer reader", mine), ("py-lmdb reader", theirs)):
            ds.close()  # a map left from the warm passes would keep pages: each pass opens afresh
            seconds, ok = cold_pass(ds, public_batches, files)
            cold[name].append(seconds)
            verified &= ok
    report("cold batches (evicted before each pass): ds.read_payloads + every byte read" + ("" if verified else
           " (eviction not verified)"), {k: statistics.median(v) for k, v in cold.items()}, count)
    decoded = {name: with_readers(args.dataset, readers, image="numpy")
               for name, readers in (("packer reader", None), ("py-lmdb reader", theirs_readers))}
    loaders = {name: ThreadLoader(ds, batch_size=args.batch_size, num_threads=2, collate_fn=len)
               for name, ds in decoded.items()}
    report("ThreadLoader epochs, JPEG decoding included (num_threads=2)",
           compare({name: (lambda ld=ld: sum(ld)) for name, ld in loaders.items()}, args.repeats), n)
    shard = mine.root / shards[0].files[0].name
    for ds in (mine, theirs, *decoded.values()):
        ds.close()

    def open_ours() -> None:
        reader = get_format("lmdb").Reader(mine.root, shards[0], mine.manifest.payload)
        reader.read(0)
        reader.close()

    def open_lmdb() -> None:
        env = lmdb.open(str(shard), subdir=False, readonly=True, lock=False, max_dbs=0)
        with env.begin() as txn:
            txn.get(key(0))
        env.close()

    report("opening shard 0 and reading one value (warm)", compare({
        "packer Reader: header, spans checked, map": open_ours, "py-lmdb: lmdb.open, txn.get": open_lmdb},
        args.repeats), 1, "ms", 1e3)


if __name__ == "__main__":
    main()
