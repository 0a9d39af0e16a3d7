"""packer bench's chart and one-line takeaway: computed from the run's figures, labels that never overlap."""

from __future__ import annotations

import pytest

from packer.diagnose.reports import (
    bench_table,
    ceiling_note,
    decoder_note,
    emulation_note,
    markdown_table,
    takeaway,
)


def _row(name, level, cache, rate, speedup, ceiling, repeats=(None,)):
    lo, hi = (rate, rate) if repeats == (None,) else (rate * repeats[0], rate * repeats[1])
    return {"dataset": f"d/{name}", "name": name, "level": level, "order": "shuffle", "cache": cache,
            "workers": None, "samples_per_s": {"median": rate, "min": lo, "max": hi},
            "mb_per_s": {"median": rate / 10, "min": lo / 10, "max": hi / 10}, "eviction": None,
            "ceiling": {"name": "c", "samples_per_s": ceiling}, "fraction_of_ceiling": rate / ceiling,
            "speedup_vs_folder": speedup}


def _report(folder_cold_read: float, repeats=(None,)) -> dict:
    datasets = [("imgs", "folder", "encoded"), ("imgs.lmdb", "lmdb", "encoded"), ("imgs.memmap", "memmap", "encoded"),
                ("imgs.bmp", "bmp", "raw")]
    results = [
        _row("imgs", "read", "cold", folder_cold_read, 1.0, 20000),
        _row("imgs", "decode", "cold", 600, 1.0, 900, repeats),
        _row("imgs.lmdb", "decode", "cold", 660, 1.1, 1100, repeats),
        _row("imgs.memmap", "decode", "cold", 540, 0.9, 1100, repeats),
        _row("imgs.bmp", "decode", "cold", 4200, 7.0, 80000, repeats),
    ]
    ceilings = {"sequential_read": {"x": {"value": 2000.0}}, "memory_copy": {"value": 20000.0},
                "decode": {"auto": {"value": 1100.0}}}
    return {"results": results, "datasets": [{"path": f"d/{n}", "kind": k, "payload": p, "samples": 10}
                                             for n, k, p in datasets],
            "machine": {"cpu": "cpu", "cores_usable": 2, "os": "linux"}, "storage": {}, "emulation": None,
            "ceilings": ceilings, "options": {"repeats": 1}}


def test_loader_rows_show_their_steady_rate_and_its_fraction_of_the_ceiling():
    """The goals are stated in steady state: loader levels print the rate after the first batch beside the
    whole-pass one (terminal and Markdown); other levels leave the cell empty."""
    report = _report(5000)
    loader = _row("imgs.lmdb", "thread", "cold", 1200, None, 1500)
    loader.update(steady_samples_per_s={"median": 1410.0, "min": 1400.0, "max": 1420.0},
                  steady_fraction_of_ceiling=1410 / 1500)
    report["results"].append(loader)
    table = bench_table(report).splitlines()
    head = next(line for line in table if line.startswith("dataset"))
    row = next(line for line in table if " thread " in line)
    assert "steady" in head and "1,410 94%" in row and "80%" in row
    decode = [line for line in table if line.startswith("imgs") and " decode " in line]
    assert decode and all(line.endswith("%" + " " * 15 + "c") for line in decode)  # no steady cell
    md = markdown_table(report).splitlines()
    assert "| steady (of ceiling) |" in md[0] and "| 1,410 94% |" in md[-1] and "|  |" in md[2]


def test_takeaway_is_computed_from_the_figures():
    fast = takeaway(_report(folder_cold_read=5000))
    assert fast.startswith("decode-bound here") and "packed encoded images 0.9-1.1x" in fast
    assert "stored pixels 7.0x" in fast
    slow = takeaway(_report(folder_cold_read=150))  # the folder reads slower than its cores decode
    assert slow.startswith("IO-bound here") and "reads 150+ samples/s cold" in slow
    assert bench_table(_report(5000)).splitlines()[-1] == f"in short: {fast}"


def test_takeaway_of_a_run_without_the_folder_gives_the_fraction_of_the_ceiling():
    """``--levels thread`` on packed datasets only: no folder to compare with, so how near the ceiling they come."""
    report = _report(5000)
    report["results"] = [_row("imgs.lmdb", "thread", "warm", 1900, None, 2000),
                         _row("imgs.memmap", "thread", "warm", 1800, None, 2000)]
    assert takeaway(report) == "thread level: 90-95 % of the ceiling (c)"
    report["results"] = report["results"][:1]
    assert takeaway(report) == "thread level: 95 % of the ceiling (c)"
    report["results"] = []
    assert takeaway(report) == "no measurements"


def test_short_emulated_cold_passes_get_a_note_on_the_throttle_slice():
    """The kernel's throttle meters in 100 ms slices: under emulation, cold passes of a second move by ~10 % from
    repeat to repeat, and the table says so (and by how much, from the shortest pass); long passes, warm ones and
    runs without emulation get no note."""
    report = _report(5000)
    for row, secs in zip(report["results"], ([1.0, 1.1, 0.9], [1.3], [4.0], [4.2], [0.5]), strict=True):
        row["seconds"] = secs
    report["results"][-1]["cache"] = "warm"  # a warm pass of 0.5 s: the throttle reads nothing there
    assert emulation_note(report) is None and not bench_table(report).splitlines()[-2].startswith("note:")
    report["emulation"] = {"description": "hdd", "read_iops": 150, "read_bps": 150e6, "devices": ["254:0 (vda)"]}
    note = emulation_note(report)
    assert note is not None and "100 ms slices" in note and "a cold pass of 1.0-1.3 s" in note
    assert "off by up to 10 % either way" in note
    assert bench_table(report).splitlines()[-2] == f"note: {note}"
    report["results"][0]["seconds"] = [0.04, 0.0, 0.05]  # shorter than a slice (0 s: a hand-edited report)
    note = emulation_note(report)
    assert note is not None and "cold passes here last 40 ms and more" in note and "%" not in note
    for row in report["results"]:
        row["seconds"] = [2.5]  # 25 slices: a slice is 4 %
    assert emulation_note(report) is None


@pytest.mark.parametrize("repeats", [(None,), (0.9, 1.1)])
def test_chart_caption_factors_and_error_bars(tmp_path, repeats):
    pytest.importorskip("matplotlib")
    import matplotlib.pyplot as plt

    from packer.diagnose import plots

    saved = []
    real_close = plt.close

    def keep(fig):  # look at the figure plot_bench made before it is closed
        saved.append(fig)

    plt.close = keep
    try:
        plots.plot_bench(_report(5000, repeats), tmp_path / "b.png")
    finally:
        plt.close = real_close
    fig = saved[0]
    assert takeaway(_report(5000, repeats)) in fig._suptitle.get_text().replace("\n", " ")
    ax = fig.axes[1]  # decode panel
    texts = [t.get_text() for t in ax.texts]
    assert texts == ["600", "660  1.1x", "540  0.9x", "4,200  7.0x"]  # the folder's own bar has no factor
    errorbars = [c for c in ax.containers if type(c).__name__ == "ErrorbarContainer"]
    assert len(errorbars) == (0 if repeats == (None,) else 4)  # a range only where there were several repeats
    # lmdb and memmap share one ceiling: one line across both bars, not one per bar
    in_errorbars = {id(part) for c in errorbars for part in c.lines[2]}
    segments = [seg for coll in ax.collections if id(coll) not in in_errorbars for seg in coll.get_segments()]
    assert sorted(round(s[0][1]) for s in segments) == [900, 1100, 80000]
    fig.canvas.draw()
    boxes = [t.get_window_extent() for t in ax.texts]
    assert not any(a.overlaps(b) for i, a in enumerate(boxes) for b in boxes[i + 1:])
    real_close(fig)


def _columns(head: str) -> dict[str, tuple[int, int]]:
    """Each header word's (start, end) in the table's header line."""
    return {word: (head.index(word), head.index(word) + len(word))
            for word in ("dataset", "level", "order", "cache", "samples/s", "MB/s", "x folder", "of ceiling")}


def test_every_level_and_name_lines_up_with_the_header():
    """``thread-train`` (12 letters) and names longer than 16 once pushed their rows' cells to the right."""
    report = _report(5000)
    for level in ("thread", "thread-train", "train"):
        report["results"].append(_row("safetensors-raw-224x224", level, "warm", 1234, 2.0, 1500))
    table = bench_table(report).splitlines()
    head = next(line for line in table if line.startswith("dataset"))
    cols = _columns(head)
    rows = [line for line in table if line.startswith(("imgs", "safetensors"))]
    assert {line.split()[1] for line in rows} >= {"read", "decode", "thread", "thread-train", "train"}
    for line in rows:
        name, level, order, cache = line.split()[:4]
        for word, value in (("dataset", name), ("level", level), ("order", order), ("cache", cache)):
            start = cols[word][0]
            assert line[start:start + len(value)] == value, (word, line)  # left-aligned under its header
        rate, mbs = line.split()[4], line.split()[6]
        for word, value in (("samples/s", rate), ("MB/s", mbs)):
            end = cols[word][1]
            assert line[end - len(value):end] == value, (word, line)  # right-aligned under its header


def _with_decoders(report: dict, turbo: str = "loaded") -> dict:
    for d in report["datasets"]:
        d["decoder"] = "pil" if d["kind"] == "folder" else "auto"
    report["machine"]["versions"] = {"libturbojpeg": turbo}
    report["ceilings"]["decode"] = {"auto": {"value": 1100.0}, "pil": {"value": 900.0}}
    return report


def test_x_folder_says_when_it_compares_decoders_too():
    """The folder decodes with Pillow as ImageFolder does, packed datasets with libjpeg-turbo: the gain is container
    + decoder, and the table says so with the decoders' own ratio from the run's ceilings."""
    report = _with_decoders(_report(5000))
    note = decoder_note(report)
    assert note is not None and "the folder decodes with Pillow" in note and "libjpeg-turbo" in note
    assert "1.22x Pillow's rate per core" in note
    assert f"note: {note}" in bench_table(report).splitlines()
    assert "packed encoded images 0.9-1.1x the folder (container + decoder)" in takeaway(report)
    assert takeaway(report).count("container + decoder") == 1  # stored pixels are not decoded
    same = _with_decoders(_report(5000), turbo="missing")  # auto falls back to Pillow: the same decoder
    assert decoder_note(same) is None and "container + decoder" not in takeaway(same)
    reads = _with_decoders(_report(5000))
    reads["results"] = [r for r in reads["results"] if r["level"] == "read"]
    assert decoder_note(reads) is None  # reading bytes decodes nothing


def test_a_rate_above_its_ceiling_is_marked_and_explained():
    report = _report(5000)
    report["results"].append(_row("imgs.memmap", "read", "warm", 23800, 1.3, 20000))
    report["results"][-1]["ceiling"]["name"] = "memory copy"
    table = bench_table(report).splitlines()
    assert any(line.startswith("imgs.memmap") and " 119%* " in line for line in table)
    assert not any("%*" in line for line in table if line.startswith("imgs.lmdb"))
    note = ceiling_note(report)
    assert note is not None and f"note: {note}" in table
    assert "memory copy: one 128 MiB copy through main memory" in note and "decode:" not in note
    assert ceiling_note(_report(5000)) is None  # nothing above 100 %: no note


def _cpu(report: dict, name: str, level: str, on_cpu: float, waiting: float) -> None:
    row = next(r for r in report["results"] if r["name"] == name and r["level"] == level)
    row["seconds"] = [1.0, 1.0]
    row["thread_cpu_seconds"] = [{"on_cpu": on_cpu, "waiting_for_cpu": waiting}] * 2


def test_under_load_the_summary_says_the_cpu_not_the_disk_was_the_limit():
    """The folder's cold reads (150 files/s) are slower than its cores decode: IO-bound, unless those reads were on
    a CPU or waiting for one most of the time (other load on the machine); the busy machine is said either way."""
    loaded = _report(folder_cold_read=150)
    _cpu(loaded, "imgs", "read", on_cpu=0.2, waiting=0.6)
    said = takeaway(loaded)
    assert said.startswith("CPU-bound here, not IO-bound") and "80% of the time, held up by the disk 20%" in said
    assert said.endswith("the machine was busy (the read and decode passes waited for a CPU 60% of their time): every "
                         "rate is lower than on a quiet machine")
    disk = _report(folder_cold_read=150)
    _cpu(disk, "imgs", "read", on_cpu=0.05, waiting=0.05)  # blocked 90 % of the time: on the disk
    assert takeaway(disk).startswith("IO-bound here") and "busy" not in takeaway(disk)
    unknown = _report(folder_cold_read=150)  # no scheduler figures: the load at the start, as packer doctor says it
    unknown["machine"]["load_average"] = [3.5, 2.0, 1.0]
    assert takeaway(unknown).startswith("IO-bound here")
    assert takeaway(unknown).endswith("the machine was busy (load 3.5 on 2 cores at the start): every rate is lower "
                                      "than on a quiet machine")
    quiet = _report(folder_cold_read=5000)
    quiet["machine"]["load_average"] = [3.5, 2.0, 1.0]  # the conversions just before, say: the passes waited little
    _cpu(quiet, "imgs", "decode", on_cpu=0.95, waiting=0.02)
    assert takeaway(quiet).startswith("decode-bound here") and "busy" not in takeaway(quiet)
