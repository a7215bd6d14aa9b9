"""sympy -> C++ expression printer for the generated CPU kernels.

The printer knows nothing about ops: a `names` callback maps each symbol, tensor read and selection field to
C++ text (the kernel emitter decides where values live). Floating values are float; integer values int64_t.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import sympy as sp

from ..symbolic.expr import (
    Cast,
    cast_bfloat16,
    cast_e4m3,
    cast_float16,
    entrysum,
    idiv,
    isin,
    sigmoid,
)

# C++20's keywords and alternative tokens, and the fixed-width integer types the generated code names unqualified:
# no name of the spec's may be one where the generated C++ uses that name as an identifier (codegen/glue.py)
CPP_RESERVED = frozenset([
    "alignas", "alignof", "and", "and_eq", "asm", "auto", "bitand", "bitor", "bool", "break", "case", "catch",
    "char", "char8_t", "char16_t", "char32_t", "class", "compl", "concept", "const", "consteval", "constexpr",
    "constinit", "const_cast", "continue", "co_await", "co_return", "co_yield", "decltype", "default", "delete",
    "do", "double", "dynamic_cast", "else", "enum", "explicit", "export", "extern", "false", "float", "for",
    "friend", "goto", "if", "inline", "int", "long", "mutable", "namespace", "new", "noexcept", "not", "not_eq",
    "nullptr", "operator", "or", "or_eq", "private", "protected", "public", "register", "reinterpret_cast",
    "requires", "return", "short", "signed", "sizeof", "static", "static_assert", "static_cast", "struct", "switch",
    "template", "this", "thread_local", "throw", "true", "try", "typedef", "typeid", "typename", "union",
    "unsigned", "using", "virtual", "void", "volatile", "wchar_t", "while", "xor", "xor_eq", "int8_t", "int16_t",
    "int32_t", "int64_t", "uint8_t", "uint16_t", "uint32_t", "uint64_t", "size_t", "uintptr_t", "NULL"
])
FLOAT_FUNCS = {sp.exp: "rf::exp", sp.log: "rf::log", sp.sin: "std::sin", sp.cos: "std::cos", sp.tanh: "std::tanh"}
ROUNDING = {cast_e4m3: "rf::round_e4m3", cast_float16: "rf::round_half", cast_bfloat16: "rf::round_bf16"}


def let_type(let) -> str:
    """The C type of a let's value: int64_t for an integer let (an index), float otherwise."""
    return "int64_t" if let.symbol.is_integer else "float"


def float_literal(v: float) -> str:
    if v == float("inf"):
        return "rf::kInf"
    if v == float("-inf"):
        return "(-rf::kInf)"
    if math.isnan(v):
        return "rf::kNaN"
    text = repr(float(v))
    if "e" not in text and "." not in text:
        text += ".0"
    return f"{text}f"


class CppPrinter:
    """Prints sympy expressions as C++; `resolve(node)` returns C++ text for leaves it knows (or None)."""

    def __init__(self, resolve: Callable[[sp.Basic], str | None], selects: bool = False):
        self.resolve = resolve
        # selects: a two-way float choice whose branches read no tensor and divide no integer is printed as
        # rf::sel (both evaluated, chosen by bit masks), which vectorises where a branch does not (CPU kernels)
        self.selects = selects

    def __call__(self, expr: sp.Basic) -> str:
        return self.p(expr)

    def is_int(self, e: sp.Basic) -> bool:
        if isinstance(e, (idiv, sp.Mod)):
            return all(self.is_int(a) for a in e.args)
        if isinstance(e, (sp.Add, sp.Mul)) and e.args:
            return all(self.is_int(a) for a in e.args)
        return bool(getattr(e, "is_integer", False))

    def p(self, e: sp.Basic) -> str:
        if isinstance(e, bool):
            return "true" if e else "false"
        hit = self.resolve(e)
        if hit is not None:
            return hit
        if e is sp.true:
            return "true"
        if e is sp.false:
            return "false"
        if e is sp.oo:
            return "rf::kInf"
        if e is sp.S.NegativeInfinity:
            return "(-rf::kInf)"
        if e is sp.nan:
            return "rf::kNaN"
        if e.is_Integer:
            return f"int64_t({int(e)})"
        if e.is_Rational:
            return float_literal(float(e))
        if e.is_Float:
            return float_literal(float(e))
        if isinstance(e, sp.Add):
            ints = all(self.is_int(a) for a in e.args)
            parts = [self.p(a) for a in e.args]
            return "(" + " + ".join(parts) + ")" if ints else "(" + " + ".join(self.flt(a) for a in e.args) + ")"
        if isinstance(e, sp.Mul):
            if all(self.is_int(a) for a in e.args):
                return "(" + " * ".join(self.p(a) for a in e.args) + ")"
            num, den = [], []
            for a in e.args:
                if a.is_Pow and a.exp.is_Integer and int(a.exp) < 0:
                    den.append(a.base ** (-a.exp))
                elif a.is_Rational and not a.is_Integer and a.p == 1:
                    den.append(sp.Integer(a.q))
                else:
                    num.append(a)
            n = " * ".join(self.flt(a) for a in num) if num else "1.0f"
            if not den:
                return f"({n})"
            d = " * ".join(self.flt(a) for a in den)
            return f"({n} / ({d}))"
        if isinstance(e, sp.Pow):
            b, x = e.base, e.exp
            if x.is_Integer:
                k = int(x)
                if k == -1:
                    return f"(1.0f / {self.flt(b)})"
                if 1 <= k <= 4:
                    return "(" + " * ".join([self.flt(b)] * k) + ")"
            if x == sp.Rational(1, 2):
                return f"rf::sqrt({self.flt(b)})"
            if x == sp.Rational(-1, 2):
                return f"(1.0f / rf::sqrt({self.flt(b)}))"
            return f"std::pow({self.flt(b)}, {self.flt(x)})"
        for fn, name in FLOAT_FUNCS.items():
            if isinstance(e, fn):
                return f"{name}({self.flt(e.args[0])})"
        if isinstance(e, sigmoid):
            return f"rf::sigmoid({self.flt(e.args[0])})"
        if isinstance(e, sp.Abs):
            return f"std::fabs({self.flt(e.args[0])})"
        if isinstance(e, (sp.Max, sp.Min)):
            fn = "rf::max" if isinstance(e, sp.Max) else "rf::min"
            ints = all(self.is_int(a) for a in e.args)
            args = [self.p(a) if ints else self.flt(a) for a in e.args]
            out = args[0]
            for a in args[1:]:
                out = f"{fn}({out}, {a})"
            return out
        if isinstance(e, Cast):
            inner = self.flt(e.args[0])
            return f"{ROUNDING[type(e)]}({inner})" if type(e) in ROUNDING else inner
        if isinstance(e, idiv):
            return f"rf::idiv({self.p(e.args[0])}, {self.p(e.args[1])})"
        if isinstance(e, sp.Mod):
            return f"rf::imod({self.p(e.args[0])}, {self.p(e.args[1])})"
        if isinstance(e, sp.Piecewise):
            if self.selects and len(e.args) == 2 and e.args[1][1] in (sp.true, True) and not self.is_int(e) \
                    and all(self.safe_both(v) for v, _ in e.args):
                (a, cond), (b, _) = e.args
                return f"rf::sel({self.p(cond)}, {self.flt(a)}, {self.flt(b)})"
            out = self.val(e.args[-1][0], e)
            for value, cond in reversed(e.args[:-1]):
                out = f"(({self.p(cond)}) ? {self.val(value, e)} : {out})"
            return out
        if isinstance(e, sp.core.relational.Relational):
            op = {sp.Eq: "==", sp.Ne: "!=", sp.Lt: "<", sp.Le: "<=", sp.Gt: ">", sp.Ge: ">="}[type(e)]
            ints = self.is_int(e.lhs) and self.is_int(e.rhs)
            a, b = (self.p(e.lhs), self.p(e.rhs)) if ints else (self.flt(e.lhs), self.flt(e.rhs))
            return f"({a} {op} {b})"
        if isinstance(e, sp.And):
            return "(" + " && ".join(self.p(a) for a in e.args) + ")"
        if isinstance(e, sp.Or):
            return "(" + " || ".join(self.p(a) for a in e.args) + ")"
        if isinstance(e, sp.Not):
            return f"(!{self.p(e.args[0])})"
        if isinstance(e, (entrysum, isin)):
            raise TypeError(f"{e} must be resolved by the kernel emitter")
        raise NotImplementedError(f"no C++ for {e!r} ({type(e).__name__})")

    def safe_both(self, e: sp.Basic) -> bool:
        """e may be evaluated where its branch is not taken: float math on values at hand, no tensor read (its
        index may be out of bounds there), no integer division, no selection entry."""
        if not isinstance(e, sp.Basic):
            return True
        return not e.atoms(sp.Indexed, idiv, sp.Mod, entrysum, isin, sp.Sum)

    def flt(self, e: sp.Basic) -> str:
        """e as a float value (integers converted)."""
        if isinstance(e, sp.Basic) and e.is_Integer:
            return float_literal(float(e))
        text = self.p(e)
        if self.is_int(e):
            return f"static_cast<float>({text})"
        return text

    def val(self, e: sp.Basic, context: sp.Basic) -> str:
        return self.p(e) if self.is_int(context) else self.flt(e)
