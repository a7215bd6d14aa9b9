"""What every template bridge shares: the refusal error, the lowering jobs and plan it returns, and the C++ helpers
that bind a lowered launcher's parameters by name.

A bridge (generator/codegen/templates/<template>_bridge.py) reads the engine's analysis of an op, checks that the
cascade has the shape its template schedules (and says precisely why not otherwise), renders the engine's formulas
into the template's math interface and returns a :class:`Plan`: the TileLang programs to lower (:class:`Job`) and,
once they are lowered, the body of the op's ``impl_cuda``. generator/codegen/cuda.py keeps the registry
(``TEMPLATES``: name -> (plan, body)) and the lowering.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass, field

import sympy as sp

from .tl_print import TLPrinter


class BridgeError(ValueError):
    """The cascade does not have the shape a template schedules."""


@dataclass(frozen=True)
class Job:
    """One CUDA variant to lower: the TileLang program text and where its .cu goes."""

    symbol: str
    family: str
    program: str  # python source with make_prim_func()
    header: tuple[tuple[str, str], ...] = ()


@dataclass
class Plan:
    jobs: list[Job] = field(default_factory=list)
    body: list[str] = field(default_factory=list)  # impl_cuda body (uses the lowered launchers by name)
    families: tuple[str, ...] = ()


def flag_test(spec, name: str, value, ref) -> str:
    """C-like test that flag ``name`` has the specialisation value ``value``; ``ref(n)`` spells the run-time value
    of ``n`` (``has_<tensor>`` for an optional tensor's presence, else the flag: bool 0/1, str the choice's index)."""
    arg = spec.arg(name)
    if getattr(arg, "optional", False) and not hasattr(arg, "type"):
        return f"{ref('has_' + name)} != 0" if value == "present" else f"{ref('has_' + name)} == 0"
    if arg.type == "bool":
        return f"{ref(name)} != 0" if value else f"{ref(name)} == 0"
    return f"{ref(name)} == {arg.choices.index(value)}"


def only(items: list, what: str, template: str) -> object:
    """The single item of a list, or a refusal naming what the template needs."""
    if len(items) != 1:
        raise BridgeError(f"the {template} template needs exactly one {what}, found {len(items)}")
    return items[0]


def py_to_cpp(text: str, names: dict[str, str]) -> str:
    """A small Python condition (template preconditions) as C++: names mapped, // -> division."""

    def conv(n: ast.AST) -> str:
        if isinstance(n, ast.BoolOp):
            op = " && " if isinstance(n.op, ast.And) else " || "
            return "(" + op.join(conv(v) for v in n.values) + ")"
        if isinstance(n, ast.UnaryOp) and isinstance(n.op, ast.Not):
            return f"(!{conv(n.operand)})"
        if isinstance(n, ast.UnaryOp) and isinstance(n.op, ast.USub):
            return f"(-{conv(n.operand)})"
        if isinstance(n, ast.Compare):
            parts = []
            left = conv(n.left)
            for op, right in zip(n.ops, n.comparators):
                r = conv(right)
                sym = {ast.Lt: "<", ast.LtE: "<=", ast.Gt: ">", ast.GtE: ">=", ast.Eq: "==", ast.NotEq: "!="}[type(op)]
                parts.append(f"({left} {sym} {r})")
                left = r
            return "(" + " && ".join(parts) + ")"
        if isinstance(n, ast.BinOp):
            sym = {ast.Add: "+", ast.Sub: "-", ast.Mult: "*", ast.FloorDiv: "/", ast.Mod: "%"}[type(n.op)]
            return f"({conv(n.left)} {sym} {conv(n.right)})"
        if isinstance(n, ast.Name):
            if n.id not in names:
                raise BridgeError(f"precondition {text!r}: unknown name {n.id}")
            return names[n.id]
        if isinstance(n, ast.Constant):
            return repr(n.value).lower() if isinstance(n.value, bool) else repr(n.value)
        raise BridgeError(f"precondition {text!r}: unsupported syntax {ast.unparse(n)}")

    return conv(ast.parse(text, mode="eval").body)


def launch_call(symbol: str, params: list[tuple], args: dict[str, str]) -> str:
    """`<symbol>_call(...)` with each parameter bound by name."""
    out = []
    for name, kind, _dtype, ctype in params:
        if kind == "stream":
            out.append("s")
            continue
        if name not in args:
            raise BridgeError(f"{symbol}: no value for launcher parameter '{name}'")
        out.append(f"({ctype})({args[name]})" if kind != "pointer" else args[name])
    return f"{symbol}_call({', '.join(out)})"


def merge_terms(states, st: dict, guards: dict, base: dict, make_printer) -> tuple[dict, list[tuple[str, str]]]:
    """The engine's merge form as kernel text, shared by the templates that merge segments (split-KV, split-K).

    ``states``: the row states' forms; ``st``: state name -> its symbols (``old``, ``new``, ``new_safe``);
    ``guards``: the guarded states; ``base``: names every printed expression may also read; ``make_printer``: a
    symbol -> text mapping to a printer.  Returns the names (a segment's old value reads ``<state>_seg``, the merged
    value ``<state>`` or its guard ``<state>_safe``) and, per state, (name, its segment value corrected to the merged
    states)."""
    names = dict(base)
    for name, roles in st.items():
        names[roles["old"]] = f"{name}_seg"
        names[roles["new_safe"]] = f"{name}_safe" if name in guards else name
        names[roles["new"]] = name
    terms = []
    for f in states:
        if f.kind == "none":
            terms.append((f.name, f"{f.name}_seg"))
            continue
        seg = sp.Symbol(f"{f.name}__seg")
        e = seg * f.correction if f.kind == "*" else seg + f.correction
        terms.append((f.name, make_printer({**names, seg: f"{f.name}_seg"})(e)))
    return names, terms


class RolePrinter(TLPrinter):
    """sympy orders the sides of an equality by the spec's names: print them in the kernel's names' order, so that
    the kernel does not depend on what the spec calls its axes and arguments."""

    def p(self, e):
        if isinstance(e, (sp.Eq, sp.Ne)):
            a, b = sorted((self.p(e.lhs), self.p(e.rhs)))
            return f"({a} {'==' if isinstance(e, sp.Eq) else '!='} {b})"
        return super().p(e)
