"""NVIDIA DALI fed by packer (``from packer.dali import pipeline, loader``): see packer.read.dali and docs/dali.md.

Importing this needs no DALI; building a pipeline does (``pip install -e '.[dali]'`` in packer's checkout).
"""

from __future__ import annotations

from packer.read.dali import DaliLoader, PackerSource, loader, pipeline

__all__ = ["DaliLoader", "PackerSource", "loader", "pipeline"]
