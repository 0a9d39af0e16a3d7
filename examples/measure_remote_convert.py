"""Converting from a bucket: `packer convert s3://bucket/train/` of N small JPEGs on the emulated store, against the
time the link needs for their bytes and against one GET at a time (N first-byte latencies).

    python examples/measure_remote_convert.py [--count 2000] [--latency 0.02] [--mbit 1000] [--json out.json]

Synthetic photos (packer's generator, --width x --height JPEGs, ImageFolder layout, 10 classes) served by the emulated
store (packer/storage/emulate.py) in its own process, --latency seconds before each first byte and one link of
--mbit Mbit/s. Measured: the fetch alone (the remote source's reader over every record, nothing decoded: what the
link allows), the conversion from the bucket and the same conversion from the local folder (the CPU's limit:
validation decodes every image), each --repeat times (the best kept). The server runs on the same cores, so what
the request concurrency allows is measured as a ceiling in the same run against the same server: the same objects
fetched by the plainest client (obstore's async ``get`` with --in-flight requests at once, nothing else: no
packer), in one process and in --ceiling-procs processes; each repetition runs the ceilings, the fetch and the
conversion in turn, so each sees the same load. The figure of merit is conversion objects/s over
min(link, best ceiling). --distinct N generates N photos and writes the rest as copies of them (fast for 100,000).
Figures go to docs/remote.md with this command.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import resource
import subprocess
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


def generate(folder: Path, args: argparse.Namespace) -> int:
    """``args.count`` photos in ImageFolder layout below ``folder`` (10 classes): ``args.distinct`` made by packer's
    generator, the rest copies of them under their own names; the bytes written."""
    distinct = min(args.distinct or args.count, args.count)
    size = make_sample(folder, count=distinct, size=(args.height, args.width), progress=False)
    if distinct == args.count:
        return size
    made = sorted(folder.rglob("*.jpg"))
    blobs = [f.read_bytes() for f in made]
    for i in range(distinct, args.count):
        data = blobs[i % distinct]
        (folder / f"class_{i % 10:02d}" / f"img_{i:06d}.jpg").write_bytes(data)
        size += len(data)
    return size


async def _plain_fetch(endpoint: str, keys: list[str], in_flight: int) -> int:
    """Every key fetched by obstore's async client, ``in_flight`` at once: the plainest client; the bytes."""
    import obstore
    from obstore.store import S3Store

    store = S3Store("packer", endpoint=endpoint, region="us-east-1", access_key_id="testing",
                    secret_access_key="testing", client_options={"allow_http": True})
    it, got = iter(keys), [0]

    async def lane() -> None:
        for key in it:
            result = await obstore.get_async(store, key)
            data = await result.bytes_async()
            got[0] += len(data)  # not ``+= len(await ...)``: that reads got[0] before the await

    await asyncio.gather(*(lane() for _ in range(in_flight)))
    return got[0]


def ceiling_worker(endpoint: str, keys_file: str, index: int, procs: int, in_flight: int) -> None:
    """Child process: its share of the keys, fetched once told to start (a line on stdin); prints its times."""
    keys = Path(keys_file).read_text().split("\n")[index::procs]
    print("ready", flush=True)
    sys.stdin.readline()
    mine, start = cpu_now(), time.monotonic()
    got = asyncio.run(_plain_fetch(endpoint, keys, in_flight))
    print(json.dumps({"start": start, "end": time.monotonic(), "bytes": got, "cpu": cpu_now() - mine}), flush=True)


def ceiling(server: Server, keys_file: Path, count: int, procs: int, in_flight: int) -> dict[str, float]:
    """Seconds for ``procs`` processes of the plainest client (each ``in_flight`` GETs at once, obstore only) to
    fetch the ``count`` objects, from the first one's start to the last one's end; with the CPU per object of the
    clients and of the server."""
    children = [subprocess.Popen([sys.executable, __file__, "--ceiling-worker", server.endpoint, str(keys_file),
                                  str(i), str(procs), str(in_flight)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                 text=True) for i in range(procs)]
    for child in children:
        assert child.stdout is not None and child.stdout.readline().strip() == "ready"
    theirs = server.cpu()
    for child in children:
        assert child.stdin is not None
        child.stdin.write("go\n")
        child.stdin.flush()
    done = [json.loads(child.communicate()[0]) for child in children]
    took = max(d["end"] for d in done) - min(d["start"] for d in done)
    return {"s": round(took, 3), "bytes": sum(d["bytes"] for d in done), "objects_per_s": round(count / took),
            "client_ms": round(sum(d["cpu"] for d in done) / count * 1e3, 3),
            "server_ms": round((server.cpu() - theirs) / count * 1e3, 3)}


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
    parser.add_argument("--batch", default=str(remote_source.BATCH),
                        help="GETs started together (one future each batch); a comma-separated list measures the fetch "
                        "with each, at the first --in-flight (1: one future per GET, as before batches)")
    parser.add_argument("--fetch-only", action="store_true", help="measure the fetch alone, not the conversions")
    parser.add_argument("--distinct", type=int, default=0,
                        help="photos generated (0: --count); the others are copies of them under their own names")
    parser.add_argument("--ceiling-procs", default="1,2",
                        help="processes of the plainest client measured for the ceiling (comma-separated)")
    parser.add_argument("--ceiling-worker", nargs=5, help=argparse.SUPPRESS)
    parser.add_argument("--json", help="also write the figures here")
    args = parser.parse_args()
    if args.ceiling_worker:
        endpoint, keys_file, index, procs, n = args.ceiling_worker
        return ceiling_worker(endpoint, keys_file, int(index), int(procs), int(n))
    bandwidth = args.mbit * 1e6 / 8
    in_flight = [int(n) for n in args.in_flight.split(",")]
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp) / "root" / "train"
        size = generate(folder, args)
        keys_file = Path(tmp) / "keys.txt"
        keys_file.write_text("\n".join(sorted(f"train/{p.relative_to(folder).as_posix()}"
                                                for p in folder.rglob("*.jpg"))))
        server = Server("emulate", Path(tmp) / "root", args.latency, bandwidth)
        os.environ.update({"AWS_ENDPOINT_URL": server.endpoint, "AWS_ACCESS_KEY_ID": "testing",
                           "AWS_SECRET_ACCESS_KEY": "testing", "AWS_REGION": "us-east-1"})
        url = "s3://packer/train/"
        try:
            fetch_by: dict[int, list[tuple[float, int]]] = {}
            cpu: dict[int, dict[str, float]] = {}  # per object fetched: this process's CPU, the server's
            for n in reversed(in_flight) if len(in_flight) > 1 else []:  # (one: measured with the batches below)
                remote_source.IN_FLIGHT = n
                mine, theirs = cpu_now(), server.cpu()
                fetch_by[n] = [fetch_all(url) for _ in range(args.repeat)]
                count = args.count * args.repeat
                cpu[n] = {"client_ms": round((cpu_now() - mine) / count * 1e3, 3),
                          "server_ms": round((server.cpu() - theirs) / count * 1e3, 3)}
            remote_source.IN_FLIGHT = in_flight[0]
            batches = [int(n) for n in args.batch.split(",")]
            fetch_by_batch: dict[int, list[tuple[float, int]]] = {}
            for b in reversed(batches[1:]):  # the first is measured below, alternated with the ceilings
                remote_source.BATCH = b
                mine, theirs = cpu_now(), server.cpu()
                fetch_by_batch[b] = [fetch_all(url) for _ in range(args.repeat)]
                count = args.count * args.repeat
                cpu[-b] = {"client_ms": round((cpu_now() - mine) / count * 1e3, 3),
                           "server_ms": round((server.cpu() - theirs) / count * 1e3, 3)}
            remote_source.BATCH = batches[0]
            fetches: list[tuple[float, int]] = []
            fetch_cpu = [0.0, 0.0]  # this process's, the server's, over the fetches below
            ceilings: dict[int, list[dict[str, float]]] = {int(p): [] for p in args.ceiling_procs.split(",")}
            remote: list[float] = []
            load = [os.getloadavg()]
            for _ in range(args.repeat):  # the ceilings, the fetch and the conversion alternate: the same load
                for procs, runs in ceilings.items():
                    runs.append(ceiling(server, keys_file, args.count, procs, in_flight[0]))
                mine, theirs = cpu_now(), server.cpu()
                fetches.append(fetch_all(url))
                fetch_cpu[0] += cpu_now() - mine
                fetch_cpu[1] += server.cpu() - theirs
                if not args.fetch_only:
                    remote.append(timed_convert(url, Path(tmp) / "remote.lmdb", args))
                load.append(os.getloadavg())
            fetch_by_batch[batches[0]] = fetches
            count = args.count * args.repeat
            cpu[-batches[0]] = {"client_ms": round(fetch_cpu[0] / count * 1e3, 3),
                                "server_ms": round(fetch_cpu[1] / count * 1e3, 3)}
            fetch_by.setdefault(in_flight[0], fetches)
            cpu.setdefault(in_flight[0], cpu[-batches[0]])
            fetched = fetches[0][1]
        finally:
            server.close()
        local = [] if args.fetch_only else [timed_convert(folder, Path(tmp) / "local.lmdb", args)
                                            for _ in range(args.repeat)]
    link_s = size / bandwidth
    serial_s = args.count * args.latency + link_s
    best_fetch = min(f for f, _ in fetches)
    best_remote, best_local = min(remote, default=None), min(local, default=None)
    assert all(r["bytes"] == size for runs in ceilings.values() for r in runs), "the ceiling missed bytes"
    best_ceiling = {procs: min(runs, key=lambda r: r["s"]) for procs, runs in ceilings.items()}
    ceiling_s = min(r["s"] for r in best_ceiling.values())
    limit_s = max(link_s, ceiling_s)  # min(link rate, ceiling rate), as a time

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
        "ceiling_by_procs": best_ceiling, "ceiling_s": ceiling_s, "limit_s": round(limit_s, 3),
        "convert_objects_per_s": None if best_remote is None else round(args.count / best_remote),
        "figure_of_merit": ratio(limit_s, best_remote),  # conversion rate / min(link rate, ceiling rate)
        "fetch_over_limit": round(limit_s / best_fetch, 3),
        "load_average_during": [[round(x, 2) for x in la] for la in load],
        "fetch_cpu_per_object_by_in_flight": {n: c for n, c in cpu.items() if n > 0},
        "batch": batches[0],
        "fetch_s_by_batch": {b: round(min(f for f, _ in runs), 3) for b, runs in fetch_by_batch.items()},
        "fetch_cpu_per_object_by_batch": {-n: c for n, c in cpu.items() if n < 0},
        "runs": {"fetch_s": [round(f, 3) for f, _ in fetches], "convert_remote_s": [round(t, 3) for t in remote],
                 "ceiling_s": {procs: [r["s"] for r in runs] for procs, runs in ceilings.items()},
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
