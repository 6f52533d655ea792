"""Host cost of the serving loop's step inputs with block tables: the tables as Python lists (the
loop's way before session 34: a flat list of every entry, converted int by int) against the
``BlockManager``'s int32 arrays copied row by row (``scheduler.padded_rows``), both through
``to_device`` (one pinned, non-blocking copy), with the stream kept busy as under the overlapped loop.

    python benchmarks/host_inputs.py [--calls 200]

Prints, per step shape, the host CPU µs (``time.thread_time``) and wall µs of a call, the median of
the calls, and checks that both ways copy the same values.
"""
import argparse
import array
import os
import random
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import device_line  # noqa: E402

WIDTH = 96          # blocks a row: max_model_len 1536 at 16 tokens a block, as benchmarks/serve.py


def _steps(rng):
    """(name, rows' block tables, other fields): decode batches and a mixed prefill step."""
    out = []
    for rows in (16, 64, 256):
        tables = [array.array("i", (rng.randrange(1 << 20) for _ in range(rng.randrange(8, WIDTH + 1))))
                  for _ in range(rows)]
        out.append((f"decode rows, {rows} x {WIDTH} blocks", tables, {
            "input_ids": ([rng.randrange(128000) for _ in range(rows)], torch.int64),
            "positions": ([rng.randrange(1500) for _ in range(rows)], torch.int64),
            "seq_lens": ([rng.randrange(1500) for _ in range(rows)], torch.int32)}))
    n, rows = 884, 237
    tables = [array.array("i", (rng.randrange(1 << 20) for _ in range(rng.randrange(8, WIDTH + 1)))) for _ in range(rows)]
    out.append((f"mixed step, {n} tokens, {rows} x {WIDTH} blocks", tables, {
        "input_ids": ([rng.randrange(128000) for _ in range(n)], torch.int64), "positions": (list(range(n)), torch.int64),
        "slot_mapping": (list(range(n)), torch.int64), "lm_head_indices": (list(range(rows)), torch.int64),
        "seq_lens": (list(range(rows)), torch.int32), "query_start_loc": (list(range(rows + 1)), torch.int32)}))
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calls", type=int, default=200)
    args = ap.parse_args(argv)
    if args.calls < 10:
        ap.error(f"--calls must be at least 10, got {args.calls}")
    if not torch.cuda.is_available():
        print("benchmarks/host_inputs.py needs a CUDA GPU", file=sys.stderr)
        return 1
    from graphdsl.runtime.serving.scheduler import padded_rows, to_device
    dev = torch.device("cuda")

    def as_lists(tables, fields):        # before: each table a list, padded and flattened entry by entry
        lists = [list(t) for t in tables]
        flat = [b for t in lists for b in t + [0] * (WIDTH - len(t))]
        return to_device(dev, {**fields, "block_tables": (flat, torch.int32)},
                         shapes={"block_tables": (len(tables), WIDTH)})

    def as_arrays(tables, fields):       # now
        return to_device(dev, {**fields, "block_tables": (padded_rows(tables, WIDTH), torch.int32)},
                         shapes={"block_tables": (len(tables), WIDTH)})

    print(device_line())
    print("| step inputs | tables as lists: CPU µs | wall µs | tables as arrays: CPU µs | wall µs |")
    print("|---|---:|---:|---:|---:|")
    for name, tables, fields in _steps(random.Random(0)):
        cells = []
        for fn in (as_lists, as_arrays):
            for _ in range(10):
                fn(tables, fields)
            cpu, wall = [], []
            for i in range(args.calls):
                if i % 20 == 0:
                    torch.cuda._sleep(2_000_000)         # keep the stream busy, as a step in flight does
                c0, w0 = time.thread_time(), time.perf_counter()
                fn(tables, fields)
                cpu.append(time.thread_time() - c0)
                wall.append(time.perf_counter() - w0)
            torch.cuda.synchronize()
            cells += [f"{statistics.median(cpu) * 1e6:.1f}", f"{statistics.median(wall) * 1e6:.1f}"]
        a, b = as_lists(tables, fields), as_arrays(tables, fields)
        if any(not torch.equal(a[k], b[k]) for k in a):
            raise SystemExit(f"host_inputs: the two ways copied different values for {name}")
        print(f"| {name} | " + " | ".join(cells) + " |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
