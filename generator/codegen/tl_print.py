"""sympy -> TileLang expression text (the `T.` intrinsics the kernel templates accept).

Names are given by the caller (a template decides where each value lives); an unnamed symbol is an error,
so nothing reaches a kernel that the bridge did not place explicitly.
"""

from __future__ import annotations

import sympy as sp

from ..symbolic.expr import Cast, sigmoid

# one-argument functions of the spec language and their TileLang intrinsics
_FUNCTIONS = ((sp.tanh, "tanh"), (sp.sin, "sin"), (sp.cos, "cos"))


class TLPrinter:
    def __init__(self, names: dict[sp.Basic, str], where: str, inf: str = "T.infinity(accum_dtype)"):
        self.names = names
        self.where = where
        self.inf = inf  # how the template spells +infinity

    def __call__(self, e: sp.Basic) -> str:
        return self.p(e)

    def p(self, e: sp.Basic) -> str:
        if isinstance(e, bool):
            return "True" if e else "False"
        if e in self.names:
            return self.names[e]
        if e is sp.oo:
            return self.inf
        if e is sp.S.NegativeInfinity:
            return f"-{self.inf}"
        if e is sp.nan:
            return 'T.float32(float("nan"))'  # a quiet NaN constant (the frontend evaluates float("nan"))
        if e.is_Number:
            return f"T.float32({float(e)!r})"
        if isinstance(e, sp.Add):
            pos = [a for a in e.args if not a.could_extract_minus_sign()]
            neg = [-a for a in e.args if a.could_extract_minus_sign()]
            out = " + ".join(self.p(a) for a in pos) if pos else "T.float32(0.0)"
            for a in neg:
                out += f" - ({self.p(a)})" if isinstance(a, sp.Add) else f" - {self.p(a)}"
            return f"({out})"
        if isinstance(e, sp.Mul):
            num, den = [], []
            for a in e.args:
                if a.is_Pow and a.exp.is_Integer and int(a.exp) < 0:
                    den.append(a.base ** (-a.exp))
                else:
                    num.append(a)
            if len(num) == 1 and num[0] == -1:
                num = [sp.Integer(-1)]
            n = " * ".join(self.p(a) for a in num) if num else "T.float32(1.0)"
            if not den:
                return f"({n})"
            return f"({n} / ({' * '.join(self.p(a) for a in den)}))"
        if isinstance(e, sp.Pow):
            if e.exp == sp.Rational(1, 2):
                return f"T.sqrt({self.p(e.base)})"
            if e.exp.is_Integer and 1 <= int(e.exp) <= 4:
                return "(" + " * ".join([self.p(e.base)] * int(e.exp)) + ")"
            if e.exp == -1:
                return f"(T.float32(1.0) / {self.p(e.base)})"
            if e.exp == sp.Rational(-1, 2):
                return f"(T.float32(1.0) / T.sqrt({self.p(e.base)}))"
            raise ValueError(f"{self.where}: no TileLang form for the power {e}")
        if isinstance(e, sp.exp):
            return f"T.exp({self.p(e.args[0])})"
        if isinstance(e, sp.log):
            return f"T.log({self.p(e.args[0])})"
        if isinstance(e, sp.Abs):
            return f"T.abs({self.p(e.args[0])})"
        for fn, name in _FUNCTIONS:
            if isinstance(e, fn):
                return f"T.{name}({self.p(e.args[0])})"
        if isinstance(e, sigmoid):
            return f"(T.float32(1.0) / (T.float32(1.0) + T.exp(-({self.p(e.args[0])}))))"
        if isinstance(e, (sp.Max, sp.Min)):
            fn = "T.max" if isinstance(e, sp.Max) else "T.min"
            out = self.p(e.args[0])
            for a in e.args[1:]:
                out = f"{fn}({out}, {self.p(a)})"
            return out
        if isinstance(e, Cast) and e.dtype == "float32":
            return self.p(e.args[0])
        if isinstance(e, sp.Piecewise):
            out = self.p(e.args[-1][0])
            for value, cond in reversed(e.args[:-1]):
                out = f"T.if_then_else({self.p(cond)}, {self.p(value)}, {out})"
            return out
        if isinstance(e, sp.core.relational.Relational):
            op = {sp.Eq: "==", sp.Ne: "!=", sp.Lt: "<", sp.Le: "<=", sp.Gt: ">", sp.Ge: ">="}[type(e)]
            return f"({self.p(e.lhs)} {op} {self.p(e.rhs)})"
        if isinstance(e, sp.Or):
            return "(" + " or ".join(self.p(a) for a in e.args) + ")"
        if isinstance(e, sp.And):
            return "(" + " and ".join(self.p(a) for a in e.args) + ")"
        if isinstance(e, sp.Not):
            return f"(not {self.p(e.args[0])})"
        raise ValueError(f"{self.where}: no TileLang name or form for {e} ({type(e).__name__})")
