"""packer bench's chart and one-line takeaway: computed from the run's figures, labels that never overlap."""

from __future__ import annotations

import pytest

from packer.diagnose.reports import bench_table, emulation_note, markdown_table, takeaway


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
