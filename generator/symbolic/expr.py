"""The expression language of specs: Python expression syntax, parsed with `ast` into sympy.

Vocabulary: + - * / // % **, comparisons, and/or/not, `a if c else b`, exp, log, sqrt, abs, max(a, b),
min(a, b), sigmoid, clamp(x, lo, hi), where(c, a, b), casts (float32, float16, bfloat16, e4m3), contractions
`sum(expr, c)` over an index c, tensor reads `x[i, j]`, top-k fields `sel.value`, `sel.index[r]`,
`sum(sel.value)` (sum over the entries of a top-k), `isin(x, sel.index)`.

Specialising arguments (bool, str, optional tensors) are resolved while parsing: `causal`, `scoring == 'softmax'`
and `bias is not None` evaluate to Python booleans under a given specialisation, so conditionals on them collapse.
"""

from __future__ import annotations

import ast
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import sympy as sp

from ..errors import Loc, SpecError


# --------------------------------------------------------------------------------------------- custom functions
class sigmoid(sp.Function):
    """The logistic function, kept whole for printing; positive and increasing."""

    nargs = 1

    @classmethod
    def eval(cls, x):
        if x is sp.oo:
            return sp.Integer(1)
        if x is sp.S.NegativeInfinity:
            return sp.Integer(0)
        if x.is_zero:
            return sp.Rational(1, 2)
        return None

    def fdiff(self, argindex=1):
        s = sigmoid(self.args[0])
        return s * (1 - s)

    def _eval_rewrite_as_exp(self, x, **kwargs):
        return 1 / (1 + sp.exp(-x))

    def _eval_is_positive(self):
        return self.args[0].is_extended_real

    def _eval_is_real(self):
        return self.args[0].is_real


class Cast(sp.Function):
    """A rounding conversion. Value-preserving for the fusion proof ("exact up to rounding"), printed as a cast."""

    nargs = 1
    dtype = ""

    def _eval_is_real(self):
        return self.args[0].is_real

    def _eval_is_positive(self):
        return self.args[0].is_positive

    def _eval_is_nonnegative(self):
        return self.args[0].is_nonnegative


class cast_float32(Cast):
    dtype = "float32"


class cast_float16(Cast):
    dtype = "float16"


class cast_bfloat16(Cast):
    dtype = "bfloat16"


class cast_e4m3(Cast):
    """Saturating conversion to float8 e4m3fn (clamped to +-448 first)."""

    dtype = "float8_e4m3fn"


CASTS: dict[str, type[Cast]] = {
    "float32": cast_float32,
    "float16": cast_float16,
    "bfloat16": cast_bfloat16,
    "e4m3": cast_e4m3,
}


class idiv(sp.Function):
    """Floor division of non-negative integers (index arithmetic)."""

    nargs = 2
    is_integer = True

    @classmethod
    def eval(cls, a, b):
        if a.is_Integer and b.is_Integer and b != 0:
            return sp.Integer(int(a) // int(b))
        if b == 1:
            return a
        return None

    def _eval_is_nonnegative(self):
        if self.args[0].is_nonnegative and self.args[1].is_positive:
            return True
        return None


class entrysum(sp.Function):
    """Sum over the entries of a top-k result field: entrysum(sel.value)."""

    nargs = 1


class isin(sp.Function):
    """Membership of an integer value among the indices a top-k selected: isin(x, sel.index)."""

    nargs = 2
    is_Boolean = True


def is_bool(x: Any) -> bool:
    """A sympy truth value (relation, boolean function or literal); sympy Symbols also subclass Boolean."""
    return isinstance(x, (bool, sp.logic.boolalg.BooleanFunction, sp.logic.boolalg.BooleanAtom,
                          sp.core.relational.Relational, isin))


def strip_casts(expr: sp.Expr) -> sp.Expr:
    """Replace every rounding cast by its argument (the exact-arithmetic view used for proofs)."""
    return expr.replace(lambda e: isinstance(e, Cast), lambda e: e.args[0])


def has_casts(expr: sp.Basic) -> list[str]:
    return sorted({type(e).dtype for e in expr.atoms(Cast)})


# --------------------------------------------------------------------------------------------- scope
@dataclass(frozen=True)
class TopkField:
    """A field of a top-k (or argmax) result: value, index or a carried payload; indexed by its entries."""

    reduction: str
    field: str

    @property
    def base(self) -> sp.IndexedBase:
        return sp.IndexedBase(f"{self.reduction}.{self.field}")


@dataclass
class Scope:
    """What names mean while parsing one expression."""

    values: dict[str, Any] = field(default_factory=dict)  # name -> sympy object
    tensors: dict[str, sp.IndexedBase] = field(default_factory=dict)
    tensor_ndim: dict[str, int] = field(default_factory=dict)
    optional_tensors: dict[str, bool] = field(default_factory=dict)  # name -> present under this specialisation
    flags: dict[str, Any] = field(default_factory=dict)  # bool/str specialising args -> Python value
    nullable: set[str] = field(default_factory=set)  # optional scalars (None handled by when_null)
    indices: dict[str, sp.Symbol] = field(default_factory=dict)
    extents: dict[str, sp.Expr] = field(default_factory=dict)
    topk: dict[str, tuple[str, ...]] = field(default_factory=dict)  # reduction -> fields
    scalar_selections: set[str] = field(default_factory=set)  # argmax results: one entry, fields read directly


_BINOPS: dict[type, Callable[[Any, Any], Any]] = {
    ast.Add: lambda a, b: a + b,
    ast.Sub: lambda a, b: a - b,
    ast.Mult: lambda a, b: a * b,
    ast.Div: lambda a, b: a / b,
    ast.Pow: lambda a, b: a**b,
    ast.FloorDiv: lambda a, b: idiv(a, b),
    ast.Mod: lambda a, b: sp.Mod(a, b),
}
_CMPOPS: dict[type, Callable[[Any, Any], Any]] = {
    ast.Lt: sp.Lt,
    ast.LtE: sp.Le,
    ast.Gt: sp.Gt,
    ast.GtE: sp.Ge,
    ast.Eq: sp.Eq,
    ast.NotEq: sp.Ne,
}
_UNARY_FUNCS = {
    "exp": sp.exp,
    "log": sp.log,
    "sqrt": sp.sqrt,
    "abs": sp.Abs,
    "sigmoid": sigmoid,
    "sin": sp.sin,
    "cos": sp.cos,
    "tanh": sp.tanh,
}


@dataclass(frozen=True)
class ReductionCall:
    """A parsed top-level reduction: op(body, [k], where=..., over=..., carry=[...])."""

    op: str
    body: sp.Expr
    k: sp.Expr | None
    where: Any  # sympy boolean or sp.true
    over: str | None
    carry: tuple[str, ...]


class ExprParser:
    def __init__(self, scope: Scope, loc: Loc):
        self.scope = scope
        self.loc = loc

    def fail(self, message: str) -> SpecError:
        return SpecError(self.loc, message)

    # ------------------------------------------------------------------ entry points
    def parse(self, text: str) -> Any:
        return self.visit(self._tree(text))

    def parse_reduction(self, text: str, ops: tuple[str, ...]) -> ReductionCall:
        node = self._tree(text)
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)):
            raise self.fail(f"a reduction is a call of one of {', '.join(ops)}: got '{text}'")
        op = node.func.id
        if op not in ops:
            raise self.fail(f"unsupported reduction operator '{op}' (supported: {', '.join(ops)})")
        kwargs = {kw.arg: kw.value for kw in node.keywords}
        for key in kwargs:
            if key not in ("where", "over", "carry"):
                raise self.fail(f"unknown keyword '{key}' in {op}()")
        want = 2 if op == "topk" else 1
        if len(node.args) != want:
            raise self.fail(f"{op}() takes {want} positional argument(s), got {len(node.args)}")
        body = self.visit(node.args[0])
        self._numeric(body, node.args[0])
        k = self.visit(node.args[1]) if op == "topk" else None
        if k is not None and (not isinstance(k, sp.Expr) or is_bool(k) or k.is_integer is not True):
            raise self.fail(f"the k of topk() is an integer expression of sizes and int arguments, got "
                            f"'{ast.unparse(node.args[1])}'")
        where = self.visit(kwargs["where"]) if "where" in kwargs else sp.true
        if where is True:
            where = sp.true
        elif where is False:
            where = sp.false
        if not is_bool(where):
            raise self.fail(f"where= is a condition (a comparison, and/or/not), got '{ast.unparse(kwargs['where'])}'")
        over = None
        if "over" in kwargs:
            o = kwargs["over"]
            if not isinstance(o, ast.Name) or o.id not in self.scope.indices:
                raise self.fail("over= names a declared index")
            over = o.id
        carry: tuple[str, ...] = ()
        if "carry" in kwargs:
            c = kwargs["carry"]
            if not isinstance(c, (ast.List, ast.Tuple)) or not all(isinstance(e, ast.Name) for e in c.elts):
                raise self.fail("carry= is a list of let names")
            carry = tuple(e.id for e in c.elts)
            if op not in ("topk", "argmax"):
                raise self.fail("only topk and argmax carry payloads")
        return ReductionCall(op, sp.sympify(body), k, where, over, carry)

    def _tree(self, text: str) -> ast.AST:
        try:
            return ast.parse(text, mode="eval").body
        except SyntaxError as exc:
            raise self.fail(f"cannot parse expression '{text}': {exc.msg}") from None

    # ------------------------------------------------------------------ visitors
    def visit(self, node: ast.AST) -> Any:
        method = getattr(self, f"visit_{type(node).__name__}", None)
        if method is None:
            raise self.fail(f"unsupported syntax: {ast.unparse(node)}")
        return method(node)

    def visit_Constant(self, node: ast.Constant) -> Any:
        v = node.value
        if isinstance(v, bool) or v is None or isinstance(v, str):
            return v
        if isinstance(v, int):
            return sp.Integer(v)
        if isinstance(v, float):
            return sp.Float(v) if v != int(v) else sp.Integer(int(v))
        raise self.fail(f"unsupported literal {v!r}")

    def visit_Name(self, node: ast.Name) -> Any:
        n = node.id
        s = self.scope
        if n == "inf":
            return sp.oo
        if n == "nan":
            return sp.nan
        if n in s.flags:
            return s.flags[n]
        if n in s.optional_tensors and n not in s.values:
            raise self.fail(f"optional tensor '{n}' is read without a test (use 'x if {n} is not None else y')")
        if n in s.values:
            return s.values[n]
        if n in s.indices:
            return s.indices[n]
        if n in s.tensors:
            raise self.fail(f"tensor '{n}' must be indexed, e.g. {n}[...]")
        if n in s.topk:
            raise self.fail(f"'{n}' is a top-k result: use one of its fields {', '.join(s.topk[n])}")
        raise self.fail(f"unknown name '{n}'")

    def visit_Attribute(self, node: ast.Attribute) -> Any:
        if isinstance(node.value, ast.Name) and node.value.id in self.scope.topk:
            red = node.value.id
            if node.attr not in self.scope.topk[red]:
                raise self.fail(f"'{red}' has no field '{node.attr}' (fields: {', '.join(self.scope.topk[red])})")
            f = TopkField(red, node.attr)
            return f.base[0] if red in self.scope.scalar_selections else f
        raise self.fail(f"unsupported attribute {ast.unparse(node)}")

    def visit_Subscript(self, node: ast.Subscript) -> Any:
        idx_node = node.slice
        items = idx_node.elts if isinstance(idx_node, ast.Tuple) else [idx_node]
        indices = [self.visit(i) for i in items]
        for i in indices:
            if not isinstance(i, sp.Basic) or is_bool(i):
                raise self.fail(f"bad index in {ast.unparse(node)}")
        base = node.value
        if isinstance(base, ast.Name) and base.id in self.scope.tensors:
            name = base.id
            if name in self.scope.optional_tensors and not self.scope.optional_tensors[name]:
                raise self.fail(f"optional tensor '{name}' is absent here: guard the read with 'if {name} is not None'")
            if len(indices) != self.scope.tensor_ndim[name]:
                raise self.fail(f"'{name}' has {self.scope.tensor_ndim[name]} dims, indexed with {len(indices)}")
            return self.scope.tensors[name][tuple(indices)]
        target = self.visit(base)
        if isinstance(target, TopkField):
            if len(indices) != 1:
                raise self.fail("a top-k field takes one entry index")
            return target.base[indices[0]]
        raise self.fail(f"cannot index {ast.unparse(base)}")

    def visit_BinOp(self, node: ast.BinOp) -> Any:
        op = _BINOPS.get(type(node.op))
        if op is None:
            raise self.fail(f"unsupported operator in {ast.unparse(node)}")
        a, b = self.visit(node.left), self.visit(node.right)
        self._numeric(a, node.left)
        self._numeric(b, node.right)
        if isinstance(node.op, (ast.Div, ast.FloorDiv, ast.Mod)) and sp.sympify(b).is_zero:
            raise self.fail(f"division by zero in {ast.unparse(node)}")
        out = op(a, b)
        if isinstance(out, sp.Basic) and out.has(sp.zoo, sp.nan):
            raise self.fail(f"{ast.unparse(node)} is undefined")
        return out

    def visit_UnaryOp(self, node: ast.UnaryOp) -> Any:
        v = self.visit(node.operand)
        if isinstance(node.op, ast.Not):
            return (not v) if isinstance(v, bool) else sp.Not(v)
        self._numeric(v, node.operand)
        if isinstance(node.op, ast.USub):
            return -v
        if isinstance(node.op, ast.UAdd):
            return v
        raise self.fail(f"unsupported operator in {ast.unparse(node)}")

    def visit_BoolOp(self, node: ast.BoolOp) -> Any:
        vals = [self.visit(v) for v in node.values]
        is_and = isinstance(node.op, ast.And)
        out = []
        for v in vals:
            if isinstance(v, bool):
                if v != is_and:  # False in and / True in or decides
                    return v
                continue
            out.append(v)
        if not out:
            return is_and
        return sp.And(*out) if is_and else sp.Or(*out)

    def visit_Compare(self, node: ast.Compare) -> Any:
        if len(node.ops) != 1:
            raise self.fail("chained comparisons are not supported; use 'and'")
        op = node.ops[0]
        left, right = node.left, node.comparators[0]
        if isinstance(op, (ast.Is, ast.IsNot)):
            if not (isinstance(right, ast.Constant) and right.value is None and isinstance(left, ast.Name)):
                raise self.fail("'is' compares an optional argument with None")
            name = left.id
            if name in self.scope.optional_tensors:
                present = self.scope.optional_tensors[name]
            elif name in self.scope.flags:
                present = self.scope.flags[name] is not None
            else:
                raise self.fail(f"'{name}' is not an optional argument")
            return present if isinstance(op, ast.IsNot) else not present
        a, b = self.visit(left), self.visit(right)
        if isinstance(a, str) or isinstance(b, str):
            if not (isinstance(a, str) and isinstance(b, str)) or not isinstance(op, (ast.Eq, ast.NotEq)):
                raise self.fail("strings compare with == or != against a str argument")
            return (a == b) if isinstance(op, ast.Eq) else (a != b)
        self._numeric(a, left)
        self._numeric(b, right)
        r = _CMPOPS[type(op)](a, b)
        if r is sp.true or r is sp.false:
            return bool(r)
        return r

    def visit_IfExp(self, node: ast.IfExp) -> Any:
        cond = self.visit(node.test)
        if isinstance(cond, bool):
            return self.visit(node.body if cond else node.orelse)
        a, b = self.visit(node.body), self.visit(node.orelse)
        return sp.Piecewise((a, cond), (b, True))

    def visit_Call(self, node: ast.Call) -> Any:
        if not isinstance(node.func, ast.Name):
            raise self.fail(f"unsupported call {ast.unparse(node)}")
        name = node.func.id
        if node.keywords:
            raise self.fail(f"{name}() takes no keywords here (reductions only appear under 'reduce')")
        if name in ("max", "min") and len(node.args) == 1:
            raise self.fail(f"{name}(x) with one argument is a reduction: put it under 'reduce'")
        if name == "sum":
            return self._sum(node)
        args = [self.visit(a) for a in node.args]
        if name in _UNARY_FUNCS:
            self._arity(name, args, 1)
            self._numeric(args[0], node.args[0])
            return _UNARY_FUNCS[name](args[0])
        if name in CASTS:
            self._arity(name, args, 1)
            return CASTS[name](args[0])
        if name in ("max", "min"):
            for a, n in zip(args, node.args):
                self._numeric(a, n)
            return sp.Max(*args) if name == "max" else sp.Min(*args)
        if name == "clamp":
            self._arity(name, args, 3)
            return sp.Min(sp.Max(args[0], args[1]), args[2])
        if name == "where":
            self._arity(name, args, 3)
            if isinstance(args[0], bool):
                return args[1] if args[0] else args[2]
            return sp.Piecewise((args[1], args[0]), (args[2], True))
        if name == "isin":
            self._arity(name, args, 2)
            if not isinstance(args[1], TopkField) or args[1].field != "index":
                raise self.fail("isin(x, sel.index) tests membership among a top-k's indices")
            return isin(args[0], args[1].base)
        if name in ("argmax", "topk"):
            raise self.fail(f"{name}() is a reduction: put it under 'reduce'")
        raise self.fail(f"unknown function '{name}'")

    def _sum(self, node: ast.Call) -> Any:
        if len(node.args) == 1:
            v = self.visit(node.args[0])
            if isinstance(v, TopkField):
                return entrysum(v.base)
            raise self.fail("sum(x) with one argument is a reduction: put it under 'reduce' "
                            "(a contraction names its index: sum(expr, c))")
        if len(node.args) != 2 or not isinstance(node.args[1], ast.Name):
            raise self.fail("a contraction is sum(expr, index)")
        c = node.args[1].id
        if c not in self.scope.indices:
            raise self.fail(f"contraction index '{c}' is not declared under indices")
        body = self.visit(node.args[0])
        self._numeric(body, node.args[0])
        return sp.Sum(body, (self.scope.indices[c], 0, self.scope.extents[c] - 1))

    def _arity(self, name: str, args: list, n: int) -> None:
        if len(args) != n:
            raise self.fail(f"{name}() takes {n} argument(s), got {len(args)}")

    def _numeric(self, v: Any, node: ast.AST) -> None:
        if isinstance(v, (str, TopkField)) or v is None or isinstance(v, bool):
            raise self.fail(f"'{ast.unparse(node)}' is not a number here")
