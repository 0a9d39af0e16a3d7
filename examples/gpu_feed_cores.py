"""examples/gpu_feed.py's second part: how decoding scales with cores, and where it stops scaling, why.

``scaling``: full decode (whole images) and train224 (``RandomResizedCropDecode(224)``) at each thread or worker
count N, through ThreadLoader (N threads), DataLoader (N workers), packer.dali on the CPU (N threads) and FFCV
(N workers, where it imports; examples/bench_peers.py's loader), plus bare libjpeg-turbo on N threads at once
(examples/measure_threads.py's): images/s from the first batch on for a fixed time, CPU per image of every
process, the fraction of N x one bare libjpeg-turbo thread (timed in the same run, before and after) and of
the same loader's own rate on one thread (linear scaling).

``gil``: what bounds a single process whatever its thread count: CPU per sample of ThreadLoader on raw 32x32
pixels (no decode: the Python work, which holds the GIL, and small copies), i.e. at most 1 / that samples/s
per process; each ThreadLoader row under 90 % of linear with its CPU per image beyond bare libjpeg-turbo's;
and the setting that spreads that work: R processes of N/R threads each (one ThreadLoader per rank).
"""

from __future__ import annotations

import multiprocessing as mp
import statistics
import sys
import time
from collections.abc import Callable, Generator, Iterable
from pathlib import Path

from torch.utils.data import DataLoader

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_peers  # noqa: E402
import measure_threads  # noqa: E402
from gpu_feed_train import long_order  # noqa: E402

import packer  # noqa: E402
from packer.errors import PackerError  # noqa: E402
from packer.images.decode import turbojpeg_available, turbojpeg_missing_reason  # noqa: E402
from packer.read.dali import import_dali  # noqa: E402

LINEAR = 0.90  # a ThreadLoader row under this fraction of linear gets its GIL-held time measured
Counts = Callable[[], Generator[int, None, None]]  # a run: yields each batch's image count, without end


def steady_rate(run: Counts, seconds: float) -> dict:
    """images/s from the first batch handed out until ``seconds`` later (a loader's start left out), and CPU ms
    per image of this process and of its children over the whole run (the run's workers are joined before the
    CPU is read: a generator's loader ends when it is closed)."""
    cpu0, t0 = measure_threads.cpu_seconds(), time.perf_counter()
    it = run()
    first, n, n_first = None, 0, 0
    try:
        for count in it:
            n += count
            now = time.perf_counter()
            if first is None:
                first, n_first = now, n
            elif now - first >= seconds:
                break
    finally:
        end = time.perf_counter()
        it.close()  # the loader inside ends here: threads stopped, workers joined
        del it
    cpu = measure_threads.cpu_seconds() - cpu0
    if first is None or n == n_first:
        return {"images": n, "images_per_s": n / (end - t0), "cpu_ms_per_image": 1e3 * cpu / max(n, 1),
                "first_batch_s": end - t0, "note": "one batch in all: the whole run's rate"}
    return {"images": n, "images_per_s": (n - n_first) / (end - first), "cpu_ms_per_image": 1e3 * cpu / n,
            "first_batch_s": first - t0}


def repeat(epoch: Callable[[], Iterable[int]]) -> Generator[int, None, None]:
    while True:
        yield from epoch()


def thread_run(ds, n: int, batch: int, epochs: int) -> Generator[int, None, None]:
    for images, _labels in packer.ThreadLoader(ds, batch_size=batch, sampler=long_order(len(ds), epochs),
                                               num_threads=n):
        yield len(images)


def worker_run(ds, n: int, batch: int, epochs: int) -> Generator[int, None, None]:
    loader = DataLoader(ds, batch_size=batch, sampler=long_order(len(ds), epochs), num_workers=n,
                        collate_fn=packer.collate)
    for images, _labels in loader:
        yield len(images)


def dali_run(path: Path, n: int, batch: int, augment: str) -> Generator[int, None, None]:
    pipe = packer.dali.pipeline(path, batch, device="cpu", augment=augment, num_threads=n)  # type: ignore[arg-type]
    while True:
        try:
            out = pipe.run()
        except StopIteration:
            pipe.reset()
            continue
        yield len(out[1])


def bare_run(payloads: list[bytes], batch: int, threads: int, chunk: int | None = None
             ) -> Generator[int, None, None]:
    """Bare libjpeg-turbo on ``threads`` threads at once, ``chunk`` payloads a round (all: None); one thread
    yields each batch as it is done, as a loader hands batches out."""
    if threads == 1:
        return repeat(lambda: measure_threads.bare_epoch(payloads, batch))
    some = (payloads * -(-chunk // len(payloads)))[:chunk] if chunk else payloads  # repeated if too few
    return repeat(lambda: measure_threads.bare_threads_epoch(some, batch, threads))


def scaling(path: Path, photos: Path, work: Path, threads: list[int], seconds: float, batch: int = 64,
            loaders: Iterable[str] = ("ThreadLoader", "DataLoader", "DALI CPU", "FFCV"), bare: bool | None = None,
            log: Callable[[str], None] = print) -> dict:
    """Every loader at every N, both settings; each run ``seconds`` long after its first batch. The bare
    one-thread rate is timed first and last (drift shows as their difference); ``bare`` False (default: where
    libjpeg-turbo loads) leaves the bare reference out, and with it every fraction of N x bare."""
    ds_full = packer.open_dataset(path, image="tensor")
    payloads = [bytes(b) for b in ds_full.read_payloads(range(len(ds_full)))]
    loaders = list(loaders)
    if bare is None:
        bare = turbojpeg_available()
    bare_missing = None if bare else turbojpeg_missing_reason() or "left out"
    bare_first: dict | None = None
    if bare_missing is None:
        log(f"scaling: bare libjpeg-turbo, 1 thread, {seconds:.1f} s")
        bare_first = steady_rate(lambda: bare_run(payloads, batch, 1), seconds)
    epochs = 64
    skipped: dict[str, str] = {}
    rows: list[dict] = []
    ffcv: dict | None = None
    if "FFCV" in loaders:
        try:
            ffcv = bench_peers.ffcv_epochs(photos, work, max(threads), batch)  # the .beton, written once
        except ImportError as exc:
            skipped["FFCV"] = f"does not import: {exc}"
    if "DALI CPU" in loaders:
        try:
            import_dali()
        except PackerError as exc:
            skipped["DALI CPU"] = str(exc)
    for setting in ("full", "train224"):
        ds = ds_full if setting == "full" else packer.open_dataset(path, image="tensor",
                                                                   crop=packer.RandomResizedCropDecode(224))
        for n in threads:
            runs: dict[str, Counts] = {}
            if "ThreadLoader" in loaders:
                runs["ThreadLoader"] = lambda d=ds, k=n: repeat(lambda: thread_run(d, k, batch, epochs))
            if "DataLoader" in loaders:
                runs["DataLoader"] = lambda d=ds, k=n: repeat(lambda: worker_run(d, k, batch, epochs))
            if "DALI CPU" in loaders and "DALI CPU" not in skipped:
                runs["DALI CPU"] = lambda k=n, s=setting: dali_run(path, k, batch, "none" if s == "full" else "train")
            if ffcv is not None:
                made = bench_peers.ffcv_epochs(photos, work, n, batch)[(setting, "training")]
                runs["FFCV"] = lambda e=made: repeat(e)
            if setting == "full" and bare_first is not None:  # rounds of about a quarter second: a steady rate
                chunk = max(batch * n, int(0.25 * n * bare_first["images_per_s"]))
                runs["bare libjpeg-turbo"] = lambda k=n, c=chunk: bare_run(payloads, batch, k, c)
            for name, run in runs.items():
                log(f"scaling: {setting}, {name}, {n} thread(s)/worker(s), {seconds:.1f} s")
                row: dict = {"setting": setting, "loader": name, "n": n}
                try:
                    row.update(steady_rate(run, seconds))
                except Exception as exc:  # noqa: BLE001 - one loader failing never loses the others' figures
                    row["error"] = f"{type(exc).__name__}: {exc}"
                rows.append(row)
    reference: dict = {"missing": f"no bare libjpeg-turbo ({bare_missing}): no fraction of N x bare"}
    bare_rate = None
    if bare_first is not None:
        log(f"scaling: bare libjpeg-turbo, 1 thread again, {seconds:.1f} s")
        bare_last = steady_rate(lambda: bare_run(payloads, batch, 1), seconds)
        bare_rate = statistics.fmean([bare_first["images_per_s"], bare_last["images_per_s"]])
        reference = {"first": bare_first, "last": bare_last, "images_per_s": bare_rate, "cpu_ms_per_image":
                     statistics.fmean([bare_first["cpu_ms_per_image"], bare_last["cpu_ms_per_image"]])}
    one = {(r["setting"], r["loader"]): r["images_per_s"] for r in rows if r["n"] == 1 and "images_per_s" in r}
    for r in rows:
        if "images_per_s" in r and bare_rate is not None:
            r["of_n_bare"] = r["images_per_s"] / (r["n"] * bare_rate)
        if "images_per_s" in r and (r["setting"], r["loader"]) in one:
            r["of_linear"] = r["images_per_s"] / (r["n"] * one[(r["setting"], r["loader"])])
    return {"threads": threads, "batch_size": batch, "seconds_per_run": seconds, "images": len(payloads),
            "bare_one_thread": reference,
            "rows": rows, "skipped": skipped,
            "note": "of_n_bare: images/s over N x one bare libjpeg-turbo thread's full decodes (train224 decodes "
                    "less than a whole image, so it can pass 1); of_linear: over N x the same loader on one thread"}


def shortfalls(result: dict) -> list[dict]:
    """ThreadLoader rows under ``LINEAR`` of linear: full decode against N x bare, train224 against its own
    one-thread rate."""
    out = []
    for r in result["rows"]:
        if r["loader"] != "ThreadLoader" or r["n"] == 1:
            continue
        frac = r.get("of_n_bare", r.get("of_linear")) if r["setting"] == "full" else r.get("of_linear")
        if frac is not None and frac < LINEAR:
            out.append({**r, "fraction": frac})
    return out


def _rank(path: str, ranks: int, rank: int, threads: int, batch: int, seconds: float, barrier, results) -> None:
    """One rank's ThreadLoader over its share of each epoch: images and seconds from the common start on."""
    try:
        ds = packer.open_dataset(path, image="tensor")

        def epoch() -> Generator[int, None, None]:
            order = long_order(len(ds), 16)[rank::ranks]
            for images, _labels in packer.ThreadLoader(ds, batch_size=batch, sampler=order, num_threads=threads):
                yield len(images)

        it = repeat(epoch)
        next(it)
        barrier.wait(timeout=300)  # every rank past its start before any is timed
        t0, n = time.perf_counter(), 0
        while time.perf_counter() - t0 < seconds:
            n += next(it)
        results.put((rank, n, time.perf_counter() - t0, None))
        it.close()
    except Exception as exc:  # noqa: BLE001 - said to the parent, which reports it
        barrier.abort()
        results.put((rank, 0, 0.0, f"{type(exc).__name__}: {exc}"))


def ranks_rate(path: Path, ranks: int, threads: int, batch: int, seconds: float) -> dict:
    """R spawned processes of T threads each, timed together: their summed images/s."""
    ctx = mp.get_context("spawn")
    barrier, results = ctx.Barrier(ranks), ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(str(path), ranks, r, threads, batch, seconds, barrier, results))
             for r in range(ranks)]
    for p in procs:
        p.start()
    try:
        got = [results.get(timeout=seconds + 600) for _ in procs]
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.terminate()  # one of ours that did not end: stopped, the run goes on
                p.join(timeout=10)
    errors = [e for *_, e in got if e is not None]
    if errors:
        raise RuntimeError(f"a rank failed: {errors[0]}")
    return {"ranks": ranks, "threads_per_rank": threads, "images_per_s": sum(n / s for _, n, s, _ in got)}


def gil(path: Path, work: Path, photos: Path, scaled: dict | None, seconds: float, cores: int, batch: int = 64,
        log: Callable[[str], None] = print) -> dict:
    """CPU per sample of ThreadLoader without decoding (raw 32x32), the ThreadLoader rows under 90 % of linear
    with their CPU per image beyond bare libjpeg-turbo's, and R ranks x N/R threads at N = ``cores``."""
    raw = work / "raw32.memmap"
    if not raw.exists():
        packer.convert(photos, raw, to="memmap", payload="raw", resize="32x32", workers=cores, progress=False)
    ds = packer.open_dataset(raw, image="tensor")
    out: dict = {"raw32": [], "shortfalls": [], "ranks": []}
    for n in sorted({1, cores}):
        for b in (64, 256):
            log(f"gil: raw 32x32 through ThreadLoader, {n} thread(s), batch {b}, {seconds:.1f} s")
            r = steady_rate(lambda k=n, bb=b: repeat(lambda: thread_run(ds, k, bb, 16)), seconds)
            r.update({"threads": n, "batch_size": b, "cpu_us_per_sample": 1e3 * r["cpu_ms_per_image"],
                      "ceiling_samples_per_s": 1e3 / r["cpu_ms_per_image"] if r["cpu_ms_per_image"] else None})
            out["raw32"].append(r)
    if scaled is not None:
        bare_cpu = scaled["bare_one_thread"].get("cpu_ms_per_image")
        for r in shortfalls(scaled):
            out["shortfalls"].append({"setting": r["setting"], "n": r["n"], "fraction": r["fraction"],
                                      "cpu_us_per_image": 1e3 * r["cpu_ms_per_image"],
                                      "bare_cpu_us_per_image": None if bare_cpu is None else 1e3 * bare_cpu})
        bare = scaled["bare_one_thread"].get("images_per_s")
        for ranks in (2, 4):
            if ranks > cores or cores % ranks:
                continue
            log(f"gil: full decode, {ranks} processes x {cores // ranks} threads, {seconds:.1f} s")
            try:
                row = ranks_rate(path, ranks, cores // ranks, batch, seconds)
                row["of_n_bare"] = None if bare is None else row["images_per_s"] / (cores * bare)
            except Exception as exc:  # noqa: BLE001
                row = {"ranks": ranks, "error": f"{type(exc).__name__}: {exc}"}
            out["ranks"].append(row)
    return out

