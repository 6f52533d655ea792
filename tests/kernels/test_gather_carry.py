"""The act-order gather carried by the int4 GEMV that reads it (runtime/backends/gather_carry.py):
a tiny GPTQ ``desc_act`` Llama on the Triton backend (interpreter on CPU) launches no gather for
decode-sized steps, its logits are the same bits as with every gather launched, and steps the
GEMV does not run (more than 16 rows) make the gather first."""
import pytest
import torch

import graphdsl as gd
from graphdsl.runtime.backends import gather_carry, triton_backend
from graphdsl.runtime.kernels import gemv as gemv_module

DEV = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture(scope="module")
def act_order_checkpoint(tmp_path_factory):
    from tests.models.quant_checkpoints import base_model, write_gptq
    tmp = tmp_path_factory.mktemp("act")
    write_gptq(base_model("llama", tmp / "base"), tmp / "q", group=64, sym=False, act_order=True)
    return tmp / "q"


def _llm(path):
    llm = gd.LLM(path, device=DEV, dtype="bfloat16", max_model_len=64, max_num_seqs=2, cuda_graphs=False)
    llm.model.configure_runtime(backend="triton", cuda_graphs=False, max_blocks_per_seq=4)   # every step in Python
    return llm


def _spy(monkeypatch):
    """Counts: gathers made, GEMVs reading through a perm, packed rows made through one."""
    seen = {"made": 0, "perm": 0, "packed": 0}
    make, gemv, pack = gather_carry.GatherCarry.make, gemv_module.gemv, triton_backend._int4_xpack

    def spy_make(pending):
        seen["made"] += 1
        return make(pending)

    def spy_gemv(*a, **k):
        seen["perm"] += k.get("perm") is not None
        return gemv(*a, **k)

    def spy_pack(be, x, scheme, perm=None):
        out = pack(be, x, scheme, perm)
        seen["packed"] += out is not None and perm is not None
        return out

    monkeypatch.setattr(gather_carry.GatherCarry, "make", staticmethod(spy_make))
    monkeypatch.setattr(gemv_module, "gemv", spy_gemv)
    monkeypatch.setattr(triton_backend, "_int4_xpack", spy_pack)
    return seen


@pytest.mark.parametrize("xpack_min", [triton_backend._XPACK_MIN_WEIGHTS, 1])
def test_decode_sized_steps_launch_no_gather_and_keep_the_bits(act_order_checkpoint, monkeypatch, xpack_min):
    """5 tokens (one prefill step) then greedy decode: every gathered act-order projection (qkv, o,
    gate/up; down's order is folded into gate/up's rows at bind) reads its rows through the
    permutation — with ``xpack_min`` 1 the one-row gate/up packs them in that order — and the
    logits equal those of the run that launches each gather."""
    monkeypatch.setattr(triton_backend, "_XPACK_MIN_WEIGHTS", xpack_min)
    llm = _llm(act_order_checkpoint)
    ids = [3, 17, 42, 99, 5]
    seen = _spy(monkeypatch)
    carried = llm.score(ids)                  # 5 rows: no gate/up packing (one row only)
    assert seen == {"made": 0, "perm": 2 * 3, "packed": 0}, seen        # 2 layers x 3 gathered projections
    sp = gd.SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)
    tokens = llm.generate([ids], sp)[0].outputs[0].token_ids            # prefill + 2 one-row steps
    packed = 2 * 2 if xpack_min == 1 else 0
    assert seen == {"made": 0, "perm": 2 * 6 + 2 * 6 - packed, "packed": packed}, seen
    monkeypatch.setattr(gather_carry, "ENABLED", False)
    assert torch.equal(llm.score(ids), carried)
    assert llm.generate([ids], sp)[0].outputs[0].token_ids == tokens


def test_the_norms_around_act_order_projections_are_carried(act_order_checkpoint, monkeypatch):
    """The RMSNorm between an act-order producer (o, down) and act-order consumers (qkv, gate/up,
    read through their gathers) rides on the GEMVs (runtime/backends/norm_carry.py): of the 2-layer
    model's 4 ``add_rms_norm`` only the last (its rows gathered for the lm_head) launches. Reading
    the normed rows through the permutation or through a gathered copy gives the same bits; with
    every norm launched the logits move only by roundings."""
    from graphdsl.runtime.backends import norm_carry
    llm = _llm(act_order_checkpoint)
    launched = []
    real = triton_backend._LOWERINGS["add_rms_norm"]
    monkeypatch.setitem(triton_backend._LOWERINGS, "add_rms_norm",
                        lambda be, node, *a: launched.append(node.name) or real(be, node, *a))
    ids = [3, 17, 42, 99, 5]
    carried = llm.score(ids)
    assert len(launched) == 1, launched
    monkeypatch.setattr(gather_carry, "ENABLED", False)
    assert torch.equal(llm.score(ids), carried)
    monkeypatch.setattr(norm_carry, "ENABLED", False)
    launched.clear()
    unfused = llm.score(ids)
    assert len(launched) == 4
    torch.testing.assert_close(carried, unfused, atol=0.05 * unfused.abs().max().item(), rtol=0.05)


def test_a_step_of_more_than_16_rows_makes_the_gather(act_order_checkpoint, monkeypatch):
    llm = _llm(act_order_checkpoint)
    ids = list(range(3, 23))                                          # 20 rows: not a decode GEMV
    seen = _spy(monkeypatch)
    got = llm.score(ids)
    assert seen["made"] == 2 * 3 and seen["perm"] == 0, seen
    monkeypatch.setattr(gather_carry, "ENABLED", False)
    assert torch.equal(llm.score(ids), got)


def test_plan_carries_only_a_gather_read_right_after_it_by_a_quantized_linear():
    from graphdsl import Network, Tensor
    from graphdsl import functional as F
    with Network("g") as net:
        x = Tensor("x", (2, 8), torch.bfloat16)
        perm = Tensor("perm", (8,), torch.int32)
        a = F.gather(x, -1, perm)
        net.mark_output(a * 2.0, "y")                         # a pointwise reader: not carried
    assert gather_carry.plan(net.nodes) == set()
