"""packer.dali: DALI pipelines fed by packer, on DALI's CPU build (device_id=None; no GPU here, so the
"mixed" nvJPEG path is not run by these tests): pixels and labels as open_dataset's for every format,
epochs, last batches, ranks, fork and spawn workers, and the error without DALI."""

from __future__ import annotations

import copyreg
import subprocess
import sys
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch
from support.cli import REPO
from support.imagesets import make_imagefolder

from packer import FORMATS, PackerError, convert, open_dataset
from packer.images.decode import DecodeError
from packer.read.dali import PackerSource
from packer.tools.sample import photo_like

JPEG_BOUND = 1  # max abs pixel difference DALI's CPU decoder may have from open_dataset's (docs/dali.md)
FORMAT_OPTIONS: dict[str, dict] = {"mosaic": {"tile": "32x48"}}  # as tests/formats/test_contract.py


def dali_or_skip():
    return pytest.importorskip("nvidia.dali", reason="NVIDIA DALI is not installed (pip install 'packer-images[dali]')")


@pytest.fixture(scope="module")
def source(tmp_path_factory) -> Path:
    """3 classes x 5 JPEGs of varying sizes, plus PNGs (RGB and grey) in a fourth class."""
    root = make_imagefolder(tmp_path_factory.mktemp("dali") / "imgs", classes=3, per_class=5)
    rng = np.random.default_rng(4)
    (root / "pngs").mkdir()
    for k in range(3):
        img = photo_like(rng, 20 + k, 30 + k, k)
        (img if k else img.convert("L")).save(root / "pngs" / f"p{k}.png")
    return root


@pytest.fixture(scope="module")
def packed(source, tmp_path_factory):
    made: dict = {}

    def get(name: str, payload: str) -> Path:
        if (name, payload) not in made:
            out = tmp_path_factory.mktemp("dali") / f"ds.{name}"
            convert(source, out, to=name, payload=payload, shard_bytes=6_000, workers=0, progress=False,
                    **FORMAT_OPTIONS.get(name, {}))
            made[name, payload] = out
        return made[name, payload]
    return get


def epoch_samples(pipe) -> list[tuple[int, int, np.ndarray]]:
    """(index, label, image) of every sample of one epoch of a pipeline, then reset for the next."""
    out = []
    while True:
        try:
            images, labels, indices = pipe.run()
        except StopIteration:
            pipe.reset()
            return out
        for k in range(len(indices)):
            out.append((int(np.asarray(indices[k])), int(np.asarray(labels[k])), np.asarray(images[k])))


def check_against_open_dataset(path: Path, samples) -> None:
    """Each sample exactly once, its label and pixels as open_dataset's (JPEG within JPEG_BOUND)."""
    ref = open_dataset(path, image="numpy")
    assert sorted(i for i, _, _ in samples) == list(range(len(ref)))
    for i, label, image in samples:
        expected, target = ref[i]
        assert label == target
        assert image.shape == expected.shape, ref.index.rel_path(i)
        diff = int(np.abs(image.astype(np.int16) - expected).max())
        exact = ref.manifest.payload == "raw" or ref.index.rel_path(i).endswith(".png")
        assert diff <= (0 if exact else JPEG_BOUND), f"{ref.index.rel_path(i)}: max pixel difference {diff}"


CASES = [pytest.param(name, payload, id=f"{name}-{payload}")
         for name, fmt in FORMATS.items() for payload in sorted(fmt.payloads - {"none"})]  # images only


@pytest.mark.parametrize(("name", "payload"), CASES)
@pytest.mark.filterwarnings("ignore:.*blocks hold a single label")  # mosaic: a small set, its mosaics by class
def test_no_augment_gives_open_datasets_pixels_and_labels(packed, name, payload):
    """Every format and payload kind: encoded payloads decoded by DALI, raw ones handed over as HWC arrays."""
    dali_or_skip()
    from packer.dali import pipeline

    path = packed(name, payload)
    pipe = pipeline(path, 4, augment="none", seed=1)
    check_against_open_dataset(path, epoch_samples(pipe))


@pytest.fixture
def plain_exception_pickling():
    """Exceptions pickled the standard way for the test: an earlier test in this process (Dask's) may have
    installed tblib's reducers, which DALI's fork workers cannot send back (packer.dali refuses that)."""
    saved = {t: f for t, f in copyreg.dispatch_table.items() if isinstance(t, type) and issubclass(t, BaseException)}
    for t in saved:
        del copyreg.dispatch_table[t]
    yield
    copyreg.dispatch_table.update(saved)


@pytest.mark.parametrize("method", ["fork", "spawn"])
def test_parallel_workers_in_fork_and_spawn(packed, method, plain_exception_pickling):
    """DALI's parallel external source (worker processes, no DataLoader): same samples, new order each epoch."""
    dali_or_skip()
    from packer.dali import pipeline

    path = packed("lmdb", "encoded")
    pipe = pipeline(path, 4, augment="none", py_workers=2, py_start_method=method)
    first, second = epoch_samples(pipe), epoch_samples(pipe)
    check_against_open_dataset(path, first)
    check_against_open_dataset(path, second)
    assert [i for i, _, _ in first] != [i for i, _, _ in second]  # the next epoch's block order


@pytest.mark.parametrize("payload", ["encoded", "raw"])
def test_train_loader_shapes_and_every_label_once_per_epoch(packed, payload):
    dali_or_skip()
    from packer.dali import loader

    path = packed("lmdb", payload)
    targets = Counter(open_dataset(path).targets)
    batches = loader(path, 8, augment="train", size=24, num_threads=2)
    for _ in range(2):
        labels = Counter()
        sizes = []
        for images, y in batches:
            assert images.dtype == torch.float32 and tuple(images.shape[1:]) == (3, 24, 24)
            assert len(y) == len(images) and y.dtype == torch.int64
            assert -3 < float(images.min()) and float(images.max()) < 3  # normalized
            labels.update(y.tolist())
            sizes.append(len(y))
        assert labels == targets
        assert sizes == [8, 8, 2]  # 18 samples: the short last batch ("partial")


def test_eval_loader_center_crops(packed):
    dali_or_skip()
    from packer.dali import loader

    path = packed("hdf5", "encoded")
    images, labels = next(iter(loader(path, 18, augment="eval", size=16, shuffle=False)))
    assert tuple(images.shape) == (18, 3, 16, 16)
    # shuffle=False: storage order (ds.index holds the labels as stored; ds.targets is ImageFolder's order)
    assert labels.tolist() == open_dataset(path).index.labels.tolist()


def test_last_batch_policies_and_epochs(packed):
    path = packed("lmdb", "encoded")
    ds = open_dataset(path)
    n = len(ds)  # 18
    for policy, sizes in (("partial", [8, 8, 2]), ("drop", [8, 8]), ("fill", [8, 8, 8])):
        src = PackerSource(ds, 8, last_batch=policy, seed=5)
        assert len(src) == len(sizes)
        got = [src.batch_indices(3, k) for k in range(len(src))]
        assert [len(b) for b in got if b is not None] == sizes
        assert src.batch_indices(3, len(src)) is None
        flat = np.concatenate(got)
        order = src.order(3)
        assert np.array_equal(flat[: min(n, len(flat))], order[: len(flat)])
        if policy == "fill":
            assert np.array_equal(flat[n:], order[: 24 - n])  # padded with the epoch's first samples
    src = PackerSource(ds, 8, seed=5, first_epoch=2)
    assert not np.array_equal(src.order(2), src.order(3))


def test_ranks_split_each_epoch(packed):
    ds = open_dataset(packed("lmdb", "encoded"))
    parts = [PackerSource(ds, 4, num_replicas=2, rank=r, seed=1).order(1) for r in (0, 1)]
    assert len(parts[0]) == len(parts[1]) == 9
    assert sorted(np.concatenate(parts).tolist()) == list(range(len(ds)))


def test_damaged_header_is_refused_before_dali_decodes(packed):
    ds = open_dataset(packed("lmdb", "encoded"))
    src = PackerSource(ds, 4)
    other = next(i for i in range(1, len(ds)) if (ds.index.heights[i], ds.index.widths[i]) !=
                 (ds.index.heights[0], ds.index.widths[0]))
    # array() takes storage positions (as ds.index does); the error names the sample's public index
    with pytest.raises(DecodeError, match=rf"sample {ds.index_map.public(0)} .*index says"):
        src.array(0, ds.payload_at(other))


def test_without_dali_a_one_line_error_names_the_extra(packed):
    """nvidia.dali blocked in sys.modules, as on a machine without it: importing packer.dali works, building
    a pipeline raises PackerError naming the extra."""
    path = packed("lmdb", "encoded")
    code = ("import sys; sys.modules['nvidia.dali'] = None\n"
            "import packer, packer.dali\n"
            "try:\n    packer.dali.pipeline(sys.argv[1], 4)\n"
            "except packer.PackerError as e:\n    print('ERROR', e)\n")
    out = subprocess.run([sys.executable, "-c", code, str(path)], capture_output=True, text=True,
                         env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"}, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("ERROR packer.dali needs NVIDIA DALI") and "pip install -e '.[dali]'" in out.stdout
    assert out.stdout.count("\n") == 1


def test_bad_arguments_are_packer_errors(packed):
    from packer.dali import loader, pipeline

    path = packed("lmdb", "encoded")
    with pytest.raises(PackerError, match="unknown device"):
        pipeline(path, 4, device="tpu")  # type: ignore[arg-type]
    with pytest.raises(PackerError, match="unknown last_batch"):
        PackerSource(open_dataset(path), 4, last_batch="wrap")  # type: ignore[arg-type]
    with pytest.raises(PackerError, match="augment='train' or 'eval'"):
        loader(path, 4, augment="none")


def test_fork_workers_refused_where_exceptions_pickle_through_copyreg(packed, plain_exception_pickling):
    """tblib (installed by Dask) pickles StopIteration with a reducer DALI's worker results refuse: a clear
    error up front instead of an UnpicklingError at the end of the first epoch."""
    from packer.dali import pipeline

    copyreg.pickle(StopIteration, lambda e: (StopIteration, e.args))
    try:
        with pytest.raises(PackerError, match="py_start_method='spawn'"):
            pipeline(packed("lmdb", "encoded"), 4, py_workers=2, py_start_method="fork")
    finally:
        del copyreg.dispatch_table[StopIteration]
