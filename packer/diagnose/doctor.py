"""``packer doctor [PATH]``: measure what will limit data loading here, then say what to do.

Each probe is brief and bounded (``seconds`` per rate, at most 400 files, a 64 MB scratch file);
the primitives are ``measure``'s and ``system``'s, shared with ``packer bench``. The verdict
(``doctor_rules``) is a list of findings, each naming the measured figures that drive it, so a
person can check the reasoning.
"""

from __future__ import annotations

import os
import resource
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

from packer import sysinfo
from packer.diagnose import gpu, measure, system
from packer.diagnose.doctor_rules import judge
from packer.units import human_bytes
from packer.write.scan import IMG_EXTENSIONS

MAX_FILES = 400  # images looked at under PATH


# ----------------------------------------------------------------------------- what PATH holds

def _image_files(path: Path, limit: int, seconds: float) -> tuple[list[str], int, bool]:
    """Up to ``limit`` image files under ``path`` spread over the tree, how many were seen, and
    whether the count is complete (stopped after ``seconds``)."""
    seen: list[str] = []
    complete, t0 = True, time.monotonic()
    stack = [str(path)]
    while stack:
        if time.monotonic() - t0 > seconds:
            complete = False
            break
        d = stack.pop()
        try:
            entries = sorted(os.scandir(d), key=lambda e: e.name)
        except OSError:
            continue
        for e in entries:
            if e.name.startswith("."):
                continue
            if e.is_dir(follow_symlinks=False):
                stack.append(e.path)
            elif os.path.splitext(e.name)[1].lower() in IMG_EXTENSIONS and e.is_file():
                seen.append(e.path)
    return [seen[i] for i in measure.spread(len(seen), limit)], len(seen), complete


def _dataset(path: Path) -> Any:
    if (path / "manifest.json").is_file():
        from packer.read.dataset import open_dataset

        return open_dataset(path)
    return None


def _generated_jpegs(k: int = 8) -> list[bytes]:
    """``k`` photo-like 500x375 JPEGs at quality 90, made in memory."""
    import io

    import numpy as np

    from packer.tools.sample import photo_like

    rng = np.random.default_rng(0)
    out = []
    for i in range(k):
        buf = io.BytesIO()
        photo_like(rng, 375, 500, i).save(buf, format="JPEG", quality=90)
        out.append(buf.getvalue())
    return out


def _decode_samples(path: Path | None, ds: Any, files: list[str]) -> tuple[list[bytes], str]:
    """A few encoded images to time the decoders on: the user's own when there are any."""
    if path is not None and ds is not None and ds.manifest.payload == "encoded" and len(ds):
        out = measure.load_samples(path, 16)
        return out, f"{len(out)} samples of {path}"
    out = measure.load_samples(files, 16) if files else []
    if out:
        return out, f"{len(out)} images from {path}"
    why = "no PATH given" if path is None else f"no images under {path}"
    return _generated_jpegs(8), f"8 generated photo-like 500x375 JPEGs at quality 90 ({why})"


# ----------------------------------------------------------------------------- probes

def probe_machine() -> dict:
    m = system.describe_machine()
    mem = sysinfo.meminfo()
    m["memory"] = {k: mem.get(k) for k in ("MemTotal", "MemAvailable", "Cached", "Buffers", "Shmem", "SwapTotal")}
    shm = sysinfo.disk_space(sysinfo.SHM_DIR)
    m["shm"] = {"path": str(sysinfo.SHM_DIR), "free": shm[0], "size": shm[1]} if shm else None
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    m["open_files_limit"] = {"soft": soft, "hard": hard}
    return m


def probe_smi(seconds: float) -> dict:
    """What nvidia-smi lists, with each GPU's utilisation and memory sampled over ``seconds`` (at most 1 s)
    before this process touches a GPU: what other jobs do with it now."""
    q = gpu.query()
    out: dict[str, Any] = {**q.to_dict(), "sampled_s": 0.0, "usage": []}
    if q.error is not None:
        return out
    window = min(seconds, 1.0)
    with gpu.GpuSampler() as sampler:
        time.sleep(window)
    out["sampled_s"], out["usage"] = window, [asdict(u) for u in sampler.usage()]
    if sampler.error is not None:
        out["sample_error"] = sampler.error
    return out


def probe_gpu(seconds: float) -> dict:
    smi = probe_smi(seconds)  # first: the h2d probe below puts this process on the GPU
    import torch

    out: dict[str, Any] = {"torch": torch.__version__, "cuda_build": torch.version.cuda,
                           "available": torch.cuda.is_available(), "devices": [], "pinned_memory": False,
                           "smi": smi}
    if not out["available"]:
        try:
            torch.empty(1).pin_memory()
            out["pinned_memory"] = True
        except RuntimeError as exc:
            out["pinned_memory_error"] = str(exc).splitlines()[0]
        return out
    out["devices"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    n = 64 << 20
    pinned = torch.empty(n, dtype=torch.uint8).pin_memory()
    out["pinned_memory"] = True
    dev = torch.empty(n, dtype=torch.uint8, device="cuda")
    for name, src in (("pageable", torch.empty(n, dtype=torch.uint8)), ("pinned", pinned)):
        def copy(src: torch.Tensor = src) -> int:
            dev.copy_(src, non_blocking=True)
            torch.cuda.synchronize()
            return n

        copy()  # warm-up
        t = measure.timed(copy, min(seconds, 0.5) / 2, min_passes=3)
        out[f"h2d_{name}_GBps"] = t.items / t.wall_s / 1e9
    return out


def probe_decoders(samples: list[bytes], seconds: float) -> dict:
    from packer.images.decode import turbojpeg_available, turbojpeg_missing_reason

    out: dict[str, Any] = {"libturbojpeg": turbojpeg_available(), "libturbojpeg_error": turbojpeg_missing_reason(),
                           "per_core": {}}
    for b in ["pil"] + (["turbojpeg"] if out["libturbojpeg"] else []):
        try:
            r = measure.decode_rate(samples, b, seconds=seconds, repeats=3)
        except Exception as exc:  # noqa: BLE001 - a broken decoder is a finding, not a crash
            out["per_core"][b] = {"error": str(exc)}
            continue
        out["per_core"][b] = {"img_per_s": r.value, "low": r.low, "high": r.high, "detail": r.detail}
    return out


def _source_folder(path: Path, ds: Any) -> Path | None:
    """The loose folder a packed dataset was converted from, if it is still there."""
    if ds is None or not ds.manifest.source:
        return None
    src = Path(ds.manifest.source)
    for cand in (src, path.parent / src.name):
        if cand.is_dir() and os.stat(cand).st_dev == os.stat(path).st_dev:
            return cand
    return None


def _small_files(path: Path, ds: Any, files: list[str], st: dict) -> tuple[list[str], Path | None]:
    """Files for the cold small-file reads: the user's images, else the folder a packed dataset came
    from, else 200 scratch files of 110 KB written here (the folder returned, to be removed)."""
    source = _source_folder(path, ds)
    if not files and source is not None:
        files, _, _ = _image_files(source, MAX_FILES, 2.0)
        st["small_files_from"] = str(source)
    writable_dir = path if path.is_dir() else path.parent
    if files or not os.access(writable_dir, os.W_OK):
        return files, None
    import numpy as np

    scratch = Path(tempfile.mkdtemp(prefix=".packer-doctor-", dir=writable_dir))
    rng = np.random.default_rng(0)
    for k in range(200):
        with open(scratch / f"f{k:04d}.jpg", "wb") as fh:
            fh.write(rng.bytes(110_000))
            fh.flush()
            os.fsync(fh.fileno())
    st["small_files_from"] = "200 scratch files of 110 KB written here"
    return sorted(str(p) for p in scratch.iterdir()), scratch


def _sequential_read(path: Path, shards: list[Path], seconds: float, log: Callable[[str], None]) -> dict | None:
    """Cold sequential read: of the largest packed shard if there is one of 16 MB or more, else of a scratch file."""
    big = max(shards, key=lambda p: p.stat().st_size) if shards else None
    if big is not None and big.stat().st_size >= 16 << 20:
        log(f"cold sequential read of {big.name}")
        r = measure.cold_read([big], max_bytes=256 << 20, seconds=seconds)
        return {"MB_per_s": r.mb_per_s, "detail": f"first {r.timing.items / 1e6:.0f} MB of {big.name}, "
                f"{measure.READ_BLOCK >> 20} MB reads", "eviction_verified": r.cold}
    writable_dir = path if path.is_dir() else path.parent
    if not os.access(writable_dir, os.W_OK):
        return None
    log("cold sequential read of a 64 MB scratch file")
    rate = measure.sequential_read_ceiling(writable_dir, nbytes=64 << 20, repeats=2)
    return {"MB_per_s": rate.value, "detail": rate.detail, "eviction_verified": "NOT verified" not in rate.detail}


def probe_storage(path: Path, ds: Any, files: list[str], seconds: float, log: Callable[[str], None]) -> dict:
    st = system.describe_storage(path)
    small, scratch = _small_files(path, ds, files, st)
    try:
        if small:
            log(f"cold small-file reads ({len(small)} files at most, {seconds:g} s)")
            r = measure.cold_read(small, seconds=seconds)
            st["small_file_read"] = {"files": r.files, "files_per_s": r.files_per_s, "MB_per_s": r.mb_per_s,
                                     "mean_KB": r.timing.items / 1e3 / max(r.files, 1), "eviction_verified": r.cold}
    finally:
        if scratch is not None:
            shutil.rmtree(scratch, ignore_errors=True)
    shards = []
    if ds is not None:
        shards = [p for p in (path / f.name for f in ds.manifest.all_files()) if p.is_file()]
        ds.close()  # pages mapped by an open reader can't be evicted
    seq = _sequential_read(path, shards, seconds, log)
    missing = []
    if seq is None:
        missing.append(f"sequential read: {path} is not writable and holds no file of 16 MB or more to read")
    else:
        st["sequential_read"] = seq
    if not small:
        missing.append(f"small-file reads: no images under {path} and it is not writable for scratch files")
    if missing:
        st["not_measured"] = "; ".join(missing)
    return st


def probe_data(ds: Any, files: list[str], count: int, complete: bool) -> dict:
    if ds is not None:
        size = sum(f.num_bytes for f in ds.manifest.all_files())
        return {"kind": f"packed dataset ({ds.manifest.format}, {ds.manifest.payload})", "samples": len(ds),
                "bytes": size, "mean_sample_bytes": size / max(len(ds), 1)}
    if files:
        sizes = [os.path.getsize(f) for f in files[:200]]
        mean = sum(sizes) / len(sizes)
        return {"kind": "loose image files", "samples": count, "samples_complete": complete,
                "bytes": int(mean * count), "mean_sample_bytes": mean}
    return {"kind": "no images found", "samples": 0, "bytes": 0, "mean_sample_bytes": None}


# ----------------------------------------------------------------------------- driver

def diagnose(path: str | os.PathLike | None = None, seconds: float = 1.0, progress: bool = True,
             storage_options: dict[str, Any] | None = None) -> dict:
    """Measure this machine (and the storage and data under ``path``, or the link to a dataset at a URL) and judge;
    a JSON-ready dict."""
    from packer.errors import PackerError
    from packer.layout.remote import is_remote
    from packer.storage.url import redact, refuse_url

    remote = path is not None and is_remote(path)
    if path is not None and not remote:
        refuse_url(path, "packer doctor")
    log = (lambda msg: print(f"doctor: {msg}", file=sys.stderr, flush=True)) if progress else (lambda msg: None)
    if not 0 < float(seconds) < float("inf"):
        raise PackerError(f"seconds {seconds!r}: expected a positive time budget")
    seconds = max(0.1, float(seconds))
    report: dict[str, Any] = {"path": None, "seconds_per_probe": seconds}
    log("machine, memory, limits")
    report["machine"] = probe_machine()
    log("GPU")
    report["gpu"] = probe_gpu(seconds)
    ds, files, p, samples = None, [], None, []
    if remote:
        from packer.diagnose.doctor_remote import probe_remote

        report["path"] = redact(str(path))
        found = probe_remote(str(path), storage_options, log)
        report["data"], report["link"], samples = found["data"], found["link"], found["samples"]
        where = found["samples_from"]
    elif path is not None:
        p = Path(path)
        if not p.exists():
            raise PackerError(f"{path}: no such file or directory")
        report["path"] = str(p.resolve())
        ds = _dataset(p)
        count, complete = 0, True
        if ds is None and p.is_dir():
            files, count, complete = _image_files(p, MAX_FILES, 2.0)
        report["data"] = probe_data(ds, files, count, complete)
    if not samples:
        samples, where = _decode_samples(p, ds, files)
    log(f"decoders on {where}")
    report["decode"] = {**probe_decoders(samples, seconds), "samples": where}
    if p is not None:
        report["storage"] = probe_storage(p, ds, files, seconds, log)
    report["verdict"] = judge(report)
    return report


def smi_lines(smi: dict) -> list[str]:
    """nvidia-smi's part of the report in a line per GPU (or why it could not be asked)."""
    if smi.get("error"):
        return [smi["error"]]
    usage = {u["index"]: gpu.GpuUsage(**u) for u in smi.get("usage", [])}
    lines = []
    for g in smi.get("gpus", []):
        u = usage.get(g["index"]) or gpu.GpuUsage(g["index"], 1, g["utilization_pct"], g["utilization_pct"],
                                                  g["utilization_pct"], g["utilization_pct"], g["memory_used_mib"])
        lines.append(f"{u.line(g['memory_total_mib'], g['name'])}, over {smi['sampled_s']:g} s")
    if smi.get("sample_error"):
        lines.append(smi["sample_error"])
    return lines


def render(r: dict) -> str:
    """The report for people: figures by topic, then the verdict."""
    m, g, d = r["machine"], r["gpu"], r["decode"]
    mem = m["memory"]
    lines = [f"machine   {m['cpu']}, {m['cores_usable']} usable cores of {m['cores']}, load "
             f"{', '.join(f'{v:.1f}' for v in m.get('load_average') or [])}"]
    if mem.get("MemTotal"):
        lines.append(f"memory    {human_bytes(mem['MemTotal'])}, {human_bytes(mem['MemAvailable'] or 0)} available, "
                     f"page cache {human_bytes((mem.get('Cached') or 0) + (mem.get('Buffers') or 0))}")
    if m.get("shm"):
        lines.append(f"/dev/shm  {human_bytes(m['shm']['free'])} free of {human_bytes(m['shm']['size'])}")
    lines.append(f"limits    open files {m['open_files_limit']['soft']} (hard {m['open_files_limit']['hard']})")
    gpu_line = (f"{', '.join(g['devices'])}, CUDA {g['cuda_build']}, pinned memory "
                f"{'yes' if g['pinned_memory'] else 'no'}" if g["available"]
                else f"none (torch {g['torch']}, CUDA build {g['cuda_build']}; pinned memory: "
                     f"{'yes' if g['pinned_memory'] else 'no'})")
    lines.append(f"GPU       {gpu_line}")
    lines.extend(f"          nvidia-smi: {line}" for line in smi_lines(g.get("smi") or {}))
    turbo = "loaded" if d["libturbojpeg"] else f"MISSING: {d['libturbojpeg_error']}"
    lines.append(f"JPEG      libjpeg-turbo {turbo}")
    for name, v in d["per_core"].items():
        lines.append(f"decode    {name}: " + (f"{v['img_per_s']:,.0f} img/s per core ({v['low']:,.0f}-{v['high']:,.0f})"
                                             if "img_per_s" in v else f"failed: {v['error']}"))
    lines.append(f"          on {d['samples']}")
    if r.get("data"):
        da = r["data"]
        n = f"{da['samples']:,}" + ("" if da.get("samples_complete", True) else "+ (count stopped early)")
        lines.append(f"data      {r['path']}: {da['kind']}, {n} samples, {human_bytes(da['bytes'])}"
                     + (f", {da['mean_sample_bytes'] / 1e3:.0f} KB each" if da.get("mean_sample_bytes") else ""))
    if r.get("link"):
        li = r["link"]
        lines.append(f"link      {li['first_byte_s'] * 1e3:.1f} ms to the first byte (median of "
                     f"{len(li['first_byte_s_each'])} 1-byte GETs), {li['bandwidth_bytes_per_s'] / 1e6:,.0f} MB/s "
                     f"({li['in_flight']} ranged GETs of {human_bytes(li['range_bytes'])} at once, of {li['object']})")
    st = r.get("storage")
    if st:
        rot = {True: "rotational", False: "non-rotational", None: "rotational unknown"}[st.get("rotational")]
        lines.append(f"storage   {st.get('fstype')} ({st['kind']}) on {st.get('source')}, mounted at "
                     f"{st.get('mount_point')}; device {st.get('device') or 'none'} ({rot})")
        if st.get("small_file_read"):
            s = st["small_file_read"]
            small_from = f"\n          (small files: {st['small_files_from']})" if st.get("small_files_from") else ""
            lines.append(f"          cold small-file reads: {s['files_per_s']:,.0f} files/s "
                         f"({s['MB_per_s']:,.0f} MB/s, {s['files']} files of {s['mean_KB']:.0f} KB; eviction "
                         f"{'verified' if s['eviction_verified'] else 'NOT verified'})" + small_from)
        if st.get("sequential_read"):
            s = st["sequential_read"]
            lines.append(f"          cold sequential read: {s['MB_per_s']:,.0f} MB/s ({s['detail']})")
        if st.get("not_measured"):
            lines.append(f"          not measured: {st['not_measured']}")
    lines.append("")
    lines.append("verdict")
    lines.extend(f"  - {f['text']}" for f in r["verdict"])
    return "\n".join(lines)
