"""``python -m graphdsl ...`` (and ``torchrun --nproc-per-node N -m graphdsl ...``): the command line."""
import sys

from graphdsl.entrypoints.cli import main

__all__: list[str] = []

if __name__ == "__main__":
    sys.exit(main())
