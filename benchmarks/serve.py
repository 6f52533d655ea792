"""Serving benchmark: the OpenAI server (``graphdsl serve``'s app, in its API processes as ``serve``
runs it on CUDA, or with ``--api-processes 0`` on uvicorn in this process) under concurrent streaming
clients, random weights of a real shape.

    python benchmarks/serve.py --shape llama-3-8b [--clients 1 16 64 256] [--seconds 20] [--max-num-seqs N]
                               [--api-processes N]

Each of ``C`` clients (in client processes of their own, at most 16 a process) sends streaming
``/v1/completions`` requests one after another, waiting an
exponential (Poisson) think time between them; prompts are random token ids with ShareGPT-like
random lengths (log-normal, median ~200 tokens) and outputs of 32-256 tokens (``ignore_eos``).
Reported per concurrency: output tokens/s, time to first token and inter-token latency (p50 and
p99, from the arrival times of the server-sent events), and at 1 client the ratio of ITL p50 to
``LLM.generate``'s per-token time on the same model; and what the two sides of the server used
over the level's window (clients' ramp-up and drain included), from /proc: the engine thread's CPU
time as a share of the wall (1.00: it never waited), and the HTTP side's in cores (the API
processes together, or uvicorn's thread). The model is warmed up first as ``graphdsl
serve`` warms it (``LLM.warmup``: each decode bucket and the largest prefill step), and the
header line says how long that took.
"""
import argparse
import asyncio
import json
import math
import os
import random
import socket
import sys
import threading
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import device_line, generate_s  # noqa: E402
from llm import SHAPES  # noqa: E402

from graphdsl.entrypoints.cli import DEFAULT_CUDA_API_PROCESSES  # noqa: E402


def _pct(xs, q):
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


async def _client(http, url, rng, vocab, stop_at, ttft, itl, tokens):
    while time.monotonic() < stop_at:
        plen = int(min(1024, max(16, rng.lognormvariate(math.log(200), 0.6))))
        body = {"model": "bench", "prompt": [rng.randrange(vocab) for _ in range(plen)], "stream": True,
                "max_tokens": rng.randint(32, 256), "temperature": 0, "ignore_eos": True}
        t0 = time.monotonic()
        last = None
        async with http.stream("POST", url, json=body, timeout=600) as r:
            async for line in r.aiter_lines():
                if not line.startswith("data: {"):
                    continue
                now = time.monotonic()
                if last is None:
                    ttft.append(now - t0)
                else:
                    itl.append(now - last)
                last = now
                tokens[0] += 1
        await asyncio.sleep(rng.expovariate(20.0))          # Poisson think time, mean 50 ms


async def _clients(url, first, count, seconds, vocab, seed):
    import httpx
    ttft, itl, tokens = [], [], [0]
    limits = httpx.Limits(max_connections=count + 4, max_keepalive_connections=count + 4)
    async with httpx.AsyncClient(limits=limits) as http:
        t0 = time.monotonic()
        stop_at = t0 + seconds
        await asyncio.gather(*[_client(http, url, random.Random(seed * 1000 + i), vocab, stop_at, ttft, itl, tokens)
                               for i in range(first, first + count)])
        wall = time.monotonic() - t0
    return {"tokens": tokens[0], "wall": wall, "ttft": ttft, "itl": itl}


def _client_process(args):
    """One client process's share of the clients (run in a spawned process)."""
    return asyncio.run(_clients(*args))


def _shares(clients: int, procs: int) -> list[tuple[int, int]]:
    """(first client index, count) of each of ``procs`` client processes, as even as can be."""
    counts = [clients // procs + (p < clients % procs) for p in range(procs)]
    return [(sum(counts[:p]), n) for p, n in enumerate(counts)]


def _cpu_s(pid: int, tid: int | None = None) -> float:
    """CPU time (user + system, seconds) of process ``pid``, or of its thread ``tid``, from /proc
    (0.0 where there is no such entry: not Linux, or it has ended)."""
    path = f"/proc/{pid}/task/{tid}/stat" if tid is not None else f"/proc/{pid}/stat"
    try:
        with open(path) as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _run(url, clients, seconds, vocab, seed):
    """``clients`` streaming clients in their own processes (at most 16 clients a process, half the
    cores), so their HTTP and SSE parsing does not share the server's interpreter lock, as real
    clients would not. Output tokens/s is every token received over the longest process's wall time."""
    import multiprocessing
    procs = max(1, min(-(-clients // 16), (os.cpu_count() or 2) // 2))
    with multiprocessing.get_context("spawn").Pool(procs) as pool:
        parts = pool.map(_client_process, [(url, f, n, seconds, vocab, seed) for f, n in _shares(clients, procs)])
    tokens = sum(p["tokens"] for p in parts)
    return {"tokens": tokens, "tokens_s": tokens / max(p["wall"] for p in parts),
            "ttft": [x for p in parts for x in p["ttft"]], "itl": [x for p in parts for x in p["itl"]]}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="llama-3-8b", choices=sorted(SHAPES))
    ap.add_argument("--clients", type=int, nargs="+", default=[1, 16, 64, 256])
    ap.add_argument("--seconds", type=float, default=20.0, help="sending time per concurrency level")
    ap.add_argument("--api-processes", type=int, default=DEFAULT_CUDA_API_PROCESSES,
                    help="serve HTTP from this many processes of its own, as `graphdsl serve --api-processes`; 0: a "
                         f"uvicorn thread in the engine's process (default {DEFAULT_CUDA_API_PROCESSES}, serve's on CUDA)")
    ap.add_argument("--max-num-seqs", type=int, default=None,
                    help="the server's running-request limit (default: the largest --clients); prefill steps "
                         "are padded to its power of two, so a larger one costs each prefill step more")
    args = ap.parse_args(argv)
    if args.max_num_seqs is not None and args.max_num_seqs < 1:
        ap.error(f"--max-num-seqs must be a positive integer, got {args.max_num_seqs}")
    if args.api_processes < 0:
        ap.error(f"--api-processes must be 0 or a positive integer, got {args.api_processes}")
    if min(args.clients) < 1:
        ap.error(f"--clients must be positive integers, got {args.clients}")
    if not torch.cuda.is_available():
        print("benchmarks/serve.py needs a CUDA GPU", file=sys.stderr)
        return 1
    import uvicorn

    import graphdsl as gd
    from graphdsl.entrypoints.openai_server import build_app
    hf = SHAPES[args.shape]
    llm = gd.LLM.from_config(hf, device="cuda", dtype="bfloat16", seed=0, max_model_len=1536,
                             max_num_seqs=args.max_num_seqs or max(args.clients), kv_cache_memory_fraction=0.8)
    warm = llm.warmup(stream=None)     # what `graphdsl serve` does on CUDA before it listens
    # LLM.generate's per-token time at batch 1 (prompt 511, (257 - 1 tokens) / 256), the ITL reference
    ids = [random.Random(0).randrange(hf["vocab_size"]) for _ in range(511)]
    times = {}
    for n in (1, 257, 1, 257):
        times[n] = generate_s(llm, ids, n)
    gen_ms = (times[257] - times[1]) / 256 * 1e3
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    if args.api_processes:
        from graphdsl.entrypoints.api_processes import start_api_processes
        server = start_api_processes(llm, args.api_processes, sock, served_model_name="bench")
        server.wait_ready()
        engine = server.engine
        http_cpu = lambda: sum(_cpu_s(p.pid) for p in server.processes)      # noqa: E731
    else:
        app = build_app(llm, served_model_name="bench")
        engine = app.state.engine
        server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
        http_thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
        http_thread.start()
        while not server.started:
            time.sleep(0.05)
        http_cpu = lambda: _cpu_s(os.getpid(), http_thread.native_id)          # noqa: E731
    engine_cpu = lambda: _cpu_s(os.getpid(), engine._thread.native_id)        # noqa: E731
    url = f"http://127.0.0.1:{port}/v1/completions"
    http = f"{args.api_processes} API processes" if args.api_processes else "HTTP in the engine's process"
    print(f"{device_line()}; {args.shape} random weights; LLM.generate {gen_ms:.3f} ms/token at batch 1; "
          f"max_num_seqs {llm.max_num_seqs}; {http}; start-up warm-up {warm.seconds:.1f} s", flush=True)
    rows = []
    for c in args.clients:
        t0, e0, h0 = time.monotonic(), engine_cpu(), http_cpu()
        r = _run(url, c, args.seconds, hf["vocab_size"], c)
        wall = time.monotonic() - t0
        busy = f"{(engine_cpu() - e0) / wall:.2f} | {(http_cpu() - h0) / wall:.2f}"
        itl50 = _pct(r["itl"], 0.5) * 1e3
        rows.append(f"| {c} | {r['tokens_s']:,.0f} | {_pct(r['ttft'], 0.5) * 1e3:.1f} | {_pct(r['ttft'], 0.99) * 1e3:.1f} "
                    f"| {itl50:.2f} | {_pct(r['itl'], 0.99) * 1e3:.2f} | {len(r['ttft'])} | {busy} |")
        print(rows[-1], flush=True)
        if c == 1:
            print(f"1 client: ITL p50 {itl50:.3f} ms = {itl50 / gen_ms:.3f}x LLM.generate's {gen_ms:.3f} ms/token",
                  flush=True)
    print("\n| clients | output tokens/s | TTFT p50 ms | TTFT p99 ms | ITL p50 ms | ITL p99 ms | requests "
          "| engine thread CPU | HTTP CPU |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    print("\n".join(rows))
    print(warm)
    print(json.dumps({"generate_ms_per_token": gen_ms, "warmup_s": warm.seconds}))
    if args.api_processes:
        server.close()
    else:
        server.should_exit = True
    return 0


if __name__ == "__main__":
    sys.exit(main())
