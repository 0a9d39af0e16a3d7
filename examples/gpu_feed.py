"""One prepared run on a GPU machine: is the GPU waiting for packer, how loading scales with cores, the GPU paths
verified; every figure into one JSON file and one markdown page.

    python examples/gpu_feed.py --out /tmp/gpu_feed [--budget-s 540] [--parts feed,prefetch,...]

Checks first what it needs (torch with CUDA, timm, NVIDIA DALI, libjpeg-turbo, nvidia-smi, FFCV) and says
what is missing; makes its own data (``packer sample`` photos, about 500x375 JPEGs in 10 classes, converted to
LMDB, or memmap where lmdb does not import; as many as the budget allows) in a scratch folder; then runs the
parts, each on its own (a missing library or a crash is reported in that part, with the reason, and the others
go on):

- ``doctor``, first, before the run uses the GPU: packer doctor on the dataset, nvidia-smi's utilisation and
  memory of each GPU included;
- ``feed`` (examples/gpu_feed_train.py): ResNet-50 training steps on the GPU, the ceiling on one batch kept on
  the GPU, then fed by DataLoader workers, ThreadLoader (whole decode + torch's RandomResizedCrop; the fused
  RandomResizedCropDecode) and packer.dali device="gpu": each one's fraction of the ceiling, nvidia-smi's
  utilisation meanwhile, and packer.profile's verdict on the best;
- ``prefetch``, ``dali_parity`` (examples/gpu_feed_verify.py): CUDAPrefetcher's checks; packer.dali on the GPU
  (nvJPEG) and the CPU against open_dataset for every sample, and their img/s side by side;
- ``scaling``, ``gil`` (examples/gpu_feed_cores.py): full decode and train224 at 1, 2, 4, ... threads or workers
  against N x bare libjpeg-turbo; what bounds one process (CPU per sample without decoding), and R ranks of
  N/R threads.

The whole run keeps to ``--budget-s`` seconds: the data's size and each part's time are cut to fit, and the
figures are written after every part (``--out``: gpu_feed.json, gpu_feed.md), so a run stopped early keeps them.
What it measures and the command: docs/results.md, "On a GPU machine".
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import shlex
import shutil
import signal
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent)]  # its sibling scripts; packer from this tree where it is not installed
import gpu_feed_cores  # noqa: E402
import gpu_feed_train  # noqa: E402
import gpu_feed_verify  # noqa: E402

import packer  # noqa: E402
from packer import sysinfo  # noqa: E402
from packer.diagnose import gpu  # noqa: E402
from packer.tools.sample import make_sample  # noqa: E402

PARTS = ("doctor", "feed", "prefetch", "dali_parity", "scaling", "gil")  # doctor first: the GPU before any use
SHARES = {"feed": 0.30, "prefetch": 0.06, "dali_parity": 0.09, "scaling": 0.38, "gil": 0.12, "doctor": 0.05}
IMAGES_PER_BUDGET_S = 8  # photos made per second of budget: 4,320 for the default 540 s


class Skip(Exception):
    """A part that cannot run here, and why."""


class OverTime(BaseException):
    """A part still running well past its share of the budget: stopped, so the parts after it still run (a
    BaseException: the parts' own ``except Exception`` around each row must not keep it going)."""


def _over_time(signum: int, frame: object) -> None:
    raise OverTime("stopped: still running well past its share of the budget")


class Budget:
    """The run's seconds: each part gets its share of what is left when it starts."""

    def __init__(self, total_s: float) -> None:
        self.total_s, self.start = total_s, time.monotonic()

    def left(self) -> float:
        return self.total_s - (time.monotonic() - self.start)

    def share(self, part: str, still: list[str]) -> float:
        return max(0.0, self.left()) * SHARES[part] / sum(SHARES[p] for p in still)


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def _version(module: str) -> str:
    mod = importlib.import_module(module)
    return str(mod.__dict__.get("__version__", "imported"))


def requirements() -> dict[str, dict]:
    """What the parts need, each ``{"ok": bool, "detail": str}``: present (its version) or why not."""
    out: dict[str, dict] = {}
    cuda = torch.cuda.is_available()
    out["torch_cuda"] = {"ok": cuda, "detail": (
        f"torch {torch.__version__}, CUDA {torch.version.cuda}, {torch.cuda.get_device_name(0)}" if cuda else
        f"torch {torch.__version__} sees no CUDA device (CUDA build: {torch.version.cuda})")}
    for name, module, why in (("timm", "timm", "ResNet-50 from examples/resnet50.py instead"),
                              ("nvidia_dali", "nvidia.dali", "the packer.dali rows are skipped"),
                              ("ffcv", "ffcv", "the FFCV rows are skipped")):
        try:
            out[name] = {"ok": True, "detail": _version(module)}
        except Exception as exc:  # noqa: BLE001 - an optional library: any failure to import is "missing"
            out[name] = {"ok": False, "detail": f"{type(exc).__name__}: {exc} ({why})"}
    from packer.images.decode import turbojpeg_available, turbojpeg_missing_reason
    from packer.images.jpegregion import region_decode_available

    out["turbojpeg"] = {"ok": turbojpeg_available(), "detail": "loaded" if turbojpeg_available() else
                        f"{turbojpeg_missing_reason()} (no bare libjpeg-turbo reference: scaling fails)"}
    out["jpegregion"] = {"ok": region_decode_available(), "detail": "built" if region_decode_available() else
                         "packer's compiled region decoder is not built: fused crops decode whole JPEGs"}
    for name, module, why in (("pillow", "PIL", "packer needs it: no sample photos, nothing runs"),
                              ("h5py", "h5py", "packer needs it to open any dataset: nothing runs"),
                              ("tqdm", "tqdm", "packer needs it: nothing runs"),
                              ("lmdb", "lmdb", "the data is packed as memmap instead")):
        try:
            out[name] = {"ok": True, "detail": _version(module)}
        except Exception as exc:  # noqa: BLE001
            out[name] = {"ok": False, "detail": f"{type(exc).__name__}: {exc} ({why})"}
    q = gpu.query()
    out["nvidia_smi"] = {"ok": q.error is None, "detail": q.error or ", ".join(
        f"GPU {g.index}: {g.name}, {g.memory_total_mib:,.0f} MiB" for g in q.gpus)}
    return out


def data_format() -> str:
    """LMDB where its Python package imports, else memmap (numpy alone)."""
    try:
        importlib.import_module("lmdb")
    except ImportError:
        return "memmap"
    return "lmdb"


def make_data(work: Path, count: int, size: tuple[int, int], cores: int, fmt: str) -> dict:
    """``count`` sample photos in ``work/photos``, packed into ``work/photos.<fmt>`` (both kept if there)."""
    photos, packed = work / "photos", work / f"photos.{fmt}"
    t0 = time.perf_counter()
    if packed.exists() and len(packer.open_dataset(packed)) == count:
        return {"photos": str(photos), "dataset": str(packed), "format": fmt, "images": count, "reused": True,
                "seconds": 0.0}
    for old in (photos, packed):
        shutil.rmtree(old, ignore_errors=True)
    total = make_sample(photos, count=count, classes=10, size=size, workers=cores, progress=False)
    made = time.perf_counter() - t0
    packer.convert(photos, packed, to=fmt, workers=cores, progress=False)
    return {"photos": str(photos), "dataset": str(packed), "format": fmt, "images": count, "bytes": total,
            "size_hw": list(size), "reused": False, "sample_s": made, "seconds": time.perf_counter() - t0}


def warm(path: Path) -> None:
    """Read every file of ``path`` once: into the page cache."""
    for f in sorted(p for p in path.rglob("*") if p.is_file()):
        with open(f, "rb") as fh:
            while fh.read(8 << 20):
                pass


def run_part(name: str, fn: Callable[[float], dict], seconds: float, limit: float, report: dict, out: Path) -> None:
    """One part: its figures, or skipped with the reason, or failed with the error (stopped after ``limit``
    seconds); saved at once."""
    log(f"== {name}: about {seconds:.0f} s")
    t0 = time.monotonic()
    previous = signal.signal(signal.SIGALRM, _over_time)
    signal.alarm(max(1, int(limit)))
    try:
        entry: dict[str, Any] = {"status": "ok", **fn(seconds)}
    except Skip as why:
        entry = {"status": "skipped", "reason": str(why)}
    except OverTime as exc:
        entry = {"status": "failed", "error": f"OverTime: {exc}", "traceback": traceback.format_exc()}
    except packer.PackerError as exc:  # a library packer needs for the part is missing, in one line
        entry = {"status": "skipped", "reason": str(exc)}
    except Exception as exc:  # noqa: BLE001 - one part failing never loses the others' figures
        entry = {"status": "failed", "error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()}
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)
    entry["seconds"] = time.monotonic() - t0
    report["parts"][name] = entry
    log(f"== {name}: {entry['status']}" + (f" ({entry.get('reason') or entry.get('error')})"
                                            if entry["status"] != "ok" else "") + f", {entry['seconds']:.0f} s")
    save(report, out)


def save(report: dict, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    for name, text in (("gpu_feed.json", json.dumps(report, indent=1, default=str)),
                       ("gpu_feed.md", markdown(report))):
        tmp = out / f".{name}.tmp"
        tmp.write_text(text)
        os.replace(tmp, out / name)


# ------------------------------------------------------------------ the markdown page


def _pct(v: float | None) -> str:
    return "-" if v is None else f"{100 * v:.0f} %"


def _num(v: float | None, digits: int = 0) -> str:
    return "-" if v is None else f"{v:,.{digits}f}"


def _usage(u: list[dict]) -> str:
    return "; ".join(f"GPU {g['index']}: {_num(g['utilization_mean'])} % (lowest {_num(g['utilization_min'])}), "
                     f"{_num(g['memory_used_max_mib'])} MiB" for g in u) or "-"


def _feed_md(p: dict) -> list[str]:
    lines = [f"{p['model']}, batch {p['batch_size']}, {p['precision']}, {p['memory_format']}, on {p['device']}; "
             f"each row {p['window_s']:.0f} s after its warm-up.", "",
             "| fed by | steps/s | images/s | of the ceiling | GPU busy (nvidia-smi), memory |",
             "|---|---:|---:|---:|---|"]
    c = p["ceiling"]
    lines.append(f"| a batch kept on the GPU (the ceiling) | {c['steps_per_s']:.2f} | {c['images_per_s']:,.0f} | "
                 f"100 % | {_usage(c['gpu'])} |")
    for name, r in p["loaders"].items():
        if "error" in r:
            lines.append(f"| {name} | failed: {r['error']} | | | |")
        else:
            lines.append(f"| {name} | {r['steps_per_s']:.2f} | {r['images_per_s']:,.0f} | {_pct(r['of_ceiling'])} | "
                         f"{_usage(r['gpu'])} |")
    prof = p.get("profile_of_best")
    if prof:
        lines += ["", f"packer.profile over {p['best']}:", "", "```",
                  prof.get("report") or prof.get("error", ""), "```"]
    return lines


def _scaling_md(p: dict) -> list[str]:
    bare = p["bare_one_thread"]
    ref = bare["missing"] if "missing" in bare else (
        f"Bare libjpeg-turbo, one thread: {bare['images_per_s']:,.0f} img/s (first "
        f"{bare['first']['images_per_s']:,.0f}, last {bare['last']['images_per_s']:,.0f}), "
        f"{bare['cpu_ms_per_image']:.2f} CPU ms/img")
    lines = [f"{ref}; {p['images']} images, batch {p['batch_size']}, {p['seconds_per_run']:.1f} s per row. "
             f"{p['note']}."]
    for loader, why in p["skipped"].items():
        lines.append(f"{loader}: skipped, {why}.")
    for setting in ("full", "train224"):
        rows = [r for r in p["rows"] if r["setting"] == setting]
        loaders = list(dict.fromkeys(r["loader"] for r in rows))
        lines += ["", f"**{setting}**: images/s (of N x bare; of linear)", "",
                  "| N | " + " | ".join(loaders) + " |", "|---:|" + "---:|" * len(loaders)]
        for n in p["threads"]:
            cells = []
            for loader in loaders:
                r = next((x for x in rows if x["loader"] == loader and x["n"] == n), None)
                cells.append("-" if r is None else f"failed: {r['error']}" if "error" in r else
                             f"{r['images_per_s']:,.0f} ({_pct(r.get('of_n_bare'))}; {_pct(r.get('of_linear'))})")
            lines.append(f"| {n} | " + " | ".join(cells) + " |")
    return lines


def _gil_md(p: dict) -> list[str]:
    lines = ["| raw 32x32 through ThreadLoader | batch | CPU us per sample | at most samples/s per process |",
             "|---|---:|---:|---:|"]
    lines += [f"| {r['threads']} thread(s) | {r['batch_size']} | {r['cpu_us_per_sample']:.1f} | "
              f"{_num(r['ceiling_samples_per_s'])} |" for r in p["raw32"]]
    if p["shortfalls"]:
        lines += ["", "ThreadLoader under 90 % of linear:", ""]
        lines += [f"- {r['setting']}, {r['n']} threads: {_pct(r['fraction'])}; {r['cpu_us_per_image']:.0f} CPU us "
                  f"per image of the process (bare libjpeg-turbo's full decode: {_num(r['bare_cpu_us_per_image'])})"
                  for r in p["shortfalls"]]
    if p["ranks"]:
        lines += ["", "The same cores as R processes (one ThreadLoader per rank):", ""]
    for r in p["ranks"]:
        lines.append(f"- {r['ranks']} processes x {r.get('threads_per_rank', '?')} threads, full decode: " +
                     (f"failed: {r['error']}" if "error" in r else
                      f"{r['images_per_s']:,.0f} img/s ({_pct(r['of_n_bare'])} of N x bare)"))
    return lines


def _prefetch_md(p: dict) -> list[str]:
    lines = [f"correctness: {'OK' if p['ok'] else 'FAILED'} (" + ", ".join(
        f"pin_memory={r['pin_memory']}: {r['wrong_sums']} wrong of {r['batches']}" for r in p["correctness"]) + ")",
        "", "| pin_memory | loader | ms per batch |", "|---|---|---:|"]
    lines += [f"| {r['pin_memory']} | {r['loader']} | {r['ms']:.2f} |" for r in p["ms_per_batch"]]
    lines.append(f"| - | step alone (no copy) | {p['step_alone_ms']:.2f} |")
    lines.append("share of the copy hidden: " + ", ".join(f"{k}: {_pct(v)}" for k, v in p["copy_hidden"].items()))
    return lines


def _dali_md(p: dict) -> list[str]:
    lines = [f"tolerance: mean |difference| per sample <= {p['tolerance']['mean_abs_diff']:g} "
             f"({p['tolerance']['source']})", ""]
    if p.get("gpu_skipped"):
        lines += [f"device gpu: skipped, {p['gpu_skipped']}", ""]
    lines += ["| device | samples seen | labels | within tolerance | exact | worst mean / max |diff| | train img/s |",
              "|---|---:|---|---:|---:|---:|---:|"]
    for dev, r in p["parity"].items():
        rate = p["train_rate"].get(dev, {})
        rate_s = _num(rate.get("images_per_s")) if "error" not in rate else f"failed: {rate['error']}"
        if "error" in r:
            lines.append(f"| {dev} | failed: {r['error']} | | | | | {rate_s} |")
            continue
        lines.append(f"| {dev} | {r['seen']} of {r['samples']} | {'equal' if not r['labels_wrong'] else 'DIFFER'} | "
                     f"{r['samples'] - r['over_tolerance_count']} | {r['exact']} | "
                     f"{r['worst_mean_abs_diff']:.2f} / {r['worst_max_abs_diff']} | {rate_s} |")
    return lines


def _doctor_md(p: dict) -> list[str]:
    from packer.diagnose.doctor import smi_lines

    return [f"nvidia-smi: {line}" for line in smi_lines(p["gpu"].get("smi") or {})] + [""] + [
        f"- {t}" for t in p["verdict"]]


RENDER = {"feed": _feed_md, "prefetch": _prefetch_md, "dali_parity": _dali_md, "scaling": _scaling_md,
          "gil": _gil_md, "doctor": _doctor_md}


def markdown(r: dict) -> str:
    lines = ["# GPU feed", "", f"`{r['command']}`", "",
             f"{r['machine']['cpu']}, {r['machine']['cores']} cores; {r['requirements']['torch_cuda']['detail']}; "
             f"nvidia-smi: {r['requirements']['nvidia_smi']['detail']}", "",
             "| needs | here |", "|---|---|"]
    lines += [f"| {k} | {'yes' if v['ok'] else 'NO'}: {v['detail']} |" for k, v in r["requirements"].items()]
    d = r.get("data")
    if d and "error" in d:
        lines += ["", f"data: FAILED, {d['error']}"]
    elif d:
        lines += ["", f"data: {d['images']} sample photos packed as {d['format']}" + (
            " (reused)" if d["reused"] else f", made in {d['seconds']:.0f} s")]
    for name, p in r["parts"].items():
        lines += ["", f"## {name}", ""]
        if p["status"] != "ok":
            lines.append(f"{p['status']}: {p.get('reason') or p.get('error')}")
            continue
        try:
            lines += RENDER[name](p)
        except Exception as exc:  # noqa: BLE001 - the JSON has the figures whatever the page can show
            lines.append(f"(not shown: {type(exc).__name__}: {exc}; see gpu_feed.json)")
    return "\n".join(lines) + "\n"


# ------------------------------------------------------------------ the run


def default_threads(cores: int) -> list[int]:
    """1, 2, 4, ... up to the cores, and the core count itself."""
    return sorted({cores, *(2 ** k for k in range(cores.bit_length()) if 2 ** k <= cores)})


def parse_hw(text: str) -> tuple[int, int]:
    h, _, w = text.partition("x")
    return int(h), int(w)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True, help="folder for gpu_feed.json and gpu_feed.md")
    ap.add_argument("--budget-s", type=float, default=540.0, help="seconds for the whole run (default 540)")
    ap.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated, of: {', '.join(PARTS)}")
    ap.add_argument("--count", type=int, help=f"photos to make (default: {IMAGES_PER_BUDGET_S} per second of "
                    "budget, 256 to 6,000)")
    ap.add_argument("--size", type=parse_hw, default=(375, 500), help="photo height x width (default 375x500)")
    ap.add_argument("--threads", help="thread/worker counts for scaling (default: 1, 2, 4, ... and the cores)")
    ap.add_argument("--workers", type=int, help="loader threads/workers feeding the GPU (default: cores - 1)")
    ap.add_argument("--batch-size", type=int, default=256, help="training batch (default 256)")
    ap.add_argument("--workdir", type=Path, help="where the data is made (default: a scratch folder, removed)")
    a = ap.parse_args(argv)
    parts = [p for p in a.parts.split(",") if p]
    if set(parts) - set(PARTS):
        ap.error(f"--parts {a.parts!r}: choose from {', '.join(PARTS)}")
    budget = Budget(a.budget_s)
    cores = sysinfo.usable_cores()
    threads = [int(t) for t in a.threads.split(",")] if a.threads else default_threads(cores)
    workers = a.workers or max(1, cores - 1)
    count = a.count or min(6000, max(256, int(IMAGES_PER_BUDGET_S * a.budget_s)))
    torch.set_num_threads(1)  # as DataLoader workers run; the decode threads' torch ops likewise
    from packer.diagnose.system import describe_machine

    report: dict = {"command": shlex.join(["python", "examples/gpu_feed.py", *(argv if argv is not None
                                                                               else sys.argv[1:])]),
                    "started": time.strftime("%Y-%m-%d %H:%M:%S %z"), "budget_s": a.budget_s,
                    "machine": describe_machine(), "requirements": requirements(), "parts": {}}
    for name, need in report["requirements"].items():
        log(f"needs {name}: {'yes' if need['ok'] else 'NO'}, {need['detail']}")
    cuda = report["requirements"]["torch_cuda"]["ok"]
    work = a.workdir or Path(tempfile.mkdtemp(prefix="gpu_feed-"))
    try:
        fmt = data_format()
        log(f"data: {count} photos of about {a.size[0]}x{a.size[1]}, packed as {fmt}, into {work}")
        try:
            report["data"] = data = make_data(work, count, a.size, cores, fmt)
        except Exception as exc:  # noqa: BLE001 - said in the report; no part can run without data
            report["data"] = {"error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()}
            for name in parts:
                report["parts"][name] = {"status": "skipped", "reason": f"no data: {report['data']['error']}",
                                         "seconds": 0.0}
            log(f"data: FAILED, {report['data']['error']}")
            return 1
        save(report, a.out)
        lmdb, photos = Path(data["dataset"]), Path(data["photos"])
        dev = torch.device("cuda" if cuda else "cpu")

        def need_cuda(what: str) -> None:
            if not cuda:
                raise Skip(f"{what} needs a CUDA device: {report['requirements']['torch_cuda']['detail']}")

        def feed(seconds: float) -> dict:
            need_cuda("training ResNet-50 on the GPU")
            return gpu_feed_train.feed(lmdb, seconds, workers, dev, batch=a.batch_size, log=log)

        def prefetch(seconds: float) -> dict:
            need_cuda("CUDAPrefetcher's checks")
            return gpu_feed_verify.prefetch()

        def dali_parity(seconds: float) -> dict:
            return gpu_feed_verify.dali_parity(lmdb, seconds, workers, cuda, log=log)

        def scaling(seconds: float) -> dict:
            per_run = seconds / (2 * len(threads) * 5 + 2)
            return gpu_feed_cores.scaling(lmdb, photos, work, threads, max(0.2, 0.6 * per_run), log=log)

        def gil(seconds: float) -> dict:
            scaled = report["parts"].get("scaling", {})
            return gpu_feed_cores.gil(lmdb, work, photos, scaled if scaled.get("status") == "ok" else None,
                                      max(0.2, 0.5 * seconds / 6), cores, log=log)

        def doctor(seconds: float) -> dict:
            from packer.diagnose.doctor import diagnose

            r = diagnose(lmdb, seconds=max(0.1, min(1.0, seconds / 10)), progress=False)
            warm(lmdb)  # its cold reads evicted the dataset: the parts after it start warm, as the others do
            return {"gpu": r["gpu"], "decode": r["decode"], "storage": r.get("storage"),
                    "verdict": [f["text"] for f in r["verdict"]]}

        run = {"feed": feed, "prefetch": prefetch, "dali_parity": dali_parity, "scaling": scaling, "gil": gil,
               "doctor": doctor}
        for k, name in enumerate(parts):
            if budget.left() <= 0:
                report["parts"][name] = {"status": "skipped", "reason": "the budget was spent", "seconds": 0.0}
                continue
            share = budget.share(name, parts[k:])  # a part is stopped at twice its share (a minute more at
            limit = min(max(2 * share, share + 60), budget.left() + 30)  # least), half a minute past the budget
            run_part(name, run[name], share, limit, report, a.out)
    finally:
        report["elapsed_s"] = time.monotonic() - budget.start
        save(report, a.out)
        if a.workdir is None:
            shutil.rmtree(work, ignore_errors=True)
    log(f"done in {report['elapsed_s']:.0f} s: {a.out / 'gpu_feed.json'}, {a.out / 'gpu_feed.md'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
