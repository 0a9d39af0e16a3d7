"""Run packer's command line in a subprocess, as a user would, with this checkout's packer."""

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def run_cli(*args, **kw) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.run([sys.executable, "-m", "packer", *map(str, args)], capture_output=True, text=True, env=env,
                          **kw)
