"""Exceptions by kind: each raised from a real call and caught as the built-in a Python user would catch; messages
name arguments as the API takes them, the command line as its flags; exit codes as ``packer --help`` lists them."""

from __future__ import annotations

import pickle
import shutil

import pytest
from support.cli import run_cli
from support.imagesets import make_imagefolder
from torch.utils.data import DataLoader, Dataset

import packer
from packer import convert, open_dataset
from packer.cli import main
from packer.errors import (
    DatasetError,
    InputNotFoundError,
    MissingPackageError,
    OptionError,
    OutputExistsError,
    PackerError,
    RunError,
    arg,
    render,
    run_error_of,
)
from packer.tools.extract import extract


@pytest.fixture(scope="module")
def packed(tmp_path_factory):
    root = tmp_path_factory.mktemp("kinds")
    out = root / "imgs.lmdb"
    convert(make_imagefolder(root / "imgs", classes=2, per_class=3), out, workers=0, progress=False)
    return out


def test_the_kinds_are_exported_from_packer():
    for kind in (InputNotFoundError, OutputExistsError, OptionError, DatasetError, MissingPackageError):
        assert getattr(packer, kind.__name__) is kind and issubclass(kind, PackerError)


def test_a_missing_dataset_is_a_file_not_found_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="no such dataset") as err:
        open_dataset(tmp_path / "nope.lmdb")
    assert isinstance(err.value, InputNotFoundError)
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="manifest.json is missing"):
        open_dataset(tmp_path / "empty")


def test_a_missing_source_is_a_file_not_found_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="no such folder or file"):
        convert(tmp_path / "nope", tmp_path / "o.lmdb", workers=0, progress=False)


def test_an_output_in_the_way_is_a_file_exists_error_naming_the_keyword(packed, tmp_path):
    with pytest.raises(FileExistsError) as err:
        convert(tmp_path / "../imgs", packed, workers=0, progress=False)
    assert isinstance(err.value, OutputExistsError)
    assert "use overwrite=True to replace it" in str(err.value) and "--" not in str(err.value)
    (tmp_path / "a_file").write_text("mine")
    with pytest.raises(FileExistsError, match="not a packer dataset"):
        convert(packed.parent / "imgs", tmp_path / "a_file", workers=0, progress=False, overwrite=True)
    assert (tmp_path / "a_file").read_text() == "mine"


def test_extracting_over_files_is_a_file_exists_error(packed, tmp_path):
    extract(packed, tmp_path / "out")
    with pytest.raises(FileExistsError, match="use overwrite=True"):
        extract(packed, tmp_path / "out")


@pytest.mark.parametrize("call, match", [
    (lambda ds, tmp: open_dataset(ds, image="jpeg"), "unknown image kind 'jpeg'"),  # pyright: ignore[reportArgumentType]
    (lambda ds, tmp: convert(ds.parent / "imgs", tmp / "o.h5", to="hdf5", payload="encoded", resize=64),
     r"resize changes pixels, so it needs payload='raw'"),
    (lambda ds, tmp: convert(ds.parent / "imgs", tmp / "o", to="mosaic", tile="16x16", codec="jpeg", quality=0),
     "quality=0: expected an integer from 1 to 100"),
    (lambda ds, tmp: packer.BlockShuffleSampler(open_dataset(ds), run=0), "run must be at least 1"),
    (lambda ds, tmp: convert(ds.parent / "imgs", tmp / "o.lmdb", workers=-1), "workers -1"),
])
def test_a_bad_argument_is_a_value_error(packed, tmp_path, call, match):
    with pytest.raises(ValueError, match=match) as err:
        call(packed, tmp_path)
    assert isinstance(err.value, OptionError) and "--" not in str(err.value)
    assert not (tmp_path / "o").exists() and not (tmp_path / "o.h5").exists()


def test_a_damaged_dataset_is_a_dataset_error_and_not_an_os_error(packed, tmp_path):
    ds = tmp_path / "ds.lmdb"
    shutil.copytree(packed, ds)
    (ds / "manifest.json").write_text('{"kind": "packer-dataset", "version": 1, "num_samples": "many"}')
    with pytest.raises(DatasetError) as err:
        open_dataset(ds)
    assert not isinstance(err.value, OSError)  # a retry on OSError must not retry damage
    with pytest.raises(DatasetError) as err:  # met under way: a RunError (exit 1) that is still a DatasetError
        extract(ds, tmp_path / "out")
    assert isinstance(err.value, RunError) and type(err.value).__name__ == "DatasetError"


def test_a_missing_optional_package_is_an_import_error(monkeypatch):
    from packer.write.cluster import open_client

    monkeypatch.setitem(__import__("sys").modules, "distributed", None)  # as if Dask were not installed
    with pytest.raises(ImportError, match=r"pip install -e '\.\[dask\]'") as err:
        with open_client("local:2"):
            pass
    assert isinstance(err.value, MissingPackageError) and "scheduler" in str(err.value)


def test_the_command_line_names_flags_and_keeps_its_exit_codes(packed, tmp_path, capsys):
    assert main(["convert", str(packed.parent / "imgs"), "-o", str(packed), "-q"]) == 2
    err = capsys.readouterr().err
    assert "(use --overwrite to replace it)" in err and "overwrite=True" not in err
    assert main(["convert", str(packed.parent / "imgs"), "-o", str(tmp_path / "o.h5"), "--to", "hdf5",
                 "--resize", "64", "-q"]) == 2
    assert "--resize changes pixels, so it needs --payload raw" in capsys.readouterr().err
    assert main(["info", str(tmp_path / "nope")]) == 2
    ds = tmp_path / "ds.lmdb"
    shutil.copytree(packed, ds)
    (ds / "manifest.json").write_text("{ not json")
    assert main(["extract", str(ds), str(tmp_path / "out"), "-q"]) == 1  # damaged under way: still exit 1


def test_a_subprocess_prints_one_line_with_the_flag(packed):
    res = run_cli("convert", packed.parent / "imgs", "-o", packed, "-q", process=True)
    assert res.returncode == 2 and res.stderr.count("\n") == 1, res.stderr
    assert res.stderr.startswith(f"packer: error: {packed}: already exists (use --overwrite")


def test_arguments_render_as_keywords_or_flags():
    message = (f"{arg('overwrite', True)}, {arg('payload', 'raw')}, {arg('output')}, {arg('resize', '224x224')}, "
               f"{arg('shard_bytes', 10, cli='shard-size')}, {arg('classes', ['a b', 'c'])}")
    assert render(message) == "overwrite=True, payload='raw', output, resize='224x224', shard_bytes=10, " \
                              "classes=['a b', 'c']"
    assert render(message, cli=True) == "--overwrite, --payload raw, --output, --resize 224x224, --shard-size 10, " \
                                        "--classes 'a b,c'"
    exc = OptionError(f"bad {arg('payload', 'raw')}")
    assert str(exc) == "bad payload='raw'" and exc.cli_message() == "bad --payload raw"
    assert repr(exc) == "OptionError(\"bad payload='raw'\")"


@pytest.mark.parametrize("kind", [InputNotFoundError, OutputExistsError, OptionError, DatasetError,
                                  MissingPackageError])
def test_the_kinds_cross_process_boundaries(kind):
    """DataLoader workers and Dask tasks pickle exceptions: kind, message and the argument marks survive."""
    for exc in (kind(f"x: {arg('resume', True)}"), run_error_of(kind)(f"x: {arg('resume', True)}")):
        back = pickle.loads(pickle.dumps(exc))
        assert type(back) is type(exc) and back.cli_message() == "x: --resume" and str(back) == "x: resume=True"


class _Refuses(Dataset):
    """A dataset whose every sample raises one of packer's kinds, as a damaged dataset's would."""

    def __init__(self, kind: type[PackerError]) -> None:
        self.kind = kind

    def __len__(self) -> int:
        return 2

    def __getitem__(self, i: int):
        raise self.kind(f"sample {i}: {arg('resume', True)}")


@pytest.mark.parametrize("kind", [DatasetError, OptionError, InputNotFoundError])
def test_a_worker_process_error_reaches_the_loop_as_its_kind(kind):
    """torch re-raises a worker's exception by its type and message: packer's kinds survive it."""
    with pytest.raises(kind, match="sample 0"):
        next(iter(DataLoader(_Refuses(kind), num_workers=1, batch_size=None)))
