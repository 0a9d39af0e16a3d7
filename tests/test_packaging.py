"""What packer's distribution says of itself: wheels tagged by what they hold, with py.typed and the metadata
(every format in the summary, classifiers, keywords); install text that works while packer-images is not on the
package index."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
from support.typecheck import USER_SCRIPT, check_real_types, run_pyright

from packer.formats import FORMATS

REPO = Path(__file__).resolve().parents[1]
NOT_ON_THE_INDEX = re.compile(r"""pip install\s+(['"]?)packer-images""")


def test_install_text_names_the_checkout():
    """packer-images is not on the package index: every install line must work from a checkout."""
    texts = [*(REPO / "packer").rglob("*.py"), REPO / "README.md", *(REPO / "docs").rglob("*.md"), REPO / "Makefile",
             *(REPO / "examples").rglob("*.py")]
    found = [f"{p.relative_to(REPO)}:{n}: {line.strip()}" for p in texts
             for n, line in enumerate(p.read_text(encoding="utf-8").splitlines(), 1) if NOT_ON_THE_INDEX.search(line)]
    assert not found, "\n".join(found)


def test_the_checker_sees_an_index_install():
    assert NOT_ON_THE_INDEX.search("pip install 'packer-images[dask]'")
    assert NOT_ON_THE_INDEX.search("pip install packer-images")
    assert not NOT_ON_THE_INDEX.search("pip install -e '.[dask]'")


def _wheel(tmp_path: Path, env: dict[str, str]) -> Path:
    """A wheel built from a copy of this checkout (no build products in it), offline, with ``env``."""
    src = tmp_path / "src"
    shutil.copytree(REPO / "packer", src / "packer", ignore=shutil.ignore_patterns("__pycache__", "*.so"))
    for name in ("pyproject.toml", "setup.py", "README.md"):
        shutil.copy(REPO / name, src / name)
    out = tmp_path / "wheels"
    res = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w",
                          str(out), str(src)], capture_output=True, text=True, env={**os.environ, **env},
                         timeout=600)
    assert res.returncode == 0, res.stderr
    (wheel,) = out.glob("*.whl")
    return wheel


def _metadata(wheel: Path) -> tuple[list[str], str, str]:
    with zipfile.ZipFile(wheel) as zf:
        names = zf.namelist()
        meta = next(zf.read(n).decode() for n in names if n.endswith(".dist-info/METADATA"))
        tags = next(zf.read(n).decode() for n in names if n.endswith(".dist-info/WHEEL"))
    return names, meta, tags


def _field(meta: str, name: str) -> str:
    found = re.search(rf"^{name}: (.*)$", meta, re.M)
    assert found, f"no {name} in the METADATA"
    return found.group(1)


def _check_metadata(names: list[str], meta: str) -> None:
    assert "packer/py.typed" in names and "packer/images/_jpegregion.pyi" in names
    summary = _field(meta, "Summary").lower()
    assert not [f for f in FORMATS if f not in summary], summary  # every format, by name
    classifiers = re.findall(r"^Classifier: (.*)$", meta, re.M)
    assert "Typing :: Typed" in classifiers and any(c.startswith("Development Status") for c in classifiers)
    assert "lmdb" in _field(meta, "Keywords")
    assert "Project-URL" not in meta  # none until packer has a public home (pyproject.toml says so)


def test_a_wheel_built_without_the_extension_is_pure_python(tmp_path):
    wheel = _wheel(tmp_path, {"CC": "false"})  # a compiler that fails: the optional extension is skipped
    names, meta, tags = _metadata(wheel)
    assert wheel.name.endswith("-py3-none-any.whl") and "Root-Is-Purelib: true" in tags
    assert not [n for n in names if n.startswith("packer/images/_jpegregion.") and not n.endswith((".c", ".pyi"))]
    _check_metadata(names, meta)


def test_pyright_sees_the_types_of_the_installed_wheel(tmp_path):
    """A user's script checked against packer installed from its wheel (py.typed and all), not the checkout."""
    wheel = _wheel(tmp_path, {"CC": "false"})
    site = tmp_path / "site"
    res = subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "--no-index", "-q", "--target",
                          str(site), str(wheel)], capture_output=True, text=True, timeout=600)
    assert res.returncode == 0 and (site / "packer" / "py.typed").is_file(), res.stderr
    user = tmp_path / "user"
    user.mkdir()
    check_real_types(run_pyright(user, USER_SCRIPT, packer_at=site))


def test_a_wheel_with_the_extension_is_tagged_for_this_platform(tmp_path, request):
    from packer.images.jpegregion import region_decode_available

    if not region_decode_available() and not request.config.getoption("--require-jpegregion"):
        pytest.skip("the region decoder does not build here (no libjpeg headers)")
    wheel = _wheel(tmp_path, {})
    names, meta, tags = _metadata(wheel)
    tag = f"cp{sys.version_info.major}{sys.version_info.minor}"
    assert f"-{tag}-{tag}-" in wheel.name and "Root-Is-Purelib: false" in tags
    assert [n for n in names if n.startswith("packer/images/_jpegregion.") and n.endswith(".so")]
    _check_metadata(names, meta)
