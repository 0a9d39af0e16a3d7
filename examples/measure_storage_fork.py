"""What obstore's fork workaround costs: packer's ObjectStore + Fetcher in the process that made the first request
(in-process client) and in a child forked from it (a helper process over a pipe: packer/storage/client.py).

    python examples/measure_storage_fork.py

The emulated store (no limits) runs in its own process. For each side: seconds to the first range (the helper's
start included), MB/s for 48 x 1 MB and 480 x 100 KB random ranges with 32 in flight, and the CPU per MB of
the whole run (the helper's CPU counted with its parent's). Figures go to docs/remote.md with this command.
"""

from __future__ import annotations

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

from packer.storage.fetch import Fetcher, Range  # noqa: E402
from packer.storage.store import ObjectStore  # noqa: E402


def cpu() -> float:
    own, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime


def run(endpoint: str, size: int) -> dict:
    t0, c0 = time.perf_counter(), cpu()
    store = ObjectStore("s3://packer/", {"endpoint": endpoint, "skip_signature": True, "region": "us-east-1"})
    store.get_range(KEY, 0, 1000)
    out: dict = {"client": type(store.client).__name__, "first_range_s": time.perf_counter() - t0}
    rng = random.Random(0)
    moved = 0
    with Fetcher(store, max_in_flight=32) as fetcher:
        for nbytes, count in ((1_000_000, 48), (100_000, 480)):
            ranges = [Range(KEY, s, s + nbytes) for s in (rng.randrange(0, size - nbytes) for _ in range(count))]
            t = time.perf_counter()
            got = sum(len(f.result()) for f in fetcher.fetch(ranges))
            out[f"{nbytes // 1000}KB_MB_per_s"] = got / 1e6 / (time.perf_counter() - t)
            moved += got
    store.close()  # a helper process exits: its CPU joins RUSAGE_CHILDREN
    out["cpu_ms_per_MB"] = (cpu() - c0) / (moved / 1e6) * 1e3
    return out


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        size = 64 << 20
        (Path(tmp) / KEY).write_bytes(os.urandom(size))
        server = Server("emulate", Path(tmp))
        try:
            results = {"in-process": run(server.endpoint, size)}
            read, write = os.pipe()
            pid = os.fork()
            if pid == 0:
                os.close(read)
                os.write(write, json.dumps(run(server.endpoint, size)).encode())
                os._exit(0)
            os.close(write)
            with os.fdopen(read) as fh:
                results["forked child"] = json.loads(fh.read())
            os.waitpid(pid, 0)
        finally:
            server.close()
    print(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
