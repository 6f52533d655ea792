"""graphdsl.passes — the compiler: graph rewrites and memory planning."""
from .dce import dead_code_elimination
from .memory_plan import MemoryPlan, plan_memory

__all__ = ["dead_code_elimination", "plan_memory", "MemoryPlan"]
