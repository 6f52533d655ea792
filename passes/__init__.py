"""graphdsl.passes — the compiler: pass manager, pattern rewriter, fusion passes, memory planning."""
from . import fused_ops
from .constant_fold import parameter_only_nodes
from .cse import common_subexpression_elimination
from .dce import dead_code_elimination
from .generic_fusion import default_can_fuse, fuse_groups, is_row_reduction
from .graph_edit import GraphEditor
from .manager import PIPELINE, BuildReport, PassManager, PassSpec, pass_names
from .memory_plan import MemoryPlan, plan_memory
from .rewriter import Match, NearMiss, Rule, Var, apply_rules, ops, replace_pattern

__all__ = ["dead_code_elimination", "plan_memory", "MemoryPlan", "PassManager", "PassSpec", "PIPELINE",
           "BuildReport", "pass_names", "Rule", "Var", "Match", "NearMiss", "apply_rules", "replace_pattern",
           "ops", "GraphEditor", "common_subexpression_elimination", "parameter_only_nodes", "fuse_groups",
           "default_can_fuse", "is_row_reduction", "fused_ops"]
