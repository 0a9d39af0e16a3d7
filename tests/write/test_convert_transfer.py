"""Payloads cross from the pool through a shared ring (fork) or pickled (other start methods, or
when they don't fit their slot): every way gives the same bytes as preparing in this process."""

import hashlib
from pathlib import Path

import pytest
from support.imagesets import make_imagefolder

from packer import convert
from packer.write import pool
from packer.write.pool import PoolSettings


def tree_digest(root: Path) -> dict[str, str]:
    return {p.relative_to(root).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file() and p.name != "manifest.json"}


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    return make_imagefolder(tmp_path_factory.mktemp("xfer") / "src", classes=3, per_class=30, size=(48, 64))


@pytest.fixture
def ring_use(monkeypatch):
    """Counts payloads copied out of the ring and results that came pickled."""
    seen = {"ring": 0, "pickled": 0}
    original = pool._from_ring

    def spy(ring, results, where):
        seen["ring"] += sum(w is not None for w in where)
        seen["pickled"] += sum(w is None for w in where)
        return original(ring, results, where)

    monkeypatch.setattr(pool, "_from_ring", spy)
    return seen


@pytest.mark.parametrize("payload", ["encoded", "raw"])
@pytest.mark.parametrize("way", ["ring", "small slots", "pickled", "spawn"])
def test_every_transfer_gives_the_same_bytes(source, tmp_path, ring_use, way, payload):
    if way == "spawn" and payload == "raw":
        pytest.skip("spawn workers take seconds to start: one case")
    kw = dict(payload=payload, shard_bytes=60_000 if payload == "encoded" else 600_000, progress=False)
    convert(source, tmp_path / "ref.lmdb", workers=0, **kw)
    settings = {
        "ring": PoolSettings(),
        # a slot holds one or two payloads: the others in its chunk come pickled
        "small slots": PoolSettings(ring_bytes=32 * (4096 if payload == "encoded" else 16384), ahead=16),
        "pickled": PoolSettings(ring_bytes=0),
        "spawn": PoolSettings(start_method="spawn"),
    }[way]
    convert(source, tmp_path / "out.lmdb", workers=2, pool=settings, **kw)
    assert tree_digest(tmp_path / "out.lmdb") == tree_digest(tmp_path / "ref.lmdb")
    if way == "ring":
        assert ring_use == {"ring": 90, "pickled": 0}
    elif way == "small slots":
        assert ring_use["ring"] > 0 and ring_use["pickled"] > 0
    else:
        assert ring_use["ring"] == 0
