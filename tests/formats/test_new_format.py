"""A sixth format, defined in this module only: registering it is all it takes for convert, the generated CLI
flag, open_dataset, verify and the contract suite (test_contract.py's tests run here again on it).

``catfile``: one file of payloads laid end to end, each padded to ``--align`` bytes, and an ``<i8 [N, 2]``
``.spans.npy`` of (start, end) per sample. Its spawn-worker case is left out: a spawned DataLoader worker
unpickles the dataset before anything imports this module, so the format is not registered there.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np
import pytest
import test_contract as contract

from packer import PackerError, cli, convert, open_dataset
from packer.formats import FORMATS, register
from packer.formats.base import Format, Option, PreparedSample, ShardReader, ShardWriter, Span
from packer.layout.manifest import Shard
from packer.layout.trust import inside, load_npy
from packer.perprocess import PerProcess
from packer.read.dataset import PackedDataset


class Writer(ShardWriter):
    def __init__(self, directory: Path, shard_id: int, num_samples: int, payload: str, options: Mapping) -> None:
        super().__init__(directory, shard_id, num_samples, payload, options)
        self.align = int(options.get("align") or 1)
        self.names = [f"cat-{shard_id:05d}.bin", f"cat-{shard_id:05d}.spans.npy"]
        self._spans: list[tuple[int, int]] = []
        self._fh = open(self.directory / self.names[0], "wb")

    def add(self, sample: PreparedSample) -> None:
        start = self._fh.tell()
        self._fh.write(sample.payload)
        self._spans.append((start, start + sample.nbytes))
        self._fh.write(b"\0" * (-self._fh.tell() % self.align))

    def close(self) -> tuple[list[str], dict]:
        self._fh.close()
        np.save(self.directory / self.names[1], np.asarray(self._spans, dtype="<i8").reshape(-1, 2))
        return list(self.names), {"align": self.align}

    def abort(self) -> None:
        self._fh.close()
        for name in self.names:
            (self.directory / name).unlink(missing_ok=True)


class Reader(ShardReader):
    def __init__(self, directory: Path, shard: Shard, payload: str, access: str = "sequential") -> None:
        self.path = inside(Path(directory), shard.files[0].name)
        self.spans = load_npy(inside(Path(directory), shard.files[1].name), "<i8", ndim=2)
        size = self.path.stat().st_size
        if self.spans.shape != (shard.num_samples, 2) or np.any(self.spans < 0) or np.any(self.spans > size) or \
                np.any(self.spans[:, 0] > self.spans[:, 1]):
            raise PackerError(f"{self.path}: spans do not describe the samples of this file")
        self._fd: PerProcess[int] = PerProcess()

    def __len__(self) -> int:
        return len(self.spans)

    def read(self, pos: int) -> bytes:
        start, end = (int(v) for v in self.spans[pos])
        return os.pread(self._fd.get(lambda: os.open(self.path, os.O_RDONLY)), end - start, start)

    def file_spans(self, positions: Sequence[int]) -> list[list[Span]]:
        return [[(str(self.path), int(self.spans[p, 0]), int(self.spans[p, 1]))] for p in positions]

    def close(self) -> None:
        self._fd.close(os.close)


class CatFormat(Format):
    def check_options(self, options: Mapping) -> None:
        if options.get("align") is not None and int(options["align"]) < 1:
            raise PackerError(f"--align {options['align']}: must be at least 1")


FORMAT = CatFormat(name="catfile", dataset_class="CatfileDataset", payloads=frozenset({"encoded", "raw"}),
                   Writer=Writer, Reader=Reader, default_shard_bytes=None,
                   options=(Option("align", "catfile: pad each payload to a multiple of this many bytes", type=int),))


@pytest.fixture(scope="module", autouse=True)
def registered():
    register(FORMAT)
    yield
    del FORMATS[FORMAT.name]


@pytest.fixture(scope="module")
def packed_cache():
    return {}


@pytest.fixture(params=[("encoded", None), ("raw", None), ("raw", "24x32")], ids=["encoded", "raw", "raw-24x32"])
def packed(request, imagefolder, packed_cache, tmp_path_factory):
    """(path, name, payload, resize) as test_contract's fixture gives, for catfile with --align 16."""
    payload, resize = request.param
    if request.param not in packed_cache:
        out = tmp_path_factory.mktemp("catfile") / "ds.catfile"
        convert(imagefolder, out, to="catfile", payload=payload, resize=resize, align=16, shard_bytes=6_000,
                workers=2, progress=False)
        packed_cache[request.param] = out
    return packed_cache[request.param], "catfile", payload, resize


# The contract suite, unchanged, on the new format (each body takes `packed` from this module).
test_round_trip_bytes_and_pixels = contract.test_round_trip_bytes_and_pixels
test_imagefolder_surface = contract.test_imagefolder_surface
test_shards_split_and_verify = contract.test_shards_split_and_verify
test_getitems_equals_getitem = contract.test_getitems_equals_getitem
test_worker_tensors_equal_main_process_reads = contract.test_worker_tensors_equal_main_process_reads
test_reader_pickles_before_and_after_first_use = contract.test_reader_pickles_before_and_after_first_use
test_verify_catches_a_flipped_byte = contract.test_verify_catches_a_flipped_byte
test_wrong_class_refuses_other_formats = contract.test_wrong_class_refuses_other_formats


def test_dataloader_fork_workers_see_every_sample_once(packed, request):
    contract.test_dataloader_workers_see_every_sample_once(packed, "fork", request)


def test_payloads_lie_where_the_option_put_them(packed):
    path, *_ = packed
    spans = np.concatenate([np.load(p) for p in sorted(Path(path).glob("cat-*.spans.npy"))])
    assert np.all(spans[:, 0] % 16 == 0) and len(open_dataset(path)) == len(spans)
    assert json.loads((Path(path) / "manifest.json").read_text())["options"]["align"] == 16


def test_the_cli_flag_comes_from_the_format(imagefolder, tmp_path, capsys):
    with pytest.raises(SystemExit):
        cli.main(["convert", "--help"])
    assert "--align ALIGN" in capsys.readouterr().out
    out = tmp_path / "c.catfile"
    assert cli.main(["convert", str(imagefolder), "--to", "catfile", "--align", "64", "-o", str(out), "-q"]) == 0
    ds = open_dataset(out)
    assert type(ds) is PackedDataset and ds.manifest.options["align"] == 64  # a plug-in format: the general class
    assert cli.main(["convert", str(imagefolder), "--to", "catfile", "--align", "0", "-o", str(tmp_path / "z")]) == 2
    assert "--align 0: must be at least 1" in capsys.readouterr().err
    assert cli.main(["convert", str(imagefolder), "--to", "lmdb", "--align", "8", "-o", str(tmp_path / "y")]) == 2
    assert "--align is an option of --to catfile only" in capsys.readouterr().err
