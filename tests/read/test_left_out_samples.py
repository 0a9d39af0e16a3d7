"""Files left out of a conversion (damaged, ``--classes``, ``--split``, a bad list row) keep the source's numbering
exact: ``ds`` stays dense over the packed samples, ``ds.imagefolder_index(i)`` / ``ds.from_imagefolder(j)`` map to
and from ``ImageFolder(source)`` (compared sample by sample with ImageFolder re-implemented in tests/support), the
claim "ds[i] is ImageFolder(source)[i]" is printed only where it holds, and opening says so once. The same for
list files, archives, re-packed datasets, WebDataset exports converted back and the Writer."""

from __future__ import annotations

import json
import shutil
import tarfile
import warnings
from pathlib import Path

import numpy as np
import pytest
from support.cli import run_cli
from support.fuzzing import _rewrite_checksums
from support.imagefolder import ImageFolder
from support.imagesets import jpeg_bytes
from torch.utils.data import DataLoader, Subset

from packer import NotPackedError, PackerError, Writer, convert, export_wds, open_dataset
from packer.errors import IndexingWarning
from packer.tools.info import dataset_info, info_rows

DAMAGED = ("class_0/img_06.jpg", "class_1/img_03.jpg")  # ImageFolder indices 2 and 10 of 19


def make_odd(root: Path) -> Path:
    """19 photos in 3 classes (7, 6, 6), two of them damaged (one truncated to its header, one not an image)."""
    rng = np.random.default_rng(3)
    for c, count in ((0, 7), (1, 6), (2, 6)):
        for k in range(count):
            path = root / f"class_{c}" / f"img_{3 * k if c == 0 else k:02d}.jpg"
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(jpeg_bytes(rng, 20 + int(rng.integers(0, 9)), 24 + int(rng.integers(0, 9))))
    (root / DAMAGED[0]).write_bytes((root / DAMAGED[0]).read_bytes()[:100])
    (root / DAMAGED[1]).write_bytes(b"garbage\n")
    return root


@pytest.fixture(scope="module")
def odd(tmp_path_factory) -> Path:
    return make_odd(tmp_path_factory.mktemp("odd") / "odd")


@pytest.fixture(scope="module")
def packed(odd, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("odd-out") / "odd.lmdb"
    return convert(odd, out, workers=0, progress=False, shard_bytes=20_000).output


def _open(path: Path, **kw):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", IndexingWarning)
        return open_dataset(path, **kw)


def _info_claim(path: Path) -> str:
    return dict(info_rows(path, dataset_info(path)))["indexing"]


def test_damaged_files_keep_imagefolder_indices_sample_by_sample(packed, odd):
    ref = ImageFolder(odd)
    ds = _open(packed, image="numpy")
    assert len(ref) == 19 and len(ds) == 17 and ds.source_records == 19 and ds.indexing == "subset"
    holes = [ref.samples.index((str(odd / d), int(d[6]))) for d in DAMAGED]
    assert holes == [2, 10]
    mapped = ds.imagefolder_index(range(len(ds)))
    assert mapped == [j for j in range(19) if j not in holes]
    assert sum(m != i for i, m in enumerate(mapped)) == 15  # what ds[i] = ImageFolder[i] would get wrong
    for i, j in enumerate(mapped):
        path, label = ref.samples[j]
        assert ds.imagefolder_index(i) == j and ds.from_imagefolder(j) == i
        assert np.array_equal(ds[i][0], np.asarray(ref[j][0])) and ds[i][1] == label == ds.targets[i]
        assert ds.samples[i] == (path, label) and bytes(ds.read_payload(i)) == Path(path).read_bytes()
    assert ds.imagefolder_index(-1) == 18 and ds.from_imagefolder(-1) == 16  # negative: from the end, like a list
    for j, rel in zip(holes, DAMAGED):
        with pytest.raises(NotPackedError, match=f"ImageFolder\\(source\\)\\[{j}\\] was not packed: {rel}: .*errors"):
            ds.from_imagefolder(j)
    with pytest.raises(LookupError):  # NotPackedError is a LookupError too
        ds.from_imagefolder([0, 2])
    assert ds.from_imagefolder([18, 2, 0, 10], missing="skip") == [16, 0]
    with pytest.raises(IndexError):
        ds.from_imagefolder(19)


def test_a_saved_imagefolder_split_still_picks_its_images(packed, odd):
    """A split saved as ImageFolder indices (before the conversion) selects the same images through a Subset."""
    ref = ImageFolder(odd)
    ds = _open(packed, image="numpy")
    split = [18, 3, 11, 7, 0, 12]
    subset = Subset(ds, ds.from_imagefolder(split))
    loader = DataLoader(subset, batch_size=None, num_workers=2, multiprocessing_context="fork")
    got = list(loader)
    assert [int(label) for _, label in got] == [ref.targets[j] for j in split]
    assert all(np.array_equal(np.asarray(img), np.asarray(ref[j][0])) for (img, _), j in zip(got, split))


def test_info_and_opening_say_so_only_where_the_claim_fails(packed, odd, tmp_path):
    claim = _info_claim(packed)
    assert "ds[i] is ImageFolder(source)[i]" not in claim and "2 of 19 source records not packed" in claim
    assert "ds.imagefolder_index(i)" in claim and "ds.from_imagefolder(j)" in claim
    assert "2 of 19" in run_cli("info", packed).stdout
    with pytest.warns(IndexingWarning) as caught:
        ds = open_dataset(packed)
        ds[0], ds[5], len(ds.samples)  # noqa: B018  reading warns no more
    assert len(caught) == 1
    assert "2 of the source's 19 records are not in this dataset (2 not packed" in str(caught[0].message)
    assert "ds.from_imagefolder" in str(caught[0].message)
    cli = run_cli("verify", packed, "--against", odd)
    assert cli.returncode == 0 and "IndexingWarning" not in cli.stderr, cli.stderr

    whole = tmp_path / "whole"
    shutil.copytree(odd, whole)
    for rel in DAMAGED:
        (whole / rel).unlink()
    clean = convert(whole, tmp_path / "whole.lmdb", workers=0, progress=False).output
    assert _info_claim(clean) == "ds[i] is ImageFolder(source)[i]"
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ds = open_dataset(clean, image="numpy")
    ref = ImageFolder(whole)
    assert ds.indexing == "imagefolder" and ds.source_records == len(ds) == len(ref)
    assert ds.imagefolder_index(range(len(ds))) == ds.from_imagefolder(range(len(ds))) == list(range(len(ds)))
    assert all(np.array_equal(ds[i][0], np.asarray(ref[i][0])) for i in range(len(ds)))


def test_classes_and_split_keep_the_whole_source_numbering(odd, tmp_path):
    ref = ImageFolder(odd)
    two = _open(convert(odd, tmp_path / "two.lmdb", classes=["class_1", "class_2"], workers=0,
                        progress=False).output, image="numpy")
    assert two.classes == ["class_1", "class_2"] and two.source_records == 19
    for i, j in enumerate(two.imagefolder_index(range(len(two)))):
        assert np.array_equal(two[i][0], np.asarray(ref[j][0])) and two.samples[i][0] == ref.samples[j][0]
    with pytest.raises(NotPackedError, match=r"\[0\] was not packed: left out by --classes class_1,class_2"):
        two.from_imagefolder(0)
    with pytest.raises(NotPackedError, match=r"\[10\] was not packed: class_1/img_03.jpg"):
        two.from_imagefolder(10)
    train, val = (_open(p.output, image="numpy") for p in
                  __import__("packer.write.convert", fromlist=["x"]).convert_split(
                      odd, tmp_path / "s.lmdb", split=0.5, workers=0, progress=False))
    parts = [set(train.imagefolder_index(range(len(train)))), set(val.imagefolder_index(range(len(val))))]
    assert not parts[0] & parts[1] and parts[0] | parts[1] == set(range(19)) - {2, 10}
    j = min(parts[1])
    with pytest.raises(NotPackedError, match="left out by --split 0.5 \\(train part\\)"):
        train.from_imagefolder(j)
    assert np.array_equal(val[val.from_imagefolder(j)][0], np.asarray(ref[j][0]))


def test_a_repack_keeps_the_original_numbering_and_reasons(packed, odd, tmp_path):
    ref = ImageFolder(odd)
    again = convert(packed, tmp_path / "again.hdf5", to="hdf5", workers=0, progress=False).output
    ds = _open(again, image="numpy")
    assert ds.source_records == 19 and ds.imagefolder_index(range(len(ds))) == _open(packed).imagefolder_index(
        range(17))
    assert all(np.array_equal(ds[i][0], np.asarray(ref[ds.imagefolder_index(i)][0])) for i in range(len(ds)))
    with pytest.raises(NotPackedError, match=f"{DAMAGED[1]}: not an image"):  # the original's reason, kept
        ds.from_imagefolder(10)
    assert json.loads((again / "errors.json").read_text())["num_errors"] == 0  # nothing failed in the re-pack
    assert "2 of 19 source records not packed" in _info_claim(again)
    once_more = _open(convert(again, tmp_path / "x.memmap", to="memmap", payload="raw", workers=0, progress=False,
                              order="source").output)
    assert once_more.imagefolder_index(range(17)) == ds.imagefolder_index(range(17))


def test_a_wds_export_and_back_keeps_the_numbering(packed, odd, tmp_path):
    ref = ImageFolder(odd)
    wds = export_wds(packed, tmp_path / "odd-wds", workers=0, progress=False).output
    keys = set()
    for shard in wds.glob("*.tar"):
        with tarfile.open(shard) as tf:
            keys |= {m.name.split(".")[0] for m in tf.getmembers()}
    keys = sorted(keys)
    assert [int(k) for k in keys] == [j for j in range(19) if j not in (2, 10)]  # ImageFolder's indices
    back = _open(convert(wds, tmp_path / "back.lmdb", workers=0, progress=False).output, image="numpy")
    assert back.source_records == 19 and back.relpaths == _open(packed).relpaths
    assert all(np.array_equal(back[i][0], np.asarray(ref[back.imagefolder_index(i)][0])) for i in range(len(back)))


def test_list_file_rows_and_archive_members_are_the_numbering(odd, tmp_path):
    rows = ["path,label", "class_0/img_00.jpg,0", "class_0/img_03.jpg,zebra", "class_2/img_01.jpg,2", "",
            "class_1/img_03.jpg,1", "class_1/img_04.jpg,1", "../up.jpg,1", "class_0/img_09.jpg,0"]
    (tmp_path / "list.csv").write_text("\n".join(rows) + "\n")
    ds = _open(convert(tmp_path / "list.csv", tmp_path / "list.lmdb", root=odd, workers=0,
                       progress=False).output, image="numpy")
    data = [r for r in rows[1:] if r]  # the data rows, numbered from 0
    assert ds.source_records == 7 and ds.imagefolder_index(range(len(ds))) == [0, 2, 4, 6]
    assert [f"{p},{t}" for p, t in zip(ds.relpaths, ds.targets)] == [data[j] for j in (0, 2, 4, 6)]
    assert "source record ds.imagefolder_index(i) (the list's data rows, from 0)" in _info_claim(ds.root)
    with pytest.raises(NotPackedError, match=r"record 1 was not packed: class_0/img_03.jpg, list.csv line 3: .*zebra"):
        ds.from_imagefolder(1)
    with pytest.raises(NotPackedError, match=r"record 3 was not packed: class_1/img_03.jpg, list.csv line 6"):
        ds.from_imagefolder(3)  # damaged: found when read, still named by its line
    with pytest.raises(NotPackedError, match=r"record 5 was not packed: \.\./up\.jpg.*leaves --root"):
        ds.from_imagefolder(5)

    with tarfile.open(tmp_path / "odd.tar", "w") as tf:
        for path in sorted(odd.rglob("*.jpg"), reverse=True):  # stored out of order: the numbering is ImageFolder's
            tf.add(path, path.relative_to(odd).as_posix())
    ref = ImageFolder(odd)
    arc = _open(convert(tmp_path / "odd.tar", tmp_path / "tar.lmdb", workers=0, progress=False).output,
                image="numpy")
    assert arc.source_records == 19 and arc.imagefolder_index(range(17)) == [j for j in range(19) if j not in (2, 10)]
    assert all(np.array_equal(arc[i][0], np.asarray(ref[arc.imagefolder_index(i)][0])) for i in range(17))


def test_writer_numbers_samples_as_added(tmp_path):
    rng = np.random.default_rng(0)
    images = [jpeg_bytes(rng, 16, 16) for _ in range(5)]
    with Writer(tmp_path / "w.lmdb", on_error="skip") as w:
        for k, img in enumerate(images):
            w.add(b"not an image" if k == 1 else img, label=k % 2)
    ds = _open(tmp_path / "w.lmdb")
    assert ds.source_records == 5 and ds.imagefolder_index(range(4)) == [0, 2, 3, 4]
    assert bytes(ds.read_payload(ds.from_imagefolder(3))) == images[3]
    with pytest.raises(NotPackedError, match=r"record 1 was not packed: 000000001: "):
        ds.from_imagefolder(1)
    assert "source record ds.imagefolder_index(i) (the order samples were added)" in _info_claim(ds.root)


def _as_older(path: Path) -> None:
    """A dataset written before packer recorded source indices: no source_index.npy, no source_records."""
    (path / "meta" / "source_index.npy").unlink()
    m = json.loads((path / "manifest.json").read_text())
    m["meta_files"] = [f for f in m["meta_files"] if f["name"] != "meta/source_index.npy"]
    m.pop("source_records")
    (path / "manifest.json").write_text(json.dumps(m))


def test_older_datasets_keep_working_and_never_claim_what_they_do_not_know(packed, tmp_path):
    old = tmp_path / "old.lmdb"
    shutil.copytree(packed, old)
    _as_older(old)
    claim = _info_claim(old)
    assert "ds[i] is ImageFolder(source)[i]" not in claim and "2 not packed" in claim and "convert again" in claim
    with pytest.warns(IndexingWarning, match="not recorded"):
        ds = open_dataset(old, image="numpy")
    assert len(ds) == 17 and ds.indexing == "subset" and ds.relpaths == _open(packed).relpaths
    for call in (lambda: ds.imagefolder_index(0), lambda: ds.from_imagefolder(0), lambda: ds.source_records):
        with pytest.raises(PackerError, match="convert it again"):
            call()
    whole = tmp_path / "whole.lmdb"  # an older dataset with nothing left out: the identity, as before
    shutil.copytree(packed, whole)
    _as_older(whole)
    m = json.loads((whole / "manifest.json").read_text())
    m["num_errors"] = 0
    (whole / "manifest.json").write_text(json.dumps(m))
    assert _info_claim(whole) == "ds[i] is ImageFolder(source)[i]" and _open(whole).imagefolder_index(3) == 3


@pytest.mark.parametrize("damage", ["repeat", "beyond", "no-count"])
def test_crafted_source_numbers_are_refused(packed, tmp_path, damage):
    crafted = tmp_path / "crafted.lmdb"
    shutil.copytree(packed, crafted)
    numbers = np.load(crafted / "meta" / "source_index.npy")
    m = json.loads((crafted / "manifest.json").read_text())
    if damage == "repeat":
        numbers[numbers == 1] = 0  # two samples claim ImageFolder index 0
    elif damage == "beyond":
        numbers[numbers == 18] = 1 << 40
    else:
        m.pop("source_records")
    np.save(crafted / "meta" / "source_index.npy", numbers)
    (crafted / "manifest.json").write_text(json.dumps(m))
    _rewrite_checksums(crafted)
    with pytest.raises(PackerError, match="source_index.npy"):
        open_dataset(crafted)
