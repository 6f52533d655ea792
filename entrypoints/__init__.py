"""graphdsl.entrypoints — what users call: the :class:`LLM` API and the ``graphdsl`` command line.

This room may import every other room; nothing imports it (but the lazy ``gd.LLM`` re-export)."""
from .llm import LLM

__all__ = ["LLM"]
