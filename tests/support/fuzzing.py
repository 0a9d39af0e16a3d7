"""Seeded mutations of a packed dataset, and the check that reading one is safe (used by test_fuzz.py).

Each case takes a copy of a real packed dataset, applies one seeded mutation (damage, or a
crafted edit whose checksums are recomputed so that only deeper checks can catch it) and then
opens and reads every sample. Cases run in forked worker processes watched by the parent, so a
crash (segfault) or a hang is caught and attributed to its seed instead of stopping the run.
Reads outside the dataset directory are caught with inotify on an identical copy placed
beside it: following a symlink or an ``..`` name there would return "valid" data, so only
watching the opens can tell. A worker copies the dataset (and the outside copy) once, and after
each case puts back only the entries that changed (``Copies``), instead of copying both per case.
"""

from __future__ import annotations

import ctypes
import hashlib
import json
import os
import random
import resource
import shutil
import stat
import time
import traceback
from pathlib import Path

import numpy as np

HOSTILE = [-1, 0, 1, 2, 3, -(2**31), 2**31 - 1, 2**63 - 1, 2**64, 10**30, 1.5, float("nan"), True, None, "",
           "x", "../outside", "/etc/passwd", [], [1], {}, {"a": 1}, "0" * 64]
KINDS = ["bitflip", "overwrite", "truncate", "extend", "delete", "manifest-field", "npy-header", "npy-value",
         "symlink-out", "name-out", "swap-files"]

# ------------------------------------------------------------------ inotify (Linux)

_IN_ACCESS, _IN_OPEN = 0x1, 0x20


class OpenWatch:
    """Reports whether any file in the watched directories was opened or read."""

    def __init__(self, dirs: list[Path]) -> None:
        self.libc = ctypes.CDLL(None, use_errno=True)
        self.fd = self.libc.inotify_init1(os.O_NONBLOCK | os.O_CLOEXEC)
        if self.fd < 0:
            raise OSError(ctypes.get_errno(), "inotify_init1")
        for d in dirs:
            if self.libc.inotify_add_watch(self.fd, str(d).encode(), _IN_ACCESS | _IN_OPEN) < 0:
                raise OSError(ctypes.get_errno(), f"inotify_add_watch {d}")

    def events(self) -> int:
        n = 0
        while True:
            try:
                data = os.read(self.fd, 65536)
            except BlockingIOError:
                return n
            n += len(data)

    def close(self) -> None:
        os.close(self.fd)


# ------------------------------------------------------------------ mutations


def _files(ds: Path) -> list[Path]:
    return sorted(p for p in ds.rglob("*") if p.is_file() and not p.is_symlink())


def put_lmdb_value(shard: Path, pos: int, value: bytes) -> None:
    """What a crafter does to an LMDB shard: replace the value at ``pos``, and write the shard's spans file
    again (the value moved). The manifest's checksums are left to ``_rewrite_checksums``."""
    import lmdb

    from packer.formats.lmdb.writer import spans_name, value_spans

    env = lmdb.open(str(shard), subdir=False, lock=False)
    with env.begin(write=True) as txn:
        txn.put(b"%010d" % pos, value)
        count = txn.stat()["entries"]
    env.close()
    np.save(shard.with_name(spans_name(shard.name)), value_spans(shard, count))


def _rewrite_checksums(ds: Path) -> None:
    """What a crafter does: make the manifest's sizes and sha256 agree with the files again."""
    path = ds / "manifest.json"
    try:
        data = json.loads(path.read_text())
        entries = [f for s in data["shards"] for f in s["files"]] + list(data.get("meta_files", []))
        for f in entries:
            p = ds / f["name"]
            if p.is_file():
                f["num_bytes"] = p.stat().st_size
                f["sha256"] = hashlib.sha256(p.read_bytes()).hexdigest()
        path.write_text(json.dumps(data))
    except Exception:  # a damaged manifest stays damaged
        pass


def put_sample_value(ds: Path, sample: int, value: bytes) -> None:
    """Replace sample ``sample``'s bytes inside its LMDB shard (a crafted shard), fixing nbytes and checksums."""
    from packer import open_dataset

    d = open_dataset(ds)
    stored = d.position(sample)  # nbytes, as all of meta/, is in storage order
    shard, pos = d.locate(sample)
    d.close()
    name = d.manifest.shards[shard].files[0].name
    put_lmdb_value(ds / name, pos, value)
    nbytes = np.load(ds / "meta/nbytes.npy")
    nbytes[stored] = len(value)
    np.save(ds / "meta/nbytes.npy", nbytes)
    _rewrite_checksums(ds)


def _json_paths(node, prefix=()):
    yield prefix
    if isinstance(node, dict):
        for k, v in node.items():
            yield from _json_paths(v, prefix + (k,))
    elif isinstance(node, list):
        for i, v in enumerate(node):
            yield from _json_paths(v, prefix + (i,))


def _edit_manifest(ds: Path, outside: Path, rng: random.Random) -> str:
    path = ds / "manifest.json"
    data = json.loads(path.read_text())
    paths = [p for p in _json_paths(data) if p]
    where = rng.choice(paths)
    parent = data
    for k in where[:-1]:
        parent = parent[k]
    old = parent[where[-1]]
    r = rng.random()
    if r < 0.15 and isinstance(parent, dict):
        del parent[where[-1]]
        what = "deleted"
    elif r < 0.45 and isinstance(old, int) and not isinstance(old, bool):
        new = old + rng.choice([-2, -1, 1, 2, old, -old - 1, 1 << 40])
        parent[where[-1]] = new
        what = f"{old}->{new}"
    else:
        new = rng.choice(HOSTILE + [str(outside / "manifest.json"), "a" * 100_000])
        parent[where[-1]] = new
        what = f"->{new!r:.30}"
    path.write_text(json.dumps(data))
    return f"{'/'.join(map(str, where))} {what}"


def _npy_header_edit(file: Path, rng: random.Random) -> str:
    raw = file.read_bytes()
    with open(file, "rb") as fh:
        np.lib.format.read_magic(fh)
        shape, fortran, dtype = np.lib.format.read_array_header_1_0(fh)
        body = raw[fh.tell():]
    choice = rng.randrange(5)
    if choice == 0:
        shape = (rng.choice([0, 1, shape[0] + 1, max(shape[0] - 1, 0), 2**40, 2**62]),)
    elif choice == 1:
        shape = (shape[0], rng.choice([1, 2, 3]))
    elif choice == 2:
        dtype = np.dtype(rng.choice(["<f8", ">i8", "<i2", "|u1", "<U4", "<i8"]))
    elif choice == 3:
        fortran = True
        shape = (shape[0], 1)
    else:  # an object array header: would need pickle
        header = f"{{'descr': '|O', 'fortran_order': False, 'shape': ({shape[0]},), }}"
        file.write_bytes(_npy_bytes(header) + body)
        return "descr |O"
    descr = np.lib.format.dtype_to_descr(dtype)
    header = f"{{'descr': {descr!r}, 'fortran_order': {fortran!r}, 'shape': {tuple(shape)!r}, }}"
    file.write_bytes(_npy_bytes(header) + body)
    return f"header {header[:60]}"


def _npy_bytes(header: str) -> bytes:
    h = header.encode("latin1")
    pad = 64 - (10 + len(h) + 1) % 64
    h = h + b" " * pad + b"\n"
    return b"\x93NUMPY\x01\x00" + len(h).to_bytes(2, "little") + h


def _npy_value_edit(file: Path, rng: random.Random) -> str:
    arr = np.load(file, allow_pickle=False)
    if arr.size == 0:
        return "empty"
    i = rng.randrange(arr.size)
    info = np.iinfo(arr.dtype)
    new = rng.choice([-1, -2, 0, 1, 3, 100, info.max, info.min, int(arr[i]) + 1, int(arr[i]) - 1])
    new = max(info.min, min(info.max, new))
    arr[i] = new
    np.save(file, arr)
    return f"[{i}]={new}"


def mutate(ds: Path, outside: Path, rng: random.Random, kind: str) -> tuple[str, bool]:
    """Apply one mutation of ``kind``; returns (description, crafted)."""
    files = _files(ds)
    target = rng.choice(files)
    crafted = False
    rel = target.relative_to(ds)
    if kind in ("bitflip", "overwrite", "truncate", "extend"):
        data = bytearray(target.read_bytes())
        if kind == "bitflip" and data:
            for _ in range(rng.randint(1, 8)):
                pos = rng.randrange(len(data))
                data[pos] ^= 1 << rng.randrange(8)
        elif kind == "overwrite" and data:
            pos = rng.randrange(len(data))
            n = rng.randint(1, 64)
            fill = rng.choice([b"\x00" * n, b"\xff" * n, bytes(rng.randrange(256) for _ in range(n))])
            data[pos:pos + n] = fill[: len(data) - pos]
        elif kind == "truncate":
            del data[rng.randrange(len(data) + 1):]
        elif kind == "extend":
            data += rng.choice([b"\x00", bytes([rng.randrange(256)])]) * rng.randint(1, 4096)
        target.write_bytes(bytes(data))
        crafted = target.name != "manifest.json" and rng.random() < 0.5
        desc = f"{kind} {rel}"
    elif kind == "delete":
        target.unlink()
        desc = f"delete {rel}"
    elif kind == "manifest-field":
        desc = "manifest " + _edit_manifest(ds, outside, rng)
    elif kind in ("npy-header", "npy-value"):
        npys = sorted((ds / "meta").glob("*.npy"))
        target = rng.choice(npys)
        edit = _npy_header_edit(target, rng) if kind == "npy-header" else _npy_value_edit(target, rng)
        crafted = rng.random() < 0.7
        desc = f"{kind} {target.relative_to(ds)} {edit}"
    elif kind == "symlink-out":
        choices = files + [ds / "meta"]
        target = rng.choice(choices)
        rel = target.relative_to(ds)
        if target.is_dir():
            shutil.rmtree(target)
        else:
            target.unlink()
        dest = outside / rel
        os.symlink(os.path.relpath(dest, target.parent) if rng.random() < 0.5 else dest, target)
        desc = f"symlink {rel} -> outside"
    elif kind == "name-out":
        path = ds / "manifest.json"
        data = json.loads(path.read_text())
        entries = [f for s in data["shards"] for f in s["files"]] + list(data.get("meta_files", []))
        entry = rng.choice(entries)
        name = entry["name"]
        entry["name"] = rng.choice([f"../outside/{name}", str(outside / name), f"meta/../../outside/{name}",
                                    f"./../outside/{name}", f"{name}/../../outside/{name}"])
        path.write_text(json.dumps(data))
        desc = f"name {name} -> {entry['name']}"
    elif kind == "swap-files":
        shards = sorted(p for p in files if p.parent == ds and p.name not in ("manifest.json", "errors.json"))
        if len(shards) >= 2:
            a, b = rng.sample(shards, 2)
            tmp = a.with_name("tmp-swap")
            a.rename(tmp)
            b.rename(a)
            tmp.rename(b)
            desc = f"swap {a.name} {b.name}"
        else:
            desc = "swap (one file only)"
        crafted = rng.random() < 0.5
    else:
        raise ValueError(kind)
    if crafted:
        _rewrite_checksums(ds)
    return desc, crafted


# ------------------------------------------------------------------ the copies a worker's cases damage


def _entries(root: Path) -> dict[str, os.stat_result]:
    """Every entry under ``root`` (not following symlinks), by path relative to it."""
    found: dict[str, os.stat_result] = {}
    todo = [""]
    while todo:
        rel = todo.pop()
        with os.scandir(root / rel) as it:
            for entry in it:
                sub = f"{rel}/{entry.name}" if rel else entry.name
                found[sub] = entry.stat(follow_symlinks=False)
                if entry.is_dir(follow_symlinks=False):
                    todo.append(sub)
    return found


def _identity(st: os.stat_result) -> tuple:
    """What changes when an entry is written, replaced, renamed over, chmod-ed or made another type: a file's
    inode, size, mtime and ctime; a directory's inode and type (its times change with its entries: see put_back)."""
    if stat.S_ISDIR(st.st_mode):
        return (st.st_mode, st.st_ino)
    return (st.st_mode, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


class Copies:
    """A worker's two copies of ``base`` (the dataset a case damages, and the outside copy beside it): moved to a
    case's paths for the case, and put back as a fresh copy would be after it by copying again only the entries
    whose identity changed (a mutation, or anything a read wrote) and setting the directories' times."""

    def __init__(self, base: Path, where: Path) -> None:
        self.base = base
        self.dirs = (where / "ds", where / "outside")
        self.known: list[dict[str, tuple]] = []
        for d in self.dirs:
            shutil.copytree(base, d)
            self.known.append({rel: _identity(st) for rel, st in _entries(d).items()})

    def place(self, ds: Path, outside: Path) -> None:
        ds.parent.mkdir(parents=True)
        self.dirs[0].rename(ds)
        self.dirs[1].rename(outside)

    def put_back(self, ds: Path, outside: Path) -> None:
        for i, placed in enumerate((ds, outside)):
            placed.rename(self.dirs[i])
            self.known[i] = self._restore(self.dirs[i], self.known[i])

    def _restore(self, root: Path, known: dict[str, tuple]) -> dict[str, tuple]:
        now = {rel: _identity(st) for rel, st in _entries(root).items()}
        if now == known:
            return known
        done: list[str] = []
        for rel in sorted(set(now) | set(known)):
            if now.get(rel) == known.get(rel) or any(rel.startswith(d + "/") for d in done):
                continue
            done.append(rel)
            path, src = root / rel, self.base / rel
            if rel in now:
                if stat.S_ISDIR(os.lstat(path).st_mode):
                    shutil.rmtree(path)
                else:
                    path.unlink()
            if rel in known:
                if src.is_dir():
                    shutil.copytree(src, path)
                else:
                    shutil.copy2(src, path)
        for rel in ["", *sorted(r for r in known if stat.S_ISDIR(known[r][0]))]:
            shutil.copystat(self.base / rel, root / rel)  # the times copytree gave: entries changed them
        return {rel: _identity(st) for rel, st in _entries(root).items()}


# ------------------------------------------------------------------ one case, in a worker


def expected_samples(path: Path) -> list[tuple[str, int, bytes]]:
    from packer import open_dataset

    ds = open_dataset(path, image="numpy")
    return [(rel, label, bytes(ds.read_payload(i))) for i, (rel, label) in enumerate(zip(ds.relpaths, ds.targets))]


def kind_of(seed: int) -> str:
    return KINDS[seed % len(KINDS)]  # round robin: every kind gets its share of the cases


def run_case(base: Path, work: Path, seed: int, expected, copies: Copies) -> dict:
    """Mutate a copy of ``base`` (from ``copies``, put back as it was afterwards) and read it; the dict says what
    happened."""
    from packer import PackerError, open_dataset
    from packer.tools.verify import verify

    rng = random.Random(seed)
    kind = kind_of(seed)
    case = work / f"case{seed}"
    ds, outside = case / "ds", case / "outside"
    copies.place(ds, outside)
    desc, crafted = mutate(ds, outside, rng, kind)
    # every folder of the outside copy: the nested folders of a format (n5 blocks) too, not only the top and meta/
    watch = OpenWatch([outside, *(p for p in outside.rglob("*") if p.is_dir() and not p.is_symlink())])
    out = {"seed": seed, "kind": kind, "desc": desc, "crafted": crafted, "ok": 0, "error": 0, "wrong": 0,
           "opened": False, "crash": None, "verify_ok": None}
    try:
        try:
            dset = open_dataset(ds, image="numpy")
        except PackerError:
            out["opened"] = False
        else:
            out["opened"] = True
            n = len(dset)
            rels = dset.relpaths  # by sample index, as dset[i]
            for i in range(n):
                try:
                    img, label = dset[i]
                    payload = bytes(dset.read_payload(i))
                    rel = rels[i]
                except PackerError:
                    out["error"] += 1
                    continue
                good = i < len(expected) and (rel, label, payload) == expected[i]
                out["ok" if good else "wrong"] += 1
            for call in (lambda: dset.__getitems__(list(range(n))[::-1]),
                         lambda: dset.read_payloads(list(range(n))[::2] + list(range(n))[1::2]),
                         lambda: getattr(dset, "get_batch", lambda _: None)(list(range(n))[::-1])):
                try:
                    call()
                except PackerError:
                    pass
            dset.close()
        out["verify_ok"] = verify(ds).ok
    except Exception as exc:  # anything but PackerError is a finding
        out["crash"] = f"{type(exc).__name__}: {exc}\n{traceback.format_exc(limit=-4)}"
    out["outside_reads"] = watch.events()
    watch.close()
    copies.put_back(ds, outside)
    case.rmdir()
    return out


def _worker(base: Path, work: Path, seeds: list[int], log: Path, expected, mem_limit: int) -> None:
    # No allocation larger than the data justifies: cap this process's address space growth.
    vm = _vm_size()
    if vm:
        resource.setrlimit(resource.RLIMIT_AS, (vm + mem_limit, resource.RLIM_INFINITY))
    copies = Copies(base, work / f"{log.stem}.copies")
    with open(log, "a") as fh:
        for seed in seeds:
            fh.write(json.dumps({"start": seed}) + "\n")
            fh.flush()
            try:
                res = run_case(base, work, seed, expected, copies)
            except MemoryError as exc:
                res = {"seed": seed, "kind": kind_of(seed), "crash": f"MemoryError: {exc}"}
            fh.write(json.dumps(res) + "\n")
            fh.flush()
    os._exit(0)


def complete_records(log: Path) -> list[dict]:
    """The JSON lines a worker has finished writing to ``log``: a last line still being written is left for later."""
    if not log.exists():
        return []
    return [json.loads(x) for x in log.read_text().split("\n")[:-1] if x]


def _vm_size() -> int:
    try:
        with open("/proc/self/status") as fh:
            for line in fh:
                if line.startswith("VmSize:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def run_cases(base: Path, work: Path, seeds: list[int], processes: int = 2, timeout: float = 30.0,
              mem_limit: int = 1 << 30) -> list[dict]:
    """Run every seed in forked workers; a worker that dies or hangs has its current case recorded as such."""
    import multiprocessing as mp

    import packer.tools.verify  # noqa: F401  (imported once here, not again in every forked worker)

    ctx = mp.get_context("fork")
    expected = expected_samples(base)
    pending = list(seeds)
    results: dict[int, dict] = {}
    running: list[tuple] = []
    chunk = max(1, len(seeds) // (processes * 4))
    launched = 0
    while pending or running:
        while pending and len(running) < processes:
            part, pending = pending[:chunk], pending[chunk:]
            log = work / f"log{launched}.jsonl"
            launched += 1
            proc = ctx.Process(target=_worker, args=(base, work, part, log, expected, mem_limit))
            proc.start()
            running.append((proc, log, part))
        time.sleep(0.02)
        still = []
        for proc, log, part in running:
            # Alive or not is asked before the log is read: a worker that wrote its last result and exited between
            # the two would otherwise have that case reported as the one it died in.
            alive = proc.is_alive()
            lines = complete_records(log)
            done = {r["seed"] for r in lines if "seed" in r}
            current = [r["start"] for r in lines if "start" in r and r["start"] not in done]
            for r in lines:
                if "seed" in r:
                    results[r["seed"]] = r
            age = time.time() - log.stat().st_mtime if log.exists() else 0.0
            if alive and not (current and age > timeout):
                still.append((proc, log, part))
                continue
            if alive:
                proc.kill()
                proc.join()
                results[current[0]] = {"seed": current[0], "kind": kind_of(current[0]),
                                       "crash": f"hang: no result after {timeout:.0f} s"}
            else:
                proc.join()
                if current:
                    results[current[0]] = {"seed": current[0], "kind": kind_of(current[0]),
                                           "crash": f"worker died (exit code {proc.exitcode})"}
            rest = [s for s in part if s not in results]
            pending = rest + pending
        running = still
    return [results[s] for s in seeds]


def craft_rel_path(ds: Path, i: int, new: str) -> None:
    """Give sample ``i`` of dataset ``ds`` the stored source path ``new`` (checksums recomputed: crafted)."""
    from packer import open_dataset

    d = open_dataset(ds)
    paths = d.index.rel_paths()
    paths[i] = new
    blob = "".join(paths).encode()
    offsets = np.zeros(len(paths) + 1, dtype="<i8")
    np.cumsum([len(p.encode()) for p in paths], out=offsets[1:])
    np.save(ds / "meta/path_blob.npy", np.frombuffer(blob, dtype="u1"))
    np.save(ds / "meta/path_offsets.npy", offsets)
    _rewrite_checksums(ds)
