"""benchmarks/loop_sass.py: the decode GEMV's launch captured from ``gemv`` without running it, and
its K loop compiled for Hopper and counted on a machine without a GPU."""
import os
import pathlib
import subprocess
import sys

import pytest
import torch

from tests.helpers import benchmarks


@pytest.fixture(scope="module")
def sass():
    return benchmarks.load("loop_sass")


def test_the_captured_launch_is_the_one_gemv_makes(sass):
    """The int4 gate/up reads packed activations with SwiGLU; the qkv makes its bytes, reading its
    activations as int64 words unless told not to. Nothing is launched and the kernel is restored."""
    import graphdsl.runtime.kernels.gemv as G
    kernel = G._gemv_kernel
    _, grid, args, kw = sass.capture_launch("int4-gate_up")
    assert kw["XPACK"] and kw["SWIGLU"] and kw["ONE_ROW"] and kw["WKIND"] == G.W_INT4
    assert args[0].dtype == torch.int32 and tuple(args[0].shape) == (6, 4096 // 8)   # the packed planes
    _, _, _, kw = sass.capture_launch("int4-qkv")
    assert not kw["XPACK"] and kw["X_WIDE"] and kw["BLOCK_N"] == 256
    assert not sass.capture_launch("int4-qkv", x_wide=False)[3]["X_WIDE"]
    assert G._gemv_kernel is kernel and G._num_sms(torch.device("cpu")) == 4


def _table(sass, prefix: str, *args) -> list[list[str]]:
    """The cells of the table rows starting ``| prefix`` that ``benchmarks/loop_sass.py args`` prints (in
    a process of its own: a test run may have put Triton in interpreter mode); skips where this
    Triton has no NVIDIA backend binaries."""
    try:
        sass._cuobjdump()
    except FileNotFoundError:
        pytest.skip("this Triton has no NVIDIA backend binaries")
    root = pathlib.Path(__file__).resolve().parents[2]
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run([sys.executable, str(root / "benchmarks" / "loop_sass.py"), *args],
                         capture_output=True, text=True, env=env, cwd=root, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    return [[c.strip() for c in line.strip("|").split("|")] for line in run.stdout.splitlines()
            if line.startswith("| " + prefix)]


def test_the_int4_loop_is_counted_for_hopper(sass):
    """Compiled for sm_90 with Triton's own ptxas: the int4 loop of integer dot products (``IDP``,
    four per word of eight weights) is found and counted."""
    cells, = _table(sass, "int4-qkv", "--launch", "int4-qkv")
    count, nbytes = int(cells[2]), int(cells[3])
    assert nbytes == 256 * 128 // 2 // 128                 # 256 rows x 128 int4 inputs over 128 threads
    idp = int(cells[6].split("IDP ")[1].split(",")[0])
    assert idp == nbytes                                   # four dp4a a 4-byte word of eight weights
    assert idp < count < 8 * idp


def _barriers(sass, *flags):
    """``{launch: BAR count}`` of the int4 qkv and packed gate/up loops, from a run of the script."""
    rows = _table(sass, "int4-", "--launch", "int4-qkv", "int4-gate_up", *flags)
    return {cells[0]: int(cells[5]) for cells in rows}


def test_the_int4_loops_convert_no_layout_through_shared_memory(sass):
    """With the scales and activations loaded in the quads' layout (``gemv._QUADS``) neither int4
    loop has a barrier; loaded as ``[BLOCK_N, G]`` / ``[G, C]`` both had (conversions each step)."""
    assert _barriers(sass) == {"int4-qkv": 0, "int4-gate_up": 0}
    before = _barriers(sass, "--no-quads")
    assert before["int4-qkv"] > 0 and before["int4-gate_up"] > 0


def test_interpreter_mode_is_refused_with_a_reason():
    root = pathlib.Path(__file__).resolve().parents[2]
    run = subprocess.run([sys.executable, str(root / "benchmarks" / "loop_sass.py")], capture_output=True, text=True,
                         env=dict(os.environ, TRITON_INTERPRET="1"), cwd=root, timeout=120)
    assert run.returncode == 2 and "unset TRITON_INTERPRET" in run.stderr


def test_an_argument_with_no_triton_type_is_named():
    """(In a process of its own, out of interpreter mode, as the compile needs.)"""
    root = pathlib.Path(__file__).resolve().parents[2]
    code = ("import sys; sys.path.insert(0, 'benchmarks'); import loop_sass as s\n"
            "kernel, _, args, kw = s.capture_launch('int4-qkv')\n"
            "args = list(args); args[[p.name for p in kernel.params].index('M')] = [1, 2]\n"
            "s.compile_launch(kernel, args, dict(kw), 90)\n")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=root, timeout=120)
    assert run.returncode != 0
    assert "TypeError: loop_sass: argument M of type list has no Triton signature" in run.stderr


def test_a_triton_without_its_nvidia_binaries_is_named(sass, monkeypatch):
    monkeypatch.setattr(sass.glob, "glob", lambda pattern: [])
    with pytest.raises(FileNotFoundError, match="Triton's NVIDIA backend has no cuobjdump next to its ptxas"):
        sass._cuobjdump()


def test_the_gguf_launch_is_the_one_gguf_gemv_makes(sass):
    """``--gguf``: 32 bf16 rows of a block-major Q6_K weight take the plane-a-dot loop (Q6_K leaves the
    rows kernel past 16 rows), 32 rows of Q4_K the rows kernel (``ROWS_BY_DEFAULT``), ``:planes`` the
    plane loop for Q4_K too; nothing runs and the kernels are restored."""
    import graphdsl.runtime.kernels.gguf_linear as GL
    import graphdsl.runtime.kernels.gguf_mma_rows as GR
    kernel, rows_kernel = GL._gguf_gemv_kernel, GR._rows_kernel
    for qtype, how in (("Q6_K", ""), ("Q4_K", "planes")):
        got, grid, args, kw = sass.capture_gguf(qtype, 14336, 4096, 32, how)
        assert got is kernel and kw["PLANES"] and kw["USE_DOT"] and kw["BLOCK_M"] == 32 and kw["KB"]
        assert grid[0] == 14336 // kw["BLOCK_N"]
    got, grid, _, kw = sass.capture_gguf("Q4_K", 14336, 4096, 32)
    assert got is rows_kernel and grid[0] == 14336 // kw["BLOCK_N"]
    assert GL._gguf_gemv_kernel is kernel and GR._rows_kernel is rows_kernel


def test_the_packed_ptx_planes_take_fewer_instructions_a_weight(sass):
    """Compiled for sm_90: the Q4_K plane loop of 32 rows (``:planes``; the rows kernel takes 32 rows by
    default) with the packed-PTX decode issues fewer instructions a weight than with the float32 decode
    (``--float32-planes``)."""
    per_weight = {}
    for flags in ((), ("--float32-planes",)):
        cells, = _table(sass, "Q4_K:14336:4096:32:planes", "--gguf", "Q4_K:14336:4096:32:planes", *flags)
        assert int(cells[3]) == 64 * 256 // 128                # 64 rows x a super-block over 128 threads
        per_weight[flags] = float(cells[4])
    assert per_weight[()] < 0.85 * per_weight[("--float32-planes",)], per_weight


def test_two_to_sixteen_q4k_rows_are_counted_on_the_rows_kernel(sass):
    """``--gguf`` with 8 (16) rows of Q4_K captures the several-row tensor-core GEMV (its K loop of
    ``mma.sync`` dots, no ``HGMMA``), 32 (64) weight rows of a super-block over 64 (128) threads; the
    kernels are restored. The integer sums a super-block keep the 8-row step under 480 instructions
    (the float32 sums a sub-block of session 49 took 556)."""
    import graphdsl.runtime.kernels.gguf_mma_rows as GR
    kernel = GR._rows_kernel
    got, grid, _, kw = sass.capture_gguf("Q4_K", 14336, 4096, 8)
    assert got is kernel and GR._rows_kernel is kernel and kw["KB"] and grid[0] == 14336 // kw["BLOCK_N"]
    eight, sixteen = _table(sass, "Q4_K:14336:4096:", "--gguf", "Q4_K:14336:4096:8", "Q4_K:14336:4096:16")
    assert eight[1].startswith("32 x 8") and int(eight[3]) == 32 * 256 // 64 and int(eight[2]) < 480
    assert sixteen[1].startswith("64 x 16") and int(sixteen[3]) == 64 * 256 // 128
    for cells in (eight, sixteen):
        assert cells[5] == "0" and int(cells[7]) <= 2          # no wgmma waits; no layout conversion a dot


def test_q5k_rows_on_the_tensor_cores_take_a_third_of_the_plane_loops_instructions(sass):
    """``--gguf Q5_K:N:K:8`` counts the several-row tensor-core GEMV on Q5_K blocks (the default for 2-32
    rows, as ``:mma`` gives it), which issues under half the instructions a step of the Q5_K plane loop
    that 8 rows ran before (``:planes``; sm_90: 487 against 1581)."""
    rows, mma, planes = _table(sass, "Q5_K:14336:4096:8", "--gguf", "Q5_K:14336:4096:8",
                               "Q5_K:14336:4096:8:mma", "Q5_K:14336:4096:8:planes")
    assert mma[1].startswith("32 x 8") and mma[5] == "0" and int(mma[7]) <= 2 and rows[1:] == mma[1:]
    assert planes[1].startswith("64 x 16")
    assert int(mma[2]) < 0.5 * int(planes[2]), (mma, planes)


def test_q8_0_rows_on_the_tensor_cores_take_fewer_instructions_a_weight_than_its_loops(sass):
    """``--gguf Q8_0:N:K:ROWS`` counts the rows kernel on Q8_0 blocks, the default for 1-32 rows: the
    codes enter the dot as they are, two to a 16-bit load (the blocks are 2-byte aligned). sm_90, 8
    rows: 605 instructions a step of 128 weights a thread, against 2086 for the plane loop that 2-16
    rows ran before (``:planes``) and 22 a weight for one row's CUDA-core loop (``1:planes``: its
    ``_pick_config`` launch)."""
    rows, mma, planes, one = _table(sass, "Q8_0:14336:4096:", "--gguf", "Q8_0:14336:4096:8", "Q8_0:14336:4096:8:mma",
                                    "Q8_0:14336:4096:8:planes", "Q8_0:14336:4096:1:planes")
    assert mma[1].startswith("32 x 8") and mma[5] == "0" and rows[1:] == mma[1:]
    assert int(mma[2]) < 700 and int(mma[2]) < 0.4 * int(planes[2]), (mma, planes)
    assert float(mma[4]) < 0.3 * float(one[4]), (mma, one)
