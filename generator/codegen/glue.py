"""Spec -> the op's C++ glue: schema, argument checks, output allocation, CPU and CUDA registration.

Everything comes from the one spec object: the schema string, the checks (their messages are the spec's), the
output shapes and dtypes. The CUDA launch code is written by the op's kernel template (templates/*), which gets
the same prepared `Args` the CPU kernel gets.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import sympy as sp

from ..errors import SpecError
from ..spec import OpSpec, ScalarArg, TensorArg, domain_bounds
from ..symbolic.expr import ExprParser, Scope, idiv
from ..symbolic.forms import OpAnalysis
from .cpp import CPP_RESERVED, CppPrinter
from .cpu import float_inputs, native_inputs

SCALAR_TYPES = {
    "float32": "ScalarType::Float",
    "float16": "ScalarType::Half",
    "bfloat16": "ScalarType::BFloat16",
    "float8_e4m3fn": "ScalarType::Float8_e4m3fn",
    "int32": "ScalarType::Int",
    "int64": "ScalarType::Long",
    "float64": "ScalarType::Double",
    "bool": "ScalarType::Bool",
}
SCHEMA_SCALARS = {"int": "int", "float": "float", "bool": "bool", "str": "str", "ScalarType": "ScalarType"}


# --------------------------------------------------------------------------------------------- names
# The identifiers the glue itself declares or calls unqualified in the functions whose parameters are the op's
# arguments (prepare, impl_cpu, impl_cuda) and in the struct that holds its outputs (Call): an argument or output of
# one of these names would not compile, or would be hidden where the glue reads it (tests/test_spec_validation.py
# checks that the CPU glue of every spec names nothing else unqualified)
GLUE_NAMES = frozenset([
    "A", "c", "kind", "on_cuda", "keep", "f", "Call", "Args", "Tensor", "ScalarType", "DeviceKind", "kOp",
    "kSchema", "rf", "std", "torch", "redfuser", "prepare", "impl_cpu", "impl_cuda", "run_cpu", "arg", "check",
    "failf", "dtype_name", "checked_out_dtype", "check_defined", "check_device_kind", "check_dtype", "check_ndim",
    "check_same_device", "check_same_dtype", "check_size", "check_value_domains"
])


def check_cpp_names(spec: OpSpec) -> None:
    """Every argument and output is a C++ identifier of the glue (a parameter, a member of Call): refuse, at its
    line in the spec, a name that C++ reserves or that the glue uses for something of its own. The op's own name
    names its C++ namespace."""
    if spec.name in CPP_RESERVED:
        raise SpecError(spec.loc, f"'{spec.name}' is a C++ keyword or type: the generated C++ puts the op in a "
                        "namespace of its name; rename it")
    for item in (*spec.args, *spec.outputs):
        if item.name in CPP_RESERVED:
            raise SpecError(item.loc, f"'{item.name}' is a C++ keyword or type: the generated C++ names each argument "
                            "and output by its name; rename it")
        if item.name in GLUE_NAMES:
            raise SpecError(item.loc, f"'{item.name}' is a name the generated C++ glue uses for its own (prepare, "
                            "impl_cpu, impl_cuda, Call); rename it")


# --------------------------------------------------------------------------------------------- schema
def _default_text(a: ScalarArg) -> str:
    v = a.default
    if v is None:
        return "None"
    if isinstance(v, bool):
        return "True" if v else "False"
    if a.type == "str":
        return f'"{v}"'
    if a.type == "float":
        return repr(float(v))
    if a.type == "ScalarType":
        return v
    return str(v)


def schema(spec: OpSpec) -> str:
    """The torch schema string: the single source of the op's signature."""
    parts = []
    for a in spec.args:
        if isinstance(a, TensorArg):
            parts.append(f"Tensor? {a.name}=None" if a.optional else f"Tensor {a.name}")
        else:
            ty = SCHEMA_SCALARS[a.type] + ("?" if a.optional else "")
            parts.append(f"{ty} {a.name}" + (f"={_default_text(a)}" if a.has_default else ""))
    outs = [f"Tensor {o.name}" for o in spec.outputs]
    ret = "Tensor" if len(outs) == 1 else "(" + ", ".join(outs) + ")"
    return f"{spec.name}({', '.join(parts)}) -> {ret}"


def cpp_param(a: TensorArg | ScalarArg) -> str:
    if isinstance(a, TensorArg):
        return f"std::optional<Tensor> {a.name}" if a.optional else f"Tensor {a.name}"
    base = {"int": "int64_t", "float": "double", "bool": "bool", "str": "std::string",
            "ScalarType": "ScalarType"}[a.type]
    return f"std::optional<{base}> {a.name}" if a.optional else f"{base} {a.name}"


def return_type(spec: OpSpec) -> str:
    if len(spec.outputs) == 1:
        return "Tensor"
    return "std::tuple<" + ", ".join("Tensor" for _ in spec.outputs) + ">"


# --------------------------------------------------------------------------------------------- shapes
@dataclass(frozen=True)
class AxisSource:
    axis: str
    tensor: str
    dim: int


def axis_sources(spec: OpSpec) -> dict[str, AxisSource]:
    """Where each axis size is read: its first appearance in a required tensor argument's shape."""
    out: dict[str, AxisSource] = {}
    for t in spec.tensors:
        if t.optional:
            continue
        for d, name in enumerate(t.shape):
            if name in {a.name for a in spec.axes} and name not in out:
                out[name] = AxisSource(name, t.name, d)
    for a in spec.axes:
        if a.name not in out:
            raise ValueError(f"{spec.file}: axis '{a.name}' appears in no required tensor argument")
    return out


def _scope(spec: OpSpec, an: OpAnalysis) -> Scope:
    ir = an.cases[0].ir
    flags = {a.name: (a.default if a.has_default else None) for a in spec.scalars if a.type in ("bool", "str")}
    return Scope(values={**ir.axes, **ir.scalars}, flags=flags)


def parse_size_expr(spec: OpSpec, an: OpAnalysis, text: str) -> sp.Expr:
    return ExprParser(_scope(spec, an), spec.loc).parse(text)


# --------------------------------------------------------------------------------------------- checks
def size_symbols(spec: OpSpec) -> dict[str, sp.Symbol]:
    """The names a check can use, as the glue sees them at run time: a size may be 0 (an empty tensor), so axes
    are only nonnegative (the engine's positive axes would fold `D >= 1` to true), int arguments any integer."""
    out = {a.name: sp.Symbol(a.name, integer=True, nonnegative=True) for a in spec.axes}
    for a in spec.scalars:
        if a.type == "int":
            out[a.name] = sp.Symbol(a.name, integer=True)
        elif a.type == "float":
            out[a.name] = sp.Symbol(a.name, real=True)
    return out


def _size_scope(spec: OpSpec) -> Scope:
    flags = {a.name: (a.default if a.has_default else None) for a in spec.scalars if a.type in ("bool", "str")}
    return Scope(values=dict(size_symbols(spec)), flags=flags)


@dataclass(frozen=True)
class SizeCheck:
    expr: sp.Basic  # over size_symbols(spec)
    message: str
    implicit: bool = False  # added by the generator: a divisor of a spec check must be >= 1 first


def divisors(expr: sp.Basic) -> list[sp.Expr]:
    """The expressions `expr` divides by or takes a modulus of, in a stable order."""
    out: list[sp.Expr] = []
    for node in sp.preorder_traversal(expr):
        den = None
        if isinstance(node, (sp.Mod, idiv)):
            den = node.args[1]
        elif isinstance(node, sp.Pow) and node.exp.is_number and node.exp < 0:
            den = node.base
        if den is not None and not (den.is_number and den >= 1) and den not in out:
            out.append(den)
    return out


def _proved_positive(expr: sp.Basic) -> set[sp.Expr]:
    """Expressions that a passed check proves >= 1 (`X >= 1`, `X > 0`, `1 <= X`, conjunctions of those)."""
    if isinstance(expr, sp.And):
        return set().union(*(_proved_positive(a) for a in expr.args))
    lo = {sp.GreaterThan: (0, 1, 1), sp.StrictGreaterThan: (0, 1, 0),
          sp.LessThan: (1, 0, 1), sp.StrictLessThan: (1, 0, 0)}.get(type(expr))
    if lo is None:
        return set()
    big, small, bound = expr.args[lo[0]], expr.args[lo[1]], lo[2]
    return {big} if small.is_number and small >= bound else set()


def ordered_checks(spec: OpSpec) -> list[SizeCheck]:
    """The spec's checks in an order where none divides by a size not yet checked >= 1.

    A check runs once the checks before it prove each of its divisors >= 1 (spec order otherwise); where no
    spec check proves it, an implicit `divisor >= 1` check naming the spec check comes first. A check that holds
    for every size (`D >= 0`) is dropped."""
    scope = _size_scope(spec)
    pending = []
    for ch in spec.checks:
        v = ExprParser(scope, ch.loc).parse(ch.expr)
        v = sp.true if v is True else sp.false if v is False else v
        if v is not sp.true:
            pending.append((ch, v))
    known: set[sp.Expr] = set()
    out: list[SizeCheck] = []
    while pending:
        ready = next((p for p in pending if all(d in known for d in divisors(p[1]))), None)
        if ready is None:
            ch, v = pending[0]
            den = next(d for d in divisors(v) if d not in known)
            out.append(SizeCheck(sp.Ge(den, 1), f"{_text(den)} must be at least 1 ({ch.expr} divides by it)", True))
            known.add(den)
            continue
        pending.remove(ready)
        out.append(SizeCheck(ready[1], ready[0].message))
        known |= _proved_positive(ready[1])
    return out


def _text(e: sp.Basic) -> str:
    return str(e).replace("idiv(", "floordiv(")


@dataclass(frozen=True)
class ValueDomain:
    """An integer tensor's declared value domain `[lo, hi)` or `[lo, hi]` (spec key `values`)."""

    tensor: str
    lo: sp.Expr
    hi: sp.Expr
    hi_closed: bool
    text: str


def value_domains(spec: OpSpec) -> list[ValueDomain]:
    out = []
    scope = _size_scope(spec)
    for t in spec.tensors:
        if not t.values:
            continue
        lo_text, hi_text, closed = domain_bounds(t.values)  # (its form checked where the spec was read)
        lo = ExprParser(scope, t.loc).parse(lo_text)
        hi = ExprParser(scope, t.loc).parse(hi_text)
        out.append(ValueDomain(t.name, sp.sympify(lo), sp.sympify(hi), closed, t.values.strip()))
    return out


# --------------------------------------------------------------------------------------------- C++
class _Glue:
    def __init__(self, spec: OpSpec, an: OpAnalysis):
        self.spec = spec
        self.an = an
        ir = an.cases[0].ir
        self.ir = ir

        def resolve(e: sp.Basic) -> str | None:
            if isinstance(e, sp.Symbol):
                if e.name in ir.axes and ir.axes[e.name] == e:
                    return f"A.sz_{e.name}"
                if e.name in ir.scalars and ir.scalars[e.name] == e:
                    return f"A.p_{e.name}"
            return None

        self.pr = CppPrinter(resolve)
        self.sizes = size_symbols(spec)
        self.spr = CppPrinter(lambda e: self.size_name(e.name)
                              if isinstance(e, sp.Symbol) and self.sizes.get(e.name) == e else None)
        self.sources = axis_sources(spec)

    def size_name(self, name: str) -> str:
        """C++ of a size or int/float argument in the prepared Args."""
        return f"A.sz_{name}" if name in self.ir.axes else f"A.p_{name}"

    def dim_expr(self, dim: str) -> str:
        if dim.isdigit():
            return f"int64_t({dim})"
        if dim in self.ir.axes:
            return f"A.sz_{dim}"
        return f"A.p_{dim}"

    def prepare(self, cuda_dtypes: tuple[str, ...]) -> list[str]:
        spec, ir = self.spec, self.ir
        L = []
        params = ", ".join("const " + cpp_param(a).replace(f" {a.name}", f"& {a.name}") for a in spec.args)
        L.append(f"Call prepare({params}, DeviceKind kind) {{")
        L.append("  Call c;")
        L.append("  Args& A = c.A;")
        L.append("  const bool on_cuda = kind == DeviceKind::CUDA;")
        L.append("  (void)on_cuda;")
        first = spec.tensors[0].name
        for t in spec.tensors:
            body = []
            body.append(f"check_device_kind(kOp, \"{t.name}\", {{T}}, kind);")
            body.append(f"check_ndim(kOp, \"{t.name}\", {{T}}, {len(t.shape)}, \"({', '.join(t.shape)})\");")
            if t.same_as:
                body.append(f"check_same_dtype(kOp, \"{t.name}\", {{T}}, \"{t.same_as}\", {t.same_as});")
            elif t.name == first:
                cpu = ", ".join(SCALAR_TYPES[d] for d in spec.variants.cpu_dtypes)
                cud = ", ".join(SCALAR_TYPES[d] for d in cuda_dtypes) or cpu
                body.append(f"if (on_cuda) check_dtype(kOp, \"{t.name}\", {{T}}, {{{cud}}}); "
                            f"else check_dtype(kOp, \"{t.name}\", {{T}}, {{{cpu}}});")
            else:
                allowed = ", ".join(SCALAR_TYPES[d] for d in t.dtypes)
                body.append(f"check_dtype(kOp, \"{t.name}\", {{T}}, {{{allowed}}});")
            if t.optional:  # read as (*t): a local name for it could hide an argument the checks name (dtype: x)
                L.append(f"  if ({t.name}.has_value() && {t.name}->defined()) {{")
                L += ["    " + b.replace("{T}", f"(*{t.name})") for b in body]
                L.append("  }")
                L.append(f"  A.has_{t.name} = {t.name}.has_value() && {t.name}->defined();")
            else:
                L.append(f"  check_defined(kOp, \"{t.name}\", {t.name});")
                L += ["  " + b.replace("{T}", t.name) for b in body]
        L.append("  check_same_device(kOp, {" + ", ".join(f"arg(\"{t.name}\", {t.name})" for t in spec.tensors) + "});")
        # axis sizes, then every other dim must agree
        for name, src in self.sources.items():
            L.append(f"  A.sz_{name} = {src.tensor}.size({src.dim});")
        for a in spec.scalars:
            if a.type == "int":
                L.append(f"  A.p_{a.name} = {a.name};")
        for t in spec.tensors:
            ref = t.name if not t.optional else f"(*{t.name})"
            checks = []
            for d, dim in enumerate(t.shape):
                src = self.sources.get(dim)
                if src is not None and (src.tensor, src.dim) == (t.name, d):
                    continue
                what = f"{src.tensor}.size({src.dim}) ({dim})" if src else dim
                checks.append(f"check_size(kOp, \"{t.name}\", {ref}, {d}, {self.dim_expr(dim)}, \"{what}\");")
            if not checks:
                continue
            if t.optional:
                L.append(f"  if (A.has_{t.name}) {{")
                L += ["    " + x for x in checks]
                L.append("  }")
            else:
                L += ["  " + x for x in checks]
        # scalar arguments
        for a in spec.scalars:
            if a.type == "float":
                if a.optional:
                    fallback = self.pr.flt(parse_size_expr(spec, self.an, a.when_null)) if a.when_null else "0.0"
                    L.append(f"  A.p_{a.name} = {a.name}.has_value() ? *{a.name} : static_cast<double>({fallback});")
                else:
                    L.append(f"  A.p_{a.name} = {a.name};")
            elif a.type == "bool":
                L.append(f"  A.f_{a.name} = {a.name};")
            elif a.type == "str":
                choices = " else ".join(f"if ({a.name} == \"{ch}\") A.f_{a.name} = {n};"
                                        for n, ch in enumerate(a.choices))
                L.append(f"  {choices} else failf(kOp, \"{a.name} must be one of "
                         f"{', '.join(repr(c) for c in a.choices)}, got '\", {a.name}, \"'\");")
        # the spec's checks (sizes may be 0: nothing is assumed positive), each after the checks that make its
        # divisors >= 1, with the values of the names they use, in spec order (renaming keeps it)
        order = [x.name for x in spec.axes] + [x.name for x in spec.args]
        for chk in ordered_checks(spec):
            names = sorted({s.name for s in chk.expr.free_symbols}, key=order.index)
            values = ", \", \", ".join(f"\"{n} = \", {self.size_name(n)}" for n in names)
            L.append(f"  check({self.spr(chk.expr)}, kOp, \"{chk.message} (\", {values}, \")\");")
        # pointers and strides of inputs
        for t in spec.tensors:
            ref = t.name if not t.optional else f"(*{t.name})"
            lines = [f"A.t_{t.name} = {ref}.const_data_ptr();",
                     f"A.dt_{t.name} = {ref}.scalar_type();"]
            lines += [f"A.st_{t.name}[{d}] = {ref}.stride({d});" for d in range(len(t.shape))]
            if t.optional:
                L.append(f"  if (A.has_{t.name}) {{")
                L += ["    " + x for x in lines]
                L.append("  }")
            else:
                L += ["  " + x for x in lines]
        # outputs
        for o in spec.outputs:
            dims = ", ".join(self.dim_expr(d) for d in o.shape)
            L.append(f"  for (int64_t s : std::initializer_list<int64_t>{{{dims}}}) "
                     f"check(s >= 0, kOp, \"output {o.name} would have a negative size\");")
            L.append(f"  c.{o.name} = torch::stable::new_empty({first}, {{{dims}}}, {self.out_dtype(o.dtype)});")
            L.append(f"  A.o_{o.name} = c.{o.name}.mutable_data_ptr();")
            L.append(f"  A.odt_{o.name} = c.{o.name}.scalar_type();")
            for d in range(len(o.shape)):
                L.append(f"  A.ost_{o.name}[{d}] = c.{o.name}.stride({d});")
        rows = " * ".join(f"({self.pr(ir.extents[r])})" for r in ir.rows)
        L.append(f"  A.rows = {rows};")
        L.append("  return c;")
        L.append("}")
        return L

    def domain_check(self) -> list[str]:
        """check_value_domains(A, tensors...): every entry of an index tensor that the cascade uses as an index or a
        length lies in the tensor's declared domain, or an error names the argument, the entry and the bound.

        Used entries, per specialisation: a read outside the element lets (a length in the mask, a row value)
        uses every entry its indices reach; a read in an element let (a gather along the reduced axis) uses
        only the entries of the keys that the mask keeps, so unused entries may hold anything. The reads of the
        mask are checked first, since the mask is evaluated to find the used entries of the others."""
        doms = {d.tensor: d for d in value_domains(self.spec)}
        if not doms:
            return []
        spec = self.spec
        for name in doms:
            if spec.arg(name).optional:
                raise ValueError(f"{spec.file}: {name}: a value domain on an optional tensor is not supported")
        params = ", ".join(f"const Tensor& {n}" for n in doms)
        L = [f"[[maybe_unused]] void check_value_domains(const Args& A, {params}) {{",
             *[f"  const IndexView v_{n} = index_view(kOp, \"{n}\", {n});" for n in doms]]
        for k, a in enumerate(self.an.cases):
            cond = " && ".join(self._case_cond(n, v) for n, v in a.ir.specialization) or "true"
            L.append(f"  {'if' if k == 0 else 'else if'} ({cond}) {{")
            L += ["    " + x for x in self._case_domain_checks(a.ir, doms)]
            L.append("  }")
        L.append("}")
        return L

    def _case_cond(self, name: str, value) -> str:
        a = self.spec.arg(name)
        if isinstance(a, TensorArg):
            return f"{'' if value == 'present' else '!'}A.has_{name}"
        if a.type == "bool":
            return f"A.f_{name} == {'true' if value else 'false'}"
        return f"A.f_{name} == {a.choices.index(value)}"

    def _case_domain_checks(self, ir, doms: dict[str, ValueDomain]) -> list[str]:
        over = ir.indices[ir.over]
        mask = ir.mask if ir.mask not in (True, None) else sp.true
        elem = {x.name for x in ir.element_lets}

        def reads(e) -> list[sp.Indexed]:
            if not isinstance(e, sp.Basic):
                return []
            return sorted((x for x in e.atoms(sp.Indexed) if str(x.base.label) in doms), key=str)

        pr: CppPrinter

        def resolve(e: sp.Basic) -> str | None:
            if isinstance(e, sp.Symbol):
                if ir.indices.get(e.name) == e:
                    return f"ix_{e.name}"
                if e.name in ir.axes or e.name in self.sizes:
                    return self.size_name(e.name)
                return None
            if isinstance(e, sp.Indexed):
                label = str(e.base.label)
                if label not in doms:
                    raise ValueError(f"{self.spec.file}: the mask reads {label}, which has no value domain")
                return f"v_{label}({{{', '.join(pr(i) for i in e.indices)}}})"
            return None

        pr = CppPrinter(resolve)
        # only reads whose value is used as an index (inside another read's indices, directly or through a let)
        # or as a length (in the mask) must lie in the domain; a value only compared (a class target that may
        # hold an ignore_index) reads no memory through it
        lets = {x.symbol: x for x in ir.lets}
        exprs = [x.expr for x in ir.lets] + [r.body for r in ir.reductions] + [o.value for o in ir.outputs]
        used = set(reads(mask))
        for e in exprs + [mask]:
            if not isinstance(e, sp.Basic):
                continue
            for ix in e.atoms(sp.Indexed):
                for i in ix.indices:
                    used |= set(reads(i))
                    for sym in i.free_symbols:
                        if sym in lets:
                            used |= set(reads(lets[sym].expr))
        first = reads(mask)
        for let in ir.lets:
            if let.name not in elem:
                first += reads(let.expr)
        later = [x for let in ir.lets if let.name in elem for x in reads(let.expr)]
        for r in ir.reductions:
            later += reads(r.body)
        first = [x for x in first if x in used]
        later = [x for x in later if x in used]
        out, seen = [], set()
        for phase, items in ((0, first), (1, later)):
            for x in items:
                gathered = phase == 1 and x.has(over)
                key = (str(x), gathered)
                if key in seen:
                    continue
                seen.add(key)
                syms = set().union(*(i.free_symbols for i in x.indices))
                if gathered:
                    syms |= mask.free_symbols if isinstance(mask, sp.Basic) else set()
                loop = [n for n, s in ir.indices.items() if s in syms]
                d = doms[str(x.base.label)]
                lo, hi = pr(d.lo.xreplace(self._ir_sizes(ir))), pr(d.hi.xreplace(self._ir_sizes(ir)))
                body = [f"const int64_t v = {pr(x)};",
                        (f"if (v < {lo} || v {'>' if d.hi_closed else '>='} {hi}) "
                         f"domain_error(kOp, \"{d.tensor}\", {{{', '.join(pr(i) for i in x.indices)}}}, v, "
                         f"\"{d.text}\", {lo}, {hi});")]
                if gathered and mask is not sp.true:
                    body.insert(0, f"if (!{pr(mask)}) continue;")
                ind = ""
                lines = []
                for n in loop:
                    lines.append(f"{ind}for (int64_t ix_{n} = 0; ix_{n} < {pr(ir.extents[n])}; ++ix_{n}) {{")
                    ind += "  "
                lines += [ind + b for b in body] if loop else ["{"] + ["  " + b for b in body]
                lines += ["}"] if not loop else ["  " * (len(loop) - 1 - i) + "}" for i in range(len(loop))]
                out += lines
        return out

    def _ir_sizes(self, ir) -> dict:
        return {s: (ir.axes.get(n) or ir.scalars.get(n)) for n, s in self.sizes.items()
                if (ir.axes.get(n) or ir.scalars.get(n)) is not None}

    def out_dtype(self, dtype: str) -> str:
        spec = self.spec
        if dtype in SCALAR_TYPES:
            return SCALAR_TYPES[dtype]
        if dtype in {t.name for t in spec.tensors}:
            return f"{dtype}.scalar_type()"
        if " or " in dtype:
            param, tensor = [x.strip() for x in dtype.split(" or ")]
            return f"checked_out_dtype({param}, {tensor}.scalar_type())"
        raise ValueError(f"{spec.file}: output dtype '{dtype}' is not understood")


def glue_source(spec: OpSpec, an: OpAnalysis, header_name: str, cuda: CudaGlue | None,
                version: str) -> str:
    check_cpp_names(spec)
    g = _Glue(spec, an)
    cuda_dtypes = spec.variants.cuda.dtypes if (cuda is not None and spec.variants.cuda) else ()
    names = ", ".join(a.name for a in spec.args)
    sig = ", ".join(cpp_param(a) for a in spec.args)
    outs = ", ".join(f"c.{o.name}" for o in spec.outputs)
    ret = f"return {{{outs}}};" if len(spec.outputs) > 1 else f"return c.{spec.outputs[0].name};"
    doms = [d.tensor for d in value_domains(spec)]
    native = native_inputs(an)
    L = [
        f"// Generated by redfuser-ops generator {version} from {spec.file}; do not edit.",
        f"// Op glue for {spec.name}: schema, checks, outputs, CPU and CUDA registration.",
        f"#include \"{header_name}\"",
        "",
        "#include <cstdint>",
        "#include <initializer_list>",
        "#include <limits>",
        "#include <optional>",
        "#include <string>",
        "#include <tuple>",
        "#include <vector>",
        "",
        "#include <torch/csrc/stable/library.h>",
        "#include <torch/csrc/stable/ops.h>",
        "",
        "#include \"cpu_math.h\"",
        "#include \"runtime.h\"",
        "",
    ]
    if cuda is not None:
        L += cuda.declarations
        L.append("")
    L += [
        f"namespace redfuser::gen::{spec.name} {{",
        "namespace {",
        "namespace rf = redfuser::cpu;",
        f"constexpr std::string_view kOp = \"{spec.name}\";",
        f"constexpr const char* kSchema = {json.dumps(schema(spec))};",
        "",
        "struct Call {",
        "  Args A;",
        *[f"  Tensor {o.name};" for o in spec.outputs],
        "};",
        "",
        "[[maybe_unused]] ScalarType checked_out_dtype(const std::optional<ScalarType>& want, ScalarType fallback) {",
        "  const ScalarType t = want.has_value() ? *want : fallback;",
        "  check(t == ScalarType::Float || t == ScalarType::Half || t == ScalarType::BFloat16, kOp,",
        "        \"out_dtype must be float32, float16 or bfloat16, got \", dtype_name(t));",
        "  return t;",
        "}",
        "",
        *g.prepare(cuda_dtypes),
        "",
        *g.domain_check(),
        "",
        f"{return_type(spec)} impl_cpu({sig}) {{",
        f"  Call c = prepare({names}, DeviceKind::CPU);",
        *([f"  check_value_domains(c.A, {', '.join(doms)});"] if doms else []),
        "  // floating inputs reach the CPU kernels as float32 with a unit last-dimension stride (so that the",
        "  // kernels' inner loops vectorise): other ones are converted (copied) once here; the streamed operands",
        "  // of the block kernels and their contractions' row factors keep their dtype (widened per packed tile or",
        "  // row in the kernel), only made unit-stride",
        "  std::vector<Tensor> keep;",
        *[line for name in float_inputs(spec) for line in _as_float(spec, name, name in native)],
        "  run_cpu(c.A);",
        f"  {ret}",
        "}",
        "",
    ]
    if cuda is not None:
        L += [
            f"{return_type(spec)} impl_cuda({sig}) {{",
            f"  Call c = prepare({names}, DeviceKind::CUDA);",
            # checking values on CUDA reads device memory (a host sync): only when the user asked for it
            *([(f"  if (redfuser::check_inputs_enabled()) check_value_domains(c.A, "
                f"{', '.join(f'host_copy({d})' for d in doms)});")] if doms else []),
            *["  " + x for x in cuda.body],
            f"  {ret}",
            "}",
            "",
        ]
    L += [
        "}  // namespace",
        "",
        "STABLE_TORCH_LIBRARY_FRAGMENT(redfuser, m) { m.def(kSchema); }",
        f"STABLE_TORCH_LIBRARY_IMPL(redfuser, CPU, m) {{ m.impl(\"{spec.name}\", TORCH_BOX(&impl_cpu)); }}",
    ]
    if cuda is not None:
        L.append(f"STABLE_TORCH_LIBRARY_IMPL(redfuser, CUDA, m) {{ m.impl(\"{spec.name}\", TORCH_BOX(&impl_cuda)); }}")
    variants = [f"{{\"{spec.name}__cpu\", \"cpu\", \"\"}}"]
    if cuda is not None:
        variants += [f"{{\"{v}\", \"cuda\", \"{fam}\"}}" for v, fam in cuda.variants]
    L += [
        "",
        f"const BuildInfoEntry kInfo(\"{spec.name}\", kSchema, {{{', '.join(variants)}}});",
        "",
        f"}}  // namespace redfuser::gen::{spec.name}",
        "",
    ]
    return "\n".join(L)


def _as_float(spec: OpSpec, name: str, native: bool = False) -> list[str]:
    arg = spec.arg(name)
    cond = f"c.A.has_{name} && " if arg.optional else ""
    ref = f"(*{name})" if arg.optional else name
    last = len(arg.shape) - 1
    to = f"c.A.dt_{name}" if native else "ScalarType::Float"
    convert = "" if native else f"c.A.dt_{name} != ScalarType::Float || "
    return [
        f"  if ({cond}({convert}({ref}.size({last}) > 1 && c.A.st_{name}[{last}] != 1))) {{",
        f"    Tensor f = torch::stable::new_empty({ref}, {ref}.sizes(), {to});",
        f"    torch::stable::copy_(f, {ref});",
        f"    c.A.t_{name} = f.const_data_ptr();",
        f"    for (int d = 0; d < {len(arg.shape)}; ++d) c.A.st_{name}[d] = f.stride(d);",
        f"    c.A.dt_{name} = {to};",
        "    keep.push_back(f);",
        "  }",
    ]


@dataclass(frozen=True)
class CudaGlue:
    """What a kernel template contributes to the glue: extern launcher declarations, the body of impl_cuda
    (it finds the prepared `Call c` with `c.A` and must launch the right variant), and the variant list."""

    declarations: list[str]
    body: list[str]
    variants: list[tuple[str, str]]  # (variant name, family)
