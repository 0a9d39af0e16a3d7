"""pyright on a user's script against packer: its diagnostics, and the check that it saw packer's real types."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PYRIGHT = Path(sys.executable).parent / "pyright"  # the dev extra installs it beside the interpreter

USER_SCRIPT = '''\
import packer

ds = packer.open_dataset("imgs.lmdb", image="numpy")
reveal_type(ds)
reveal_type(packer.open_dataset("imgs.lmdb", cache="ram"))
reveal_type(packer.BlockShuffleSampler(ds, batch_size=64))
reveal_type(packer.convert("imgs", "imgs.lmdb", to="hdf5"))
reveal_type(packer.LMDBDataset)
count: str = packer.convert("imgs").num_samples  # a deliberate mistake: an int
packer.open_dataset("imgs.lmdb", image="jpeg")  # another: not one of pil, numpy, tensor
'''


def run_pyright(tmp_path: Path, script: str, packer_at: Path = REPO) -> list[dict]:
    """pyright's diagnostics on ``script`` as a user's file outside the repository, packer found in ``packer_at``
    (this checkout, or where a wheel was installed)."""
    assert PYRIGHT.exists(), f"{PYRIGHT}: pyright is missing (pip install -e '.[dev]')"
    (tmp_path / "user.py").write_text(script)
    (tmp_path / "pyrightconfig.json").write_text(json.dumps(
        {"extraPaths": [str(packer_at)], "pythonVersion": "3.11", "typeCheckingMode": "basic"}))
    res = subprocess.run([str(PYRIGHT), "--outputjson", "--pythonpath", sys.executable, "user.py"], cwd=tmp_path,
                         capture_output=True, text=True, timeout=300)
    return json.loads(res.stdout)["generalDiagnostics"]


def check_real_types(diags: list[dict]) -> None:
    """USER_SCRIPT's revealed types are packer's classes, and its two mistakes (only they) are errors."""
    by_line: dict[int, list[dict]] = {}
    for d in diags:
        by_line.setdefault(d["range"]["start"]["line"] + 1, []).append(d)
    revealed = {n: d["message"] for n, ds in by_line.items() for d in ds if d["message"].startswith("Type of")}
    assert revealed[4].endswith('is "PackedDataset"'), revealed
    assert revealed[5].endswith('is "CachedDataset"'), revealed
    assert revealed[6].endswith('is "BlockShuffleSampler"'), revealed
    assert revealed[7].endswith('is "ConvertResult"'), revealed
    assert revealed[8].endswith('is "type[LMDBDataset]"'), revealed
    errors = {n: [d["message"] for d in ds if d["severity"] == "error"] for n, ds in by_line.items()}
    assert any('"int" is not assignable to "str"' in m for m in errors.get(9, [])), diags
    assert any("Literal['jpeg']" in m and '"image"' in m for m in errors.get(10, [])), diags
    assert not [m for n, ms in errors.items() if n not in (9, 10) for m in ms], diags  # nothing else, no Unknown import
