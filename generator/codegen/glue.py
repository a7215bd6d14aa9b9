"""Spec -> the op's C++ glue: schema, argument checks, output allocation, CPU and CUDA registration.

Everything comes from the one spec object: the schema string, the checks (their messages are the spec's), the
output shapes and dtypes. The CUDA launch code is written by the op's kernel template (templates/*), which gets
the same prepared `Args` the CPU kernel gets.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import sympy as sp

from ..spec import OpSpec, ScalarArg, TensorArg
from ..symbolic.expr import ExprParser, Scope
from ..symbolic.forms import OpAnalysis
from .cpp import CppPrinter
from .cpu import float_inputs

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
        self.sources = axis_sources(spec)

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
            if t.optional:
                L.append(f"  if_present({t.name}, [&](const Tensor& x) {{")
                L += ["    " + b.replace("{T}", "x") for b in body]
                L.append("  });")
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
        # the spec's checks, with the values of the names they use
        for ch, expr in zip(spec.checks, ir.checks):
            if expr is sp.true:  # holds for every size (e.g. D >= 1 for a positive axis)
                continue
            order = [x.name for x in spec.axes] + [x.name for x in spec.args]  # spec order: renaming keeps it
            names = sorted({s.name for s in expr.free_symbols}, key=order.index)
            values = ", \", \", ".join(f"\"{n} = \", {self.pr(ir.axes.get(n, ir.scalars.get(n)))}" for n in names)
            L.append(f"  check({self.pr(expr)}, kOp, \"{ch.message} (\", {values}, \")\");")
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
    g = _Glue(spec, an)
    cuda_dtypes = spec.variants.cuda.dtypes if (cuda is not None and spec.variants.cuda) else ()
    names = ", ".join(a.name for a in spec.args)
    sig = ", ".join(cpp_param(a) for a in spec.args)
    outs = ", ".join(f"c.{o.name}" for o in spec.outputs)
    ret = f"return {{{outs}}};" if len(spec.outputs) > 1 else f"return c.{spec.outputs[0].name};"
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
        f"{return_type(spec)} impl_cpu({sig}) {{",
        f"  Call c = prepare({names}, DeviceKind::CPU);",
        "  // floating inputs reach the CPU kernels as float32 with a unit last-dimension stride (so that the",
        "  // kernels' inner loops vectorise): other ones are converted (copied) once here",
        "  std::vector<Tensor> keep;",
        *[line for name in float_inputs(spec) for line in _as_float(spec, name)],
        "  run_cpu(c.A);",
        f"  {ret}",
        "}",
        "",
    ]
    if cuda is not None:
        L += [
            f"{return_type(spec)} impl_cuda({sig}) {{",
            f"  Call c = prepare({names}, DeviceKind::CUDA);",
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


def _as_float(spec: OpSpec, name: str) -> list[str]:
    arg = spec.arg(name)
    cond = f"c.A.has_{name} && " if arg.optional else ""
    ref = f"(*{name})" if arg.optional else name
    last = len(arg.shape) - 1
    return [
        f"  if ({cond}(c.A.dt_{name} != ScalarType::Float || ({ref}.size({last}) > 1 && c.A.st_{name}[{last}] != 1))) {{",
        f"    Tensor f = torch::stable::new_empty({ref}, {ref}.sizes(), ScalarType::Float);",
        f"    torch::stable::copy_(f, {ref});",
        f"    c.A.t_{name} = f.const_data_ptr();",
        f"    for (int d = 0; d < {len(arg.shape)}; ++d) c.A.st_{name}[d] = f.stride(d);",
        f"    c.A.dt_{name} = ScalarType::Float;",
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
