"""The one conversion driver (write/convert.py): any ``Sink`` behind it gets the scan, the order, the output's lock,
the numbered and located errors.json entries, nothing that looks complete before the end, and the move into place;
and every file operation of a dataset goes through the ``Output`` it is given (the seam for other kinds of output)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from support.imagefolder import ImageFolder
from support.imagesets import make_imagefolder

from packer.errors import Interrupted, PackerError
from packer.formats import get_format
from packer.tools.verify import verify
from packer.write.convert import drive
from packer.write.dataset_sink import DatasetSink
from packer.write.export_wds import ExportSink
from packer.write.finish import write_error_report
from packer.write.lock import OutputLock
from packer.write.options import WDS, ConvertOptions, RunOptions
from packer.write.output import Output
from packer.write.sink import Finished, Sink
from packer.write.sources.base import RecordError, SourceOptions
from packer.write.sources.records import ScanResult, SourceError

RUN = RunOptions(workers=0, progress=False)


class KeysSink(Sink):
    """A sink of the test's own: one line per readable record (its key and label, in dataset order) in keys.txt,
    ``done`` written last. ``during``: called after the first record (a Ctrl-C, a second run)."""

    name = "keys"
    resumable = False

    def __init__(self, during=None) -> None:
        self.during = during
        self.count = 0

    def options(self, given):
        opts = ConvertOptions(format=WDS, **given)  # no options of its own, as the export
        opts.check()
        return opts

    def accept(self, scan, options, payload) -> None:
        pass

    def start(self, scan, output: Output, options, resume) -> OutputLock:
        return output.start({"kind": "keys"})

    def recorded_samples(self, folder: Path) -> int:
        return len((folder / "keys.txt").read_text().splitlines())

    def write(self, scan: ScanResult, output: Output, options, run) -> list[SourceError]:
        errors = []
        reader = scan.source_reader()
        with open(output.folder / "keys.txt", "w") as f:
            for rel, label, loc in scan.records():
                try:
                    reader.read(rel, loc)
                except RecordError as exc:
                    errors.append(SourceError(rel, str(exc)))
                    continue
                f.write(f"{rel} {label}\n")
                self.count += 1
                if self.during is not None and self.count == 1:
                    self.during()
        return errors

    def finish(self, scan, output: Output, errors, options, source) -> Finished:
        write_error_report(output.folder, errors, scan.ignored, self.count, scan.earlier)
        output.seal(lambda folder: (folder / "done").write_text("ok"))
        return Finished(self.count, 0)


@pytest.fixture
def src(tmp_path) -> Path:
    src = make_imagefolder(tmp_path / "imgs", classes=2, per_class=3)
    (src / "class_1" / "img_001.jpg").unlink()
    os.symlink(src / "nowhere.jpg", src / "class_1" / "img_001.jpg")  # listed by the scan, unreadable
    return src


def test_a_sink_of_its_own_gets_the_order_the_numbering_errors_json_and_the_move_into_place(src, tmp_path):
    out = tmp_path / "keys"
    res = drive(src, Output(out), KeysSink(), RUN, SourceOptions(), {"order": "source"})
    reference = [(os.path.relpath(p, src), label) for p, label in ImageFolder(src).samples]
    assert (out / "keys.txt").read_text().splitlines() == [f"{r} {lab}" for r, lab in reference
                                                           if r != "class_1/img_001.jpg"]
    report = json.loads((out / "errors.json").read_text())
    assert [(e["path"], e["index"]) for e in report["errors"]] == [("class_1/img_001.jpg", 4)]
    assert res.num_samples == 5 and [e.index for e in res.errors] == [4] and (out / "done").is_file()
    assert not (tmp_path / "keys.partial").exists()
    shuffled = drive(src, Output(tmp_path / "shuffled"), KeysSink(), RUN, SourceOptions(), {"seed": 1})
    lines = (shuffled.output / "keys.txt").read_text().splitlines()
    assert sorted(lines) == sorted((out / "keys.txt").read_text().splitlines()) and lines != sorted(lines)


def test_a_sink_of_its_own_holds_the_output_and_leaves_nothing_when_interrupted(src, tmp_path):
    out = tmp_path / "keys"
    seen = []

    def second_run():  # while the first holds the output's lock
        with pytest.raises(PackerError, match=f"in use by pid {os.getpid()}"):
            drive(src, Output(out), KeysSink(), RUN, SourceOptions(), {})
        seen.append("refused")

    drive(src, Output(out), KeysSink(during=second_run), RUN, SourceOptions(), {})
    assert seen == ["refused"] and (out / "done").is_file()

    def ctrl_c():
        raise KeyboardInterrupt

    other = tmp_path / "other"
    with pytest.raises(Interrupted, match="nothing was kept"):
        drive(src, Output(other), KeysSink(during=ctrl_c), RUN, SourceOptions(), {})
    assert not other.exists() and not (tmp_path / "other.partial").exists()


class Recorded(Output):
    """The local output, its file operations recorded in order."""

    def __init__(self, path: Path) -> None:
        super().__init__(path)
        self.calls: list[str] = []

    def start(self, plan):
        self.calls.append("start")
        return super().start(plan)

    def shard_done(self, result, names):
        self.calls.append(f"shard {result.shard_id}")
        return super().shard_done(result, names)

    def seal(self, write_last):
        self.calls.append("seal")
        super().seal(lambda folder: (self.calls.append("last"), write_last(folder)))


@pytest.mark.parametrize("to", ["lmdb", "wds"])
def test_every_file_operation_goes_through_the_output_given(src, tmp_path, to):
    """The driver and the sinks make, journal and finish the output through the ``Output`` they are given: the
    plan first, each shard journaled as it is done (a dataset), the last file last, then the move into place."""
    output = Recorded(tmp_path / f"o.{to}")
    sink = DatasetSink(get_format(to)) if to != WDS else ExportSink()
    res = drive(src, output, sink, RUN, SourceOptions(), {"shard_bytes": 2000, "order": "source"})
    journaled = len(output.calls) - 3  # every planned shard (one holding only the unreadable record is left out)
    assert output.calls == ["start", *(f"shard {i}" for i in range(journaled)), "seal", "last"]
    assert res.num_samples == 5
    if to != WDS:
        assert journaled >= len(json.loads((output.path / "manifest.json").read_text())["shards"]) > 1
        assert verify(output.path, against=src).ok
    else:
        assert journaled == 0 and len(list(output.path.glob("*.tar"))) > 1  # an export journals no shard
