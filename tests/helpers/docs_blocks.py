"""Run the code blocks of a markdown doc, so the docs cannot drift from the code.

Every fenced block of a doc is either run or explicitly excused. ``python`` blocks run by default,
in order, in one namespace per doc, in a fresh working directory; any other block needs a marker:
an HTML comment on the line just before its fence::

    <!-- docs-test: DIRECTIVE[; DIRECTIVE ...] -->

Directives:

``skip: REASON``
    not run (a GPU, a real checkpoint, a measured number); the reason, required, is the rest of
    the marker.
``file NAME``
    a ``python`` block written to ``NAME`` in the working directory and run as that file (so the
    source lines graphdsl records read ``NAME:LINE``); a ``yaml`` block is only written there (a
    rule file later blocks load).
``process``
    with ``file NAME``: run as its own process (``python NAME``), with ``TRITON_INTERPRET=1`` when
    there is no GPU (Triton reads it when kernels are defined, so only a fresh process can set it).
``excerpt of NAME``
    every line of the block (but ``...`` lines) is a line of the doc's block ``file NAME``.
``run``
    a shell block: each line is a command (``#`` starts a comment); ``graphdsl ...`` runs in-process
    through the CLI's ``main``, anything else through ``bash``; each must exit 0.
``output`` / ``output start`` / ``output, timings vary``
    the block is what the previous run block printed on stdout: all of it, its first lines (a
    last ``...`` line is dropped), or all of it with decimal numbers and runs of spaces masked.
``replace TEXT=MODEL``
    before running, ``TEXT`` becomes the path of ``MODEL`` (a name the caller maps to a path).
"""
from __future__ import annotations

import contextlib
import io
import os
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass, field

__all__ = ["Block", "parse_blocks", "run_doc", "DocBlockError"]

_FENCE = re.compile(r"^```(\S*)\s*$")
_MARK = re.compile(r"^<!--\s*docs-test:\s*(.*?)\s*-->\s*$")


class DocBlockError(AssertionError):
    """A block that failed, named by doc and line."""


@dataclass
class Block:
    doc: str
    line: int                    # 1-based line of the opening fence
    lang: str
    text: str
    directives: dict = field(default_factory=dict)

    @property
    def where(self) -> str:
        return f"{self.doc}:{self.line}"


def parse_blocks(path: str) -> list[Block]:
    """The fenced blocks of ``path`` with the directives of the marker just above each."""
    lines = open(path, encoding="utf-8").read().split("\n")
    blocks, i, doc = [], 0, os.path.basename(path)
    while i < len(lines):
        m = _FENCE.match(lines[i])
        if m is None:
            i += 1
            continue
        j = i + 1
        while j < len(lines) and lines[j].rstrip() != "```":
            j += 1
        if j == len(lines):
            raise DocBlockError(f"{doc}:{i + 1}: unclosed code block")
        prev = next((lines[k] for k in range(i - 1, -1, -1) if lines[k].strip()), "")
        mark = _MARK.match(prev.strip())
        blocks.append(Block(doc, i + 1, m.group(1), "\n".join(lines[i + 1:j]) + "\n",
                            _directives(mark.group(1), f"{doc}:{i + 1}") if mark else {}))
        i = j + 1
    return blocks


def _directives(text: str, where: str) -> dict:
    out: dict = {}
    if text.startswith("skip:"):                 # the reason is the rest, semicolons and all
        if not text[5:].strip():
            raise DocBlockError(f"{where}: skip needs a reason (skip: REASON)")
        return {"skip": text[5:].strip()}
    for part in (p.strip() for p in text.split(";")):
        if part.startswith("file "):
            out["file"] = part[5:].strip()
        elif part.startswith("excerpt of "):
            out["excerpt"] = part[len("excerpt of "):].strip()
        elif part in ("run", "process"):
            out[part] = True
        elif part in ("output", "output start", "output, timings vary"):
            out["output"] = part
        elif part.startswith("replace ") and "=" in part:
            text_, model = part[len("replace "):].rsplit("=", 1)
            out.setdefault("replace", []).append((text_.strip(), model.strip()))
        else:
            raise DocBlockError(f"{where}: unknown docs-test directive {part!r} (see tests/helpers/docs_blocks.py)")
    return out


def run_doc(path: str, workdir: str, models: dict[str, str] | None = None) -> list[Block]:
    """Run or check every block of ``path`` in ``workdir``; return the blocks that ran or were checked.
    ``models`` maps the names ``replace`` directives use to paths."""
    blocks = parse_blocks(path)
    files = {b.directives["file"]: b for b in blocks if "file" in b.directives}
    scope: dict = {"__name__": "__docs__"}
    last = None                  # (block, stdout) of the last block that ran
    done = []
    for b in blocks:
        d = b.directives
        if "skip" in d:
            continue
        text = b.text
        for old, model in d.get("replace", ()):
            if model not in (models or {}):
                raise DocBlockError(f"{b.where}: no model {model!r} for replace (have {sorted(models or {})})")
            text = text.replace(old, models[model])
        if "excerpt" in d:
            _check_excerpt(b, files)
        elif "output" in d:
            if last is None:
                raise DocBlockError(f"{b.where}: an output block with no block run before it")
            _check_output(b, d["output"], *last)
        elif b.lang == "python":
            last = (b, _run_python(b, text, scope, workdir))
        elif b.lang == "yaml" and "file" in d:
            with open(os.path.join(workdir, d["file"]), "w", encoding="utf-8") as f:
                f.write(text)
        elif d.get("run"):
            last = (b, _run_shell(b, text, workdir))
        else:
            raise DocBlockError(f"{b.where}: a ```{b.lang or '(no language)'} block needs a docs-test marker "
                                "(run, output, excerpt of, or skip: reason)")
        done.append(b)
    return done


def _run_python(b: Block, text: str, scope: dict, workdir: str) -> str:
    name = b.directives.get("file")
    if name:
        with open(os.path.join(workdir, name), "w", encoding="utf-8") as f:
            f.write(text)
    if b.directives.get("process"):
        if not name:
            raise DocBlockError(f"{b.where}: process needs file NAME")
        import torch
        env = dict(os.environ)
        if not torch.cuda.is_available():
            env["TRITON_INTERPRET"] = "1"
        r = subprocess.run([sys.executable, name], cwd=workdir, env=env, capture_output=True, text=True, timeout=600)
        if r.returncode:
            raise DocBlockError(f"{b.where}: python {name} exited {r.returncode}:\n{r.stderr}")
        return r.stdout
    out = io.StringIO()
    try:
        with contextlib.redirect_stdout(out):
            exec(compile(text, name or b.where, "exec"), scope)
    except Exception as e:
        raise DocBlockError(f"{b.where}: the python block raised {type(e).__name__}: {e}\n--- stdout so far:\n"
                            f"{out.getvalue()}") from e
    return out.getvalue()


def _run_shell(b: Block, text: str, workdir: str) -> str:
    from graphdsl.entrypoints.cli import main
    out = io.StringIO()
    env = dict(os.environ, PATH=os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", ""))
    for raw in text.splitlines():
        line = raw.split(" #")[0].strip() if not raw.lstrip().startswith("#") else ""
        if not line:
            continue
        argv = shlex.split(line)
        if argv[0] == "graphdsl":
            err = io.StringIO()
            with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err), \
                    _stdin(io.StringIO("")):
                try:
                    code = main(argv[1:])
                except SystemExit as e:
                    code = e.code
            if code not in (0, None):
                raise DocBlockError(f"{b.where}: `{line}` exited {code}:\n{err.getvalue()}")
        else:
            r = subprocess.run(["bash", "-c", line], cwd=workdir, env=env, capture_output=True, text=True,
                               timeout=600)
            if r.returncode:
                raise DocBlockError(f"{b.where}: `{line}` exited {r.returncode}:\n{r.stderr}")
            out.write(r.stdout)
    return out.getvalue()


@contextlib.contextmanager
def _stdin(stream):
    saved, sys.stdin = sys.stdin, stream
    try:
        yield
    finally:
        sys.stdin = saved


def _lines(text: str) -> list[str]:
    return [s.rstrip() for s in text.rstrip("\n").split("\n")]


def _mask(line: str) -> str:
    return re.sub(r" +", " ", re.sub(r"\d+\.\d+", "#", line)).strip()


def _check_output(b: Block, mode: str, ran: Block, stdout: str) -> None:
    want, got = _lines(b.text), _lines(stdout)
    if mode == "output start":
        if want and want[-1].strip() == "...":
            want = want[:-1]
        got = got[:len(want)]
    elif mode == "output, timings vary":
        want, got = [_mask(s) for s in want], [_mask(s) for s in got]
    if want != got:
        diff = "\n".join(f"  doc: {w!r}\n  ran: {g!r}" for w, g in zip(want + [""] * len(got), got + [""] * len(want))
                         if w != g)
        raise DocBlockError(f"{b.where}: the output shown differs from what {ran.where} prints ({mode}):\n{diff}")


def _check_excerpt(b: Block, files: dict[str, Block]) -> None:
    name = b.directives["excerpt"]
    if name not in files:
        raise DocBlockError(f"{b.where}: excerpt of {name!r}, but the doc has no block `file {name}`")
    have = {s.strip() for s in files[name].text.splitlines()}
    missing = [s for s in b.text.splitlines() if s.strip() and "..." not in s and s.strip() not in have]
    if missing:
        raise DocBlockError(f"{b.where}: lines not in {name}: {missing}")
