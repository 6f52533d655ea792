"""benchmarks/cold_start.py: its table and digest check, and its refusals (the runs need a GPU)."""
from tests.helpers import benchmarks


def _res(decode, prefill, digest, ahead=()):
    return {"decode_build": 0.5, "decode_first_step": decode, "prefill_build": 0.25, "prefill_first_step": prefill,
            "decode_digest": digest, "triton_new": 32, "ahead": list(ahead)}


def test_the_table_sums_each_engine_and_flags_differing_logits():
    cold = benchmarks.load("cold_start")
    rows = [("one by one", "cold", _res(8.0, 4.5, "aa")),
            ("ahead", "cold", _res(4.0, 2.0, "aa", ["decode: 8 kernels to compile"]))]
    text, same = cold.table("llama-3-8b", rows)
    assert same
    assert "| one by one | cold | 8.50 | 4.75 | 13.25 | 32 | aa |" in text
    assert "| ahead | cold | 4.50 | 2.25 | 6.75 | 32 | aa |" in text
    assert "- ahead, cold: decode: 8 kernels to compile" in text
    assert text.endswith("decode logits identical across runs: yes")
    text, same = cold.table("llama-3-8b", rows + [("ahead", "warm", _res(1.0, 0.3, "bb"))])
    assert not same and text.endswith("decode logits identical across runs: NO")


def test_without_a_gpu_it_exits_2(capsys, monkeypatch):
    benchmarks.exits_without_gpu("cold_start", ["--rounds", "1"], capsys, monkeypatch)


def test_bad_arguments_are_named(capsys):
    assert "--workers: expected an integer >= 2, got '1'" in benchmarks.refusal("cold_start", ["--workers", "1"],
                                                                               capsys)
    assert "--rounds: expected an integer >= 1, got 'x'" in benchmarks.refusal("cold_start", ["--rounds", "x"], capsys)
