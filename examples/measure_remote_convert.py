"""Converting from a bucket: `packer convert s3://bucket/train/` of N small JPEGs on the emulated store, against the
time the link needs for their bytes and against one GET at a time (N first-byte latencies).

    python examples/measure_remote_convert.py [--count 2000] [--latency 0.02] [--mbit 1000] [--json out.json]

Synthetic photos (packer's generator, --width x --height JPEGs, ImageFolder layout, 10 classes) served by the emulated
store (packer/storage/emulate.py) in its own process, --latency seconds before each first byte and one link of
--mbit Mbit/s. Measured: the fetch alone (the remote source's reader over every record, nothing decoded: what the
link allows), the conversion from the bucket and the same conversion from the local folder (the CPU's limit:
validation decodes every image), each --repeat times (the best kept). Figures go to docs/remote.md with this
command.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from measure_storage import Server  # noqa: E402

import packer  # noqa: E402
import packer.write.sources.remote as remote_source  # noqa: E402
from packer.tools.sample import make_sample  # noqa: E402
from packer.write.sources.registry import scan_source  # noqa: E402


def cpu_now() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def fetch_all(url: str) -> tuple[float, int]:
    """Seconds to list ``url`` and fetch every record's object (as the conversion's driver does), and the bytes."""
    start = time.perf_counter()
    scan = scan_source(url)
    reader = scan.source_reader()
    got = 0
    for _, _, loc in reader.admitted(scan.records()):
        got += len(loc.data)
    reader.close()
    return time.perf_counter() - start, got


def timed_convert(src: str | Path, out: Path, args: argparse.Namespace) -> float:
    start = time.perf_counter()
    result = packer.convert(src, out, to="lmdb", workers=args.workers, validate=args.validate, overwrite=True,
                            progress=False)
    took = time.perf_counter() - start
    assert result.errors == [] and result.num_samples == args.count, (result.errors[:3], result.num_samples)
    return took


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--count", type=int, default=2000)
    parser.add_argument("--width", type=int, default=500)
    parser.add_argument("--height", type=int, default=375)
    parser.add_argument("--latency", type=float, default=0.02)
    parser.add_argument("--mbit", type=float, default=1000)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--validate", default="full", choices=["full", "header", "none"])
    parser.add_argument("--repeat", type=int, default=2)
    parser.add_argument("--in-flight", default=str(remote_source.IN_FLIGHT),
                        help="GETs at once; a comma-separated list measures the fetch with each (the conversions: "
                        "the first)")
    parser.add_argument("--fetch-only", action="store_true", help="measure the fetch alone, not the conversions")
    parser.add_argument("--json", help="also write the figures here")
    args = parser.parse_args()
    bandwidth = args.mbit * 1e6 / 8
    in_flight = [int(n) for n in args.in_flight.split(",")]
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp) / "root" / "train"
        size = make_sample(folder, count=args.count, size=(args.height, args.width), progress=False)
        server = Server("emulate", Path(tmp) / "root", args.latency, bandwidth)
        os.environ.update({"AWS_ENDPOINT_URL": server.endpoint, "AWS_ACCESS_KEY_ID": "testing",
                           "AWS_SECRET_ACCESS_KEY": "testing", "AWS_REGION": "us-east-1"})
        url = "s3://packer/train/"
        try:
            fetch_by: dict[int, list[tuple[float, int]]] = {}
            cpu: dict[int, dict[str, float]] = {}  # per object fetched: this process's CPU, the server's
            for n in reversed(in_flight):  # the first last: it stays set for the conversions
                remote_source.IN_FLIGHT = n
                mine, theirs = cpu_now(), server.cpu()
                fetch_by[n] = [fetch_all(url) for _ in range(args.repeat)]
                count = args.count * args.repeat
                cpu[n] = {"client_ms": round((cpu_now() - mine) / count * 1e3, 3),
                          "server_ms": round((server.cpu() - theirs) / count * 1e3, 3)}
            fetches = fetch_by[in_flight[0]]
            fetched = fetches[0][1]
            remote = [] if args.fetch_only else [timed_convert(url, Path(tmp) / "remote.lmdb", args)
                                                 for _ in range(args.repeat)]
        finally:
            server.close()
        local = [] if args.fetch_only else [timed_convert(folder, Path(tmp) / "local.lmdb", args)
                                            for _ in range(args.repeat)]
    link_s = size / bandwidth
    serial_s = args.count * args.latency + link_s
    best_fetch = min(f for f, _ in fetches)
    best_remote, best_local = min(remote, default=None), min(local, default=None)

    def ratio(a: float | None, b: float | None) -> float | None:  # None: not measured (--fetch-only)
        return None if a is None or b is None else round(a / b, 3)

    results = {
        "objects": args.count, "bytes": size, "mean_object_bytes": round(size / args.count),
        "latency_s": args.latency, "link_mbit": args.mbit, "in_flight": in_flight[0], "workers": args.workers,
        "validate": args.validate,
        "cores": os.cpu_count(), "load_average": os.getloadavg(),
        "link_s": round(link_s, 3), "one_at_a_time_s": round(serial_s, 3),
        "fetch_s": round(best_fetch, 3), "fetch_bytes": fetched,
        "fetch_link_fraction": round(link_s / best_fetch, 3), "fetch_objects_per_s": round(args.count / best_fetch),
        "convert_remote_s": ratio(best_remote, 1), "convert_local_s": ratio(best_local, 1),
        "remote_over_local": ratio(best_remote, best_local),
        "speedup_over_one_at_a_time": ratio(serial_s, best_remote),
        "fetch_speedup_over_one_at_a_time": round(serial_s / best_fetch, 1),
        "fetch_s_by_in_flight": {n: round(min(f for f, _ in runs), 3) for n, runs in fetch_by.items()},
        "fetch_cpu_per_object_by_in_flight": cpu,
        "runs": {"fetch_s": [round(f, 3) for f, _ in fetches], "convert_remote_s": [round(t, 3) for t in remote],
                 "convert_local_s": [round(t, 3) for t in local]},
    }
    print(json.dumps(results, indent=1))
    if args.json:  # several runs (sizes, in-flight) go to one file, each under its own name
        path = Path(args.json)
        runs = json.loads(path.read_text()) if path.exists() else {}
        runs[f"{args.count}x{args.width}x{args.height}"] = results
        path.write_text(json.dumps(runs, indent=1) + "\n")


if __name__ == "__main__":
    main()
