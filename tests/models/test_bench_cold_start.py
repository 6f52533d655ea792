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


def _warm(warmup, digest, rounds=0, compiled=0, failed=0):
    return {"load": 2.0, "warmup": warmup, "stages": [["prefill of 64 tokens", 1.5], ["decode batch 1", warmup - 1.5]],
            "triton_new": 40, "rounds": rounds, "ahead_compiled": compiled, "ahead_seconds": 3.25,
            "ahead_failed": failed, "reserved_gib": 4.5, "digest": digest}


def test_the_warmup_table_names_the_slowest_stage_and_flags_differing_tokens():
    cold = benchmarks.load("cold_start")
    rows = [("one by one", "cold", _warm(30.0, "t1")), ("ahead", "cold", _warm(12.0, "t1", 20, 35, 1))]
    text, same = cold.warmup_table("llama-3.2-1b", 32, rows)
    assert same and "max_num_seqs 32" in text
    assert "| one by one | cold | 2.0 | 30.0 | decode batch 1 28.5 | 40 | 0 | 0 (3.2) | 4.50 | t1 |" in text
    assert "| ahead | cold | 2.0 | 12.0 | decode batch 1 10.5 | 40 | 20 | 35 (3.2), 1 left to the step | 4.50 | t1 |" \
        in text
    text, same = cold.warmup_table("llama-3.2-1b", 32, rows + [("ahead", "warm", _warm(3.0, "t2"))])
    assert not same and text.endswith("generated tokens identical across runs: NO")
