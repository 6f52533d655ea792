"""StepBatch.model_inputs packs each dtype into one host-to-device copy; every tensor it hands out
must still be its own correct, contiguous, 16-byte-aligned view."""
from graphdsl.runtime.serving.kv_cache import BlockManager
from graphdsl.runtime.serving.sampling import SamplingParams
from graphdsl.runtime.serving.scheduler import Scheduler


def test_inputs_are_aligned_contiguous_views_with_the_right_values():
    blocks = BlockManager(32, 4)
    sched = Scheduler(blocks, max_num_seqs=4, max_num_batched_tokens=9, max_model_len=64)
    sched.add_request("a", [5, 6, 7], SamplingParams(max_tokens=4))
    sched.add_request("b", list(range(10, 21)), SamplingParams(max_tokens=4))
    batch = sched.schedule()                      # a: 0..3 (samples), b: 0..6 (a middle chunk)
    t = batch.model_inputs(blocks)
    assert t["input_ids"].tolist() == [5, 6, 7, 10, 11, 12, 13, 14, 15]
    assert t["positions"].tolist() == [0, 1, 2, 0, 1, 2, 3, 4, 5]
    assert t["slot_mapping"].tolist() == blocks.slot_mapping("a", 0, 3) + blocks.slot_mapping("b", 0, 6)
    assert t["lm_head_indices"].tolist() == [2]
    assert t["block_tables"].tolist() == [blocks.block_table("a") + [0], blocks.block_table("b")]
    assert t["seq_lens"].tolist() == [3, 6] and t["query_start_loc"].tolist() == [0, 3, 9]
    for name, x in t.items():
        assert x.is_contiguous() and x.data_ptr() % 16 == 0, name
