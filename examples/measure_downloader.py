"""What the node's downloader costs against obstore in the reading process: the same random ranges read
(a) in-process (ObjectStore + Fetcher, the process that made the first request), (b) in a child forked from it
through its own helper process (packer/storage/client.py's HelperClient: bytes over a pipe) and (c) through the
node's downloader (packer/storage/downloader.py: bytes written to the cache's files, read back by the client),
from the main process and from a forked child.

    python examples/measure_downloader.py [--json out.json]

The emulated store (no limits) runs in its own process. For each side: seconds to the first range (starting a
helper or the downloader included), MB/s for 48 x 1 MB and 480 x 100 KB random ranges with 32 in flight, and the
CPU per MB delivered of the whole run: the reader's, its helper's, and the downloader's (its own count, asked
before it exits), in all and per range size; and what writing one cache entry costs. Each run reads with a cold
cache. Figures go to docs/remote.md with this command.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import resource
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from measure_storage import KEY, Server  # noqa: E402

from packer.storage.client import HelperClient, StoreSpec  # noqa: E402
from packer.storage.downloader_client import DownloaderClient, wait_all  # noqa: E402
from packer.storage.fetch import Fetcher, Range  # noqa: E402
from packer.storage.store import ObjectStore  # noqa: E402

SIZES = ((1_000_000, 48), (100_000, 480))
OPTIONS = {"endpoint": "", "skip_signature": True, "region": "us-east-1"}


def cpu() -> float:
    own, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime


def ranges(size: int, nbytes: int, count: int, seed: int) -> list[tuple[int, int]]:
    rng = random.Random(seed)
    return [(s, s + nbytes) for s in (rng.randrange(0, size - nbytes) for _ in range(count))]


def in_process(endpoint: str, size: int) -> dict:
    t0, c0 = time.perf_counter(), cpu()
    store = ObjectStore("s3://packer/", {**OPTIONS, "endpoint": endpoint})
    store.get_range(KEY, 0, 1000)
    out: dict = {"client": type(store.client).__name__, "first_range_s": time.perf_counter() - t0}
    moved = 0
    with Fetcher(store, max_in_flight=32) as fetcher:
        for seed, (nbytes, count) in enumerate(SIZES):
            t, c = time.perf_counter(), cpu() + helper_cpu(store)
            got = sum(len(f.result()) for f in fetcher.fetch([Range(KEY, a, b) for a, b in
                                                               ranges(size, nbytes, count, seed)]))
            out[f"{nbytes // 1000}KB_MB_per_s"] = got / 1e6 / (time.perf_counter() - t)
            out[f"{nbytes // 1000}KB_cpu_ms_per_MB"] = (cpu() + helper_cpu(store) - c) / (got / 1e6) * 1e3
            moved += got
    store.close()  # a helper process exits: its CPU joins RUSAGE_CHILDREN
    out["cpu_ms_per_MB"] = (cpu() - c0) / (moved / 1e6) * 1e3
    return out


def helper_cpu(store: ObjectStore) -> float:
    """The CPU seconds of this process's helper so far (0 without one)."""
    client = store.client
    if not isinstance(client, HelperClient):
        return 0.0
    fields = Path(f"/proc/{client._proc.pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def downloader(endpoint: str, size: int, cache: Path) -> dict:
    spec = StoreSpec("s3://packer/", {**OPTIONS, "endpoint": endpoint})
    t0, c0 = time.perf_counter(), cpu()
    client = DownloaderClient(cache, "10GB", linger=0.5)
    etag = client.head(spec, KEY).etag
    wait_all(client.fetch(spec, KEY, etag, [(0, 1000, [])]))
    out: dict = {"client": "DownloaderClient", "first_range_s": time.perf_counter() - t0}
    before = client.stats()["cpu_s"]
    moved = 0
    for seed, (nbytes, count) in enumerate(SIZES):
        t, c, d = time.perf_counter(), cpu(), client.stats()["cpu_s"]
        paths = wait_all(client.fetch(spec, KEY, etag, [(a, b, []) for a, b in ranges(size, nbytes, count, seed)],
                                      priority=seed))
        got = 0
        for path in paths:  # the reader's side: the bytes come from the cache's files
            with open(path, "rb") as fh:
                got += len(fh.read())
        out[f"{nbytes // 1000}KB_MB_per_s"] = got / 1e6 / (time.perf_counter() - t)
        served = client.stats()["cpu_s"] - d
        out[f"{nbytes // 1000}KB_cpu_ms_per_MB"] = (cpu() - c + served) / (got / 1e6) * 1e3
        out[f"{nbytes // 1000}KB_downloader_cpu_ms_per_MB"] = served / (got / 1e6) * 1e3
        moved += got
    served = client.stats()["cpu_s"] - before
    client.close()
    out["cpu_ms_per_MB"] = (cpu() - c0 + served) / (moved / 1e6) * 1e3
    out["downloader_cpu_ms_per_MB"] = served / (moved / 1e6) * 1e3
    return out


def cache_stores(folder: Path) -> dict:
    """What writing an entry costs (the downloader writes one per range): ``RangeCache.store`` under its claim,
    per entry of 100 KB and of 1 MB, wall and CPU microseconds."""
    from packer.storage.cache import RangeCache

    cache = RangeCache(folder, "10GB")
    out = {}
    for nbytes in (100_000, 1_000_000):
        data = os.urandom(nbytes)
        t, c = time.perf_counter(), cpu()
        for i in range(200):
            name = cache.name("s3://packer/blob.bin", "etag", i * nbytes, (i + 1) * nbytes)
            with cache.claim(name):
                cache.store(name, data)
        out[f"{nbytes // 1000}KB_store_us"] = (time.perf_counter() - t) / 200 * 1e6
        out[f"{nbytes // 1000}KB_store_cpu_us"] = (cpu() - c) / 200 * 1e6
    cache.close()
    return out


def in_child(run, *args) -> dict:
    """``run(*args)`` in a child forked from this process (which has used obstore), its result back."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(read)
        os.write(write, json.dumps(run(*args)).encode())
        os._exit(0)
    os.close(write)
    with os.fdopen(read) as fh:
        result = json.loads(fh.read())
    os.waitpid(pid, 0)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--json", help="also write the figures here")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        size = 64 << 20
        (Path(tmp) / KEY).write_bytes(os.urandom(size))
        server = Server("emulate", Path(tmp))
        try:
            results = {"in-process": in_process(server.endpoint, size),
                       "forked child, helper": in_child(in_process, server.endpoint, size),
                       "downloader": downloader(server.endpoint, size, Path(tmp) / "c1"),
                       "forked child, downloader": in_child(downloader, server.endpoint, size, Path(tmp) / "c2"),
                       "cache entries": cache_stores(Path(tmp) / "c3")}
        finally:
            server.close()
    print(json.dumps(results, indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()
