"""Pattern rewriting: patterns are graphdsl functions, one driver applies a table of rules.

A pattern is written like model code and traced by the same tracer (as ``torch.fx.replace_pattern``)::

    def pattern(x, residual, weight):
        s = x + residual
        return F.rms_norm(s, weight, eps=Var("eps")), s

    def replacement(x, residual, weight, *, eps):
        return add_rms_norm(x, residual, weight, eps=eps)

    Rule("add_rms_norm", pattern, replacement, extra_check=None)

The pattern's parameters match any tensor (the same parameter must match the same tensor each
time it is read); attributes match by equality, or anything when given as :class:`Var` (whose
value the replacement receives as a keyword argument of the same name). The replacement is
called on the matched graph tensors inside the target network, so it records the new nodes
there; it returns one tensor per pattern output (an existing tensor is fine: identity rewrites).

Matching starts at the pattern's last node (the *anchor*) and walks inputs backwards. A match is
rejected when a tensor computed inside the pattern, other than a pattern output, is read outside
the match (an intermediate used elsewhere would have to be recomputed, so the rewrite would not
pay), or when ``extra_check(match)`` returns False or a reason string. A rejection after more than
the anchor matched (or after the whole structure matched) is kept as a :class:`NearMiss` (rule,
node, module path, source line, reason) for ``engine.fusion_report()``.

:func:`apply_rules` is the one driver: a worklist over the :class:`GraphEditor`'s networkx view,
seeded with every node in order; after a rewrite only the new nodes, their readers and the
readers of the replaced nodes' inputs are revisited — never the whole graph.
"""
from __future__ import annotations

import inspect
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable

from graphdsl.errors import GraphDSLError
from graphdsl.functional import scalar as _scalar_op
from graphdsl.network import Network, Node
from graphdsl.tensor import Tensor

from .graph_edit import OUTPUT, GraphEditor
from .shapes import same_shape

_SCALAR = _scalar_op.opdef

__all__ = ["Var", "Rule", "Pattern", "Match", "NearMiss", "RewriteResult", "apply_rules", "replace_pattern"]


class Var:
    """An attribute placeholder in a pattern: matches any value and binds it to ``name``."""

    def __init__(self, name: str):
        if not isinstance(name, str) or not name.isidentifier():
            raise GraphDSLError(f"Var name must be an identifier, got {name!r}")
        self.name = name

    def __repr__(self):
        return f"Var({self.name!r})"


@dataclass
class NearMiss:
    """A place where a rule's anchor op occurred but the rule did not apply, and why."""

    rule: str
    pass_name: str
    node: str
    op: str
    module: str
    source: str
    reason: str

    def __str__(self):
        where = f"@{self.module} " if self.module else ""
        return f"{self.node} ({self.op}) {where}({self.source}): {self.reason}"


class _NoMatch(Exception):
    def __init__(self, reason: str, depth: int = 1 << 30):
        super().__init__(reason)
        self.reason = reason
        self.depth = depth          # pattern nodes matched before the failure


@dataclass
class Match:
    """One match of a pattern: pattern node -> graph node, parameter name -> tensor, Var values."""

    rule: "Rule"
    anchor: Node
    nodes: dict = field(default_factory=dict)        # pattern Node -> graph Node
    inputs: dict = field(default_factory=dict)       # parameter name -> graph Tensor
    vars: dict = field(default_factory=dict)         # Var name -> attribute value
    outputs: list = field(default_factory=list)      # graph Tensors of the pattern outputs

    def node(self, op: str) -> Node:
        """The graph node matched by the (first) pattern node of op ``op``."""
        for p, g in self.nodes.items():
            if p.op == op:
                return g
        raise GraphDSLError(f"rule '{self.rule.name}': the pattern has no '{op}' node; it has "
                            f"{sorted({p.op for p in self.nodes})}")


class Pattern:
    """A traced pattern function: its nodes, parameter placeholders, outputs and anchor."""

    def __init__(self, fn: Callable, name: str):
        self.name = name
        params = list(inspect.signature(fn).parameters.values())
        bad = [p.name for p in params if p.kind not in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
        if bad:
            raise GraphDSLError(f"pattern '{name}': parameters must be plain positional tensors, got {bad}")
        self.params = [p.name for p in params]
        self.net = Network(f"pattern:{name}")
        with self.net:
            out = fn(*[Tensor(p) for p in self.params])
        outs = list(out) if isinstance(out, (tuple, list)) else [out]
        if not outs or not all(isinstance(t, Tensor) and t.producer is not None for t in outs):
            raise GraphDSLError(f"pattern '{name}' must return the tensors it computes (one or a tuple), got {out!r}")
        self.outputs: list[Tensor] = outs
        self.nodes: list[Node] = list(self.net.nodes)
        self.anchor: Node = self.nodes[-1]
        reach, stack = set(), [self.anchor]
        while stack:
            n = stack.pop()
            if n not in reach:
                reach.add(n)
                stack.extend(t.producer for t in n.inputs if t.producer is not None)
        unreached = [n.name for n in self.nodes if n not in reach]
        if unreached:
            raise GraphDSLError(f"pattern '{name}': nodes {unreached} do not feed its last node "
                                f"'{self.anchor.op}'; a pattern must be one tree rooted at its last op")
        used = {t.name for n in self.nodes for t in n.inputs if t.producer is None}
        unused = [p for p in self.params if p not in used]
        if unused:
            raise GraphDSLError(f"pattern '{name}': parameters {unused} are never read")
        self.output_set = set(outs)

    def __str__(self):
        return str(self.net)


@dataclass
class Rule:
    """A named (pattern, replacement) pair with an optional ``extra_check(match) -> bool | str``."""

    name: str
    pattern: Callable
    replacement: Callable
    extra_check: Callable[[Match], Any] | None = None
    _compiled: Pattern | None = field(default=None, repr=False)

    @property
    def compiled(self) -> Pattern:
        if self._compiled is None:
            self._compiled = Pattern(self.pattern, self.name)
        return self._compiled


@dataclass
class RewriteResult:
    applied: list[tuple[str, str, str]] = field(default_factory=list)   # (rule, anchor node, new nodes)
    near_misses: list[NearMiss] = field(default_factory=list)

    def counts(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for rule, _, _ in self.applied:
            out[rule] = out.get(rule, 0) + 1
        return out


# -- matching ------------------------------------------------------------------------------------
def _match(rule: Rule, ed: GraphEditor, anchor: Node) -> Match:
    pat = rule.compiled
    m = Match(rule, anchor)
    used: set[Node] = set()

    def visit(p: Node, g: Node):
        if p in m.nodes:
            if m.nodes[p] is not g:
                raise _NoMatch(f"pattern node {p.op} would match both '{m.nodes[p].name}' and '{g.name}'")
            return
        if g in used:
            raise _NoMatch(f"'{g.name}' would match two pattern nodes")
        if g.op != p.op:
            raise _NoMatch(f"pattern expects {p.op}, found '{g.name}' ({g.op})")
        if len(g.inputs) != len(p.inputs):
            raise _NoMatch(f"'{g.name}' has {len(g.inputs)} inputs, pattern's {p.op} has {len(p.inputs)}")
        for k, want in p.attrs.items():
            have = g.attrs.get(k)
            if isinstance(want, Var):
                if want.name in m.vars and m.vars[want.name] != have:
                    raise _NoMatch(f"attribute {want.name} is {m.vars[want.name]!r} in one place and {have!r} in "
                                   f"'{g.name}'", depth=len(m.nodes) + 1)
                m.vars[want.name] = have
            elif want != have or type(want) is not type(have):
                raise _NoMatch(f"'{g.name}' has {k}={have!r}, pattern wants {k}={want!r}", depth=len(m.nodes) + 1)
        m.nodes[p] = g
        used.add(g)
        for pt, gt in zip(p.inputs, g.inputs):
            if pt.producer is None:
                bound = m.inputs.get(pt.name)
                if bound is not None and bound is not gt:
                    raise _NoMatch(f"parameter '{pt.name}' would be both '{bound.name}' and '{gt.name}'")
                m.inputs[pt.name] = gt
            else:
                if gt.producer is None or gt.index != pt.index:
                    what = "a graph input" if gt.producer is None else f"'{gt.producer.name}' ({gt.producer.op})"
                    raise _NoMatch(f"'{g.name}' reads '{gt.name}' from {what}; pattern expects {pt.producer.op}")
                visit(pt.producer, gt.producer)

    try:
        visit(pat.anchor, anchor)
    except _NoMatch as e:
        raise _NoMatch(e.reason, depth=len(m.nodes) if e.depth == 1 << 30 else e.depth) from None
    for p, g in m.nodes.items():
        for pt, gt in zip(p.outputs, g.outputs):
            if pt in pat.output_set:
                continue
            # name a reader that uses the value (a scalar constant only borrows its dtype) first
            for u in sorted(ed.users(gt), key=lambda u: isinstance(u, Node) and u.opdef is _SCALAR):
                if isinstance(u, OUTPUT):
                    raise _NoMatch(f"extra user: '{gt.name}' (inside the pattern) is also the network output "
                                   f"'{u.name}'")
                if u not in used:
                    where = f" @{u.module}" if u.module else ""
                    raise _NoMatch(f"extra user: '{gt.name}' (inside the pattern) is also read by '{u.name}' "
                                   f"({u.op}{where}, {u.source})")
    m.outputs = [m.nodes[t.producer].outputs[t.index] for t in pat.outputs]
    if rule.extra_check is not None:
        verdict = rule.extra_check(m)
        if verdict is False:
            raise _NoMatch("extra_check rejected the match")
        if isinstance(verdict, str):
            raise _NoMatch(verdict)
    return m


def _replace(ed: GraphEditor, m: Match) -> list[Node]:
    rule, pat = m.rule, m.rule.compiled
    repl = rule.replacement
    sig = inspect.signature(repl).parameters
    kw = {k: v for k, v in m.vars.items() if k in sig}
    args = [m.inputs[p] for p in pat.params]
    result, new = ed.record(repl, *args, at=m.anchor, **kw)
    outs = list(result) if isinstance(result, (tuple, list)) else [result]
    if len(outs) != len(m.outputs) or not all(isinstance(t, Tensor) for t in outs):
        raise GraphDSLError(f"rule '{rule.name}': the replacement returned {len(outs)} value(s), the pattern has "
                            f"{len(m.outputs)} output(s); return one graph tensor per pattern output")
    for old, new_t in zip(m.outputs, outs):
        if old.shape is not None and new_t.shape is not None and (not same_shape(old.shape, new_t.shape)
                                                                   or old.dtype != new_t.dtype):
            raise GraphDSLError(f"rule '{rule.name}' replaced '{old.name}' {old.shape} {old.dtype} by "
                                f"'{new_t.name}' {new_t.shape} {new_t.dtype}; a rewrite must keep shapes and dtypes")
        ed.replace_uses(old, new_t, exclude=new)
    matched = set(m.nodes.values())
    for g in sorted(matched, key=lambda n: -ed.pos[n]):
        if all(not ed.users(t) for t in g.outputs):
            ed.erase(g)
    return new


def apply_rules(net_or_editor, rules: list[Rule], *, pass_name: str = "", dry_run: bool = False,
                dry_reason: str = "") -> RewriteResult:
    """Apply ``rules`` to a fixed point (one worklist driver); ``dry_run`` only reports matches.

    ``net_or_editor`` is a Network (edited and committed here) or a GraphEditor (left uncommitted).
    """
    ed = net_or_editor if isinstance(net_or_editor, GraphEditor) else GraphEditor(net_or_editor)
    by_op: dict[str, list[Rule]] = {}
    for r in rules:
        by_op.setdefault(r.compiled.anchor.op, []).append(r)
    result = RewriteResult()
    misses: dict[tuple[str, Node], NearMiss] = {}
    work = deque(n for n in ed.nodes if n.op in by_op)
    queued = set(work)
    budget = 20 * (len(ed.pos) + 10)
    while work:
        n = work.popleft()
        queued.discard(n)
        if not ed.alive(n):
            continue
        budget -= 1
        if budget < 0:
            raise GraphDSLError(f"pass '{pass_name}': rules {[r.name for r in rules]} did not reach a fixed point "
                                "(a rule keeps re-matching its own output)")
        for rule in by_op.get(n.op, ()):
            try:
                m = _match(rule, ed, n)
            except _NoMatch as e:
                # a miss counts as "near" once more than the anchor matched (or only checks failed)
                if e.depth >= min(2, len(rule.compiled.nodes)):
                    misses[(rule.name, n)] = NearMiss(rule.name, pass_name, n.name, n.op, n.module, n.source,
                                                      e.reason)
                continue
            if dry_run:
                misses[(rule.name, n)] = NearMiss(rule.name, pass_name, n.name, n.op, n.module, n.source,
                                                  dry_reason or "dry run")
                continue
            touched = {t.producer for g in m.nodes.values() for t in g.inputs if t.producer is not None}
            new = _replace(ed, m)
            result.applied.append((rule.name, n.name, ", ".join(x.name for x in new)))
            for key in [k for k in misses if not ed.alive(k[1])]:
                del misses[key]
            revisit = list(new) + [u for x in new for u in ed.node_users(x)]
            revisit += [u for p in touched if ed.alive(p) for u in ed.node_users(p)]
            for x in revisit:
                if x.op in by_op and x not in queued and ed.alive(x):
                    work.append(x)
                    queued.add(x)
            break
    result.near_misses = [mm for (r, node), mm in misses.items() if ed.alive(node)]
    if not isinstance(net_or_editor, GraphEditor):
        ed.commit()
    return result


def replace_pattern(net: Network, pattern: Callable, replacement: Callable, extra_check=None) -> RewriteResult:
    """fx-style one-shot: rewrite every match of ``pattern`` in ``net`` with ``replacement``."""
    name = getattr(pattern, "__name__", "pattern")
    return apply_rules(net, [Rule(name, pattern, replacement, extra_check)], pass_name="replace_pattern")


class _Ops:
    """``ops.<name>(*tensors, **attrs)`` records any registered op by name, with its declared
    attribute defaults — for patterns over ops whose functional wrapper needs known shapes."""

    def __getattr__(self, name: str):
        from graphdsl.network import record_op
        from graphdsl.opdef import get_op
        opdef = get_op(name)

        def call(*tensors, **attrs):
            unknown = sorted(set(attrs) - set(opdef.attr_defaults))
            if unknown:
                raise GraphDSLError(f"ops.{name}: unknown attributes {unknown}; it takes {list(opdef.attr_defaults)}")
            return record_op(opdef, list(tensors), {**opdef.attr_defaults, **attrs})
        return call


ops = _Ops()
__all__.append("ops")
