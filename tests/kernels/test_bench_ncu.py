"""benchmarks/ncu_gemv.py: the parsing of ``ncu --page raw --csv`` output and the table row, the case
argument, and the refusal to run without a GPU (ncu itself runs only on the device)."""
import argparse

import pytest
import torch

from tests.helpers import benchmarks


def _csv(ncu, values: dict, time_unit="usecond", bytes_unit="Mbyte") -> str:
    names = ["ID", "Process ID", "Kernel Name"] + list(values)
    units = ["", "", ""] + [time_unit if n == "gpu__time_duration.sum" else bytes_unit if n == "dram__bytes_read.sum"
                            else "" for n in values]
    vals = ["0", "745", "_gemv_kernel"] + [str(v) for v in values.values()]
    q = lambda xs: ",".join(f'"{x}"' for x in xs)   # noqa: E731
    return "==PROF== Connected to process 745\ndone\n" + "\n".join(q(r) for r in (names, units, vals)) + "\n"


def _metrics(ncu, **over):
    m = {name: 0.0 for name in ncu.METRICS}
    m.update({"gpu__time_duration.sum": 15.0, "dram__bytes_read.sum": 30.0, "launch__grid_size": 256,
              "launch__registers_per_thread": 168, "dram__throughput.avg.pct_of_peak_sustained_elapsed": 42.0,
              "smsp__issue_active.avg.pct_of_peak_sustained_active": 31.0,
              "smsp__warps_active.avg.per_cycle_active": 1.9,
              ncu._STALL.format("long_scoreboard"): 2.3, ncu._STALL.format("barrier"): 0.84,
              ncu._STALL.format("wait"): 0.05})
    m.update(over)
    return m


def test_parse_reads_the_profiled_kernel_and_converts_units():
    ncu = benchmarks.load("ncu_gemv")
    got = ncu.parse(_csv(ncu, _metrics(ncu, **{"gpu__time_duration.sum": "15,260"}), time_unit="nsecond"))
    assert got["gpu__time_duration.sum"] == pytest.approx(15.26)
    assert got["dram__bytes_read.sum"] == pytest.approx(30e6)
    assert got["launch__grid_size"] == 256


def test_the_row_shows_bandwidth_and_the_stalls_that_matter():
    ncu = benchmarks.load("ncu_gemv")
    line = ncu.row("int4 8b.down", ncu.parse(_csv(ncu, _metrics(ncu))))
    # 30 MB in 15 µs = 2000 GB/s; stalls under 0.1 cycles (wait 0.05) are left out
    assert line == ("| int4 8b.down | 256 x 168 regs | 15.00 | 2000 (42%) | 31% | 1.90 | "
                    "long_scoreboard 2.30, barrier 0.84 |")


def test_parse_names_what_is_missing():
    ncu = benchmarks.load("ncu_gemv")
    m = _metrics(ncu)
    del m["launch__grid_size"]
    with pytest.raises(ValueError, match=r"lacks the metrics \['launch__grid_size'\]"):
        ncu.parse(_csv(ncu, m))
    with pytest.raises(ValueError, match="no profiled kernel"):
        ncu.parse("==PROF== ERR_NVGPUCTRPERM - no access to the performance counters\n")
    with pytest.raises(ValueError, match="in 'cycle'"):
        ncu.parse(_csv(ncu, _metrics(ncu), time_unit="cycle"))
    with pytest.raises(ValueError, match="dram__bytes_read.sum in 'sector'"):
        ncu.parse(_csv(ncu, _metrics(ncu), bytes_unit="sector"))


def test_cases_are_checked_and_named():
    ncu = benchmarks.load("ncu_gemv")
    assert ncu.case("fp8:1b.o") == ("fp8", "1b.o")
    assert ncu.case("q6_k:8b.down") == ("q6_k", "8b.down")          # GGUF blocks on the tensor cores
    assert ncu.KERNELS["q4_k"] == "_q4k_kernel" and "int4" not in ncu.KERNELS
    with pytest.raises(argparse.ArgumentTypeError, match="got 'int3:8b.down'"):
        ncu.case("int3:8b.down")
    with pytest.raises(argparse.ArgumentTypeError, match="got 'int4:8b.up'"):
        ncu.case("int4:8b.up")


def test_without_a_gpu_it_exits_2(capsys, monkeypatch):
    ncu = benchmarks.load("ncu_gemv")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert ncu.main(["--cases", "int4:8b.down"]) == 2
    assert "needs a CUDA GPU" in capsys.readouterr().err
