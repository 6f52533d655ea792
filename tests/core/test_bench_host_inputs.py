"""benchmarks/host_inputs.py: its two ways of sending block tables are built from the same tables
(the check it makes on the GPU, here on the CPU through ``to_device``), and bad arguments are refused
by name."""
import sys

import pytest
import torch

from tests.helpers.benchmarks import ROOT, load


@pytest.fixture(scope="module")
def bench():
    sys.path.insert(0, str(ROOT))
    try:
        return load("host_inputs")
    finally:
        sys.path.remove(str(ROOT))


def test_the_tables_as_arrays_are_the_tables_as_lists(bench):
    import random

    from graphdsl.runtime.serving.scheduler import padded_rows, to_device
    for name, tables, fields in bench._steps(random.Random(1)):
        flat = [b for t in tables for b in list(t) + [0] * (bench.WIDTH - len(t))]
        a = to_device("cpu", {"block_tables": (flat, torch.int32)})["block_tables"]
        b = to_device("cpu", {"block_tables": (padded_rows(tables, bench.WIDTH), torch.int32)})["block_tables"]
        assert torch.equal(a, b), name
        assert all(len(v) for v, _ in fields.values())


def test_bad_calls_are_refused_by_name(bench, capsys):
    with pytest.raises(SystemExit):
        bench.main(["--calls", "3"])
    assert "--calls must be at least 10, got 3" in capsys.readouterr().err
