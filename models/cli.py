"""The ``graphdsl`` command line: ``graphdsl demo | generate | chat | dump | bench``."""
from __future__ import annotations

import argparse
import sys

import torch

__all__ = ["main"]


def _demo(args) -> int:
    """Record the seed's matmul, build it, run it on real tensors and show the debugging views."""
    from graphdsl import Tensor, get_default_net
    from graphdsl import functional as F
    out = F.linear(Tensor("x"), Tensor("weight"), None, False, False)
    get_default_net().mark_output(out, "out")
    engine = get_default_net().build_engine()
    x = torch.rand(1000, 2000, dtype=torch.float16)
    w = torch.rand(2000, 3000, dtype=torch.float16)
    buf = torch.empty(1000, 3000, dtype=torch.float16)
    engine.forward({"x": x, "weight": w}, {"out": buf})
    ok = torch.allclose(torch.matmul(x, w), buf, rtol=1e-2, atol=1e-2)
    print(engine.net)
    print(engine.summary())
    print(f"matches torch.matmul: {ok}")
    return 0 if ok else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="graphdsl",
        description="graphdsl: define LLMs as torch-like Python modules, compile them into static engines.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    p = sub.add_parser("demo", help="run the built-in demo")
    p.set_defaults(fn=_demo)
    args = parser.parse_args(argv)
    if not getattr(args, "fn", None):
        parser.print_help()
        return 2
    return args.fn(args)


if __name__ == "__main__":
    sys.exit(main())
