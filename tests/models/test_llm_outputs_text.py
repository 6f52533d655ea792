"""What ``LLM`` hands back as text, vLLM's way, on the tiny byte-level GGUF (its random weights
write arbitrary bytes, so characters get cut): EOS and stop token ids are no text, a character the
last token left unfinished is no text, a stop string must end after the first ``min_tokens``
tokens' text; and the checks of the API's arguments."""
import codecs
import re

import pytest

import graphdsl as gd
from graphdsl.errors import GraphDSLError
from graphdsl.runtime.loaders.tokenizer import StreamDecoder
from tests.models.gguf_tiny import SPECIALS, build_tiny_gguf, byte_level_alphabet, vocabulary

_BYTE = {c: b for b, c in enumerate(byte_level_alphabet())}
TOKEN_BYTES = [b"" if t in SPECIALS else bytes(_BYTE[c] for c in t) for t in vocabulary()]


def text_of(ids) -> str:
    """The reference: the tokens' bytes as UTF-8 (U+FFFD for invalid bytes), less a last character
    whose bytes are not all there (vLLM's detokenizer never emits one)."""
    decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
    return decoder.decode(b"".join(TOKEN_BYTES[i] for i in ids), final=False)


def cut_inside_a_character(ids) -> bool:
    decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
    decoder.decode(b"".join(TOKEN_BYTES[i] for i in ids), final=False)
    return bool(decoder.getstate()[0])


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path, _ = build_tiny_gguf(tmp_path_factory.mktemp("outputs"))
    return str(path), gd.LLM(str(path), device="cpu", max_model_len=64, max_num_seqs=2)


@pytest.fixture(scope="module")
def llm(tiny):
    return tiny[1]


def greedy(n=24, **kw):
    return gd.SamplingParams(max_tokens=n, temperature=0, ignore_eos=True, **kw)


def streamed(llm, prompt, params) -> str:
    return "".join(llm.stream(prompt, params))


# ---------------------------------------------------------------- text of the tokens

def test_text_leaves_out_a_character_max_tokens_cut(llm):
    base = llm.generate("hello there", greedy())[0].outputs[0].token_ids
    cuts = [k for k in range(1, len(base) + 1) if cut_inside_a_character(base[:k])]
    assert cuts, "the greedy tokens never end inside a character: pick another prompt"
    for k in cuts[:3]:
        out = llm.generate("hello there", greedy(k))[0].outputs[0]
        assert out.token_ids == base[:k] and out.finish_reason == "length"
        assert out.text == text_of(base[:k])
        assert llm.tokenizer.decode(base[:k]) == out.text + "\ufffd"      # the cut character, as decode shows it
        assert streamed(llm, "hello there", greedy(k)) == out.text
    whole = llm.generate("hello there", greedy())[0].outputs[0]
    assert whole.text == text_of(base) and streamed(llm, "hello there", greedy()) == whole.text


def _printable_token(base, start=2):
    """(index, id) of a token spelling one printable ASCII character, first seen at index >= start."""
    for i in range(start, len(base)):
        t = base[i]
        if t < 128 and chr(t).isprintable() and t not in base[:i]:
            return i, t
    pytest.skip("no printable ASCII token in the greedy output")


@pytest.mark.parametrize("prompt", ["hello there", "a b c d e"])
def test_a_stop_token_id_is_not_text(llm, prompt):
    base = llm.generate(prompt, greedy())[0].outputs[0].token_ids
    i, stop = _printable_token(base)
    out = llm.generate(prompt, greedy(stop_token_ids=[stop]))[0].outputs[0]
    assert out.token_ids == base[:i + 1]                     # the stop token stays in token_ids (vLLM)
    assert (out.finish_reason, out.stop_reason) == ("stop", stop)
    assert out.text == text_of(base[:i])
    assert streamed(llm, prompt, greedy(stop_token_ids=[stop])) == out.text


def test_an_eos_token_is_not_text(llm):
    base = llm.generate("hello there", greedy())[0].outputs[0].token_ids
    i, eos = _printable_token(base)
    saved = set(llm.eos_token_ids)
    try:
        llm.eos_token_ids = {eos}                             # a printable token as EOS: its text would show
        p = gd.SamplingParams(max_tokens=24, temperature=0)
        out = llm.generate("hello there", p)[0].outputs[0]
        assert out.token_ids == base[:i + 1] and (out.finish_reason, out.stop_reason) == ("stop", None)
        assert out.text == text_of(base[:i]) and streamed(llm, "hello there", p) == out.text
    finally:
        llm.eos_token_ids = saved


# ---------------------------------------------------------------- stop strings and min_tokens

def _first_stop(text: str, stop: str, after: int) -> int | None:
    """Where the first match of ``stop`` that ends past ``after`` characters begins."""
    return next((i for i in range(len(text)) if text.startswith(stop, i) and i + len(stop) > after), None)


def _stop_cases(base):
    """``(min_tokens, stop, where)``: a 2-character stop string lying inside the first ``min_tokens``
    tokens' text, and one that begins there and ends after it."""
    full = text_of(base)
    inside = across = None
    for k in range(2, len(base) // 2):
        head = text_of(base[:k])
        for a in range(len(head) - 1):
            x = full[a:a + 2]
            if "\ufffd" not in x and x.isprintable():
                if a + 2 <= len(head) and inside is None:
                    inside = (k, x, "inside")
                if a + 2 > len(head) and across is None:
                    across = (k, x, "across")
    return [c for c in (inside, across) if c is not None]


@pytest.mark.parametrize("prompt", ["a b c d e", "hello there", "é"])
def test_a_stop_string_must_end_after_the_min_tokens_text(llm, prompt):
    base = llm.generate(prompt, greedy())[0].outputs[0].token_ids
    full = text_of(base)
    cases = _stop_cases(base)
    assert any(where == "inside" for *_, where in cases), full
    for min_tokens, stop, where in cases:
        after = len(text_of(base[:min_tokens]))
        p = greedy(stop=[stop], min_tokens=min_tokens)
        out = llm.generate(prompt, p)[0].outputs[0]
        at = _first_stop(full, stop, after)
        if where == "across":
            assert at is not None and at < after             # it may begin inside the min_tokens text
        if at is None:
            assert (out.text, out.finish_reason, out.stop_reason) == (full, "length", None), (stop, min_tokens)
        else:
            assert (out.text, out.finish_reason, out.stop_reason) == (full[:at], "stop", stop), (stop, min_tokens)
        assert streamed(llm, prompt, p) == out.text


def test_stop_strings_without_min_tokens_cut_at_the_first_match(llm):
    base = llm.generate("a b c d e", greedy())[0].outputs[0].token_ids
    full = text_of(base)
    stop = next(full[a:a + 2] for a in range(1, len(full) - 1) if full[a:a + 2].isprintable()
                and "\ufffd" not in full[a:a + 2])
    out = llm.generate("a b c d e", greedy(stop=[stop, "never there"]))[0].outputs[0]
    assert (out.text, out.finish_reason, out.stop_reason) == (full[:full.index(stop)], "stop", stop)


# ---------------------------------------------------------------- StreamDecoder

def test_stream_decoder_passes_a_whole_u_fffd_and_holds_a_cut_character(llm):
    tok = llm.tokenizer                                      # token id b < 256 is the byte b
    sd = StreamDecoder(tok)
    assert [sd.push(b) for b in b"\xef\xbf\xbd"] == ["", "", "\ufffd"]    # U+FFFD spelled out: text
    assert sd.push(ord("A")) == "A"
    assert [sd.push(b) for b in "日".encode()] == ["", "", "日"]
    assert sd.push(0xE6) == "" and sd.flush(drop_incomplete=True) == ""     # a cut character: none
    sd = StreamDecoder(tok)
    assert [sd.push(b) for b in b"x\xe6\x97"] == ["x", "", ""] and sd.flush() == "\ufffd"   # decode's view
    assert sd.text == tok.decode(list(b"x\xe6\x97")) == "x\ufffd"


def test_stream_decoder_ignores_skipped_special_tokens_inside_a_character(llm):
    tok = llm.tokenizer
    special = vocabulary().index("<|im_start|>")
    sd = StreamDecoder(tok)
    assert [sd.push(t) for t in [0xE6, special, 0x97, 0xA5]] == ["", "", "", "日"]


# ---------------------------------------------------------------- arguments

def test_sampling_params_keyword(llm):
    sp = greedy(6)
    want = llm.generate("hello there", sp)[0].outputs[0]
    assert llm.generate("hello there", sampling_params=sp)[0].outputs[0].token_ids == want.token_ids
    assert llm.generate(["hello there"], sampling_params=[sp])[0].outputs[0].token_ids == want.token_ids
    assert "".join(llm.stream("hello there", sampling_params=sp)) == want.text
    chat = llm.chat([{"role": "user", "content": "hi"}], sampling_params=sp).outputs[0]
    assert len(chat.token_ids) == 6


def test_stop_token_ids_outside_the_vocabulary_are_refused(llm):
    vocab = llm.config.vocab_size
    with pytest.raises(GraphDSLError, match=rf"stop_token_ids must be token ids in \[0, {vocab}\).*\[{10**12}\]"):
        llm.generate("hello", greedy(4, stop_token_ids=[5, 10**12]))
    with pytest.raises(GraphDSLError, match=rf"sampling_params\[1\]\.stop_token_ids .*\[{vocab}\]"):
        llm.generate(["hello", "there"], [greedy(4), greedy(4, stop_token_ids=[vocab])])
    with pytest.raises(GraphDSLError, match="stop_token_ids"):
        list(llm.stream("hello", greedy(4, stop_token_ids=[vocab])))
    last = llm.generate("hello", greedy(4, stop_token_ids=[vocab - 1]))[0].outputs[0]
    assert len(last.token_ids) >= 1


def test_lists_changed_in_place_are_checked_when_the_params_are_used(llm):
    sp = greedy(4, stop=["zzz"])
    sp.stop.append("")                                   # assignment checks; an in-place change does not
    with pytest.raises(GraphDSLError, match=r"^sampling_params: invalid SamplingParams: stop must be a list of "
                                            r"non-empty strings, got \['zzz', ''\]"):
        llm.generate("hello", sp)
    sp = greedy(4)
    sp.stop_token_ids.append(-1)
    with pytest.raises(GraphDSLError, match=r"sampling_params\[1\]: .*stop_token_ids must be a list of integers >= 0"):
        llm.generate(["hello", "there"], [greedy(4), sp])
    with pytest.raises(GraphDSLError, match="stop_token_ids"):
        list(llm.stream("hello", sp))


def test_a_bad_dict_among_the_params_is_named_by_its_index(llm):
    """Dicts are checked where SamplingParams are: the error names which one of the list it is."""
    with pytest.raises(GraphDSLError, match=r"^sampling_params\[1\]: invalid SamplingParams: max_tokens must be an "
                                            r"integer >= 1, or None .*, got 0"):
        llm.generate(["hello", "there"], [greedy(4), {"max_tokens": 0}])
    with pytest.raises(GraphDSLError, match=r"^sampling_params: invalid SamplingParams: unknown field 'bogus'"):
        llm.generate(["hello", "there"], {"max_tokens": 2, "bogus": 1})
    out = llm.generate(["hello", "there"], [greedy(3), {"max_tokens": 2, "temperature": 0, "stop": None}])
    assert [len(o.outputs[0].token_ids) for o in out] == [3, 2]


def test_a_request_keeps_the_params_it_was_given(llm):
    """The request holds a snapshot: changing the caller's object while a stream runs changes nothing."""
    sp = greedy(8)
    want = llm.generate("hello there", sp)[0].outputs[0].text
    pieces = llm.stream("hello there", sp)
    first = next(pieces)
    sp.stop.append(want[-1])
    sp.max_tokens = 2
    assert first + "".join(pieces) == want


@pytest.mark.parametrize("prompt", [None, 5, {"prompt": "hi"}])
def test_stream_refuses_what_is_not_a_prompt(llm, prompt):
    with pytest.raises(GraphDSLError, match="stream: prompt must be one prompt"):
        next(llm.stream(prompt, greedy(2)))


@pytest.mark.parametrize("messages", [[], None, "hi", [{"role": "user"}], [{"role": "user", "content": None}]])
def test_chat_refuses_an_empty_or_malformed_conversation(llm, messages):
    with pytest.raises(GraphDSLError, match=r'chat: messages(\[0\]\.content)? must be (a non-empty list of \{"role": '
                                            r'str|a string or a non-empty list of \{"type": "text")'):
        llm.chat(messages, greedy(2))


@pytest.mark.parametrize("messages,got", [([{"content": "hi"}], "None (the message has no role)"),
                                          ([{"role": "user", "content": "a"}, {"role": 3, "content": "b"}], "3")])
def test_chat_names_the_message_whose_role_is_missing(llm, messages, got):
    i = len(messages) - 1
    with pytest.raises(GraphDSLError, match=rf'chat: messages\[{i}\]\.role must be a string \("system", "user", '
                                            rf'"assistant", ...\), got {re.escape(got)}$'):
        llm.chat(messages, greedy(2))


def test_chat_reads_openai_text_parts_and_refuses_other_parts(llm):
    parts = [{"role": "user", "content": [{"type": "text", "text": "a b"}, {"type": "text", "text": "c"}]}]
    text = [{"role": "user", "content": "a b\nc"}]
    assert llm.chat(parts, greedy(3)).outputs[0].token_ids == llm.chat(text, greedy(3)).outputs[0].token_ids
    with pytest.raises(GraphDSLError, match=r"chat: messages\[0\]\.content holds parts of type \['image_url'\]"):
        llm.chat([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}], greedy(2))


def test_prompt_logprobs_of_a_one_token_prompt(llm):
    res = llm.generate([[5]], greedy(2, prompt_logprobs=2))[0]
    assert res.prompt_logprobs == [None]
    res = llm.generate([[5, 6]], greedy(2, prompt_logprobs=2))[0]
    assert res.prompt_logprobs[0] is None and len(res.prompt_logprobs) == 2 and 6 in res.prompt_logprobs[1]
    assert llm.generate([[5]], greedy(2))[0].prompt_logprobs is None


@pytest.mark.parametrize("model", [None, 5, ["a.gguf"], b"a.gguf"])
def test_llm_model_must_be_a_path(model):
    with pytest.raises(GraphDSLError, match=r"LLM: model must be the path \(a str or os.PathLike\) of a HF model "
                                            r"directory or a .gguf file, got"):
        gd.LLM(model)


def test_the_clis_smollm2_name_is_explained_not_reported_missing(tmp_path, monkeypatch):
    with pytest.raises(GraphDSLError, match=r"model='SmolLM2' is the CLI's name .* LLM\(graphdsl.entrypoints.cli"
                                            r".smollm2_path\(\)\)"):
        gd.LLM("SmolLM2")
    monkeypatch.chdir(tmp_path)                 # a directory of that name is taken as the path it is
    (tmp_path / "smollm2").mkdir()
    with pytest.raises(GraphDSLError, match=r"'smollm2' is a directory without config.json"):
        gd.LLM("smollm2")


@pytest.mark.parametrize("kw,match", [
    (dict(cuda_graphs="no"), "cuda_graphs must be a bool"),
    (dict(overlap=1), "overlap must be a bool"),
    (dict(progress="yes"), "progress must be a bool"),
    (dict(max_model_len=1), r"max_model_len must be at least 2 \(a request holds at least one prompt token and "
                            r"one generated token\), got 1"),
    (dict(max_model_len=0), "max_model_len must be a positive int, got 0"),
])
def test_llm_arguments_are_checked_before_loading(tmp_path, kw, match):
    missing = str(tmp_path / "not-there.gguf")               # nothing is read: the argument is named first
    with pytest.raises(GraphDSLError, match=f"LLM: {match}"):
        gd.LLM(missing, device="cpu", **kw)
    if "progress" not in kw:
        with pytest.raises(GraphDSLError, match=f"LLM: {match}"):
            gd.LLM.from_config({"model_type": "llama"}, device="cpu", **kw)


def test_the_shortest_max_model_len(tiny):
    llm = gd.LLM(tiny[0], device="cpu", max_model_len=2, max_num_seqs=1)
    out = llm.generate([[5]], greedy(4))[0].outputs[0]
    assert len(out.token_ids) == 1 and out.finish_reason == "length"
    with pytest.raises(GraphDSLError, match=r"prompt 0 has 2 tokens, more than max_model_len=2 allows \(1, leaving"):
        llm.generate([[5, 6]], greedy(4))


# ---------------------------------------------------------------- the server shares LLM._accept / LLM._text

def test_the_server_leaves_out_a_cut_character_and_an_eos(llm):
    pytest.importorskip("fastapi")
    pytest.importorskip("httpx")
    import json

    from fastapi.testclient import TestClient

    from graphdsl.entrypoints.openai_server import build_app
    base = llm.generate("hello there", greedy())[0].outputs[0].token_ids
    k = next(k for k in range(1, len(base) + 1) if cut_inside_a_character(base[:k]))
    i, eos = _printable_token(base)
    saved = set(llm.eos_token_ids)
    llm.eos_token_ids = {eos}
    try:
        with TestClient(build_app(llm, served_model_name="tiny")) as client:
            for body, want in (({"max_tokens": k, "ignore_eos": True}, text_of(base[:k])),
                               ({"max_tokens": 24}, text_of(base[:i]))):
                body = {"model": "tiny", "prompt": "hello there", "temperature": 0, **body}
                r = client.post("/v1/completions", json=body)
                assert r.status_code == 200, r.text
                assert r.json()["choices"][0]["text"] == want
                with client.stream("POST", "/v1/completions", json={**body, "stream": True}) as s:
                    lines = [x[len("data: "):] for x in s.iter_lines() if x.startswith("data: ")]
                pieces = [json.loads(x)["choices"][0]["text"] for x in lines if x != "[DONE]"]
                assert "".join(pieces) == want
    finally:
        llm.eos_token_ids = saved
