"""Human-readable derivations: what `python -m generator explain SPEC` prints."""

from __future__ import annotations

import sympy as sp
from sympy.printing.str import StrPrinter

from .symbolic.algebra import MONOIDS
from .symbolic.expr import Cast, entrysum, idiv, isin
from .symbolic.forms import Analysis, OpAnalysis, ReductionForm


class _Printer(StrPrinter):
    """sympy's str printer with positive terms first (m_old - m_new), -oo as -inf, casts and helpers by name."""

    def _print_Add(self, expr, order=None):
        terms = list(expr.args)
        pos = [t for t in terms if not t.could_extract_minus_sign()]
        neg = [t for t in terms if t.could_extract_minus_sign()]
        out = " + ".join(self._print(t) for t in pos) if pos else ""
        for t in neg:
            s = self.parenthesize(-t, 40)
            out = f"{out} - {s}" if out else f"-{s}"
        return out

    def _print_NegativeInfinity(self, expr):
        return "-inf"

    def _print_Infinity(self, expr):
        return "inf"

    def _print_Piecewise(self, expr):
        parts = []
        for value, cond in expr.args[:-1]:
            parts.append(f"{self._print(value)} if {self._print(cond)} else")
        parts.append(self._print(expr.args[-1][0]))
        return "(" + " ".join(parts) + ")"

    def _print_Equality(self, expr):
        return f"{self._print(expr.lhs)} == {self._print(expr.rhs)}"

    def _print_Unequality(self, expr):
        return f"{self._print(expr.lhs)} != {self._print(expr.rhs)}"

    def _print_Function(self, expr):
        if isinstance(expr, Cast):
            return f"{expr.dtype.replace('float8_e4m3fn', 'e4m3')}({self._print(expr.args[0])})"
        if isinstance(expr, idiv):
            a, b = (self._print(x) if (x.is_Atom or isinstance(x, sp.Indexed)) else f"({self._print(x)})"
                    for x in expr.args)
            return f"({a} // {b})"
        if isinstance(expr, entrysum):
            return f"sum({self._print(expr.args[0])})"
        if isinstance(expr, isin):
            return f"isin({self._print(expr.args[0])}, {self._print(expr.args[1])})"
        return super()._print_Function(expr)

    def _print_Sum(self, expr):
        c = expr.limits[0][0]
        return f"sum_{c}({self._print(expr.function)})"

    def _print_Abs(self, expr):
        return f"abs({self._print(expr.args[0])})"

    def _print_Max(self, expr):
        return "max(" + ", ".join(self._print(a) for a in expr.args) + ")"

    def _print_Min(self, expr):
        return "min(" + ", ".join(self._print(a) for a in expr.args) + ")"

    def _print_Float(self, expr):
        v = float(expr)
        return repr(int(v)) if v == int(v) and abs(v) < 1e15 else f"{v:g}"


def show(expr: object) -> str:
    if isinstance(expr, bool):
        return str(expr).lower()
    return _Printer({"order": "none"}).doprint(expr)


def _rename(expr: sp.Expr, a: Analysis, f: ReductionForm, target: str) -> sp.Expr:
    """Show old/new symbols as segment/merged ones (target == 'merge')."""
    if target != "merge":
        return expr
    sub = {}
    for d in f.online_deps:
        sub[a.sym(d, "old")] = a.sym(d, "seg")
        sub[a.sym(d, "old_safe")] = sp.Symbol(f"{d}_p_safe")
        sub[a.sym(d, "new")] = a.ir.states[d]
        sub[a.sym(d, "new_safe")] = sp.Symbol(f"{d}_safe")
    return expr.xreplace(sub)


def _over(a: Analysis, f: ReductionForm) -> str:
    ir = a.ir
    over = ir.over if f.stage == "stream" else ir.reduction(f.name).over
    return over


def _state(f: ReductionForm) -> str:
    return f.name + (f"[{', '.join(f.free)}]" if f.free else "")


def _reduction_line(a: Analysis, f: ReductionForm) -> str:
    op = f.op if f.op != "topk" else f"top[{show(f.k)}]"
    where = "" if f.where in (sp.true, True) else f" where {show(f.where)}"
    carry = f" carrying {', '.join(p.name for p in f.payloads)}" if f.payloads else ""
    return f"{_state(f)} = {op}_{_over(a, f)} {show(f.body)}{where}{carry}"


def _update(a: Analysis, f: ReductionForm, target: str) -> list[str]:
    """The online update (target 'online') or merge (target 'merge') of one reduction."""
    idx = a.ir.over
    lines = []
    neutral = show(MONOIDS[f.op].neutral)
    if target == "online":
        chunk = f"{f.op}_{{{idx} in chunk}} {show(f.term)}"
        if f.selection:
            chunk = f"top[{show(f.k)}]_{{{idx} in chunk}} {show(f.term)}"
        if f.kind == "none":
            if f.selection:
                rhs = f"top[{show(f.k)}]({f.name}_old U {chunk})"
            elif f.op == "sum":
                rhs = f"{f.name}_old + {chunk}"
            else:
                rhs = f"{f.op}({f.name}_old, {chunk})"
        else:
            c = show(f.correction)
            corrected = f"{f.name}_old {f.kind} {c}"
            if f.op == "sum":
                rhs = f"{corrected} + {chunk}"
            elif f.selection:
                rhs = f"top[{show(f.k)}](({corrected}) U {chunk})"
            else:
                rhs = f"{f.op}({corrected}, {chunk})"
        lines.append(f"{_state(f)}_new = {rhs}    [init {neutral}]")
        for p in f.payloads:
            if p.kind != "none":
                lines.append(f"    payload {p.name}: old entries {p.kind} {show(p.correction)}, new entries {show(p.term)}")
            else:
                lines.append(f"    payload {p.name}: new entries {show(p.term)}")
    else:
        c = show(_rename(f.correction, a, f, "merge"))
        part = f"{f.name}_p" if f.kind == "none" else f"{f.name}_p {f.kind} {c}"
        if f.selection:
            lines.append(f"{_state(f)} = top[{show(f.k)}](U_p {part})")
        elif f.op == "sum":
            lines.append(f"{_state(f)} = sum_p {part}")
        else:
            lines.append(f"{_state(f)} = {f.op}_p {part}")
    return lines


def explain_case(a: Analysis) -> str:
    ir = a.ir
    out = [f"specialisation: {ir.label}"]
    rows = ", ".join(ir.rows)
    out.append(f"  cascade over {ir.over} in [0, {show(ir.extents[ir.over])}) for each row ({rows})")
    if ir.mask not in (sp.true, True):
        out.append(f"  mask: {show(ir.mask)}")
    for let in ir.lets:
        out.append(f"  let {let.name} = {show(let.expr)}    [{let.kind}]")
    out.append("  reductions:")
    for f in a.reductions:
        out.append(f"    {_reduction_line(a, f)}")
        for c in f.conditions:
            mark = "yes" if c.holds else "NO"
            out.append(f"        {c.name}: {mark}: {c.detail}")
    out.append(f"  passes: {len(a.passes)}")
    for p in a.passes:
        streamed = ", ".join(p.reductions) or "-"
        epi = f"; then resident: {', '.join(p.epilogues)}" if p.epilogues else ""
        out.append(f"    pass {p.number}: stream {streamed}{epi}    ({p.reason})")
    out.append("  fused form (one pass with the final states):")
    for f in a.reductions:
        if f.stage != "stream":
            continue
        if f.kind == "none":
            out.append(f"    {_state(f)} = {f.op}_{ir.over} {show(f.body)}")
        else:
            op = f.op if not f.selection else f"top[{show(f.k)}]"
            out.append(f"    {_state(f)} = ({op}_{ir.over} {show(f.G)}) {f.kind} {show(f.H)}")
    if a.guards:
        out.append("  guards (H is not finite or is zero there; such a prefix contributed only neutral elements):")
        for g in a.guards:
            pts = ", ".join(f"{show(p)} -> {show(s)}" for p, s in g.points)
            out.append(f"    {g.state}_safe = {show(g.apply(ir.states[g.state]))}    [{pts}; {g.reason}]")
    for p in a.passes:
        out.append(f"  online form, pass {p.number} (per chunk; states of this pass updated in order):")
        for f in a.reductions:
            if f.stage == "stream" and f.pass_no == p.number:
                out += [f"    {line}" for line in _update(a, f, "online")]
        if p.epilogues:
            for name in p.epilogues:
                out.append(f"    then {_reduction_line(a, a.form(name))}")
        out.append(f"  merge form, pass {p.number} (segments p, states merged in order):")
        for f in a.reductions:
            if f.stage == "stream" and f.pass_no == p.number:
                out += [f"    {line}" for line in _update(a, f, "merge")]
    if a.mask_value:
        vals = ", ".join(f"{show(k)} = {show(v)}" for k, v in a.mask_value.items())
        out.append(f"  masked elements: {vals} makes every streamed term neutral")
    out.append("  finalize:")
    for o in a.outputs:
        per = "    [per element: one more read of the row]" if o.per_element else ""
        out.append(f"    {o.name}[{', '.join(o.index)}] = {show(o.value)}{per}")
    for ap in a.approximations:
        out.append(f"  note: {ap}")
    return "\n".join(out)


def explain(op: OpAnalysis) -> str:
    spec = op.spec
    head = [f"op {spec.name}  ({spec.file})"]
    if spec.summary:
        head.append(f"  {spec.summary}")
    return "\n\n".join(["\n".join(head)] + [explain_case(a) for a in op.cases]) + "\n"
