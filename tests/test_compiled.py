"""packer.compiled: the optional C extensions imported in one place, and what is missing said once per process."""

from __future__ import annotations

import logging
import subprocess
import sys
from pathlib import Path

from packer.compiled import Extension, extension, jpeg_region, safe_copy

REPO = Path(__file__).resolve().parents[1]


def test_a_missing_extension_is_said_once_with_what_packer_does_instead(caplog):
    ext = extension("packer._no_such_extension", "the test's extension", "packer does it the slow way", "nothing")
    assert extension("packer._no_such_extension", "x", "y", "z") is ext  # imported once, the same record after
    assert not ext.available and ext.module is None and "packer._no_such_extension" in (ext.missing or "")
    with caplog.at_level(logging.WARNING, logger="packer"):
        ext.notice()
        ext.notice()
    said = [r.getMessage() for r in caplog.records if "the test's extension" in r.getMessage()]
    assert len(said) == 1 and "packer does it the slow way" in said[0] and "pip install -e ." in said[0]


def test_a_built_extension_says_nothing(caplog):
    ext = Extension("m", "a built one", "", "", module=sys)
    with caplog.at_level(logging.WARNING, logger="packer"):
        ext.notice()
    assert ext.available and not caplog.records


def test_both_extensions_are_the_same_records_everywhere():
    from packer.formats import safecopy
    from packer.images import decode, jpegregion

    assert jpegregion.region_decode_available() == jpeg_region().available
    assert decode._native is jpeg_region().module and jpegregion._jpegregion is jpeg_region().module
    assert safecopy.available() == safe_copy().available


def test_without_the_guarded_copy_payloads_are_read_with_pread_and_that_is_said_once(tmp_path):
    """The copy out of a map falls back to ``pread`` (the same bytes), with one notice for the process."""
    path = tmp_path / "f.bin"
    path.write_bytes(bytes(range(256)) * 64)
    script = (
        "import sys; sys.modules['packer.formats._safecopy'] = None\n"  # an import of it now fails
        "import os, numpy as np\n"
        "from packer.formats import safecopy\n"
        "from packer.formats.base import pread_ranges\n"
        "assert not safecopy.available()\n"
        f"fd = os.open({str(path)!r}, os.O_RDONLY); arr = np.fromfile({str(path)!r}, np.uint8)\n"
        "for _ in range(3):\n"
        "    got = pread_ranges(fd, [10, 300], [20, 310], None, 'f.bin', len(arr), mapped=(arr, 0))\n"
        "    assert [bytes(g) for g in got] == [arr[10:20].tobytes(), arr[300:310].tobytes()]\n"
    )
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, cwd=REPO)
    assert run.returncode == 0, run.stderr
    notices = [line for line in run.stderr.splitlines() if "guarded map copy is not built" in line]
    assert len(notices) == 1 and "pread" in notices[0]
