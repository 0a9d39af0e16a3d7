"""packer.ThreadLoader: the same samples, order and pixels as a DataLoader; errors and shutdown."""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch
from support.imagesets import make_imagefolder
from torch.utils.data import DataLoader

import packer
from packer import PackerError, ThreadLoader, convert, open_dataset


@pytest.fixture(scope="module")
def packed(tmp_path_factory):
    """The same JPEGs of varied sizes (plus a PNG and a grayscale JPEG) as lmdb and memmap."""
    from packer.tools.sample import photo_like

    root = tmp_path_factory.mktemp("threaded")
    src = make_imagefolder(root / "src", classes=3, per_class=9, size=(30, 40))
    rng = np.random.default_rng(3)
    photo_like(rng, 27, 35, 1).save(src / "class_1" / "png.png", format="PNG")
    photo_like(rng, 33, 31, 2).convert("L").save(src / "class_2" / "gray.jpg", format="JPEG")
    return {fmt: convert(src, root / f"ds.{fmt}", to=fmt, workers=0, progress=False).output
            for fmt in ("lmdb", "memmap")}


_BEFORE: set[threading.Thread] = set()


@pytest.fixture(autouse=True)
def _threads_of_others():
    """The threads alive as each test starts (another test's, left for the garbage collector) are not its own."""
    _BEFORE.clear()
    _BEFORE.update(threading.enumerate())


def loader_threads() -> list[threading.Thread]:
    """The test's own ThreadLoader threads still alive."""
    return [t for t in threading.enumerate()
            if t not in _BEFORE and t.name.startswith(("packer-decode", "packer-ThreadLoader"))]


def same_batches(got: list, want: list) -> None:
    assert len(got) == len(want)
    for (imgs, labels), (ref_imgs, ref_labels) in zip(got, want, strict=True):
        assert torch.equal(labels, ref_labels)
        if isinstance(ref_imgs, torch.Tensor):
            assert isinstance(imgs, torch.Tensor) and torch.equal(imgs, ref_imgs)
        else:
            assert len(imgs) == len(ref_imgs)
            assert all(a.shape == b.shape and torch.equal(a, b) for a, b in zip(imgs, ref_imgs, strict=True))


@pytest.mark.parametrize("fmt", ["lmdb", "memmap"])
@pytest.mark.parametrize("order", ["stored", "block"])
def test_batches_equal_the_dataloaders(packed, fmt, order):
    ds = open_dataset(packed[fmt], image="tensor")
    sampler = packer.BlockShuffleSampler(ds, batch_size=4, seed=1, block_bytes=2000) if order == "block" else None
    want = list(DataLoader(ds, batch_size=4, sampler=sampler, num_workers=0, collate_fn=packer.collate))
    if sampler is not None:
        sampler.set_epoch(0)  # the same epoch again (a second pass would take the next by itself)
    loader = ThreadLoader(ds, batch_size=4, sampler=sampler, num_threads=3)
    assert len(loader) == len(want)
    got = list(loader)
    same_batches(got, want)
    mixed = [imgs for imgs, _ in got if isinstance(imgs, list)]
    assert mixed and all(len({img.untyped_storage().data_ptr() for img in imgs}) == 1 for imgs in mixed)
    assert loader_threads() == []


@pytest.mark.parametrize("crop", [packer.RandomResizedCropDecode(16, seed=4), packer.CenterCropDecode(16, resize=20)])
def test_fused_crops_come_stacked_and_equal(packed, monkeypatch, jpegregion, crop):
    """Each decode thread's chunk of JPEGs is cropped by one call of the extension (``decode_windows``); the PNG
    goes one by one; the batches are the DataLoader's."""
    from packer.images import crop as crops

    done: list[int] = []
    bulk = crops.decode_regions

    def counted(*args, **kwargs):
        status = bulk(*args, **kwargs)
        done.extend(status)
        return status

    monkeypatch.setattr(crops, "decode_regions", counted)
    ds = open_dataset(packed["lmdb"], image="tensor", crop=crop)
    want = list(DataLoader(ds, batch_size=5, num_workers=0))
    got = list(ThreadLoader(ds, batch_size=5, num_threads=2))
    same_batches(got, want)
    assert got[0][0].shape == (5, 3, 16, 16)
    assert len(done) == len(ds) - 1 and set(done) == {1}  # all but the PNG in bulk


def test_pil_images_and_a_transform_go_through_the_collate_function(packed):
    ds = open_dataset(packed["memmap"], transform=lambda im: torch.from_numpy(np.array(im.resize((8, 6)))))
    want = list(DataLoader(ds, batch_size=6, shuffle=True, generator=torch.Generator().manual_seed(2)))
    got = list(ThreadLoader(ds, batch_size=6, shuffle=True, generator=torch.Generator().manual_seed(2),
                            collate_fn=torch.utils.data.default_collate, drop_last=False))
    same_batches(got, want)
    assert len(list(ThreadLoader(ds, batch_size=6, drop_last=True))) == len(ds) // 6


@pytest.mark.parametrize("crop", [None, packer.RandomResizedCropDecode(16)])
def test_a_damaged_sample_is_one_error_naming_it_and_no_thread_stays(packed, tmp_path, crop):
    import shutil

    path = shutil.copytree(packed["memmap"], tmp_path / "bad.memmap")
    ds = open_dataset(path, image="tensor")
    bad = 13
    pos = ds.position(bad)
    offsets = np.load(path / "shard-00000.offsets.npy")
    with open(path / "shard-00000.files.bin", "r+b") as fh:  # the JPEG's markers gone, its size kept
        fh.seek(int(offsets[pos]))
        fh.write(b"\0" * 16)
    with pytest.raises(PackerError) as err:
        for _ in ThreadLoader(open_dataset(path, image="tensor", crop=crop), batch_size=4, num_threads=2):
            pass
    assert f"sample {bad}" in str(err.value) and "\n" not in str(err.value)
    assert loader_threads() == []


def test_breaking_out_and_close_stop_every_thread(packed):
    ds = open_dataset(packed["lmdb"], image="tensor")
    loader = ThreadLoader(ds, batch_size=2, num_threads=2, prefetch_batches=3)
    for k, _ in enumerate(loader):
        if k == 1:
            break
    it = iter(loader)
    next(it)
    loader.close()
    with ThreadLoader(ds, batch_size=2) as again:
        next(iter(again))
    assert loader_threads() == []


def test_state_dict_resumes_after_the_last_batch_handed_out(packed):
    ds = open_dataset(packed["lmdb"], image="tensor")

    def make():
        return ThreadLoader(ds, batch_sampler=packer.BlockBatchSampler(ds, 3, seed=5, block_bytes=3000),
                            num_threads=2, prefetch_batches=4)

    full = list(make())
    loader = make()
    it = iter(loader)
    head = [next(it) for _ in range(3)]
    state = loader.state_dict()
    it.close()
    resumed = make()
    resumed.load_state_dict(state)
    same_batches(head + list(resumed), full)
    with pytest.raises(PackerError, match="cannot save its position"):
        ThreadLoader(ds, batch_size=2).state_dict()


def test_reads_are_queued_batches_ahead_in_the_order_decoded(packed, monkeypatch):
    """Each batch's reads start READ_AHEAD_BATCHES batches before it is decoded, in batch order; its chunks are taken
    in the order their bytes arrive (file order here), each once its bytes are in, from those very reads (not read
    again), as copies in memory of their own (never views of a map: a truncated shard is an error, not a SIGBUS)."""
    from packer.read import threaded

    ds = open_dataset(packed["memmap"], image="tensor")
    events: list = []
    lock = threading.Lock()
    source = ds.source
    real_start, real_payloads = source.start, source.payloads

    def start(idx, ahead=(), skip_cached=True):
        pending = real_start(idx, ahead, skip_cached)
        with lock:
            events.append(("start", np.asarray(idx).tolist(), pending))
        return pending

    def payloads(stored, pending=None, into=None, places=None):
        assert into is not None and pending is None  # copies; waited for already: nothing read ahead again
        with lock:
            events.append(("take", np.asarray(stored).tolist(), None))
        return real_payloads(stored, pending, into, places)

    sampler = packer.BlockShuffleSampler(ds, batch_size=4, seed=3, block_bytes=2000)
    want = list(DataLoader(ds, batch_size=4, sampler=sampler, num_workers=0, collate_fn=packer.collate))
    monkeypatch.setattr(source, "start", start)
    monkeypatch.setattr(source, "payloads", payloads)
    sampler.set_epoch(0)  # each pass below reads epoch 0 again (without it, each would take the next epoch)
    same_batches(list(ThreadLoader(ds, batch_size=4, sampler=sampler, num_threads=2)), want)
    sampler.set_epoch(0)
    batches = [ds.positions(b).tolist() for b in torch.utils.data.BatchSampler(sampler, 4, False)]
    starts = [e for e in events if e[0] == "start"]
    assert [e[1] for e in starts] == batches and all(e[2] is not None for e in starts)
    takes = [e[1] for e in events if e[0] == "take"]
    assert sorted(sum(takes, [])) == sorted(sum(batches, []))  # each sample taken once
    for b, batch in enumerate(batches):
        mine = [k for k, e in enumerate(events) if e[0] == "take" and set(e[1]) <= set(batch)]
        chunks = sorted((events[k][1] for k in mine), key=min)  # decode threads take them at once: any order
        assert sum(chunks, []) == sorted(batch)  # each chunk a run of the order the bytes arrive in (file order)
        started = sum(e[0] == "start" for e in events[: mine[0]])
        assert started >= min(b + threaded.READ_AHEAD_BATCHES + 1, len(batches))  # its reads started ahead


def test_an_error_drawing_a_batch_comes_after_the_batches_before_it(packed):
    """Reads are queued ahead, yet a sampler that fails at its fourth batch (or an index out of range) fails the
    fourth batch, after three good ones, as a DataLoader does; and as a DataLoader's, the iterator then goes on
    with the next batch (a bad index) or ends (a sampler that failed)."""
    ds = open_dataset(packed["memmap"], image="tensor")

    def failing():
        yield from ([0, 1], [2, 3], [4, 5])
        raise ValueError("sampler broke")

    def out_of_range():
        yield from ([0, 1], [2, 3], [4, 5], [len(ds)], [6, 7])

    for batches, error, after in ((failing, ValueError, []), (out_of_range, IndexError, [[6, 7]])):
        for loader in (DataLoader(ds, batch_sampler=batches(), collate_fn=packer.collate),
                       ThreadLoader(ds, batch_sampler=batches(), num_threads=2)):
            it, got = iter(loader), 0
            with pytest.raises(error):
                for _ in it:
                    got += 1
            assert got == 3, type(loader).__name__
            rest = list(it)
            assert [labels.tolist() for _, labels in rest] == [ds.targets[a:b + 1] for a, b in after]
    del it
    assert loader_threads() == []


def test_arguments_are_checked(packed):
    ds = open_dataset(packed["lmdb"])
    for kwargs in ({"num_threads": 0}, {"prefetch_batches": 0}, {"batch_size": 0},
                   {"batch_sampler": [[0, 1]], "batch_size": 2}, {"shuffle": True, "sampler": [0, 1]}):
        with pytest.raises(PackerError):
            ThreadLoader(ds, **kwargs)
    with pytest.raises(PackerError, match="packer datasets"):
        ThreadLoader(torch.utils.data.TensorDataset(torch.zeros(3)))  # type: ignore[arg-type]


def test_batch_memory_is_used_again_only_once_nothing_holds_it():
    from packer.read.slots import BlockPool

    pool = BlockPool(keep=3)
    first = pool.take(100)
    where = first.data_ptr()
    del first
    again = pool.take(50)
    assert again.data_ptr() == where  # free: used again
    view = again[:10].view(2, 5)
    array = view.numpy()
    del again, view
    assert pool.take(10).data_ptr() != where  # a numpy view of a view still holds it
    del array
    assert pool.take(10).data_ptr() == where
    assert len(pool.blocks) <= 3


def test_batch_memory_is_used_again_across_epochs_and_loaders(packed):
    """A dataset's ThreadLoaders share its batch memory: a new epoch, or a new loader, decodes into blocks an
    earlier one made (fresh memory costs a page fault per page), and two iterations at once get apart blocks."""
    from packer.read.slots import pool_of

    ds = open_dataset(packed["memmap"], image="tensor", crop=packer.RandomResizedCropDecode(16, seed=0))
    loader = ThreadLoader(ds, batch_size=8, num_threads=2)
    first = {imgs.untyped_storage().data_ptr() for imgs, _ in loader}
    blocks = [id(b) for b in pool_of(ds, 1).blocks]
    assert blocks and {b.ctypes.data for b in pool_of(ds, 1).blocks} == first
    for again in (loader, ThreadLoader(ds, batch_size=8, num_threads=3, prefetch_batches=1)):
        # batches decoded into the first epoch's blocks (one more may be made while all are still held)
        assert {imgs.untyped_storage().data_ptr() for imgs, _ in again} & first
        assert set(blocks) <= {id(b) for b in pool_of(ds, 1).blocks}  # kept, not replaced
    a, b = iter(ThreadLoader(ds, batch_size=8)), iter(ThreadLoader(ds, batch_size=8))
    held = [next(a)[0], next(b)[0], next(a)[0], next(b)[0]]
    assert len({imgs.untyped_storage().data_ptr() for imgs in held}) == 4


@pytest.mark.parametrize("fields", [("image", "label", "score"), ("label", "image"), "all"])
def test_samples_with_fields_are_collated_as_the_dataloader_does(tmp_path, fields):
    """Samples of other shapes than (image, label) (``fields=``) come out as packer.collate makes them."""
    from packer import Writer
    from packer.tools.sample import photo_like

    rng = np.random.default_rng(5)
    with Writer(tmp_path / "f.memmap", format="memmap", fields={"score": "float"}) as w:
        for i in range(10):
            w.add(image=np.asarray(photo_like(rng, 20 + i, 30)), label=i % 2, score=float(i))
    ds = open_dataset(tmp_path / "f.memmap", image="tensor", fields=fields)
    want = list(DataLoader(ds, batch_size=4, num_workers=0, collate_fn=packer.collate))
    got = list(ThreadLoader(ds, batch_size=4, num_threads=2))
    assert len(got) == len(want) == 3
    for g, r in zip(got, want, strict=True):
        pairs = zip(g.values(), r.values(), strict=True) if isinstance(r, dict) else zip(g, r, strict=True)
        for a, b in pairs:
            if isinstance(b, list):
                assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True))
            else:
                assert torch.equal(a, b)


def test_breaking_out_cancels_the_reads_queued_ahead(packed, monkeypatch):
    """Reads queued for batches nobody will take are cancelled, so the next iteration's reads do not wait behind."""
    from packer.read import readahead, threaded

    cancelled = []
    real = readahead.Pending.cancel
    monkeypatch.setattr(readahead.Pending, "cancel", lambda self: (cancelled.append(self), real(self)))
    ds = open_dataset(packed["memmap"], image="tensor")
    loader = ThreadLoader(ds, batch_size=2, num_threads=2)
    for _ in loader:
        break
    loader.close()
    assert len(cancelled) == threaded.READ_AHEAD_BATCHES and all(p.cancelled for p in cancelled)
    assert loader_threads() == []


def test_torch_ops_in_decode_threads_run_on_that_thread_alone(packed):
    """A decode thread's torch ops (the fused crop's resize, a transform) get an OpenMP team of one: teams per
    op and thread spin beside the decoders (train224: ~10 % fewer images/s); the process keeps its setting."""
    if not torch.backends.openmp.is_available():
        pytest.skip("torch without OpenMP: its ops have no per-thread team size")
    seen: list[int] = []

    def record(img):
        seen.append(torch.get_num_threads())
        return img

    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        ds = open_dataset(packed["lmdb"], image="tensor", transform=record)
        list(ThreadLoader(ds, batch_size=4, num_threads=2))
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)
    assert len(seen) == len(ds) and set(seen) == {1}


def test_whole_jpegs_are_decoded_in_bulk_and_the_rest_one_by_one(packed, monkeypatch, jpegregion, turbojpeg):
    """A decode thread hands its chunk's JPEGs to the extension in one call (``decode_many``); the PNG goes to the
    per-sample path; the batches are the DataLoader's."""
    import packer.read.decoding as decoding_mod

    ds = open_dataset(packed["memmap"], image="tensor")
    counts = {"calls": 0, "done": 0, "left": 0}
    real = decoding_mod.decode_many

    def spy(datas, outs, backend, strict):
        status = real(datas, outs, backend, strict)
        counts["calls"] += 1
        counts["done"] += status.count(1)
        counts["left"] += len(status) - status.count(1)
        return status

    monkeypatch.setattr(decoding_mod, "decode_many", spy)
    want = list(DataLoader(ds, batch_size=8, num_workers=0, collate_fn=packer.collate))
    counts.update(calls=0, done=0, left=0)  # the DataLoader's path decodes one by one
    same_batches(list(ThreadLoader(ds, batch_size=8, num_threads=2)), want)
    assert counts["done"] == len(ds) - 1 and counts["left"] == 0  # the PNG is not even handed over
    assert counts["calls"] >= len(ds) // 8


# (a crop's region decode never reads the rows below it: damage at the end is a whole decode's error only)
@pytest.mark.parametrize(("crop", "damage"), [
    (crop, damage) for crop in (None, packer.RandomResizedCropDecode(16, seed=1))
    for damage in ("app0-length", "frame-size", *(("late-frame-header",) if crop is None else ()))])
def test_a_damaged_header_has_the_per_sample_error(packed, tmp_path, jpegregion, turbojpeg, crop, damage):
    """A header the one-by-one path refuses is never handed to the extension in bulk (libjpeg, not strict, would
    decode past a broken APP0 length), and damage the extension meets after the header is refused there too: both
    loaders raise the same one-line error naming the sample."""
    import shutil

    path = shutil.copytree(packed["memmap"], tmp_path / f"{damage}.memmap")
    ds = open_dataset(path, image="tensor", crop=crop)
    bad = 4
    at = int(np.load(path / "shard-00000.offsets.npy")[ds.position(bad)])
    assert ds.read_payload(bad)[2:4] == b"\xff\xe0"  # Pillow's JPEGs start with JFIF's APP0
    with open(path / "shard-00000.files.bin", "r+b") as fh:
        if damage == "app0-length":
            fh.seek(at + 4)
            fh.write(b"\x00\x0e")  # 16 -> 14: the next segment is looked for two bytes early
        elif damage == "late-frame-header":
            fh.seek(at + len(ds.read_payload(bad)) - 6)
            fh.write(b"\xff\xc0\x00\x02")  # the scan's last bytes become a second frame header
        else:
            sof = bytes(ds.read_payload(bad)).index(b"\xff\xc0")
            fh.seek(at + sof + 5)
            fh.write(b"\x00\x07")  # the frame header's height: no longer the index's
    ds = open_dataset(path, image="tensor", crop=crop)
    with pytest.raises(PackerError) as single:
        ds[bad]
    with pytest.raises(PackerError) as threaded:
        for _ in ThreadLoader(ds, batch_size=4, num_threads=2):
            pass
    assert str(threaded.value) == str(single.value) and f"sample {bad}" in str(single.value)
    assert "\n" not in str(single.value)


def test_unseeded_crops_draw_once_per_sample_with_fallbacks(tmp_path, jpegregion):
    """seed=None crops come from the per-process stream in sample order: a sample the bulk path leaves (PNG, CMYK)
    draws its crop once, so one thread gives the crops a DataLoader without workers gives."""
    from packer.tools.sample import photo_like

    src = make_imagefolder(tmp_path / "src", classes=2, per_class=10, size=(40, 50))
    rng = np.random.default_rng(4)
    photo_like(rng, 44, 52, 1).save(src / "class_0" / "png.png", format="PNG")
    photo_like(rng, 41, 57, 2).convert("CMYK").save(src / "class_1" / "cmyk.jpg", format="JPEG")
    out = convert(src, tmp_path / "d.memmap", to="memmap", workers=0, progress=False).output
    ds = open_dataset(out, image="tensor", crop=packer.RandomResizedCropDecode(24))
    torch.manual_seed(0)
    want = list(DataLoader(ds, batch_size=11, num_workers=0))
    ds = open_dataset(out, image="tensor", crop=packer.RandomResizedCropDecode(24))
    torch.manual_seed(0)
    same_batches(list(ThreadLoader(ds, batch_size=11, num_threads=1)), want)


@pytest.mark.parametrize("cache", [None, "ram"])
def test_unseeded_crops_do_not_depend_on_which_bytes_come_first(packed, monkeypatch, cache):
    """A batch's seed=None crops are drawn in the batch's order, as DataLoader's per-sample draws are, whatever
    order its samples are decoded in (bytes in the page cache first, storage order under cache="ram")."""
    from packer.read.readahead import Pending

    def fresh():  # a new crop's stream starts from torch's seed
        return open_dataset(packed["memmap"], image="tensor", crop=packer.RandomResizedCropDecode(12), cache=cache)

    torch.manual_seed(0)
    want = list(DataLoader(fresh(), batch_size=7, num_workers=0))
    reversed_order = []

    def backwards(self):
        order = sorted(range(len(self.need)), key=self.need.__getitem__)[::-1]
        reversed_order.append(len(order))
        return order

    monkeypatch.setattr(Pending, "arrival_order", backwards)  # the last sample's bytes "arrive" first
    for loader in (lambda ds: ThreadLoader(ds, batch_size=7, num_threads=1),
                   lambda ds: DataLoader(ds, batch_size=7, num_workers=0)):
        torch.manual_seed(0)
        same_batches(list(loader(fresh())), want)
    assert cache == "ram" or reversed_order  # the loaders decoded in the reversed order


@pytest.mark.parametrize("fmt,resize", [("lmdb", None), ("lmdb", "24x32"), ("memmap", "24x32"), ("hdf5", None),
                                        ("pth", None), ("n5", "24x32")])
def test_raw_pixels_are_read_straight_into_their_batch_slots(tmp_path, fmt, resize):
    """ThreadLoader's copies of raw payloads (``pread``, never a map) land in the batch memory they are handed out in:
    one copy, as the views copied into it were; the batches are ``ds[i]``'s, mixed shapes or one."""
    src = make_imagefolder(tmp_path / "src", classes=2, per_class=7)
    out = convert(src, tmp_path / f"ds.{fmt}", to=fmt, payload="raw", resize=resize, workers=0, progress=False).output
    ds = open_dataset(out, image="tensor")
    idx = ds.positions(list(range(6)))
    from packer.read.slots import Pooled

    _stacked, slots = ds.pipeline.slots(idx, Pooled())
    flat = [slot.view(-1).numpy() for slot in slots]
    got = ds.payloads_at(idx, into=lambda n: np.zeros(n, np.uint8), places=flat)
    assert all(np.shares_memory(np.asarray(g), f) for g, f in zip(got, flat, strict=True))
    want = [ds[i][0] for i in range(len(ds))]
    for b, (images, _labels) in enumerate(ThreadLoader(ds, batch_size=4, num_threads=2)):
        assert all(torch.equal(img, want[4 * b + k]) for k, img in enumerate(images))
