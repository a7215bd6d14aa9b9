"""The three fusion conditions as small pure functions over sympy, each checked symbolically and numerically.

For a reduction y = (+)_l F(x_l, D) over elements x_l, with D the values of earlier reductions:
- decomposable: F(x, D) = G(x) (x) H(D) for a monoid (x) in {*, +}. Equivalently the correction
  c(D -> D') = F(x, D') (/) F(x, D) does not depend on x (the fixed-point identity
  F(x,y) F(x0,y0) - F(x,y0) F(x0,y) = 0 with fresh symbols, and its additive analogue);
- distributive: the reduction operator distributes over (x) with that factor: (a (+) b) (x) c = (a (x) c) (+) (b (x) c),
  proved by cases for max/min (selections need a strictly increasing factor, so that order and ties survive);
- invertible: H(D) is finite and non-zero wherever D can be; where it is not (an empty prefix: max = -oo, sum = 0)
  the state is replaced by a safe value, which is sound because such a prefix contributed only neutral elements.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import sympy as sp

from .expr import sigmoid, strip_casts


# --------------------------------------------------------------------------------------------- reduction monoids
@dataclass(frozen=True)
class Monoid:
    op: str
    neutral: sp.Expr
    combine: Callable[[Any, Any], Any]
    selection: bool  # argmax / topk: keeps elements by order, ties to the lower index

    def fold(self, values: list[Any]) -> Any:
        out = self.neutral
        for v in values:
            out = self.combine(out, v)
        return out


MONOIDS: dict[str, Monoid] = {
    "sum": Monoid("sum", sp.Integer(0), lambda a, b: a + b, False),
    "max": Monoid("max", sp.S.NegativeInfinity, sp.Max, False),
    "min": Monoid("min", sp.oo, sp.Min, False),
    "argmax": Monoid("argmax", sp.S.NegativeInfinity, sp.Max, True),
    "topk": Monoid("topk", sp.S.NegativeInfinity, sp.Max, True),
}

# the binary operations a correction can be: multiply, or add
TIMES = "*"
PLUS = "+"


def apply(kind: str, a: Any, c: Any) -> Any:
    return a * c if kind == TIMES else a + c


# --------------------------------------------------------------------------------------------- numeric helpers
def _lambdify(symbols: list[sp.Symbol], expr: sp.Expr) -> Callable[..., float]:
    return sp.lambdify(symbols, expr, modules=[{"sigmoid": lambda x: 1.0 / (1.0 + math.exp(-x))}, "math"])


def np_lambdify(symbols: list[sp.Basic], expr: sp.Expr) -> Callable[..., Any]:
    """expr as a numpy float64 function (overflow gives inf, 0/0 nan: the arithmetic of the kernels)."""
    import numpy as np

    return sp.lambdify(symbols, strip_casts(expr), modules=[{"sigmoid": lambda x: 1.0 / (1.0 + np.exp(-x))}, "numpy"])


def sample_value(sym: sp.Basic, rng: random.Random) -> float:
    """A random value that respects a symbol's assumptions."""
    if getattr(sym, "is_integer", False):
        lo = 1 if sym.is_positive else 0
        return float(rng.randint(lo, 7))
    if sym.is_positive:
        return rng.uniform(0.2, 4.0)
    if sym.is_nonnegative:
        return rng.uniform(0.0, 4.0)
    return rng.uniform(-3.0, 3.0)


def close(a: float, b: float, rtol: float = 1e-9) -> bool:
    if isinstance(a, complex) or isinstance(b, complex):
        return False
    if math.isnan(a) or math.isnan(b):
        return math.isnan(a) and math.isnan(b)
    if math.isinf(a) or math.isinf(b):
        return a == b
    return abs(a - b) <= rtol * max(1.0, abs(a), abs(b))


# --------------------------------------------------------------------------------------------- decomposition
@dataclass(frozen=True)
class Decomposition:
    kind: str  # "*" | "+" | "none" (F does not depend on D: no correction)
    correction: sp.Expr  # c(D_old -> D_new), in the old and new symbols
    G: sp.Expr  # F(x, D_ref)
    H: sp.Expr  # H(D) with F(x, D) = G(x) (x) H(D), H(D_ref) = identity
    reference: tuple[tuple[sp.Symbol, sp.Expr], ...]


@dataclass(frozen=True)
class Refusal:
    condition: str
    detail: str


def _reference_point(used: list[sp.Symbol], c: sp.Expr, old: dict[sp.Symbol, sp.Symbol]) -> dict[sp.Symbol, sp.Expr]:
    """A point D_ref where the correction c(D_ref -> D) is finite and non-zero, so that H(D) = c(D_ref -> D)."""
    ref: dict[sp.Symbol, sp.Expr] = {}
    for d in used:
        o = old[d]  # regular assumptions (the state away from its degenerate values)
        order = (1, 0, 2) if (o.is_positive or o.is_nonnegative) else (0, 1, 2)
        for v in order:
            probe = c.xreplace({old[d]: sp.Integer(v)})
            generic = {s: sp.Rational(37, 100) + n for n, s in enumerate(sorted(probe.free_symbols, key=str))}
            if not _degenerate(sp.simplify(probe.xreplace(generic))):
                ref[d] = sp.Integer(v)
                break
        else:
            ref[d] = sp.Integer(1)
    return ref


def real_safe(expr: sp.Expr) -> bool:
    """Every intermediate of the expression is real where its symbols are: fractional powers and logs of
    arguments known to be non-negative only (what C++/CUDA math evaluates without NaN)."""
    for p in expr.atoms(sp.Pow):
        if not p.exp.is_integer and p.base.is_nonnegative is not True:
            return False
    for lg in expr.atoms(sp.log):
        if lg.args[0].is_nonnegative is not True:
            return False
    return True


def sanitize(expr: sp.Expr) -> sp.Expr:
    """Rewrite forms that sympy keeps through complex intermediates into real ones:
    |a * b| -> |a| * |b| and |b**e| -> |b|**e (valid for real b and e)."""

    def split(e: sp.Expr) -> sp.Expr:
        arg = e.args[0]
        if arg.is_Mul:
            return sp.Mul(*[sp.Abs(a) for a in arg.args])
        if arg.is_Pow and arg.base.is_real and arg.exp.is_real:
            return sp.Abs(arg.base) ** arg.exp
        return e

    prev = None
    while prev != expr:
        prev = expr
        expr = expr.replace(lambda e: isinstance(e, sp.Abs) and (e.args[0].is_Mul or e.args[0].is_Pow), split)
    return expr


def decompose(
    body: sp.Expr,
    atoms: list[sp.Basic],
    deps: list[sp.Symbol],
    old: dict[sp.Symbol, sp.Symbol],
    new: dict[sp.Symbol, sp.Symbol],
    rng: random.Random | None = None,
) -> Decomposition | Refusal:
    """Decide whether F(x, D) = G(x) (x) H(D) and return the correction c(D_old -> D_new)."""
    F = strip_casts(body)
    used = [d for d in deps if F.has(d)]
    if not used:
        return Decomposition("none", sp.Integer(1), F, sp.Integer(1), ())
    f_old = F.xreplace({d: old[d] for d in used})
    f_new = F.xreplace({d: new[d] for d in used})
    attempts: list[str] = []
    for kind in (TIMES, PLUS):
        if kind == TIMES:
            c = sanitize(sp.simplify(sp.powsimp(f_new / f_old, force=False)))
        else:
            c = sanitize(sp.simplify(f_new - f_old))
        depends = [a for a in atoms if c.has(a)]
        depends = [a for a in depends if not any(b != a and b.has(a) for b in depends)]  # outermost only
        if depends:
            names = ", ".join(sorted(str(a) for a in depends))
            attempts.append(f"F(x, D') {'/' if kind == TIMES else '-'} F(x, D) = {c} depends on {names}")
            continue
        if c.has(sp.nan, sp.zoo):
            attempts.append(f"the correction {c} is undefined")
            continue
        if not real_safe(c):
            attempts.append(f"the correction {c} goes through non-real intermediates")
            continue
        if not _numeric_identity(F, atoms, used, old, new, kind, c, rng or random.Random(0)):
            attempts.append(f"the correction {c} failed the numeric check of F(x, D') = F(x, D) {kind} c")
            continue
        ref = _reference_point(used, c, old)
        G = sp.simplify(F.xreplace(ref))
        H = sanitize(sp.simplify(c.xreplace({old[d]: v for d, v in ref.items()}).xreplace({new[d]: d for d in used})))
        return Decomposition(kind, c, G, H, tuple(ref.items()))
    return Refusal("decomposable", "; ".join(attempts))


def _numeric_identity(
    F: sp.Expr,
    atoms: list[sp.Basic],
    deps: list[sp.Symbol],
    old: dict[sp.Symbol, sp.Symbol],
    new: dict[sp.Symbol, sp.Symbol],
    kind: str,
    c: sp.Expr,
    rng: random.Random,
    trials: int = 24,
) -> bool:
    """F(x, D_new) == F(x, D_old) (x) c(D_old -> D_new) at random points (guards a wrong simplification)."""
    fresh = {a: sp.Dummy(f"x{n}", real=True) for n, a in enumerate(atoms)}
    Fx = F.xreplace(fresh) if fresh else F
    others = sorted((Fx.free_symbols | c.free_symbols) - set(fresh.values()) - set(deps)
                    - set(old.values()) - set(new.values()), key=str)
    syms = list(fresh.values()) + deps + [old[d] for d in deps] + [new[d] for d in deps] + others
    f = _lambdify(syms, Fx)
    f_c = _lambdify(syms, c)
    checked = 0
    for _ in range(trials):
        vals = {s: sample_value(s, rng) for s in syms}
        for d in deps:  # states at their regular values (old/new carry those assumptions: an abs-max is >= 0)
            vals[old[d]] = sample_value(old[d], rng)
            vals[new[d]] = sample_value(new[d], rng)
        args_new = [vals[s] for s in syms]
        args_old = list(args_new)
        for d in deps:
            args_new[syms.index(d)] = vals[new[d]]
            args_old[syms.index(d)] = vals[old[d]]
        try:
            lhs, before = f(*args_new), f(*args_old)
        except (ValueError, ZeroDivisionError, OverflowError):
            continue  # F itself is undefined at this sample (its own domain)
        if isinstance(lhs, complex) or isinstance(before, complex):
            continue
        try:
            rhs = apply(kind, before, f_c(*args_new))
        except (ValueError, ZeroDivisionError, OverflowError):
            return False  # the correction is undefined where F is defined
        if isinstance(rhs, complex) or not close(float(lhs), float(rhs)):
            return False
        checked += 1
    return checked >= trials // 2


# --------------------------------------------------------------------------------------------- distributivity
@dataclass(frozen=True)
class Distributivity:
    holds: bool
    detail: str


def _sign_of(c: sp.Expr) -> str:
    if c.is_positive:
        return "positive"
    if c.is_nonnegative:
        return "non-negative"
    return "unknown"


def distributes(op: str, kind: str, c: sp.Expr) -> Distributivity:
    """Does the reduction operator distribute over (x) = kind with the factor c? Proved, not looked up."""
    monoid = MONOIDS[op]
    a, b = sp.Dummy("a", real=True), sp.Dummy("b", real=True)
    t = sp.Dummy("t", nonnegative=True)
    tp = sp.Dummy("t", positive=True)
    if not monoid.selection and op == "sum":
        diff = sp.expand(apply(kind, a + b, c) - (apply(kind, a, c) + apply(kind, b, c)))
        if diff == 0:
            return Distributivity(True, f"sum distributes over {kind}: (a + b) {kind} c = a {kind} c + b {kind} c")
        return Distributivity(False, f"sum does not distribute over {kind}: (a + b) {kind} c - (a {kind} c + b {kind} c) = {diff}")
    # max / min and the selections: prove by the two orderings of a and b
    cases = [{b: a + t}, {a: b + t}]
    for case in cases:
        lhs = apply(kind, monoid.combine(a, b), c).xreplace(case)
        rhs = monoid.combine(apply(kind, a, c), apply(kind, b, c)).xreplace(case)
        if sp.simplify(lhs - rhs) != 0:
            return Distributivity(
                False,
                f"{op} distributes over {kind} only for a non-negative factor; the factor {c} has {_sign_of(c)} sign",
            )
    if monoid.selection:
        # order and ties must survive: a < b  =>  a (x) c < b (x) c
        gap = sp.simplify(apply(kind, a + tp, c) - apply(kind, a, c))
        if gap.is_positive is not True:
            return Distributivity(
                False, f"{op} keeps elements by order: the factor {c} must be strictly increasing ({_sign_of(c)} sign)"
            )
        return Distributivity(True, f"{op} commutes with the strictly increasing map y -> y {kind} {c}")
    if kind == TIMES:
        return Distributivity(True, f"{op} distributes over * with the {_sign_of(c)} factor {c}")
    return Distributivity(True, f"{op} distributes over + (any term; here {c})")


# --------------------------------------------------------------------------------------------- invertibility
@dataclass(frozen=True)
class GuardPoint:
    state: sp.Symbol
    point: sp.Expr  # the value where H is not finite or is zero
    safe: sp.Expr  # the finite value used instead
    why: str


def _degenerate(value: sp.Expr, kind: str = TIMES) -> bool:
    """Not usable as a correction factor: +-oo, nan or undetermined (sin(oo) is an interval in sympy), and 0 for a
    multiplicative correction (0 is the identity of an additive one, not a degenerate value)."""
    if value.has(sp.nan, sp.zoo, sp.oo, sp.S.NegativeInfinity) or value.atoms(sp.AccumBounds):
        return True
    if not value.is_number:
        return True
    if value.is_zero:
        return kind == TIMES
    return value.is_finite is False


# values of the other symbols of H at which a point is tried: two of either sign (one generic point is not a proof)
_GENERIC = (sp.Rational(37, 100), sp.Rational(-53, 100), sp.Rational(29, 10), sp.Rational(-41, 10))


def _at_points(H: sp.Expr, dep: sp.Symbol, p: sp.Expr) -> list[sp.Expr]:
    """H at dep = p, exactly where sympy can decide it, else at several generic values of the other symbols."""
    others = sorted(H.free_symbols - {dep}, key=str)
    try:
        exact = sp.simplify(H.subs(dep, p))
    except (ZeroDivisionError, TypeError, ValueError):
        return [sp.nan]
    if exact.is_number or not others:
        return [exact]
    out = []
    for n, g in enumerate(_GENERIC):
        sub = {s: g + sp.Rational(k, 7) for k, s in enumerate(others)} if n else \
            {s: _GENERIC[0] + k for k, s in enumerate(others)}
        try:
            out.append(sp.simplify(H.xreplace(sub).subs(dep, p)))
        except (ZeroDivisionError, TypeError, ValueError):
            out.append(sp.nan)
    return out


def degenerate_points(H: sp.Expr, dep: sp.Symbol, candidates: list[sp.Expr], kind: str = TIMES) -> list[GuardPoint]:
    """Points among the candidates where H(D) cannot serve as a correction (see _degenerate), each with a safe
    substitute where H is usable for every value of the other symbols tried."""
    out = []
    for p in candidates:
        values = _at_points(H, dep, p)
        bad = [v for v in values if _degenerate(v, kind)]
        if not bad:
            continue
        safe = None
        for cand in (sp.Integer(0), sp.Integer(1), sp.Integer(2), sp.Integer(-1)):
            if cand == p:
                continue
            if not any(_degenerate(w, kind) for w in _at_points(H, dep, cand)):
                safe = cand
                break
        if safe is None:
            raise ValueError(f"no safe substitute for {dep} = {p} in H = {H}")
        out.append(GuardPoint(dep, p, safe, f"H = {H} is {bad[0]} at {dep} = {p}"))
    return out


def state_candidates(op: str) -> list[sp.Expr]:
    """Values a state reaches where its correction may break down: its neutral element (an empty prefix, or a
    prefix of elements at the neutral value), 0 (an all-zero abs-max, a signed max passing through 0, an
    underflowed or cancelled sum) and both infinities (overflow, infinite entries)."""
    out = [MONOIDS[op].neutral]
    out.append(sp.Integer(0))  # e.g. the abs-max of an all-zero row
    for inf in (sp.S.NegativeInfinity, sp.oo):
        if inf not in out:
            out.append(inf)
    return out


def other_singular_points(H: sp.Expr, dep: sp.Symbol, known: list[sp.Expr], kind: str = TIMES) -> list[sp.Expr] | None:
    """Finite real values of dep, besides the known candidates, where H is zero (multiplicative corrections) or
    has a pole; None when sympy cannot locate them."""
    d = sp.Dummy("d", real=True)
    h = sp.together(H.xreplace({dep: d}))
    num, den = sp.fraction(h)
    found: list[sp.Expr] = []
    for part in ([num, den] if kind == TIMES else [den]):
        if not part.has(d) or part.is_zero is False:
            continue  # no real root (sympy knows the sign, e.g. max(eps, a) or exp(-a))
        try:
            sols = sp.solve(part, d, dict=False)
        except (NotImplementedError, TypeError, ValueError):
            return None
        if not isinstance(sols, list):
            return None
        # a root outside the state's range is never reached (ss = -N*eps for a sum of squares, eps > 0)
        below = bool(dep.is_nonnegative or dep.is_extended_nonnegative)
        found += [x for x in sols if x.is_real is not False and x not in known and not (below and x.is_negative)]
    return found


# --------------------------------------------------------------------------------------------- reachable values
# element values tried when asking which values a body takes in floating point: -inf entries, zeros of either sign,
# values around 0 and values whose exp overflows or underflows
PROBE = (-math.inf, -1000.0, -800.0, -745.5, -100.0, -3.0, -1.0, -1e-300, -0.0, 0.0, 1e-300, 1.0, 3.0, 100.0,
         710.0, 800.0, 1000.0)


def sample_values(sym: sp.Basic) -> tuple[float, ...]:
    """A few float values a symbol can take (its sign and integer assumptions respected)."""
    if getattr(sym, "is_integer", False):
        return (1.0, 3.0) if sym.is_positive else (0.0, 1.0, 3.0)
    if sym.is_positive:
        return (1e-3, 1.0, 800.0)
    if sym.is_nonnegative:
        return (0.0, 1.0, 800.0)
    return (-800.0, -1.0, 0.0, 1.0, 800.0)


def probe_body(body: sp.Expr, atom: sp.Basic, rng: random.Random, combos: int = 12) -> list[tuple[float, float]]:
    """(element value, body value) in float64 over PROBE, with the other symbols of the body (states at their
    regular values, row constants, other reads) at a few values each."""
    a = sp.Dummy("a", real=True)
    b = strip_casts(body).xreplace({atom: a})
    others = sorted(b.free_symbols - {a}, key=str) + sorted(b.atoms(sp.Indexed), key=str)
    fresh = {o: sp.Dummy(f"o{n}", real=True) for n, o in enumerate(others)}
    b = b.xreplace(fresh)
    import numpy as np

    f = np_lambdify([a, *fresh.values()], b)
    grids = [sample_values(o) if isinstance(o, sp.Symbol) else (-800.0, -1.0, 0.0, 1.0, 800.0) for o in others]
    points = [tuple(rng.choice(g) for g in grids) for _ in range(combos)] if others else [()]
    out = []
    with np.errstate(all="ignore"):
        for x in PROBE:
            for pt in points:
                try:
                    v = complex(f(np.float64(x), *[np.float64(c) for c in pt]))
                except (ValueError, ZeroDivisionError, OverflowError, TypeError, NameError):
                    continue
                if v.imag == 0:
                    out.append((x, v.real))
    return out


def correction_overflows(c: sp.Expr, moves: list[tuple[sp.Symbol, sp.Symbol, int]],
                         rng: random.Random, trials: int = 200) -> tuple[float, float] | None:
    """A multiplicative correction c(old -> new) that overflows to +-inf in float64 for states that move as they
    can (moves: (old, new, direction), +1: new >= old as for a max or a sum of non-negative terms, -1: new <= old,
    0: either way), e.g. exp(m_old - m_new) for a min m. Such a correction turns a state 0 into nan and a finite
    state into inf where the plain math is finite. Returns an (old, new) pair where it does, else None."""
    import numpy as np

    # states reach the infinities too (a sum of |y| with y = -inf, a max of inf): inf / inf is nan, not inf, but
    # (inf / 0.5)**2 is inf
    values = (-math.inf, -1000.0, -800.0, -3.0, -1.0, 0.0, 1.0, 3.0, 800.0, 1000.0, math.inf)
    movers = {o for o, _, _ in moves} | {n for _, n, _ in moves}
    others = sorted(c.free_symbols - movers, key=str)
    syms = [x for o, n, _ in moves for x in (o, n)] + others
    fresh = {x: sp.Dummy(f"c{k}", real=True) for k, x in enumerate(syms)}
    f = np_lambdify(list(fresh.values()), c.xreplace(fresh))

    def allowed(sym: sp.Symbol, v: float) -> bool:
        return not ((sym.is_positive and v <= 0) or (sym.is_nonnegative and v < 0))

    with np.errstate(all="ignore"):
        for _ in range(trials):
            args = []
            pair = None
            for o, n, direction in moves:
                a, b = rng.choice(values), rng.choice(values)
                if direction * (b - a) < 0:
                    a, b = b, a
                if not (allowed(o, a) and allowed(n, b)):
                    break
                args += [a, b]
                pair = pair or (a, b)
            else:
                args += [rng.choice(sample_values(x)) for x in others]
                try:
                    v = complex(f(*[np.float64(x) for x in args]))
                except (ValueError, ZeroDivisionError, OverflowError, TypeError, NameError):
                    continue
                if v.imag == 0 and math.isinf(v.real):
                    return pair
    return None


def nan_point(body: sp.Expr, atoms: list[sp.Basic], rng: random.Random, trials: int = 80) -> dict | None:
    """Element values (from PROBE, -inf included) at which the body is nan in float64 (e.g. (x - 1)/(1 + |x|) at
    x = -inf), with the other symbols at sampled values; None when none was found."""
    import numpy as np

    b = strip_casts(body)
    others = sorted(b.free_symbols - set(atoms), key=str) + sorted(set(b.atoms(sp.Indexed)) - set(atoms), key=str)
    syms = list(atoms) + others
    fresh = {x: sp.Dummy(f"n{k}", real=True) for k, x in enumerate(syms)}
    f = np_lambdify(list(fresh.values()), b.xreplace(fresh))
    with np.errstate(all="ignore"):
        for _ in range(trials):
            vals = [rng.choice(PROBE) for _ in atoms] + [
                rng.choice(sample_values(x) if isinstance(x, sp.Symbol) else (-1.0, 0.0, 1.0)) for x in others]
            try:
                v = complex(f(*[np.float64(x) for x in vals]))
            except (ValueError, ZeroDivisionError, OverflowError, TypeError, NameError):
                continue
            if math.isnan(v.real):
                return {a: vals[k] for k, a in enumerate(atoms)}
    return None


def neutral_everywhere(term: sp.Expr, neutral: sp.Expr) -> bool:
    """term equals the neutral element for every value of its symbols (as sympy proves it with their assumptions):
    a check at one generic point is not a proof."""
    try:
        return sp.simplify(term) == neutral
    except (ValueError, TypeError, ZeroDivisionError):
        return False


__all__ = [
    "MONOIDS",
    "PLUS",
    "PROBE",
    "TIMES",
    "Decomposition",
    "Distributivity",
    "GuardPoint",
    "Monoid",
    "Refusal",
    "apply",
    "correction_overflows",
    "decompose",
    "degenerate_points",
    "distributes",
    "nan_point",
    "neutral_everywhere",
    "other_singular_points",
    "probe_body",
    "sample_values",
    "sigmoid",
    "state_candidates",
]
