"""Tokenizers for generation: HF ``tokenizer.json`` directories and GGUF-embedded vocabularies.

:class:`Tokenizer` wraps a fast ``tokenizers.Tokenizer`` plus what generation needs around it:
the BOS id, the set of EOS ids (tokenizer config, ``generation_config.json``, GGUF eos/eot/eom),
and the chat template, rendered in a sandboxed jinja2 environment with HF's conventions
(``trim_blocks``, ``lstrip_blocks``, ``raise_exception``, ``bos_token``/``eos_token`` variables).

GGUF vocabularies (``tokenizer.ggml.*``) are rebuilt as ``tokenizers`` models:

- ``gpt2``: byte-level BPE over the file's tokens and merges; the split regex comes from
  ``tokenizer.ggml.pre`` (GPT-2's when unknown); control tokens (type 3) become special added
  tokens, user-defined ones (type 4) plain added tokens.
- ``llama``: SentencePiece-style BPE with byte fallback; merges are recovered from the vocabulary
  (every split of a token into two vocabulary pieces, ranked by the merged token's score), which
  reproduces llama.cpp's "merge the highest-scoring adjacent pair" loop.

:class:`StreamDecoder` turns a token stream into text increments: it re-decodes a short window of
recent ids and only emits text once the tokens' bytes no longer end inside a multi-byte UTF-8
character, so characters split across tokens come out whole, and a genuine U+FFFD passes.
"""
from __future__ import annotations

import codecs
import json
import os
import re
import weakref
from datetime import datetime
from typing import Any, Iterable

from graphdsl.errors import GraphDSLError

from .jsonfile import read_json_object

__all__ = ["Tokenizer", "StreamDecoder"]

# llama.cpp token types (gguf TokenType)
_NORMAL, _UNKNOWN, _CONTROL, _USER_DEFINED, _UNUSED, _BYTE = 1, 2, 3, 4, 5, 6

_GPT2_SPLIT = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")

# DeepSeek's pre-tokenizers (their tokenizer.json): newlines, cased-letter runs, ASCII/full-width punctuation
# runs, trailing spaces, CJK/Hangul runs, digit runs; V3: digits in threes, CJK/kana runs, then Llama-3-like
_DEEPSEEK_LLM_SPLITS = (r"[\r\n]", r"\s?\p{LC}+",
                        r"\s?[!-/:-~\uff01-\uff0f\uff1a-\uff5e\u2018-\u201f\u3000-\u3002]+", r"\s+$",
                        r"[\u4e00-\u9fa5\u0800-\u4e00\uac00-\ud7ff]+", r"\p{N}+")
_DEEPSEEK_V3_SPLITS = (r"\p{N}{1,3}", r"[\u4e00-\u9fa5\u3040-\u309f\u30a0-\u30ff]+",
                       r"[!\"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+"
                       r"| ?[\p{P}\p{S}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")

# tokenizer.ggml.pre -> (split regexes applied in order, ignore_merges)
_PRE_SPLITS: dict[str, tuple[tuple[str, ...], bool]] = {
    "default": ((_GPT2_SPLIT,), False),
    "gpt2": ((_GPT2_SPLIT,), False),
    "smollm": ((r"\p{N}", _GPT2_SPLIT), False),       # SmolLM: single digits, then GPT-2 split
    "llama3": ((_LLAMA3_SPLIT,), True),
    "llama-v3": ((_LLAMA3_SPLIT,), True),
    "llama-bpe": ((_LLAMA3_SPLIT,), True),
    "smaug-bpe": ((_LLAMA3_SPLIT,), True),
    "qwen2": ((_QWEN2_SPLIT,), False),
    "deepseek-r1-qwen": ((_QWEN2_SPLIT,), False),
    "deepseek-llm": (_DEEPSEEK_LLM_SPLITS, False),    # DeepSeek LLM / V2
    "deepseek-v3": (_DEEPSEEK_V3_SPLITS, False),
}

_GGUF_MODELS = ("gpt2", "llama")


def _token_str(v: Any) -> str | None:
    """A special-token entry of tokenizer_config.json: a string, ``{"content": ...}`` or None."""
    if isinstance(v, dict):
        v = v.get("content")
    return v if isinstance(v, str) else None


def _ids(v: Any) -> list[int]:
    if v is None:
        return []
    if isinstance(v, int) and not isinstance(v, bool):
        return [v]
    if isinstance(v, (list, tuple)):
        return [int(x) for x in v]
    return []


class Tokenizer:
    """A fast tokenizer with the special ids and chat template generation needs."""

    def __init__(self, backend, *, bos_token_id: int | None = None,
                 eos_token_ids: Iterable[int] = (), chat_template: str | None = None,
                 add_bos: bool = False, add_eos: bool = False, source: str = "<memory>") -> None:
        self.backend = backend
        self.bos_token_id = bos_token_id
        self.eos_token_ids: set[int] = set(eos_token_ids)
        self.chat_template = chat_template
        self.add_bos = add_bos
        self.add_eos = add_eos
        self.source = source
        self._template = None

    def __getstate__(self) -> dict:
        """Pickled without the compiled chat template (made again on first use): ``graphdsl serve
        --api-processes`` sends the tokenizer to its API processes."""
        return {**self.__dict__, "_template": None}

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_pretrained(cls, model_dir: str | os.PathLike) -> "Tokenizer":
        """Load ``tokenizer.json`` (+ ``tokenizer_config.json``, chat template files,
        ``generation_config.json``) from a HF model directory."""
        from tokenizers import Tokenizer as _Backend

        model_dir = os.fspath(model_dir)
        if not os.path.isdir(model_dir):
            raise GraphDSLError(f"tokenizer directory {model_dir!r} does not exist")
        tj = os.path.join(model_dir, "tokenizer.json")
        if not os.path.isfile(tj):
            present = sorted(f for f in os.listdir(model_dir) if "token" in f)
            raise GraphDSLError(
                f"{model_dir!r} has no tokenizer.json (graphdsl needs the fast-tokenizer file; "
                f"found {present or 'no tokenizer files'})")
        try:
            backend = _Backend.from_file(tj)
        except Exception as e:
            raise GraphDSLError(f"cannot load {tj!r}: {str(e).splitlines()[0]}") from None

        cfg_path = os.path.join(model_dir, "tokenizer_config.json")
        cfg = read_json_object(cfg_path) if os.path.isfile(cfg_path) else {}

        def tid(key: str) -> int | None:
            tok = _token_str(cfg.get(key))
            return backend.token_to_id(tok) if tok is not None else None

        bos = tid("bos_token")
        eos = set(x for x in [tid("eos_token")] if x is not None)
        gen_path = os.path.join(model_dir, "generation_config.json")
        if os.path.isfile(gen_path):
            gen = read_json_object(gen_path)
            eos.update(_ids(gen.get("eos_token_id")))
            if bos is None and isinstance(gen.get("bos_token_id"), int):
                bos = gen["bos_token_id"]

        # BOS/EOS insertion is tokenizer.json's post-processor's job here, as in transformers
        # (which ignores tokenizer_config's add_bos_token for tokenizer.json-backed tokenizers)
        template = cls._find_template(model_dir, cfg)
        return cls(backend, bos_token_id=bos, eos_token_ids=eos, chat_template=template,
                   source=model_dir)

    @staticmethod
    def _find_template(model_dir: str, cfg: dict) -> str | None:
        jinja = os.path.join(model_dir, "chat_template.jinja")
        if os.path.isfile(jinja):
            with open(jinja, encoding="utf-8") as f:
                return f.read()
        t = cfg.get("chat_template")
        ctj = os.path.join(model_dir, "chat_template.json")
        if t is None and os.path.isfile(ctj):
            t = read_json_object(ctj).get("chat_template")
        if isinstance(t, list):  # [{"name": "default", "template": ...}, ...]
            named = {d.get("name"): d.get("template") for d in t if isinstance(d, dict)}
            t = named.get("default") or next(iter(named.values()), None)
        return t if isinstance(t, str) else None

    @classmethod
    def from_gguf(cls, metadata: dict[str, Any], *, source: str = "<gguf>") -> "Tokenizer":
        """Build the tokenizer a GGUF's ``tokenizer.ggml.*`` metadata describes."""
        model = metadata.get("tokenizer.ggml.model")
        tokens = metadata.get("tokenizer.ggml.tokens")
        if model not in _GGUF_MODELS:
            raise GraphDSLError(f"{source}: tokenizer.ggml.model is {model!r}; graphdsl builds "
                                f"GGUF tokenizers of type {list(_GGUF_MODELS)}")
        if not isinstance(tokens, list) or not tokens:
            raise GraphDSLError(f"{source}: tokenizer.ggml.tokens is missing or empty")
        types = metadata.get("tokenizer.ggml.token_type") or [_NORMAL] * len(tokens)
        if len(types) != len(tokens):
            raise GraphDSLError(f"{source}: tokenizer.ggml.token_type has {len(types)} entries "
                                f"for {len(tokens)} tokens")
        if model == "gpt2":
            backend = _gguf_bpe(metadata, tokens, types, source)
            default_bos = False
        else:
            backend = _gguf_spm(metadata, tokens, types, source)
            default_bos = True

        def meta_id(key: str) -> int | None:
            v = metadata.get(f"tokenizer.ggml.{key}")
            if v is None:
                return None
            if not (isinstance(v, int) and 0 <= v < len(tokens)):
                raise GraphDSLError(f"{source}: tokenizer.ggml.{key} = {v!r} is not a token id "
                                    f"in [0, {len(tokens)})")
            return v

        bos = meta_id("bos_token_id")
        eos = {i for i in (meta_id("eos_token_id"), meta_id("eot_token_id"),
                           meta_id("eom_token_id")) if i is not None}
        template = metadata.get("tokenizer.chat_template")
        return cls(backend, bos_token_id=bos, eos_token_ids=eos,
                   chat_template=template if isinstance(template, str) else None,
                   add_bos=bool(metadata.get("tokenizer.ggml.add_bos_token", default_bos))
                   and bos is not None,
                   add_eos=bool(metadata.get("tokenizer.ggml.add_eos_token", False))
                   and meta_id("eos_token_id") is not None,
                   source=source)

    # ------------------------------------------------------------------ encode / decode
    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    def token_to_id(self, token: str) -> int | None:
        return self.backend.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        return self.backend.id_to_token(token_id)

    @property
    def bos_token(self) -> str | None:
        return None if self.bos_token_id is None else self.backend.id_to_token(self.bos_token_id)

    @property
    def eos_token(self) -> str | None:
        """The primary EOS token string (the lowest EOS id)."""
        return None if not self.eos_token_ids else self.backend.id_to_token(min(self.eos_token_ids))

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text``; with ``add_special_tokens`` the BOS (and EOS) the model wants."""
        if not isinstance(text, str):
            raise GraphDSLError(f"encode: text must be a str, got {type(text).__name__}")
        ids = self.backend.encode(text, add_special_tokens=add_special_tokens).ids
        if add_special_tokens:
            # tokenizer.json's post-processor usually adds these; add them when it does not
            if self.add_bos and self.bos_token_id is not None and ids[:1] != [self.bos_token_id]:
                ids = [self.bos_token_id] + ids
            eos = min(self.eos_token_ids) if self.eos_token_ids else None
            if self.add_eos and eos is not None and ids[-1:] != [eos]:
                ids = ids + [eos]
        return ids

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        ids = [int(i) for i in ids]
        n = self.vocab_size
        if ids and (min(ids) < 0 or max(ids) >= n):
            bad = [i for i in ids if not 0 <= i < n]
            raise GraphDSLError(f"decode: ids outside the vocabulary [0, {n}): {bad[:8]}")
        return self.backend.decode(ids, skip_special_tokens=skip_special_tokens)

    # ------------------------------------------------------------------ chat
    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            **extra: Any) -> str:
        """Render ``messages`` (``[{"role": ..., "content": ...}, ...]``) with the model's template."""
        if not self.chat_template:
            raise GraphDSLError(
                f"the tokenizer from {self.source} has no chat template (no chat_template in "
                f"tokenizer_config.json / chat_template.jinja, or tokenizer.chat_template in the "
                f"GGUF); pass a plain prompt instead of chat messages")
        if not isinstance(messages, list) or not all(
                isinstance(m, dict) and isinstance(m.get("role"), str) and "content" in m
                for m in messages):
            raise GraphDSLError("apply_chat_template: messages must be a list of dicts with "
                                f"'role' (str) and 'content', got {messages!r}"[:400])
        import jinja2

        if self._template is None:
            self._template = _compile_template(self.chat_template)
        try:
            return self._template.render(
                messages=messages, add_generation_prompt=add_generation_prompt,
                bos_token=self.bos_token or "", eos_token=self.eos_token or "", **extra)
        except jinja2.TemplateError as e:
            raise GraphDSLError(f"chat template of {self.source} failed: {e}") from None

    def __repr__(self) -> str:
        return (f"Tokenizer(vocab_size={self.vocab_size}, bos={self.bos_token_id}, "
                f"eos={sorted(self.eos_token_ids)}, chat_template={self.chat_template is not None}, "
                f"source={self.source!r})")


def _compile_template(source: str):
    import jinja2
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str):
        raise jinja2.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                          sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    try:
        return env.from_string(source)
    except jinja2.TemplateSyntaxError as e:
        raise GraphDSLError(f"chat template does not parse (line {e.lineno}): {e.message}") from None


# ---------------------------------------------------------------------- GGUF vocabularies

def _with_added_tokens(backend, tokens: list[str], types: list[int]):
    """Register the vocabulary's control and user-defined tokens on ``backend``; return it."""
    special, user = _added_tokens(tokens, types)
    if special:
        backend.add_special_tokens(special)
    if user:
        backend.add_tokens(user)
    return backend


def _added_tokens(tokens: list[str], types: list[int], keep=lambda t: True):
    from tokenizers import AddedToken

    special = [AddedToken(t, special=True, normalized=False)
               for t, ty in zip(tokens, types) if ty == _CONTROL and keep(t)]
    user = [AddedToken(t, special=False, normalized=False)
            for t, ty in zip(tokens, types) if ty == _USER_DEFINED and keep(t)]
    return special, user


def _gguf_bpe(metadata: dict, tokens: list[str], types: list[int], source: str):
    from tokenizers import Regex, Tokenizer as _Backend, decoders, models, pre_tokenizers

    merges_raw = metadata.get("tokenizer.ggml.merges")
    if not isinstance(merges_raw, list):
        raise GraphDSLError(f"{source}: a gpt2 (BPE) tokenizer needs tokenizer.ggml.merges")
    merges = []
    for i, m in enumerate(merges_raw):
        parts = m.split(" ")
        if len(parts) != 2:
            raise GraphDSLError(f"{source}: tokenizer.ggml.merges[{i}] = {m!r} is not 'left right'")
        merges.append((parts[0], parts[1]))
    vocab = {}
    for i, t in enumerate(tokens):
        vocab.setdefault(t, i)
    pre = metadata.get("tokenizer.ggml.pre", "default")
    splits, ignore_merges = _PRE_SPLITS.get(pre, _PRE_SPLITS["default"])
    try:
        model = models.BPE(vocab=vocab, merges=merges, ignore_merges=ignore_merges)
    except Exception as e:  # tokenizers reports a merge over a token missing from the vocab
        raise GraphDSLError(f"{source}: tokenizer.ggml.merges do not fit tokenizer.ggml.tokens: "
                            f"{str(e).strip()}") from None
    backend = _Backend(model)
    backend.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(s), behavior="isolated") for s in splits]
        + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    backend.decoder = decoders.ByteLevel()
    return _with_added_tokens(backend, tokens, types)


def _gguf_spm(metadata: dict, tokens: list[str], types: list[int], source: str):
    from tokenizers import Tokenizer as _Backend, decoders, models, pre_tokenizers

    scores = metadata.get("tokenizer.ggml.scores")
    if not isinstance(scores, list) or len(scores) != len(tokens):
        raise GraphDSLError(f"{source}: a llama (SentencePiece) tokenizer needs "
                            f"tokenizer.ggml.scores with one score per token "
                            f"({len(tokens)}), got {None if scores is None else len(scores)}")
    vocab: dict[str, int] = {}
    for i, t in enumerate(tokens):
        vocab.setdefault(t, i)
    unk_id = metadata.get("tokenizer.ggml.unknown_token_id")
    unk = tokens[unk_id] if isinstance(unk_id, int) and 0 <= unk_id < len(tokens) else None
    mergeable = {t for t, ty in zip(tokens, types) if ty in (_NORMAL, _USER_DEFINED)}
    ranked = []
    for t in mergeable:
        for cut in range(1, len(t)):
            left, right = t[:cut], t[cut:]
            if left in vocab and right in vocab:
                ranked.append((-scores[vocab[t]], vocab[left], vocab[right], left, right))
    ranked.sort()
    merges = [(left, right) for *_, left, right in ranked]
    model = models.BPE(vocab=vocab, merges=merges, unk_token=unk, fuse_unk=True,
                       byte_fallback=any(ty == _BYTE for ty in types))
    backend = _Backend(model)
    prefix = bool(metadata.get("tokenizer.ggml.add_space_prefix", True))
    backend.pre_tokenizer = pre_tokenizers.Metaspace(
        replacement="\u2581", prepend_scheme="first" if prefix else "never", split=False)
    steps = [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()]
    if prefix:
        steps.append(decoders.Strip(" ", 1, 0))
    backend.decoder = decoders.Sequence(steps)
    return _with_added_tokens(backend, tokens, types)


# ---------------------------------------------------------------------- streaming

class StreamDecoder:
    """Incremental detokenizer: ``push(id)`` returns only the text that id completed.

    Keeps ``prefix_offset`` (start of a short context window, so tokenizers that strip a leading
    space decode the new token's space correctly) and ``read_offset`` (ids already emitted).
    Text whose bytes end inside a multi-byte UTF-8 character (a byte-level BPE or byte-fallback
    token holding only its first bytes) is held back until the character's last byte arrives; a
    U+FFFD the tokens spell out whole (its three bytes) is text like any other. For a decoder that
    builds no text from bytes nothing is ever incomplete; one it cannot read holds back text that
    ends in U+FFFD. ``"".join(pushes) + flush()`` equals ``tokenizer.decode(all_ids)`` (except
    where a run of byte-fallback tokens holds invalid bytes: ``decode`` turns the whole run into
    U+FFFD, the stream only the invalid bytes); ``flush(drop_incomplete=True)`` leaves an incomplete
    trailing character out instead of ending in U+FFFD (vLLM's final text). ``flush`` ends the stream.
    """

    def __init__(self, tokenizer: Tokenizer, *, skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.ids: list[int] = []
        self.prefix_offset = 0
        self.read_offset = 0
        self.text = ""
        self._bytes = _token_bytes(tokenizer)
        self._vocab = tokenizer.vocab_size

    def _decode(self, ids: list[int]) -> str:
        """The text of ``ids`` (checked as :meth:`push` took them: no second check a window)."""
        return self.tokenizer.backend.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def _incomplete(self, end: int) -> int:
        """How many bytes at the end of ``ids[:end]``'s text start a character not finished yet
        (0 to 3); 0 when the decoder builds no text from bytes or cannot be read."""
        if self._bytes is None:
            return 0
        return self._bytes.incomplete(self.ids, end, self.skip_special_tokens)

    def push(self, token_id: int) -> str:
        token_id = int(token_id)
        if not 0 <= token_id < self._vocab:
            raise GraphDSLError(f"StreamDecoder.push: token id {token_id} is outside the vocabulary [0, {self._vocab})")
        self.ids.append(token_id)
        if self._incomplete(len(self.ids)):
            return ""
        prefix = self._decode(self.ids[self.prefix_offset:self.read_offset])
        full = self._decode(self.ids[self.prefix_offset:])
        if len(full) > len(prefix) and (self._bytes is not None or not full.endswith("\ufffd")):
            new = full[len(prefix):]
            self.prefix_offset = self.read_offset
            self.read_offset = len(self.ids)
            self.text += new
            return new
        return ""

    def flush(self, *, drop_incomplete: bool = False) -> str:
        """Text still held back: with a trailing incomplete character as U+FFFD (what
        ``tokenizer.decode`` gives), or without it when ``drop_incomplete``."""
        tail = self._incomplete(len(self.ids)) if drop_incomplete else 0
        end, rest = len(self.ids), ""
        if tail:
            end, rest = self._before_tail(tail)
        prefix = self._decode(self.ids[self.prefix_offset:self.read_offset])
        full = self._decode(self.ids[self.prefix_offset:end])
        new = full[len(prefix):] + rest
        self.prefix_offset = self.read_offset = len(self.ids)
        self.text += new
        return new

    def _before_tail(self, tail: int) -> tuple[int, str]:
        """``(end, rest)``: the held ids ``ids[:end]`` end on a character boundary, and ``rest`` is
        the complete text of ``ids[end:]`` before the last ``tail`` bytes (a byte-level token may
        hold a space and the first byte of a character)."""
        got, end = b"", len(self.ids)
        while end > self.read_offset:
            end -= 1
            got = self._bytes.of(self.ids[end], self.skip_special_tokens) + got
            if len(got) >= tail and not self._incomplete(end):
                break
        return end, got[:-tail].decode("utf-8", errors="replace")


_UTF8_DECODER = codecs.getincrementaldecoder("utf-8")
_BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")


def _byte_level_chars() -> dict[str, int]:
    """GPT-2's byte-level alphabet: the printable stand-in character of each byte -> the byte."""
    keep = {*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)}
    out, extra = {}, 0
    for b in range(256):
        if b in keep:
            out[chr(b)] = b
        else:
            out[chr(256 + extra)] = b
            extra += 1
    return out


_BYTE_LEVEL_CHARS = _byte_level_chars()


class _TokenBytes:
    """The bytes each token decodes to, for the two decoders of ``tokenizers`` that build text from
    bytes: ``ByteLevel`` (GPT-2's stand-in alphabet; a token with a character outside it is its
    own UTF-8, as that decoder does) and ``ByteFallback`` (``<0xE6>`` is one byte; other tokens are
    text, ``\u2581`` a space). Skipped special tokens are no bytes."""

    def __init__(self, backend, byte_level: bool):
        self.backend, self.byte_level = backend, byte_level
        self.special = {i for i, t in backend.get_added_tokens_decoder().items() if t.special}
        self._cache: dict[int, bytes] = {}

    def of(self, token_id: int, skip_special_tokens: bool) -> bytes:
        if skip_special_tokens and token_id in self.special:
            return b""
        got = self._cache.get(token_id)
        if got is None:
            got = self._cache[token_id] = self._bytes(self.backend.id_to_token(token_id) or "")
        return got

    def _bytes(self, token: str) -> bytes:
        if self.byte_level:
            try:
                return bytes(_BYTE_LEVEL_CHARS[c] for c in token)
            except KeyError:
                return token.encode("utf-8")
        m = _BYTE_TOKEN.fullmatch(token)
        return bytes([int(m.group(1), 16)]) if m else token.replace("\u2581", " ").encode("utf-8")

    def incomplete(self, ids: list[int], end: int, skip_special_tokens: bool) -> int:
        """How many of the last bytes of ``ids[:end]`` start a character still missing bytes. An
        ASCII last byte ends every character (most tokens of most text): 0 without decoding."""
        tail = b""
        while end > 0 and len(tail) < 4:           # a UTF-8 character has at most four bytes
            end -= 1
            tail = self.of(ids[end], skip_special_tokens) + tail
            if tail and tail[-1] < 0x80:
                return 0
        decoder = _UTF8_DECODER(errors="replace")
        decoder.decode(tail, final=False)
        return len(decoder.getstate()[0])


_TOKEN_BYTES: "weakref.WeakKeyDictionary[Tokenizer, _TokenBytes | _NoBytes | None]" = weakref.WeakKeyDictionary()


def _token_bytes(tokenizer: Tokenizer) -> "_TokenBytes | _NoBytes | None":
    """``tokenizer``'s token bytes (cached per tokenizer); :class:`_NoBytes` for a decoder that
    builds no text from bytes; None when the decoder cannot be read."""
    if tokenizer not in _TOKEN_BYTES:
        _TOKEN_BYTES[tokenizer] = _read_token_bytes(tokenizer.backend)
    return _TOKEN_BYTES[tokenizer]


def _read_token_bytes(backend) -> "_TokenBytes | _NoBytes | None":
    decoder = getattr(backend, "decoder", None)
    if decoder is None:
        return _NoBytes()
    try:
        spec = json.loads(decoder.__getstate__())
    except Exception:  # noqa: BLE001 - a decoder without a JSON state: fall back to the U+FFFD rule
        return None
    kinds = _decoder_types(spec)
    if "ByteLevel" in kinds or "ByteFallback" in kinds:
        return _TokenBytes(backend, byte_level="ByteLevel" in kinds)
    return _NoBytes()


class _NoBytes:
    """A decoder that builds no text from bytes: no character is ever incomplete."""

    def incomplete(self, ids: list[int], end: int, skip_special_tokens: bool) -> int:
        return 0


def _decoder_types(spec) -> set[str]:
    """The ``type`` of a serialized ``tokenizers`` decoder and of those in its ``Sequence``."""
    if not isinstance(spec, dict):
        return set()
    inner = spec.get("decoders") or []
    return {spec.get("type")} | set().union(*(_decoder_types(d) for d in inner))
