"""The link to object storage, for ``packer bench`` and ``packer doctor`` on a URL: an emulated store in its own
process (``EmulatedLink``, what ``--emulate s3`` serves a local dataset through, as ``--emulate hdd`` throttles a
disk) and a measure of a real link's first-byte latency and bandwidth by a few ranged GETs (``measure_link``).

The emulated store (packer/storage/emulate.py) runs in a child process so that its CPU is not the reader's; the
child says its endpoint on stdout, answers ``stats`` on stdin with its counters as one JSON line, and exits when
its stdin closes (so with the bench, whatever ends it). The presets (``LINK_PRESETS``) and their sources:
docs/bench.md.
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from packer.errors import PackerError

EMULATED_BUCKET = "packer"
PROBES = 5  # small ranged GETs one after another: the first-byte latency
PARALLEL = 8  # large ranged GETs in flight: the bandwidth
RANGE_BYTES = 4 << 20


@dataclass(frozen=True)
class LinkPreset:
    latency: float  # seconds before each response's first byte
    bandwidth: float  # bytes/s of the whole link
    source: str


LINK_PRESETS: dict[str, LinkPreset] = {
    "s3": LinkPreset(0.020, 125_000_000, "S3 read in-region: 10-30 ms to the first byte, a 1 Gbit/s link"),
}


class EmulatedLink:
    """The emulated store serving ``root`` (bucket ``packer``) in a child process with ``latency`` seconds before
    each first byte and ``bandwidth`` bytes/s for the whole link (None: unlimited). A context manager;
    ``url(name)`` is ``s3://packer/<name>``, ``storage_options`` what a reader needs to reach it."""

    def __init__(self, root: str | os.PathLike, latency: float, bandwidth: float | None) -> None:
        if latency < 0 or (bandwidth is not None and bandwidth <= 0):
            raise PackerError(f"--latency {latency} and --bandwidth {bandwidth}: expected >= 0 and > 0")
        self.root, self.latency, self.bandwidth = Path(root).resolve(), latency, bandwidth
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (_package_root(), os.environ.get(
            "PYTHONPATH")) if p)}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "packer.diagnose.link", str(self.root), str(latency), str(bandwidth or 0)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline().strip()
        if not line.startswith("http://"):
            self.close()
            raise PackerError(f"the emulated store did not start (it said {line!r})")
        self.endpoint = line

    @property
    def storage_options(self) -> dict[str, Any]:
        return {"endpoint": self.endpoint, "skip_signature": True, "region": "us-east-1"}

    def url(self, name: str) -> str:
        return f"s3://{EMULATED_BUCKET}/{name}"

    def stats(self) -> dict[str, float]:
        """The server's own counters (requests, GETs, HEADs, listings, body bytes, delays) once no request is being
        answered: what it served."""
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write("stats\n")
        self.proc.stdin.flush()
        return json.loads(self.proc.stdout.readline())

    def describe(self) -> dict[str, Any]:
        return {"latency_s": self.latency, "bandwidth_bytes_per_s": self.bandwidth, "endpoint": self.endpoint,
                "server": "packer.storage.emulate in its own process"}

    def close(self) -> None:
        if self.proc.stdin is not None and not self.proc.stdin.closed:
            self.proc.stdin.close()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        if self.proc.stdout is not None:
            self.proc.stdout.close()

    def __enter__(self) -> EmulatedLink:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _package_root() -> str:
    return str(Path(__file__).resolve().parents[2])


def measure_link(url: str, storage_options: Mapping[str, Any] | None = None, key: str | None = None,
                 probes: int = PROBES, parallel: int = PARALLEL, range_bytes: int = RANGE_BYTES) -> dict[str, Any]:
    """First-byte latency (median of ``probes`` 1-byte ranged GETs, one after another: a round trip and the
    server's delay) and bandwidth (``parallel`` ranged GETs of ``range_bytes`` at once, twice; the faster) of
    object ``key`` below ``url`` (None: the largest listed; http(s):// cannot list, so its callers name one, the
    dataset's largest shard file): the link a reader of that dataset gets. Nothing is cached."""
    from packer.storage.store import ObjectStore

    with ObjectStore(url, storage_options) as store:
        objects = [store.head(key)] if key is not None else [o for o in store.list() if o.size > 0]
        if not objects or objects[0].size <= 0:
            raise PackerError(f"{store.root}: no object to measure the link with")
        obj = max(objects, key=lambda o: o.size)
        store.get_range(obj.key, 0, 1)  # connect first: a connection's set-up is not the link's latency
        firsts = []
        for i in range(probes):
            start = (i * 4099) % obj.size
            t0 = time.perf_counter()
            store.get_range(obj.key, start, start + 1)
            firsts.append(time.perf_counter() - t0)
        size = min(range_bytes, obj.size)
        rounds = []
        for r in range(2):
            starts = [((r * parallel + k) * size) % max(obj.size - size + 1, 1) for k in range(parallel)]
            t0 = time.perf_counter()
            futures = [store.submit_get(obj.key, s, s + size) for s in starts]
            got = sum(len(f.result()[0]) for f in concurrent.futures.as_completed(futures))
            rounds.append(got / max(time.perf_counter() - t0, 1e-9))
    return {"object": obj.key, "object_bytes": obj.size, "first_byte_s": statistics.median(firsts),
            "first_byte_s_each": firsts, "bandwidth_bytes_per_s": max(rounds), "bandwidth_rounds": rounds,
            "range_bytes": size, "in_flight": parallel, "gets": 1 + probes + 2 * parallel}


def _serve(root: str, latency: float, bandwidth: float) -> None:
    """The child: serve ``root`` until stdin closes; ``stats`` on stdin prints the counters as a JSON line."""
    from packer.storage.emulate import EmulatedStore

    with EmulatedStore(root, EMULATED_BUCKET, latency=latency, bandwidth=bandwidth or None) as server:
        print(server.endpoint, flush=True)
        for line in sys.stdin:
            if line.strip() == "stats":
                print(json.dumps(server.stats.settled()), flush=True)


if __name__ == "__main__":
    _serve(sys.argv[1], float(sys.argv[2]), float(sys.argv[3]))
