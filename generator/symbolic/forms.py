"""Derive the fused, online and merge forms of a cascade, or say precisely why a reduction does not fuse.

Nothing here knows any particular op: the forms come from the three conditions in algebra.py applied to each
reduction's body. For a reduction y = (+)_l F(x_l, D) that decomposes as F = G (x) H:
- fused form: y = ((+)_l G(x_l)) (x) H(D) with the final D: one pass suffices;
- online form: state y with the running D; per chunk, with D_old -> D_new (deps updated first, in order),
  y_new = (y_old (x) c(D_old -> D_new)) (+) ((+)_{l in chunk} F(x_l, D_new)), c = H(D_old)^-1 (x) H(D_new);
- merge form: segments p with states (D_p, y_p): D = merge of the D_p, y = (+)_p y_p (x) c(D_p -> D).
Where H is zero or infinite at a value a state can take (an empty prefix), the state is replaced by a safe value
in H (a guard); outputs that are undefined for an empty row take the spec's `empty` value.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field
from typing import Any

import sympy as sp

from ..errors import FusionError, Loc, SpecError
from ..spec import OpSpec
from .algebra import (
    MONOIDS,
    PROBE,
    Decomposition,
    GuardPoint,
    Refusal,
    correction_overflows,
    decompose,
    degenerate_points,
    distributes,
    nan_point,
    neutral_everywhere,
    np_lambdify,
    other_singular_points,
    probe_body,
    sample_value,
    sample_values,
    state_candidates,
)
from .expr import has_casts, is_bool, strip_casts
from .ir import CascadeIR, Reduction, build_ir, specializations


# --------------------------------------------------------------------------------------------- results
@dataclass(frozen=True)
class Condition:
    name: str  # decomposable | distributive | invertible | order
    holds: bool
    detail: str


@dataclass(frozen=True)
class Guard:
    """state_safe = safe if state == point (for each point) else state; used wherever H(state) is evaluated."""

    state: str
    points: tuple[tuple[sp.Expr, sp.Expr], ...]  # (point, safe value)
    reason: str

    def apply(self, value: sp.Expr) -> sp.Expr:
        pieces = [(safe, sp.Eq(value, point)) for point, safe in self.points]
        return sp.Piecewise(*pieces, (value, True))


@dataclass(frozen=True)
class Payload:
    name: str
    expr: sp.Expr  # F_p(x, D)
    term: sp.Expr  # with the new (guarded) states
    kind: str  # "*", "+" or "none"
    correction: sp.Expr  # in old/new (guarded) symbols


@dataclass(frozen=True)
class ReductionForm:
    name: str
    op: str
    stage: str  # "stream" (over the cascade axis, online) | "epilogue" (over a resident axis after a pass)
    pass_no: int  # pass over the cascade axis (stream) or the pass after which it runs (epilogue)
    body: sp.Expr  # F(x, D) as written (casts kept), D = current states
    where: Any
    k: sp.Expr | None
    free: tuple[str, ...]
    online_deps: tuple[str, ...]  # states of the same pass that it is corrected for
    final_deps: tuple[str, ...]  # results of earlier passes (constants here)
    kind: str  # "*", "+" or "none"
    correction: sp.Expr  # c(D_old -> D_new) in guarded old/new symbols (1 / 0 when kind == "none")
    term: sp.Expr  # F(x, D_new) in guarded new symbols: the per-element contribution of a chunk
    G: sp.Expr
    H: sp.Expr
    payloads: tuple[Payload, ...]
    conditions: tuple[Condition, ...]
    loc: Loc

    @property
    def neutral(self) -> sp.Expr:
        return MONOIDS[self.op].neutral

    @property
    def selection(self) -> bool:
        return MONOIDS[self.op].selection


@dataclass(frozen=True)
class PassInfo:
    number: int
    reductions: tuple[str, ...]  # streamed in this pass
    epilogues: tuple[str, ...]  # computed on resident data after this pass
    reason: str  # why this pass exists (pass 1: "first pass")


@dataclass(frozen=True)
class OutputForm:
    name: str
    value: sp.Expr  # over final states and row constants, guarded for empty rows where needed
    raw: sp.Expr
    empty_condition: Any  # sympy boolean or None
    index: tuple[str, ...]
    per_element: bool  # reads element values: needs one more read of the row after the last pass


@dataclass(frozen=True)
class Analysis:
    """Everything derived for one specialisation of one op."""

    ir: CascadeIR
    reductions: tuple[ReductionForm, ...]
    passes: tuple[PassInfo, ...]
    guards: tuple[Guard, ...]
    outputs: tuple[OutputForm, ...]
    mask_value: dict[sp.Basic, sp.Expr]  # element atom -> a value that makes every streamed term neutral
    approximations: tuple[str, ...]
    symbols: dict[str, dict[str, sp.Symbol]] = field(default_factory=dict)  # state -> role -> symbol

    def form(self, name: str) -> ReductionForm:
        for r in self.reductions:
            if r.name == name:
                return r
        raise KeyError(name)

    def guard(self, state: str) -> Guard | None:
        for g in self.guards:
            if g.state == state:
                return g
        return None

    def sym(self, state: str, role: str) -> sp.Symbol:
        """Symbol of a state in a role: cur, old, new, old_safe, new_safe."""
        return self.symbols[state][role]


@dataclass(frozen=True)
class OpAnalysis:
    spec: OpSpec
    cases: tuple[Analysis, ...]

    def case(self, **special: Any) -> Analysis:
        for a in self.cases:
            d = dict(a.ir.specialization)
            if all(d.get(k) == v for k, v in special.items()):
                return a
        raise KeyError(special)


# --------------------------------------------------------------------------------------------- helpers
def state_symbols(name: str, sym: sp.Symbol, regular: dict[str, bool]) -> dict[str, sp.Symbol]:
    """The symbols of one state in each role. Values (cur, old, new, seg) take the state symbol's assumptions:
    they can be degenerate (-inf, 0). Safe values are regular. old_r/new_r are the regular stand-ins used only
    inside proofs (decomposition, distributivity, signs), where guards have excluded the degenerate values."""
    value = {k: v for k, v in sym.assumptions0.items()
             if k in ("real", "extended_real", "positive", "nonnegative", "extended_nonnegative")}
    return {
        "cur": sym,
        "old": sp.Symbol(f"{name}_old", **value),
        "new": sp.Symbol(f"{name}_new", **value),
        "seg": sp.Symbol(f"{name}_p", **value),
        "old_safe": sp.Symbol(f"{name}_old_safe", **regular),
        "new_safe": sp.Symbol(f"{name}_new_safe", **regular),
        "safe": sp.Symbol(f"{name}_safe", **regular),
        "old_r": sp.Symbol(f"{name}_old", **regular),
        "new_r": sp.Symbol(f"{name}_new", **regular),
    }


def element_atoms(ir: CascadeIR, expr: sp.Basic, outermost: bool = False) -> list[sp.Basic]:
    """Sub-expressions of expr that vary along the cascade axis: element lets, reads indexed by it, the index.
    outermost: drop atoms that occur only inside other atoms (the index inside x[t, e])."""
    over = ir.indices[ir.over]
    out: list[sp.Basic] = []
    element_syms = {x.symbol for x in ir.element_lets}
    for s in expr.free_symbols:
        if s in element_syms or s == over:
            out.append(s)
    for ix in expr.atoms(sp.Indexed):
        if over in ix.free_symbols or any(a in element_syms for a in ix.indices):
            out.append(ix)
    atoms = sorted(set(out), key=str)
    if outermost:
        rest = expr
        for a in atoms:
            if isinstance(a, sp.Indexed):
                rest = rest.xreplace({a: sp.Dummy()})
        atoms = [a for a in atoms if isinstance(a, sp.Indexed) or rest.has(a)]
    return atoms


def _value_at(expr: sp.Expr, sub: dict) -> sp.Expr:
    """expr with sub applied and simplified; nan where sympy cannot evaluate it (e.g. max(nan, ...))."""
    try:
        return sp.simplify(expr.xreplace(sub))
    except (ValueError, TypeError, ZeroDivisionError):
        return sp.nan


def _final_value(expr: sp.Expr) -> float:
    f = sp.lambdify([], expr, modules=["math"])
    try:
        with _np_quiet():
            return float(f())
    except (ValueError, ZeroDivisionError, OverflowError):
        return math.nan


class _np_quiet:
    def __enter__(self) -> None:
        import numpy as np

        self._old = np.seterr(all="ignore")

    def __exit__(self, *exc: object) -> None:
        import numpy as np

        np.seterr(**self._old)


def _numeric_at(expr: sp.Expr, values: dict[sp.Symbol, float]) -> float:
    import numpy as np

    syms = sorted(expr.free_symbols, key=str)
    f = sp.lambdify(syms, expr, modules=["numpy"])
    with _np_quiet():
        try:
            return float(np.asarray(f(*[np.float64(values.get(s, 0.37)) for s in syms])))
        except (ValueError, ZeroDivisionError, OverflowError, TypeError):
            return math.nan


UNREACHABLE = "unreachable"  # _reached_only_empty: no prefix takes the state to the point (no guard needed)


def _implies(a: Any, b: Any) -> bool:
    """The predicate a implies b, syntactically: b is true, equal to a, or made of conjuncts of a."""
    if b in (sp.true, True) or a == b:
        return True
    conj_a = set(a.args) if isinstance(a, sp.And) else {a}
    conj_b = set(b.args) if isinstance(b, sp.And) else {b}
    return conj_b <= conj_a


def _neutral_at(f: ReductionForm, atom: sp.Basic, value: sp.Expr) -> bool:
    """The streamed term of f is neutral at atom = value for every value of its other symbols (False where sympy
    cannot even substitute, e.g. max(nan, ...))."""
    try:
        if not neutral_everywhere(strip_casts(f.term).xreplace({atom: value}), f.neutral):
            return False
    except (ValueError, TypeError, ZeroDivisionError):
        return False
    return _neutral_in_floats(f, atom, value)


def _neutral_in_floats(f: ReductionForm, atom: sp.Basic, value: sp.Expr) -> bool:
    """The term is also neutral in floating point at atom = value, at a few values of its other symbols: sympy takes
    limits where the kernels compute nan (sin(-oo) is a bounded set to sympy, so -oo + sin(-oo) = -oo; in floats
    sin(-inf) is nan, and so is the term). Found by the property test (ENGINE_SEED=1717, 2,000 examples)."""
    import numpy as np

    term = strip_casts(f.term)
    sub = {a: sp.Dummy(f"a{k}", real=True) for k, a in enumerate(sorted(term.atoms(sp.Indexed), key=str))}
    if atom not in sub:
        sub[atom] = sp.Dummy("atom", real=True)
    term = term.xreplace(sub)
    others = sorted(term.free_symbols - {sub[atom]}, key=str)
    try:
        fn = np_lambdify([sub[atom], *others], term)
    except (ValueError, TypeError, KeyError, NameError):
        return False
    rng = random.Random(0)
    want = float(f.neutral)
    with _np_quiet():
        for _ in range(3):
            try:
                got = float(np.asarray(fn(np.float64(float(value)), *[np.float64(sample_value(s, rng)) for s in others])))
            except (ValueError, TypeError, ZeroDivisionError, OverflowError, NameError):
                return False
            if got != want:  # nan never equals
                return False
    return True


def _solutions(b: sp.Expr, a: sp.Basic, target: sp.Expr) -> list[sp.Expr] | None:
    """Real element values with b = target (infinite ones by substitution); None when sympy cannot solve."""
    if target.is_infinite:
        return [c for c in (target, -target) if _value_at(b, {a: c}) == target]
    x = sp.Dummy("a", real=True)
    try:
        sols = sp.solve(sp.Eq(b.xreplace({a: x}), target), x, dict=False)
    except (NotImplementedError, TypeError, ValueError):
        return None
    if not isinstance(sols, list) or any(not isinstance(v, sp.Expr) for v in sols):
        return None
    out = [v for v in sols if v.is_real is not False]
    out += [c for c in (sp.oo, sp.S.NegativeInfinity) if _value_at(b, {a: c}) == target]
    return out


def _value_can_be(b: sp.Expr, atoms: list[sp.Basic], value: sp.Expr) -> bool:
    """Some element value gives b = value (True when sympy cannot tell)."""
    if len(atoms) != 1:
        return True
    sols = _solutions(b, atoms[0], value)
    return sols is None or bool(sols)


# --------------------------------------------------------------------------------------------- the analysis
class _Analyzer:
    def __init__(self, ir: CascadeIR):
        self.ir = ir
        self.syms = {n: state_symbols(n, s, ir.regular[n]) for n, s in ir.states.items()}
        self.pass_of: dict[str, int] = {}
        self.ready: dict[str, int] = {}  # first pass in which a result is a constant
        self.stage: dict[str, str] = {}
        self.forms: list[ReductionForm] = []
        self.guard_points: dict[str, list[GuardPoint]] = {}
        self.pass_reasons: dict[int, str] = {1: "first pass over the row"}
        self.approximations: set[str] = set()
        self.undefined: list[str] = []  # degenerate points reached only where the plain math is nan
        self.rng = random.Random(1234)

    def fail(self, r: Reduction, condition: str, detail: str) -> FusionError:
        return FusionError(r.loc, r.name, condition, detail)

    def run(self) -> Analysis:
        for r in self.ir.reductions:
            if r.over != self.ir.over:
                self._epilogue(r)
            else:
                self._stream(r)
        guards = tuple(
            Guard(name, tuple((p.point, p.safe) for p in pts), "; ".join(p.why for p in pts))
            for name, pts in self.guard_points.items()
            if pts
        )
        forms = tuple(self._guarded(f, guards) for f in self.forms)
        passes = self._passes(forms)
        outputs = tuple(self._output(o) for o in self.ir.outputs)
        return Analysis(
            ir=self.ir,
            reductions=forms,
            passes=passes,
            guards=guards,
            outputs=outputs,
            mask_value=self._mask_value(forms, guards),
            approximations=tuple(sorted(self.approximations)),
            symbols=self.syms,
        )

    # ------------------------------------------------------------------ epilogue reductions
    def _epilogue(self, r: Reduction) -> None:
        after = 1
        for d in r.deps:
            after = max(after, self.ready[d] - 1)
        self.pass_of[r.name] = after
        self.ready[r.name] = after + 1
        self.stage[r.name] = "epilogue"
        self.forms.append(
            ReductionForm(
                name=r.name, op=r.op, stage="epilogue", pass_no=after, body=r.body, where=r.where, k=r.k,
                free=r.free, online_deps=(), final_deps=r.deps, kind="none", correction=sp.Integer(1),
                term=r.body, G=r.body, H=sp.Integer(1),
                payloads=tuple(Payload(n, e, e, "none", sp.Integer(1)) for n, e in r.carry),
                conditions=(Condition("resident", True, f"reduces over '{r.over}' after pass {after}, "
                                      "when everything it reads is final"),),
                loc=r.loc,
            )
        )

    # ------------------------------------------------------------------ streamed reductions
    def _stream(self, r: Reduction) -> None:
        scalar_deps = [d for d in r.deps if d in self.ir.states and self.stage.get(d) == "stream"]
        must_final = [d for d in r.deps if d not in scalar_deps]
        base = max([self.ready[d] for d in must_final] + [self.pass_of[d] for d in scalar_deps] + [1])
        same = [d for d in scalar_deps if self.pass_of[d] == base]
        result = self._classify_safely(r, same)
        if isinstance(result, Refusal):
            if base + 1 > self.ir.passes:
                raise self.fail(r, result.condition, result.detail)
            why = f"'{r.name}' needs {', '.join(same)} final: {result.condition} fails ({result.detail})"
            self.pass_reasons.setdefault(base + 1, why)
            base += 1
            same = []
            result = self._classify_safely(r, [])
            if isinstance(result, Refusal):  # with no online deps everything is constant
                raise self.fail(r, result.condition, result.detail)
        elif base > 1 and base not in self.pass_reasons:
            waits = [d for d in must_final if self.ready[d] == base]
            self.pass_reasons[base] = f"'{r.name}' reads {', '.join(waits)}, final only after pass {base - 1}"
        if base > self.ir.passes:
            raise self.fail(
                r, "passes",
                f"needs pass {base} but the spec allows {self.ir.passes} (cascade.passes); it reads "
                f"{', '.join(must_final)}, final only after pass {base - 1}",
            )
        self.pass_of[r.name] = base
        self.ready[r.name] = base + 1
        self.stage[r.name] = "stream"
        self.forms.append(result)

    def _classify_safely(self, r: Reduction, online: list[str]) -> ReductionForm | Refusal:
        """Classify; where sympy cannot decide a question (it raises), refuse rather than guess."""
        try:
            return self._classify(r, online)
        except (ValueError, TypeError, ZeroDivisionError, NotImplementedError, RecursionError, AttributeError,
                KeyError) as exc:  # KeyError: a printer without the constant (log(0) folds to zoo, complex infinity)
            return Refusal("analysis", f"sympy could not decide a condition for body {r.body}: {exc!r}")

    def _classify(self, r: Reduction, online: list[str]) -> ReductionForm | Refusal:
        conditions: list[Condition] = []
        casts = has_casts(r.body) + [c for _, e in r.carry for c in has_casts(e)]
        for c in casts:
            self.approximations.add(f"{c} conversion treated as value-preserving in the proof (exact up to rounding)")
        deps = [self.ir.states[d] for d in online]
        old = {self.ir.states[d]: self.syms[d]["old_r"] for d in online}
        new = {self.ir.states[d]: self.syms[d]["new_r"] for d in online}
        # proofs run on the regular stand-ins; the forms are stated on the value symbols
        to_values = {self.syms[d][f"{r}_r"]: self.syms[d][r] for d in online for r in ("old", "new")}
        if MONOIDS[r.op].selection and any(r.body.has(self.ir.states[d]) for d in online):
            # mathematically a strictly increasing correction keeps the order, but a corrected key is rounded:
            # two equal keys, one corrected and one fresh, would be ordered by rounding, not by index
            return Refusal("exact order", f"the key {r.body} of a selection would be corrected as "
                           f"{', '.join(online)} change, and rounding would decide between equal keys")
        if MONOIDS[r.op].selection and any(e.has(self.ir.states[d]) for _, e in r.carry for d in online):
            # a selection's entries are kept as they were chosen: payloads are never corrected either
            return Refusal("exact order", f"a payload of the selection would be corrected as {', '.join(online)} "
                           "change; the selection's entries are kept exactly as chosen")
        where_deps = [d for d in online if isinstance(r.where, sp.Basic) and r.where.has(self.ir.states[d])]
        if where_deps:
            return Refusal("decomposable", f"the predicate {r.where} depends on {', '.join(where_deps)} of the same pass")
        atoms = element_atoms(self.ir, r.body)
        dec = decompose(r.body, atoms, deps, old, new, self.rng)
        if isinstance(dec, Refusal):
            return Refusal(dec.condition, f"body {r.body}: {dec.detail}")
        if dec.kind == "none":
            conditions.append(Condition("decomposable", True, "F does not depend on any state of this pass"))
        else:
            conditions.append(
                Condition("decomposable", True, f"F(x, D) = G(x) {dec.kind} H(D) with G = {dec.G}, H = {dec.H}")
            )
            dist = distributes(r.op, dec.kind, dec.correction)
            conditions.append(Condition("distributive", dist.holds, dist.detail))
            if not dist.holds:
                return Refusal("distributive", f"body {r.body}: {dist.detail}")
        payloads = []
        for pname, pexpr in r.carry:
            pdec = decompose(pexpr, element_atoms(self.ir, pexpr), deps, old, new, self.rng)
            if isinstance(pdec, Refusal):
                return Refusal("decomposable", f"payload {pname} = {pexpr}: {pdec.detail}")
            payloads.append((pname, pexpr, pdec))
        for x in online:  # a state that is nan makes every correction nan, also of a sum that counted nothing
            if any(dd.kind != "none" and dd.correction.has(old[self.ir.states[x]]) for dd in [dec] + [p[2] for p in payloads]):
                dep = self.ir.reduction(x)
                b = strip_casts(dep.body).xreplace({self.ir.states[y]: self.syms[y]["new_r"] for y in dep.deps
                                                    if y in self.ir.states})
                at = nan_point(b, element_atoms(self.ir, b, outermost=True), self.rng)
                if at is not None:
                    shown = ", ".join(f"{k} = {v}" for k, v in at.items())
                    return Refusal("invertible", f"the body {b} of '{x}' is nan at {shown}, which makes '{x}' nan "
                                   f"and the correction of '{r.name}' nan even where '{r.name}' counts no element")
        for dd in [dec] + [p[2] for p in payloads]:
            if dd.kind == "*":
                moves = [(old[self.ir.states[x]], new[self.ir.states[x]], self._direction(x)) for x in online
                         if dd.correction.has(old[self.ir.states[x]])]
                bad = correction_overflows(dd.correction, moves, self.rng) if moves else None
                if bad is not None:
                    return Refusal("invertible", f"the correction {dd.correction} overflows to inf in floating point "
                                   f"as the states move (e.g. from {bad[0]} to {bad[1]}): a state of 0 becomes nan "
                                   "and a finite one inf")
        inv = self._invertible(r, online, [dec] + [p[2] for p in payloads])
        if isinstance(inv, Refusal):
            return inv
        conditions.append(inv)
        if dec.kind != "none":
            early = self._early_term_not_finite(r, online)
            if early is not None:
                return Refusal("bounded", early)
            conditions.append(Condition("bounded", True, "the term of an element is finite at the states of the "
                                        "elements seen so far wherever the plain result is finite"))
        return ReductionForm(
            name=r.name, op=r.op, stage="stream", pass_no=0, body=r.body, where=r.where, k=r.k, free=r.free,
            online_deps=tuple(online), final_deps=tuple(d for d in r.deps if d not in online),
            kind=dec.kind, correction=dec.correction.xreplace(to_values),
            term=r.body.xreplace(new).xreplace(to_values), G=dec.G, H=dec.H,
            payloads=tuple(Payload(n, e, e.xreplace(new).xreplace(to_values), pd.kind,
                                   pd.correction.xreplace(to_values)) for n, e, pd in payloads),
            conditions=tuple(conditions), loc=r.loc,
        )

    def _early_term_not_finite(self, r: Reduction, online: list[str], trials: int = 300) -> str | None:
        """The online form evaluates an element's term F(x, D) at the states D of the elements seen so far (a
        segment's states when merging), and corrects it later. Where D moves on as later elements come, an early
        term can be inf or nan although the plain result, which reads the final D, is finite: exp(x - r0) / r0**2
        with r0 = sum(0.5) and x = 710 overflows after the first element (r0 = 0.5) but not at r0 = 1. A running
        max keeps its terms bounded (exp(s - m) <= 1 once m has seen s); nothing here knows that: short rows (a
        prefix, the element, a suffix) of special values run through the plain math of the states, and the term
        is evaluated at the prefix's (guarded) states. Returns a witness, or None when no row showed one."""
        import numpy as np

        ir = self.ir
        if any(ir.reduction(d).selection for d in online):
            return None
        chain = set(online)
        for red in reversed(ir.reductions):  # the same-pass states the online ones read, transitively
            if red.name in chain:
                chain |= {x for x in red.deps if x in ir.states and self.stage.get(x) == "stream"
                          and self.pass_of.get(x) == self.pass_of.get(red.name)}
        chain_reds = [red for red in ir.reductions if red.name in chain]
        exprs = [strip_casts(r.body), r.where] + [x for red in chain_reds for x in (strip_casts(red.body), red.where)]
        exprs = [sp.sympify(e) for e in exprs]
        atoms = sorted({a for e in exprs for a in element_atoms(ir, e, outermost=True)}, key=str)
        sub = {a: sp.Dummy(f"x{k}", real=True) for k, a in enumerate(atoms)}
        others = sorted({s for e in exprs for s in e.xreplace(sub).free_symbols} - set(sub.values()), key=str)
        args = [sub[a] for a in atoms] + others
        try:
            fns = [np_lambdify(args, e.xreplace(sub)) for e in exprs]
        except (ValueError, TypeError, KeyError, NameError):
            return None
        state_of = {ir.states[red.name]: red.name for red in ir.reductions if red.name in ir.states}
        guards = {d: [(float(p.point), float(p.safe)) for p in self.guard_points.get(d, [])] for d in online}
        over = ir.indices[ir.over]
        rng = random.Random(4321)

        def value(fn: Any, elem: list[float], consts: dict[sp.Symbol, float], states: dict[str, float]) -> float:
            vals = [*elem] + [states[state_of[o]] if o in state_of and state_of[o] in states else consts[o]
                              for o in others]
            try:
                return float(np.asarray(fn(*[np.float64(v) for v in vals])))
            except (ValueError, TypeError, ZeroDivisionError, OverflowError, NameError):
                return math.nan

        def fold(op: str, acc: float, v: float) -> float:
            if op == "sum":
                return acc + v
            if math.isnan(acc) or math.isnan(v):
                return math.nan
            return max(acc, v) if op == "max" else min(acc, v)

        def states_over(elems: list[list[float]], consts: dict[sp.Symbol, float]) -> dict[str, float]:
            got: dict[str, float] = {}
            for k, red in enumerate(chain_reds):
                acc = float(MONOIDS[red.op].neutral)
                for el in elems:
                    if value(fns[3 + 2 * k], el, consts, got):
                        acc = fold(red.op, acc, value(fns[2 + 2 * k], el, consts, got))
                got[red.name] = acc
            return got

        with _np_quiet():
            for _ in range(trials):
                consts = {o: (rng.choice(sample_values(o)) if o not in state_of else 0.0) for o in others}
                for o in others:
                    if o in state_of and state_of[o] not in chain:  # a state final before this pass: a constant
                        consts[o] = rng.choice(sample_values(o))
                n_pre = rng.choice((0, 0, 1, 2))
                elems = [[float(j) if a == over else rng.choice(PROBE) for a in atoms]
                         for j in range(n_pre + 1 + rng.randint(1, 2))]
                x = elems[n_pre]
                if not value(fns[1], x, consts, {}):
                    continue
                early = states_over(elems[:n_pre + 1], consts)
                final = states_over(elems, consts)
                safe = {d: next((sv for pt, sv in guards.get(d, []) if v == pt), v) for d, v in early.items()}
                t_early = value(fns[0], x, consts, safe)
                if math.isfinite(t_early) or not math.isfinite(value(fns[0], x, consts, final)):
                    continue
                total = float(MONOIDS[r.op].neutral)
                for el in elems:
                    if value(fns[1], el, consts, {}):
                        total = fold(r.op, total, value(fns[0], el, consts, final))
                if math.isfinite(total):
                    shown = ", ".join(f"{a} = {v}" for a, v in zip(atoms, x) if a != over)
                    at = ", ".join(f"{d} = {v}" for d, v in early.items())
                    to = ", ".join(f"{d} = {v}" for d, v in final.items())
                    return (f"the term {r.body} of an element ({shown}) is {t_early} at the states of the elements "
                            f"seen so far ({at}) while the plain result over the row ({to}) is finite ({total}): "
                            "the online and merged forms would carry inf or nan")
        return None

    def _direction(self, d: str) -> int:
        """How a state moves as elements come: +1 up (a max, a sum of non-negative terms), -1 down (a min, a sum
        of non-positive terms), 0 either way."""
        dep = self.ir.reduction(d)
        if dep.op in ("max", "min"):
            return 1 if dep.op == "max" else -1
        regular = {self.ir.states[x]: self.syms[x]["new_r"] for x in dep.deps if x in self.ir.states}
        b = strip_casts(dep.body).xreplace(regular)
        return 1 if b.is_nonnegative else (-1 if b.is_nonpositive else 0)

    def _invertible(self, r: Reduction, online: list[str], decs: list[Decomposition]) -> Condition | Refusal:
        details = []
        for d in online:
            sym = self.ir.states[d]
            dep_red = self.ir.reduction(d)
            cands = state_candidates(dep_red.op)
            for dec in decs:
                if dec.kind == "none" or not dec.H.has(sym):
                    continue
                other = other_singular_points(dec.H, sym, cands, dec.kind)
                if other is None:
                    return Refusal("invertible", f"cannot locate where H = {dec.H} is zero or infinite in {d}")
                if other:
                    return Refusal("invertible", f"H = {dec.H} is zero or infinite at {d} = {other[0]}: only a "
                                   f"state's neutral value, 0 and the infinities can be guarded")
                try:
                    pts = degenerate_points(dec.H, sym, cands, dec.kind)
                except ValueError as exc:
                    return Refusal("invertible", str(exc))
                known = self.guard_points.setdefault(d, [])
                for p in pts:
                    before = len(self.undefined)
                    unsound = self._reached_only_empty(r, d, p)
                    if unsound == UNREACHABLE:
                        continue
                    if unsound:
                        return Refusal("invertible", f"H = {dec.H} is not finite/non-zero at {d} = {p.point}, "
                                       f"and {unsound}")
                    if len(self.undefined) > before:
                        details.append(self.undefined[-1])
                        continue  # no guard: the plain math is undefined on the rows that reach the point
                    if all(p.point != q.point for q in known):
                        known.append(p)
                    details.append(f"H is not finite/non-zero at {d} = {p.point}: guarded with {d} -> {p.safe}")
        if not details:
            return Condition("invertible", True, "H is finite and non-zero wherever its states can be")
        return Condition("invertible", True, "; ".join(sorted(set(details))))

    def _reached_only_empty(self, r: Reduction, d: str, gp: GuardPoint) -> str | None:
        """A guard replaces state d at a point by a safe value, and the correction out of that point by the
        identity. That is sound when every prefix on which d is at the point holds only elements that contribute
        the neutral element to r, for every value of the states r reads (the safe value included). None when
        proved; else why not. Prefixes are judged in floating point: exp underflows to 0 and overflows to inf,
        entries may be -inf, a signed max passes through 0, a signed sum cancels."""
        ir = self.ir
        dep = ir.reduction(d)
        point = gp.point
        if not _implies(r.where, dep.where):
            return (f"'{r.name}' counts elements that '{d}' does not (where={dep.where}), so '{d}' can stay at "
                    f"{point} on a prefix that is not empty for '{r.name}'")
        regular = {ir.states[x]: self.syms[x]["new_r"] for x in dep.deps if x in ir.states}
        b = strip_casts(dep.body).xreplace(regular)
        atoms = element_atoms(ir, b, outermost=True)
        # a body of no element value (a final state of an earlier pass) still overflows: exp(0.5 - r0), r0 = -800
        probes = probe_body(b, atoms[0] if atoms else sp.Dummy(), self.rng) if len(atoms) <= 1 else []
        finite_probe = [v for _, v in probes]
        if dep.op == "sum":
            if point.is_infinite:
                if len(atoms) > 1:
                    return f"cannot tell whether {b} can be {point} (it reads {len(atoms)} element values)"
                if not any(v == float(point) for v in finite_probe) and not (not atoms and b.is_infinite):
                    return UNREACHABLE  # no element value makes a term infinite: the sum stays finite
                if self._undefined_there(r, d, b, atoms, point, probes):
                    return None
                return (f"{d} = sum({b}) is {point} once one element's term is (overflow or an infinite entry), "
                        "whatever the other elements of the prefix are")
            if point != 0 or b.is_nonnegative is not True:
                return f"{d} (a sum of terms of any sign) can reach {point} on a non-empty prefix"
            target = sp.Integer(0)
        else:
            flip = -1 if dep.op == "min" else 1  # a min is the max of the negated body
            be, pe = flip * b, flip * point
            if pe is sp.S.NegativeInfinity:
                target = point
            elif pe is sp.oo:
                if any(flip * v == math.inf for v in finite_probe):
                    if self._undefined_there(r, d, b, atoms, point, probes):
                        return None
                    return f"{d} = {dep.op}({b}) is {point} once one element is, whatever the others are"
                return UNREACHABLE
            elif (be - pe).is_nonnegative:
                target = point
            elif (be - pe).is_nonpositive:
                if any(v == float(point) for v in finite_probe) or _value_can_be(b, atoms, point):
                    return f"{d} = {dep.op}({b}) is {point} once one element is, whatever the others are"
                return UNREACHABLE
            else:
                return f"{d} = {dep.op}({b}) passes through {point} on prefixes of elements of either sign"
        # every element of such a prefix has b = target: find them, and what they contribute to r
        empty = UNREACHABLE if point != MONOIDS[dep.op].neutral else None  # the empty prefix is at the neutral value
        if not atoms:  # a term of states only: read them as the values they can take, degenerate ones included
            # (r1 = sum(r0) with r0 = sum(exp(x), where=x > 0) is 0 on a row where r0 counted nothing)
            b_values = strip_casts(dep.body)
            return empty if (b_values - target).is_zero is False else f"every element makes {d} = {point}"
        if len(atoms) != 1:
            return f"cannot tell which elements make {d} = {point} (its body reads {len(atoms)} element values)"
        a = atoms[0]
        sols = _solutions(b, a, target)
        if sols is None:
            return f"cannot solve {b} = {target}"
        for x, v in probes:  # floating point: exp underflows to 0, log(0) is -inf
            if v == float(target):
                val = sp.Float(x) if math.isfinite(x) else sp.S.NegativeInfinity
                if val not in sols:
                    sols.append(val)
        if not sols:
            return empty  # no element makes the state reach the point: only the empty prefix can
        sols.sort(key=lambda v: (bool(v.is_infinite), str(v)))  # finite ones first: the floating-point cases
        new = {ir.states[x]: self.syms[x]["new_r"] for x in r.deps if x in ir.states}
        safe = {self.syms[d]["new_r"]: gp.safe}
        term = strip_casts(r.body).xreplace(new)
        neutral = MONOIDS[r.op].neutral
        for x in sols:
            if _value_at(r.where, {a: x}) in (sp.false, False):
                continue  # r does not count such an element (e.g. where=x > -1e30 and x = -inf)
            try:
                v = term.xreplace({a: x})
                ok = neutral_everywhere(v, neutral) and neutral_everywhere(v.xreplace(safe), neutral)
            except (ValueError, TypeError, ZeroDivisionError):
                return f"cannot evaluate what an element with {a} = {x} contributes to '{r.name}'"
            if not ok:
                return (f"an element with {a} = {x} makes {d} = {point} but contributes {sp.simplify(v)} to "
                        f"'{r.name}', not its neutral element {neutral} for every value of the states")
        return None

    def _undefined_there(self, r: Reduction, d: str, b: sp.Expr, atoms: list[sp.Basic], point: sp.Expr,
                         probes: list[tuple[float, float]]) -> bool:
        """d reaches an infinite point through one element and stays there (a max at +oo, a min at -oo, a sum at
        +-oo or nan). When r is a sum, max or min (each propagates nan) and that element's own term is nan at
        d = point, r is nan in the plain math on every such row: the result there is undefined, and nothing the
        online form computes can differ from a defined value."""
        if r.op not in ("sum", "max", "min") or len(atoms) != 1:
            return False
        a = atoms[0]
        sols = _solutions(b, a, point) or []
        sols += [sp.Float(x) if math.isfinite(x) else sp.S.NegativeInfinity for x, v in probes if v == float(point)]
        if not sols:
            return False
        new = {self.ir.states[x]: self.syms[x]["new_r"] for x in r.deps if x in self.ir.states}
        term = strip_casts(r.body).xreplace(new)
        d_r = self.syms[d]["new_r"]
        for x in sols:
            v = _value_at(term, {a: x, d_r: point})
            if v is not sp.nan:
                return False
        self.undefined.append(f"{d} = {point} only on rows where '{r.name}' is nan in the plain math "
                              f"(the element that makes it so contributes nan)")
        return True

    # ------------------------------------------------------------------ guards, passes, outputs
    def _guarded(self, f: ReductionForm, guards: tuple[Guard, ...]) -> ReductionForm:
        """Move the online term and correction onto the guarded (safe) symbols of the states that need guards."""
        if f.stage != "stream":
            return f
        by_state = {g.state: g for g in guards}
        sub_new = {self.syms[d]["new"]: self.syms[d]["new_safe"] for d in f.online_deps if d in by_state}
        # results of earlier passes are read through their guards too, where the guard is sound for this reader
        sub_final = {self.ir.states[d]: self.syms[d]["safe"] for d in f.final_deps
                     if d in by_state and d in self.ir.states and self._final_guard_sound(f, d)}
        sub_new = {**sub_new, **sub_final}
        return ReductionForm(
            **{
                **f.__dict__,
                "pass_no": self.pass_of[f.name],
                "term": f.term.xreplace(sub_new),
                "correction": self._guard_correction(f.correction, f.kind, f.online_deps, by_state, sub_new, f),
                "payloads": tuple(
                    Payload(p.name, p.expr, p.term.xreplace(sub_new), p.kind, p.correction) for p in f.payloads
                ),
            }
        )

    def _final_guard_sound(self, f: ReductionForm, d: str) -> bool:
        """Whether f may read the final state d (of an earlier pass) through d's guard: on a row where d is at a
        guarded point, every element f counts must contribute f's neutral element, also with the safe value (the
        proof of _reached_only_empty, with the whole row as the prefix). Else f reads d as it is, which is the plain
        math: r1 = sum(r0 * r0) with r0 = max(x, where=x > 0) is inf on a row with no positive x, not 0."""
        r = self.ir.reduction(f.name)
        if f.selection:  # a key read through the guard keeps its order (a softmax router: every key of an all -inf row
            return True  # is 0 instead of nan, ranked by index either way); the proof below is about neutrals
        for gp in self.guard_points.get(d, []):
            before = len(self.undefined)
            why = self._reached_only_empty(r, d, gp)
            if len(self.undefined) > before:  # the plain math is nan there: read as it is (nan too)
                del self.undefined[before:]
                return False
            if why and why != UNREACHABLE:
                return False
        return True

    def _nan_when_infinite(self, c: sp.Expr, d: str) -> bool:
        """The correction c is nan in floating point where state d stays at +inf or -inf (old = new)."""
        import numpy as np

        old, new = self.syms[d]["old"], self.syms[d]["new"]
        others = sorted(c.free_symbols - {old, new}, key=str)
        try:
            fn = np_lambdify([old, new, *others], c)
        except (ValueError, TypeError, KeyError, NameError):
            return True
        rng = random.Random(5)
        with _np_quiet():
            for inf in (math.inf, -math.inf):
                for _ in range(4):
                    try:
                        v = complex(np.asarray(fn(inf, inf, *[np.float64(rng.choice(sample_values(o))) for o in others])))
                    except (ValueError, TypeError, ZeroDivisionError, OverflowError, NameError):
                        return True
                    if math.isnan(v.real):
                        return True
        return False

    def _inf_beside_a_finite_term(self, f: ReductionForm | None, d: str) -> bool:
        """Whether the max/min state d can reach the infinity it moves towards through element values at which
        f's own term is not nan (exp(x - m) with m = max(exp(x)) at x = 1000 is 0; |x| + exp(0.5 - r1) with r1 the
        min of a sum that reached -inf is inf), i.e. f's plain result can be a number while d is infinite."""
        import numpy as np

        if f is None:
            return True
        dep, r = self.ir.reduction(d), self.ir.reduction(f.name)
        inf = math.inf if dep.op == "max" else -math.inf
        body, term = strip_casts(dep.body), strip_casts(r.body)
        atoms = sorted(set(element_atoms(self.ir, body, outermost=True)) | set(element_atoms(self.ir, term, True)),
                       key=str)
        sub = {a: sp.Dummy(f"x{k}", real=True) for k, a in enumerate(atoms)}
        state = self.ir.states[d]
        others = sorted((body.xreplace(sub).free_symbols | term.xreplace(sub).free_symbols) - set(sub.values())
                        - {state}, key=str)
        try:
            fb = np_lambdify([*sub.values(), *others], body.xreplace(sub))
            ft = np_lambdify([*sub.values(), state, *others], term.xreplace(sub))
        except (ValueError, TypeError, KeyError, NameError):
            return True
        rng = random.Random(17)
        with _np_quiet():
            for _ in range(300):
                xs = [rng.choice(PROBE + (math.inf,)) for _ in atoms]
                os_ = [rng.choice(sample_values(o) + (math.inf, -math.inf)) for o in others]
                try:
                    b = float(np.asarray(fb(*[np.float64(v) for v in xs + os_])))
                    if b != inf:
                        continue
                    t = complex(np.asarray(ft(*[np.float64(v) for v in xs + [inf] + os_])))
                except (ValueError, TypeError, ZeroDivisionError, OverflowError, NameError):
                    continue
                if not math.isnan(t.real):  # a number (inf included) that the plain math gives and the forms must
                    return True
        return False

    def _guard_correction(self, c: sp.Expr, kind: str, deps: tuple[str, ...], by_state: dict[str, Guard],
                          sub_new: dict, f: ReductionForm | None = None) -> sp.Expr:
        """c(D_old -> D_new) with guards. Where an old state is at a degenerate value the prefix contributed only
        neutral elements (proved when the guard was derived), so the state is neutral and the identity correction
        is exact; it also avoids overflow (exp(0 - m_new) for a very negative m_new times a zero state).
        Elsewhere the old state is regular (equal to its safe value) and the new one is read through its guard."""
        if kind == "none":
            return c
        regular = c.xreplace(sub_new)
        degenerate = [sp.Eq(self.syms[d]["old"], point) for d in deps if d in by_state
                      for point, _ in by_state[d].points]
        # a state that stays at +-inf: c(inf -> inf) is inf / inf or exp(inf - inf), nan, where the identity is
        # exact. A sum gets there by overflowing (an RMS norm's sqrt(N eps + ss_old) / sqrt(N eps + ss_new) on a row
        # whose sum of squares overflows: the plain norm is 0, not nan); a max through an element whose body is
        # inf, which only matters where that element's own term is not nan anyway (softmax: exp(inf - inf) is nan
        # in the plain math too; max(exp(x)) or a max of a state that overflowed are not so)
        # The condition is that every state the correction reads is unchanged (where the identity is exact by
        # definition), not only the one at inf: sum(sigmoid(r0 * r1)) with r0 unchanged by an element whose sigmoid
        # is 0 and r1 (a count) moving on needs its correction (ENGINE_SEED=77).
        if any(self._nan_when_infinite(c, d)
               and (not MONOIDS[self.ir.reduction(d).op].neutral.is_infinite or self._inf_beside_a_finite_term(f, d))
               for d in deps):
            degenerate.append(sp.And(*[sp.Eq(self.syms[d]["old"], self.syms[d]["new"]) for d in deps]))
        # an additive correction g(D_new) - g(D_old) whose two parts are both inf (exp(0.5 - r1) for a running min r1
        # that is already below -709 and falls further): the state was already at inf, as the plain math's is, and
        # inf - inf is nan; the identity is exact wherever the parts are equal
        if kind == "+":
            split = self._shift_parts(c)
            if split is not None:
                degenerate.append(sp.Eq(*split))
        # a max/min still at its neutral (nothing counted yet) stays there: the correction is a positive factor
        # (distributivity), and -inf * c = -inf, except where c underflows to 0 or is inf / inf (nan): an RMS norm's
        # abs-max before the first element, when the sum of squares jumps from 0 to inf in the first chunk
        # (an additive correction likewise: -inf + c is -inf, except where c is +inf: a max of x + exp(0.5 - r1)
        # whose first element takes the running min r1 from its neutral +inf to -1000)
        if f is not None and kind in ("*", "+") and f.op in ("max", "min"):
            degenerate.append(sp.Eq(self.syms[f.name]["old"], MONOIDS[f.op].neutral))
        if not degenerate:
            return regular
        identity = sp.Integer(1) if kind == "*" else sp.Integer(0)
        return sp.Piecewise((identity, sp.Or(*degenerate)), (regular, True))

    def _shift_parts(self, c: sp.Expr) -> tuple[sp.Expr, sp.Expr] | None:
        """(g(D_new), g(D_old)) of an additive correction c = g(D_new) - g(D_old) whose parts may overflow (not
        polynomial in the states): each term of c reads only new or only old states. None otherwise."""
        olds = {r["old"] for r in self.syms.values() if "old" in r}
        news = {r["new"] for r in self.syms.values() if "new" in r}
        new_part, old_part = sp.Integer(0), sp.Integer(0)
        for t in sp.Add.make_args(c):
            fs = t.free_symbols
            if fs & olds and not fs & news:
                old_part -= t
            elif fs & news and not fs & olds:
                new_part += t
            else:
                return None
        states = sorted(olds | news, key=str)
        if new_part == 0 or old_part == 0 or (new_part.is_polynomial(*states) and old_part.is_polynomial(*states)):
            return None
        return new_part, old_part

    def _passes(self, forms: tuple[ReductionForm, ...]) -> tuple[PassInfo, ...]:
        n = max([f.pass_no for f in forms] + [1])
        out = []
        for p in range(1, n + 1):
            out.append(
                PassInfo(
                    p,
                    tuple(f.name for f in forms if f.stage == "stream" and f.pass_no == p),
                    tuple(f.name for f in forms if f.stage == "epilogue" and f.pass_no == p),
                    self.pass_reasons.get(p, f"results of pass {p - 1} are needed"),
                )
            )
        return tuple(out)

    def _output(self, o: Any) -> OutputForm:
        ir = self.ir
        value = o.value
        per_element = bool(element_atoms(ir, value)) if isinstance(value, sp.Basic) else False
        # an empty row (every element masked) leaves the streamed states at their neutral elements
        scalar_states = [ir.states[n] for n in ir.states
                         if value.has(ir.states[n]) and self.stage.get(n) == "stream"]
        cond = None
        guarded = value
        if scalar_states:
            at_empty = {s: float(MONOIDS[ir.reduction(s.name).op].neutral) for s in scalar_states}
            # casts are value-preserving for this question (is the value defined at an empty row?)
            probe = strip_casts(value).xreplace({a: sp.Rational(37, 100) for a in element_atoms(ir, value)})
            v = _numeric_at(probe, at_empty)
            _, den = sp.fraction(sp.together(probe))
            divides_by_zero = bool(den.free_symbols & set(scalar_states)) and _numeric_at(den, at_empty) == 0
            if math.isnan(v) or divides_by_zero:
                if o.empty is None:
                    raise SpecError(
                        o.loc,
                        f"output '{o.name}' = {value} is undefined for an empty row "
                        f"({', '.join(f'{s} = {at_empty[s]}' for s in scalar_states)}): give 'empty:'",
                    )
                if den.free_symbols & set(scalar_states):
                    cond = sp.Eq(den, 0)
                else:
                    cond = sp.And(*[sp.Eq(s, MONOIDS[ir.reduction(s.name).op].neutral) for s in scalar_states])
                guarded = sp.Piecewise((o.empty, cond), (value, True))
        return OutputForm(o.name, guarded, value, cond, o.index, per_element)

    def _mask_value(self, forms: tuple[ReductionForm, ...], guards: tuple[Guard, ...]) -> dict[sp.Basic, sp.Expr]:
        """An element value (of an atom every streamed term reads) that makes every streamed term neutral:
        masked elements can take it, and elements that have it count as masked."""
        out: dict[sp.Basic, sp.Expr] = {}
        streamed = [f for f in forms if f.stage == "stream" and not f.selection]
        if not streamed:
            return out
        common = set(element_atoms(self.ir, streamed[0].term))
        for f in streamed[1:]:
            common &= set(element_atoms(self.ir, f.term))
        for atom in sorted(common, key=str):
            if atom == self.ir.indices[self.ir.over]:
                continue
            for cand in (sp.S.NegativeInfinity, sp.Integer(0), sp.oo):
                # neutral for every value of the states and row constants, not at one generic point
                ok = all(_neutral_at(f, atom, cand) for f in streamed)
                if ok:
                    out[atom] = cand
                    break
        return out


def analyze_ir(ir: CascadeIR) -> Analysis:
    return _Analyzer(ir).run()


def analyze(spec: OpSpec) -> OpAnalysis:
    """Analyse every specialisation of an op; raises FusionError/SpecError with a precise reason otherwise."""
    return OpAnalysis(spec, tuple(analyze_ir(build_ir(spec, s)) for s in specializations(spec)))


__all__ = [
    "Analysis",
    "Condition",
    "Guard",
    "OpAnalysis",
    "OutputForm",
    "PassInfo",
    "Payload",
    "ReductionForm",
    "analyze",
    "analyze_ir",
    "element_atoms",
    "is_bool",
]
