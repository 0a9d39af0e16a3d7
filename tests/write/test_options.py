"""A conversion's options are declared once (packer/write/options.py): ``convert``'s keywords, their entries in
``help(packer.convert)`` and ``packer convert``'s flags, with their defaults and types, are all made from the
declarations, so the command line and the Python API take the same options and say the same of each."""

from __future__ import annotations

import argparse
import inspect
import json

import pytest
from support.cli import run_cli
from support.imagesets import make_imagefolder

from packer import convert, export_wds
from packer.cli import build_parser
from packer.errors import render
from packer.formats import FORMATS
from packer.write.convert import SPLIT, convert_split, keywords
from packer.write.options import RunOptions, declared, own_options
from tests.test_docstrings import args_section

# not options of convert(): the command's own (--storage-option: storage_options, added by cli/parser.py)
CLI_ONLY = {"--help", "--to", "--output", "--scheduler", "--storage-option", "--quiet", "--json"}


def convert_parser() -> argparse.ArgumentParser:
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices["convert"]


def flagged():
    """The declared options that ``packer convert`` has a flag for (its own made from the declaration)."""
    return [o for o in [*keywords(), *own_options(FORMATS)] if o.flag is not None and o.generated]


def test_the_flags_are_the_declared_options_with_their_help_type_choices_and_default():
    actions = {a.option_strings[-1]: a for a in convert_parser()._actions if a.option_strings}
    declared_flags = {f"--{o.flag}": o for o in flagged()}
    assert set(actions) - CLI_ONLY == set(declared_flags)
    for flag, option in declared_flags.items():
        action = actions[flag]
        assert action.dest == option.keyword and action.help == render(option.help, cli=True).replace("%", "%%")
        if option.switch:
            assert isinstance(action, argparse._StoreTrueAction), flag
        else:
            assert (action.default, action.type, action.choices) == (option.default, option.parse, option.choices)


def test_every_keyword_is_in_the_signature_and_explained_with_its_type_and_the_flags_default():
    """``help(packer.convert)`` names each keyword with its type; the flag left out gives the keyword's default."""
    args = vars(build_parser().parse_args(["convert", "SRC"]))
    for func, accepted in ((convert, [k for k in keywords() if k.keyword != SPLIT]),
                           (convert_split, [k for k in keywords() if k.keyword != SPLIT]),
                           (export_wds, [k for k in keywords() if k.wds and k.keyword != SPLIT])):
        params = inspect.signature(func).parameters
        entries = args_section(inspect.getdoc(func) or "")
        for k in accepted:
            assert params[k.keyword].default == k.default and params[k.keyword].annotation == k.accepts
            assert k.keyword in entries and render(k.help) in entries[k.keyword], (func.__name__, k.keyword)
            if k.flag is not None and k.generated:
                assert args[k.keyword] == k.default, k.keyword
        refused = {k.keyword for k in keywords()} - {k.keyword for k in accepted} - {SPLIT}
        assert not refused & set(params), (func.__name__, refused & set(params))
    assert "**options: the format's own options" in (inspect.getdoc(convert) or "")
    assert all(o.name in (inspect.getdoc(convert) or "") for f in FORMATS.values() for o in f.options)


def test_the_run_options_say_how_the_command_line_gives_those_without_a_flag():
    """progress (-q), client (--scheduler), pool: the API's only, or given by the command's own flags."""
    run = {k.keyword: k for k in declared(RunOptions)}
    assert (run["progress"].flag, run["pool"].flag) == (None, None)
    assert run["client"].flag == "scheduler" and not run["client"].generated and not run["client"].wds
    assert "--scheduler" in {a.option_strings[-1] for a in convert_parser()._actions if a.option_strings}
    assert run["storage_options"].flag == "storage-option" and not run["storage_options"].generated  # cli/parser.py's
    assert "--storage-option" in {a.option_strings[-1] for a in convert_parser()._actions if a.option_strings}


@pytest.mark.parametrize("to", ["hdf5", "wds"])
def test_the_command_line_and_the_api_record_the_same_options(tmp_path, to):
    """The same options given as flags and as keywords: the same manifest (or export index) options and source
    options; a flag reaches its keyword through its declaration alone."""
    src = make_imagefolder(tmp_path / "imgs", classes=3, per_class=2, size=(16, 16))
    flags = ["--order", "source", "--seed", "3", "--skip-hidden", "--shard-size", "1MB", "--validate", "header",
             "--classes", "class_0,class_2"]
    given = {"order": "source", "seed": 3, "skip_hidden": True, "shard_bytes": 1_000_000, "validate": "header",
             "classes": "class_0,class_2"}
    if to == "hdf5":
        flags += ["--payload", "raw", "--resize", "8x8", "--resize-mode", "fit", "--compression", "lzf"]
        given.update(payload="raw", resize="8x8", resize_mode="fit", compression="lzf")
    res = run_cli("convert", src, "--to", to, "-o", tmp_path / "cli", "--workers", "0", "-q", *flags)
    assert res.returncode == 0, res.stderr
    convert(src, tmp_path / "api", to=to, workers=0, progress=False, **given)
    name = "manifest.json" if to != "wds" else "packer-wds.json"
    cli, api = (json.loads((tmp_path / d / name).read_text()) for d in ("cli", "api"))
    assert cli["options"] == api["options"] and cli["options"]["seed"] == 3
    if to != "wds":
        assert cli["source_options"] == api["source_options"] and api["source_options"]["classes"] == ["class_0",
                                                                                                        "class_2"]
