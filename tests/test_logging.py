"""Library notices go through ``logging.getLogger("packer")``: a library user routes or silences them, the command
line prints them on stderr as it always has (``packer: <message>``)."""

from __future__ import annotations

import ast
import json
import logging
import subprocess
import sys
from pathlib import Path

import pytest
from support.cli import REPO, run_cli
from support.imagesets import make_bad_inputs, make_imagefolder

from packer import convert

PACKAGE = REPO / "packer"
TERMINAL = ("cli", "diagnose")  # reports meant for the terminal (packer bench, doctor, profile) print there


@pytest.fixture(scope="module")
def bad_folder(tmp_path_factory):
    root = make_imagefolder(tmp_path_factory.mktemp("bad") / "imgs", classes=2, per_class=2)
    make_bad_inputs(root)
    return root


def prints_to_stderr(path: Path) -> list[int]:
    """Lines of ``print(..., file=sys.stderr)`` and ``sys.stderr.write(...)`` calls in one module."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if not isinstance(node, ast.Call):
            continue
        func = ast.unparse(node.func)
        to_stderr = any(k.arg == "file" and ast.unparse(k.value) == "sys.stderr" for k in node.keywords)
        if (func == "print" and to_stderr) or func == "sys.stderr.write":
            found.append(node.lineno)
    return found


def test_no_library_module_prints_notices_to_stderr():
    library = [p for p in PACKAGE.rglob("*.py") if p.relative_to(PACKAGE).parts[0] not in TERMINAL]
    printing = {str(p.relative_to(REPO)): lines for p in library if (lines := prints_to_stderr(p))}
    assert not printing, f"print to stderr instead of logging.getLogger(__name__): {printing}"


def test_the_checker_sees_a_print_to_stderr(tmp_path):
    src = tmp_path / "m.py"
    src.write_text("import sys\nprint('x', file=sys.stderr)\nsys.stderr.write('y')\nprint('z')\n")
    assert prints_to_stderr(src) == [2, 3]


def test_a_library_user_gets_the_notices_as_log_records(bad_folder, tmp_path, caplog, capsys):
    with caplog.at_level(logging.INFO, logger="packer"):
        res = convert(bad_folder, tmp_path / "o.lmdb", workers=0, progress=False)
    records = [r for r in caplog.records if "files not packed" in r.getMessage()]
    assert len(records) == 1 and records[0].name == "packer.write.finish" and records[0].levelno == logging.WARNING
    assert records[0].getMessage().startswith(f"{len(res.errors)} of ")
    assert "files not packed" not in capsys.readouterr().err  # routed to the log, not printed past it


def _convert_in_a_fresh_process(bad_folder: Path, out: Path, setup: str) -> str:
    code = (f"import logging\n{setup}\nfrom packer import convert\n"
            f"convert({str(bad_folder)!r}, {str(out)!r}, workers=0, progress=False)")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=300)
    assert res.returncode == 0, res.stderr
    return res.stderr


def test_a_library_user_can_silence_or_route_them(bad_folder, tmp_path):
    plain = _convert_in_a_fresh_process(bad_folder, tmp_path / "a.lmdb", "")
    assert "files not packed" in plain  # unconfigured: Python's last-resort handler shows warnings
    silenced = _convert_in_a_fresh_process(bad_folder, tmp_path / "b.lmdb",
                                           "logging.getLogger('packer').setLevel(logging.ERROR)")
    assert "files not packed" not in silenced
    routed = _convert_in_a_fresh_process(
        bad_folder, tmp_path / "c.lmdb",
        f"logging.basicConfig(filename={str(tmp_path / 'log.txt')!r}, format='%(levelname)s %(name)s %(message)s')")
    assert "files not packed" not in routed
    assert "WARNING packer.write.finish " in (tmp_path / "log.txt").read_text()


def test_the_command_line_prints_them_as_before(bad_folder, tmp_path):
    res = run_cli("convert", bad_folder, "-o", tmp_path / "o.lmdb", "--workers", "0", "-q")
    assert res.returncode == 1 and res.stdout == ""
    errors = json.loads((tmp_path / "o.lmdb" / "errors.json").read_text())["errors"]
    offered = len(errors) + json.loads((tmp_path / "o.lmdb" / "manifest.json").read_text())["num_samples"]
    assert 0 < len(errors) <= 10  # all of them listed, one line each below the count, in the order met
    head, *rest = res.stderr.splitlines()
    assert head == f"packer: {len(errors)} of {offered} files not packed, see errors.json:"
    assert sorted(rest) == sorted(f"  {e['path']}: {e['reason']}" for e in errors)


def test_the_command_line_leaves_the_logger_as_it_found_it(bad_folder, tmp_path, capsys):
    from packer.cli import main

    logger = logging.getLogger("packer")
    before = (list(logger.handlers), logger.level, logger.propagate)
    assert main(["convert", str(bad_folder), "-o", str(tmp_path / "o.lmdb"), "--workers", "0", "-q"]) == 1
    assert "files not packed, see errors.json:" in capsys.readouterr().err
    assert (list(logger.handlers), logger.level, logger.propagate) == before
