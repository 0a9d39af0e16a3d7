"""WebDataset shards as a source: written by webdataset's TarWriter, read by packer with tarfile alone,
checked against what webdataset itself reads from the same shards."""

from __future__ import annotations

import io
import json
import tarfile
from pathlib import Path

import pytest
from support.archives import zero_bomb_tgz
from support.cli import run_cli
from support.foreign import items, make_wds
from support.memlimit import limited_convert

from packer import open_dataset
from packer.write.sources.wdstar import expand_braces, list_shard, split_name

ITEMS = items(10)


@pytest.fixture(scope="module")
def shards(tmp_path_factory) -> list[Path]:
    return make_wds(tmp_path_factory.mktemp("wds") / "w", ITEMS, per_shard=4)


def pattern(shards: list[Path]) -> str:
    return str(shards[0].parent / "shards-{000000..000002}.tar")


def convert_ok(src: str | Path, out: Path, *args: str) -> dict:
    res = run_cli("convert", src, "--to", "lmdb", "-o", out, "--workers", "1", "--order", "source", *args)
    report = json.loads((out / "errors.json").read_text())
    assert res.returncode == (1 if report["num_errors"] else 0), res.stderr  # 1: some records not packed
    return report


def test_brace_pattern_converts_every_sample_with_its_bytes_label_and_verifies(shards, tmp_path):
    out = tmp_path / "out.lmdb"
    report = convert_ok(pattern(shards), out)
    assert report["num_errors"] == 0
    assert report["ignored"] == {}
    ds = open_dataset(out, image="numpy")
    assert ds.field_specs == {"txt": "str"}  # the other members become fields
    assert [ds.field("txt", i) for i in range(len(ds))] == [f"caption {it.key}" for it in ITEMS]
    assert [Path(r).name for r in ds.index.rel_paths()] == [f"{it.key}.jpg" for it in ITEMS]
    assert [bytes(ds.read_payload(i)) for i in range(len(ds))] == [it.image for it in ITEMS]
    assert ds.targets == [it.label for it in ITEMS] and ds.classes == ["0", "1", "2"]
    res = run_cli("verify", out, "--against", pattern(shards))
    assert res.returncode == 0, res.stdout + res.stderr


def test_webdataset_itself_reads_the_same_samples_from_the_shards(shards, tmp_path):
    import webdataset as wds

    out = tmp_path / "out.lmdb"
    convert_ok(shards[0].parent, out, "--source-type", "webdataset")  # a folder of .tar shards
    reader = wds.WebDataset([str(p) for p in shards], shardshuffle=False)
    theirs = [(s["__key__"], s["jpg"], int(s["cls"])) for s in reader]
    ds = open_dataset(out)
    ours = [(Path(r).stem, bytes(ds.read_payload(i)), ds.targets[i]) for i, r in enumerate(ds.index.rel_paths())]
    assert ours == theirs


def test_label_from_a_json_field_and_classes_from_a_file(tmp_path):
    shards = make_wds(tmp_path / "w", ITEMS[:6], per_shard=3, label="json")
    (tmp_path / "classes.txt").write_text("cat\ndog\nemu\n")
    out = tmp_path / "out.lmdb"
    convert_ok(shards[0].parent / "shards-{000000..000001}.tar", out, "--label-key", "label",
               "--classes-file", tmp_path / "classes.txt")
    ds = open_dataset(out)
    assert ds.targets == [it.label for it in ITEMS[:6]] and ds.classes == ["cat", "dog", "emu"]


def add(tf: tarfile.TarFile, name: str, data: bytes) -> None:
    info = tarfile.TarInfo(name)
    info.size = len(data)
    tf.addfile(info, io.BytesIO(data))


def test_bad_samples_and_a_truncated_shard_are_errors_naming_shard_and_key(tmp_path):
    folder = tmp_path / "w"
    folder.mkdir()
    a, b = ITEMS[0].image, ITEMS[1].image
    with tarfile.open(folder / "s-0.tar", "w", format=tarfile.GNU_FORMAT) as tf:
        add(tf, "good.jpg", a)
        add(tf, "good.cls", b"1")
        add(tf, "noimage.cls", b"2")  # no image member
        add(tf, "two.jpg", a)
        add(tf, "two.png", b)  # two images
        add(tf, "badlabel.jpg", a)
        add(tf, "badlabel.cls", b"one")
        add(tf, "nolabel.jpg", b)
        add(tf, "good.txt", b"apart from its sample")  # key seen earlier: not adjacent
    with tarfile.open(folder / "s-1.tar", "w", format=tarfile.GNU_FORMAT) as tf:
        add(tf, "fine.jpg", b)
        add(tf, "fine.cls", b"0")
        add(tf, "cut.jpg", a)
    data = (folder / "s-1.tar").read_bytes()
    end_of_cut = data.index(a) + len(a) // 2
    (folder / "s-1.tar").write_bytes(data[:end_of_cut])  # the last member's bytes stop half way
    out = tmp_path / "out.lmdb"
    report = convert_ok(folder / "s-{0..1}.tar", out)
    reasons = {e["path"]: e["reason"] for e in report["errors"]}
    assert "no image member" in reasons["s-0.tar/noimage"]
    assert "2 image members" in reasons["s-0.tar/two"]
    assert "not an integer" in reasons["s-0.tar/badlabel.jpg"]
    assert "no label" in reasons["s-0.tar/nolabel.jpg"]
    assert "key seen earlier" in reasons["s-0.tar/good"]
    assert "truncated" in reasons["s-1.tar/cut.jpg"]
    assert all(e["location"].startswith(("s-0.tar:", "s-1.tar:")) for e in report["errors"])
    ds = open_dataset(out)
    assert list(ds.index.rel_paths()) == ["s-0.tar/good.jpg", "s-1.tar/fine.jpg"] and ds.targets == [1, 0]
    res = run_cli("verify", out, "--against", folder / "s-{0..1}.tar")
    assert res.returncode == 0, res.stdout + res.stderr


def test_a_shard_cut_inside_a_header_and_a_missing_shard_are_reported(shards, tmp_path):
    folder = tmp_path / "w"
    folder.mkdir()
    data = shards[0].read_bytes()
    (folder / "s-0.tar").write_bytes(data[: 512 * 3 + 100])  # a header, data, then half a header
    report = convert_ok(folder / "s-{0..1}.tar", tmp_path / "out.lmdb")
    reasons = {e["path"]: e["reason"] for e in report["errors"]}
    assert "damaged" in reasons["s-0.tar/"] and "shard missing" in reasons["s-1.tar/"]


def test_not_a_tar_is_one_clear_line(tmp_path):
    (tmp_path / "s-0.tar").write_bytes(b"garbage" * 100)
    res = run_cli("convert", tmp_path / "s-{0..0}.tar", "--to", "lmdb", "-o", tmp_path / "o.lmdb")
    assert res.returncode == 2 and "Traceback" not in res.stderr
    assert res.stderr.startswith("packer: ") and "s-0.tar: not a readable tar file" in res.stderr


@pytest.mark.parametrize("text", ["s-{000000..000012}.tar", "a{1..3}b{x,y}", "{a,{1..2}}", "x{010..8..2}", "{a..d}",
                                  "plain.tar", "x{}y", "{x}{1..2}", "a{b{1..2},c}d", "q{-03..2}"])
def test_brace_patterns_expand_as_braceexpand_does(text):
    from braceexpand import braceexpand  # what webdataset expands its URLs with

    assert expand_braces(text) == list(braceexpand(text))


@pytest.mark.parametrize("name", ["a/b.c.D", "a/.hidden", "x.JPG", "noext", "dir.x/file", "a/b/c.tar.gz", "k.1.cls"])
def test_member_names_split_into_key_and_extension_as_webdataset_does(name):
    from webdataset.tariterators import base_plus_ext

    key, ext = base_plus_ext(name)
    assert split_name(name) == (None if key is None else (key, ext.lower()))


def test_listing_records_where_each_member_lies_in_the_shard(shards):
    listing = list_shard(shards[0])
    assert [s.key for s in listing.samples] == [it.key for it in ITEMS[:4]]
    member = listing.samples[0].members["jpg"]
    with open(shards[0], "rb") as fh:
        fh.seek(member.offset)
        assert fh.read(member.size) == ITEMS[0].image


def test_compressed_shards_are_streamed_in_order_with_the_same_records(shards, tmp_path):
    import gzip

    folder = tmp_path / "gz"
    folder.mkdir()
    for p in shards:
        (folder / (p.name + ".gz")).write_bytes(gzip.compress(p.read_bytes()))
    src = folder / "shards-{000000..000002}.tar.gz"
    out = tmp_path / "out.lmdb"
    assert convert_ok(src, out, "--workers", "2")["num_errors"] == 0
    ds = open_dataset(out)
    assert [bytes(ds.read_payload(i)) for i in range(len(ds))] == [it.image for it in ITEMS]
    assert ds.targets == [it.label for it in ITEMS] and ds.index.rel_path(0) == "shards-000000.tar.gz/s0000.jpg"
    res = run_cli("verify", out, "--against", src)
    assert res.returncode == 0, res.stdout + res.stderr


def test_other_members_become_fields_json_and_bytes_too(tmp_path):
    import webdataset as wds

    path = tmp_path / "w" / "shards-000000.tar"
    path.parent.mkdir()
    with wds.TarWriter(str(path)) as sink:
        for i, it in enumerate(ITEMS[:4]):
            sample = {"__key__": it.key, "jpg": it.image, "cls": it.label, "json": {"box": [i, 2 * i]},
                      "seg.bin": bytes([i]) * 3}
            if i != 2:
                sample["txt"] = f"caption {i}"
            sink.write(sample)
    out = tmp_path / "o.lmdb"
    assert convert_ok(path.parent, out)["num_errors"] == 0
    ds = open_dataset(out)
    assert ds.field_specs == {"json": "json", "seg_bin": "bytes", "txt": "str"}
    assert [ds.field("json", i) for i in range(4)] == [{"box": [i, 2 * i]} for i in range(4)]
    assert [ds.field("seg_bin", i) for i in range(4)] == [bytes([i]) * 3 for i in range(4)]
    assert [ds.field("txt", i) for i in range(4)] == ["caption 0", "caption 1", "", "caption 3"]  # absent: empty


@pytest.mark.parametrize("compressed", [False, True], ids=["tar", "tar.gz"])
def test_huge_negative_and_non_integer_cls_labels_are_errors_in_bounded_memory(tmp_path, compressed):
    """A ``.cls`` of 20 digits gave an OverflowError traceback and nothing converted; one of 100 million built
    100 million class names. Each is now its sample's error (shard and key), the rest converts, in 1 GiB."""
    folder = tmp_path / "w"
    folder.mkdir()
    labels = [b"0", b"100000000", b"99999999999999999999", b"-1", b"2.0", b"9" * 100_000, b"1"]
    name = folder / ("s-0.tar.gz" if compressed else "s-0.tar")
    with tarfile.open(name, "w:gz" if compressed else "w", format=tarfile.GNU_FORMAT) as tf:
        for k, label in enumerate(labels):
            add(tf, f"k{k}.jpg", ITEMS[k].image)
            add(tf, f"k{k}.cls", label)
    status, report = limited_convert(str(folder / f"s-{{0..0}}{name.name[3:]}"), tmp_path / "out.lmdb",
                                     order="source")
    assert status == "ok", report
    reasons = {e["path"]: e["reason"] for e in report["errors"]}
    assert {e["location"] for e in report["errors"]} == {f"s-0.tar{'.gz' * compressed}: key k{k}"
                                                         for k in range(1, 6)}
    assert reasons["s-0.tar.gz/k1.jpg" if compressed else "s-0.tar/k1.jpg"] == \
        "k1.cls: label 100000000 above 1,048,575: give --classes-file to name its classes"
    text = " ".join(reasons.values())
    assert "label 99999999999999999999 above" in text and "label -1: negative" in text
    assert "'2.0': not an integer" in text and "(100000 characters) above 1,048,575" in text
    ds = open_dataset(tmp_path / "out.lmdb")
    assert ds.targets == [0, 1] and ds.classes == ["0", "1"]


def test_json_labels_are_checked_the_same_way(tmp_path):
    folder = tmp_path / "w"
    folder.mkdir()
    with tarfile.open(folder / "s-0.tar", "w", format=tarfile.GNU_FORMAT) as tf:
        for k, label in enumerate([0, 10**30, -2, 2]):
            add(tf, f"k{k}.jpg", ITEMS[k].image)
            add(tf, f"k{k}.json", json.dumps({"label": label}).encode())
    status, report = limited_convert(str(folder / "s-{0..0}.tar"), tmp_path / "out.lmdb", label_key="label")
    assert status == "ok", report
    assert sorted(e["reason"] for e in report["errors"]) == [
        "k1.json: label 1000000000000000000000000000000 above 1,048,575: give --classes-file to name its classes",
        "k2.json: label -2: negative, not a class index"]
    assert sorted(open_dataset(tmp_path / "out.lmdb").targets) == [0, 2]


def test_a_compressed_shard_member_inflating_like_a_bomb_stops_the_shard_there(tmp_path):
    """A ``.tar.gz`` shard's image member of 640 MiB of zeros (~1 MB compressed): its sample is an error, and so is
    the rest of the shard (unreachable without inflating it); the samples before it convert, in 512 MiB."""
    folder = tmp_path / "w"
    folder.mkdir()
    before = [("k0.jpg", ITEMS[0].image), ("k0.cls", b"0")]
    zero_bomb_tgz(folder / "s-0.tar.gz", before, "k1.png", 640, [("k1.cls", b"1"), ("k2.jpg", ITEMS[2].image)])
    status, report = limited_convert(str(folder / "s-{0..0}.tar.gz"), tmp_path / "o.lmdb", limit=512 << 20,
                                     order="source")
    assert status == "ok", report
    errors = {e["path"]: e["reason"] for e in report["errors"]}
    assert set(errors) == {"s-0.tar.gz/k1", "s-0.tar.gz/"}
    assert errors["s-0.tar.gz/k1"].startswith("k1.png: inflates more than 200:1")
    assert errors["s-0.tar.gz/"].startswith("not read: member k1.png before it inflates more than 200:1")
    assert open_dataset(tmp_path / "o.lmdb").relpaths == ["s-0.tar.gz/k0.jpg"]


def test_compressed_shards_without_order_source_are_refused_before_they_are_read(tmp_path):
    (tmp_path / "s-0.tar.gz").write_bytes(b"not gzip" * 100)
    res = run_cli("convert", tmp_path / "s-{0..0}.tar.gz", "-o", tmp_path / "o.lmdb", "-q")
    assert res.returncode == 2 and "add --order source" in res.stderr and res.stderr.count("\n") == 1, res.stderr
