"""packer convert changes nothing it did not make: not the source, not a folder around it, not a file
or folder that is not a packer dataset, not a user's ``X.old`` or ``X.partial``."""

from __future__ import annotations

import hashlib
import os
import random
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest
from support.imagesets import make_imagefolder
from support.interrupt import run_cli_at

from packer import PackerError, convert, open_dataset
from packer.tools.verify import verify

REPO = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "PYTHONPATH": str(REPO)}


def packer_cli(*args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "packer", *map(str, args)], env=ENV, capture_output=True, text=True)


def tree_state(root: Path) -> dict[str, str]:
    """Every entry below ``root``: folders, symlinks (their target) and files (sha256), by relative path."""
    state = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            path = Path(dirpath) / name
            mode = os.lstat(path).st_mode
            if stat.S_ISLNK(mode):
                kind = "link:" + os.readlink(path)
            elif stat.S_ISDIR(mode):
                kind = "dir"
            else:
                kind = hashlib.sha256(path.read_bytes()).hexdigest()
            state[path.relative_to(root).as_posix()] = kind
    return state


def without(state: dict[str, str], root: Path, *paths: Path) -> dict[str, str]:
    """``state`` (of ``root``) minus ``paths`` and everything below them."""
    rels = [p.relative_to(root).as_posix() for p in paths]
    return {k: v for k, v in state.items() if not any(k == r or k.startswith(r + "/") for r in rels)}


@pytest.fixture
def world(tmp_path):
    """tmp/w/src (the source), with bystanders beside it and beside its parent."""
    src = make_imagefolder(tmp_path / "w" / "src", classes=2, per_class=2, size=(16, 16))
    (tmp_path / "w" / "notes.txt").write_text("mine")
    (tmp_path / "keep.txt").write_text("mine too")
    return tmp_path, src


@pytest.mark.parametrize("where", ["the source", "its parent", "inside it", "a link to it", "inside via a link"])
def test_output_that_is_holds_or_lies_inside_the_source_is_refused(world, where):
    root, src = world
    (root / "link").symlink_to(src)
    out = {"the source": src, "its parent": src.parent, "inside it": src / "class_0" / "o.lmdb",
           "a link to it": root / "link", "inside via a link": root / "link" / "o.lmdb"}[where]
    before = tree_state(root)
    with pytest.raises(PackerError, match="source folder"):
        convert(src, out, overwrite=True, resume=True, workers=0, progress=False)
    assert tree_state(root) == before


@pytest.mark.parametrize("kind", ["file", "folder", "broken link", "foreign manifest"])
def test_overwrite_replaces_only_a_packer_dataset(world, kind):
    root, src = world
    out = root / "w" / "x.lmdb"
    if kind == "file":
        out.write_text("my notes")
    elif kind == "broken link":
        out.symlink_to(root / "nowhere")
    else:
        out.mkdir()
        (out / "manifest.json").write_text('{"kind": "something else"}' if kind == "foreign manifest" else "{}")
    before = tree_state(root)
    with pytest.raises(PackerError, match=rf"{out}: exists and is .*not a packer dataset"):
        convert(src, out, overwrite=True, workers=0, progress=False)
    assert tree_state(root) == before


def test_empty_output_path_is_refused(world, monkeypatch):
    root, src = world
    monkeypatch.chdir(root / "w")
    before = tree_state(root)
    with pytest.raises(PackerError, match="output path is empty"):
        convert(src, "", overwrite=True, workers=0, progress=False)
    res = packer_cli("convert", src, "-o", "", "--overwrite", "-q")
    assert res.returncode == 2 and "output path is empty" in res.stderr
    assert tree_state(root) == before


def test_a_users_dot_old_survives_conversion_and_overwrite(world):
    root, src = world
    out = root / "w" / "x.lmdb"
    backup = out.with_name("x.lmdb.old")
    backup.mkdir()
    (backup / "precious.txt").write_text("my manual backup")
    convert(src, out, workers=0, progress=False)
    convert(src, out, overwrite=True, workers=0, progress=False)
    assert (backup / "precious.txt").read_text() == "my manual backup"
    assert sorted(p.name for p in out.parent.iterdir()) == ["notes.txt", "src", "x.lmdb", "x.lmdb.old"]


@pytest.mark.parametrize("kind", ["folder", "empty folder", "file"])
def test_a_partial_packer_did_not_make_is_refused_never_deleted(world, kind):
    root, src = world
    out = root / "w" / "x.lmdb"
    partial = out.with_name("x.lmdb.partial")
    if kind == "file":
        partial.write_text("mine")
    else:
        partial.mkdir()
        if kind == "folder":
            (partial / "work.txt").write_text("mine")
    before = tree_state(root)
    for resume in (True, False):
        with pytest.raises(PackerError, match=rf"{partial}: exists but was not made by packer"):
            convert(src, out, resume=resume, workers=0, progress=False)
        assert tree_state(root) == before


def test_cli_refusals_exit_2_with_one_line(world):
    root, src = world
    (root / "w" / "file.lmdb").write_text("mine")
    before = tree_state(root)
    for out in (src, src.parent, src / "o.lmdb", root / "w" / "file.lmdb"):
        res = packer_cli("convert", src, "-o", out, "--overwrite", "-q")
        assert res.returncode == 2, res.stderr
        assert res.stderr.startswith(f"packer: error: {out}: ") and res.stderr.count("\n") == 1, res.stderr
    assert tree_state(root) == before


# ---------------------------------------------------------------- random combinations

# the two outputs a conversion may write come up more often, so both outcomes are well represented
TARGETS = ("new", "source", "dataset", "parent", "new", "inside", "dataset", "file", "new", "folder", "dataset")


@pytest.fixture(scope="module")
def templates(tmp_path_factory):
    """A source, a dataset of it, and the .partial a conversion of it leaves when killed mid-way."""
    base = tmp_path_factory.mktemp("templates")
    src = make_imagefolder(base / "src", classes=2, per_class=2, size=(16, 16))
    convert(src, base / "ds.lmdb", workers=0, progress=False)
    run = run_cli_at(["convert", src, "-o", base / "cut.lmdb", "--workers", "0", "-q"], ENV,
                     "open", "shard-00000.json.tmp", "kill")
    assert run.returncode == -9 and (base / "cut.lmdb.partial" / "journal" / "plan.json").is_file(), run.stderr
    return src, base / "ds.lmdb", base / "cut.lmdb.partial"


def _place(path: Path, kind: str | None, templates) -> None:
    """Put a pre-existing ``kind`` of thing at ``path``."""
    _src, dataset, partial = templates
    if kind == "file":
        path.write_text("a user's file")
    elif kind == "folder":
        path.mkdir()
        (path / "data.txt").write_text("a user's data")
    elif kind == "dataset":
        shutil.copytree(dataset, path)
    elif kind == "packer partial":
        shutil.copytree(partial, path)


def _case(root: Path, rng: random.Random, target: str, templates):
    """Build one random situation under ``root``; returns (src, out, convert kwargs, partial kind)."""
    src = root / "w" / "src"
    shutil.copytree(templates[0], src)
    (root / "w" / "notes.txt").write_text("mine")
    out = {"new": root / "w" / "out.lmdb", "source": src, "parent": src.parent, "inside": src / "class_0" / "o.lmdb",
           "file": root / "w" / "f.lmdb", "folder": root / "w" / "d.lmdb", "dataset": root / "w" / "ds.lmdb"}[target]
    _place(out, {"file": "file", "folder": "folder", "dataset": "dataset"}.get(target), templates)
    _place(out.with_name(out.name + ".old"), rng.choice([None, "file", "folder", "dataset"]), templates)
    partial = rng.choice([None, None, None, "file", "folder", "packer partial", "packer partial"])
    _place(out.with_name(out.name + ".partial"), partial, templates)
    return src, out, {"overwrite": rng.random() < 0.5, "resume": rng.random() < 0.5}, partial


def test_random_situations_change_nothing_but_the_output(tmp_path, templates):
    rng = random.Random(1234)
    outcomes = []
    for n in range(42):
        root = tmp_path / f"case{n}"
        target = TARGETS[n % len(TARGETS)]
        src, out, kw, partial = _case(root, rng, target, templates)
        may = target in ("new", "dataset") and (target == "new" or kw["overwrite"]) and \
            (partial is None or (partial == "packer partial" and kw["resume"]))
        # --resume of the finished conversion the dataset there is (the same source files and options): nothing to do
        done = target == "dataset" and kw["resume"] and not kw["overwrite"] and partial is None
        before = tree_state(root)
        where = f"case {n}: -o {target}, {kw}, .partial {partial}"
        try:
            convert(src, out, workers=0, progress=False, **kw)
        except PackerError as exc:
            assert not (may or done), f"{where}: refused ({exc})"
            assert tree_state(root) == before, f"{where}: a refusal changed something"
            outcomes.append("refused")
            continue
        if done:
            assert tree_state(root) == before, f"{where}: nothing to resume, yet something changed"
            outcomes.append("nothing to resume")
            continue
        assert may, f"{where}: succeeded"
        assert len(open_dataset(out)) == 4 and verify(out, against=src).ok, where
        made = [out, out.with_name(out.name + ".partial")] if partial == "packer partial" else [out]
        assert without(tree_state(root), root, out) == without(before, root, *made), where
        outcomes.append("converted")
    assert outcomes.count("converted") >= 8 and outcomes.count("refused") >= 8, outcomes
