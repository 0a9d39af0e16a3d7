"""Converting into a bucket against converting to a local folder: seconds, bytes put, the link's time for those
bytes, and the most the staging folder held (packer/write/remote_output.py).

    python examples/measure_remote_write.py [--count 2000] [--latency 0.02] [--mbit 1000] [--json out.json]

Synthetic photos (packer's generator, 500x375 JPEGs) converted to lmdb in shards of --shard-size, first to a local
folder, then to s3://packer/ds.lmdb on the emulated store (packer/storage/emulate.py, in its own process, with
--latency seconds before each response and a link of --mbit Mbit/s for the request bodies). The remote conversion
writes each shard in a staging folder and uploads it while the next is written, so its time is expected near
max(local conversion, bytes / link speed) plus one shard's upload at the end. Figures go to docs/remote.md.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from measure_storage import Server  # noqa: E402

import packer  # noqa: E402
from packer.tools.sample import make_sample  # noqa: E402
from packer.units import parse_bytes  # noqa: E402


def folder_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file()) if folder.exists() else 0


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--count", type=int, default=2000)
    parser.add_argument("--shard-size", default="16MB")
    parser.add_argument("--latency", type=float, default=0.02)
    parser.add_argument("--mbit", type=float, default=1000)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--json", help="also write the figures here")
    args = parser.parse_args()
    bandwidth = args.mbit * 1e6 / 8
    shard_bytes = parse_bytes(args.shard_size)
    with tempfile.TemporaryDirectory() as tmp:
        base = Path(tmp)
        make_sample(base / "imgs", count=args.count, progress=False)
        started = time.perf_counter()
        packer.convert(base / "imgs", base / "local.lmdb", to="lmdb", shard_bytes=shard_bytes, workers=args.workers,
                       progress=False)
        local_s = time.perf_counter() - started
        (base / "root").mkdir()
        server = Server("emulate", base / "root", args.latency, bandwidth)
        staged = [0]
        done = threading.Event()

        def watch() -> None:  # the staging folder's size, sampled: the most it held
            while not done.wait(0.01):
                staged[0] = max(staged[0], folder_bytes(base / "staging"))

        watcher = threading.Thread(target=watch)
        watcher.start()
        try:
            started = time.perf_counter()
            packer.convert(base / "imgs", "s3://packer/ds.lmdb", to="lmdb", shard_bytes=shard_bytes,
                           workers=args.workers, progress=False, staging_dir=base / "staging",
                           storage_options={"endpoint": server.endpoint, "region": "us-east-1",
                                            "aws_access_key_id": "testing", "aws_secret_access_key": "testing"})
            remote_s = time.perf_counter() - started
        finally:
            done.set()
            watcher.join()
            server.close()
        put = folder_bytes(base / "root" / "ds.lmdb")
        manifest = packer.open_dataset(base / "local.lmdb").manifest
        results = {
            "samples": args.count, "shards": len(manifest.shards), "dataset_bytes": put,
            "latency_s": args.latency, "link_mbit": args.mbit, "workers": args.workers,
            "local_s": round(local_s, 2), "remote_s": round(remote_s, 2),
            "link_s": round(put / bandwidth, 2),
            "remote_over_max_local_link": round(remote_s / max(local_s, put / bandwidth), 2),
            "staging_peak_bytes": staged[0],
        }
    print(json.dumps(results, indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()
