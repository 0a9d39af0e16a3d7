"""The conversion's counts: one count per source record, the same on stderr (the error report's headline) and
stdout (the summary), whatever the source; folders, link loops and the unread rest of an archive are named,
never counted as files. Each situation is one that gave an impossible count ("2 of 1 files not packed",
"1 of 0 files") before."""

from __future__ import annotations

import io
import json
import os
import re
import tarfile
import zlib
from pathlib import Path

import pytest
from support.cli import run_cli
from support.imagesets import make_imagefolder

from packer.write.sources.records import SourceError
from packer.write.summary import conversion_summary, not_packed_line


def counts(src: Path, out: Path, *args: object) -> tuple[tuple[int, int], tuple[int, int], str, dict]:
    """((not packed, of), (packed, of)) as the command line prints them, its "left out" line and errors.json."""
    res = run_cli("convert", src, "-o", out, "--workers", "0", "--order", "source", *args)
    assert res.returncode == 1 and "Traceback" not in res.stderr, res.stderr
    head = re.search(r"packer: (\d+) of (\d+) files not packed", res.stderr)
    summary = re.search(r"^packed (\d+) of (\d+) files", res.stdout, re.M)
    assert head and summary, res.stdout + res.stderr
    left = next(line for line in res.stdout.splitlines() if line.startswith("left out: "))
    report = json.loads((out / "errors.json").read_text())
    return ((int(head[1]), int(head[2])), (int(summary[1]), int(summary[2])), left, report)


def test_link_loops_count_as_files_only_where_imagefolder_lists_a_file(tmp_path):
    src = make_imagefolder(tmp_path / "src", classes=2, per_class=2)
    os.symlink("..", src / "class_0" / "up")  # a folder leading back above it: a folder not followed
    os.symlink("loop", src / "class_0" / "loop")  # a link to itself without an image name: no record
    os.symlink("self.jpg", src / "class_1" / "self.jpg")  # os.walk takes it for a file: ImageFolder lists it
    os.symlink("top", src / "top")  # at the top, where a class folder would be: no record
    (not_packed, of), (packed, found), left, report = counts(src, tmp_path / "o.lmdb")
    assert (not_packed, of) == (1, 5) and (packed, found) == (4, 5)
    assert left == ("left out: 1 not packed (see errors.json), 3 folders or parts of the source not read "
                    "(see errors.json)")
    records = {e["path"]: e.get("record", True) for e in report["errors"]}
    assert records == {"class_0/up/": False, "class_0/loop": False, "class_1/self.jpg": True, "top": False}


def test_a_list_of_missing_files_and_bad_rows_counts_each_row_once(tmp_path):
    imgs = make_imagefolder(tmp_path / "imgs", classes=1, per_class=2)
    listing = tmp_path / "l.csv"
    listing.write_text("path,label\nclass_0/img_000.jpg,0\nclass_0/gone.jpg,0\nclass_0/img_001.jpg,x\n"
                       "class_0/also-gone.jpg,1\n../out.jpg,0\n")
    (not_packed, of), (packed, found), left, report = counts(listing, tmp_path / "o.lmdb", "--root", imgs)
    assert (not_packed, of) == (4, 5) and (packed, found) == (1, 5)
    assert left == "left out: 4 not packed (see errors.json)"
    assert len(report["errors"]) == 4


def test_every_sample_failing_counts_them_all(tmp_path):
    """A WebDataset shard whose only samples have bad labels: "2 of 2 files", no longer "2 of 0"."""
    folder = tmp_path / "w"
    folder.mkdir()
    with tarfile.open(folder / "s-0.tar", "w", format=tarfile.GNU_FORMAT) as tf:
        for name, data in (("a.jpg", b"\xff\xd8x"), ("a.cls", b"-1"), ("b.jpg", b"\xff\xd8y"), ("b.cls", b"x")):
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tf.addfile(info, io.BytesIO(data))
    res = run_cli("convert", folder / "s-{0..0}.tar", "-o", tmp_path / "o.lmdb", "--workers", "0")
    assert "packer: 2 of 2 files not packed" in res.stderr, res.stderr


def test_the_unread_rest_of_a_damaged_archive_is_named_not_counted(tmp_path):
    imgs = make_imagefolder(tmp_path / "imgs", classes=2, per_class=2)
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tf:
        for p in sorted(imgs.rglob("*.jpg")):
            tf.add(p, arcname=p.relative_to(imgs).as_posix())
    data = zlib.compress(buf.getvalue(), wbits=31)
    src = tmp_path / "cut.tar.gz"
    src.write_bytes(data[: len(data) * 2 // 3])  # the stream stops inside the third or fourth member
    (not_packed, of), (packed, found), left, report = counts(src, tmp_path / "o.lmdb")
    rest = [e for e in report["errors"] if e["path"].startswith("(after ")]
    assert len(rest) == 1 and rest[0]["record"] is False
    assert of == packed + not_packed == found and not_packed == len(report["errors"]) - 1
    assert left.endswith("1 folder or part of the source not read (see errors.json)")


@pytest.mark.parametrize(("errors", "line"), [
    ([SourceError("a.jpg", "x")], "1 of 3 files not packed"),
    ([SourceError("d/", "x", record=False)], "1 folder or part of the source not read"),
    ([SourceError("a.jpg", "x"), SourceError("b.jpg", "x"), SourceError("d/", "x", record=False),
      SourceError("(after 3 members)", "x", record=False)],
     "2 of 4 files not packed and 2 folders or parts of the source not read"),
])
def test_not_packed_line(errors, line):
    assert not_packed_line(2, errors) == line
    assert conversion_summary(2, {}, errors) == f"packed 2 of {2 + sum(e.record for e in errors)} files"


def test_an_error_report_from_before_counts_folders_apart():
    """errors.json of older conversions has no "record": a path ending in "/" is a folder, as it always was."""
    assert SourceError.from_json({"path": "d/", "reason": "x"}).record is False
    assert SourceError.from_json({"path": "a.jpg", "reason": "x", "location": "l"}).record is True
    entry = SourceError("top", "loop", record=False)
    assert SourceError.from_json(entry.to_json()) == entry
