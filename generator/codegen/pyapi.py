"""Spec -> the op's Python module: the fake (meta) implementation for torch.compile and a typed wrapper.

The fake checks the same preconditions as the C++ glue (same spec, same messages) with torch._check, so that
shape errors surface while tracing, and returns outputs of the right shape, dtype and device.
"""

from __future__ import annotations

import sympy as sp

from ..errors import SpecError
from ..explain import _Printer
from ..spec import OpSpec, ScalarArg, TensorArg
from ..symbolic.forms import OpAnalysis
from .glue import _default_text, axis_sources, ordered_checks, schema

PY_TYPES = {"int": "int", "float": "float", "bool": "bool", "str": "str", "ScalarType": "torch.dtype"}
TORCH_DTYPES = {
    "float32": "torch.float32",
    "float16": "torch.float16",
    "bfloat16": "torch.bfloat16",
    "float8_e4m3fn": "torch.float8_e4m3fn",
    "int32": "torch.int32",
    "int64": "torch.int64",
    "float64": "torch.float64",
    "bool": "torch.bool",
}


class _PyPrinter(_Printer):
    """Python text for size/check expressions; names are local variables of the fake."""

    def _print_Symbol(self, expr):
        return expr.name

    def _print_Mod(self, expr):
        return f"({self._print(expr.args[0])} % {self._print(expr.args[1])})"

    def _print_And(self, expr):
        return "(" + " and ".join(self._print(a) for a in expr.args) + ")"

    def _print_Or(self, expr):
        return "(" + " or ".join(self._print(a) for a in expr.args) + ")"

    def _print_Relational(self, expr):
        return f"({self._print(expr.lhs)} {expr.rel_op} {self._print(expr.rhs)})"

    _print_StrictLessThan = _print_Relational
    _print_LessThan = _print_Relational
    _print_StrictGreaterThan = _print_Relational
    _print_GreaterThan = _print_Relational


def py(expr: sp.Basic) -> str:
    return _PyPrinter({"order": "none"}).doprint(expr)


def _py_default(a: ScalarArg) -> str:
    if a.default is None:
        return "None"
    if a.type == "ScalarType":
        return TORCH_DTYPES[a.default]
    text = _default_text(a)
    return text.replace('"', "'") if a.type == "str" else text


def _signature(spec: OpSpec) -> str:
    parts = []
    for a in spec.args:
        if isinstance(a, TensorArg):
            parts.append(f"{a.name}: Tensor | None = None" if a.optional else f"{a.name}: Tensor")
        else:
            ty = PY_TYPES[a.type] + (" | None" if a.optional else "")
            parts.append(f"{a.name}: {ty}" + (f" = {_py_default(a)}" if a.has_default else ""))
    return ", ".join(parts)


def _docstring(spec: OpSpec) -> list[str]:
    lines = [spec.summary or spec.name, "", f"Schema: ``torch.ops.redfuser.{schema(spec)}``", "", "Args:"]
    for a in spec.args:
        if isinstance(a, TensorArg):
            dt = f"dtype of {a.same_as}" if a.same_as else ", ".join(a.dtypes)
            desc = f"tensor ({', '.join(a.shape)}), {dt}" + (", optional" if a.optional else "")
        else:
            desc = a.type + ("?" if a.optional else "") + (f", default {_py_default(a)}" if a.has_default else "")
            if a.when_null:
                desc += f" (None means {a.when_null})"
            if a.choices:
                desc += f", one of {', '.join(a.choices)}"
        doc = f": {a.doc}" if a.doc else ""
        lines.append(f"    {a.name}: {desc}{doc}")
    lines.append("")
    lines.append("Returns:")
    for o in spec.outputs:
        lines.append(f"    {o.name}: ({', '.join(o.shape)}) {o.dtype}, = {o.value}")
    lines.append("")
    lines.append(f"CPU dtypes: {', '.join(spec.variants.cpu_dtypes)}.")
    if spec.variants.cuda:
        c = spec.variants.cuda
        lines.append(f"CUDA dtypes: {', '.join(c.dtypes)}; arch families: {', '.join(c.families)}.")
    return lines


# the names the generated module and its fake implementation use for their own; axes, arguments and outputs are local
# names of the fake (an argument `op` was overwritten by the op's name before the checks that read it)
PY_NAMES = frozenset(["op", "allowed", "torch", "Tensor", "SCHEMA", "annotations"])
# the package's own functions, next to which redfuser_ops re-exports every op's wrapper (tests/test_library.py
# checks this list against the installed package)
PACKAGE_NAMES = frozenset(["check_inputs", "format_info", "info", "library_path", "set_check_inputs", "warm_up"])


def check_python_names(spec: OpSpec) -> None:
    if spec.name in PACKAGE_NAMES or spec.name.startswith("_"):  # `_`: the runtime's own ops (_build_info, ...)
        raise SpecError(spec.loc, f"an op may not be named '{spec.name}': redfuser_ops has a function of that name, "
                        "and torch.ops.redfuser ops of its own start with '_'")
    for item in (*spec.axes, *spec.args, *spec.outputs):
        if item.name in PY_NAMES:
            raise SpecError(item.loc, f"'{item.name}' is a name the generated Python module uses for its own "
                            f"({', '.join(sorted(PY_NAMES))}); rename it")


def python_module(spec: OpSpec, an: OpAnalysis, version: str) -> str:
    check_python_names(spec)
    sources = axis_sources(spec)
    names = [a.name for a in spec.args]
    first = spec.tensors[0].name
    L = [
        f'"""Generated by redfuser-ops generator {version} from {spec.file}; do not edit.',
        "",
        f"The fake (meta) implementation and the typed wrapper of torch.ops.redfuser.{spec.name}.",
        '"""',
        "",
        "from __future__ import annotations",
        "",
        "import torch",
        "from torch import Tensor",
        "",
        f"SCHEMA = {schema(spec)!r}",
        f"__all__ = [{spec.name!r}]",
        "",
        "",
        f"@torch.library.register_fake(\"redfuser::{spec.name}\")",
        f"def _fake({_signature(spec)}):",
        f'    op = "redfuser::{spec.name}"',
    ]
    cpu_dt = ", ".join(TORCH_DTYPES[d] for d in spec.variants.cpu_dtypes)
    cuda_dt = ", ".join(TORCH_DTYPES[d] for d in spec.variants.cuda.dtypes) if spec.variants.cuda else cpu_dt
    for t in spec.tensors:
        ind = "    "
        if t.optional:
            L.append(f"    if {t.name} is not None:")
            ind = "        "
        L.append(f"{ind}torch._check({t.name}.dim() == {len(t.shape)}, lambda: "
                 f"f\"{{op}}: {t.name} must be {len(t.shape)}-D ({', '.join(t.shape)}), got a {{{t.name}.dim()}}-D tensor\")")
        if t.name != first:
            L.append(f"{ind}torch._check({t.name}.device == {first}.device, lambda: "
                     f"f\"{{op}}: {t.name} is on {{{t.name}.device}} but {first} is on {{{first}.device}}\")")
        if t.same_as:
            L.append(f"{ind}torch._check({t.name}.dtype == {t.same_as}.dtype, lambda: "
                     f"f\"{{op}}: {t.name} must have the dtype of {t.same_as} ({{{t.same_as}.dtype}}), got {{{t.name}.dtype}}\")")
        elif t.name == first:
            L.append(f"{ind}allowed = ({cuda_dt},) if {first}.device.type == 'cuda' else ({cpu_dt},)")
            L.append(f"{ind}torch._check({t.name}.dtype in allowed, lambda: "
                     f"f\"{{op}}: {t.name} has unsupported dtype {{{t.name}.dtype}} on {{{t.name}.device.type}}\")")
        else:
            allowed = ", ".join(TORCH_DTYPES[d] for d in t.dtypes)
            L.append(f"{ind}torch._check({t.name}.dtype in ({allowed},), lambda: "
                     f"f\"{{op}}: {t.name} has unsupported dtype {{{t.name}.dtype}}\")")
    for name, src in sources.items():
        L.append(f"    {name} = {src.tensor}.shape[{src.dim}]")
    for t in spec.tensors:
        ind = "        " if t.optional else "    "
        checks = []
        for d, dim in enumerate(t.shape):
            src = sources.get(dim)
            if src is not None and (src.tensor, src.dim) == (t.name, d):
                continue
            checks.append(f"{ind}torch._check({t.name}.shape[{d}] == {dim}, lambda: "
                          f"f\"{{op}}: {t.name}.size({d}) must equal {dim} (= {{{dim}}}), got {{{t.name}.shape[{d}]}}\")")
        if checks:
            if t.optional:
                L.append(f"    if {t.name} is not None:")
            L += checks
    # the same checks as the C++ glue, in the same order (no divisor used before it is checked >= 1)
    for chk in ordered_checks(spec):
        used = sorted({s.name for s in chk.expr.free_symbols})
        vals = ", ".join(f"{n} = {{{n}}}" for n in used)
        L.append(f"    torch._check({py(chk.expr)}, lambda: f\"{{op}}: {chk.message} ({vals})\")")
    for a in spec.scalars:
        if a.type == "str":
            L.append(f"    torch._check({a.name} in {a.choices!r}, lambda: f\"{{op}}: {a.name} must be one of "
                     f"{', '.join(repr(c) for c in a.choices)}, got {{{a.name}!r}}\")")
    outs = []
    for o in spec.outputs:
        shape = ", ".join(o.shape)
        if o.dtype in TORCH_DTYPES:
            dt = TORCH_DTYPES[o.dtype]
        elif " or " in o.dtype:
            param, tensor = [x.strip() for x in o.dtype.split(" or ")]
            dt = f"({param} if {param} is not None else {tensor}.dtype)"
        else:
            dt = f"{o.dtype}.dtype"
        L.append(f"    {o.name} = {first}.new_empty(({shape},), dtype={dt})")
        outs.append(o.name)
    L.append(f"    return {', '.join(outs)}" if len(outs) > 1 else f"    return {outs[0]}")
    L.append("")
    L.append("")
    ret = "tuple[" + ", ".join("Tensor" for _ in spec.outputs) + "]" if len(spec.outputs) > 1 else "Tensor"
    L.append(f"def {spec.name}({_signature(spec)}) -> {ret}:")
    L.append('    """' + _docstring(spec)[0])
    L += [("    " + x) if x else "" for x in _docstring(spec)[1:]]
    L.append('    """')
    L.append(f"    return torch.ops.redfuser.{spec.name}.default({', '.join(names)})")
    L.append("")
    return "\n".join(L)
