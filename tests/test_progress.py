"""Progress bars: one decision (packer.progress) for every long call; none when stderr is not a terminal unless
asked, none under TQDM_DISABLE, ``progress=`` on each long API call."""

from __future__ import annotations

import ast
import fcntl
import inspect
import io
import os
import pty
import select
import struct
import subprocess
import sys
import termios

import pytest
from support.cli import REPO, run_cli

import packer
from packer.progress import progress_wanted
from packer.tools.sample import make_sample
from packer.tools.verify import verify

BAR = "packing"  # convert's bar: "packing: 100%|...| 15/15 [...]"


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


@pytest.mark.parametrize("progress, stream, env, wanted", [
    (None, Terminal(), None, True), (None, io.StringIO(), None, False), (True, io.StringIO(), None, True),
    (False, Terminal(), None, False), (None, Terminal(), "1", False), (True, Terminal(), "true", False),
    (None, Terminal(), "0", True), (None, Terminal(), "", True), (None, None, None, False),
])
def test_the_decision(progress, stream, env, wanted, monkeypatch):
    if env is None:
        monkeypatch.delenv("TQDM_DISABLE", raising=False)
    else:
        monkeypatch.setenv("TQDM_DISABLE", env)
    if stream is None:
        monkeypatch.setattr(sys, "stderr", None)  # pythonw, a daemon: no stderr at all
    assert progress_wanted(progress, stream) is wanted


@pytest.fixture(scope="module")
def imgs(tmp_path_factory):
    out = tmp_path_factory.mktemp("p") / "imgs"
    make_sample(out, count=12, classes=2, size=(24, 32), progress=False)
    return out


def _convert(imgs, out, progress: str, env: dict | None = None, stderr=subprocess.PIPE) -> subprocess.Popen:
    code = f"from packer import convert; convert({str(imgs)!r}, {str(out)!r}, workers=0{progress})"
    environ = {k: v for k, v in os.environ.items() if k != "TQDM_DISABLE"} | (env or {})
    return subprocess.Popen([sys.executable, "-c", code], stderr=stderr, stdout=subprocess.DEVNULL, text=True,
                            cwd=REPO, env=environ)


@pytest.mark.parametrize("progress, env, drawn", [
    ("", None, False), (", progress=True", None, True), (", progress=True", {"TQDM_DISABLE": "1"}, False),
])
def test_convert_into_a_pipe(imgs, tmp_path, progress, env, drawn):
    proc = _convert(imgs, tmp_path / "o.lmdb", progress, env)
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 0 and (BAR in err) is drawn, err


def test_convert_on_a_terminal_draws_its_bar(imgs, tmp_path):
    leader, follower = pty.openpty()
    fcntl.ioctl(follower, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 100, 0, 0))  # a terminal 100 columns wide
    proc = _convert(imgs, tmp_path / "o.lmdb", "", stderr=follower)
    os.close(follower)
    seen = b""
    poller = select.poll()  # not select.select: it fails on a descriptor numbered 1024 or more
    poller.register(leader, select.POLLIN)
    while True:
        assert poller.poll(300_000), "no output within 300 s"
        try:
            chunk = os.read(leader, 4096)
        except OSError:  # EIO: the child closed its end
            break
        if not chunk:
            break
        seen += chunk
    os.close(leader)
    assert proc.wait(timeout=60) == 0 and BAR.encode() in seen, seen


def test_the_command_line_into_a_pipe_draws_no_bar(imgs, tmp_path):
    res = run_cli("convert", imgs, "-o", tmp_path / "o.lmdb", "--workers", "0", process=True)
    assert res.returncode == 0 and res.stderr == "" and "into" in res.stdout
    res = run_cli("verify", tmp_path / "o.lmdb", "--against", imgs, process=True)
    assert res.returncode == 0 and res.stderr == "", res.stderr


@pytest.mark.parametrize("call", [packer.convert, packer.export_wds, verify, packer.CachedDataset, make_sample,
                                  __import__("packer.tools.extract", fromlist=["extract"]).extract])
def test_every_long_call_takes_progress_and_decides_the_same_way(call):
    param = inspect.signature(call).parameters["progress"]
    assert param.default is None, f"{call.__qualname__}: progress={param.default!r}, expected None (decide)"


def test_one_home_for_the_decision():
    """No module but packer/progress.py draws a tqdm bar itself."""
    users = []
    for path in (REPO / "packer").rglob("*.py"):
        if path.name == "progress.py" and path.parent.name == "packer":
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                names = [a.name for a in node.names] + [getattr(node, "module", None) or ""]
                if any(n == "tqdm" or n.startswith("tqdm.") for n in names):
                    users.append(str(path.relative_to(REPO)))
    assert not users
