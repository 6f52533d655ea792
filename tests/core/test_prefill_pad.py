"""runtime/serving/prefill_pad.py: the buckets and the padded tensors."""
import torch

from graphdsl.runtime.serving.prefill_pad import STANDARD_INPUTS, WIDTH_FLOOR, pad_prefill, token_bucket


def test_token_buckets_pad_at_most_an_eighth():
    assert [token_bucket(n) for n in (1, 16, 17, 31, 32, 33, 100, 511, 512, 513, 8191)] == \
        [16, 16, 18, 32, 32, 36, 104, 512, 512, 576, 8192]
    for n in range(17, 5000):
        b = token_bucket(n)
        assert n <= b <= n + n // 8 + 1
    assert len({token_bucket(n) for n in range(1, 8193)}) <= 1 + 8 * 9


def test_pad_prefill_values():
    i64, i32 = torch.int64, torch.int32
    inputs = {"input_ids": torch.tensor([5, 6, 7, 8, 9], dtype=i64), "positions": torch.tensor([0, 1, 2, 7, 8]),
              "slot_mapping": torch.tensor([10, 11, 12, 40, 41]), "seq_lens": torch.tensor([3, 9], dtype=i32),
              "block_tables": torch.tensor([[1, 0, 0], [4, 5, 6]], dtype=i32),
              "query_start_loc": torch.tensor([0, 3, 5], dtype=i32), "lm_head_indices": torch.tensor([2, 4, 4])}
    assert set(inputs) == STANDARD_INPUTS
    out, heads = pad_prefill(inputs, max_width=8)
    assert heads == 3
    assert out["input_ids"].tolist() == [5, 6, 7, 8, 9] + [0] * 11
    assert out["positions"].tolist() == [0, 1, 2, 7, 8] + [0] * 11
    assert out["slot_mapping"].tolist() == [10, 11, 12, 40, 41] + [-1] * 11      # no cache writes
    assert out["seq_lens"].tolist() == [3, 9] and out["query_start_loc"].tolist() == [0, 3, 5]
    assert out["block_tables"].tolist() == [[1] + [0] * 7, [4, 5, 6] + [0] * 5]    # the model's width (8)
    assert out["block_tables"].dtype == i32
    assert out["lm_head_indices"].tolist() == [2, 4, 4, 0]
    three = {**inputs, "seq_lens": torch.tensor([3, 1, 1], dtype=i32), "query_start_loc": torch.tensor([0, 3, 4, 5], dtype=i32),
             "block_tables": torch.tensor([[1], [2], [3]], dtype=i32)}
    out, _ = pad_prefill(three, max_width=8)
    assert out["seq_lens"].tolist() == [0, 3, 1, 1] and out["query_start_loc"].tolist() == [0, 0, 3, 4, 5]
    assert out["block_tables"].tolist() == [[0] * 8, [1] + [0] * 7, [2] + [0] * 7, [3] + [0] * 7]   # padding first
    wide = {**inputs, "block_tables": torch.zeros(2, 5, dtype=i32)}
    assert pad_prefill(wide, max_width=6)[0]["block_tables"].shape == (2, 6)      # capped at the model's width


def test_block_table_widths_are_few():
    """Every width up to WIDTH_FLOOR pads to one table width; past it, powers of two."""
    def width(w, max_width):
        step = {"input_ids": torch.zeros(3, dtype=torch.int64), "positions": torch.zeros(3, dtype=torch.int64),
                "slot_mapping": torch.zeros(3, dtype=torch.int64), "seq_lens": torch.tensor([3], dtype=torch.int32),
                "block_tables": torch.ones(1, w, dtype=torch.int32), "query_start_loc": torch.tensor([0, 3], dtype=torch.int32),
                "lm_head_indices": torch.tensor([2])}
        bt = pad_prefill(step, max_width)[0]["block_tables"]
        assert bt[0, :w].tolist() == [1] * w and not bt[0, w:].any()
        return bt.shape[1]
    assert {width(w, 96) for w in range(1, 97)} == {96}                   # max_model_len 1536, block 16
    assert {width(w, 8192) for w in (1, 7, 300, 512)} == {WIDTH_FLOOR}
    assert [width(w, 8192) for w in (513, 1024, 1025, 5000)] == [1024, 1024, 2048, 8192]
    assert width(513, 600) == 600 and width(600, 600) == 600


def test_pad_prefill_lora_indices_pad_with_no_adapter():
    i64, i32 = torch.int64, torch.int32
    inputs = {"input_ids": torch.tensor([5, 6, 7], dtype=i64), "positions": torch.tensor([0, 1, 2]),
              "slot_mapping": torch.tensor([10, 11, 12]), "seq_lens": torch.tensor([3], dtype=i32),
              "block_tables": torch.tensor([[1]], dtype=i32), "query_start_loc": torch.tensor([0, 3], dtype=i32),
              "lm_head_indices": torch.tensor([2]), "lora_indices": torch.tensor([1, 1, 1], dtype=i32)}
    out, _ = pad_prefill(inputs, max_width=8)
    assert out["lora_indices"].tolist() == [1, 1, 1] + [-1] * 13 and out["lora_indices"].dtype == i32
    assert "lora_indices" not in pad_prefill({k: v for k, v in inputs.items() if k != "lora_indices"}, 8)[0]


def test_a_seq_bucket_pads_sequences_and_projected_rows_to_one_count():
    """The serving loop passes its max_num_seqs: every step then has that many sequences (rounded up
    to a power of two) and as many projected rows, unless more rows are projected (prompt logprobs)."""
    i32 = torch.int32
    step = {"input_ids": torch.arange(5), "positions": torch.arange(5), "slot_mapping": torch.arange(5),
            "seq_lens": torch.tensor([3, 2], dtype=i32), "block_tables": torch.tensor([[1], [2]], dtype=i32),
            "query_start_loc": torch.tensor([0, 3, 5], dtype=i32), "lm_head_indices": torch.tensor([2, 4])}
    out, heads = pad_prefill(step, max_width=4, seq_bucket=5)
    assert heads == 2
    assert out["seq_lens"].tolist() == [0] * 6 + [3, 2] and out["query_start_loc"].tolist() == [0] * 6 + [0, 3, 5]
    assert out["block_tables"].tolist() == [[0] * 4] * 6 + [[1, 0, 0, 0], [2, 0, 0, 0]]
    assert out["lm_head_indices"].tolist() == [2, 4] + [0] * 6
    every_row = {**step, "lm_head_indices": torch.arange(5)}       # prompt logprobs: more rows than sequences
    assert pad_prefill(every_row, max_width=4, seq_bucket=2)[0]["lm_head_indices"].shape == (8,)
    shapes = {tuple((k, tuple(v.shape)) for k, v in sorted(pad_prefill(
        {**step, "seq_lens": torch.tensor([5] * s, dtype=i32)[:s], "block_tables": torch.ones(s, 1, dtype=i32),
         "query_start_loc": torch.tensor([0] + [5] * s, dtype=i32), "lm_head_indices": torch.arange(s)},
        max_width=4, seq_bucket=8)[0].items())) for s in (1, 3, 8)}
    assert len(shapes) == 1                                          # one signature for 1, 3 or 8 sequences
