"""graphdsl.runtime.codegen — Triton code generation for fused groups, and the fused LLM kernels."""
from .fused import FusedKernel, compile_source, kernel_source, launch_config, prepare_fused, run_fused
from .lowering import POINTWISE, ROW_REDUCTIONS

__all__ = ["FusedKernel", "prepare_fused", "run_fused", "kernel_source", "compile_source", "launch_config",
           "POINTWISE", "ROW_REDUCTIONS"]
