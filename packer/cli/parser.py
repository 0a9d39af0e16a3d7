"""The argument parser: ``build_parser`` and one ``_add_<command>(sub)`` per subcommand (its options and
examples); each subcommand runs ``packer.cli.commands.cmd_<command>``."""

from __future__ import annotations

import argparse
import textwrap
from typing import TYPE_CHECKING, Any

from packer.argtypes import csv_of, float_in, hw_arg, int_in, size_arg
from packer.cli import commands
from packer.errors import render

if TYPE_CHECKING:
    from packer.write.options import Declared

EXIT_CODES = """\
exit codes (every command):
  0    ok
  1    the command ran and found a problem: verify found damage or differences, convert left
       source files unpacked (listed in errors.json), profile found no setting that keeps the
       step fed, a dataset failed its checks while being read, a write failed part-way
  2    the command could not run as asked: a usage error or an option out of range, an input
       path that is missing, unreadable or not a dataset, a destination refused before anything
       was written (read-only, files in the way, names too long), a missing optional package
  130  interrupted (Ctrl-C)"""



def _parser(sub, name: str, help: str, examples: str, description: str = "") -> argparse.ArgumentParser:
    return sub.add_parser(
        name, help=help, description=(description or help),
        epilog="examples:\n" + textwrap.indent(textwrap.dedent(examples).strip(), "  "),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )



def _add_json(p: argparse.ArgumentParser, what: str) -> None:
    """``--json`` of the commands that print one JSON document (the shared envelope: docs/library.md)."""
    p.add_argument("--json", action="store_true",
                   help=f"print one JSON document on stdout instead of text: {what}, after the envelope every "
                   "command shares (command, packer_version, schema, ok, exit_code; docs/library.md). A failed run "
                   "prints it too, with 'error'. Progress and notices stay on stderr")


def build_parser() -> argparse.ArgumentParser:
    from packer._version import __version__
    from packer.formats import FORMATS

    parser = argparse.ArgumentParser(
        prog="packer",
        description=f"Pack loose image folders into few large files, in any of {len(FORMATS)} formats "
        f"({', '.join(FORMATS)}), and read them back fast with PyTorch.",
        epilog="Run 'packer COMMAND --help' for the options and examples of each command.\n\n" + EXIT_CODES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"packer {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for add in (_add_convert, _add_info, _add_verify, _add_extract, _add_sample, _add_profile, _add_doctor,
                _add_bench):
        add(sub)
    return parser


def _add_convert(sub) -> None:
    from packer.formats import FORMATS
    from packer.write.convert import keywords, targets
    from packer.write.options import own_options

    p = _parser(sub, "convert", "pack images (a folder, a list file, an archive or a dataset) into a dataset", """
        packer convert imgs/ --to lmdb                # -> imgs.lmdb/ beside imgs/
        packer convert imgs/ --to lmdb -o /fast/imgs.lmdb --workers 8
        packer convert imgs/ --to lmdb -o s3://bucket/imgs.lmdb   # into a bucket (credentials from AWS_* as usual)
        packer convert s3://bucket/train/ --to lmdb -o train.lmdb --storage-option endpoint=http://minio:9000
        packer convert imgs/ --to lmdb --validate header   # faster; catches fewer damaged files
        packer convert imgs/ --to lmdb --payload raw --resize 256   # decoded once, short side 256
        packer convert imgs/ --to hdf5                               # encoded bytes, one blob + offsets
        packer convert imgs/ --to memmap --payload raw --resize 224x224   # one (N,224,224,3) .npy
        packer convert imgs/ --to hdf5 --payload raw --resize 256 --compression lzf
        packer convert imgs/ --to lmdb --resume       # go on after Ctrl-C, a kill or a full disk
        packer convert imgs/ --to lmdb --if-changed --overwrite   # in a pipeline: reuse an up-to-date output
        packer convert imgs/ --to lmdb --order source      # keep ImageFolder's sample order (indices)
        packer convert imgs/ --to lmdb --jpeg-restarts     # lossless rewrite: training crops decode faster
        packer convert imgs/ --to bmp --resize 256          # one uncompressed BMP per image, no decoding in training
        packer convert imgs/ --to mosaic --tile 224x224     # 224x224 tiles on ~16 MB BMP mosaics
        packer convert imgs/ --to mosaic --tile 224x224 --grid 16x16 --codec jpeg --quality 95   # lossy, small
        packer convert /shared/imgs --to lmdb --scheduler tcp://HOST:8786   # on a Dask cluster
        packer convert imgs/ --to lmdb --scheduler local:4      # a local Dask cluster of 4 processes
        packer convert s3://b/imgs/ --to lmdb -o s3://b/imgs.lmdb --scheduler tcp://HOST:8786   # nothing shared
        packer convert labels.csv --root imgs/ --to lmdb    # a list file: path,label[,...] (or "path label" lines)
        packer convert train.tar --to lmdb                  # an archive, read in place (also .zip, nested tars)
        packer convert imgs.lmdb --to hdf5                  # a packer dataset into another format
        packer convert imgs.lmdb --to lmdb --classes cat,dog --split 0.9 -o pets   # -> pets-train, pets-val
        packer convert imgs.lmdb --to wds -o imgs-wds --shard-size 256MB   # WebDataset shards (a sink, not a format)
        """, description="Pack a source (a folder of images in ImageFolder layout root/<class>/<img> or flat, a "
        "list file, an archive, or a packer dataset) into one dataset directory. Every source record is either "
        "packed or listed with its reason and location in errors.json.")
    p.add_argument("source", help="a folder of images, a list file (.csv .tsv .txt .lst), an archive (.tar .tar.gz "
                   ".tgz .zip), a packer dataset, WebDataset shards ('shards-{000000..000099}.tar'), a Hugging Face "
                   "dataset (save_to_disk folder, .parquet) or an MXNet .rec; --source-type names the kind when "
                   "its name does not")
    p.add_argument("--to", dest="format", default="lmdb", choices=targets(), help="output format "
                   "(default lmdb); wds: WebDataset shards, bytes as stored (decoded pixels as lossless PNG)")
    p.add_argument("-o", "--output", help="output directory (default: <source>.<format> beside the source), or a "
                   "URL in a bucket (s3://, gs://, az://: shards uploaded as they are finished, the manifest last; "
                   "credentials and endpoint from the environment, AWS_* as usual, or --storage-option)")
    for option in [*keywords(), *own_options(FORMATS)]:  # declared once (write/options.py; a format's own in it)
        if option.flag is not None and option.generated:
            add_declared(p, option)
    _add_storage_option(p)  # storage_options (write/options.py): the one flag every command has for a URL
    p.add_argument("--scheduler", metavar="tcp://HOST:PORT|local:N",
                   help="convert on a Dask cluster (pip install -e '.[dask]' in packer's checkout): the address of "
                   "a running scheduler, or local:N to start N local worker processes. Workers scan the class folders "
                   "and write one shard per task; the source must be on storage they all share (or in a bucket), "
                   "and so must the output, unless it is in a bucket (-o s3://...: each task uploads its shard "
                   "from its worker, the driver the manifest last). Same bytes as a local conversion; --workers "
                   "is then ignored")
    p.add_argument("-q", "--quiet", action="store_true",
                   help="print errors only: no progress bar, no summary (the exit code still tells)")
    _add_json(p, "what was packed into each output and every record left out, with its reason")
    p.set_defaults(func=commands.cmd_convert)


def add_declared(p: argparse.ArgumentParser, option: Declared) -> None:
    """The flag of one declared option: its name, help text, type, choices and default from the declaration."""
    text = render(option.help, cli=True).replace("%", "%%")  # argparse formats help with %
    if option.switch:
        p.add_argument(f"--{option.flag}", dest=option.keyword, action="store_true", help=text)
        return
    typed: dict[str, Any] = {"type": option.parse} if option.parse is not None else {}  # None: the text as given
    p.add_argument(f"--{option.flag}", dest=option.keyword, metavar=option.metavar, choices=option.choices,
                   default=option.default, help=text, **typed)


def _add_info(sub) -> None:
    p = _parser(sub, "info", "describe a packed dataset", """
        packer info imgs.lmdb
        packer info imgs.lmdb --json | jq .num_samples
        packer info s3://bucket/imgs.lmdb          # credentials and endpoint from AWS_* as usual
        """)
    p.add_argument("dataset")
    _add_cache_dir(p)
    _add_storage_option(p)
    _add_json(p, "the manifest and the statistics of the per-sample metadata")
    p.set_defaults(func=commands.cmd_info)


def _add_cache_dir(p, text: str | None = None) -> None:
    p.add_argument("--cache-dir", metavar="DIR", help=text or "for a dataset in object storage (s3://, gs://, az://, "
                   "http(s)://): the node's cache, where its metadata is kept (default: $XDG_CACHE_HOME/packer or "
                   "~/.cache/packer)")


def _add_verify(sub) -> None:
    p = _parser(sub, "verify", "check a packed dataset (exit 1 on any problem)", """
        packer verify imgs.lmdb                    # files present, checksums, counts
        packer verify imgs.lmdb --against imgs/    # and every source file packed identically or reported
        packer verify imgs.lmdb --deep             # and decode every sample, shapes as recorded
        packer verify s3://bucket/imgs.lmdb        # every object's size and sha256, streamed (nothing kept)
        packer verify s3://bucket/imgs.lmdb --deep # and every sample decoded, through the node's cache
        """)
    p.add_argument("dataset")
    _add_cache_dir(p)
    _add_storage_option(p)
    p.add_argument("--deep", action="store_true",
                   help="also decode every sample (strictly) and check it against the stored shape")
    p.add_argument("--against", metavar="SRC", help="the source to compare with (read as the dataset's manifest "
                   "records it was read: its kind, a list file's --root and columns, --classes, its --split part)")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress bar")
    _add_json(p, "every problem found and what was checked")
    p.set_defaults(func=commands.cmd_verify)


def _add_extract(sub) -> None:
    p = _parser(sub, "extract", "write a packed dataset's images back as files", """
        packer extract imgs.lmdb restored/               # restored/<class>/<file>, byte-identical
        packer extract imgs.lmdb restored/ --overwrite   # replace files that exist already
        packer extract s3://bucket/imgs.lmdb restored/   # shards read through the node's cache (--cache-dir)
        """, description="Write every sample back under its original relative path inside DIR: the original "
        "bytes for encoded payloads; PNG (lossless pixels) for raw payloads, the extension changed to .png "
        "(a.jpg -> a.png), except where the source folder had two files of one name with different extensions "
        "(a.jpg and a.png): then a renamed one keeps its whole name plus .png (a.jpg.png; a.png stays a.png). "
        "Every target is checked before anything is written (exit 2 if refused): paths that would land outside "
        "DIR, names too long for the filesystem, a read-only or unwritable DIR, existing files unless "
        "--overwrite. A failure part-way (disk full) stops with exit 1, the files before it written.")
    p.add_argument("dataset")
    p.add_argument("dir", help="destination folder (created if missing)")
    p.add_argument("--overwrite", action="store_true", help="replace files that exist already")
    _add_cache_dir(p)
    _add_storage_option(p)
    p.add_argument("-q", "--quiet", action="store_true", help="no progress bar")
    _add_json(p, "where the files went, how many and how large")
    p.set_defaults(func=commands.cmd_extract)


def _add_sample(sub) -> None:
    from packer.tools.sample import MAX_COUNT, MAX_SIDE

    p = _parser(sub, "sample", "generate a folder of photo-like JPEGs to try packer on", """
        packer sample imgs/ --count 2000 --classes 10
        packer sample flat/ --count 100 --classes 0     # flat folder, no class folders
        """, description="Write an ImageFolder of synthetic photo-like JPEGs (about 500x375, about 100 KB at "
        "quality 90, like ImageNet), deterministic for a seed.")
    p.add_argument("output")
    p.add_argument("--count", type=int_in(1, MAX_COUNT), default=2000, help="images (default 2000)")
    p.add_argument("--classes", type=int_in(0, MAX_COUNT), default=10,
                   help="class folders (default 10; 0: a flat folder)")
    p.add_argument("--size", type=hw_arg(MAX_SIDE), default=(375, 500), metavar="HxW",
                   help=f"around which sizes vary by 10%% (default 375x500; sides 1 to {MAX_SIDE})")
    p.add_argument("--quality", type=int_in(1, 100), default=90, help="JPEG quality 1-100 (default 90)")
    p.add_argument("--seed", type=int_in(0), default=0)
    p.add_argument("-q", "--quiet", action="store_true", help="no progress bar")
    _add_json(p, "where the images went and how large they are")
    p.set_defaults(func=commands.cmd_sample)


def _add_profile(sub) -> None:
    p = _parser(sub, "profile", "find the num_workers that keeps a training step fed", """
        packer profile imgs.lmdb --workers 0,1,2 --batch-size 64 --step-ms 40
        packer profile imgs.lmdb --step-ms 40 --plot sweep.png --json sweep.json
        packer profile imgs.lmdb --batch-size 64,128 --pin-memory off,on --device cuda
        packer profile imgs.lmdb --cache ram-decoded     # what a RAM cache of decoded pixels would give
        packer profile imgs.lmdb --train-crop            # fused decode + RandomResizedCrop(224) + flip
        packer profile s3://bucket/imgs.lmdb             # through the node's cache (--cache-dir), as training reads
        """, description="Run a real DataLoader over the dataset (shuffled, as in training) for each "
        "num_workers / batch size / pin_memory setting while a simulated step sleeps --step-ms per batch, as "
        "a host waiting on its GPU does. Reports data wait vs step time, samples/s and the per-sample cost of "
        "read, decode, transform (a random crop) and collate inside the workers; picks the smallest "
        "num_workers whose wait stays under 10%% of the step, or says plainly that none does. "
        "Exit 1 when no setting keeps the step fed.")
    p.add_argument("dataset", help="a packed dataset (packer convert), a path or a URL")
    _add_cache_dir(p)
    _add_storage_option(p)
    p.add_argument("--workers", type=lambda t: t if t == "auto" else csv_of(int_in(0))(t), default="auto",
                   metavar="N,..",
                   help="num_workers values, e.g. 0,2,4 (default: 0, 1, 2, 4, ... up to the cores)")
    p.add_argument("--batch-size", type=csv_of(int_in(1)), default=(64,), metavar="B,..",
                   help="batch sizes, e.g. 64 or 64,128 (default 64)")
    p.add_argument("--pin-memory", default="off", help="off, on or off,on (on needs CUDA; default off)")
    p.add_argument("--step-ms", type=float_in(0.0, 60_000.0), default=40.0,
                   help="simulated step per batch of the first batch size, in ms (default 40); scaled for others")
    p.add_argument("--batches", type=int_in(2), default=30,
                   help="batches measured per setting, after warm-up (default 30)")
    p.add_argument("--crop", type=int_in(0), default=224,
                   help="random crop size so batches collate (default 224; 0: none, samples collated as lists)")
    p.add_argument("--train-crop", action="store_true",
                   help="the fused training pipeline instead: decode + RandomResizedCrop(--crop) + flip in one step")
    p.add_argument("--decoder", default="auto", help="JPEG decoder of the dataset (auto, turbojpeg, pil)")
    p.add_argument("--cache", choices=("ram", "ram-decoded"), default=None, help="profile through a shared RAM cache")
    p.add_argument("--device", default=None, help="copy each batch to this device, timed as host-to-device (e.g. cuda)")
    p.add_argument("--start-method", choices=("fork", "spawn", "forkserver"), default=None,
                   help="DataLoader worker start method (default: the platform's)")
    p.add_argument("--plot", metavar="PNG",
                   help="write a chart of wait and samples/s against num_workers (needs matplotlib)")
    p.add_argument("--json", metavar="FILE", help="write every figure as JSON ('-': stdout)")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress bars")
    p.set_defaults(func=commands.cmd_profile)


def _add_doctor(sub) -> None:
    p = _parser(sub, "doctor", "measure this machine (and the storage under PATH) and say where loading will wait", """
        packer doctor                  # the machine: cores, memory, decoders, GPU, /dev/shm, limits
        packer doctor imgs/            # and the storage under imgs/: device, filesystem, cold reads
        packer doctor imgs.lmdb --json
        packer doctor s3://bucket/imgs.lmdb   # the link: first-byte latency, bandwidth; link- or decode-bound
        """, description="Measure, briefly and within bounds, what limits data loading here: cores and load, "
        "memory and page cache, the storage under PATH (device, rotational or not, filesystem), cold "
        "small-file vs sequential read rate there, per-core decode rate of each decoder, GPU and pinned "
        "memory, libjpeg-turbo, /dev/shm and the open-files limit; then a verdict in plain words where each "
        "recommendation names the figure behind it.")
    p.add_argument("path", nargs="?",
                   help="a folder of images, a packed dataset or any directory on the storage to test; or a packed "
                   "dataset's URL (s3://, gs://, az://, http(s)://): the link and whether reading it is link-bound")
    _add_storage_option(p)
    p.add_argument("--seconds", type=float_in(0.0, 600.0, above=True), default=1.0,
                   help="time budget of each rate measurement (default 1 s)")
    p.add_argument("--json", action="store_true", help="print every figure and the verdict as JSON")
    p.set_defaults(func=commands.cmd_doctor)


def _add_bench(sub) -> None:
    about = "measure read throughput: loose folder vs packed datasets, against the machine's ceilings"
    p = _parser(sub, "bench", about, """
        packer bench imgs/ imgs.lmdb                          # every level, order and cache state
        packer bench imgs/ imgs.lmdb --cold --workers 0,2,4 --json bench.json --plot bench.png
        packer bench imgs/ imgs.lmdb --emulate hdd --levels read   # as on a 7200 rpm disk (root, Linux)
        packer bench imgs/ imgs.lmdb --read-iops 500 --read-bps 200MB --limit 500
        packer bench s3://bucket/imgs.lmdb --workers 2 --json b.json   # by URL: a cold cache per repeat
        packer bench imgs.lmdb --emulate s3        # served through an emulated store (20 ms, 1 Gbit/s), by URL
        packer bench --decoders imgs.lmdb --sizes full,224,112     # decoders: img/s and MP/s per core
        packer bench --decoders                               # ... on 200 generated photo-like JPEGs
        """, description="Time reading a loose folder (as ImageFolder reads it) and packed datasets of the same "
        "images at three levels (read: bytes only; decode: samples as training gets them; loader: through a "
        "DataLoader), in three orders (sequential, uniform shuffle, block = locality-preserving shuffle), with a cold "
        "(evicted, mincore-checked) and a warm page cache. Each figure is the median of --repeats passes with "
        "min-max, shown as samples/s, MB/s, speed-up over the folder and fraction of the machine's ceiling measured "
        "in the same run. --emulate throttles this run's reads with the kernel block-IO controller. "
        "--decoders [DATASET|FOLDER] instead measures images/s and megapixels/s per core of each available JPEG "
        "decoder, at full size and with decode-time downscaling (decode_size), on in-memory bytes in one process; "
        "on a packed dataset also open_dataset's decoding rate against bare libjpeg-turbo (packer's overhead).")
    p.add_argument("paths", nargs="*", metavar="PATH", help="loose image folders and packed datasets (same images)")
    p.add_argument("--decoders", action="store_true",
                   help="benchmark the JPEG decoders on one DATASET|FOLDER (default: generated samples)")
    p.add_argument("--sizes", type=csv_of(lambda t: None if t == "full" else int_in(1)(t)), default=(None, 224, 112),
                   metavar="S,..",
                   help="--decoders: decode sizes, 'full' or a short side S (decode_size=S) (default full,224,112)")
    p.add_argument("--backends", default=None, help="--decoders: comma-separated (default: all available)")
    p.add_argument("--seconds", type=float_in(0.0, 600.0, above=True), default=2.0,
                   help="--decoders: CPU seconds per measurement (default 2)")
    p.add_argument("--levels", type=csv_of(str), default=None, metavar="L,..",
                   help="any of read, decode, loader, thread (packer.ThreadLoader, --workers threads), train "
                   "(RandomResizedCrop(224) batches), thread-train (those through packer.ThreadLoader) "
                   "(default: read, decode, loader; on a URL: loader)")
    p.add_argument("--orders", type=csv_of(str), default=None, metavar="O,..",
                   help="any of sequential, shuffle, block (default all; on a URL: block)")
    cache = p.add_mutually_exclusive_group()
    cache.add_argument("--cold", action="store_true", help="cold page cache only")
    cache.add_argument("--warm", action="store_true", help="warm page cache only")
    p.add_argument("--workers", type=csv_of(int_in(0)), default=None, metavar="N,..",
                   help="DataLoader num_workers values for the loader level (default: the usable cores, at most 8)")
    p.add_argument("--batch-size", type=int_in(1), default=64,
                   help="loader batch size, also the read level's batch (default 64)")
    p.add_argument("--pin-memory", action="store_true", help="DataLoader pin_memory=True")
    p.add_argument("--repeats", type=int_in(1), default=3, help="timed passes per measurement (default 3)")
    p.add_argument("--limit", type=int_in(1), default=None, metavar="N", help="only the first N samples of each "
                   "dataset, in its stored order (packed datasets are usually stored shuffled)")
    p.add_argument("--seed", type=int_in(0), default=0, help="seed of the shuffled orders")
    p.add_argument("--block-size", type=size_arg, default=None, metavar="SIZE",
                   help="block order: payload bytes per block (default: packer.read.sampler's, 16MB)")
    p.add_argument("--open-blocks", type=int_in(1), default=None, metavar="N",
                   help="block order: blocks shuffled together in a window (default: the sampler's, 8)")
    p.add_argument("--run", type=int_in(1), default=None, metavar="N",
                   help="block order: neighbours read together (default: the sampler's, 16)")
    p.add_argument("--ceiling-size", type=size_arg, default=None, metavar="SIZE",
                   help="size of the scratch file for the sequential-read ceiling (default: the largest dataset's "
                        "size on disk, from 32MiB to 256MiB)")
    _add_throttle(p)
    _add_remote_bench(p)
    p.add_argument("--json", metavar="FILE", help="write every figure and the machine/setup as JSON ('-': stdout)")
    p.add_argument("--plot", metavar="PNG", help="write a chart (needs matplotlib: pip install matplotlib)")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress lines on stderr")
    p.set_defaults(func=commands.cmd_bench)


def _add_remote_bench(p: argparse.ArgumentParser) -> None:
    """``packer bench`` on a URL: what reaches the store, the node's cache, and the emulated link's settings."""
    p.add_argument("--latency", type=float_in(0.0, 60.0), default=None, metavar="SECONDS",
                   help="emulated object store: seconds before each response's first byte (default: the preset's; "
                   "without --emulate: serve through the emulated store with this latency)")
    p.add_argument("--bandwidth", type=size_arg, default=None, metavar="B",
                   help="emulated object store: bytes/s of the whole link, e.g. 125MB (1 Gbit/s)")
    _add_storage_option(p)
    _add_cache_dir(p, "for a URL: the node's cache (default: a new temporary folder per repeat, a cold cache)")
    p.add_argument("--cache-limit", default="20GB", metavar="SIZE",
                   help="for a URL: the disk the node's cache may use (default 20GB)")
    p.add_argument("--remote-mode", choices=("auto", "ranged", "shard"), default="auto",
                   help="for a URL: open_dataset's remote_mode (auto: ranged reads where the dataset records ranges, "
                   "as training reads it; shard: whole shards)")


def _add_storage_option(p: argparse.ArgumentParser) -> None:
    p.add_argument("--storage-option", action="append", default=[], metavar="KEY=VALUE",
                   help="for a URL: the object store's configuration (endpoint=..., region=...; repeatable; "
                   "credentials are best left to the environment)")


def _add_throttle(p: argparse.ArgumentParser) -> None:
    """``packer bench``'s emulated storage: a preset device or explicit read limits."""
    from packer.diagnose.link import LINK_PRESETS
    from packer.diagnose.throttle import PRESETS

    devices = "; ".join(f"{k} = {v.read_iops} IOPS, {v.read_bps // 10**6} MB/s" for k, v in sorted(PRESETS.items()))
    links = "; ".join(f"{k} = an object store, {v.latency * 1e3:g} ms to the first byte, {v.bandwidth * 8 / 1e9:g} "
                      f"Gbit/s" for k, v in sorted(LINK_PRESETS.items()))
    p.add_argument("--emulate", choices=sorted(PRESETS) + sorted(LINK_PRESETS),
                   help=f"throttle reads like this device: {devices}; or serve the packed datasets through {links} "
                   "(in its own process) and bench them by URL")
    p.add_argument("--read-iops", type=int_in(1), default=None, metavar="N", help="throttle: read IOs per second")
    p.add_argument("--read-bps", type=size_arg, default=None, metavar="B",
                   help="throttle: read bytes per second, e.g. 150MB")
