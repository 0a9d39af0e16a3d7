"""The formats pages as pasted (docs/formats-*.md): every block runs in order, as the README's do
(tests/support/pasted.py), in the folder the README's "In one minute" leaves (``imgs/`` of 48 sample photos,
``imgs.lmdb``); each snippet that reads sample ``i`` of a dataset ``root`` without packer must get ImageFolder's
sample ``i``: the file's bytes (``jpeg_bytes``), its label (``label``), or the stored pixels (``pixels``)."""

from __future__ import annotations

import pytest
from support.pasted import REPO, Substitution, blocks, checkout, environment, run, run_page, text_commands

PAGES = sorted((REPO / "docs").glob("formats-*.md"))
COUNT = 48
SUBSTITUTIONS = (
    Substitution(r"--count \d[\d,]*", f"--count {COUNT}", "sample sets of 48 photos, not 500 or 2,000"),
    Substitution(r"--repeats \d+", "--repeats 1", "one timed repeat of each measurement"),
    Substitution(r"--batch-size 256", "--batch-size 16", "batches that 48 photos fill"),
)
# the README's "In one minute", which these pages start from
BEFORE = (f"packer sample imgs/ --count {COUNT} --classes 3 -q", "packer convert imgs/ --to lmdb -q")
# run after each python block, in its interpreter: a block that reads sample i of dataset root read ImageFolder's
CHECK = f"""
# ---- appended by tests/test_formats_docs.py ----
import sys as _sys
_sys.path.insert(0, {str(REPO / "tests")!r})
from support.imagefolder import ImageFolder as _ImageFolder
if "root" in globals() and "i" in globals():
    _path, _target = _ImageFolder("imgs").samples[i]
    _read = [name for name in ("jpeg_bytes", "pixels") if name in globals()]
    assert _read, "a block naming a dataset and a sample read neither jpeg_bytes nor pixels"
    if "jpeg_bytes" in globals():
        assert bytes(jpeg_bytes) == open(_path, "rb").read(), (root, i, "not ImageFolder's file")
    if "label" in globals():
        assert int(label) == _target, (root, i, label, _target)
    if "pixels" in globals():
        import numpy as _np
        from packer import open_dataset as _open
        _ds = _open(root, image="numpy")
        import os as _os
        assert _os.path.samefile(_ds.samples[i][0], _path), (root, i)  # packer's i is ImageFolder's: the reference
        assert _np.array_equal(_np.asarray(pixels), _ds[i][0]), (root, i, "not the stored pixels of sample i")
    print(f"checked: {{root}} sample {{i}} is ImageFolder's {{_path}}")
"""


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_every_block_has_a_language_and_no_text_block_hides_a_command(page):
    found = blocks(page.read_text())
    assert not [b.line for b in found if not b.lang], f"{page.name}: blocks without a language"
    hidden = [f"line {b.line}: {line}" for b in found for line in text_commands(b)]
    assert not hidden, f"commands in {page.name}'s text blocks:\n" + "\n".join(hidden)


def test_the_pages_read_without_packer_name_the_mapping_from_record_to_sample():
    """Record k of a shard is not sample k under the default shuffled order: each page says so and how to map."""
    for page in PAGES:
        text = page.read_text()
        assert "meta/position.npy" in text and "Record k is not sample k" in text, page.name


@pytest.mark.slow
@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_page_runs_as_pasted(page, tmp_path):
    cwd = checkout(tmp_path / "checkout")
    for command in BEFORE:
        run(command, cwd, environment(), "the README's In one minute")
    done = run_page(page, cwd, SUBSTITUTIONS, epilogue=CHECK)
    readers = sum(b.lang == "python" and not b.needs and "root, i = " in b.body for b in blocks(page.read_text()))
    assert readers >= 3 and done["stdout"].count("checked: ") == readers, done["stdout"]
