"""Quantized decode: kernels and the 8B Llama shape end to end, beside torchao int4 + torch.compile.

    python benchmarks/quant.py [--shape llama-3-8b] [--schemes int4 fp8 int8 gguf-q4_k_m] [--gguf-cuda-cores]
                               [--batches 8 32 64] [--gguf-tiles] [--no-peer] [--out t.md]
    python benchmarks/quant.py --schemes gguf-q5_k_m --batches 2 8 16 --gguf-q5k-off --no-peer --no-kernels
    python benchmarks/quant.py --schemes gguf-q8_0 --batches 2 8 16 --gguf-q8_0-off --no-peer --no-kernels

1. The batch-1 decode GEMV the engine runs for ``quant_linear``, on the shape's projections (gate_up
   with its SwiGLU epilogue), one CUDA graph replaying it over >= 256 MB of weight copies so every
   weight streams from HBM as in a decode step: µs and GB/s of the stored weight bytes (codes +
   scales + zero points) vs the measured device copy bandwidth; for int4 also the kernel peer,
   gemlite's GEMV on the same codes (``--schemes`` with int4 and gemlite installed).
2. ``LLM.from_config(shape, quantization=...)`` (random weights), batch 1 at 512 tokens of context:
   the engine's decode step (CUDA graph), ``LLM.generate`` ms/token and its first token after a
   511-token prompt (the prompt's prefill: the time a user waits), the first two as % of the quantized
   roofline = (every stored tensor but the embedding table + the KV cache read) / copy bandwidth,
   MoE expert stacks at the share a one-token step reads (``top_k / experts``: ``--shape
   mixtral-8x7b``, whose stacks take the scheme too); bf16 for reference. ``--batches``: the engine
   step at those batch sizes as well (batched decode), each against the roofline with its
   sequences' KV.
   ``gguf-q4_k_m`` (in ``--schemes``; ``gguf-q5_k_m`` the same with Q5_K for Q4_K, llama.cpp's
   Q5_K_M; ``gguf-q8_0`` every matrix Q8_0, llama.cpp's Q8_0) is a llama.cpp Q4_K_M-style mix kept in GGUF blocks (the
   rule of llama.cpp's ``llama_tensor_get_type`` for ``LLAMA_FTYPE_MOSTLY_Q4_K_M``): every attention
   and MLP matrix Q4_K, but ``attn_v`` and ``ffn_down`` Q6_K in the layers of ``use_more_bits`` (the
   first and last eighth, and every third layer between); MoE experts' gate/up Q4_K and down as the
   layer's ``ffn_down``; a matrix whose inputs are no multiple of 256 Q5_0 for Q4_K and Q8_0 for Q6_K
   (llama.cpp's fallback: DeepSeek-V2-Lite's experts); random weights rounded onto those blocks.
   As ``LLM(file.gguf, quantization="gguf")`` would: a fused ``qkv_proj`` whose v part is Q6_K beside
   Q4_K q/k keeps both (``gguf-q4_k.5120+q6_k.1024``: two GEMVs), and ``lm_head`` (Q6_K in
   llama.cpp) stays bf16; the roofline counts the bytes actually stored
   (GGUF blocks: the file's bytes, without the stored layout's Q6_K padding).
3. The peer in the same run: transformers with the same config and random weights, torchao
   ``Int4WeightOnlyConfig(group_size=128)`` (tinygemm tile-packed layout), static cache,
   ``torch.compile(mode="reduce-overhead")`` (benchmarks/llm.py's ``measure_peer``).
"""
from __future__ import annotations

import argparse
import math
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import bench_ms, copy_bandwidth_gbs, device_line, generate_s, graph_ms  # noqa: E402
from llm import BLOCK, SHAPES, _decode_inputs, _free, _log, kv_bytes_per_token, measure_peer, random_kv  # noqa: E402

CONTEXT = 512


def _projections(shape: str) -> dict[str, tuple[int, int]]:
    """The shape's decode GEMVs, ``name -> (weight rows N, K)``; gate_up is the packed ``[gate | up]``."""
    c = SHAPES[shape]
    h, i = c["hidden_size"], c["intermediate_size"]
    hd = c.get("head_dim") or h // c["num_attention_heads"]
    return {"qkv": ((c["num_attention_heads"] + 2 * c["num_key_value_heads"]) * hd, h),
            "o": (h, c["num_attention_heads"] * hd), "gate_up": (2 * i, h), "down": (h, i)}


def _copies(one: list[torch.Tensor]) -> list[list[torch.Tensor]]:
    """``one`` (a weight's stored tensors) and clones of it, at least 256 MB in all: a graph replaying a
    GEMV over them reads every weight from HBM, not L2, as a decode step does."""
    nbytes = sum(t.numel() * t.element_size() for t in one)
    return [one] + [[t.clone() for t in one] for _ in range(max(1, -(-(256 << 20) // nbytes)) - 1)]


def _graph_us(call, copies: list) -> float:
    """µs per ``call(stored)``: one CUDA graph replays it over ``copies`` (run once first, outside the
    graph, so autotuners and allocations settle)."""
    def run():
        for st in copies:
            call(st)
    return graph_ms(run, repeats=1, warmup_ms=10, rep_ms=60) * 1e3 / len(copies)


def kernel_rows(shape: str, schemes: list[str], copy: float) -> list[str]:
    """Per projection and scheme: µs and GB/s of the batch-1 decode GEMV the engine runs for
    ``quant_linear`` (gate_up with its SwiGLU epilogue; the codes in the layout a CUDA bind
    stores, ``layers.quantize.bound_scheme``), timed as :func:`_graph_us` does; GB/s of the stored
    weight bytes (int4's blocks: their padding too)."""
    from graphdsl.layers import quantize
    from graphdsl.quant import online_scheme
    from graphdsl.runtime.kernels.gemv import GemvWorkspace, gemv
    ws, rows = GemvWorkspace(), []
    for name in schemes:
        s = quantize.bound_scheme(online_scheme(name))
        for proj, (n, k) in _projections(shape).items():
            copies = _copies(s.quantize(torch.randn(n, k, device="cuda", dtype=torch.bfloat16)))
            x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
            silu = proj == "gate_up"
            out = torch.empty(1, n // 2 if silu else n, device="cuda", dtype=torch.bfloat16)
            us = _graph_us(lambda st: gemv(x, st[0], silu_mul=silu, out=out, workspace=ws, scheme=s, scales=st[1],
                                           zeros=st[2] if len(st) > 2 else None), copies)
            rows.append(_row(s.name, proj, n, k, sum(t.numel() * t.element_size() for t in copies[0]), us, copy))
            del copies
            torch.cuda.empty_cache()
        if s.name.startswith("int4"):
            rows += gemlite_rows(shape, s.with_blocks(False), copy)
    return rows


def _row(scheme: str, proj: str, n: int, k: int, nbytes: int, us: float, copy: float) -> str:
    gbs = nbytes / (us * 1e-6) / 1e9
    row = f"| {scheme} | {proj} [{n}, {k}] | {us:.1f} | {gbs:.0f} | {100 * gbs / copy:.0f}% |"
    _log(row)
    return row


def gemlite_rows(shape: str, s, copy: float) -> list[str]:
    """The kernel peer for int4: gemlite's batch-1 GEMV (``A16Wn``, 4-bit, the scheme's group, bfloat16,
    its default autotune) on the same codes, scales and zero points (8 for a symmetric scheme);
    gate_up is a plain GEMV (gemlite has no SwiGLU epilogue). One row saying why if gemlite is missing."""
    try:
        from gemlite.helper import A16Wn
    except Exception as e:  # noqa: BLE001 - not installed, or it cannot start (it reads the GPU at import)
        return [f"| gemlite | unavailable: {type(e).__name__}: {str(e)[:80]} | | | |"]
    from graphdsl.quant import unpack_int4
    rows = []
    for proj, (n, k) in _projections(shape).items():
        one = s.quantize(torch.randn(n, k, device="cuda", dtype=torch.bfloat16))
        nbytes = sum(t.numel() * t.element_size() for t in one)
        zeros = one[2] if len(one) > 2 else torch.full_like(one[1], 8.0)
        layers = [[A16Wn(device="cuda", dtype=torch.bfloat16).from_weights(
            unpack_int4(st[0]), st[1], st[2] if len(st) > 2 else zeros, W_nbits=4, group_size=s.group_size)]
            for st in _copies(one)]
        x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
        rows.append(_row(f"gemlite {s.name}", proj, n, k, nbytes, _graph_us(lambda st: st[0](x), layers), copy))
        del layers
        torch.cuda.empty_cache()
    return rows


def sweep(shape: str, schemes: list[str], copy: float, *, top: int = 3, int_dot_only: bool = False) -> list[str]:
    """Decode GEMV configs for quantized weights (``gemv(..., scheme=)``; BLOCK_N, BLOCK_K, SPLIT_K,
    stages; int4 also its integer-dot row loop, ``INT_DOT``): per projection of the shape (gate_up
    with its SwiGLU epilogue, as in the model), a CUDA graph replays the GEMV over enough copies of
    the weights (>= 256 MB) that they stream from HBM, as in a decode step (:func:`_graph_us`); µs
    per GEMV and % of copy bandwidth, the ``top`` best first (and int4's best ``INT_DOT`` launch),
    and the default heuristic's row (how ``_pick_quant_config`` was chosen). ``int_dot_only``: int4's ``INT_DOT`` launches alone (beside
    the heuristic's row), a quicker sweep."""
    import itertools

    from graphdsl.layers import quantize
    from graphdsl.quant import online_scheme
    from graphdsl.runtime.kernels.gemv import W_INT4, W_INT4_ZP, GemvWorkspace, _pick_quant_config, gemv, weight_kind
    rows = []
    ws = GemvWorkspace()
    for name in schemes:
        s = quantize.bound_scheme(online_scheme(name))
        for proj, (n, k) in _projections(shape).items():
            copies = _copies(s.quantize(torch.randn(n, k, device="cuda", dtype=torch.bfloat16)))
            nbytes = sum(t.numel() * t.element_size() for t in copies[0])
            x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
            silu = proj == "gate_up"
            out = torch.empty(1, n // 2 if silu else n, device="cuda", dtype=torch.bfloat16)
            group = getattr(s, "group_size", None) or 1

            def time_graph(cfg) -> float:
                return _graph_us(lambda st: gemv(x, st[0], silu_mul=silu, out=out, workspace=ws, config=dict(cfg),
                                                 scheme=s, scales=st[1], zeros=st[2] if len(st) > 2 else None), copies)

            default = _pick_quant_config(1, n, k, weight_kind(s), group, x.device)
            int4 = weight_kind(s) in (W_INT4, W_INT4_ZP)
            if int4:        # the one-row loops (float FMAs, or INT_DOT): BLOCK_K / group groups a step
                tiles = [(bn, bk) for bn, bk in itertools.product((32, 64, 128, 256), (128, 256, 512, 1024))
                         if bn * bk // 8 <= 8192]
                configs = [dict(BLOCK_N=bn, BLOCK_K=bk, SPLIT_K=split, num_warps=4 if bn * bk <= 32768 else 8,
                                num_stages=2, INT_DOT=dot)
                           for dot in ((True,) if int_dot_only else (False, True))
                           for (bn, bk), split in itertools.product(tiles, (1, 2, 4, 8, 16))]
            else:
                configs = [dict(BLOCK_N=bn, BLOCK_K=bk, SPLIT_K=split, num_warps=4, num_stages=4)
                           for bn, bk, split in itertools.product((32, 64, 128), (128, 256, 512), (1, 2, 4, 8, 16))]
            results = []
            for cfg in configs:
                bk = cfg["BLOCK_K"]
                if (group > 1 and bk % group and group % bk) or k % bk:
                    continue
                try:
                    results.append((time_graph(cfg), cfg))
                    _log(f"{s.name} {proj} {cfg}: {results[-1][0]:.2f} µs")
                except Exception as e:  # noqa: BLE001 - a config past shared memory / registers: skip it
                    _log(f"{s.name} {proj} {cfg}: {type(e).__name__}: {str(e)[:100]}")
            results.sort(key=lambda r: r[0])
            best = results[0][1]
            for st in (3, 5, 6) if not int4 else ():       # pipeline depth around the best tile (tl.dot paths)
                cfg = dict(best, num_stages=st)
                try:
                    results.append((time_graph(cfg), cfg))
                except Exception as e:  # noqa: BLE001
                    _log(f"{s.name} {proj} {cfg}: {type(e).__name__}: {str(e)[:100]}")
            results.sort(key=lambda r: r[0])
            best_int = [r for r in results if r[1].get("INT_DOT")][:1]
            shown = results[:top] + [r for r in best_int if r not in results[:top]] \
                + [(time_graph(default), dict(default, heuristic=True))]
            for us, cfg in shown:
                gbs = nbytes / (us * 1e-6) / 1e9
                rows.append(f"| {s.name} | {proj} [{n}, {k}] | {cfg} | {us:.2f} | {100 * gbs / copy:.0f}% |")
                _log(rows[-1])
            del copies
            torch.cuda.empty_cache()
    return rows


def _use_more_bits(i: int, n: int) -> bool:
    """llama.cpp's ``use_more_bits``: the layers a Q4_K_M (Q5_K_M) file gives Q6_K attn_v / ffn_down."""
    return i < n // 8 or i >= 7 * n // 8 or (i - n // 8) % 3 == 2


def k_mix_types(num_layers: int, experts: dict[str, str] | None = None, base: str = "Q4_K",
                more_type: str = "Q6_K") -> dict[str, str]:
    """``{HF tensor name: GGML type}`` of a Llama's attention/MLP matrices in llama.cpp's Q4_K_M mix
    (``base`` Q5_K: its Q5_K_M mix, the same rule; ``base`` and ``more_type`` Q8_0: a Q8_0 file, every
    matrix Q8_0); ``experts`` (``{checkpoint name: stack parameter}`` of an MoE model's expert pieces)
    adds them: gate/up ``base``, down as the dense down of its layer."""
    types = {}
    for name, param in (experts or {}).items():
        i = int(name.split(".layers.")[1].split(".")[0])
        types[name] = more_type if param.endswith("down_proj") and _use_more_bits(i, num_layers) else base
    for i in range(num_layers):
        more = more_type if _use_more_bits(i, num_layers) else base
        for proj in ("q_proj", "k_proj", "o_proj"):
            types[f"model.layers.{i}.self_attn.{proj}.weight"] = base
        types[f"model.layers.{i}.self_attn.v_proj.weight"] = more
        types[f"model.layers.{i}.mlp.gate_proj.weight"] = base
        types[f"model.layers.{i}.mlp.up_proj.weight"] = base
        types[f"model.layers.{i}.mlp.down_proj.weight"] = more
    return types


# llama.cpp's types for a row whose inputs are no multiple of 256 (its ``convert_incompatible_tensor``)
_NO_SUPER_BLOCK = {"Q4_K": "Q5_0", "Q5_K": "Q5_1", "Q6_K": "Q8_0"}


def with_fallbacks(types: dict[str, str], inputs: dict[str, int]) -> dict[str, str]:
    """``types`` with each K type whose tensor's ``inputs`` (``{name: K}``) are no multiple of 256
    replaced as llama.cpp replaces it (DeepSeek-V2-Lite's experts: down over 1408 inputs, Q5_0 or
    Q8_0)."""
    return {n: _NO_SUPER_BLOCK.get(q, q) if inputs.get(n, 0) % 256 else q for n, q in types.items()}


class _GGUFMix:
    """While active, ``LLM.from_config(..., quantization="gguf-q4_k_m")`` (``"gguf-q5_k_m"``,
    ``"gguf-q8_0"``) marks the linears with the Q4_K_M (Q5_K_M, Q8_0) mix through the same rule as a GGUF file
    (:func:`graphdsl.models.gguf_weights.keep_gguf_blocks`), and the random weights are rounded onto
    those blocks (``quantize_weights``)."""

    NAME = "gguf-q4_k_m"
    # mix -> (its type, the type of the attn_v / ffn_down of use_more_bits' layers)
    BASES = {NAME: ("Q4_K", "Q6_K"), "gguf-q5_k_m": ("Q5_K", "Q6_K"), "gguf-q8_0": ("Q8_0", "Q8_0")}

    def __enter__(self):
        import graphdsl.entrypoints.llm as llm_mod
        from graphdsl.models.gguf_weights import keep_gguf_blocks
        self._mod, self._saved = llm_mod, llm_mod._quantize_model

        def mark(model, quantization, tp=None):
            if quantization not in self.BASES:
                return self._saved(model, quantization, tp)
            table = model.checkpoint_table()
            experts = {n: slot.param for n, slot in table.items() if ".experts." in slot.param}
            types = k_mix_types(model.config.num_hidden_layers, experts, *self.BASES[quantization])
            kept = keep_gguf_blocks(model, with_fallbacks(types, {n: slot.shape[-1] for n, slot in table.items()}))
            _log(f"{quantization}: {len(kept)} weights (linears, expert stacks) in GGUF blocks "
                 f"({sorted(set(kept.values()))})")
            return quantization
        llm_mod._quantize_model = mark
        return self

    def __exit__(self, *exc):
        self._mod._quantize_model = self._saved


class _ActOrder:
    """While active, act-order int4 schemes (``--quantization int4-g128-act``, GPTQ ``desc_act``'s
    layout) quantize random weights online: each weight's inputs in a seeded random order (a
    checkpoint's order comes from GPTQ's Hessian; a benchmark only needs some permutation), the
    plain scheme's codes of ``W[:, perm]`` and ``perm`` as the last companion."""

    def __enter__(self):
        from graphdsl.quant import IntScheme
        self._cls, self._saved = IntScheme, IntScheme.quantize
        saved = self._saved

        def quantize(scheme, weight, dtype=None):
            if not scheme.act_order:
                return saved(scheme, weight, dtype)
            perm = torch.randperm(weight.shape[1], generator=torch.Generator().manual_seed(weight.shape[1]))
            return saved(scheme.kernel_scheme, weight[:, perm.to(weight.device)], dtype) + \
                [perm.to(torch.int32).to(weight.device)]
        IntScheme.quantize = quantize
        return self

    def __exit__(self, *exc):
        self._cls.quantize = self._saved


def gguf_kernel_rows(shape: str, copy: float) -> list[str]:
    """Per projection, Q4_K and Q6_K blocks: µs and GB/s of the batch-1 GGUF GEMV (``gguf_gemv``, what
    the engine runs for one row; the blocks in the layout a CUDA bind stores,
    ``layers.quantize.bound_scheme``), timed as :func:`_graph_us` does."""
    from graphdsl.layers import quantize
    from graphdsl.runtime.gguf_blocks import row_bytes
    from graphdsl.runtime.gguf_scheme import GGUFScheme
    from graphdsl.runtime.kernels.gemv import GemvWorkspace
    from graphdsl.runtime.kernels.gguf_linear import gguf_gemv
    ws, rows = GemvWorkspace(), []
    for qtype in ("Q4_K", "Q6_K"):
        scheme = quantize.bound_scheme(GGUFScheme(qtype))
        for proj, (n, k) in _projections(shape).items():
            copies = _copies(scheme.quantize(torch.randn(n, k, device="cuda")))
            x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
            out = torch.empty(1, n, device="cuda", dtype=torch.bfloat16)
            us = _graph_us(lambda st: gguf_gemv(x, st[0], qtype, out=out, workspace=ws), copies)
            rows.append(_row(f"gguf-{qtype.lower()}", proj, n, k, n * row_bytes(qtype, k), us, copy))   # file bytes
            del copies
            torch.cuda.empty_cache()
    return rows


def stored_bytes(llm) -> int:
    """Bytes one decode step must read of the weights: every parameter as stored (a quantized one's
    companions) but the embedding table, of which a step reads one row; the lm_head counts once,
    tied or not (a tied model lists the table under both names, and counting both overstated the
    Llama-3.2-1B roofline by its 525 MB). GGUF weights count their file's block bytes: the stored
    layout's padding of Q6_K blocks (gguf_blocks.to_stored) is the engine's choice, so it does not
    raise the roofline. MoE expert stacks count ``top_k / experts`` of their bytes: a one-token
    step reads its chosen experts only."""
    from graphdsl.layers import FusedExperts
    from graphdsl.runtime.gguf_blocks import row_bytes
    from graphdsl.runtime.gguf_scheme import GGUFMixScheme, GGUFScheme
    share = {f"{path}.{w}": m.top_k / m.num_experts for path, m in llm.model.named_modules()
             if isinstance(m, FusedExperts) and m.top_k for w in ("gate_up_proj", "down_proj")}
    bound, total = llm.model._bound, 0
    for name, p in llm.model.named_parameters():
        if name == "model.embed_tokens.weight":
            continue
        if isinstance(p.quant, (GGUFScheme, GGUFMixScheme)):       # a weight [N, K] or a stack [E, N, K]
            n, k = p.shape[-2:]
            nbytes = (p.shape[0] if len(p.shape) == 3 else 1) * sum(
                (r1 - r0) * row_bytes(q, k) for q, r0, r1 in p.quant.row_parts(n))
            total += round(nbytes * share.get(name, 1.0))
            continue
        nbytes = sum(t.numel() * t.element_size()
                     for t in ([bound[c.name] for c in p.companions()] if p.quant is not None else [bound[name]]))
        total += round(nbytes * share.get(name, 1.0))
    return total


def e2e(shape: str, quantization: str | None, copy: float, gen_tokens: int = 64, batches: tuple = ()) -> dict:
    """One model's row: load, the batch-1 engine step and ``LLM.generate``; the engine step at each of
    ``batches`` too (``steps``: batch -> ms, against the roofline with that many sequences' KV)."""
    import graphdsl as gd
    from graphdsl.layers import Phase
    max_len = CONTEXT + gen_tokens + 1
    most = max((1, *batches))
    t0 = time.perf_counter()
    with _GGUFMix():
        llm = gd.LLM.from_config(SHAPES[shape], device="cuda", dtype="bfloat16", seed=0, max_model_len=max_len,
                                 max_num_seqs=most, num_kv_blocks=(most + 1) * math.ceil(max_len / BLOCK) + 2,
                                 block_size=BLOCK, quantization=quantization)
    load_s = time.perf_counter() - t0
    random_kv(llm)
    wbytes = stored_bytes(llm)
    kv = kv_bytes_per_token(llm) * CONTEXT
    roof_ms = (wbytes + kv) / copy / 1e6
    gen = torch.Generator(device="cuda").manual_seed(0)
    inputs, ids = _decode_inputs(llm, 1, CONTEXT, gen)
    step_ms = bench_ms(lambda: llm.model.execute(Phase.DECODE, inputs, float_logits=False))
    _free(llm, ids)
    steps = {}
    for b in batches:
        inputs, ids = _decode_inputs(llm, b, CONTEXT, gen)
        steps[b] = bench_ms(lambda: llm.model.execute(Phase.DECODE, inputs, float_logits=False))
        _free(llm, ids)
    pgen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, llm.config.vocab_size, (CONTEXT - 1,), generator=pgen).tolist() for _ in range(most)]
    gen_ms, firsts = {}, []
    for b in (1, *batches):                               # batch 1 first: its prefill times are the first-token figure
        generate_s(llm, prompts[:b], gen_tokens)          # build and warm every engine and graph of this batch
        runs = []
        for _ in range(3):
            first = generate_s(llm, prompts[:b], 1)       # the prompts' prefill and one token
            if b == 1:
                firsts.append(first * 1e3)
            runs.append((generate_s(llm, prompts[:b], gen_tokens + 1) - first) / gen_tokens * 1e3)
        gen_ms[b] = sorted(runs)[1]
    res = dict(name=quantization or "bf16", load_s=load_s, weight_gb=wbytes / 1e9, kv_gb=kv / 1e9, roof_ms=roof_ms,
               step_ms=step_ms, gen_ms=gen_ms[1], first_ms=sorted(firsts)[1], steps=steps,
               gen_steps={b: gen_ms[b] for b in batches}, roofs={b: (wbytes + kv * b) / copy / 1e6 for b in batches})
    _log(f"{res}")
    del llm
    torch.cuda.empty_cache()
    return res


# the Q4_K_M A/B runs: run name -> (gguf_linear switch, or "triton_backend.<switch>", value, label). "cuda-cores": every GGUF GEMV on the CUDA cores
# (the tensor-core GEMV out of reach: the A/B of gguf_mma.py); "tiles": several rows on the decoded tiles up to 16
# and dequantize + cuBLAS beyond (the A/B of the plane-a-dot GEMV, with --batches); "planes" / "q6k-planes": 2-32 rows
# (of Q6_K only) a plane a dot (the A/Bs of gguf_mma_rows.py, with --batches); "q5k-off": the Q5_K_M mix with its
# Q5_K rows off the tensor-core rows kernel: one row on the CUDA cores, 2-32 a plane a dot (--gguf-q5k-off);
# "norm-rows-off": the rows GEMVs after a norm making their own operands (--gguf-norm-rows-off); "q8_0-off": the
# Q8_0 mix with its rows off the tensor-core rows kernel: one row on the CUDA cores, 2-32 a plane a dot (--gguf-q8_0-off);
# "rows-16": 17-32 rows a plane a dot, not on the rows kernel (--gguf-rows-16, with --batches 17..32: the A/B of the
# default since session 53)
_AB_RUNS = {"cuda-cores": ("MMA_MIN_ROWS", 1 << 40, "CUDA-core GEMVs"),
            "planes": ("_MMA_ROWS", False, "2-32 rows a plane a dot, not the tensor-core rows kernel"),
            "q6k-planes": ("_MMA_ROWS_Q6K", False, "2-16 rows of Q6_K a plane a dot"),
            "tiles": ("_PLANE_ROWS", False, "several rows: decoded tiles, dequantize + cuBLAS"),
            "q5k-off": ("_MMA_ROWS_Q5K", False, "Q5_K off the rows kernel: one row on the CUDA cores, 2-32 a "
                                                "plane a dot"),
            "norm-rows-off": ("triton_backend._NORM_ROWS_PLANES", False,
                              "each rows GEMV making its operands, not the RMSNorm before it"),
            "q8_0-off": ("_MMA_ROWS_Q8_0", False, "Q8_0 off the rows kernel: one row on the CUDA cores, 2-32 a "
                                                  "plane a dot"),
            "rows-16": ("ROWS_BY_DEFAULT", 16, "17-32 rows a plane a dot, not on the rows kernel")}


# the A/B flags: flag -> (its runs in _AB_RUNS, the mixes they switch (each one in --schemes), what they change, for
# --help)
_AB_FLAGS = {
    "--gguf-cuda-cores": (["cuda-cores"], _GGUFMix.NAME, "every GEMV on the CUDA cores (A/B)"),
    "--gguf-tiles": (["tiles"], _GGUFMix.NAME, "several rows on the decoded tiles and dequantize + cuBLAS, not a "
                                               "plane a dot (A/B; with --batches)"),
    "--gguf-planes": (["planes", "q6k-planes"], _GGUFMix.NAME, "2-32 rows (Q6_K: 2-16) a plane a dot instead of the "
                      "several-row tensor-core kernel, for every type and for Q6_K only (A/B; with --batches)"),
    "--gguf-norm-rows-off": (["norm-rows-off"], _GGUFMix.NAME, "each 2-32-row tensor-core GEMV making its own "
                             "operands, not the RMSNorm before qkv and gate/up (the A/B of norm_rows_planes)"),
    "--gguf-q5k-off": (["q5k-off"], "gguf-q5_k_m", "Q5_K off the tensor-core rows kernel (one row on the CUDA cores, "
                       "2-32 rows a plane a dot: the A/B of the default)"),
    "--gguf-q8_0-off": (["q8_0-off"], "gguf-q8_0", "Q8_0 off the tensor-core rows kernel (one row on the CUDA cores, "
                        "2-32 rows a plane a dot: the A/B of the default)"),
    "--gguf-rows-16": (["rows-16"], tuple(_GGUFMix.BASES), "17-32 rows a plane a dot, not on the tensor-core rows "
                       "kernel (with --batches 17..32; the A/B of gguf_mma_rows.ROWS_BY_DEFAULT)"),
}


def _mixes(mixes) -> tuple:
    """An ``_AB_FLAGS`` entry's mixes as a tuple (one name or several)."""
    return (mixes,) if isinstance(mixes, str) else tuple(mixes)


def switch_target(attr: str) -> tuple:
    """``(module, name)`` of an ``_AB_RUNS`` switch: ``gguf_linear``'s, or ``triton_backend``'s when it says so."""
    import graphdsl.runtime.backends.triton_backend as tb
    import graphdsl.runtime.kernels.gguf_linear as gl
    return (tb, attr.split(".", 1)[1]) if attr.startswith("triton_backend.") else (gl, attr)


def e2e_switched(run: str, scheme: str, shape: str, copy: float, batches: tuple = ()) -> dict:
    """:func:`e2e` of the mix ``scheme`` (the one its ``_AB_FLAGS`` flag names) with the switch of
    ``_AB_RUNS[run]`` set (and put back)."""
    attr, value, label = _AB_RUNS[run]
    mod, attr = switch_target(attr)
    keep = getattr(mod, attr)
    setattr(mod, attr, value)
    try:
        res = e2e(shape, scheme, copy, batches=batches)
    finally:
        setattr(mod, attr, keep)
    res["name"] += f" ({label})"
    return res


def torchao_int4(model) -> None:
    from torchao.quantization import Int4WeightOnlyConfig, quantize_
    quantize_(model, Int4WeightOnlyConfig(group_size=128, int4_packing_format="tile_packed_to_4d"))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shape", default="llama-3-8b", choices=sorted(SHAPES))
    ap.add_argument("--schemes", nargs="+", default=["int4", "fp8", "int8", "gguf-q4_k_m"])
    ap.add_argument("--no-peer", action="store_true")
    ap.add_argument("--no-kernels", action="store_true")
    ap.add_argument("--no-e2e", action="store_true")
    ap.add_argument("--sweep", action="store_true", help="also sweep the decode tile configs")
    ap.add_argument("--int-dot-only", action="store_true", help="with --sweep: int4's INT_DOT launches only")
    for flag, (_, mixes, text) in _AB_FLAGS.items():
        ap.add_argument(flag, action="store_true", help=f"with {' or '.join(_mixes(mixes))}: also its run with {text}")
    ap.add_argument("--batches", nargs="*", type=int, default=[],
                    help="also the engine decode step and LLM.generate ms a step at these batch sizes (e.g. 8 32 "
                         "64: batched decode)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    extra = tuple(b for b in args.batches if b > 1)
    copy = copy_bandwidth_gbs()
    lines = [f"device: {device_line()}; copy bandwidth {copy:.0f} GB/s; shape {args.shape}, batch 1, "
             f"context {CONTEXT}", ""]
    if not args.no_kernels:
        lines += ["| scheme | projection | µs | GB/s | % of copy |", "|---|---|---|---|---|"]
        lines += kernel_rows(args.shape, [s for s in args.schemes if s not in _GGUFMix.BASES], copy)
        if _GGUFMix.NAME in args.schemes:
            lines += gguf_kernel_rows(args.shape, copy)
        lines += [""]
    if args.sweep:
        lines += ["| scheme | projection | decode GEMV config | µs | % of copy |", "|---|---|---|---|---|"]
        lines += sweep(args.shape, [s for s in args.schemes if s not in _GGUFMix.BASES], copy,
                       int_dot_only=args.int_dot_only) + [""]
    if args.no_e2e:
        print("\n".join(lines))
        return 0
    lines += ["| model | weights GB | roofline ms | engine step ms | % roofline | LLM.generate ms/token | % roofline "
              f"| first token ms (prompt {CONTEXT - 1}) |"
              + "".join(f" step ms, batch {b} (% roofline) | LLM.generate ms/step, batch {b} |" for b in extra),
              "|---|---|---|---|---|---|---|---|" + "---|---|" * len(extra)]
    runs = [(None, None)] + [(q, q) for q in args.schemes]
    for flag, (names, mixes, _) in _AB_FLAGS.items():
        if getattr(args, flag[2:].replace("-", "_")):
            runs += [(n, scheme) for scheme in _mixes(mixes) if scheme in args.schemes for n in names]
    for q, scheme in runs:
        r = e2e_switched(q, scheme, args.shape, copy, extra) if q in _AB_RUNS else e2e(args.shape, q, copy,
                                                                                          batches=extra)
        lines.append(f"| graphdsl {r['name']} | {r['weight_gb']:.2f} | {r['roof_ms']:.3f} | {r['step_ms']:.3f} | "
                     f"{100 * r['roof_ms'] / r['step_ms']:.0f}% | {r['gen_ms']:.3f} | {100 * r['roof_ms'] / r['gen_ms']:.0f}% "
                     f"| {r['first_ms']:.2f} |" + "".join(f" {r['steps'][b]:.3f} ({100 * r['roofs'][b] / r['steps'][b]:.0f}%) "
                                                          f"| {r['gen_steps'][b]:.3f} |" for b in extra))
        print(lines[-1], flush=True)
    if not args.no_peer:
        try:
            p = measure_peer(args.shape, context=CONTEXT, prepare=torchao_int4)
            lines.append(f"| torchao int4 g128 + torch.compile (transformers {p['version']}, fullgraph={p['fullgraph']}) "
                         f"| | | {p['ms']:.3f} | | | | |")
        except Exception as e:  # noqa: BLE001 - report the peer's failure in the table, keep ours
            lines.append(f"| torchao int4 g128 + torch.compile | failed: {type(e).__name__}: {str(e)[:160]} | | | | | | |")
        print(lines[-1], flush=True)
    text = "\n".join(lines)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
