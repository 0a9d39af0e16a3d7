"""Distributed conversion on a real 2-process Dask LocalCluster: same bytes as a local run, lost workers, resume."""

from __future__ import annotations

import importlib
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from support.dask_cluster import cluster_client  # noqa: F401  # the fixture `client`: the module's cluster
from support.imagesets import make_bad_inputs, make_imagefolder

distributed = pytest.importorskip("distributed", reason="needs the packer[dask] extra (make install adds it)")

from test_resume import manifest_without_time, tree_digest  # noqa: E402

from packer import FORMATS, PackerError, convert, open_dataset  # noqa: E402
from packer.tools.verify import verify  # noqa: E402
from packer.write.cluster import STAGING_DIR, _move_into_place, open_client, scan_on_cluster  # noqa: E402
from packer.write.scan import scan_folder  # noqa: E402
from packer.write.shards import ShardWriteError  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
SHARD = 40_000  # about 8 images of 48x64: several shards from a tiny source


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    root = make_imagefolder(tmp_path_factory.mktemp("dist") / "src", classes=3, per_class=20, size=(48, 64))
    make_bad_inputs(root)  # a fourth class, "weird", with files that must end in errors.json
    return root


@pytest.fixture(scope="module")
def reference(source, tmp_path_factory):
    """The local conversion every distributed one must equal, byte for byte."""
    out = tmp_path_factory.mktemp("ref") / "ref.lmdb"
    convert(source, out, workers=0, shard_bytes=SHARD, progress=False)
    return out


def same_dataset(a: Path, b: Path) -> None:
    assert tree_digest(a) == tree_digest(b)  # every shard, meta/*.npy, errors.json
    assert manifest_without_time(a) == manifest_without_time(b)


def test_byte_identical_to_local_conversion(client, source, reference, tmp_path):
    out = tmp_path / "d.lmdb"
    res = convert(source, out, shard_bytes=SHARD, progress=False, client=client)
    manifest = json.loads((out / "manifest.json").read_text())
    assert len(manifest["shards"]) >= 5
    same_dataset(out, reference)
    errors = json.loads((out / "errors.json").read_text())
    assert errors["num_errors"] == len(res.errors) >= 4  # zero-byte, truncated, random bytes, broken link...
    assert {e["path"] for e in errors["errors"]} >= {"weird/empty.jpg", "weird/truncated.jpg", "weird/broken_link.jpg"}
    assert verify(out, against=source).ok
    assert not (out / STAGING_DIR).exists()


FORMAT_NEEDS = {"mosaic": {"tile": "16x16", "grid": "2x2", "shard_bytes": 3_000}}  # options a format needs here


@pytest.mark.parametrize("fmt", sorted(set(FORMATS) - {"lmdb"}))
def test_every_format_is_byte_identical(client, source, tmp_path, fmt):
    opts = {"to": fmt, "shard_bytes": SHARD, "progress": False, **FORMAT_NEEDS.get(fmt, {})}
    convert(source, tmp_path / "local", workers=0, **opts)
    convert(source, tmp_path / "dask", client=client, **opts)
    assert len(json.loads((tmp_path / "dask" / "manifest.json").read_text())["shards"]) >= 5
    same_dataset(tmp_path / "local", tmp_path / "dask")


def test_raw_payload_in_source_order_is_byte_identical(client, source, tmp_path):
    opts = dict(payload="raw", resize="16", order="source", shard_bytes=4_000, progress=False)
    convert(source, tmp_path / "local.lmdb", workers=0, **opts)
    convert(source, tmp_path / "dask.lmdb", client=client, **opts)
    same_dataset(tmp_path / "local.lmdb", tmp_path / "dask.lmdb")


def _tree(root: Path, dirs: int, per_dir: int) -> None:
    for c in range(dirs):
        for sub in ("", "b/", "a/deep/"):
            d = root / f"c{c:02d}" / sub
            d.mkdir(parents=True, exist_ok=True)
            for i in range(per_dir):
                (d / f"{i}.JPG").write_bytes(b"x")
            (d / "notes.txt").write_text("-")
            (d / ".hidden.jpg").write_bytes(b"x")
    (root / ".git").mkdir()
    (root / "stray.jpg").write_bytes(b"x")


def test_scan_on_cluster_equals_scan_folder(client, tmp_path):
    _tree(tmp_path / "many", dirs=37, per_dir=3)  # more classes than tasks: several classes per task
    root = tmp_path / "many"
    # ImageFolder's rules (.git an empty class, .hidden.jpg samples), and with the hidden names left out
    for rules, classes, count in (({"allow_empty": True}, 38, 37 * 12), ({"skip_hidden": True}, 37, 37 * 9)):
        local, remote = scan_folder(root, **rules), scan_on_cluster(client, root, **rules)
        assert remote.root == local.root and remote.classes == local.classes and len(local.classes) == classes
        assert remote.rel_paths == local.rel_paths and len(local) == count
        assert remote.labels.dtype == local.labels.dtype and (remote.labels == local.labels).all()
        assert list(remote.ignored.items()) == list(local.ignored.items())  # same counts, same order (errors.json)
        assert remote.not_images == local.not_images
    flat = tmp_path / "flat"
    flat.mkdir()
    for i in range(5):
        (flat / f"{i}.png").write_bytes(b"x")
    assert scan_on_cluster(client, flat).rel_paths == scan_folder(flat).rel_paths


def test_move_into_place_handles_subfolders_and_repeats(tmp_path):
    partial = tmp_path / "out.partial"
    partial.mkdir()
    names = ["shard-00001.bin", "cat/a.bmp", "cat/sub/b.bmp"]
    for attempt in (b"first", b"second"):  # a repeated attempt renames complete files over the first's
        staging = partial / STAGING_DIR / attempt.decode()
        for n in names:
            (staging / n).parent.mkdir(parents=True, exist_ok=True)
            (staging / n).write_bytes(attempt)
        _move_into_place(staging, partial, names)
        assert all((partial / n).read_bytes() == attempt for n in names)
    gone = tmp_path / "removed.partial"  # an output folder removed meanwhile is not re-created
    staging = tmp_path / "elsewhere"
    (staging / "cat").mkdir(parents=True)
    (staging / "cat" / "a.bmp").write_bytes(b"x")
    with pytest.raises(FileNotFoundError):
        _move_into_place(staging, gone, ["cat/a.bmp"])
    assert not gone.exists()


# Run on the workers (client.run): the first time a worker prepares the victim file, it kills itself.
def _arm_killer(marker: str, victim: str) -> None:
    pc = importlib.import_module("packer.write.cluster")  # where a shard task finds prepare

    original = pc.prepare

    def prepare(reader, rel, label, options, loc=None):
        if rel == victim and not os.path.exists(marker):
            open(marker, "w").close()
            os.kill(os.getpid(), signal.SIGKILL)  # the worker process is lost mid-shard
        return original(reader, rel, label, options, loc)

    prepare.original = original
    pc.prepare = prepare


def _disarm_killer() -> None:
    pc = importlib.import_module("packer.write.cluster")

    pc.prepare = getattr(pc.prepare, "original", pc.prepare)


def test_lost_worker_is_retried_without_a_half_shard(client, source, reference, tmp_path):
    marker = tmp_path / "killed-once"
    ds = open_dataset(reference)
    first = ds.manifest.shards[0].num_samples
    victim = ds.index.rel_path(first + 3)  # 4th stored in shard 1: the worker dies with it half written
    client.run(_arm_killer, str(marker), victim)
    try:
        out = tmp_path / "d.lmdb"
        convert(source, out, shard_bytes=SHARD, progress=False, client=client)
    finally:
        client.wait_for_workers(2, timeout=60)
        client.run(_disarm_killer)
    assert marker.exists(), "no worker was killed: the test did not test anything"
    same_dataset(out, reference)
    assert verify(out, against=source).ok


def test_on_error_raise_names_the_file(client, source, tmp_path):
    out = tmp_path / "d.lmdb"
    with pytest.raises(PackerError, match=r"weird/(empty|truncated|random|broken_link|unreadable)\.jpg"):
        convert(source, out, shard_bytes=SHARD, on_error="raise", order="source", progress=False, client=client)
    assert not out.exists()
    assert not (tmp_path / "d.lmdb.partial").exists()  # running shards ended before it was removed


def _fail_at_shard(monkeypatch, module, shard_id: int) -> None:
    original = module.write_shard

    def write_shard(partial, sid, *args, **kwargs):
        if sid == shard_id:
            raise ShardWriteError(f"writing shard {sid} failed (simulated)")
        return original(partial, sid, *args, **kwargs)

    monkeypatch.setattr(module, "write_shard", write_shard)


def test_resume_local_run_on_the_cluster(client, source, reference, tmp_path, monkeypatch):
    out = tmp_path / "d.lmdb"
    with monkeypatch.context() as m:
        _fail_at_shard(m, importlib.import_module("packer.write.pool"), 4)  # the local backend's write_shard
        with pytest.raises(PackerError, match="resume=True"):
            convert(source, out, workers=0, shard_bytes=SHARD, progress=False)
    journaled = list((tmp_path / "d.lmdb.partial" / "journal").glob("shard-*.json"))
    assert len(journaled) >= 1  # later ones may be cancelled with the failure
    convert(source, out, shard_bytes=SHARD, progress=False, client=client, resume=True)
    same_dataset(out, reference)


def _arm_write_failure(shard_id: int) -> None:
    pc = importlib.import_module("packer.write.cluster")  # where a shard task finds write_shard

    original = pc.write_shard

    def write_shard(partial, sid, *args, **kwargs):
        if sid == shard_id:
            raise pc.ShardWriteError(f"writing shard {sid} failed (simulated)")
        return original(partial, sid, *args, **kwargs)

    write_shard.original = original
    pc.write_shard = write_shard


def _disarm_write_failure() -> None:
    pc = importlib.import_module("packer.write.cluster")

    pc.write_shard = getattr(pc.write_shard, "original", pc.write_shard)


def test_resume_cluster_run_locally(client, source, reference, tmp_path):
    out = tmp_path / "d.lmdb"
    client.run(_arm_write_failure, 3)
    try:
        with pytest.raises(PackerError, match="simulated.*resume=True"):
            convert(source, out, order="source", shard_bytes=SHARD, progress=False, client=client)
    finally:
        client.run(_disarm_write_failure)
    partial = tmp_path / "d.lmdb.partial"
    assert len(list((partial / "journal").glob("shard-*.json"))) >= 1
    assert not (partial / "shard-00003.lmdb").exists()
    local = tmp_path / "local.lmdb"
    convert(source, local, order="source", workers=0, shard_bytes=SHARD, progress=False)
    convert(source, out, order="source", workers=0, shard_bytes=SHARD, progress=False, resume=True)
    same_dataset(out, local)


def _cli(*args: str, block_dask: bool = False) -> subprocess.CompletedProcess:
    block = "sys.modules['distributed'] = None; sys.modules['dask'] = None; " if block_dask else ""
    code = ("import sys; " + block + "import packer, packer.write.cluster; from packer.cli import main; "
            "sys.exit(main(sys.argv[1:]))")
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.run([sys.executable, "-c", code, *args], env=env, capture_output=True, text=True, timeout=300)


def test_cli_with_a_scheduler_address(client, source, reference, tmp_path):
    out = tmp_path / "cli.lmdb"
    address = client.scheduler.address  # tcp://127.0.0.1:PORT, as `dask scheduler` prints
    res = _cli("convert", str(source), "-o", str(out), "--shard-size", str(SHARD), "--scheduler", address, "-q")
    assert res.returncode == 1, res.stderr  # 1: some source files were bad (listed in errors.json)
    assert "not packed, see errors.json" in res.stderr and res.stdout == ""  # -q: the errors only
    same_dataset(out, reference)


def test_without_dask_packer_works_and_scheduler_says_what_to_install(source, tmp_path):
    # packer, its CLI and packer.write.cluster import without Dask; --scheduler then says what to install
    res = _cli("convert", str(source), "-o", str(tmp_path / "x.lmdb"), "--scheduler", "local:2", block_dask=True)
    assert res.returncode == 2 and "pip install -e '.[dask]'" in res.stderr and "--scheduler" in res.stderr, res.stderr
    assert not (tmp_path / "x.lmdb.partial").exists()


@pytest.mark.parametrize("spec", ["local:0", "local:two"])
def test_bad_local_cluster_size_is_a_clear_error(spec):
    with pytest.raises(PackerError, match="local:N needs a positive number"):
        with open_client(spec):
            pass


def test_a_worker_that_cannot_see_the_folders_says_so(source, tmp_path):
    from packer import __version__
    from packer.write.cluster import convert_shard
    from packer.write.options import ConvertOptions

    opts = ConvertOptions().record()
    reply = convert_shard(str(source), str(tmp_path / "missing.partial"), 0, [("class_0/img_000.jpg", 0)], opts,
                          "skip", __version__)
    assert reply["kind"] == "input" and "shared by the driver and every worker" in reply["error"]
    reply = convert_shard(str(source), str(tmp_path), 0, [], opts, "skip", "0.0.0")
    assert reply["kind"] == "input" and "install the same packer" in reply["error"]


def test_decoder_handle_is_safe_to_load_from_several_threads(monkeypatch):
    """A Dask worker with --nthreads > 1 loads the TurboJPEG handle from several threads at once."""
    import threading

    decode = importlib.import_module("packer.images.decode")
    from packer.perprocess import PerProcess
    if not decode.turbojpeg_available():
        pytest.skip("libturbojpeg not installed")
    for _ in range(5):
        monkeypatch.setattr(decode, "_TURBO", PerProcess(decode._turbo_state))  # not loaded yet in this process
        barrier, handles = threading.Barrier(4), []

        def load(barrier=barrier, handles=handles):
            barrier.wait()
            handles.append(decode.turbojpeg_handle())

        threads = [threading.Thread(target=load) for _ in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert len(handles) == 4 and all(h is not None for h in handles)
