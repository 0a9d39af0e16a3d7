"""The command line's numeric options and exit codes: nonsense is refused with exit 2 and a clear
message before any work (the Python API raises PackerError for the same values); 1 means the
command ran and found a problem; the convention is stated in ``packer --help`` and the README."""

from __future__ import annotations

import argparse
import math
import shutil
from pathlib import Path

import pytest

from packer import PackerError, convert
from packer.cli import build_parser, main
from packer.tools.sample import make_sample
from packer.units import parse_bytes

REPO = Path(__file__).resolve().parent.parent


def exit_code(argv: list[str]) -> int:
    try:
        return main(argv)
    except SystemExit as exc:  # argparse's usage errors
        return int(exc.code)


# (command line before the option, option, nonsense values): every numeric option of every command
NONSENSE = [
    (["convert", "SRC"], "--workers", ["-1", "two"]),
    (["convert", "SRC"], "--shard-size", ["0", "-5MB", "..", "big"]),
    (["convert", "SRC", "--to", "n5"], "--n5-block", ["0", "-5MB", "big"]),
    (["convert", "SRC"], "--seed", ["-1", "1.5"]),
    (["convert", "SRC"], "--split", ["0", "1", "-0.5", "nan", "half"]),
    (["convert", "SRC", "--to", "mosaic", "--tile", "16x16", "--codec", "jpeg"], "--quality", ["0", "101", "-3"]),
    (["sample", "OUT"], "--count", ["0", "-2", "99999999999"]),
    (["sample", "OUT"], "--classes", ["-1"]),
    (["sample", "OUT"], "--size", ["0x0", "375x0", "375", "100000x100", "axb"]),
    (["sample", "OUT"], "--quality", ["0", "500"]),
    (["sample", "OUT"], "--seed", ["-1"]),
    (["profile", "DS"], "--workers", ["-1", "1,-2", ","]),
    (["profile", "DS"], "--batch-size", ["0", "4,0"]),
    (["profile", "DS"], "--step-ms", ["-1", "nan", "inf", "1e9"]),
    (["profile", "DS"], "--batches", ["1", "0"]),
    (["profile", "DS"], "--crop", ["-3"]),
    (["doctor"], "--seconds", ["0", "-1", "nan", "inf"]),
    (["bench", "P"], "--sizes", ["0", "full,-2", "abc"]),
    (["bench", "P"], "--seconds", ["0", "nan"]),
    (["bench", "P"], "--workers", ["-1", ""]),
    (["bench", "P"], "--batch-size", ["0"]),
    (["bench", "P"], "--repeats", ["0"]),
    (["bench", "P"], "--limit", ["0", "-4"]),
    (["bench", "P"], "--seed", ["-1"]),
    (["bench", "P"], "--block-size", ["0"]),
    (["bench", "P"], "--open-blocks", ["0"]),
    (["bench", "P"], "--run", ["0"]),
    (["bench", "P"], "--ceiling-size", ["0"]),
    (["bench", "P"], "--read-iops", ["0", "-5"]),
    (["bench", "P"], "--read-bps", ["0"]),
    (["bench", "P"], "--latency", ["-1", "nan", "61"]),
    (["bench", "P"], "--bandwidth", ["0", "-5MB"]),
]


@pytest.mark.parametrize("head, option, values", NONSENSE, ids=[f"{h[0]}{o}" for h, o, _ in NONSENSE])
def test_nonsense_numeric_values_are_usage_errors(head, option, values, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)  # nothing may be created: the paths do not exist and must stay so
    for value in values:
        assert exit_code([*head, f"{option}={value}"]) == 2, (option, value)
        err = capsys.readouterr().err
        assert f"argument {option}" in err and "Traceback" not in err, err
    assert not list(tmp_path.iterdir())


def test_every_typed_option_is_range_checked_and_tried_here():
    """No option is typed plain int/float/size (unchecked), and every typed option is in NONSENSE above."""
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    typed = [(name, a.option_strings[-1], a.type) for name, p in sub.choices.items() for a in p._actions
             if a.type is not None and a.option_strings]
    assert not [t[:2] for t in typed if t[2] in (int, float, parse_bytes)]
    words = {("bench", "--levels"), ("bench", "--orders")}  # lists of names, checked by the bench
    assert {t[:2] for t in typed} - words == {(h[0], o) for h, o, _ in NONSENSE}


@pytest.mark.parametrize("kwargs, match", [
    ({"count": 0}, "count=0"), ({"size": (0, 0)}, "size=.0, 0."), ({"size": (375, 100_000)}, "size="),
    ({"quality": 500}, "quality=500"), ({"quality": 0}, "quality=0"), ({"seed": -1}, "seed=-1"),
    ({"classes": -1}, "classes=-1"), ({"workers": 0}, "workers"),
])
def test_make_sample_refuses_the_same_values(kwargs, match, tmp_path):
    with pytest.raises(PackerError, match=match):
        make_sample(tmp_path / "s", **{"count": 2, **kwargs}, progress=False)
    assert not (tmp_path / "s").exists()


def test_sample_with_the_smallest_size(tmp_path):
    assert exit_code(["sample", str(tmp_path / "s"), "--count", "2", "--size", "1x1", "-q"]) == 0
    assert len(list((tmp_path / "s").rglob("*.jpg"))) == 2


def test_mosaic_quality_0_is_refused_not_recorded_as_0(imagefolder, tmp_path):
    with pytest.raises(PackerError, match="quality=0: expected an integer from 1 to 100"):
        convert(imagefolder, tmp_path / "m", to="mosaic", tile="16x16", codec="jpeg", quality=0, workers=0,
                progress=False)
    assert not (tmp_path / "m").exists()


@pytest.mark.parametrize(("args", "message"), [
    (["--tile", "0x0"], "--tile 0x0: expected HxW of positive integers"),
    (["--tile", "16x"], "--tile 16x: expected HxW of positive integers"),
    (["--tile", "16x16", "--grid", "0x3"], "--grid 0x3: expected RxC of positive integers, e.g. 11x10"),
    (["--resize", "0x0", "--payload", "raw"], "--resize 0x0: sizes must be at least 1"),
])
def test_mosaic_sizes_are_refused_naming_the_option_given(imagefolder, tmp_path, capsys, args, message):
    """--tile 0x0 was reported as "--resize '0x0'": the message names the option the user gave."""
    to = ["--to", "mosaic"] if "--tile" in args else []
    assert main(["convert", str(imagefolder), *to, *args, "-o", str(tmp_path / "m"), "-q"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"packer: error: {message}") and err.count("\n") == 1, err
    assert not (tmp_path / "m").exists()


@pytest.mark.parametrize("workers", [-1, 1.5, True])
def test_convert_refuses_negative_workers(imagefolder, tmp_path, workers):
    with pytest.raises(PackerError, match="workers"):
        convert(imagefolder, tmp_path / "o.lmdb", workers=workers, progress=False)


def test_bench_and_doctor_apis_refuse_the_same_values(tmp_path):
    from packer.diagnose.bench import BenchOptions, run_bench
    from packer.diagnose.decoders import measure_decoders
    from packer.diagnose.doctor import diagnose

    for bad in ({"seed": -1}, {"ceiling_bytes": 0}, {"block_bytes": 0}, {"open_blocks": 0}, {"run": 0}):
        with pytest.raises(PackerError):
            run_bench([tmp_path], BenchOptions(**bad))
    with pytest.raises(PackerError):
        measure_decoders([b"x"], seconds=0)
    with pytest.raises(PackerError):
        measure_decoders([b"x"], sizes=(0,))
    with pytest.raises(PackerError):
        diagnose(seconds=math.inf, progress=False)


# ------------------------------------------------------------------ exit codes


@pytest.fixture(scope="module")
def dataset(imagefolder, tmp_path_factory):
    return convert(imagefolder, tmp_path_factory.mktemp("codes") / "ds.lmdb", workers=0, progress=False).output


def damaged(dataset: Path, tmp_path: Path) -> Path:
    copy = tmp_path / "damaged.lmdb"
    shutil.copytree(dataset, copy)
    (copy / "manifest.json").write_text('{"kind": "packer-dataset", "version": 1, "format": 5}')
    return copy


def test_a_missing_or_non_dataset_input_exits_2(dataset, imagefolder, tmp_path, capsys):
    for argv in (["verify", str(tmp_path / "nope")], ["verify", str(imagefolder)],
                 ["verify", str(dataset), "--against", str(tmp_path / "nope")], ["info", str(tmp_path / "nope")],
                 ["info", str(imagefolder)], ["profile", str(tmp_path / "nope")],
                 ["extract", str(tmp_path / "nope"), str(tmp_path / "out")]):
        assert exit_code([*argv, *(["-q"] if argv[0] != "info" else [])]) == 2, argv
        assert capsys.readouterr().err.startswith("packer: error: ")
    assert not (tmp_path / "out").exists()


def test_a_dataset_failing_its_checks_exits_1(dataset, tmp_path, capsys):
    bad = damaged(dataset, tmp_path)
    for argv in (["verify", str(bad), "-q"], ["info", str(bad)], ["profile", str(bad), "-q"],
                 ["extract", str(bad), str(tmp_path / "out"), "-q"],
                 ["bench", str(bad), "--levels", "read", "--repeats", "1", "-q"]):
        assert exit_code(argv) == 1, argv
        captured = capsys.readouterr()
        assert "manifest" in captured.out + captured.err and "Traceback" not in captured.err


def test_lmdb_that_is_not_lmdb_is_reported_as_damaged_not_replaced(dataset, tmp_path):
    from packer import open_dataset

    copy = tmp_path / "ds.lmdb"
    shutil.copytree(dataset, copy)
    shard = next(copy.glob("*.lmdb"))
    size = shard.stat().st_size
    shard.write_bytes(b"not an lmdb file".ljust(size, b"\0"))
    ds = open_dataset(copy)
    with pytest.raises(PackerError) as err:
        ds[0]
    assert "not a valid LMDB file" in str(err.value) and "replaced" not in str(err.value)


def test_the_convention_is_stated_in_help_and_readme(capsys):
    assert exit_code(["--help"]) == 0
    out = capsys.readouterr().out
    readme = (REPO / "README.md").read_text()
    for text in (out, readme):
        assert "exit codes" in text.lower()
        for code, words in (("0", "ok"), ("1", "found a problem"), ("2", "could not run as asked"),
                            ("130", "interrupted")):
            assert any(line.strip().startswith(code) and words in line for line in text.splitlines()), (code, text)


def test_compression_help_is_built_from_each_formats_codecs():
    """``--compression``'s help names what each format offers (hdf5: gzip, lzf; n5: gzip), not one format."""
    from packer.errors import render
    from packer.formats import FORMATS
    from packer.write.options import compression_help

    text = render(compression_help(FORMATS), cli=True)
    offering = {name: fmt.compressions for name, fmt in FORMATS.items() if fmt.compressions}
    assert {"hdf5", "n5"} <= set(offering)
    for name, codecs in offering.items():
        assert f"{name}: {', '.join(sorted(codecs))}" in text, (name, text)
    convert_help = next(a for a in build_parser()._subparsers._group_actions[0].choices["convert"]._actions
                        if "--compression" in a.option_strings).help
    assert convert_help == text


def test_help_names_every_registered_format(capsys):
    """``packer --help`` once named 5 of the 9 formats; its list is the registry's, so a new format shows."""
    from packer.formats import FORMATS

    assert exit_code(["--help"]) == 0
    description = " ".join(capsys.readouterr().out.split())  # argparse wraps the line
    assert len(FORMATS) >= 9
    missing = [name for name in FORMATS if name not in description]
    assert not missing, f"packer --help does not name {missing}:\n{description}"
