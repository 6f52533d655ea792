"""benchmarks/host_experts.py prints its table on the CPU (the kernels it times are the ones
CPUExperts runs), and benchmarks/moe.py says it needs a GPU on a machine without one."""
import re

from tests.helpers import benchmarks


def test_host_experts_prints_a_row_per_stack(capsys):
    bench = benchmarks.load("host_experts")
    bench.SHAPES["tiny"] = (128, 64)
    assert bench.main(["--shape", "tiny", "--rows", "1", "2"]) == 0
    rows = [line for line in capsys.readouterr().out.splitlines() if re.match(r"\| \d+ \|", line)]
    assert [r.split("|")[2].strip() for r in rows] == ["bf16", "int8-channel", "int4-g128"] * 2
    mb = [float(r.split("|")[3]) for r in rows[:3]]
    assert mb[0] > mb[1] > mb[2] > 0                 # codes: a half and about a quarter of bf16's bytes


def test_moe_benchmark_needs_a_gpu(capsys, monkeypatch):
    benchmarks.exits_without_gpu("moe", ["--schemes", "int4-g128"], capsys, monkeypatch)
