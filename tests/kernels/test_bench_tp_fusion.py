"""benchmarks/tp_fusion.py: the producer GEMV pushes its partial tiles into every rank's buffer and
counts them there; the consumer waits for every rank's tiles, sums them in rank order, adds the
residual, normalises and runs its GEMV. Two ranks run one after another under the interpreter
(producers first, so no wait spins), over three calls (both slots), against a float32 reference
with the one-shot kernel's roundings."""
import pytest
import torch

from tests.helpers import benchmarks

H, K, N = 64, 48, 40


def _reference(xs, os_, res, nw, gu, eps=1e-5):
    parts = [(o.float() @ x.float()).to(torch.bfloat16) for o, x in zip(os_, xs)]
    y = sum(p.float() for p in parts).to(torch.bfloat16)
    s = (y.float() + res.float()).to(torch.bfloat16)
    sf = s.float()
    normed = (sf * torch.rsqrt((sf * sf).mean() + eps)).to(torch.bfloat16)
    normed = (nw.float() * normed.float()).to(torch.bfloat16)
    return s, [(g.float() @ normed.float()).to(torch.bfloat16) for g in gu]


def test_push_then_sum_norm_gemv_over_two_ranks_and_three_calls():
    mod = benchmarks.load("tp_fusion")
    torch.manual_seed(0)
    bf = dict(dtype=torch.bfloat16)
    sites = mod.local_sites(2, H, torch.bfloat16, "cpu")
    os_ = [torch.randn(H, K).mul(0.1).to(**bf) for _ in range(2)]
    gu = [torch.randn(N, H).mul(0.1).to(**bf) for _ in range(2)]
    nw = torch.rand(H).add(0.5).to(**bf)
    res = torch.randn(H).to(**bf)
    for call in range(1, 4):
        xs = [torch.randn(K).to(**bf) for _ in range(2)]
        new_res = [torch.empty(H, **bf) for _ in range(2)]
        outs = [torch.empty(N, **bf) for _ in range(2)]
        for r in range(2):
            mod.push_gemv(xs[r], os_[r], sites[r])
        for r in range(2):
            mod.norm_gemv(sites[r], res, new_res[r], nw, gu[r], outs[r], torch.empty(H, **bf))
        s, want = _reference(xs, os_, res, nw, gu)
        torch.testing.assert_close(new_res[0], new_res[1], rtol=0, atol=0)    # one sum order on every rank
        for r in range(2):
            torch.testing.assert_close(new_res[r], s, rtol=2e-2, atol=3e-2)   # partials rounded alike but for ties
            torch.testing.assert_close(outs[r], want[r], rtol=2e-2, atol=3e-2)
        tiles = -(-H // mod.BLOCK_N)
        for r in range(2):
            assert sites[r].keep[1][r].item() == call * tiles * 2        # every rank's tiles, every call
            assert sites[r].produced[:tiles].tolist() == [call] * tiles
            assert sites[r].consumed[:-(-N // mod.BLOCK_N)].tolist() == [call] * -(-N // mod.BLOCK_N)
        res = new_res[0]


def test_without_a_gpu_it_exits_2(capsys, monkeypatch):
    benchmarks.exits_without_gpu("tp_fusion", ["--layers", "2"], capsys, monkeypatch)


@pytest.mark.parametrize("argv", [["--world", "1"], ["--layers", "0"]])
def test_bad_sizes_are_refused(argv, capsys):
    err = benchmarks.refusal("tp_fusion", argv, capsys)
    assert "--world must be at least 2 and --layers at least 1, got" in err


def test_with_too_few_gpus_it_exits_2(capsys, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert benchmarks.load("tp_fusion").main(["--world", "2"]) == 2
    assert "tp_fusion.py needs 2 CUDA GPUs, found 1" in capsys.readouterr().err
