"""Choose the object-storage library by measuring: obstore (Rust object_store) vs fsspec + s3fs (aiobotocore).

    pip install s3fs        # the measured alternative; obstore and moto[server] come with requirements/test.txt
    python examples/measure_storage.py --json examples/measure_storage.json   # about 7 minutes on 2 cores

Both servers run in their own process, so each side's CPU is its own: moto's ThreadedMotoServer (pure Python,
what the tests use) and packer's emulated store (packer/storage/emulate.py: sendfile, path-style S3), first
unlimited (the fast server of the same bytes), then as a 1 Gbit/s link with 20 ms first-byte latency. Measured:
per ranged GET latency (one in flight), throughput and client CPU per MB with 1/8/32/64 requests in flight for
1 MB and 100 KB ranges (obstore async, obstore sync calls from threads, s3fs async), the emulated server's own
CPU per MB, what a client made before fork does in the child, several threads sharing one client, how fast a
Ctrl-C ends a blocking read and a cancelled async read, retries of 503 answers by default, and install size.
Figures go to docs/remote.md with this command.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import resource
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

KEY = "blob.bin"
CREDS = {"aws_access_key_id": "testing", "aws_secret_access_key": "testing"}


def serve(kind: str, folder: str, latency: float, bandwidth: float) -> None:
    """Child process: start one server, print its endpoint, serve until stdin closes."""
    if kind == "moto":
        from moto.server import ThreadedMotoServer

        server = ThreadedMotoServer("127.0.0.1", 0, verbose=False)
        server.start()
        host, port = server.get_host_and_port()
        print(f"http://{host}:{port}", flush=True)
    else:
        from packer.storage.emulate import EmulatedStore

        store = EmulatedStore(folder, latency=latency, bandwidth=bandwidth or None).start()
        print(store.endpoint, flush=True)
    sys.stdin.read()


class Server:
    def __init__(self, kind: str, folder: Path, latency: float = 0.0, bandwidth: float = 0.0) -> None:
        self.proc = subprocess.Popen([sys.executable, __file__, "--serve", kind, str(folder), str(latency),
                                      str(bandwidth)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                     stderr=subprocess.DEVNULL,
                                     env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])})
        assert self.proc.stdout is not None
        self.endpoint = self.proc.stdout.readline().strip()

    def cpu(self) -> float:
        from packer import sysinfo

        return sysinfo.cpu_seconds(str(self.proc.pid)) or 0.0

    def close(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.close()
        self.proc.wait(10)


def obstore_client(endpoint: str, **retry):
    from obstore.store import S3Store

    return S3Store("packer", endpoint=endpoint, region="us-east-1", access_key_id="testing",
                   secret_access_key="testing", client_options={"allow_http": True}, **retry)


def s3fs_client(endpoint: str):
    import s3fs

    return s3fs.S3FileSystem(key="testing", secret="testing", skip_instance_cache=True,
                             client_kwargs={"endpoint_url": endpoint, "region_name": "us-east-1"})


def cpu_now() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def ranges_of(size: int, nbytes: int, count: int, seed: int = 0) -> list[tuple[int, int]]:
    rng = random.Random(seed)
    starts = [rng.randrange(0, size - nbytes) for _ in range(count)]
    return [(s, s + nbytes) for s in starts]


def fetch_all(client: str, store, ranges, inflight: int) -> int:
    """Fetch every range with ``inflight`` requests at once; the bytes received."""
    import obstore as obs

    if client == "obstore-async":
        async def run():
            sem = asyncio.Semaphore(inflight)

            async def one(a, b):
                async with sem:
                    return len(await obs.get_range_async(store, KEY, start=a, end=b))
            return sum(await asyncio.gather(*(one(a, b) for a, b in ranges)))
        return asyncio.run(run())
    if client == "obstore-threads":
        with ThreadPoolExecutor(inflight) as pool:
            return sum(pool.map(lambda r: len(obs.get_range(store, KEY, start=r[0], end=r[1])), ranges))
    from fsspec.asyn import sync

    async def run_s3fs():
        sem = asyncio.Semaphore(inflight)

        async def one(a, b):
            async with sem:
                return len(await store._cat_file(f"packer/{KEY}", start=a, end=b))
        return sum(await asyncio.gather(*(one(a, b) for a, b in ranges)))
    return sync(store.loop, run_s3fs)


def make(client: str, endpoint: str):
    return s3fs_client(endpoint) if client == "s3fs" else obstore_client(endpoint)


def latency(client: str, endpoint: str, size: int, count: int) -> dict:
    store = make(client, endpoint)
    fetch_all(client, store, ranges_of(size, 100_000, 2), 1)  # connect
    times = []
    for r in ranges_of(size, 100_000, count, seed=1):
        t = time.perf_counter()
        fetch_all(client, store, [r], 1)
        times.append((time.perf_counter() - t) * 1e3)
    return {"median_ms": statistics.median(times), "p90_ms": sorted(times)[int(0.9 * len(times))]}


def throughput(client: str, server: Server, size: int, nbytes: int, inflight: int, total: int) -> dict:
    store = make(client, server.endpoint)
    fetch_all(client, store, ranges_of(size, nbytes, inflight, seed=2), inflight)  # connections up
    ranges = ranges_of(size, nbytes, max(inflight, total // nbytes), seed=3)
    c0, s0, t0 = cpu_now(), server.cpu(), time.perf_counter()
    got = fetch_all(client, store, ranges, inflight)
    wall, cpu, scpu = time.perf_counter() - t0, cpu_now() - c0, server.cpu() - s0
    mb = got / 1e6
    return {"MB_per_s": mb / wall, "client_cpu_ms_per_MB": cpu / mb * 1e3, "server_cpu_ms_per_MB": scpu / mb * 1e3,
            "requests": len(ranges)}


def after_fork(client: str, endpoint: str) -> str:
    """A client used in the parent, then used in a forked child (10 s alarm): what happens."""
    store = make(client, endpoint)
    fetch_all(client, store, [(0, 1000)], 1)
    pid = os.fork()
    if pid == 0:
        signal.alarm(10)
        try:
            ok = fetch_all(client, store, [(0, 1000)], 1) == 1000
            os._exit(0 if ok else 3)
        except BaseException:
            os._exit(4)
    _, status = os.waitpid(pid, 0)
    if os.WIFSIGNALED(status):
        return f"child killed by signal {os.WTERMSIG(status)} (hung: 10 s alarm)" if os.WTERMSIG(status) == 14 else \
            f"child died with signal {os.WTERMSIG(status)}"
    return {0: "works in the child", 3: "wrong bytes in the child", 4: "raises in the child"}[os.WEXITSTATUS(status)]


def shared_by_threads(client: str, endpoint: str, size: int, data: bytes) -> str:
    """8 threads share one client, 200 ranged reads in all; every range's bytes checked."""
    import obstore as obs

    store = make(client, endpoint)
    ranges = ranges_of(size, 50_000, 200, seed=4)

    def one(r):
        a, b = r
        got = bytes(obs.get_range(store, KEY, start=a, end=b)) if client != "s3fs" else \
            store.cat_file(f"packer/{KEY}", start=a, end=b)
        return got == data[a:b]
    with ThreadPoolExecutor(8) as pool:
        ok = sum(pool.map(one, ranges))
    return f"{ok}/{len(ranges)} correct"


def interrupt_blocking(client: str, endpoint: str) -> str:
    """Ctrl-C (SIGINT from outside, 0.5 s in) during a blocking read (the library's sync call in the main thread)
    of a slow body (1 KB/s, 30 s in all): seconds from the signal until KeyboardInterrupt, or until the read
    finished regardless."""
    call = ("import obstore as obs; obs.get_range(store, KEY, start=0, end=30_000)" if client != "s3fs" else
            "store.cat_file('packer/' + KEY, start=0, end=30_000)")
    code = f"""
import time, sys
sys.path.insert(0, {str(Path(__file__).resolve().parent)!r})
from measure_storage import make, KEY
store = make({client!r}, {endpoint!r})
print("reading", flush=True)
t = time.perf_counter()
try:
    {call}
    print("finished", time.perf_counter() - t - 0.5, flush=True)
except KeyboardInterrupt:
    print("interrupted", time.perf_counter() - t - 0.5, flush=True)
"""
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])})
    assert proc.stdout is not None
    proc.stdout.readline()
    time.sleep(0.5)
    proc.send_signal(signal.SIGINT)
    try:
        out, _ = proc.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()
        return "not interrupted within 60 s"
    words = out.split()
    return f"{words[0]} {float(words[1]):.2f} s after the signal" if len(words) > 1 else f"exit {proc.returncode}"


def cancel_async(endpoint: str) -> str:
    """obstore: an async read of a slow body cancelled 0.5 s in: seconds until the task is done."""
    import obstore as obs

    store = obstore_client(endpoint)

    async def run():
        task = asyncio.ensure_future(obs.get_range_async(store, KEY, start=0, end=30_000))
        await asyncio.sleep(0.5)
        t = time.perf_counter()
        task.cancel()
        try:
            await task
        except asyncio.CancelledError:
            return f"cancelled after {time.perf_counter() - t:.3f} s"
        return "finished anyway"
    return asyncio.run(run())


def site_size(names: list[str]) -> float:
    import importlib.metadata as md

    total = 0
    for name in names:
        dist = md.distribution(name)
        total += sum(dist.locate_file(f).stat().st_size for f in dist.files or [] if dist.locate_file(f).exists())
    return total / 1e6


def slow_server(folder: Path):
    """An emulated store in this process whose every GET body trickles at 1 KB/s, and one that answers 503 twice."""
    from packer.storage.emulate import EmulatedStore, Fault, FaultPlan

    slow = EmulatedStore(folder, faults=FaultPlan().add(Fault("slow", rate=1000), times=-1)).start()
    flaky = FaultPlan()
    return slow, EmulatedStore(folder, faults=flaky).start(), flaky


def retries(client: str, endpoint: str, flaky) -> str:
    from packer.storage.emulate import Fault

    store = make(client, endpoint)
    flaky.add(Fault("status", 503, "SlowDown"), times=2)
    try:
        fetch_all(client, store, [(0, 1000)], 1)
        return "retried: read after two 503 SlowDown"
    except Exception as exc:
        return f"raised {type(exc).__name__}"
    finally:
        flaky.clear()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--serve", nargs=4, help=argparse.SUPPRESS)
    ap.add_argument("--size-mb", type=int, default=64, help="the object read (random bytes)")
    ap.add_argument("--megabytes", type=int, default=48, help="bytes moved per throughput cell")
    ap.add_argument("--json", help="write the figures here")
    args = ap.parse_args()
    if args.serve:
        kind, folder, lat, bw = args.serve
        return serve(kind, folder, float(lat), float(bw))
    clients = ["obstore-async", "obstore-threads", "s3fs"]
    out: dict = {"cores": os.cpu_count(), "python": sys.version.split()[0]}
    import obstore
    import s3fs

    out["versions"] = {"obstore": obstore.__version__, "s3fs": s3fs.__version__}
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        size = args.size_mb << 20
        data = os.urandom(size)
        (folder / KEY).write_bytes(data)
        fast, moto = Server("emulate", folder), Server("moto", folder)
        import boto3

        s3 = boto3.client("s3", endpoint_url=moto.endpoint, region_name="us-east-1", **CREDS)
        s3.create_bucket(Bucket="packer")
        s3.put_object(Bucket="packer", Key=KEY, Body=data)
        total = args.megabytes * 1_000_000
        out["latency_100KB"] = {f"{srv}/{c}": latency(c, s.endpoint, size, 60)
                                for srv, s in (("moto", moto), ("emulated", fast)) for c in clients}
        print(json.dumps(out["latency_100KB"], indent=1), flush=True)
        out["throughput"] = {}
        for srv, s, flights, moved in (("emulated", fast, (1, 8, 32, 64), total), ("moto", moto, (1, 8), total // 6)):
            for nbytes in (1_000_000, 100_000):
                for n in flights:
                    for c in clients:
                        cell = throughput(c, s, size, nbytes, n, moved)
                        out["throughput"][f"{srv}/{nbytes // 1000}KB/{n}/{c}"] = cell
                        print(f"{srv} {nbytes // 1000} KB x{n} {c}: {cell}", flush=True)
        link = Server("emulate", folder, latency=0.02, bandwidth=125e6)
        try:
            out["link_1gbit_20ms"] = {f"{nb // 1000}KB/{n}": throughput("obstore-async", link, size, nb, n, total)
                                      for nb in (1_000_000, 100_000) for n in (8, 32, 64)}
        finally:
            link.close()
        print(json.dumps(out["link_1gbit_20ms"], indent=1), flush=True)
        out["after_fork"] = {c: after_fork(c, fast.endpoint) for c in ("obstore-async", "s3fs")}
        out["threads_share_one_client"] = {c: shared_by_threads(c, fast.endpoint, size, data)
                                           for c in ("obstore-threads", "s3fs")}
        slow, flaky_store, flaky = slow_server(folder)
        try:
            out["sigint_during_blocking_read"] = {c: interrupt_blocking(c, slow.endpoint)
                                                  for c in ("obstore", "s3fs")}
            out["cancel_async_read"] = {"obstore-async": cancel_async(slow.endpoint)}
            out["default_retry_of_503"] = {c: retries(c, flaky_store.endpoint, flaky)
                                           for c in ("obstore-async", "s3fs")}
        finally:
            slow.stop()
            flaky_store.stop()
        fast.close()
        moto.close()
    out["install_MB"] = {
        "obstore": site_size(["obstore"]),
        "s3fs": site_size(["s3fs", "aiobotocore", "botocore", "aiohttp", "aioitertools", "jmespath", "multidict",
                           "yarl", "propcache", "frozenlist", "aiosignal", "aiohappyeyeballs", "wrapt", "urllib3",
                           "python-dateutil"]),
    }
    print(json.dumps({k: v for k, v in out.items() if k not in ("throughput", "latency_100KB", "link_1gbit_20ms")},
                     indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
