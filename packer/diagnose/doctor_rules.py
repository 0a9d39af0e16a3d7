"""The verdict of ``packer doctor``: one small rule function per finding.

Each rule takes the measured facts (``Facts``: the doctor's report and the figures several rules
share) and returns a finding that names the figures behind it, or None. ``judge`` applies
``RULES`` in order; a new finding is one more function and one more entry there.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from packer.units import human_bytes

BATCH_BYTES = 256 * 3 * 224 * 224  # one batch of 256 224x224 RGB uint8 images, for the /dev/shm advice

Finding = dict  # {"text": plain words naming the figures, "figures": {name: value}}


def _finding(text: str, **figures: Any) -> Finding:
    return {"text": text, "figures": figures}


@dataclass
class Facts:
    """The measured report and the figures several rules share."""

    r: dict
    cores: int  # usable
    per_core: dict[str, float]  # img/s per core of each decoder that worked
    best_decoder: str | None
    decode_all: float  # the best decoder on every usable core
    workers: int  # the num_workers advised

    @classmethod
    def of(cls, r: dict) -> Facts:
        cores = r["machine"]["cores_usable"] or 1
        per_core = {k: v["img_per_s"] for k, v in r["decode"]["per_core"].items() if "img_per_s" in v}
        best = max(per_core, key=lambda k: per_core[k]) if per_core else None
        return cls(r, cores, per_core, best, per_core[best] * cores if best else 0.0,
                   max(1, cores - 1) if cores > 2 else cores)

    @property
    def storage(self) -> dict:
        return self.r.get("storage") or {}


def busy_machine(f: Facts) -> Finding | None:
    load1 = (f.r["machine"].get("load_average") or [0])[0]
    if load1 <= 0.8 * f.cores:
        return None
    return _finding(f"the machine is busy: load {load1:.1f} on {f.cores} cores; the rates below are lower than on a "
                    "quiet machine, and loader workers will compete with whatever runs now.",
                    load1=load1, cores=f.cores)


def decode_ceiling(f: Facts) -> Finding | None:
    if not f.best_decoder:
        return None
    best = f.per_core[f.best_decoder]
    return _finding(
        f"decoding: {best:,.0f} img/s per core with {f.best_decoder} -> about {f.decode_all:,.0f} img/s on {f.cores} "
        f"cores: the most a CPU loader can deliver here; a model that trains faster will wait for data.",
        decode_per_core=best, decoder=f.best_decoder, cores=f.cores, decode_all=f.decode_all)


def libjpeg_turbo(f: Facts) -> Finding | None:
    dec, pc = f.r["decode"], f.per_core
    if not dec["libturbojpeg"] and "pil" in pc:
        return _finding(
            f"libjpeg-turbo is missing ({dec['libturbojpeg_error']}): JPEGs decode with Pillow at "
            f"{pc['pil']:,.0f} img/s per core; libjpeg-turbo decoded 1.14-1.28x faster than Pillow 13 in packer's "
            "measurements (docs/decoding.md): apt-get install libturbojpeg0 (or conda install libjpeg-turbo).",
            pil=pc["pil"])
    if "turbojpeg" in pc and "pil" in pc:
        return _finding(f"libjpeg-turbo decodes {pc['turbojpeg']:,.0f} img/s per core vs Pillow {pc['pil']:,.0f} "
                        f"({pc['turbojpeg'] / pc['pil']:.2f}x): keep decoder='auto'.",
                        turbojpeg=pc["turbojpeg"], pil=pc["pil"])
    return None


def storage_not_measured(f: Facts) -> Finding | None:
    if f.storage or f.r.get("link"):
        return None
    return _finding("storage not measured: run packer doctor PATH with PATH on the disk that holds the training data "
                    "to compare its cold small-file and sequential reads with decoding.")


def network_storage(f: Facts) -> Finding | None:
    st = f.storage
    if st.get("kind") not in ("network", "parallel"):
        return None
    return _finding(f"the data is on {st['fstype']} ({st['kind']} filesystem): every small file costs at least one "
                    "network round trip (open, stat, read); pack it, or copy the packed dataset to local disk.",
                    fstype=st["fstype"])


def rotational_disk(f: Facts) -> Finding | None:
    st = f.storage
    if not st.get("rotational"):
        return None
    small = st.get("small_file_read")
    fps = small["files_per_s"] if small else None
    if fps is not None and fps > 1000:
        text = (f"sysfs says {st['device']} is rotational, but it read {fps:,.0f} small files/s cold, which no "
                "spinning disk does: a virtual disk backed by faster storage or a host cache; go by the measured "
                "figures.")
    else:
        text = (f"{st['device']} is a spinning disk (rotational=1 in sysfs): random small reads manage ~100-200 per "
                "second; pack the data and read it in packer's block order.")
    return _finding(text, device=st["device"], rotational=True, small_files_per_s=fps)


def io_or_decode_bound(f: Facts) -> Finding | None:
    small, seq, data = f.storage.get("small_file_read"), f.storage.get("sequential_read"), f.r.get("data")
    if not (small and seq and data and data.get("mean_sample_bytes")):
        return None
    mean, rate, dec = data["mean_sample_bytes"], small["files_per_s"], f.decode_all
    packed = seq["MB_per_s"] * 1e6 / mean
    if dec and rate < dec:
        speedup = min(packed, dec) / min(rate, dec)
        return _finding(
            f"IO-bound on loose files when the page cache is cold: {rate:,.0f} files/s read cold vs {dec:,.0f} img/s "
            f"of decoding. Packed, the same storage streams {seq['MB_per_s']:,.0f} MB/s = {packed:,.0f} samples of "
            f"{mean / 1e3:.0f} KB per second: pack it (packer convert --to lmdb), expected ≈ {speedup:.1f}x on a cold "
            "epoch.", small_files_per_s=rate, decode_all=dec, sequential_MBps=seq["MB_per_s"],
            mean_sample_bytes=mean, expected_speedup=speedup)
    return _finding(
        f"decode-bound, not IO-bound: even loose files read cold at {rate:,.0f} files/s, more than the {dec:,.0f} "
        "img/s the cores decode; packing saves little here: more cores, decode at reduced size, or store decoded "
        "pixels if they fit.", small_files_per_s=rate, decode_all=dec)


def link_or_decode_bound(f: Facts) -> Finding | None:
    """A dataset at a URL: would the reader wait on the link (bandwidth over the bytes per sample) or on decoding?"""
    link, data = f.r.get("link"), f.r.get("data")
    if not (link and data and data.get("mean_sample_bytes") and f.decode_all):
        return None
    mean, bw, dec = data["mean_sample_bytes"], link["bandwidth_bytes_per_s"], f.decode_all
    carried = bw / mean
    figures = {"link_samples_per_s": carried, "decode_all": dec, "bandwidth_bytes_per_s": bw,
               "first_byte_s": link["first_byte_s"], "mean_sample_bytes": mean}
    said = (f"the link carries {bw / 1e6:,.0f} MB/s = {carried:,.0f} samples of {mean / 1e3:.0f} KB per second "
            f"({link['first_byte_s'] * 1e3:.0f} ms to each first byte)")
    if carried < dec:
        return _finding(f"link-bound: {said}, less than the {dec:,.0f} img/s the cores decode. Read it in "
                        "BlockShuffleSampler order (whole shards fetched ahead, many in flight) and give cache_limit "
                        "at least the dataset's size so that later epochs fetch nothing; packer bench URL measures "
                        "it.", bound="link", **figures)
    return _finding(f"decode-bound: {said}, more than the {dec:,.0f} img/s the cores decode: the link keeps up; "
                    "more cores or decoding at reduced size would help, a faster link would not.", bound="decode",
                    **figures)


def eviction_unverified(f: Facts) -> Finding | None:
    small = f.storage.get("small_file_read")
    if not small or small.get("eviction_verified"):
        return None
    return _finding("cold reads could not be verified as cold (mincore): they may be page-cache reads.",
                    eviction_verified=False)


def fits_in_ram(f: Facts) -> Finding | None:
    data, avail = f.r.get("data"), f.r["machine"]["memory"].get("MemAvailable")
    if not (data and data.get("bytes") and avail):
        return None
    size = data["bytes"]
    if size < 0.5 * avail:
        return _finding(f"the data ({human_bytes(size)}) fits in RAM ({human_bytes(avail)} available): after the first "
                        "epoch reads come from the page cache, so IO matters for the first epoch only; "
                        "open_dataset(path, cache='ram') keeps one shared copy for all workers.",
                        data_bytes=size, mem_available=avail)
    return _finding(f"the data ({human_bytes(size)}) does not fit in RAM ({human_bytes(avail)} available): every epoch "
                    "reads from storage, so the cold figures above are the ones that count.",
                    data_bytes=size, mem_available=avail)


def num_workers(f: Facts) -> Finding | None:
    return _finding(f"num_workers={f.workers}: {f.cores} usable cores"
                    + (", one left for the training process" if f.cores > 2 else "")
                    + "; check with packer profile DATASET --step-ms <your step time>.",
                    cores=f.cores, num_workers=f.workers)


def _smi_gpus(f: Facts) -> list[tuple[dict, dict | None]]:
    """(nvidia-smi's facts, its sampled usage or None) per GPU it lists; [] without nvidia-smi."""
    smi = f.r["gpu"].get("smi") or {}
    usage = {u["index"]: u for u in smi.get("usage", [])}
    return [(g, usage.get(g["index"])) for g in smi.get("gpus", [])]


def gpu(f: Facts) -> Finding | None:
    g = f.r["gpu"]
    if not g["available"]:
        return _finding(f"no GPU visible to torch {g['torch']} (CUDA build: {g['cuda_build']}): pin_memory has no "
                        "effect here; the training step itself competes with loader workers for the CPU.",
                        cuda_build=g["cuda_build"])
    pin, page = g.get("h2d_pinned_GBps"), g.get("h2d_pageable_GBps")
    smi = _smi_gpus(f)
    busy = "; ".join(f"GPU {s['index']} {u['utilization_mean']:.0f}% busy, {u['memory_used_max_mib']:,.0f} of "
                     f"{s['memory_total_mib']:,.0f} MiB used" for s, u in smi
                     if u and u["utilization_mean"] is not None and u["memory_used_max_mib"] is not None
                     and s["memory_total_mib"])
    return _finding(f"GPU present ({', '.join(g['devices'])}, CUDA {g['cuda_build']}): pin_memory=True "
                    + (f"(host-to-device {pin:.1f} GB/s pinned vs {page:.1f} GB/s pageable) " if pin and page else "")
                    + "and packer.CUDAPrefetcher to overlap the copy with compute"
                    + (f"; nvidia-smi before training: {busy}" if busy else "")
                    + ". While training, packer.profile(loader) samples the GPU's utilisation: below ~95% the step "
                    "waits for something, data or the loop itself.",
                    h2d_pinned_GBps=pin, h2d_pageable_GBps=page)


def gpu_unusable(f: Facts) -> Finding | None:
    g, smi = f.r["gpu"], _smi_gpus(f)
    if g["available"] or not smi:
        return None
    names = ", ".join(s["name"] for s, _ in smi)
    why = ("it is a CPU-only build: install a CUDA build of torch" if g["cuda_build"] is None else
           f"it was built for CUDA {g['cuda_build']}: the driver may be older than that, or CUDA_VISIBLE_DEVICES "
           "hides the GPUs")
    return _finding(f"nvidia-smi lists {len(smi)} GPU(s) ({names}) but torch {g['torch']} cannot use them: {why}.",
                    gpus=len(smi), torch=g["torch"], cuda_build=g["cuda_build"])


SHARED_UTIL = 10.0  # percent busy before this process ran anything: another job's kernels
SHARED_MEMORY = 0.05  # of the GPU's memory held before this process ran anything (at least 1 GiB)


def gpu_in_use(f: Facts) -> Finding | None:
    shared = []
    for s, u in _smi_gpus(f):
        if u is None:
            continue
        util, used, total = u["utilization_mean"], u["memory_used_max_mib"], s["memory_total_mib"]
        if (util is not None and util >= SHARED_UTIL) or (
                used is not None and total and used >= max(1024.0, SHARED_MEMORY * total)):
            shared.append(f"GPU {s['index']} ({s['name']}) "
                          + ("utilisation not reported" if util is None else f"{util:.0f}% busy")
                          + ("" if used is None else f", {used:,.0f}" + (f" of {total:,.0f}" if total else "")
                             + " MiB used"))
    if not shared:
        return None
    return _finding("another job is on the GPU: " + "; ".join(shared) + " while doctor sampled it, before this "
                    "process used it; a training job here shares its time and memory, and its utilisation figures "
                    "count the other job's kernels too.", gpus=shared)


def shm_space(f: Facts) -> Finding | None:
    shm = f.r["machine"].get("shm")
    need = min(f.workers, 8) * 2 * BATCH_BYTES
    if not shm or shm["free"] >= need:
        return None
    return _finding(f"/dev/shm has {human_bytes(shm['free'])} free: DataLoader workers hand batches over through it, "
                    f"and {f.workers} workers x 2 batches of 256 images at 224x224 need about {human_bytes(need)}; "
                    "enlarge it (docker run --shm-size=8g) or the loader will fail with 'bus error'.",
                    shm_free=shm["free"], needed=need)


def open_files(f: Facts) -> Finding | None:
    limit = f.r["machine"]["open_files_limit"]
    if limit["soft"] >= 4096:
        return None
    return _finding(f"open-files limit is {limit['soft']} (ulimit -n): loose-file loaders with many workers, and "
                    f"tensors shared between processes, can run out; raise it (ulimit -n {min(65536, limit['hard'])}).",
                    open_files_soft=limit["soft"])


RULES: tuple[Callable[[Facts], Finding | None], ...] = (
    busy_machine, decode_ceiling, libjpeg_turbo, storage_not_measured, network_storage, rotational_disk,
    io_or_decode_bound, link_or_decode_bound, eviction_unverified, fits_in_ram, num_workers, gpu, gpu_unusable,
    gpu_in_use, shm_space, open_files,
)


def judge(r: dict) -> list[Finding]:
    """Plain-words findings, in ``RULES`` order; each names the figures that drive it."""
    facts = Facts.of(r)
    return [found for rule in RULES if (found := rule(facts)) is not None]
