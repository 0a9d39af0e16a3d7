"""What a spawned DataLoader worker of a URL dataset waits for: the dataset's pickle (bytes) and when each of two
spawned workers started and the first batch came, for one dataset in many shards.

    python examples/measure_spawn_pickle.py [--count 300] [--shards 300] [--repeats 3] [--json out.json]
    PYTHONPATH=/path/to/other/checkout python examples/measure_spawn_pickle.py ...   # another packer's code

--count synthetic photos (packer's generator, 500x375 JPEGs) converted to lmdb (shuffled) in about --shards shards
(kept in --dataset between runs), served by the emulated store (packer/storage/emulate.py) in its own process with
no latency; each repeat opens s3://packer/ds.lmdb in a new cache folder (ranged mode where it can, --mode) and runs
one pass of DataLoader(num_workers=2, multiprocessing_context="spawn", BlockShuffleSampler, batch_size=--batch).
Python writes a spawned child's pickle through a 64 KiB pipe and ``Process.start`` waits until the child has read
it: a pickle past that makes the second worker start after the first has imported torch and packer. Reported per
repeat: the pickle's bytes, the seconds to unpickle it in this process (its modules imported), each worker's
``worker_init_fn`` time after the DataLoader's iterator was asked for, their gap, the first batch's time and the
load average. Figures go to docs/remote.md with this command.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import pickle
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from measure_storage import Server  # noqa: E402
from torch.utils.data import DataLoader  # noqa: E402

import packer  # noqa: E402
from packer.tools.sample import make_sample  # noqa: E402


def started(folder: str, worker: int) -> None:
    """A worker's ``worker_init_fn``: the time it ran, in a file of its own."""
    Path(folder, f"worker-{worker}").write_text(repr(time.time()))


def make_dataset(root: Path, count: int, shards: int) -> Path:
    """``root/ds.lmdb`` of ``count`` photos in about ``shards`` shards (made once)."""
    out = root / "ds.lmdb"
    if not (out / "manifest.json").exists():
        make_sample(root / "imgs", count=count, progress=False)
        total = sum(f.stat().st_size for f in (root / "imgs").rglob("*.jpg"))
        packer.convert(root / "imgs", out, to="lmdb", shard_bytes=max(1, total // shards + 1), order="shuffled",
                       workers=0, progress=False)
    return out


def repeat(server: Server, cache_dir: Path, marks: Path, args: argparse.Namespace) -> dict:
    load = os.getloadavg()[0]
    ds = packer.open_dataset("s3://packer/ds.lmdb", cache_dir=cache_dir, image="tensor", remote_mode=args.mode,
                             storage_options={"endpoint": server.endpoint, "skip_signature": True,
                                              "region": "us-east-1"})
    try:
        blob = pickle.dumps(ds)
        began = time.perf_counter()
        pickle.loads(blob).close()  # what a worker does with it, its modules imported
        unpickle = time.perf_counter() - began
        loader = DataLoader(ds, batch_size=args.batch, sampler=packer.BlockShuffleSampler(ds, batch_size=args.batch),
                            num_workers=2, multiprocessing_context="spawn", collate_fn=packer.collate,
                            worker_init_fn=functools.partial(started, str(marks)))
        start = time.time()
        batches = iter(loader)
        next(batches)
        first = time.time() - start
        for _ in batches:
            pass
        inits = sorted(float((marks / f"worker-{w}").read_text()) - start for w in range(2))
        return {"shards": len(ds.manifest.shards), "pickle_bytes": len(blob), "unpickle_s": round(unpickle, 3),
                "worker_init_s": [round(t, 2) for t in inits],
                "gap_s": round(inits[1] - inits[0], 2), "first_batch_s": round(first, 2), "load_1min": load}
    finally:
        ds.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--count", type=int, default=300)
    parser.add_argument("--shards", type=int, default=300)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--mode", default="auto", choices=["auto", "ranged", "shard"])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dataset", help="a folder to keep the converted dataset in between runs")
    parser.add_argument("--json", help="also write the figures here")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(args.dataset or Path(tmp) / "root")
        make_dataset(root, args.count, args.shards)
        server = Server("emulate", root)
        try:
            runs = []
            for n in range(args.repeats):
                marks = Path(tmp) / f"marks-{n}"
                marks.mkdir()
                runs.append(repeat(server, Path(tmp) / f"cache-{n}", marks, args))
                print(json.dumps(runs[-1]), flush=True)
        finally:
            server.close()
    results = {"packer": str(Path(packer.__file__).parent), "runs": runs}
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()
