"""convert(..., if_changed=True) / --if-changed: reuse an output whose options and source files did not change."""

import json
import os

import pytest
from support.cli import run_cli
from support.imagesets import make_imagefolder

from packer import convert, open_dataset
from packer.errors import PackerError


def _stamp(out):
    st = (out / "manifest.json").stat()
    return st.st_ino, st.st_mtime_ns


def test_an_up_to_date_output_is_reused_and_the_cli_says_so(tmp_path):
    src = make_imagefolder(tmp_path / "src", classes=2, per_class=3)
    out = tmp_path / "o.lmdb"
    first = convert(src, out, if_changed=True, workers=0, progress=False)  # missing: converted
    assert not first.reused and first.num_samples == 6
    before = _stamp(out)
    again = convert(src, out, if_changed=True, workers=0, progress=False)
    assert again.reused and again.num_samples == 6 and again.errors == [] and _stamp(out) == before
    (src / "class_0" / "notes.txt").write_text("not an image: the output does not change")
    res = run_cli("convert", src, "-o", out, "--if-changed", "--overwrite", "--workers", "0")
    assert res.returncode == 0 and res.stdout.startswith(f"reused {out}: up to date"), res.stdout + res.stderr
    assert _stamp(out) == before


@pytest.mark.parametrize("change", ["touch", "add", "remove", "options"])
def test_a_stale_output_is_converted_again_only_with_overwrite(tmp_path, change):
    src = make_imagefolder(tmp_path / "src", classes=2, per_class=3)
    out = tmp_path / "o.lmdb"
    convert(src, out, workers=0, progress=False)
    options = {}
    if change == "touch":  # same bytes, a new modification time
        st = os.stat(src / "class_1" / "img_000.jpg")
        os.utime(src / "class_1" / "img_000.jpg", ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    elif change == "add":
        (src / "class_1" / "extra.jpg").write_bytes((src / "class_1" / "img_000.jpg").read_bytes())
    elif change == "remove":
        (src / "class_0" / "img_002.jpg").unlink()
    else:
        options = {"validate": "header"}
    before = _stamp(out)
    with pytest.raises(PackerError, match="out of date .*overwrite=True"):
        convert(src, out, if_changed=True, workers=0, progress=False, **options)
    assert _stamp(out) == before
    res = convert(src, out, if_changed=True, overwrite=True, workers=0, progress=False, **options)
    assert not res.reused and _stamp(out) != before
    assert res.num_samples == {"add": 7, "remove": 5}.get(change, 6)
    assert convert(src, out, if_changed=True, workers=0, progress=False, **options).reused


def test_outputs_without_a_recorded_source_are_stale(tmp_path):
    src = make_imagefolder(tmp_path / "src", classes=2, per_class=2)
    out = convert(src, tmp_path / "o.lmdb", workers=0, progress=False).output
    manifest = json.loads((out / "manifest.json").read_text())
    del manifest["source_digest"]  # as packer wrote it before
    (out / "manifest.json").write_text(json.dumps(manifest))
    assert len(open_dataset(out)) == 4  # still opens
    with pytest.raises(PackerError, match="did not record its source"):
        convert(src, out, if_changed=True, workers=0, progress=False)
