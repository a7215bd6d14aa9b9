"""YAML spec -> validated, frozen spec objects.

Expressions stay text here (the symbolic layer parses them); this module checks structure, names and kinds,
and remembers where every key came from so that any later error can name the file, the line and the key.
The spec format is documented for users in specs/README.md.
"""

from __future__ import annotations

import ast
import keyword
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from .errors import Loc, SpecError
from .families import FAMILIES

# the tensor dtypes a spec may name, with their bytes per element
DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2, "float64": 8, "float8_e4m3fn": 1, "int32": 4, "int64": 8,
               "bool": 1}
TENSOR_DTYPES = tuple(DTYPE_BYTES)
SCALAR_TYPES = ("int", "float", "bool", "str", "ScalarType")
REDUCTION_OPS = ("sum", "max", "min", "argmax", "topk")
_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
# Literals and keywords of the expression language: no axis, argument, index or let may take them. Function
# names (exp, topk, ...) are not reserved: a name is a function only where it is called.
# Python's keywords (expressions are parsed as Python, and every name becomes a parameter of the generated Python
# API: an argument named `lambda` made the installed package fail to import) and the constants inf and nan
RESERVED = frozenset(keyword.kwlist) | {"inf", "nan"}


# --------------------------------------------------------------------------------------------- YAML with lines
class _Node(dict):
    """A mapping that remembers the line of each key (and its own line)."""

    line: int = 0
    lines: dict


class _List(list):
    line: int = 0
    lines: list


class _Loader(yaml.SafeLoader):
    text = ""


def key_path(text: str, line: int) -> str:
    """The dotted key path of the YAML block entry at a 1-based line (indentation-based: the keys of the lines
    above with less indentation), e.g. 'cascade.reduce.m'."""
    lines = text.splitlines()
    if not 1 <= line <= len(lines):
        return "(top level)"
    path: list[str] = []
    indent = None
    for raw in reversed(lines[:line]):
        body = raw.split("#", 1)[0].rstrip()
        stripped = body.lstrip(" -")
        if not stripped or ":" not in stripped:
            continue
        ind = len(body) - len(stripped)
        if indent is None or ind < indent:
            key = stripped.split(":", 1)[0].strip().strip("'\"")
            if key and " " not in key and "{" not in key:
                path.append(key)
            indent = ind
            if ind == 0:
                break
    return ".".join(reversed(path)) or "(top level)"


def _kind(node: Any) -> str:
    if node is None:
        return "nothing"
    if isinstance(node, dict):
        return "a mapping"
    if isinstance(node, list):
        return "a list"
    if isinstance(node, str):
        return f"the text '{node}'"
    return f"the {type(node).__name__} {node!r}"


def _construct_mapping(loader: _Loader, node: yaml.MappingNode) -> _Node:
    out = _Node()
    out.line = node.start_mark.line + 1
    out.lines = {}
    for key_node, value_node in node.value:
        key = loader.construct_object(key_node, deep=True)
        if key in out:
            line = key_node.start_mark.line + 1
            raise SpecError(Loc(loader.name, line, key_path(loader.text, line)), "duplicate key")
        out[key] = loader.construct_object(value_node, deep=True)
        out.lines[key] = key_node.start_mark.line + 1
    return out


def _construct_sequence(loader: _Loader, node: yaml.SequenceNode) -> _List:
    out = _List(loader.construct_object(n, deep=True) for n in node.value)
    out.line = node.start_mark.line + 1
    out.lines = [n.start_mark.line + 1 for n in node.value]
    return out


_Loader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _construct_mapping)
_Loader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_SEQUENCE_TAG, _construct_sequence)


class _Ctx:
    """Location bookkeeping while validating one file."""

    def __init__(self, file: str):
        self.file = file

    def loc(self, node: Any, key: str, path: str) -> Loc:
        line = getattr(node, "lines", {}).get(key, getattr(node, "line", 0)) if isinstance(node, dict) else 0
        return Loc(self.file, line, f"{path}.{key}" if path else str(key))

    def at(self, node: Any, path: str) -> Loc:
        return Loc(self.file, getattr(node, "line", 0), path)

    def mapping(self, node: Any, path: str, required: tuple = (), optional: tuple = ()) -> dict:
        if not isinstance(node, dict):
            where = self.at(node, path) if path else Loc(self.file, max(1, getattr(node, "line", 1)), "(top level)")
            raise SpecError(where, f"expected a mapping, got {_kind(node)}")
        allowed = set(required) | set(optional)
        for key in node:
            if allowed and key not in allowed:
                raise SpecError(self.loc(node, key, path), f"unknown key (allowed: {', '.join(sorted(allowed))})")
        for key in required:
            if key not in node:
                raise SpecError(self.at(node, path), f"missing key '{key}'")
        return node

    def name(self, node: Any, key: Any, path: str) -> str:
        if not isinstance(key, str) or not _NAME.match(key):
            raise SpecError(self.loc(node, key, path), f"'{key}' is not a valid name")
        if key in RESERVED:
            raise SpecError(self.loc(node, key, path), f"'{key}' is a reserved word")
        return key

    def text(self, node: Any, key: str, path: str) -> tuple[str, Loc]:
        value = node[key]
        loc = self.loc(node, key, path)
        if isinstance(value, bool) or value is None:
            return str(value), loc
        if isinstance(value, (int, float)):
            return repr(value), loc
        if not isinstance(value, str) or not value.strip():
            raise SpecError(loc, "expected an expression (a non-empty string)")
        return value.strip(), loc

    def str_list(self, node: Any, key: str, path: str) -> tuple[str, ...]:
        value = node[key]
        loc = self.loc(node, key, path)
        if not isinstance(value, list) or not all(isinstance(v, (str, int)) for v in value):
            raise SpecError(loc, "expected a list of names or sizes")
        return tuple(str(v) for v in value)


# --------------------------------------------------------------------------------------------- spec objects
@dataclass(frozen=True)
class Axis:
    name: str
    doc: str
    loc: Loc


@dataclass(frozen=True)
class TensorArg:
    name: str
    shape: tuple[str, ...]  # each an axis name or an integer literal
    dtypes: tuple[str, ...]  # allowed dtypes; empty when same_as is set
    same_as: str | None  # dtype must equal this tensor argument's dtype
    optional: bool
    values: str | None  # documented value domain of integer tensors, e.g. "[0, NB)"
    doc: str
    loc: Loc

    is_tensor = True


@dataclass(frozen=True)
class ScalarArg:
    name: str
    type: str  # int | float | bool | str | ScalarType
    optional: bool  # "float?" etc: None allowed
    has_default: bool
    default: Any
    when_null: str | None  # expression used when the value is None
    choices: tuple[str, ...]
    doc: str
    loc: Loc

    is_tensor = False


@dataclass(frozen=True)
class Check:
    expr: str
    message: str
    loc: Loc


@dataclass(frozen=True)
class Output:
    name: str
    shape: tuple[str, ...]
    dtype: str  # a dtype literal, a tensor argument name, or "<ScalarType param> or <tensor arg>"
    index: tuple[str, ...]  # cascade indices naming each output dim
    value: str
    empty: str | None  # value for an empty row where `value` is undefined there
    loc: Loc


@dataclass(frozen=True)
class Let:
    name: str
    text: str
    loc: Loc


@dataclass(frozen=True)
class ReduceDef:
    name: str
    text: str
    loc: Loc


@dataclass(frozen=True)
class Cascade:
    indices: tuple[tuple[str, str, Loc], ...]  # (index, extent expression, loc)
    rows: tuple[str, ...]
    over: str
    lets: tuple[Let, ...]
    mask: tuple[str, Loc] | None
    reduce: tuple[ReduceDef, ...]
    passes: int
    loc: Loc


@dataclass(frozen=True)
class CudaVariants:
    template: str  # "": the generator picks the first template that accepts the cascade
    families: tuple[str, ...]
    dtypes: tuple[str, ...]
    static: tuple[tuple[str, tuple[Any, ...]], ...]
    loc: Loc


@dataclass(frozen=True)
class Variants:
    cpu_dtypes: tuple[str, ...]
    cuda: CudaVariants | None


@dataclass(frozen=True)
class OpSpec:
    name: str
    summary: str
    file: str
    axes: tuple[Axis, ...]
    args: tuple[TensorArg | ScalarArg, ...]
    checks: tuple[Check, ...]
    outputs: tuple[Output, ...]
    cascade: Cascade
    variants: Variants
    loc: Loc

    @property
    def tensors(self) -> tuple[TensorArg, ...]:
        return tuple(a for a in self.args if isinstance(a, TensorArg))

    @property
    def scalars(self) -> tuple[ScalarArg, ...]:
        return tuple(a for a in self.args if isinstance(a, ScalarArg))

    def arg(self, name: str) -> TensorArg | ScalarArg:
        for a in self.args:
            if a.name == name:
                return a
        raise KeyError(name)


# --------------------------------------------------------------------------------------------- validation
def _axes(ctx: _Ctx, node: Any) -> tuple[Axis, ...]:
    ctx.mapping(node, "axes")
    return tuple(Axis(ctx.name(node, k, "axes"), str(v or ""), ctx.loc(node, k, "axes")) for k, v in node.items())


def _shape(ctx: _Ctx, node: Any, key: str, path: str, axes: set[str], scalars: set[str]) -> tuple[str, ...]:
    shape = node[key]
    loc = ctx.loc(node, key, path)
    if not isinstance(shape, list):
        raise SpecError(loc, "a shape is a list of axis names, integer parameters or integer sizes")
    out = []
    for dim in shape:
        if isinstance(dim, bool) or not isinstance(dim, (str, int)):
            raise SpecError(loc, f"bad dimension {dim!r}")
        if isinstance(dim, int):
            if dim < 1:
                raise SpecError(loc, f"a fixed size must be positive, got {dim}")
        elif dim not in axes and dim not in scalars:
            raise SpecError(loc, f"unknown axis '{dim}' (declare it under 'axes')")
        out.append(str(dim))
    return tuple(out)


def domain_bounds(values: str) -> tuple[str, str, bool]:
    """A tensor's `values`, '[lo, hi)' or '[lo, hi]' -> (lo, hi, whether hi is included); ValueError otherwise."""
    text = values.strip() if isinstance(values, str) else ""
    if not (text.startswith("[") and text[-1:] in (")", "]") and text.count(",") == 1):
        raise ValueError(f"values must read '[lo, hi)' or '[lo, hi]', got {values!r}")
    lo, hi = text[1:-1].split(",")
    return lo.strip(), hi.strip(), text.endswith("]")


def _domain_problem(values: Any, dtypes: tuple[str, ...], names: set[str]) -> str | None:
    """Why a tensor's `values` is not '[lo, hi)' or '[lo, hi]' over sizes and int arguments of an integer tensor,
    or None."""
    if any(d not in ("int32", "int64") for d in dtypes):
        return "only integer tensors take values (a domain of indices or lengths)"
    try:
        lo, hi, _ = domain_bounds(values)
    except ValueError as exc:
        return str(exc)
    text = values.strip()
    for part in (lo, hi):
        try:
            tree = ast.parse(part, mode="eval")
        except SyntaxError:
            return f"cannot parse the bound '{part}' of {text}"
        unknown = sorted({n.id for n in ast.walk(tree) if isinstance(n, ast.Name)} - names)
        if unknown:
            return f"the bound '{part}' of {text} reads {', '.join(unknown)}: only axes and int arguments"
    return None


def _default_ok(type_: str, value: Any, choices: tuple[str, ...]) -> bool:
    if type_ == "int":
        return isinstance(value, int) and not isinstance(value, bool)
    if type_ == "float":
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if type_ == "bool":
        return isinstance(value, bool)
    if type_ == "str":
        return isinstance(value, str) and (not choices or value in choices)
    return isinstance(value, str) and value in TENSOR_DTYPES


def _args(ctx: _Ctx, node: Any, axes: set[str]) -> tuple[TensorArg | ScalarArg, ...]:
    ctx.mapping(node, "args")
    out: list[TensorArg | ScalarArg] = []
    tensors: set[str] = set()
    int_scalars = {k for k, v in node.items() if isinstance(v, dict) and v.get("type") == "int"}
    for name, entry in node.items():
        ctx.name(node, name, "args")
        path = f"args.{name}"
        if name in axes:
            raise SpecError(ctx.loc(node, name, "args"), "an argument may not share its name with an axis")
        if isinstance(entry, dict) and "shape" in entry:
            ctx.mapping(entry, path, ("shape", "dtype"), ("optional", "values", "doc"))
            shape = _shape(ctx, entry, "shape", path, axes, int_scalars)
            dtype = entry["dtype"]
            if isinstance(dtype, str):
                if dtype not in tensors:
                    raise SpecError(ctx.loc(entry, "dtype", path), f"'{dtype}' is not an earlier tensor argument")
                dtypes, same = (), dtype
            else:
                if not isinstance(dtype, list) or not dtype or any(d not in TENSOR_DTYPES for d in dtype):
                    raise SpecError(ctx.loc(entry, "dtype", path), f"expected a list of dtypes from {TENSOR_DTYPES}")
                dtypes, same = tuple(dtype), None
            optional = entry.get("optional", False)
            if not isinstance(optional, bool):
                raise SpecError(ctx.loc(entry, "optional", path), "expected true or false")
            if "values" in entry:
                base, ref = dtypes, same
                while not base:  # dtype: an earlier tensor's (perhaps its own dtype: another's)
                    earlier = next(a for a in out if a.name == ref)
                    base, ref = earlier.dtypes, earlier.same_as
                why = _domain_problem(entry["values"], base, axes | int_scalars)
                if why:
                    raise SpecError(ctx.loc(entry, "values", path), why)
            out.append(
                TensorArg(name, shape, dtypes, same, optional, entry.get("values"), str(entry.get("doc", "")),
                          ctx.loc(node, name, "args"))
            )
            tensors.add(name)
            continue
        ctx.mapping(entry, path, ("type",), ("default", "when_null", "choices", "doc"))
        raw = entry["type"]
        optional = isinstance(raw, str) and raw.endswith("?")
        type_ = raw[:-1] if optional else raw
        if type_ not in SCALAR_TYPES:
            raise SpecError(ctx.loc(entry, "type", path), f"unknown type '{raw}' (one of {SCALAR_TYPES}, '?' for optional)")
        choices = tuple(entry.get("choices", ()))
        if choices and type_ != "str":
            raise SpecError(ctx.loc(entry, "choices", path), "only str arguments take choices")
        if type_ == "str" and not choices:
            raise SpecError(ctx.at(entry, path), "a str argument must list its choices")
        has_default = "default" in entry
        default = entry.get("default")
        if has_default and default is None and not optional:
            raise SpecError(ctx.loc(entry, "default", path), "only optional ('?') arguments may default to null")
        if has_default and default is not None and not _default_ok(type_, default, choices):
            raise SpecError(ctx.loc(entry, "default", path), f"default {default!r} does not fit type '{raw}'")
        when_null = None
        if "when_null" in entry:
            if not optional:
                raise SpecError(ctx.loc(entry, "when_null", path), "only optional ('?') arguments take when_null")
            when_null, _ = ctx.text(entry, "when_null", path)
        out.append(
            ScalarArg(name, type_, optional, has_default, default, when_null, choices, str(entry.get("doc", "")),
                      ctx.loc(node, name, "args"))
        )
    seen_default = False
    for a in out:
        has = a.optional if isinstance(a, TensorArg) else a.has_default
        if seen_default and not has:
            raise SpecError(a.loc, "an argument without a default may not follow one with a default")
        seen_default = seen_default or has
    return tuple(out)


def _checks(ctx: _Ctx, node: Any) -> tuple[Check, ...]:
    if not isinstance(node, list):
        raise SpecError(ctx.at(node, "checks"), "expected a list of {expr, message}")
    out = []
    for n, entry in enumerate(node):
        path = f"checks[{n}]"
        ctx.mapping(entry, path, ("expr", "message"))
        expr, loc = ctx.text(entry, "expr", path)
        out.append(Check(expr, str(entry["message"]), loc))
    return tuple(out)


def _outputs(ctx: _Ctx, node: Any, axes: set[str], scalars: set[str], arg_names: set[str]) -> tuple[Output, ...]:
    ctx.mapping(node, "outputs")
    out = []
    for name, entry in node.items():
        ctx.name(node, name, "outputs")
        for taken, what in ((arg_names, "an argument"), (axes, "an axis")):
            if name in taken:  # the fake implementation holds all three as local names
                raise SpecError(ctx.loc(node, name, "outputs"), f"an output may not share its name with {what}")
        path = f"outputs.{name}"
        ctx.mapping(entry, path, ("shape", "dtype", "index", "value"), ("empty", "doc"))
        shape = _shape(ctx, entry, "shape", path, axes, scalars)
        index = ctx.str_list(entry, "index", path)
        if len(index) != len(shape):
            raise SpecError(ctx.loc(entry, "index", path), f"{len(index)} indices for a {len(shape)}-d output")
        value, _ = ctx.text(entry, "value", path)
        empty = ctx.text(entry, "empty", path)[0] if "empty" in entry else None
        dtype = str(entry["dtype"])
        for part in dtype.split(" or "):
            if part.strip() not in TENSOR_DTYPES and part.strip() not in arg_names:
                raise SpecError(ctx.loc(entry, "dtype", path), f"unknown dtype '{part.strip()}' (a dtype of "
                                f"{', '.join(TENSOR_DTYPES)}, or an argument's name)")
        out.append(Output(name, shape, dtype, index, value, empty, ctx.loc(node, name, "outputs")))
    return tuple(out)


def _cascade(ctx: _Ctx, node: Any) -> Cascade:
    path = "cascade"
    ctx.mapping(node, path, ("indices", "rows", "over", "reduce"), ("let", "mask", "passes"))
    idx = node["indices"]
    ctx.mapping(idx, f"{path}.indices")
    indices = []
    for name in idx:
        ctx.name(idx, name, f"{path}.indices")
        ext, loc = ctx.text(idx, name, f"{path}.indices")
        indices.append((name, ext, loc))
    names = {i[0] for i in indices}
    rows = ctx.str_list(node, "rows", path)
    for r in rows:
        if r not in names:
            raise SpecError(ctx.loc(node, "rows", path), f"row index '{r}' is not declared under indices")
    over = node["over"]
    if over not in names:
        raise SpecError(ctx.loc(node, "over", path), f"reduction index '{over}' is not declared under indices")
    if over in rows:
        raise SpecError(ctx.loc(node, "over", path), "the reduction index cannot also be a row index")
    lets = []
    if "let" in node:
        ctx.mapping(node["let"], f"{path}.let")
        for name in node["let"]:
            ctx.name(node["let"], name, f"{path}.let")
            text, loc = ctx.text(node["let"], name, f"{path}.let")
            lets.append(Let(name, text, loc))
    mask = ctx.text(node, "mask", path) if "mask" in node else None
    ctx.mapping(node["reduce"], f"{path}.reduce")
    reduce = []
    for name in node["reduce"]:
        ctx.name(node["reduce"], name, f"{path}.reduce")
        text, loc = ctx.text(node["reduce"], name, f"{path}.reduce")
        reduce.append(ReduceDef(name, text, loc))
    if not reduce:
        raise SpecError(ctx.loc(node, "reduce", path), "a cascade needs at least one reduction")
    passes = node.get("passes", 1)
    if not isinstance(passes, int) or isinstance(passes, bool) or passes < 1:
        raise SpecError(ctx.loc(node, "passes", path), "passes is a positive integer")
    taken: dict[str, str] = {}
    for kind, items in (("index", [i[0] for i in indices]), ("let", [x.name for x in lets]),
                        ("reduction", [r.name for r in reduce])):
        for item in items:
            if item in taken:
                raise SpecError(ctx.at(node, path), f"'{item}' names both a {taken[item]} and a {kind}")
            taken[item] = kind
    return Cascade(tuple(indices), rows, str(over), tuple(lets), mask, tuple(reduce), passes, ctx.at(node, path))


def _variants(ctx: _Ctx, node: Any, first_dtypes: tuple[str, ...]) -> Variants:
    ctx.mapping(node, "variants", (), ("cpu", "cuda"))
    cpu = node.get("cpu") or {}
    ctx.mapping(cpu, "variants.cpu", (), ("dtype",))
    cpu_dtypes = tuple(cpu.get("dtype", first_dtypes))
    for d in cpu_dtypes:
        if d not in first_dtypes:
            raise SpecError(ctx.loc(cpu, "dtype", "variants.cpu"), f"dtype {d} is not allowed by the first argument")
    cuda = None
    if "cuda" in node:
        c = node["cuda"]
        p = "variants.cuda"
        ctx.mapping(c, p, ("families", "dtype"), ("template", "static"))
        fams = tuple(c["families"])
        for f in fams:
            if f not in FAMILIES:
                raise SpecError(ctx.loc(c, "families", p), f"unknown arch family '{f}' (one of {FAMILIES})")
        dts = tuple(c["dtype"])
        for d in dts:
            if d not in first_dtypes:
                raise SpecError(ctx.loc(c, "dtype", p), f"dtype {d} is not allowed by the first argument")
        static = c.get("static", {})
        ctx.mapping(static, f"{p}.static")
        st = []
        for k, vals in static.items():
            if not isinstance(vals, list) or not vals:
                raise SpecError(ctx.loc(static, k, f"{p}.static"), "expected a non-empty list of values")
            st.append((str(k), tuple(vals)))
        cuda = CudaVariants(str(c.get("template", "")), fams, dts, tuple(st), ctx.at(c, p))
    return Variants(cpu_dtypes, cuda)


def parse_spec(text: str, file: str = "<spec>") -> OpSpec:
    """Parse and validate one spec. Raises SpecError naming the file, line and key of the first problem."""
    try:
        loader = _Loader(text)
        loader.name = file
        loader.text = text
        try:
            root = loader.get_single_data()
        finally:
            loader.dispose()
    except yaml.YAMLError as exc:
        # the line where the broken construct starts (context), else where the parser noticed (problem)
        mark = getattr(exc, "context_mark", None) or getattr(exc, "problem_mark", None)
        line = (mark.line + 1) if mark else 1
        what = "; ".join(str(x) for x in (getattr(exc, "context", None), getattr(exc, "problem", None)) if x)
        raise SpecError(Loc(file, line, key_path(text, line)), f"invalid YAML: {what or exc}") from None
    if root is None:
        raise SpecError(Loc(file, 1, "(top level)"), "the spec is empty: expected a mapping with the keys op, args, "
                        "outputs and cascade")
    ctx = _Ctx(file)
    ctx.mapping(root, "", ("op", "args", "outputs", "cascade"),
                ("summary", "axes", "checks", "variants", "schedule"))
    if "schedule" in root:
        raise SpecError(ctx.loc(root, "schedule", ""), "'schedule:' is gone: each kernel template chooses its tiles "
                        "per arch family (generator/codegen/templates); remove the block")
    name = root["op"]
    if not isinstance(name, str) or not _NAME.match(name):
        raise SpecError(ctx.loc(root, "op", ""), "op must be a valid name")
    if name in RESERVED:
        raise SpecError(ctx.loc(root, "op", ""), f"'{name}' is a reserved word")
    axes = _axes(ctx, root.get("axes", _Node()))
    axis_names = {a.name for a in axes}
    args = _args(ctx, root["args"], axis_names)
    tensors = [a for a in args if isinstance(a, TensorArg)]
    if not tensors:
        raise SpecError(ctx.loc(root, "args", ""), "an op needs at least one tensor argument")
    int_scalars = {a.name for a in args if isinstance(a, ScalarArg) and a.type == "int"}
    checks = _checks(ctx, root.get("checks", _List()))
    outputs = _outputs(ctx, root["outputs"], axis_names, int_scalars, {a.name for a in args})
    cascade = _cascade(ctx, root["cascade"])
    clash = {n for n, _, _ in cascade.indices} & ({a.name for a in args} | axis_names)
    if clash:
        raise SpecError(cascade.loc, f"indices {sorted(clash)} clash with axis or argument names")
    first_dtypes = tensors[0].dtypes
    variants = _variants(ctx, root.get("variants", _Node()), first_dtypes)
    return OpSpec(
        name=name,
        summary=" ".join(str(root.get("summary", "")).split()),
        file=file,
        axes=axes,
        args=args,
        checks=checks,
        outputs=outputs,
        cascade=cascade,
        variants=variants,
        loc=ctx.loc(root, "op", ""),
    )


def load_spec(path: str | Path) -> OpSpec:
    path = Path(path)
    return parse_spec(path.read_text(), str(path))


def spec_files(directory: str | Path) -> list[Path]:
    return sorted(p for p in Path(directory).glob("*.yaml"))
