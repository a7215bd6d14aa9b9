"""Cascade IR: a spec under one specialisation, as sympy objects with their roles made explicit.

Roles of names inside reduction bodies:
- element values: lets that depend on the reduction index (`s`, `x`) and tensor reads indexed by it (`v[b,j,g,d]`);
  they are atoms of the fusion proof (the `x` of F(x, D));
- row constants: sizes, scalar arguments, lets that depend on neither the reduction index nor a state;
- states: results of earlier reductions (the `D` of F(x, D)); lets that depend on states are inlined.
"""

from __future__ import annotations

import ast
import itertools
from dataclasses import dataclass
from typing import Any

import sympy as sp

from ..errors import FusionError, Loc, SpecError
from ..spec import REDUCTION_OPS, OpSpec, ScalarArg, TensorArg
from .expr import ExprParser, ReductionCall, Scope, TopkField, entrysum, is_bool, isin

SELECTION_OPS = ("argmax", "topk")


@dataclass(frozen=True)
class LetDef:
    name: str
    symbol: sp.Symbol
    expr: Any  # sympy expression (or boolean)
    kind: str  # "row" | "element" | "state" (state lets are inlined wherever they are used)
    indices: frozenset[str]  # indices it depends on, through other lets too
    loc: Loc


@dataclass(frozen=True)
class Reduction:
    name: str
    op: str  # sum | max | min | argmax | topk
    body: sp.Expr
    k: sp.Expr | None  # top-k size (argmax: 1)
    where: Any  # sympy boolean, sp.true when absent
    over: str  # the index it reduces over
    carry: tuple[tuple[str, sp.Expr], ...]  # payloads of a selection: (name, expression)
    free: tuple[str, ...]  # indices carried besides the rows (the d of o[d], the g of a per-group top-k)
    deps: tuple[str, ...]  # reductions it reads, in cascade order
    loc: Loc

    @property
    def selection(self) -> bool:
        return self.op in SELECTION_OPS

    @property
    def fields(self) -> tuple[str, ...]:
        return ("value", "index") + tuple(n for n, _ in self.carry) if self.selection else ()


@dataclass(frozen=True)
class OutputDef:
    name: str
    value: Any
    empty: Any  # value for an empty row, or None
    index: tuple[str, ...]
    loc: Loc


@dataclass(frozen=True)
class CascadeIR:
    op: str
    file: str
    specialization: tuple[tuple[str, Any], ...]
    axes: dict[str, sp.Symbol]
    scalars: dict[str, sp.Symbol]
    tensors: dict[str, sp.IndexedBase]
    tensor_args: dict[str, TensorArg]
    indices: dict[str, sp.Symbol]
    extents: dict[str, sp.Expr]
    rows: tuple[str, ...]
    over: str
    lets: tuple[LetDef, ...]
    mask: Any  # sympy boolean over indices, sizes, arguments and tensor reads (no states)
    reductions: tuple[Reduction, ...]
    states: dict[str, sp.Symbol]  # scalar reductions -> their value symbol (any value, 0 of an empty sum too)
    regular: dict[str, dict[str, bool]]  # assumptions that hold away from degenerate values (guards cover those)
    outputs: tuple[OutputDef, ...]
    passes: int
    checks: tuple[Any, ...]  # the spec's checks as sympy booleans over sizes and int/float arguments

    def reduction(self, name: str) -> Reduction:
        for r in self.reductions:
            if r.name == name:
                return r
        raise KeyError(name)

    def let(self, name: str) -> LetDef:
        for x in self.lets:
            if x.name == name:
                return x
        raise KeyError(name)

    @property
    def element_lets(self) -> tuple[LetDef, ...]:
        return tuple(x for x in self.lets if x.kind == "element")

    @property
    def row_lets(self) -> tuple[LetDef, ...]:
        return tuple(x for x in self.lets if x.kind == "row")

    @property
    def label(self) -> str:
        if not self.specialization:
            return "(no specialisation)"
        return ", ".join(f"{k}={_show(v)}" for k, v in self.specialization)


def _show(v: Any) -> str:
    if v is True:
        return "true"
    if v is False:
        return "false"
    return str(v)


# --------------------------------------------------------------------------------------------- specialisations
def specialization_axes(spec: OpSpec) -> list[tuple[str, tuple[Any, ...]]]:
    """Arguments that change the math: bool and str arguments, and the presence of optional tensors."""
    out: list[tuple[str, tuple[Any, ...]]] = []
    for a in spec.args:
        if isinstance(a, ScalarArg) and a.type == "bool":
            out.append((a.name, (False, True)))
        elif isinstance(a, ScalarArg) and a.type == "str":
            out.append((a.name, a.choices))
        elif isinstance(a, TensorArg) and a.optional:
            out.append((a.name, ("absent", "present")))
    return out


def specializations(spec: OpSpec) -> list[tuple[tuple[str, Any], ...]]:
    axes = specialization_axes(spec)
    return [tuple(zip([n for n, _ in axes], combo)) for combo in itertools.product(*[v for _, v in axes])]


# --------------------------------------------------------------------------------------------- building
class _Pending(Exception):
    def __init__(self, name: str):
        self.name = name


def _peek_call(text: str) -> tuple[str | None, tuple[str, ...]]:
    """The operator and carry names of a reduction text, without resolving names."""
    try:
        node = ast.parse(text, mode="eval").body
    except SyntaxError:
        return None, ()
    if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)):
        return None, ()
    carry: tuple[str, ...] = ()
    for kw in node.keywords:
        if kw.arg == "carry" and isinstance(kw.value, (ast.List, ast.Tuple)):
            carry = tuple(e.id for e in kw.value.elts if isinstance(e, ast.Name))
    return node.func.id, carry


def _check_signs(spec: OpSpec) -> dict[str, dict[str, bool]]:
    """Signs of float arguments that the spec's checks guarantee (`eps > 0`, `beta >= 0`, also inside an `and`):
    the checks run before any kernel, so the proofs may assume them (a positive eps keeps rsqrt(ss + eps) finite)."""
    out: dict[str, dict[str, bool]] = {}
    for ch in spec.checks:
        try:
            node = ast.parse(ch.expr, mode="eval").body
        except SyntaxError:
            continue
        parts = node.values if isinstance(node, ast.BoolOp) and isinstance(node.op, ast.And) else [node]
        for part in parts:
            if not (isinstance(part, ast.Compare) and len(part.ops) == 1):
                continue
            lhs, op, rhs = part.left, part.ops[0], part.comparators[0]
            if isinstance(lhs, ast.Constant) and isinstance(rhs, ast.Name):  # 0 < eps  ->  eps > 0
                lhs, rhs = rhs, lhs
                op = {ast.Lt: ast.Gt(), ast.LtE: ast.GtE()}.get(type(op), op)
            if not (isinstance(lhs, ast.Name) and isinstance(rhs, ast.Constant) and rhs.value == 0
                    and not isinstance(rhs.value, bool)):
                continue
            if isinstance(op, ast.Gt):
                out[lhs.id] = {"positive": True}
            elif isinstance(op, ast.GtE):
                out.setdefault(lhs.id, {"nonnegative": True})
    return out


class _Builder:
    def __init__(self, spec: OpSpec, special: tuple[tuple[str, Any], ...]):
        self.spec = spec
        self.special = dict(special)
        c = spec.cascade
        self.axes = {a.name: sp.Symbol(a.name, integer=True, positive=True) for a in spec.axes}
        self.scalars: dict[str, sp.Symbol] = {}
        flags: dict[str, Any] = {}
        nullable: set[str] = set()
        optional_tensors: dict[str, bool] = {}
        for a in spec.scalars:
            if a.type in ("bool", "str"):
                flags[a.name] = self.special[a.name]
            elif a.type == "int":
                self.scalars[a.name] = sp.Symbol(a.name, integer=True)
            elif a.type == "float":
                sign = _check_signs(spec).get(a.name, {}) if not a.optional else {}
                self.scalars[a.name] = sp.Symbol(a.name, real=True, **sign)
                if a.optional:
                    nullable.add(a.name)
        self.tensors: dict[str, sp.IndexedBase] = {}
        ndim: dict[str, int] = {}
        for t in spec.tensors:
            kind = {"integer": True} if t.dtypes and t.dtypes[0].startswith("int") else {"real": True}
            if t.same_as:
                kind = {"real": True}
            self.tensors[t.name] = sp.IndexedBase(t.name, **kind)
            ndim[t.name] = len(t.shape)
            if t.optional:
                optional_tensors[t.name] = self.special[t.name] == "present"
        self.indices = {n: sp.Symbol(n, integer=True, nonnegative=True) for n, _, _ in c.indices}
        self.scope = Scope(
            values={**self.axes, **self.scalars},
            tensors=self.tensors,
            tensor_ndim=ndim,
            optional_tensors=optional_tensors,
            flags=flags,
            nullable=nullable,
            indices=self.indices,
            extents={},
        )
        self.extents: dict[str, sp.Expr] = {}
        for n, text, loc in c.indices:
            ext = ExprParser(Scope(values={**self.axes, **self.scalars}, flags=flags), loc).parse(text)
            if not isinstance(ext, sp.Expr) or not (ext.is_integer or ext.is_Integer):
                raise SpecError(loc, f"the extent of index '{n}' must be an integer expression of axes and int arguments")
            self.extents[n] = ext
        self.scope.extents = self.extents
        self.let_text = {x.name: x for x in c.lets}
        self.lets: dict[str, LetDef] = {}
        self.resolving: list[str] = []
        self.reduce_index = {r.name: n for n, r in enumerate(c.reduce)}
        self.current: int | None = None  # index of the reduction being parsed
        self.states: dict[str, sp.Symbol] = {}
        self.selections: dict[str, tuple[str, ...]] = {}
        self.reductions: list[Reduction] = []
        self.free_of: dict[str, tuple[str, ...]] = {}
        self.regular: dict[str, dict[str, bool]] = {}
        for r in c.reduce:
            op, carry = _peek_call(r.text)
            if op in SELECTION_OPS:
                self.selections[r.name] = ("value", "index") + carry
                if op == "argmax":
                    self.scope.scalar_selections.add(r.name)
        self.scope.topk = dict(self.selections)

    # ------------------------------------------------------------------ name resolution
    def _install_resolver(self) -> None:
        builder = self

        class _Values(dict):
            def __contains__(self, key: object) -> bool:
                return dict.__contains__(self, key) or key in builder.let_text or key in builder.reduce_index

            def __getitem__(self, key: str) -> Any:
                if dict.__contains__(self, key):
                    return dict.__getitem__(self, key)
                if key in builder.let_text:
                    return builder.resolve_let(key)
                if key in builder.reduce_index:
                    return builder.resolve_state(key)
                raise KeyError(key)

        self.scope.values = _Values(self.scope.values)

    def resolve_state(self, name: str) -> Any:
        if name in self.states:
            return self.states[name]
        if name in self.selections:
            raise SpecError(self.spec.cascade.loc, f"'{name}' is a top-k result: use one of its fields")
        raise _Pending(name)

    def resolve_let(self, name: str) -> Any:
        if name in self.lets:
            d = self.lets[name]
            return d.expr if d.kind == "state" else d.symbol
        if name in self.resolving:
            chain = " -> ".join(self.resolving + [name])
            raise SpecError(self.let_text[name].loc, f"let definitions form a cycle: {chain}")
        self.resolving.append(name)
        try:
            text = self.let_text[name]
            expr = ExprParser(self.scope, text.loc).parse(text.text)
        finally:
            self.resolving.pop()
        if isinstance(expr, (str, TopkField)) or expr is None:
            raise SpecError(text.loc, f"let '{name}' must be a numeric or boolean expression")
        if isinstance(expr, bool):
            expr = sp.true if expr else sp.false
        idx = self.index_deps(expr)
        if self.depends_on_state(expr):
            kind = "state"
        elif self.scope.indices[self.spec.cascade.over] in expr.free_symbols or self.spec.cascade.over in idx:
            kind = "element"
        else:
            kind = "row"
        if isinstance(expr, sp.Expr):
            assumptions = {"integer": True} if expr.is_integer else {"real": True}
        else:
            assumptions = {}
        sym = sp.Symbol(name, **assumptions)
        self.lets[name] = LetDef(name, sym, expr, kind, frozenset(idx), text.loc)
        return expr if kind == "state" else sym

    # ------------------------------------------------------------------ dependency analysis
    def index_deps(self, expr: Any) -> set[str]:
        """Indices an expression depends on, looking through let symbols and excluding contraction indices."""
        out: set[str] = set()
        if not isinstance(expr, sp.Basic):
            return out
        bound = set()
        for s in expr.atoms(sp.Sum):
            for lim in s.limits:
                bound.add(lim[0].name)
        for sym in expr.free_symbols:
            if sym.name in self.indices and self.indices[sym.name] == sym:
                out.add(sym.name)
            elif sym.name in self.lets and self.lets[sym.name].symbol == sym:
                out |= set(self.lets[sym.name].indices)
        for dep in self.state_deps(expr):  # a state carried over free indices depends on them
            out |= set(self.free_of.get(dep, ()))
        return out - bound

    def depends_on_state(self, expr: Any) -> bool:
        return bool(self.state_deps(expr))

    def state_deps(self, expr: Any) -> set[str]:
        out: set[str] = set()
        if not isinstance(expr, sp.Basic):
            return out
        for sym in expr.free_symbols:
            if sym.name in self.states and self.states[sym.name] == sym:
                out.add(sym.name)
        for base in expr.atoms(sp.IndexedBase):
            name = str(base.label)
            if "." in name and name.split(".")[0] in self.selections:
                out.add(name.split(".")[0])
        for e in expr.atoms(entrysum, isin):
            for a in e.args:
                if isinstance(a, sp.IndexedBase):
                    out.add(str(a.label).split(".")[0])
        return out

    # ------------------------------------------------------------------ reductions
    def build(self) -> CascadeIR:
        c = self.spec.cascade
        self._install_resolver()
        mask = sp.true
        if c.mask is not None:
            text, loc = c.mask
            try:
                m = ExprParser(self.scope, loc).parse(text)
            except _Pending as p:
                raise SpecError(loc, f"the mask may not depend on a reduction ('{p.name}')") from None
            if isinstance(m, bool):
                m = sp.true if m else sp.false
            if self.depends_on_state(m):
                raise SpecError(loc, "the mask may not depend on a reduction result")
            mask = m
        self.mask_expr = mask
        for n, rd in enumerate(c.reduce):
            self.current = n
            op, _ = _peek_call(rd.text)
            if op is not None and op not in REDUCTION_OPS:
                raise FusionError(
                    rd.loc, rd.name, "operator",
                    f"'{op}' is not a supported reduction: a fusible reduction is associative and commutative with "
                    f"a neutral element, so that chunks and segments combine ({', '.join(REDUCTION_OPS)})",
                )
            try:
                call = ExprParser(self.scope, rd.loc).parse_reduction(rd.text, REDUCTION_OPS)
            except _Pending as p:
                if p.name == rd.name:
                    raise FusionError(rd.loc, rd.name, "dependency order", "the reduction depends on itself") from None
                raise FusionError(
                    rd.loc, rd.name, "dependency order",
                    f"depends on '{p.name}', which is reduced later (list reductions in dependency order)",
                ) from None
            self.reductions.append(self._reduction(rd.name, call, rd.loc))
        outputs = []
        for o in self.spec.outputs:
            for i in o.index:
                if i not in self.indices:
                    raise SpecError(o.loc, f"output index '{i}' is not declared under cascade.indices")
            value = self._parse_output(o.value, o.loc)
            empty = self._parse_output(o.empty, o.loc) if o.empty is not None else None
            self._check_output_index(o, value, empty)
            outputs.append(OutputDef(o.name, value, empty, o.index, o.loc))
        needed = self._live(outputs)
        return CascadeIR(
            op=self.spec.name,
            file=self.spec.file,
            specialization=tuple(self.special.items()),
            axes=self.axes,
            scalars=self.scalars,
            tensors=self.tensors,
            tensor_args={t.name: t for t in self.spec.tensors},
            indices=self.indices,
            extents=self.extents,
            rows=c.rows,
            over=c.over,
            # live lets; state lets are inlined where they are used, and kept here by name for the kernel bridges
            lets=tuple(self.lets[n] for n in self.let_text
                       if n in self.lets and (n in needed or self.lets[n].kind == "state")),
            mask=mask,
            reductions=tuple(r for r in self.reductions if r.name in needed),
            states={k: v for k, v in self.states.items() if k in needed},
            regular={k: v for k, v in self.regular.items() if k in needed},
            outputs=tuple(outputs),
            passes=c.passes,
            checks=tuple(self._check(ch) for ch in self.spec.checks),
        )

    def _check_output_index(self, o: Any, value: Any, empty: Any) -> None:
        """Each output dimension runs over its index's extent, and the value reads no index the output does not
        name: an output indexed by the streamed axis (`index: [t, j]`) is written per element in a final pass
        over the row; one that reads x[t, j] without naming j has no meaning (reduce over j instead)."""
        c = self.spec.cascade
        for dim, i in zip(o.shape, o.index):
            size = sp.Integer(int(dim)) if dim.isdigit() else self.axes.get(dim, self.scalars.get(dim))
            ext = self.extents[i]
            if size is not None and sp.simplify(size - ext) != 0:
                raise SpecError(o.loc, f"output '{o.name}': the dimension {dim} is indexed by '{i}', which runs "
                                f"over {ext}")
        if len(set(o.index)) != len(o.index):
            raise SpecError(o.loc, f"output '{o.name}' names an index twice: {list(o.index)}")
        extra = sorted((self.index_deps(value) | self.index_deps(empty)) - set(o.index))
        if extra:
            hint = (f" (name '{c.over}' in its index to write one value per element of the row, after the "
                    f"reductions; or reduce over it)" if c.over in extra else "")
            raise SpecError(o.loc, f"output '{o.name}' = {o.value} reads index {', '.join(repr(e) for e in extra)}, "
                            f"which its index {list(o.index)} does not name{hint}")

    def _check(self, ch: Any) -> Any:
        scope = Scope(values={**self.axes, **self.scalars}, flags=self.scope.flags)
        v = ExprParser(scope, ch.loc).parse(ch.expr)
        if isinstance(v, bool):
            return sp.true if v else sp.false
        if not is_bool(v):
            raise SpecError(ch.loc, "a check is a condition (a comparison)")
        return v

    def _live(self, outputs: list[OutputDef]) -> set[str]:
        """Names (reductions and lets) that the outputs need, directly or through other reductions/lets."""

        def names_in(expr: Any) -> set[str]:
            if not isinstance(expr, sp.Basic):
                return set()
            found = self.state_deps(expr)
            found |= {s.name for s in expr.free_symbols if s.name in self.lets and self.lets[s.name].symbol == s}
            return found

        by_name = {r.name: r for r in self.reductions}
        todo: set[str] = set()
        for o in outputs:
            todo |= names_in(o.value) | names_in(o.empty)
        todo |= names_in(self.mask_expr)
        live: set[str] = set()
        while todo:
            n = todo.pop()
            if n in live:
                continue
            live.add(n)
            if n in by_name:
                r = by_name[n]
                for part in (r.body, r.where, r.k, *[e for _, e in r.carry]):
                    todo |= names_in(part)
            elif n in self.lets:
                todo |= names_in(self.lets[n].expr)
        return live

    def _parse_output(self, text: str, loc: Loc) -> Any:
        try:
            v = ExprParser(self.scope, loc).parse(text)
        except _Pending as p:  # cannot happen after all reductions are parsed
            raise SpecError(loc, f"unknown reduction '{p.name}'") from None
        if isinstance(v, bool) or v is None or isinstance(v, (str, TopkField)):
            raise SpecError(loc, "an output value is a numeric expression")
        return sp.sympify(v)

    def _reduction(self, name: str, call: ReductionCall, loc: Loc) -> Reduction:
        c = self.spec.cascade
        over = call.over or c.over
        body = call.body
        if not isinstance(body, sp.Expr) or is_bool(body):
            raise SpecError(loc, f"the body of '{name}' must be numeric")
        k = call.k
        if call.op == "argmax":
            k = sp.Integer(1)
        carry = []
        for pname in call.carry:
            if pname not in self.let_text:
                raise SpecError(loc, f"carry names a let; '{pname}' is not one")
            carry.append((pname, sp.sympify(self.resolve_let(pname))))
        parts = [body, call.where if isinstance(call.where, sp.Basic) else sp.true] + [e for _, e in carry]
        if k is not None:
            parts.append(k)
        deps: set[str] = set()
        idx: set[str] = set()
        for p in parts:
            deps |= self.state_deps(p)
            idx |= self.index_deps(p)
        if k is not None and self.state_deps(k):
            raise FusionError(loc, name, "selection size", f"the size k = {k} depends on a reduction result")
        if over != c.over and over in c.rows:
            raise SpecError(loc, f"'{name}' cannot reduce over the row index '{over}'")
        free = tuple(sorted(i for i in idx if i not in c.rows and i != over and i != c.over))
        order = [r.name for r in c.reduce]
        for d in deps:
            if d == name:
                raise FusionError(loc, name, "dependency order", "the reduction depends on itself")
            if order.index(d) > order.index(name):
                raise FusionError(loc, name, "dependency order",
                                  f"depends on '{d}', which is reduced later (list reductions in dependency order)")
        self.free_of[name] = free
        # symbol for scalar results, with the sign its body guarantees
        if call.op in ("sum", "max", "min"):
            # the value symbol covers every value (0 for an empty sum); the regular assumptions hold away
            # from the degenerate values that guards handle (a sum of positive terms over a non-empty prefix)
            # sign of the body away from degenerate values: earlier states at their regular assumptions
            b = body.xreplace({self.states[d]: sp.Symbol(f"{d}__regular", **self.regular[d])
                               for d in deps if d in self.states})
            if call.op == "sum":
                assumptions: dict[str, bool] = {"nonnegative": True} if b.is_nonnegative else {"real": True}
                regular = {"positive": True} if b.is_positive else assumptions
            else:  # max/min: -inf/+inf for an empty prefix
                nonneg = bool(b.is_nonnegative)
                assumptions = {"extended_nonnegative": True} if nonneg else {"extended_real": True}
                regular = {"nonnegative": True} if nonneg else {"real": True}
            self.states[name] = sp.Symbol(name, **assumptions)
            self.regular[name] = regular
        return Reduction(
            name=name,
            op=call.op,
            body=body,
            k=k,
            where=call.where if call.where is not True else sp.true,
            over=over,
            carry=tuple(carry),
            free=free,
            deps=tuple(d for d in order if d in deps),
            loc=loc,
        )


def build_ir(spec: OpSpec, specialization: tuple[tuple[str, Any], ...]) -> CascadeIR:
    return _Builder(spec, specialization).build()
