"""The packed-word layouts of pre-quantized checkpoints, pinned by hand-written words (independent of
the test writers in tests/models/quant_checkpoints.py): AutoAWQ's interleaved nibble order, GPTQ's
sequential one, and compressed-tensors' int32 words being our little-end-first nibble bytes."""
import torch

from graphdsl.quant import IntScheme, unpack_int4
from graphdsl.runtime.loaders.prequantized import _awq_columns, _int32_bytes, _nibbles, read_checkpoint_quantization


def _word(nibbles):
    v = sum(int(x) << (4 * i) for i, x in enumerate(nibbles))
    return v - 2 ** 32 if v >= 2 ** 31 else v


def test_awq_word_holds_columns_in_order_0_2_4_6_1_3_5_7():
    # columns 0..7 hold codes 9..16 (mod 16): AutoAWQ writes column [0,2,4,6,1,3,5,7][i] into nibble i
    codes = [9, 10, 11, 12, 13, 14, 15, 0]
    word = _word([codes[c] for c in (0, 2, 4, 6, 1, 3, 5, 7)])
    assert _awq_columns(torch.tensor([[word]], dtype=torch.int32)).tolist() == [codes]


def test_gptq_and_compressed_tensors_words_are_sequential_little_end_first():
    word = _word([1, 2, 3, 4, 5, 6, 7, 15])
    t = torch.tensor([[word]], dtype=torch.int32)
    assert _nibbles(t).tolist() == [[1, 2, 3, 4, 5, 6, 7, 15]]
    # compressed-tensors int4: the word's bytes are our packed bytes (even k in the low nibble)
    assert unpack_int4(_int32_bytes(t)).tolist() == [[1, 2, 3, 4, 5, 6, 7, 15]]


def test_gptq_v1_zero_plus_one_and_v2_as_stored():
    """A one-linear GPTQ layer [8 out, 32 in], all codes 10, stored zeros 7: v1 means z = 8, v2 z = 7."""
    n, k = 8, 32
    qweight = torch.full((k // 8, n), _word([10] * 8), dtype=torch.int32)
    qzeros = torch.full((1, n // 8), _word([7] * 8), dtype=torch.int32)
    scales = torch.full((1, n), 0.5, dtype=torch.float16)
    for fmt, want in (("gptq", (10 - 8) * 0.5), ("gptq_v2", (10 - 7) * 0.5)):
        q = read_checkpoint_quantization({"quantization_config": {"quant_method": "gptq", "bits": 4, "group_size": 32,
                                                                  "sym": False, "checkpoint_format": fmt}})
        s = q.scheme_for("layer", n, k)
        assert s == IntScheme(4, 32, True)
        tensors = dict(q.convert([("layer.qweight", qweight), ("layer.qzeros", qzeros), ("layer.scales", scales),
                                  ("layer.bias", torch.zeros(n, dtype=torch.float16))], torch.float32))
        assert tensors["layer.bias"].dtype == torch.float32
        w = s.dequantize([tensors[f"layer.weight{c.suffix}"] for c in s.companions(n, k)], n, k, torch.float32)
        assert torch.equal(w, torch.full((n, k), want))
