"""benchmarks/boundary.py: the chained link kernel computes what its docstring says (under the
interpreter), and the script refuses to run without a GPU instead of timing nothing."""
import pytest
import torch

from tests.helpers import benchmarks


def test_a_link_reads_the_whole_row_and_writes_its_slice_of_the_next():
    """Program ``p`` sums the predecessor's row and stores ``OUT`` values at ``y[p * OUT:]``, masked
    at ``N``: three links of 4 programs over a 50-value row, checked against the same arithmetic in torch
    (within two bfloat16 steps: the interpreter's cast to bfloat16 truncates)."""
    bound = benchmarks.load("boundary")
    n, programs, out = 50, 4, 16
    x = torch.arange(n, dtype=torch.float32).to(torch.bfloat16)
    rows = [x.clone(), torch.zeros(n, dtype=torch.bfloat16)]
    want = x.clone()
    for i in range(3):
        bound._link[(programs,)](rows[i % 2], rows[1 - i % 2], n, OUT=out, ROW=64, READ=True, USE_PDL=False,
                                 EARLY=False)
        total = want.float().sum()
        want = (total * 1e-3 + torch.arange(n) % out).to(torch.bfloat16)
        torch.testing.assert_close(rows[1 - i % 2].float(), want.float(), rtol=2 ** -6, atol=0)


def test_without_a_gpu_it_exits_2(capsys, monkeypatch):
    bound = benchmarks.load("boundary")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert bound.main(["--links", "4"]) == 2
    assert "needs a CUDA GPU" in capsys.readouterr().err


def test_bad_arguments_are_named(capsys):
    bound = benchmarks.load("boundary")
    for argv, want in ((["--links", "1"], "--links: expected an integer >= 2, got '1'"),
                       (["--sizes", "2048,x"], "--sizes: expected an integer >= 16, got 'x'")):
        with pytest.raises(SystemExit) as e:
            bound.main(argv)
        assert e.value.code == 2
        assert want in capsys.readouterr().err
