"""Numeric interpretation of the derived forms in float64 with numpy: online (chunked) and merged.

Used by the engine's self-check and by the tests: the online form run chunk by chunk, and the merge form over
random segment splits, must reproduce the plain unfused math, which oracle.py computes without any of the
engine's guards or mask values (the epilogue reductions here run directly, on the final states).

Arrays carry named dimensions (one per index: rows, the cascade axis, free indices, a top-k's entries), so that
sympy expressions evaluate by broadcasting. Semantics of the engine's forms:
- an element is counted when the cascade mask and the reduction's `where` hold; an element whose value is the
  cascade's mask value (e.g. a score of -inf) is not counted by non-selection reductions (proved neutral);
- selections order elements by (counted first, larger key first, NaN keys last, lower index first).
Rounding casts are the identity here (exact arithmetic), unless an Evaluator is made with round_casts: then each
cast rounds as the dtype does (to nearest even; e4m3 saturating at +-448), for judging a built kernel whose math
rounds there (tests/test_user_specs.py).
"""

from __future__ import annotations

import itertools
import math
import random
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import numpy as np
import sympy as sp

from ..errors import Loc
from ..spec import domain_bounds
from .algebra import MONOIDS, TIMES
from .expr import Cast, entrysum, idiv, isin, sigmoid
from .forms import Analysis, ReductionForm
from .ir import CascadeIR

ENTRY = "#"  # prefix of a selection's entry dimension


# --------------------------------------------------------------------------------------------- named arrays
@dataclass(frozen=True)
class NA:
    data: np.ndarray
    dims: tuple[str, ...]

    @staticmethod
    def scalar(v: Any) -> NA:
        return NA(np.asarray(v), ())

    def expand(self, dims: tuple[str, ...]) -> np.ndarray:
        """View with the given dim order (a superset of self.dims), size-1 axes for missing dims."""
        perm = [self.dims.index(d) for d in dims if d in self.dims]
        arr = np.transpose(self.data, perm) if perm != list(range(len(perm))) else self.data
        shape = []
        it = iter(arr.shape)
        for d in dims:
            shape.append(next(it) if d in self.dims else 1)
        return arr.reshape(shape)


def _union(*arrays: NA) -> tuple[str, ...]:
    out: list[str] = []
    for a in arrays:
        for d in a.dims:
            if d not in out:
                out.append(d)
    return tuple(out)


def lift(fn: Any, *arrays: NA) -> NA:
    dims = _union(*arrays)
    with np.errstate(all="ignore"):
        return NA(np.asarray(fn(*[a.expand(dims) for a in arrays])), dims)


def spread(a: NA, others: list[NA]) -> NA:
    """Broadcast a to the union of its dims and the others' dims (e.g. a constant body over the reduced axis)."""
    dims = _union(a, *others)
    shape = np.broadcast_shapes(*[x.expand(dims).shape for x in (a, *others)])
    return NA(np.broadcast_to(a.expand(dims), shape), dims)


def reduce_dim(a: NA, dim: str, fn: Any) -> NA:
    if dim not in a.dims:
        raise ValueError(f"cannot reduce over {dim}: not in {a.dims}")
    ax = a.dims.index(dim)
    with np.errstate(all="ignore"):
        return NA(np.asarray(fn(a.data, axis=ax)), a.dims[:ax] + a.dims[ax + 1:])


def broadcast_to(a: NA, dims: tuple[str, ...], sizes: dict[str, int]) -> NA:
    full = _union(NA(np.zeros(()), dims), a)
    arr = a.expand(full)
    return NA(np.broadcast_to(arr, tuple(sizes[d] for d in full)).copy(), full)


# --------------------------------------------------------------------------------------------- problems
@dataclass
class Problem:
    """Concrete sizes, scalar arguments and tensors for one evaluation."""

    sizes: dict[str, int]  # axes
    scalars: dict[str, Any]  # int/float arguments
    tensors: dict[str, np.ndarray]


def _extent(ir: CascadeIR, name: str, p: Problem) -> int:
    env = {ir.axes[k]: sp.sympify(v) for k, v in p.sizes.items() if k in ir.axes}
    env.update({ir.scalars[k]: sp.sympify(v) for k, v in p.scalars.items() if k in ir.scalars})
    return int(ir.extents[name].xreplace(env))


def _domain(text: str, env: dict[sp.Symbol, int]) -> tuple[int, int]:
    """'[lo, hi)' or '[lo, hi]' -> inclusive integer bounds."""
    lo_s, hi_s, closed = domain_bounds(text)
    names = {s.name: s for s in env}
    lo = int(sp.sympify(lo_s, locals=names).xreplace(env))
    hi = int(sp.sympify(hi_s, locals=names).xreplace(env))
    return lo, (hi if closed else hi - 1)


def random_problem(
    ir: CascadeIR,
    rng: random.Random,
    max_size: int = 9,
    fixed: dict[str, Any] | None = None,
) -> Problem:
    """Sizes and int arguments drawn until the spec's checks hold; tensors normal (ints in their domain)."""
    fixed = fixed or {}
    for _ in range(2000):
        # small sizes; round ones only once small ones keep failing checks such as K % 16 == 0
        pool = list(range(1, max_size + 1)) + ([16, 32] if _ >= 200 else [])
        sizes = {n: int(fixed.get(n, rng.choice(pool))) for n in ir.axes}
        scalars: dict[str, Any] = {}
        for n, s in ir.scalars.items():
            if n in fixed:
                scalars[n] = fixed[n]
            elif s.is_integer:
                scalars[n] = rng.randint(1, max_size)
            else:
                scalars[n] = rng.uniform(0.3, 1.5)
        env = {**{ir.axes[k]: sp.Integer(v) for k, v in sizes.items()},
               **{ir.scalars[k]: (sp.Integer(v) if isinstance(v, int) else sp.Float(v)) for k, v in scalars.items()}}
        if all(bool(c.xreplace(env)) for c in ir.checks):
            break
    else:
        raise ValueError(f"{ir.op}: could not draw sizes satisfying the checks")
    shapes_env = {**{sp.Symbol(k): v for k, v in sizes.items()}, **{sp.Symbol(k): v for k, v in scalars.items()}}
    tensors = {}
    for name, t in ir.tensor_args.items():
        shape = tuple(int(d) if d.isdigit() else int(sizes.get(d, scalars.get(d, 1))) for d in t.shape)
        dtypes = t.dtypes or ir.tensor_args[t.same_as].dtypes if t.same_as else t.dtypes
        if dtypes and dtypes[0].startswith("int"):
            lo, hi = _domain(t.values, shapes_env) if t.values else (0, 7)
            tensors[name] = np.array([rng.randint(lo, max(lo, hi)) for _ in range(int(np.prod(shape)))],
                                     dtype=np.int64).reshape(shape)
        else:
            tensors[name] = np.array([rng.gauss(0.0, 1.0) for _ in range(int(np.prod(shape)))]).reshape(shape)
    return Problem(sizes, scalars, tensors)


# --------------------------------------------------------------------------------------------- rounding casts
def round_cast(dtype: str, x: Any) -> np.ndarray:
    """x rounded as a cast to dtype rounds it (float64 values, first held in float32 as the kernels hold them; to
    nearest even; e4m3 saturating at +-448), by ml_dtypes as tests/tl_interp.py rounds (it comes with TileLang, a
    build and test requirement; imported here only where an Evaluator rounds)."""
    import ml_dtypes

    f = np.asarray(x, dtype=np.float64).astype(np.float32)
    if dtype == "float8_e4m3fn":
        f = np.where(np.isnan(f), f, np.clip(f, -448.0, 448.0))
    target = {"float32": np.float32, "float16": np.float16, "bfloat16": ml_dtypes.bfloat16,
              "float8_e4m3fn": ml_dtypes.float8_e4m3fn}[dtype]
    with np.errstate(over="ignore"):
        return f.astype(target).astype(np.float64)


# --------------------------------------------------------------------------------------------- expressions
class Evaluator:
    def __init__(self, ir: CascadeIR, problem: Problem, analysis: Analysis | None = None, round_casts: bool = False):
        self.ir = ir
        self.p = problem
        self.analysis = analysis
        self.round_casts = round_casts
        self.sizes = {n: _extent(ir, n, problem) for n in ir.indices}
        self.const: dict[sp.Symbol, NA] = {}
        for n, s in ir.axes.items():
            self.const[s] = NA.scalar(problem.sizes[n])
        for n, s in ir.scalars.items():
            self.const[s] = NA.scalar(problem.scalars[n])
        self.let_syms = {x.symbol: x for x in ir.lets}

    # the environment maps sympy symbols/bases to NA; index symbols to their ranges
    def index_env(self, over_range: range | None = None) -> dict[sp.Basic, NA]:
        env: dict[sp.Basic, NA] = {}
        for n, s in self.ir.indices.items():
            r = over_range if (n == self.ir.over and over_range is not None) else range(self.sizes[n])
            env[s] = NA(np.arange(r.start, r.stop), (n,))
        return env

    def ev(self, expr: Any, env: dict[sp.Basic, NA]) -> NA:
        if isinstance(expr, bool):
            return NA.scalar(expr)
        if expr in env:
            return env[expr]
        if expr in self.const:
            return self.const[expr]
        if expr in self.let_syms:
            v = self.ev(self.let_syms[expr].expr, env)
            env[expr] = v
            return v
        if expr is sp.true:
            return NA.scalar(True)
        if expr is sp.false:
            return NA.scalar(False)
        if isinstance(expr, (sp.Integer, sp.Float, sp.Rational)) or expr.is_Number:
            return NA.scalar(float(expr) if not expr.is_Integer else int(expr))
        if isinstance(expr, sp.NumberSymbol):  # E, pi
            return NA.scalar(float(expr))
        if expr is sp.oo:
            return NA.scalar(math.inf)
        if expr is sp.S.NegativeInfinity:
            return NA.scalar(-math.inf)
        if expr is sp.nan or expr is sp.zoo:  # zoo: sympy's log(0), 1/0; undefined here
            return NA.scalar(math.nan)
        if isinstance(expr, sp.Indexed):
            return self._read(expr, env)
        if isinstance(expr, sp.Sum):
            body, (c, lo, hi) = expr.args[0], expr.args[1]
            inner = dict(env)
            inner[c] = NA(np.arange(int(self.ev(lo, env).data), int(self.ev(hi, env).data) + 1), (c.name,))
            factors = [self.ev(f, inner) for f in (body.args if isinstance(body, sp.Mul) else (body,))]
            return _contract(factors, c.name)
        if isinstance(expr, sp.Add):
            out = self.ev(expr.args[0], env)
            for a in expr.args[1:]:
                out = lift(np.add, out, self.ev(a, env))
            return out
        if isinstance(expr, sp.Mul):
            out = self.ev(expr.args[0], env)
            for a in expr.args[1:]:
                out = lift(np.multiply, out, self.ev(a, env))
            return out
        if isinstance(expr, sp.Pow):
            return lift(lambda a, b: np.power(np.asarray(a, dtype=np.float64), b),
                        self.ev(expr.base, env), self.ev(expr.exp, env))
        if isinstance(expr, sp.exp):
            return lift(np.exp, self.ev(expr.args[0], env))
        if isinstance(expr, sp.log):
            return lift(np.log, self.ev(expr.args[0], env))
        if isinstance(expr, (sp.sin, sp.cos, sp.tanh)):
            fn = {sp.sin: np.sin, sp.cos: np.cos, sp.tanh: np.tanh}[type(expr)]
            return lift(fn, self.ev(expr.args[0], env))
        if isinstance(expr, sp.Abs):
            return lift(np.abs, self.ev(expr.args[0], env))
        if isinstance(expr, sigmoid):
            return lift(lambda x: 1.0 / (1.0 + np.exp(-x)), self.ev(expr.args[0], env))
        if isinstance(expr, Cast):
            inner = self.ev(expr.args[0], env)
            return lift(lambda v: round_cast(expr.dtype, v), inner) if self.round_casts else inner
        if isinstance(expr, (sp.Max, sp.Min)):
            fn = np.maximum if isinstance(expr, sp.Max) else np.minimum
            out = self.ev(expr.args[0], env)
            for a in expr.args[1:]:
                out = lift(fn, out, self.ev(a, env))
            return out
        if isinstance(expr, idiv):
            return lift(np.floor_divide, self.ev(expr.args[0], env), self.ev(expr.args[1], env))
        if isinstance(expr, sp.Mod):
            return lift(np.mod, self.ev(expr.args[0], env), self.ev(expr.args[1], env))
        if isinstance(expr, sp.Piecewise):
            out = None
            for value, cond in reversed(expr.args):
                v = self.ev(value, env)
                if out is None:
                    out = v
                    continue
                c = self.ev(cond, env)
                out = lift(np.where, c, v, out)
            return out
        if isinstance(expr, sp.core.relational.Relational):
            ops = {sp.Eq: np.equal, sp.Ne: np.not_equal, sp.Lt: np.less, sp.Le: np.less_equal,
                   sp.Gt: np.greater, sp.Ge: np.greater_equal}
            return lift(ops[type(expr)], self.ev(expr.lhs, env), self.ev(expr.rhs, env))
        if isinstance(expr, sp.And):
            out = self.ev(expr.args[0], env)
            for a in expr.args[1:]:
                out = lift(np.logical_and, out, self.ev(a, env))
            return out
        if isinstance(expr, sp.Or):
            out = self.ev(expr.args[0], env)
            for a in expr.args[1:]:
                out = lift(np.logical_or, out, self.ev(a, env))
            return out
        if isinstance(expr, sp.Not):
            return lift(np.logical_not, self.ev(expr.args[0], env))
        if isinstance(expr, entrysum):  # over the filled entries
            base = env[expr.args[0]]
            ok = env[_valid_base(expr.args[0])]
            filled = lift(lambda v, k: np.where(k, v, 0.0), base, ok)
            return reduce_dim(filled, _entry_dim(base), np.sum)
        if isinstance(expr, isin):
            x = self.ev(expr.args[0], env)
            base = env[expr.args[1]]
            ok = env[_valid_base(expr.args[1])]
            eq = lift(lambda a, b, k: np.logical_and(np.equal(a, b), k), x, base, ok)
            return reduce_dim(eq, _entry_dim(base), np.any)
        raise NotImplementedError(f"cannot evaluate {expr!r} ({type(expr).__name__})")

    def _read(self, ix: sp.Indexed, env: dict[sp.Basic, NA]) -> NA:
        base = ix.base
        if base in env:  # a selection field indexed by its entry
            arr = env[base]
            edim = _entry_dim(arr)
            i = self.ev(ix.indices[0], env)
            k = arr.data.shape[arr.dims.index(edim)]
            idx = NA(np.clip(np.asarray(i.data, dtype=np.int64), 0, k - 1), i.dims)
            dims = _union(NA(np.zeros(()), tuple(d for d in arr.dims if d != edim)), idx)
            src = arr.expand(dims + (edim,))
            sel = idx.expand(dims + (edim,))
            lead = np.broadcast_shapes(src.shape[:-1], sel.shape[:-1])
            src = np.broadcast_to(src, lead + (src.shape[-1],))
            sel = np.broadcast_to(sel, lead + (1,))
            return NA(np.take_along_axis(src, sel, axis=-1)[..., 0], dims)
        data = self.p.tensors[str(base.label)]
        parts = [self.ev(i, env) for i in ix.indices]
        dims = _union(*parts)
        idx = []
        for axis, part in enumerate(parts):
            a = np.asarray(part.expand(dims), dtype=np.int64)
            idx.append(np.clip(a, 0, data.shape[axis] - 1))  # masked elements may point anywhere
        return NA(data[tuple(idx)], dims)


def _contract(factors: list[NA], dim: str) -> NA:
    """sum over `dim` of the product of the factors, with einsum (no dense intermediate)."""
    dims = _union(*factors)
    letters = {d: chr(ord("a") + n) for n, d in enumerate(dims)}
    out_dims = tuple(d for d in dims if d != dim)
    spec = ",".join("".join(letters[d] for d in f.dims) for f in factors)
    spec += "->" + "".join(letters[d] for d in out_dims)
    with np.errstate(all="ignore"):
        ops = [np.asarray(f.data, dtype=np.float64) for f in factors]
        if not any(dim in f.dims for f in factors):
            raise ValueError(f"contraction over {dim} of factors that do not depend on it")
        return NA(np.asarray(np.einsum(spec, *ops)), out_dims)


def _valid_base(base: sp.IndexedBase) -> sp.IndexedBase:
    return sp.IndexedBase(str(base.label).split(".")[0] + ".__valid")


def _entry_dim(a: NA) -> str:
    for d in a.dims:
        if d.startswith(ENTRY):
            return d
    raise ValueError(f"no entry dimension in {a.dims}")


# --------------------------------------------------------------------------------------------- reductions
@dataclass
class SelState:
    """A selection's candidates: keys, element indices, validity and payloads, over an entry dimension."""

    key: NA
    index: NA
    valid: NA
    payloads: dict[str, NA]


def _order_key(key: np.ndarray, valid: np.ndarray, index: np.ndarray) -> tuple[np.ndarray, ...]:
    k = np.where(np.isnan(key), -np.inf, key)
    nan_rank = np.isnan(key).astype(np.int64)
    return (index, -k, nan_rank, ~valid)  # np.lexsort: last key is primary


def select_top(key: NA, index: NA, valid: NA, payloads: dict[str, NA], dim: str, k: int, out_dim: str) -> SelState:
    """Top-k along `dim`: counted elements first, larger key first (NaN last), lower index first."""
    dims = _union(key, index, valid, *payloads.values())
    if dim not in dims:
        raise ValueError(dim)
    order_dims = tuple(d for d in dims if d != dim) + (dim,)
    shape = np.broadcast_shapes(*[a.expand(order_dims).shape for a in (key, index, valid, *payloads.values())])

    def full(a: NA) -> np.ndarray:
        return np.broadcast_to(a.expand(order_dims), shape)

    K, I, V = full(key).astype(np.float64), full(index).astype(np.int64), full(valid).astype(bool)
    order = np.lexsort(_order_key(K, V, I), axis=-1)[..., :k]

    def take(a: np.ndarray) -> np.ndarray:
        return np.take_along_axis(a, order, axis=-1)

    nd = order_dims[:-1] + (out_dim,)
    ok = take(V)
    # entries that no counted element filled are canonical: key -inf, index -1, payloads 0
    return SelState(
        NA(np.where(ok, take(K), -np.inf), nd), NA(np.where(ok, take(I), -1), nd), NA(ok, nd),
        {n: NA(np.where(ok, take(full(v).astype(np.float64)), 0.0), nd) for n, v in payloads.items()},
    )


def _counted(ev: Evaluator, env: dict[sp.Basic, NA], where: Any, exclude_mask_value: bool) -> NA:
    ir = ev.ir
    valid = ev.ev(ir.mask, env)
    valid = lift(np.logical_and, valid, ev.ev(where, env))
    if exclude_mask_value and ev.analysis is not None:
        for atom, v in ev.analysis.mask_value.items():
            val = ev.ev(atom, env)
            valid = lift(lambda a, b, vv=float(v): np.logical_and(a, ~(b == vv)), valid, val)
    return valid


def _fold(op: str, body: NA, valid: NA, dim: str) -> NA:
    neutral = float(MONOIDS[op].neutral)
    masked = lift(lambda b, v: np.where(v, b, neutral), body, valid)
    fn = {"sum": np.sum, "max": lambda a, axis: np.max(a, axis=axis, initial=-np.inf),
          "min": lambda a, axis: np.min(a, axis=axis, initial=np.inf)}[op]
    return reduce_dim(masked, dim, fn)


class _Run:
    """Shared machinery of the direct, online and merged evaluations."""

    def __init__(self, analysis: Analysis, problem: Problem):
        self.a = analysis
        self.ir = analysis.ir
        self.ev = Evaluator(self.ir, problem, analysis)
        self.final: dict[str, Any] = {}  # reduction -> NA (scalar states) or SelState

    def env_with_finals(self, env: dict[sp.Basic, NA], through_guards: bool = False) -> dict[sp.Basic, NA]:
        """Bind final results; `through_guards`: reductions read guarded states at their safe values."""
        for name, val in self.final.items():
            self._bind(env, name, val, "cur")
            g = self.a.guard(name)
            if g is not None and not isinstance(val, SelState):
                safe = self.safe_value(name, val)
                self._bind(env, name, safe, "safe")
                if through_guards:
                    self._bind(env, name, safe, "cur")
        return env

    def safe_value(self, name: str, val: NA) -> NA:
        g = self.a.guard(name)
        if g is None:
            return val
        for point, value in g.points:
            val = lift(lambda x, p=float(point), s=float(value): np.where(x == p, s, x), val)
        return val

    def _bind(self, env: dict[sp.Basic, NA], name: str, val: Any, role: str) -> None:
        red = self.ir.reduction(name)
        if isinstance(val, SelState):
            if role != "cur":
                return
            env[sp.IndexedBase(f"{name}.value")] = val.key
            env[sp.IndexedBase(f"{name}.index")] = val.index
            env[sp.IndexedBase(f"{name}.__valid")] = val.valid
            for p, v in val.payloads.items():
                env[sp.IndexedBase(f"{name}.{p}")] = v
            return
        sym = self.ir.states[name] if role == "cur" else self.a.sym(name, role)
        env[sym] = val
        del red

    def k_of(self, f: ReductionForm, env: dict[sp.Basic, NA]) -> int:
        return int(self.ev.ev(f.k, env).data) if f.k is not None else 1

    # ------------------------------------------------------------------ direct reductions
    def direct(self, f: ReductionForm) -> Any:
        ir = self.ir
        env = self.env_with_finals(self.ev.index_env(), through_guards=True)
        over = f.stage == "stream"
        dim = ir.over if over else ir.reduction(f.name).over
        where = f.where
        valid = _counted(self.ev, env, where, exclude_mask_value=not f.selection) if over else \
            lift(np.logical_and, NA.scalar(True), self.ev.ev(where, env))
        axes = [env[ir.indices[n]] for n in (*ir.rows, *f.free, dim)]
        body = spread(self.ev.ev(f.body, env), axes)
        valid = spread(valid, axes)
        if f.selection:
            k = self.k_of(f, env)
            idx = env[ir.indices[dim]]
            payloads = {p.name: self.ev.ev(p.expr, env) for p in f.payloads}
            return select_top(body, idx, valid, payloads, dim, k, ENTRY + f.name)
        return _fold(f.op, body, valid, dim)

    def epilogues(self, pass_no: int) -> None:
        for f in self.a.reductions:
            if f.stage == "epilogue" and f.pass_no == pass_no:
                self.final[f.name] = self.direct(f)

    def outputs(self) -> dict[str, np.ndarray]:
        out = {}
        for o in self.a.outputs:
            env = self.env_with_finals(self.ev.index_env())
            v = self.ev.ev(o.value, env)
            sizes = dict(self.ev.sizes)
            sizes.update({d: v.data.shape[v.dims.index(d)] for d in v.dims})
            full = broadcast_to(v, o.index, sizes)
            out[o.name] = full.expand(o.index).astype(np.float64)
        return out

    # ------------------------------------------------------------------ online pieces
    def init_state(self, f: ReductionForm, env: dict[sp.Basic, NA]) -> Any:
        rows = tuple(self.ir.rows) + tuple(f.free)
        sizes = self.ev.sizes
        if f.selection:
            k = self.k_of(f, env)
            e = ENTRY + f.name
            shape = tuple(sizes[d] for d in rows) + (k,)
            dims = rows + (e,)
            return SelState(NA(np.full(shape, -np.inf), dims), NA(np.full(shape, -1, dtype=np.int64), dims),
                            NA(np.zeros(shape, dtype=bool), dims),
                            {p.name: NA(np.zeros(shape), dims) for p in f.payloads})
        return NA(np.full(tuple(sizes[d] for d in rows), float(f.neutral)), rows)

    def bind_guarded(self, env: dict[sp.Basic, NA], name: str, val: NA, role: str) -> None:
        """Bind old/new symbols of a state and their safe versions (guard applied numerically)."""
        self._bind(env, name, val, role)
        self._bind(env, name, self.safe_value(name, val), role + "_safe")

    def correct(self, f: ReductionForm, state: Any, env: dict[sp.Basic, NA]) -> Any:
        """Apply c(D_old -> D_new) to a state (old/new symbols bound in env)."""
        if f.kind == "none" and not f.payloads:
            return state
        if isinstance(state, SelState):
            key = state.key if f.kind == "none" else lift(
                np.multiply if f.kind == TIMES else np.add, state.key, self.ev.ev(f.correction, env))
            pays = {}
            for p in f.payloads:
                v = state.payloads[p.name]
                if p.kind != "none":
                    v = lift(np.multiply if p.kind == TIMES else np.add, v, self.ev.ev(p.correction, env))
                pays[p.name] = v
            return SelState(key, state.index, state.valid, pays)
        c = self.ev.ev(f.correction, env)
        return lift(np.multiply if f.kind == TIMES else np.add, state, c)

    def combine(self, f: ReductionForm, a: Any, b: Any, env: dict[sp.Basic, NA]) -> Any:
        if isinstance(a, SelState):
            e = ENTRY + f.name
            tmp = e + "'"
            cat = lambda x, y: _concat(x, y, e, tmp)
            k = self.k_of(f, env)
            return select_top(cat(a.key, b.key), cat(a.index, b.index), cat(a.valid, b.valid),
                              {n: cat(a.payloads[n], b.payloads[n]) for n in a.payloads}, tmp, k, e)
        fn = {"sum": np.add, "max": np.maximum, "min": np.minimum}[f.op]
        return lift(fn, a, b)

    def chunk_state(self, f: ReductionForm, env: dict[sp.Basic, NA]) -> Any:
        """The chunk's own contribution, with the new (guarded) states bound in env."""
        axes = [env[self.ir.indices[n]] for n in (*self.ir.rows, *f.free, self.ir.over)]
        valid = spread(_counted(self.ev, env, f.where, exclude_mask_value=not f.selection), axes)
        term = spread(self.ev.ev(f.term, env), axes)
        if f.selection:
            idx = env[self.ir.indices[self.ir.over]]
            payloads = {p.name: self.ev.ev(p.term, env) for p in f.payloads}
            return select_top(term, idx, valid, payloads, self.ir.over, self.k_of(f, env), ENTRY + f.name)
        return _fold(f.op, term, valid, self.ir.over)

    # ------------------------------------------------------------------ one pass, online
    def online_pass(self, pass_no: int, bounds: list[int]) -> dict[str, Any]:
        """Run the online form of one pass over the chunks [bounds[i], bounds[i+1])."""
        forms = [f for f in self.a.reductions if f.stage == "stream" and f.pass_no == pass_no]
        env0 = self.env_with_finals(self.ev.index_env())
        state = {f.name: self.init_state(f, env0) for f in forms}
        for lo, hi in itertools.pairwise(bounds):
            env = self.env_with_finals(self.ev.index_env(range(lo, hi)))
            before = dict(state)
            for f in forms:
                for d in f.online_deps:
                    self.bind_guarded(env, d, before[d], "old")
                    self.bind_guarded(env, d, state[d], "new")
                if not f.selection:  # a correction may read the state it corrects (a max still at -inf)
                    self._bind(env, f.name, before[f.name], "old")
                corrected = self.correct(f, before[f.name], env)
                state[f.name] = self.combine(f, corrected, self.chunk_state(f, env), env)
        return state

    def merge(self, pass_no: int, segments: list[dict[str, Any]]) -> dict[str, Any]:
        """Merge the states of independent segments with the merge form."""
        forms = [f for f in self.a.reductions if f.stage == "stream" and f.pass_no == pass_no]
        merged: dict[str, Any] = {}
        for f in forms:
            acc = None
            for seg in segments:
                env = self.env_with_finals(self.ev.index_env())
                for d in f.online_deps:
                    self.bind_guarded(env, d, seg[d], "old")
                    self.bind_guarded(env, d, merged[d], "new")
                if not f.selection:
                    self._bind(env, f.name, seg[f.name], "old")
                part = self.correct(f, seg[f.name], env)
                acc = part if acc is None else self.combine(f, acc, part, env)
            merged[f.name] = acc
        return merged


def _concat(a: NA, b: NA, dim: str, new: str) -> NA:
    dims = _union(a, b)
    others = tuple(d for d in dims if d != dim)
    order = others + (dim,)
    x, y = a.expand(order), b.expand(order)
    shape = np.broadcast_shapes(x.shape[:-1], y.shape[:-1])
    x = np.broadcast_to(x, shape + (x.shape[-1],))
    y = np.broadcast_to(y, shape + (y.shape[-1],))
    return NA(np.concatenate([x, y], axis=-1), others + (new,))


# --------------------------------------------------------------------------------------------- entry points
def random_bounds(n: int, rng: random.Random, min_chunk: int = 1, max_chunk: int | None = None) -> list[int]:
    bounds = [0]
    max_chunk = max_chunk or max(1, n)
    while bounds[-1] < n:
        bounds.append(min(n, bounds[-1] + rng.randint(min_chunk, max_chunk)))
    return bounds


def evaluate_online(analysis: Analysis, problem: Problem, rng: random.Random,
                    chunks: Iterable[int] | None = None) -> dict[str, np.ndarray]:
    """The online form, chunk by chunk (random chunk sizes from 1 up, or the given bounds)."""
    run = _Run(analysis, problem)
    n = run.ev.sizes[analysis.ir.over]
    for p in analysis.passes:
        bounds = list(chunks) if chunks is not None else random_bounds(n, rng, 1, max(1, n // 2))
        run.final.update(run.online_pass(p.number, bounds))
        run.epilogues(p.number)
    return run.outputs()


def evaluate_merged(analysis: Analysis, problem: Problem, rng: random.Random, segments: int = 3,
                    edges: list[int] | None = None) -> dict[str, np.ndarray]:
    """Split the axis into random segments (empty ones included) or at the given edges, run each online, merge
    with the merge form."""
    run = _Run(analysis, problem)
    n = run.ev.sizes[analysis.ir.over]
    fixed = edges
    for p in analysis.passes:
        edges = list(fixed) if fixed is not None else [0] + sorted(rng.randint(0, n) for _ in range(segments - 1)) + [n]
        states = []
        for lo, hi in itertools.pairwise(edges):
            inner = [lo] + [b + lo for b in random_bounds(hi - lo, rng)[1:]] if hi > lo else [lo, lo]
            states.append(run.online_pass(p.number, inner))
        run.final.update(run.merge(p.number, states))
        run.epilogues(p.number)
    return run.outputs()


__all__ = [
    "NA",
    "Evaluator",
    "Loc",
    "Problem",
    "evaluate_merged",
    "evaluate_online",
    "random_bounds",
    "random_problem",
]
