"""runtime/loaders/tokenizer.py against transformers' tokenizers (HF dir and GGUF metadata), chat templates,
streaming decode and every error path."""
from __future__ import annotations

import json

import pytest

from graphdsl.errors import GraphDSLError
from graphdsl.runtime.loaders.tokenizer import StreamDecoder, Tokenizer

tokenizers = pytest.importorskip("tokenizers")
transformers = pytest.importorskip("transformers")

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHATML = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' }}"
          "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
TEXTS = [
    "Hello world! The quick brown fox jumps over the lazy dog.",
    "naïve café déjà vu — 日本語のテキスト 😀🎉 unseen: ẞ Ω ∑",
    "def f(x):\n    return x * 2  # comment\n\n\ttabs and  spaces   ",
    "numbers 12345 and 3.14159, plus <|im_start|>user\nhi<|im_end|> specials",
    "",
    " leading space",
]
CORPUS = ["Hello world! The quick brown fox jumps over the lazy dog 12345.",
          "Graphs of fused kernels run fast; naïve café déjà vu — 日本語のテキスト 😀🎉",
          "def f(x):\n    return x * 2  # comment\n\n\ttabs and  spaces"] * 20


def train_bpe(vocab_size: int = 400):
    from tokenizers import decoders, models, pre_tokenizers, trainers
    tok = tokenizers.Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tr = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIALS, show_progress=False,
                             initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS, tr)
    return tok


def write_hf_dir(path, *, template=CHATML, add_bos=False, gen_eos=(2, 0)):
    tok = train_bpe()
    tok.save(str(path / "tokenizer.json"))
    cfg = {"bos_token": "<|endoftext|>", "eos_token": "<|im_end|>",
           "add_bos_token": add_bos, "tokenizer_class": "PreTrainedTokenizerFast"}
    if template is not None:
        cfg["chat_template"] = template
    (path / "tokenizer_config.json").write_text(json.dumps(cfg))
    if gen_eos is not None:
        (path / "generation_config.json").write_text(json.dumps({"eos_token_id": list(gen_eos)}))
    return tok


def gguf_metadata_from(tok, *, pre="gpt2", template=CHATML, **extra) -> dict:
    """The tokenizer.ggml.* metadata llama.cpp's converter writes for a byte-level BPE."""
    j = json.loads(tok.to_str())
    vocab = j["model"]["vocab"]
    tokens = [None] * len(vocab)
    for t, i in vocab.items():
        tokens[i] = t
    types = [3 if t in SPECIALS else 1 for t in tokens]
    meta = {"general.architecture": "llama", "tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": pre,
            "tokenizer.ggml.tokens": tokens, "tokenizer.ggml.token_type": types,
            "tokenizer.ggml.merges": [" ".join(m) if isinstance(m, list) else m for m in j["model"]["merges"]],
            "tokenizer.ggml.bos_token_id": 0, "tokenizer.ggml.eos_token_id": 2,
            "tokenizer.ggml.add_bos_token": False}
    if template is not None:
        meta["tokenizer.chat_template"] = template
    meta.update(extra)
    return meta


@pytest.fixture()
def hf_dir(tmp_path):
    write_hf_dir(tmp_path)
    return tmp_path


# ---------------------------------------------------------------- from_pretrained vs transformers

def test_from_pretrained_matches_transformers(hf_dir):
    ours = Tokenizer.from_pretrained(hf_dir)
    ref = transformers.AutoTokenizer.from_pretrained(str(hf_dir))
    for text in TEXTS:
        ids = ours.encode(text)
        assert ids == ref.encode(text), text
        assert ours.encode(text, add_special_tokens=False) == ref.encode(text, add_special_tokens=False)
        assert ours.decode(ids) == ref.decode(ids, skip_special_tokens=True)
        assert ours.decode(ids, skip_special_tokens=False) == ref.decode(ids, skip_special_tokens=False)
    assert ours.vocab_size == len(ref) == 400


def test_from_pretrained_special_ids(hf_dir):
    ours = Tokenizer.from_pretrained(hf_dir)
    assert ours.bos_token_id == 0 and ours.bos_token == "<|endoftext|>"
    assert ours.eos_token_ids == {0, 2}            # tokenizer_config eos + generation_config list
    assert ours.encode("hi") == ours.encode("hi", add_special_tokens=False)  # add_bos_token False


def test_post_processor_adds_bos_like_transformers(tmp_path):
    """tokenizer.json's post-processor decides BOS; tokenizer_config's add_bos_token is ignored,
    as transformers does for tokenizer.json-backed tokenizers."""
    from tokenizers import processors
    tok = write_hf_dir(tmp_path, add_bos=True)
    tok.post_processor = processors.TemplateProcessing(
        single="<|endoftext|> $A", pair="<|endoftext|> $A $B", special_tokens=[("<|endoftext|>", 0)])
    tok.save(str(tmp_path / "tokenizer.json"))
    ours = Tokenizer.from_pretrained(tmp_path)
    ref = transformers.AutoTokenizer.from_pretrained(str(tmp_path))
    assert ours.encode("hello")[0] == 0
    assert ours.encode("hello")[1:] == ours.encode("hello", add_special_tokens=False)
    assert ours.encode("hello") == ref.encode("hello")
    assert ours.encode("hello", add_special_tokens=False) == ref.encode("hello", add_special_tokens=False)
    write_hf_dir(tmp_path, add_bos=True)          # no post-processor: no BOS, like transformers
    ours = Tokenizer.from_pretrained(tmp_path)
    assert ours.encode("hello") == transformers.AutoTokenizer.from_pretrained(str(tmp_path)).encode("hello")
    assert ours.encode("hello")[0] != 0


def test_chat_template_matches_transformers(hf_dir):
    ours = Tokenizer.from_pretrained(hf_dir)
    ref = transformers.AutoTokenizer.from_pretrained(str(hf_dir))
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there ☃"}]
    for gen in (True, False):
        assert ours.apply_chat_template(msgs, add_generation_prompt=gen) == \
            ref.apply_chat_template(msgs, add_generation_prompt=gen, tokenize=False)


def test_chat_template_from_jinja_file_and_named_list(tmp_path):
    write_hf_dir(tmp_path, template=[{"name": "tool_use", "template": "T"},
                                     {"name": "default", "template": "{{ bos_token }}D{{ eos_token }}"}])
    assert Tokenizer.from_pretrained(tmp_path).apply_chat_template([]) == "<|endoftext|>D<|endoftext|>"
    (tmp_path / "chat_template.jinja").write_text("J{{ messages | length }}")
    assert Tokenizer.from_pretrained(tmp_path).apply_chat_template([{"role": "user", "content": "x"}]) == "J1"


def test_chat_template_helpers():
    tok = Tokenizer(train_bpe(), chat_template="{{ messages[0] | tojson }}{% for m in messages %}"
                    "{% if loop.index > 1 %}{% break %}{% endif %}{% endfor %}")
    assert tok.apply_chat_template([{"role": "user", "content": "é"}]) == '{"role": "user", "content": "é"}'


# ---------------------------------------------------------------- error paths

def test_no_chat_template_is_clear(tmp_path):
    write_hf_dir(tmp_path, template=None)
    tok = Tokenizer.from_pretrained(tmp_path)
    with pytest.raises(GraphDSLError, match="has no chat template.*pass a plain prompt"):
        tok.apply_chat_template([{"role": "user", "content": "hi"}])


def test_template_raise_exception_and_syntax_error():
    tok = Tokenizer(train_bpe(), chat_template="{{ raise_exception('only user turns') }}", source="m")
    with pytest.raises(GraphDSLError, match="chat template of m failed: only user turns"):
        tok.apply_chat_template([{"role": "user", "content": "x"}])
    tok = Tokenizer(train_bpe(), chat_template="{% for %}")
    with pytest.raises(GraphDSLError, match=r"chat template does not parse \(line 1\)"):
        tok.apply_chat_template([{"role": "user", "content": "x"}])


def test_template_is_sandboxed():
    tok = Tokenizer(train_bpe(), chat_template="{{ ''.__class__.__mro__[1].__subclasses__() }}")
    with pytest.raises(GraphDSLError, match="chat template of .* failed"):
        tok.apply_chat_template([{"role": "user", "content": "x"}])


def test_bad_messages():
    tok = Tokenizer(train_bpe(), chat_template=CHATML)
    with pytest.raises(GraphDSLError, match="messages must be a list of dicts with 'role'"):
        tok.apply_chat_template([{"content": "no role"}])


def test_missing_dir_and_tokenizer_json(tmp_path):
    with pytest.raises(GraphDSLError, match="does not exist"):
        Tokenizer.from_pretrained(tmp_path / "nope")
    (tmp_path / "tokenizer.model").write_bytes(b"x")
    with pytest.raises(GraphDSLError, match=r"has no tokenizer.json.*\['tokenizer.model'\]"):
        Tokenizer.from_pretrained(tmp_path)


def test_corrupt_files(tmp_path):
    (tmp_path / "tokenizer.json").write_text("{broken")
    with pytest.raises(GraphDSLError, match=r"cannot load .*tokenizer.json"):
        Tokenizer.from_pretrained(tmp_path)
    write_hf_dir(tmp_path)
    (tmp_path / "tokenizer_config.json").write_text("[1, 2]")
    with pytest.raises(GraphDSLError, match=r"tokenizer_config.json' must hold a JSON object, got list"):
        Tokenizer.from_pretrained(tmp_path)


def test_encode_decode_argument_errors():
    tok = Tokenizer(train_bpe())
    with pytest.raises(GraphDSLError, match="text must be a str, got list"):
        tok.encode(["a"])
    with pytest.raises(GraphDSLError, match=r"ids outside the vocabulary \[0, 400\): \[400\]"):
        tok.decode([1, 400])


# ---------------------------------------------------------------- GGUF metadata (gpt2 BPE)

def test_from_gguf_bpe_matches_hf(hf_dir):
    hf = Tokenizer.from_pretrained(hf_dir)
    ours = Tokenizer.from_gguf(gguf_metadata_from(hf.backend))
    for text in TEXTS:
        assert ours.encode(text) == hf.encode(text), text
        ids = hf.encode(text)
        assert ours.decode(ids) == hf.decode(ids)
        assert ours.decode(ids, skip_special_tokens=False) == hf.decode(ids, skip_special_tokens=False)
    assert ours.vocab_size == hf.vocab_size
    assert ours.bos_token_id == 0 and ours.eos_token_ids == {2}
    msgs = [{"role": "user", "content": "hi"}]
    assert ours.apply_chat_template(msgs) == hf.apply_chat_template(msgs)


def test_from_gguf_bos_and_eot():
    meta = gguf_metadata_from(train_bpe(), **{"tokenizer.ggml.add_bos_token": True,
                                             "tokenizer.ggml.eot_token_id": 1})
    tok = Tokenizer.from_gguf(meta)
    assert tok.encode("hi")[0] == 0 and tok.encode("hi", add_special_tokens=False)[0] != 0
    assert tok.eos_token_ids == {1, 2}


def test_from_gguf_smollm_pre_splits_digits():
    tok = Tokenizer.from_gguf(gguf_metadata_from(train_bpe(), pre="smollm"))
    digits = tok.encode("12345", add_special_tokens=False)
    assert [tok.decode([i]) for i in digits] == list("12345")
    assert tok.decode(tok.encode("abc 12345 def")) == "abc 12345 def"


@pytest.mark.parametrize("change,msg", [
    ({"tokenizer.ggml.model": "rwkv"}, r"tokenizer.ggml.model is 'rwkv'; .*\['gpt2', 'llama'\]"),
    ({"tokenizer.ggml.tokens": []}, "tokenizer.ggml.tokens is missing or empty"),
    ({"tokenizer.ggml.token_type": [1, 1]}, "token_type has 2 entries for 400 tokens"),
    ({"tokenizer.ggml.merges": None}, "needs tokenizer.ggml.merges"),
    ({"tokenizer.ggml.merges": ["a b c"]}, r"merges\[0\] = 'a b c' is not 'left right'"),
    ({"tokenizer.ggml.merges": ["zz\u2603 q"]}, r"merges do not fit tokenizer.ggml.tokens: .*out of vocabulary"),
    ({"tokenizer.ggml.eos_token_id": 4000}, r"eos_token_id = 4000 is not a token id in \[0, 400\)"),
])
def test_from_gguf_errors(change, msg):
    meta = gguf_metadata_from(train_bpe())
    meta.update(change)
    with pytest.raises(GraphDSLError, match=msg):
        Tokenizer.from_gguf(meta, source="x.gguf")


# ---------------------------------------------------------------- GGUF metadata (llama SPM)

def spm_metadata(**extra) -> dict:
    """A tiny SentencePiece vocabulary: control tokens, bytes, pieces with scores."""
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    types = [2, 3, 3] + [6] * 256
    scores = [0.0] * len(tokens)
    pieces = {"\u2581": -1.0, "h": -2.0, "e": -2.0, "l": -2.0, "o": -2.0, "w": -2.0, "r": -2.0, "d": -2.0,
              "he": -3.0, "ll": -3.5, "hell": -4.0, "\u2581hell": -4.5, "\u2581hello": -5.0,
              "lo": -6.0, "or": -6.5, "\u2581w": -7.0, "\u2581wor": -7.5, "ld": -8.0, "\u2581world": -8.5}
    for p, s in pieces.items():
        tokens.append(p)
        types.append(1)
        scores.append(s)
    meta = {"tokenizer.ggml.model": "llama", "tokenizer.ggml.tokens": tokens,
            "tokenizer.ggml.token_type": types, "tokenizer.ggml.scores": scores,
            "tokenizer.ggml.bos_token_id": 1, "tokenizer.ggml.eos_token_id": 2,
            "tokenizer.ggml.unknown_token_id": 0}
    meta.update(extra)
    return meta


def test_from_gguf_spm_merges_by_score_and_byte_fallback():
    tok = Tokenizer.from_gguf(spm_metadata())
    toks = tok.backend
    ids = tok.encode("hello world")
    assert ids[0] == 1                               # llama SPM adds BOS by default
    assert [toks.id_to_token(i) for i in ids[1:]] == ["\u2581hello", "\u2581world"]
    ids = tok.encode("hello é", add_special_tokens=False)
    pieces = [toks.id_to_token(i) for i in ids]
    assert pieces == ["\u2581hello", "\u2581", "<0xC3>", "<0xA9>"]   # é is not in vocab: UTF-8 bytes
    assert tok.decode(ids) == "hello é"
    assert tok.decode(tok.encode("hello world")) == "hello world"


def test_from_gguf_spm_needs_scores():
    meta = spm_metadata()
    meta["tokenizer.ggml.scores"] = meta["tokenizer.ggml.scores"][:5]
    with pytest.raises(GraphDSLError, match=r"needs tokenizer.ggml.scores with one score per token \(278\), got 5"):
        Tokenizer.from_gguf(meta)


# ---------------------------------------------------------------- streaming

def test_stream_decoder_matches_full_decode(hf_dir):
    tok = Tokenizer.from_pretrained(hf_dir)
    for text in TEXTS:
        ids = tok.encode(text)
        sd = StreamDecoder(tok)
        pieces = [sd.push(i) for i in ids]
        assert "".join(pieces) + sd.flush() == tok.decode(ids)
        assert all("\ufffd" not in p for p in pieces)


def test_stream_decoder_holds_split_utf8():
    tok = Tokenizer.from_gguf(spm_metadata())
    ids = tok.encode("hello é", add_special_tokens=False)  # ... <0xC3> <0xA9>
    sd = StreamDecoder(tok)
    out = [sd.push(i) for i in ids]
    assert out == ["hello", " ", "", "é"]
    assert sd.flush() == "" and sd.text == "hello é"


def test_stream_decoder_flush_emits_incomplete_tail():
    tok = Tokenizer.from_gguf(spm_metadata())
    sd = StreamDecoder(tok)
    c3 = tok.backend.token_to_id("<0xC3>")
    assert sd.push(c3) == ""
    assert sd.flush() == "\ufffd"


def test_stream_decoder_spm_leading_space_is_kept_mid_stream():
    tok = Tokenizer.from_gguf(spm_metadata())
    ids = tok.encode("hello world hello", add_special_tokens=True)
    sd = StreamDecoder(tok)
    assert [sd.push(i) for i in ids] == ["", "hello", " world", " hello"]


def test_added_token_dict_form_in_config(tmp_path):
    write_hf_dir(tmp_path, gen_eos=None)
    cfg = json.loads((tmp_path / "tokenizer_config.json").read_text())
    cfg["eos_token"] = {"__type": "AddedToken", "content": "<|im_end|>"}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(cfg))
    assert Tokenizer.from_pretrained(tmp_path).eos_token_ids == {2}


# ---------------------------------------------------------------- GGUF files written with GGUFWriter

def _write_tokenizer_gguf(path, meta: dict) -> None:
    import numpy as np
    from tests.helpers.gguf_files import write_gguf
    meta = dict(meta)
    meta.pop("general.architecture", None)
    write_gguf(path, "llama", meta, {"output_norm.weight": (np.ones(4, np.float32), None)})


def test_gguf_file_bpe_tokenizer_matches_hf_and_transformers_gguf(tmp_path, hf_dir):
    from graphdsl.runtime.loaders.gguf import GGUFCheckpoint
    hf = Tokenizer.from_pretrained(hf_dir)
    ref_dir = transformers.AutoTokenizer.from_pretrained(str(hf_dir))
    (tmp_path / "g").mkdir()                      # apart from hf_dir's tokenizer files
    path = tmp_path / "g" / "tok.gguf"
    _write_tokenizer_gguf(path, gguf_metadata_from(hf.backend))
    ours = GGUFCheckpoint(path).tokenizer()
    ref_gguf = transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file="tok.gguf")
    for text in TEXTS:
        ids = ours.encode(text)
        assert ids == hf.encode(text) == ref_dir.encode(text) == ref_gguf.encode(text), text
        assert ours.decode(ids) == ref_dir.decode(ids, skip_special_tokens=True) == ref_gguf.decode(ids, skip_special_tokens=True)
        assert ours.decode(ids, skip_special_tokens=False) == ref_gguf.decode(ids, skip_special_tokens=False)
    msgs = [{"role": "user", "content": "hi"}]
    assert ours.apply_chat_template(msgs) == ref_gguf.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    assert ours.vocab_size == len(ref_gguf) and ours.eos_token_ids == {2} and ours.bos_token_id == 0


def test_gguf_file_spm_tokenizer_matches_transformers_gguf(tmp_path):
    from graphdsl.runtime.loaders.gguf import GGUFCheckpoint
    path = tmp_path / "spm.gguf"
    _write_tokenizer_gguf(path, spm_metadata())
    ours = GGUFCheckpoint(path).tokenizer()
    ref = transformers.AutoTokenizer.from_pretrained(str(tmp_path), gguf_file="spm.gguf")
    for text in ["hello world", "hello é", "world hello hello", "  hello", "hello\nworld", "lord held"]:
        ids = ours.encode(text)
        assert ids == ref.encode(text), (text, ids, ref.encode(text))
        assert ours.decode(ids) == ref.decode(ids, skip_special_tokens=True), text


def test_incomplete_tail_bytes_match_an_incremental_utf8_decoder():
    """``_TokenBytes.incomplete`` (an ASCII last byte answers 0 at once) against a UTF-8 incremental
    decoder over every prefix of random token sequences of the SPM byte-fallback tokenizer: ASCII,
    multi-byte characters cut anywhere, stray continuation and invalid lead bytes."""
    import codecs
    import random

    from graphdsl.runtime.loaders.tokenizer import _token_bytes
    tok = Tokenizer.from_gguf(spm_metadata())
    tb = _token_bytes(tok)
    vocab = tok.vocab_size
    byte_ids = [tok.token_to_id(f"<0x{b:02X}>") for b in range(256)]
    assert None not in byte_ids
    rng = random.Random(0)
    for _ in range(300):
        ids = [rng.choice(byte_ids) if rng.random() < 0.7 else rng.randrange(vocab) for _ in range(rng.randrange(1, 9))]
        for end in range(1, len(ids) + 1):
            tail = b"".join(tb.of(i, True) for i in ids[:end])[-4:]
            dec = codecs.getincrementaldecoder("utf-8")(errors="replace")
            dec.decode(tail, final=False)
            assert tb.incomplete(ids, end, True) == len(dec.getstate()[0]), (ids[:end], tail)


def test_stream_decoder_refuses_an_id_outside_the_vocabulary():
    tok = Tokenizer.from_gguf(spm_metadata())
    sd = StreamDecoder(tok)
    with pytest.raises(GraphDSLError, match=rf"StreamDecoder.push: token id {tok.vocab_size} is outside the "
                                            rf"vocabulary \[0, {tok.vocab_size}\)"):
        sd.push(tok.vocab_size)
    with pytest.raises(GraphDSLError, match="token id -1 is outside"):
        sd.push(-1)
