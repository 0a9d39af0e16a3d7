"""Seeded fuzzing of packed datasets: damaged or crafted files give PackerError, never anything else.

For every registered format and payload (the contract cases), a real dataset is packed and
then mutated ``--fuzz-cases`` times (bit flips, overwrites, truncations, extensions, deleted
and swapped files, manifest field edits, .npy header and value edits, symlinks and names
leading out of the directory; see tests/support/fuzzing.py). For each case every read must return
the original sample or raise PackerError; no other exception, no crash, no hang, no open of
a file outside the dataset, no allocation beyond 1 GiB. Where damage (not a crafted edit with
recomputed checksums) lets a read return wrong data, ``packer verify`` must report the dataset.
"""

from __future__ import annotations

import collections

import pytest
from support.fuzzing import KINDS, run_cases
from test_contract import CASES, FORMAT_OPTIONS

from packer import convert


@pytest.mark.slow
@pytest.mark.parametrize("case", CASES)
def test_fuzzed_dataset_reads_verified_data_or_raises_packer_error(case, imagefolder, tmp_path, request):
    name, payload, resize = case
    base = tmp_path / f"ds.{name}"
    kwargs = dict(FORMAT_OPTIONS.get(name, {}))
    if resize:
        kwargs["resize"] = resize
        kwargs.pop("tile", None)  # mosaic: a fixed --resize HxW is the tile size (as in test_contract)
    convert(imagefolder, base, to=name, payload=payload, shard_bytes=6_000, workers=1, progress=False, **kwargs)
    count = request.config.getoption("--fuzz-cases")
    work = tmp_path / "work"
    work.mkdir()
    results = run_cases(base, work, list(range(count)))

    crashes = [r for r in results if r.get("crash")]
    escapes = [r for r in results if r.get("outside_reads")]
    silent = [r for r in results if r.get("wrong") and not r["crafted"] and r["verify_ok"] is not False]
    tally = collections.Counter((r["kind"], _outcome(r)) for r in results)
    print(f"\nfuzz {name}-{payload}{'-' + resize if resize else ''}: {count} cases")
    for kind in KINDS:
        row = {o: n for (k, o), n in tally.items() if k == kind}
        print(f"  {kind:15} {sum(row.values()):5}  " + ", ".join(f"{o} {n}" for o, n in sorted(row.items())))
    lines = [f"seed {r['seed']} {r.get('desc', r['kind'])}: {r['crash'][:200]}" for r in crashes]
    assert not crashes, f"{len(crashes)} cases raised something other than PackerError:\n" + "\n".join(lines)
    assert not escapes, "\n".join(f"seed {r['seed']} {r['desc']}: read outside the dataset" for r in escapes[:5])
    assert not silent, "\n".join(f"seed {r['seed']} {r['desc']}: wrong data, verify saw nothing" for r in silent[:5])
    assert sum(r["ok"] for r in results) > 0
    assert sum(r["error"] for r in results) + sum(not r["opened"] for r in results) > 0


def _outcome(r: dict) -> str:
    if r.get("crash"):
        return "CRASH"
    if not r["opened"]:
        return "refused at open"
    if r["wrong"]:
        return "crafted: other data" if r["crafted"] else "damaged: verify reports it"
    if r["error"]:
        return "error on read"
    return "all samples intact"


def test_the_harness_catches_crashes_hangs_and_reads_outside(tmp_path, monkeypatch, imagefolder):
    """The guards above can fail: a segfault, a hang and an open outside are each reported."""
    import faulthandler
    import os
    import signal
    import time

    from support import fuzzing

    base = tmp_path / "ds.lmdb"
    convert(imagefolder, base, to="lmdb", workers=1, progress=False)
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "secret").write_bytes(b"x")

    def fake(base, work, seed, expected, copies):
        if seed == 1:
            faulthandler.disable()  # the crash is the point: no traceback dump in the test output
            os.kill(os.getpid(), signal.SIGSEGV)
        if seed == 2:
            time.sleep(60)
        watch = fuzzing.OpenWatch([outside])
        if seed == 3:
            (outside / "secret").read_bytes()
        return {"seed": seed, "kind": "x", "outside_reads": watch.events()}

    monkeypatch.setattr(fuzzing, "run_case", fake)
    res = {r["seed"]: r for r in fuzzing.run_cases(base, tmp_path, [0, 1, 2, 3, 4], processes=2, timeout=3)}
    assert "died" in res[1]["crash"] and "hang" in res[2]["crash"]
    assert res[3]["outside_reads"] and not res[0]["outside_reads"] and not res[4].get("crash")


def test_the_harness_reads_only_complete_log_lines(tmp_path):
    """A worker's log is read while the worker writes it: a half-written last line waits for the next look."""
    from support.fuzzing import complete_records

    log = tmp_path / "log.jsonl"
    log.write_text('{"start": 1}\n{"seed": 1, "ok": true}\n{"sta')
    assert complete_records(log) == [{"start": 1}, {"seed": 1, "ok": True}]
    assert complete_records(tmp_path / "missing.jsonl") == []


def test_the_harness_puts_a_case_s_copies_back_as_fresh_copies(tmp_path, imagefolder):
    """A worker reuses its two copies of the dataset: after each mutation kind (and a write into the outside copy,
    as a read that escaped could make) both are again what copytree gives: the same names, types, bytes and times."""
    import filecmp
    import os
    import random

    from support.fuzzing import Copies, mutate

    def same(a, b):
        cmp = filecmp.dircmp(a, b)
        assert not (cmp.left_only or cmp.right_only or cmp.funny_files or cmp.common_funny), (a, cmp.left_only,
                                                                                             cmp.right_only)
        assert filecmp.cmpfiles(a, b, cmp.common_files, shallow=False)[0] == sorted(cmp.common_files), a
        for name in cmp.common:
            sa, sb = os.lstat(a / name), os.lstat(b / name)
            assert (sa.st_mode, sa.st_mtime_ns) == (sb.st_mode, sb.st_mtime_ns), a / name
        for name in cmp.common_dirs:
            same(a / name, b / name)

    base = tmp_path / "ds.n5"  # shards of nested block folders, and meta/
    convert(imagefolder, base, to="n5", payload="raw", resize="24x32", shard_bytes=6_000, workers=1, progress=False)
    copies = Copies(base, tmp_path / "copies")
    for seed, kind in enumerate(KINDS * 2):
        ds, outside = tmp_path / f"case{seed}" / "ds", tmp_path / f"case{seed}" / "outside"
        copies.place(ds, outside)
        mutate(ds, outside, random.Random(seed), kind)
        (outside / "meta" / "labels.npy").write_bytes(b"written through a symlink")
        copies.put_back(ds, outside)
        (tmp_path / f"case{seed}").rmdir()
        same(base, copies.dirs[0])
        same(base, copies.dirs[1])
