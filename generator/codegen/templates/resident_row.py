"""Resident-row template: one row of up to ``E_cap`` elements lives in the registers of one warp.

The template owns the *schedule* (rows per CTA, the element-to-lane layout, vectorized masked
loads, warp-level reductions, top-k rounds, the writes) and none of the *math*: every value comes
in as expression text inside a :class:`StepProgram` (produced by the symbolic engine; the tests
write the moe_route one by hand).  Per variant (input dtype x ``E_cap`` x arch family) it emits a
Python module holding ``make_prim_func()``, which builds one TileLang ``@T.prim_func``.

Step IR (the program is a sequence of these; math as data)
----------------------------------------------------------
``Load(name, input, fill)``
    per element: ``float32(input[row, e])`` for ``e < length``, else ``fill``.  A ``per_row=False``
    input has shape ``(length,)`` (a bias).  Vectorized when the row start is aligned.
``Map(name, expr, dtype="float32")``
    per element value (``dtype="bool"``: a per-element predicate, kept as a bit mask).
``Reduce(name, op, expr, where=None, over="row")``
    ``op`` in ``max | min | sum``.  ``over="row"``: over the valid elements (``e < length`` and
    ``where``) -> a row scalar.  ``over="k"``: over the ``k`` selected values -> a row scalar.
``GroupReduce(name, op, expr, group_size, n_groups, k=1, where=None)``
    contiguous groups of ``group_size`` elements (group ``g`` = elements
    ``[g*group_size, (g+1)*group_size)``); per group, ``op`` in ``max | sum | topk_sum`` (sum of the
    ``k`` largest, ``k`` static) over its valid elements -> ``n_groups`` values (the group domain).
``GroupSelect(name, score, group_size, n_groups, k)``
    keep the ``k`` groups with the best ``score`` (group-domain expression; ties -> lower group id)
    -> a per-element predicate ``name`` (the element's group is kept).
``TopK(ids, key, k, where=None, gather=((out, expr), ...))``
    ``k`` rounds; each picks the element with the largest ``key`` among the unpicked ones (ties ->
    lower index); elements failing ``where`` rank after every element passing it, in index order;
    ``ids`` (int32) and each ``out`` (``expr`` at the picked element) form the k domain, in order of
    selection.  ``k`` must not exceed ``length`` (then every id is distinct and in ``[0, length)``).
``Epilogue(name, expr)``
    a value per selected item (k domain), e.g. renormalisation and scaling.
``If(cond, then, orelse=())``
    runtime, warp-uniform branch on a row-level condition (params, dims, row scalars), so one
    kernel serves every mode (scoring, bias present, grouped...).  A name is defined after the
    ``If`` only when both branches define it (same domain and dtype).
``Store(output, expr, over="k")``
    write the ``k`` values of a row: ``output[row, j] = expr`` for ``j < k``.

Ordering of keys (TopK, GroupSelect): NaN orders as -inf; -0.0 orders as +0.0.  Group reductions
ignore NaN elements for ``max`` and ``topk_sum`` (IEEE maxNum / comparisons); ``sum`` propagates NaN.
A ``topk_sum`` over fewer than ``k`` elements is -inf.  Row ``max``/``min`` ignore NaN (maxNum).

Expression language
-------------------
Python expression text over ``T.<intrinsic>(...)`` (see ``_T_FUNCS``), numeric literals,
arithmetic / comparison / ``and`` / ``or`` / ``not`` and the names of its context:

* element context (``Load`` fill, ``Map``, ``Reduce`` over the row, ``GroupReduce`` expr and
  ``where``, ``TopK`` key / where / gather): element names, ``e`` (the element index, int32), row
  scalars, params, dims.
* row context (``If`` conditions, ``k``, ``n_groups``, ``group_size``): row scalars, params, dims.
* group context (``GroupSelect`` score): group names, ``g`` (the group index), row scalars, params,
  dims.
* k context (``Reduce(over="k")``, ``Epilogue``, ``Store``): k names, ``j`` (the rank), row
  scalars, params, dims.

Kernel design (one variant)
---------------------------
* A CTA of ``rows_per_cta`` warps; warp ``w`` of CTA ``b`` owns row ``b * rows_per_cta + w``.
* Layout (a ``T.Fragment``-like map written out explicitly): ``S = E_cap / 32`` slots per lane,
  ``VEC`` = elements of one 16-byte load (capped to ``S``); slot ``s`` of lane ``l`` holds element
  ``e = (s // VEC) * 32 * VEC + l * VEC + s % VEC``.  A warp's load of one chunk is 32 consecutive
  ``VEC``-vectors: coalesced, one ``LDG.128`` per lane per chunk when ``length % VEC == 0`` and the
  base pointer is 16-byte aligned (checked in the kernel), else a masked scalar load of the same map.
* Every per-element value is an ``S``-register array per lane (all indices static after unrolling);
  predicates are bit masks in one 32-bit register.  Nothing goes through shared memory.
* A warp whose row is past the end skips the whole body (the guard is warp-uniform, so every
  shuffle runs with the full mask).  Shuffles are always separate statements: TileLang lowers
  ``T.if_then_else`` to branches, and a shuffle inside one would be divergent.
* Row reductions: per-lane partial over the slots, then a 5-step ``shfl_xor`` butterfly: every lane
  ends with the bit-identical result (the butterfly is symmetric).
* Top-k round: each lane scans its slots in increasing ``e`` (strict ``>``, so the lowest index wins
  a tie inside the lane), forms the 64-bit key ``(orderable(value) << 32) | (0xFFFFFFFF - e)`` and
  one ``uint64`` butterfly max gives the winner to every lane (the low word breaks ties towards the
  lower index).  The owner lane clears the slot; gathered values are taken from the owner lane's
  running best with one ``shfl_sync``.  Result ``j`` is kept by lane ``j % 32`` (register
  ``j // 32``), so the k-domain epilogue is lane-parallel and the store is coalesced.
  ``orderable``: 0 = unavailable (picked, or ``e >= length``), 1 = fails ``where``, else the
  monotone map of the float bits (>= 0x007FFFFF), so the ranking is total and never runs out of
  valid candidates while ``k <= length``.  ``warp_argmax="redux"`` replaces the 64-bit butterfly by
  ``__reduce_max_sync`` of the rank word and ``__reduce_min_sync`` of the index over the lanes
  holding that rank (same order; two REDUX instead of ten SHFL per round).
* Groups: group ``g`` is kept by lane ``g % 32`` (register ``g // 32``); a group reduction loops over
  the groups (runtime count), each a per-lane partial plus one butterfly; group selection is ``k``
  rounds of a 64-bit butterfly max over the lanes.

Backends
--------
``backend="cuda"`` is the kernel.  ``backend="cpu_sim"`` emits *the same program* for TileLang's
``"c"`` target with the 32 lanes made explicit: every per-lane statement runs inside
``for lane in T.serial(32)``, per-lane registers get a leading lane axis, a shuffle becomes a read
of another lane's copy, one row per grid step.  Layout, keys, masks, butterflies and round logic are
emitted by the same code path, so the CPU simulation checks the template's logic and the step
program (not nvcc or the hardware).  bfloat16 inputs are passed as raw ``uint16`` there (the C
backend has no bfloat16) and widened by a shift.
"""

from __future__ import annotations

import ast
import contextlib
import dataclasses
import hashlib
from dataclasses import dataclass

from ...families import family

TEMPLATE_VERSION = "resident_row/1"

__all__ = [
    "DTYPES",
    "FAMILIES",
    "TEMPLATE_VERSION",
    "Epilogue",
    "GroupReduce",
    "GroupSelect",
    "If",
    "Input",
    "Load",
    "Map",
    "Output",
    "Param",
    "Reduce",
    "RowVariant",
    "StepProgram",
    "Store",
    "TopK",
    "check_program",
    "emit_resident_row_program",
    "preconditions",
]

# --------------------------------------------------------------------------------------------
# Step IR
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Load:
    name: str
    input: str
    fill: str = "0.0"  # element context


@dataclass(frozen=True)
class Map:
    name: str
    expr: str
    dtype: str = "float32"  # "float32" | "bool"


@dataclass(frozen=True)
class Reduce:
    name: str
    op: str  # "max" | "min" | "sum"
    expr: str
    where: str | None = None
    over: str = "row"  # "row" | "k"


@dataclass(frozen=True)
class GroupReduce:
    name: str
    op: str  # "max" | "sum" | "topk_sum"
    expr: str
    group_size: str  # row context
    n_groups: str  # row context
    k: int = 1  # topk_sum only: how many of the largest values are summed (static)
    where: str | None = None


@dataclass(frozen=True)
class GroupSelect:
    name: str
    score: str  # group context
    group_size: str
    n_groups: str
    k: str  # row context: how many groups are kept


@dataclass(frozen=True)
class TopK:
    ids: str
    key: str
    k: str  # row context
    where: str | None = None
    gather: tuple[tuple[str, str], ...] = ()  # (k-domain name, element expression)


@dataclass(frozen=True)
class Epilogue:
    name: str
    expr: str


@dataclass(frozen=True)
class If:
    cond: str
    then: tuple = ()
    orelse: tuple = ()


@dataclass(frozen=True)
class Store:
    output: str
    expr: str
    over: str = "k"


Step = Load | Map | Reduce | GroupReduce | GroupSelect | TopK | Epilogue | If | Store


@dataclass(frozen=True)
class Input:
    name: str
    dtype: str | None = None  # None: the variant's dtype
    per_row: bool = True  # (rows, length) when True, (length,) when False


@dataclass(frozen=True)
class Output:
    name: str
    dtype: str  # "float32" | "int32"; shape (rows, k)


@dataclass(frozen=True)
class Param:
    name: str
    dtype: str  # "int32" | "float32"


@dataclass(frozen=True)
class StepProgram:
    name: str
    inputs: tuple[Input, ...]
    outputs: tuple[Output, ...]
    params: tuple[Param, ...]
    steps: tuple
    rows: str = "num_tokens"  # dynamic dim: rows
    length: str = "E"  # dynamic dim: elements per row
    k: str = "topk"  # dynamic dim: results per row (second dim of the outputs)


# --------------------------------------------------------------------------------------------
# Variant
# --------------------------------------------------------------------------------------------

# the families this template lowers for -> the arch TileLang targets (generator/families.py)
FAMILIES = {f: family(f).lower_arch for f in ("sm80", "sm90a", "sm100a")}
DTYPES = {"float32": 4, "float16": 2, "bfloat16": 2}
_DT_SHORT = {"float32": "fp32", "float16": "fp16", "bfloat16": "bf16"}


@dataclass(frozen=True)
class RowVariant:
    dtype: str  # dtype of the inputs declared with dtype None
    e_cap: int  # elements per row the registers hold: a multiple of 32, at most 1024
    family: str = "sm80"
    rows_per_cta: int = 4
    k_max: int = 32  # largest k (results per row) the k-domain registers hold
    g_max: int = 32  # largest group count the group-domain registers hold
    # warp argmax of a top-k round: "shfl64" = one 5-step shfl_xor butterfly over the 64-bit key;
    # "redux" = __reduce_max_sync over the rank word, then __reduce_min_sync over the index of the
    # lanes holding that maximum (REDUX, sm_80+; same order, fewer instructions per round)
    warp_argmax: str = "shfl64"

    @property
    def arch(self) -> str:
        return FAMILIES[self.family]

    @property
    def slots(self) -> int:
        return self.e_cap // 32

    @property
    def vec(self) -> int:
        v = 16 // DTYPES[self.dtype]
        while self.slots % v:
            v //= 2
        return v

    @property
    def kq(self) -> int:
        return (self.k_max + 31) // 32

    @property
    def gq(self) -> int:
        return (self.g_max + 31) // 32

    def variant_name(self, op: str) -> str:
        """Deterministic; encodes every parameter (defaults left out: rows 4, k_max 32, g_max 32, shfl64)."""
        extra = ""
        if self.rows_per_cta != 4:
            extra += f"_r{self.rows_per_cta}"
        if self.k_max != 32:
            extra += f"_k{self.k_max}"
        if self.g_max != 32:
            extra += f"_g{self.g_max}"
        if self.warp_argmax != "shfl64":
            extra += f"_{self.warp_argmax}"
        return f"{op}__{_DT_SHORT[self.dtype]}_e{self.e_cap}{extra}__{self.family}"

    def check(self) -> None:
        if self.family not in FAMILIES:
            raise ValueError(f"unknown arch family {self.family!r}; expected one of {sorted(FAMILIES)}")
        if self.dtype not in DTYPES:
            raise ValueError(f"unsupported dtype {self.dtype!r}; expected one of {sorted(DTYPES)}")
        if self.e_cap % 32 or not 32 <= self.e_cap <= 1024:
            raise ValueError(f"e_cap must be a multiple of 32 in [32, 1024], got {self.e_cap}")
        if not 1 <= self.rows_per_cta <= 32:
            raise ValueError(f"rows_per_cta must be in [1, 32], got {self.rows_per_cta}")
        if not 1 <= self.k_max <= 1024 or not 1 <= self.g_max <= 1024:
            raise ValueError("k_max and g_max must be in [1, 1024]")
        if self.warp_argmax not in ("shfl64", "redux"):
            raise ValueError(f"warp_argmax must be 'shfl64' or 'redux', got {self.warp_argmax!r}")


# --------------------------------------------------------------------------------------------
# Checking a program: names, domains, contexts
# --------------------------------------------------------------------------------------------

_T_FUNCS = {
    "exp", "exp2", "log", "log2", "max", "min", "abs", "sqrt", "tanh", "sin", "cos", "if_then_else", "infinity",
    "float32", "int32", "isnan", "isinf", "isfinite",
}
_REDUCE_OPS = ("max", "min", "sum")
_GROUP_OPS = ("max", "sum", "topk_sum")
# names the emitted code uses for itself; user names are prefixed with "u_", internals with "i_"
_RESERVED = {"T", "e", "g", "j", "lane", "bx", "make_prim_func", "True", "False"}


@dataclass(frozen=True)
class _Sym:
    domain: str  # "elem" | "row" | "group" | "k"
    dtype: str  # "float32" | "bool" | "int32"


def _expr_names(expr: str, where: str) -> set[str]:
    try:
        tree = ast.parse(expr, mode="eval")
    except SyntaxError as exc:
        raise ValueError(f"{where}: cannot parse expression {expr!r}: {exc.msg}") from None
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute):
            if not (isinstance(node.value, ast.Name) and node.value.id == "T"):
                raise ValueError(f"{where}: attribute access {ast.unparse(node)!r} is not allowed in {expr!r}")
            if node.attr not in _T_FUNCS:
                raise ValueError(f"{where}: T.{node.attr} is not an allowed intrinsic in {expr!r}")
        elif isinstance(node, ast.Name) and node.id != "T":
            out.add(node.id)
        elif isinstance(node, (ast.Lambda, ast.NamedExpr, ast.Subscript, ast.Starred, ast.comprehension)):
            raise ValueError(f"{where}: {type(node).__name__} is not allowed in {expr!r}")
    return out


class _Checker:
    """Walks the steps in order, building the symbol table; raises ValueError naming the step."""

    def __init__(self, program: StepProgram):
        self.p = program
        self.params = {q.name: q for q in program.params}
        self.dims = {program.rows, program.length, program.k}
        self.inputs = {i.name: i for i in program.inputs}
        self.outputs = {o.name: o for o in program.outputs}
        self.stored: set[str] = set()
        self.groups_shape: tuple[str, str] | None = None
        taken: set[str] = set()
        for nm in [*self.params, *self.dims, *self.inputs, *self.outputs]:
            self._ident(nm, "program")
            if nm in taken:
                raise ValueError(f"program {program.name}: name {nm!r} is used twice (params, dims, inputs, outputs)")
            taken.add(nm)
        self.globals = taken
        for q in program.params:
            if q.dtype not in ("int32", "float32"):
                raise ValueError(f"param {q.name}: dtype must be int32 or float32, got {q.dtype}")
        for o in program.outputs:
            if o.dtype not in ("int32", "float32"):
                raise ValueError(f"output {o.name}: dtype must be int32 or float32, got {o.dtype}")
        for i in program.inputs:
            if i.dtype is not None and i.dtype not in DTYPES:
                raise ValueError(f"input {i.name}: dtype must be one of {sorted(DTYPES)} or None")

    @staticmethod
    def _ident(nm: str, where: str) -> None:
        if not nm.isidentifier() or nm in _RESERVED or nm.startswith(("u_", "i_", "_")):
            raise ValueError(f"{where}: {nm!r} is not a usable name (identifier, not reserved, no u_/i_/_ prefix)")

    def use(self, expr: str, ctx: str, syms: dict[str, _Sym], where: str) -> None:
        allowed_local = {"elem": "elem", "group": "group", "k": "k", "row": None}[ctx]
        index_name = {"elem": "e", "group": "g", "k": "j", "row": None}[ctx]
        for nm in _expr_names(expr, where):
            if nm in self.params or nm in self.dims:
                continue
            if nm == index_name:
                continue
            s = syms.get(nm)
            if s is None:
                raise ValueError(f"{where}: unknown name {nm!r} in {expr!r}")
            if s.domain == "row" or s.domain == allowed_local:
                continue
            raise ValueError(f"{where}: {nm!r} is a {s.domain} value; not usable in a {ctx} expression {expr!r}")

    def define(self, nm: str, sym: _Sym, syms: dict[str, _Sym], where: str) -> None:
        self._ident(nm, where)
        if nm in self.globals:
            raise ValueError(f"{where}: {nm!r} is already a param, dim, input or output")
        old = syms.get(nm)
        if old is not None and old != sym:
            raise ValueError(f"{where}: {nm!r} redefined as {sym.domain}/{sym.dtype} (was {old.domain}/{old.dtype})")
        syms[nm] = sym

    def groups(self, group_size: str, n_groups: str, where: str) -> None:
        shape = (group_size.replace(" ", ""), n_groups.replace(" ", ""))
        if self.groups_shape is not None and self.groups_shape != shape:
            raise ValueError(f"{where}: every group step must use the same group_size and n_groups")
        self.groups_shape = shape

    def steps(self, steps, syms: dict[str, _Sym], path: str) -> dict[str, _Sym]:
        for i, st in enumerate(steps):
            where = f"program {self.p.name}, step {path}{i} ({type(st).__name__})"
            if isinstance(st, Load):
                inp = self.inputs.get(st.input)
                if inp is None:
                    raise ValueError(f"{where}: unknown input {st.input!r}")
                self.use(st.fill, "elem", syms, where)
                self.define(st.name, _Sym("elem", "float32"), syms, where)
            elif isinstance(st, Map):
                if st.dtype not in ("float32", "bool"):
                    raise ValueError(f"{where}: Map dtype must be float32 or bool")
                self.use(st.expr, "elem", syms, where)
                self.define(st.name, _Sym("elem", st.dtype), syms, where)
            elif isinstance(st, Reduce):
                if st.op not in _REDUCE_OPS:
                    raise ValueError(f"{where}: op must be one of {_REDUCE_OPS}")
                if st.over not in ("row", "k"):
                    raise ValueError(f"{where}: over must be 'row' or 'k'")
                ctx = "elem" if st.over == "row" else "k"
                self.use(st.expr, ctx, syms, where)
                if st.where is not None:
                    self.use(st.where, ctx, syms, where)
                self.define(st.name, _Sym("row", "float32"), syms, where)
            elif isinstance(st, GroupReduce):
                if st.op not in _GROUP_OPS:
                    raise ValueError(f"{where}: op must be one of {_GROUP_OPS}")
                if not isinstance(st.k, int) or not 1 <= st.k <= 8:
                    raise ValueError(f"{where}: k must be a static int in [1, 8]")
                self.use(st.expr, "elem", syms, where)
                if st.where is not None:
                    self.use(st.where, "elem", syms, where)
                self.use(st.group_size, "row", syms, where)
                self.use(st.n_groups, "row", syms, where)
                self.groups(st.group_size, st.n_groups, where)
                self.define(st.name, _Sym("group", "float32"), syms, where)
            elif isinstance(st, GroupSelect):
                self.use(st.score, "group", syms, where)
                for x in (st.group_size, st.n_groups, st.k):
                    self.use(x, "row", syms, where)
                self.groups(st.group_size, st.n_groups, where)
                self.define(st.name, _Sym("elem", "bool"), syms, where)
            elif isinstance(st, TopK):
                self.use(st.key, "elem", syms, where)
                self.use(st.k, "row", syms, where)
                if st.k.replace(" ", "") != self.p.k:
                    raise ValueError(f"{where}: k must be the program's k dim {self.p.k!r}")
                if st.where is not None:
                    self.use(st.where, "elem", syms, where)
                for out, ex in st.gather:
                    self.use(ex, "elem", syms, where)
                self.define(st.ids, _Sym("k", "int32"), syms, where)
                for out, _ex in st.gather:
                    self.define(out, _Sym("k", "float32"), syms, where)
            elif isinstance(st, Epilogue):
                self.use(st.expr, "k", syms, where)
                self.define(st.name, _Sym("k", "float32"), syms, where)
            elif isinstance(st, If):
                self.use(st.cond, "row", syms, where)
                a = self.steps(st.then, dict(syms), f"{path}{i}.then.")
                b = self.steps(st.orelse, dict(syms), f"{path}{i}.else.")
                for nm in set(a) & set(b):
                    if a[nm] != b[nm]:
                        raise ValueError(f"{where}: {nm!r} has different domains/dtypes in the two branches")
                    syms[nm] = a[nm]
            elif isinstance(st, Store):
                if st.over != "k":
                    raise ValueError(f"{where}: only over='k' stores are supported")
                if st.output not in self.outputs:
                    raise ValueError(f"{where}: unknown output {st.output!r}")
                self.use(st.expr, "k", syms, where)
                self.stored.add(st.output)
            else:
                raise TypeError(f"{where}: unknown step type")
        return syms


def check_program(program: StepProgram) -> dict[str, tuple[str, str]]:
    """Validate ``program``; return its symbol table ``name -> (domain, dtype)``."""
    ck = _Checker(program)
    syms = ck.steps(program.steps, {}, "")
    missing = set(ck.outputs) - ck.stored
    if missing:
        raise ValueError(f"program {program.name}: outputs never stored: {sorted(missing)}")
    return {k: (v.domain, v.dtype) for k, v in syms.items()}


def _all_symbols(program: StepProgram) -> dict[str, _Sym]:
    """Every name any branch defines (the emitter declares storage for all of them)."""
    ck = _Checker(program)
    out: dict[str, _Sym] = {}

    def walk(steps, syms):
        for st in steps:
            if isinstance(st, If):
                a = walk(st.then, dict(syms))
                b = walk(st.orelse, dict(syms))
                syms.update(a)
                syms.update(b)
                continue
            before = dict(syms)
            ck.steps((st,), syms, "")
            for nm, s in syms.items():
                if nm not in before:
                    out[nm] = s
        return syms

    # the checked walk establishes consistency; this one collects branch-local names too
    check_program(program)
    walk(program.steps, {})
    return out


def preconditions(program: StepProgram, variant: RowVariant) -> list[tuple[str, str]]:
    """Conditions (Python expression text over dims and params, message) the caller must check.

    The kernel relies on them; a launcher that cannot meet them must refuse the call.
    """
    p = program
    out = [
        (f"{p.rows} >= 1", f"{p.rows} must be at least 1 (skip empty launches)"),
        (f"1 <= {p.length} <= {variant.e_cap}", f"{p.length} must be in [1, {variant.e_cap}] for this variant"),
    ]

    def walk(steps, guard: str | None):
        def add(cond: str, msg: str):
            out.append((cond if guard is None else f"not ({guard}) or ({cond})", msg))

        for st in steps:
            if isinstance(st, If):
                g1 = st.cond if guard is None else f"({guard}) and ({st.cond})"
                g2 = f"not ({st.cond})" if guard is None else f"({guard}) and not ({st.cond})"
                walk(st.then, g1)
                walk(st.orelse, g2)
            elif isinstance(st, TopK):
                add(f"1 <= {st.k} <= {p.length}", f"{st.k} must be in [1, {p.length}]")
                add(f"{st.k} <= {variant.k_max}", f"{st.k} must be at most {variant.k_max} for this variant")
            elif isinstance(st, (GroupReduce, GroupSelect)):
                add(f"1 <= {st.n_groups} <= {variant.g_max}", f"{st.n_groups} must be in [1, {variant.g_max}]")
                add(f"({st.group_size}) >= 1", f"group size {st.group_size} must be at least 1")
                add(f"({st.group_size}) * ({st.n_groups}) <= {p.length}", "groups must fit in the row")
                if isinstance(st, GroupSelect):
                    add(f"1 <= {st.k} <= {st.n_groups}", f"{st.k} must be in [1, {st.n_groups}]")

    walk(p.steps, None)
    seen, uniq = set(), []
    for c in out:
        if c not in seen:
            seen.add(c)
            uniq.append(c)
    return uniq


# --------------------------------------------------------------------------------------------
# Emission
# --------------------------------------------------------------------------------------------

_NEG_INF = 'T.infinity("float32") * -1.0'
_POS_INF = 'T.infinity("float32")'
_U32_MAX = "T.uint32(4294967295)"


class _Src:
    def __init__(self):
        self.lines: list[str] = []
        self.depth = 0

    def __call__(self, text: str) -> None:
        self.lines.append("    " * self.depth + text)

    @contextlib.contextmanager
    def block(self, header: str):
        self(header + ":")
        self.depth += 1
        n = len(self.lines)
        yield
        if len(self.lines) == n:
            self("T.evaluate(0)")
        self.depth -= 1


class _Rename(ast.NodeTransformer):
    def __init__(self, mapping: dict[str, str]):
        self.mapping = mapping

    def visit_Attribute(self, node: ast.Attribute):
        return node  # T.<intrinsic>; checked by _expr_names

    def visit_Name(self, node: ast.Name):
        if node.id == "T" or node.id not in self.mapping:
            return node
        return ast.parse(self.mapping[node.id], mode="eval").body


class _Emitter:
    def __init__(self, program: StepProgram, variant: RowVariant, backend: str):
        if backend not in ("cuda", "cpu_sim"):
            raise ValueError(f"backend must be 'cuda' or 'cpu_sim', got {backend!r}")
        variant.check()
        check_program(program)
        self.p = program
        self.v = variant
        self.sim = backend == "cpu_sim"
        self.syms = _all_symbols(program)
        self.params = {q.name for q in program.params}
        self.dims = {program.rows, program.length, program.k}
        self.inputs = {i.name: i for i in program.inputs}
        self.outputs = {o.name: o for o in program.outputs}
        self.src = _Src()
        self.decls: dict[str, tuple[str, int | None]] = {}  # name -> (dtype, n or None for a scalar)
        self.in_lanes = False
        S, V = variant.slots, variant.vec
        if S == V:
            self.e_expr = f"lane * {V} + i_s"
        else:
            self.e_expr = f"(i_s // {V}) * {32 * V} + lane * {V} + i_s % {V}"
        self.slot_loop = f"for i_s in T.{'serial' if self.sim else 'unroll'}({S})"

    # ---- storage ------------------------------------------------------------------------
    def decl(self, name: str, dtype: str, n: int | None = None) -> None:
        old = self.decls.get(name)
        if old is not None and old != (dtype, n):
            raise AssertionError(f"internal: {name} declared twice differently")
        self.decls[name] = (dtype, n)

    def sv(self, name: str) -> str:
        """A per-lane scalar."""
        return f"{name}[lane]" if self.sim else name

    def av(self, name: str, idx: str) -> str:
        """A per-lane array element."""
        return f"{name}[lane, {idx}]" if self.sim else f"{name}[{idx}]"

    def uni(self, name: str) -> str:
        """A warp-uniform per-lane scalar read outside lane code (sim: lane 0's copy)."""
        return f"{name}[0]" if self.sim else name

    # ---- lanes and collectives --------------------------------------------------------------
    @contextlib.contextmanager
    def lanes(self):
        if self.in_lanes or not self.sim:
            yield
            return
        self.in_lanes = True
        with self.src.block("for lane in T.serial(32)"):
            yield
        self.in_lanes = False

    def butterfly(self, names: list[tuple[str, str]], combine) -> None:
        """All-reduce per-lane scalars over the warp; ``combine(mine, other)`` -> statements."""
        assert not self.in_lanes
        others = []
        for nm, dt in names:
            o = f"i_o_{nm}"
            self.decl(o, dt)
            others.append(o)
        with self.src.block("for i_bf in T.unroll(5)"):
            if self.sim:
                with self.lanes():
                    for (nm, _dt), o in zip(names, others):
                        self.src(f"{o}[lane] = {nm}[lane ^ (16 >> i_bf)]")
                with self.lanes():
                    for stmt in combine([self.sv(n) for n, _ in names], [self.sv(o) for o in others]):
                        self.src(stmt)
            else:
                for (nm, _dt), o in zip(names, others):
                    self.src(f"{o} = T.shfl_xor({nm}, 16 >> i_bf)")
                for stmt in combine([n for n, _ in names], others):
                    self.src(stmt)

    def reduce_u32(self, name: str, op: str) -> None:
        """Every lane gets the warp max/min of the uint32 per-lane ``name`` (REDUX on sm_80+)."""
        assert not self.in_lanes and op in ("max", "min")
        if self.sim:
            o = f"i_o_{name}"
            self.decl(o, "uint32")
            better = "<" if op == "max" else ">"
            self.src(f"{o}[0] = {name}[0]")
            with self.src.block("for i_l in T.serial(1, 32)"):
                self.src(f"{o}[0] = T.if_then_else({o}[0] {better} {name}[i_l], {name}[i_l], {o}[0])")
            with self.lanes():
                self.src(f"{name}[lane] = {o}[0]")
        else:
            self.src(f"{name} = T.call_extern(\"uint32\", \"__reduce_{op}_sync\", T.uint32(4294967295), {name})")

    def bcast(self, name: str, dtype: str, src_lane: str) -> None:
        """Every lane takes lane ``src_lane``'s value of ``name`` (``src_lane``: lane-code text)."""
        assert not self.in_lanes
        if self.sim:
            o = f"i_o_{name}"
            self.decl(o, dtype)
            with self.lanes():
                self.src(f"{o}[lane] = {name}[{src_lane}]")
            with self.lanes():
                self.src(f"{name}[lane] = {o}[lane]")
        else:
            self.src(f"{name} = T.shfl_sync({name}, {src_lane})")

    # ---- expressions ------------------------------------------------------------------------
    def render(self, expr: str, ctx: str, in_lanes: bool = True) -> str:
        mapping: dict[str, str] = {}
        for nm, s in self.syms.items():
            u = f"u_{nm}"
            if s.domain == "row":
                mapping[nm] = self.sv(u) if in_lanes else self.uni(u)
            elif s.domain == "elem" and ctx == "elem":
                if s.dtype == "bool":
                    mapping[nm] = f"((({self.sv(u)} >> T.cast(i_s, \"uint32\")) & T.uint32(1)) == T.uint32(1))"
                else:
                    mapping[nm] = self.av(u, "i_s")
            elif s.domain == ctx and ctx in ("group", "k"):
                mapping[nm] = self.av(u, "i_q")
        if ctx == "elem":
            mapping["e"] = "i_e"
        elif ctx in ("group", "k"):
            mapping[{"group": "g", "k": "j"}[ctx]] = "(lane + 32 * i_q)"
        tree = _Rename(mapping).visit(ast.parse(expr, mode="eval"))
        return "(" + ast.unparse(tree) + ")"

    def loop(self, var: str, n: int) -> str:
        """Header of a static loop: unrolled in the kernel (registers need static indices)."""
        return f"for {var} in T.{'serial' if self.sim else 'unroll'}({n})"

    def e_alias(self) -> None:
        self.src(f"i_e = {self.e_expr}")

    def order_key(self, value: str) -> list[str]:
        """Statements leaving in ``i_kb`` the monotone uint32 image of the float32 ``value``.

        NaN orders as -inf and -0.0 as +0.0; branch-free: flip all bits of a negative float, set the
        sign bit of a positive one (so the image of -inf is 0x007FFFFF, above the rank classes 0/1).
        """
        kf, kb = self.sv("i_kf"), self.sv("i_kb")
        return [
            f"{kf} = {value}",
            f"{kb} = T.if_then_else(T.isnan({kf}), T.uint32(4286578688), T.reinterpret({kf}, \"uint32\"))",
            f"{kb} = T.if_then_else({kb} == T.uint32(2147483648), T.uint32(0), {kb})",
            f"{kb} = {kb} ^ (T.reinterpret(T.reinterpret({kb}, \"int32\") >> 31, \"uint32\") | T.uint32(2147483648))",
        ]

    def hoist_group_size(self, group_size: str) -> str:
        """Evaluate the group size once per row (an integer division must not sit in the slot loops)."""
        self.decl("i_gsz", "int32")
        with self.lanes():
            self.src(f"{self.sv('i_gsz')} = {self.render(group_size, 'row')}")
        return self.sv("i_gsz")

    # ---- steps ----------------------------------------------------------------------------
    def steps(self, steps) -> None:
        for st in steps:
            getattr(self, f"st_{type(st).__name__}")(st)

    def st_If(self, st: If) -> None:
        with self.src.block(f"if {self.render(st.cond, 'row', in_lanes=False)}"):
            self.steps(st.then)
        if st.orelse:
            with self.src.block("else"):
                self.steps(st.orelse)

    def st_Load(self, st: Load) -> None:
        inp = self.inputs[st.input]
        dt = inp.dtype or self.v.dtype
        u = f"u_{st.name}"
        self.decl(u, "float32", self.v.slots)
        L = self.p.length
        idx = (lambda e: f"i_row, {e}") if inp.per_row else (lambda e: e)
        fill = self.render(st.fill, "elem")

        def widen(x: str) -> str:
            if dt == "float32":
                return x
            if dt == "bfloat16" and self.sim:  # raw uint16 bits in the C simulation
                return f"T.reinterpret(T.cast({x}, \"uint32\") << T.uint32(16), \"float32\")"
            return f"T.cast({x}, \"float32\")"

        def scalar_path():
            with self.lanes(), self.src.block(self.slot_loop):
                self.e_alias()
                ld = widen(st.input + "[" + idx("i_e") + "]")
                self.src(f"{self.av(u, 'i_s')} = T.if_then_else(i_e < {L}, {ld}, {fill})")

        S, V = self.v.slots, self.v.vec
        # every slot array shares the layout of the row (VEC of the variant's dtype); one access is
        # at most 16 bytes, so that is all the alignment a wider input (fp32 bias of a bf16 row) needs
        vbytes = min(V * DTYPES[dt], 16)
        raw = f"i_ld_{st.name}"
        self.decl(raw, "uint16" if (self.sim and dt == "bfloat16") else dt, V)
        slot = f"i_c * {V} + i_v"
        # vectorized path: `L % V == 0` must be the *whole* condition of its own `if` (TileLang's
        # vectorizer takes it as a fact only then); the alignment test sits inside it.
        aligned = f"T.reinterpret(T.address_of({st.input}[{idx('0')}]), \"uint64\") % T.uint64({vbytes}) == T.uint64(0)"
        with self.src.block(f"if {L} % {V} == 0"):
            with self.src.block(f"if {aligned}"), self.lanes(), self.src.block(self.loop("i_c", S // V)):
                self.src(f"i_e0 = i_c * {32 * V} + lane * {V}")
                with self.src.block(f"if i_e0 < {L}"):
                    with self.src.block(f"for i_v in T.{'serial' if self.sim else 'vectorized'}({V})"):
                        self.src(f"{self.av(raw, 'i_v')} = {st.input}[{idx('i_e0 + i_v')}]")
                    with self.src.block(self.loop("i_v", V)):
                        self.src(f"{self.av(u, slot)} = {widen(self.av(raw, 'i_v'))}")
                with self.src.block("else"), self.src.block(self.loop("i_v", V)):
                    self.src(f"i_s = {slot}")
                    self.src("i_e = i_e0 + i_v")
                    self.src(f"{self.av(u, slot)} = {fill}")
            with self.src.block("else"):
                scalar_path()
        with self.src.block("else"):
            scalar_path()

    def st_Map(self, st: Map) -> None:
        u = f"u_{st.name}"
        ex = self.render(st.expr, "elem")
        with self.lanes():
            if st.dtype == "bool":
                self.decl(u, "uint32")
                self.src(f"{self.sv(u)} = T.uint32(0)")
                with self.src.block(self.slot_loop):
                    self.e_alias()
                    self.src(
                        f"{self.sv(u)} = {self.sv(u)} | T.if_then_else({ex}, T.uint32(1) << T.cast(i_s, \"uint32\"), T.uint32(0))"
                    )
            else:
                self.decl(u, "float32", self.v.slots)
                with self.src.block(self.slot_loop):
                    self.e_alias()
                    self.src(f"{self.av(u, 'i_s')} = {ex}")

    @staticmethod
    def _acc(op: str, acc: str, val: str) -> str:
        if op == "max":
            return f"T.call_extern(\"float32\", \"fmaxf\", {acc}, {val})"
        if op == "min":
            return f"T.call_extern(\"float32\", \"fminf\", {acc}, {val})"
        return f"({acc} + {val})"

    @staticmethod
    def _neutral(op: str) -> str:
        return {"max": _NEG_INF, "min": _POS_INF, "sum": "T.float32(0.0)"}[op]

    def st_Reduce(self, st: Reduce) -> None:
        u = f"u_{st.name}"
        self.decl(u, "float32")
        acc = self.sv(u)
        with self.lanes():
            self.src(f"{acc} = {self._neutral(st.op)}")
            if st.over == "row":
                ex = self.render(st.expr, "elem")
                cond = f"i_e < {self.p.length}"
                if st.where is not None:
                    cond = f"({cond}) and {self.render(st.where, 'elem')}"
                with self.src.block(self.slot_loop):
                    self.e_alias()
                    self.src(f"{acc} = {self._acc(st.op, acc, f'T.if_then_else({cond}, {ex}, {self._neutral(st.op)})')}")
            else:
                ex = self.render(st.expr, "k")
                cond = f"lane + 32 * i_q < {self.p.k}"
                if st.where is not None:
                    cond = f"({cond}) and {self.render(st.where, 'k')}"
                with self.src.block(self.loop("i_q", self.v.kq)):
                    self.src(f"{acc} = {self._acc(st.op, acc, f'T.if_then_else({cond}, {ex}, {self._neutral(st.op)})')}")
        self.butterfly([(u, "float32")], lambda m, o: [f"{m[0]} = {self._acc(st.op, m[0], o[0])}"])

    def st_GroupReduce(self, st: GroupReduce) -> None:
        u = f"u_{st.name}"
        GQ = self.v.gq
        qloop = self.loop("i_q", GQ)
        self.decl(u, "float32", GQ)
        kk = st.k if st.op == "topk_sum" else 1
        accs = [f"i_ga{i}" for i in range(kk)]
        for a in accs:
            self.decl(a, "float32")
        neutral = _NEG_INF if st.op in ("max", "topk_sum") else "T.float32(0.0)"
        with self.lanes(), self.src.block(qloop):
            self.src(f"{self.av(u, 'i_q')} = {neutral}")
        gs = self.hoist_group_size(st.group_size)
        ex = self.render(st.expr, "elem")
        self.decl("i_gv", "float32")
        self.decl("i_gt", "float32")
        gv, gt = self.sv("i_gv"), self.sv("i_gt")

        def insert(lst: list[str], val: str) -> list[str]:
            """Bubble ``val`` into the descending list ``lst`` (comparisons only: NaN is dropped)."""
            out = [f"{gv} = {val}"]
            for a in lst:
                out += [
                    f"{gt} = T.if_then_else({gv} > {a}, {a}, {gv})",
                    f"{a} = T.if_then_else({gv} > {a}, {gv}, {a})",
                    f"{gv} = {gt}",
                ]
            return out

        with self.src.block(f"for i_g in T.serial({self.render(st.n_groups, 'row', in_lanes=False)})"):
            with self.lanes():
                for a in accs:
                    self.src(f"{self.sv(a)} = {neutral}")
                self.src(f"i_glo = i_g * {gs}")
                cond = f"(i_e < {self.p.length}) and (T.cast(i_e - i_glo, \"uint32\") < T.cast({gs}, \"uint32\"))"
                if st.where is not None:
                    cond = f"{cond} and {self.render(st.where, 'elem')}"
                with self.src.block(self.slot_loop):
                    self.e_alias()
                    val = f"T.if_then_else({cond}, {ex}, {neutral})"
                    if st.op == "topk_sum":
                        for s in insert([self.sv(a) for a in accs], val):
                            self.src(s)
                    else:
                        self.src(f"{self.sv(accs[0])} = {self._acc(st.op, self.sv(accs[0]), val)}")

            def combine(mine: list[str], other: list[str]) -> list[str]:
                if st.op == "topk_sum":
                    out: list[str] = []
                    for o in other:
                        out += insert(mine, o)
                    return out
                return [f"{mine[0]} = {self._acc(st.op, mine[0], other[0])}"]

            self.butterfly([(a, "float32") for a in accs], combine)
            with self.lanes():
                total = " + ".join(self.sv(a) for a in accs)
                with self.src.block(qloop):
                    self.src(
                        f"{self.av(u, 'i_q')} = T.if_then_else(lane + 32 * i_q == i_g, {total}, {self.av(u, 'i_q')})"
                    )

    def st_GroupSelect(self, st: GroupSelect) -> None:
        u = f"u_{st.name}"
        GQ = self.v.gq
        qloop = self.loop("i_q", GQ)
        self.decl(u, "uint32")
        self.decl("i_gk", "uint64", GQ)
        self.decl("i_gm", "uint64")
        self.decl("i_gw", "int32")
        self.decl("i_kf", "float32")
        self.decl("i_kb", "uint32")
        score = self.render(st.score, "group")
        ng = self.render(st.n_groups, "row")
        gs = self.hoist_group_size(st.group_size)
        kb = self.sv("i_kb")
        with self.lanes():
            with self.src.block(qloop):
                for stmt in self.order_key(score):
                    self.src(stmt)
                key = (
                    f"(T.cast({kb}, \"uint64\") << T.uint64(32)) | "
                    f"T.cast({_U32_MAX} - T.cast(lane + 32 * i_q, \"uint32\"), \"uint64\")"
                )
                self.src(f"{self.av('i_gk', 'i_q')} = T.if_then_else(lane + 32 * i_q < {ng}, {key}, T.uint64(0))")
            self.src(f"{self.sv(u)} = T.uint32(0)")
        gm, gw = self.sv("i_gm"), self.sv("i_gw")
        with self.src.block(f"for i_r in T.serial({self.render(st.k, 'row', in_lanes=False)})"):
            with self.lanes():
                self.src(f"{gm} = T.uint64(0)")
                with self.src.block(qloop):
                    self.src(f"{gm} = T.if_then_else({self.av('i_gk', 'i_q')} > {gm}, {self.av('i_gk', 'i_q')}, {gm})")
            self.butterfly([("i_gm", "uint64")], lambda m, o: [f"{m[0]} = T.if_then_else({o[0]} > {m[0]}, {o[0]}, {m[0]})"])
            with self.lanes():
                self.src(f"{gw} = T.cast({_U32_MAX} - T.cast({gm} & T.uint64(4294967295), \"uint32\"), \"int32\")")
                with self.src.block(qloop):
                    self.src(
                        f"{self.av('i_gk', 'i_q')} = T.if_then_else(lane + 32 * i_q == {gw}, T.uint64(0), {self.av('i_gk', 'i_q')})"
                    )
                self.src(f"i_glo = {gw} * {gs}")
                with self.src.block(self.slot_loop):
                    self.e_alias()
                    self.src(
                        f"{self.sv(u)} = {self.sv(u)} | T.if_then_else(T.cast(i_e - i_glo, \"uint32\") < T.cast({gs}, \"uint32\"), "
                        f"T.uint32(1) << T.cast(i_s, \"uint32\"), T.uint32(0))"
                    )

    def st_TopK(self, st: TopK) -> None:
        S, V, KQ = self.v.slots, self.v.vec, self.v.kq
        qloop = self.loop("i_q", KQ)
        uid = f"u_{st.ids}"
        self.decl(uid, "int32", KQ)
        self.decl("i_hi", "uint32", S)
        self.decl("i_bh", "uint32")
        self.decl("i_be", "uint32")
        self.decl("i_key", "uint64")
        self.decl("i_win", "int32")
        self.decl("i_kf", "float32")
        self.decl("i_kb", "uint32")
        gathers = []
        for out, ex in st.gather:
            self.decl(f"u_{out}", "float32", KQ)
            self.decl(f"i_gv_{out}", "float32")
            gathers.append((f"u_{out}", f"i_gv_{out}", self.render(ex, "elem")))
        key = self.render(st.key, "elem")
        where = self.render(st.where, "elem") if st.where is not None else None
        kb = self.sv("i_kb")
        L = self.p.length
        # rank classes: 0 unavailable, 1 fails `where`, else orderable(key) >= 0x007FFFFF
        with self.lanes():
            with self.src.block(qloop):
                self.src(f"{self.av(uid, 'i_q')} = 0")
                for u, _g, _ex in gathers:
                    self.src(f"{self.av(u, 'i_q')} = T.float32(0.0)")
            with self.src.block(self.slot_loop):
                self.e_alias()
                for stmt in self.order_key(key):
                    self.src(stmt)
                if where is not None:
                    self.src(f"{kb} = T.if_then_else({where}, {kb}, T.uint32(1))")
                self.src(f"{self.av('i_hi', 'i_s')} = T.if_then_else(i_e < {L}, {kb}, T.uint32(0))")
        bh, be, kk, win = self.sv("i_bh"), self.sv("i_be"), self.sv("i_key"), self.sv("i_win")
        with self.src.block(f"for i_r in T.serial({self.render(st.k, 'row', in_lanes=False)})"):
            with self.lanes():
                self.src(f"{bh} = T.uint32(0)")
                self.src(f"{be} = {_U32_MAX}")
                for _u, g, _ex in gathers:
                    self.src(f"{self.sv(g)} = T.float32(0.0)")
                with self.src.block(self.slot_loop):
                    self.e_alias()
                    better = f"{self.av('i_hi', 'i_s')} > {bh}"
                    for _u, g, ex in gathers:
                        self.src(f"{self.sv(g)} = T.if_then_else({better}, {ex}, {self.sv(g)})")
                    self.src(f"{be} = T.if_then_else({better}, T.cast(i_e, \"uint32\"), {be})")
                    self.src(f"{bh} = T.if_then_else({better}, {self.av('i_hi', 'i_s')}, {bh})")
                if self.v.warp_argmax == "shfl64":
                    self.src(f"{kk} = (T.cast({bh}, \"uint64\") << T.uint64(32)) | T.cast({_U32_MAX} - {be}, \"uint64\")")
            if self.v.warp_argmax == "shfl64":
                # one uint64 max: the rank word decides, the low word (0xFFFFFFFF - e) breaks ties low
                self.butterfly([("i_key", "uint64")], lambda m, o: [f"{m[0]} = T.if_then_else({o[0]} > {m[0]}, {o[0]}, {m[0]})"])
                with self.lanes():
                    self.src(f"{win} = T.cast({_U32_MAX} - T.cast({kk} & T.uint64(4294967295), \"uint32\"), \"int32\")")
            else:
                self.decl("i_rm", "uint32")
                rm = self.sv("i_rm")
                with self.lanes():
                    self.src(f"{rm} = {bh}")
                self.reduce_u32("i_rm", "max")
                with self.lanes():
                    self.src(f"{rm} = T.if_then_else({bh} == {rm}, {be}, {_U32_MAX})")
                self.reduce_u32("i_rm", "min")
                with self.lanes():
                    self.src(f"{win} = T.cast({rm}, \"int32\")")
            owner = f"({win} % {32 * V}) // {V}"
            for _u, g, _ex in gathers:
                self.bcast(g, "float32", owner)
            with self.lanes():
                with self.src.block(self.slot_loop):
                    self.e_alias()
                    self.src(f"{self.av('i_hi', 'i_s')} = T.if_then_else(i_e == {win}, T.uint32(0), {self.av('i_hi', 'i_s')})")
                with self.src.block(qloop):
                    mine = "i_r == lane + 32 * i_q"
                    self.src(f"{self.av(uid, 'i_q')} = T.if_then_else({mine}, {win}, {self.av(uid, 'i_q')})")
                    for u, g, _ex in gathers:
                        self.src(f"{self.av(u, 'i_q')} = T.if_then_else({mine}, {self.sv(g)}, {self.av(u, 'i_q')})")

    def st_Epilogue(self, st: Epilogue) -> None:
        u = f"u_{st.name}"
        self.decl(u, "float32", self.v.kq)
        ex = self.render(st.expr, "k")
        with self.lanes(), self.src.block(self.loop("i_q", self.v.kq)):
            self.src(f"{self.av(u, 'i_q')} = {ex}")

    def st_Store(self, st: Store) -> None:
        out = self.outputs[st.output]
        ex = self.render(st.expr, "k")
        valid = f"if lane + 32 * i_q < {self.p.k}"
        with self.lanes(), self.src.block(self.loop("i_q", self.v.kq)), self.src.block(valid):
            self.src(f"{st.output}[i_row, lane + 32 * i_q] = T.cast({ex}, \"{out.dtype}\")")

    # ---- the whole program ------------------------------------------------------------------
    def emit(self, symbol: str) -> str:
        p, v = self.p, self.v
        body = _Src()
        self.src = body
        body.depth = 3 if self.sim else 4
        self.steps(p.steps)

        params = []
        for i in p.inputs:
            dt = i.dtype or v.dtype
            if self.sim and dt == "bfloat16":
                dt = "uint16"
            shape = f"({p.rows}, {p.length})" if i.per_row else f"({p.length},)"
            params.append(f"{i.name}: T.Tensor({shape}, \"{dt}\")")
        for o in p.outputs:
            params.append(f"{o.name}: T.Tensor(({p.rows}, {p.k}), \"{o.dtype}\")")
        for q in p.params:
            params.append(f"{q.name}: T.{q.dtype}")

        out = _Src()
        digest = hashlib.sha256(repr(p).encode()).hexdigest()[:16]
        backend = "cpu_sim" if self.sim else "cuda"
        out(f"# Generated by redfuser-ops {TEMPLATE_VERSION} from generator/codegen/templates/resident_row.py; do not edit.")
        out(f"# program: {p.name} (digest {digest})")
        out(f"# variant: dtype={v.dtype} e_cap={v.e_cap} family={v.family} rows_per_cta={v.rows_per_cta} "
            f"k_max={v.k_max} g_max={v.g_max} warp_argmax={v.warp_argmax} slots={v.slots} vec={v.vec} "
            f"backend={backend}")
        out("import tilelang.language as T")
        out("")
        out(f"KERNEL_SYMBOL = {symbol!r}")
        out(f"BACKEND = {backend!r}")
        out(f"TARGET_ARCH = {(v.arch if not self.sim else 'c')!r}")
        out(f"THREADS = {32 if not self.sim else 1} * {v.rows_per_cta if not self.sim else 1}")
        out(f"ROWS_PER_CTA = {v.rows_per_cta if not self.sim else 1}")
        out(f"PARAM_ORDER = {tuple(x.split(':')[0] for x in params)!r}  # then the dynamic dims, then the stream")
        dims: list[str] = []
        for shape in [(p.rows, p.length) if i.per_row else (p.length,) for i in p.inputs] + [(p.rows, p.k)] * len(p.outputs):
            dims += [d for d in shape if d not in dims]
        out(f"DYNAMIC_DIMS = {tuple(dims)!r}  # in order of first appearance: the launcher's trailing ints")
        out(f"PRECONDITIONS = {tuple(preconditions(p, v))!r}")
        out("PASS_CONFIGS = {}")
        out("")
        out("")
        out("def make_prim_func():")
        out.depth = 1
        out(f"{p.rows}, {p.length}, {p.k} = T.dynamic(\"{p.rows}, {p.length}, {p.k}\")")
        out("")
        out("@T.prim_func")
        out(f"def {symbol}(")
        for prm in params:
            out(f"    {prm},")
        out("):")
        out.depth = 2
        if self.sim:
            out(f"with T.Kernel({p.rows}, threads=1) as bx:")
            out.depth = 3
            out("i_row = bx")
        else:
            R = v.rows_per_cta
            out(f"with T.Kernel(T.ceildiv({p.rows}, {R}), threads={32 * R}) as bx:")
            out.depth = 3
            out("i_tx = T.get_thread_binding(0)")
            out("lane = i_tx % 32")
            out(f"i_row = bx * {R} + i_tx // 32")
        for nm in sorted(self.decls):
            dt, n = self.decls[nm]
            if self.sim:
                shape = "(32,)" if n is None else f"(32, {n})"
                out(f"{nm} = T.alloc_local({shape}, \"{dt}\")")
            elif n is None:
                out(f"{nm} = T.alloc_var(\"{dt}\")")
            else:
                out(f"{nm} = T.alloc_local(({n},), \"{dt}\")")
        if self.sim:
            out.lines += body.lines
        else:
            out(f"if i_row < {p.rows}:")
            out.lines += body.lines
        out.depth = 1
        out("")
        out(f"return {symbol}")
        return "\n".join(out.lines) + "\n"


def emit_resident_row_program(
    program: StepProgram, variant: RowVariant, symbol: str | None = None, backend: str = "cuda"
) -> str:
    """Python source (a module with ``make_prim_func()``) of one variant of ``program``.

    Kernel arguments, in order: the inputs, the outputs, the params; the launcher appends the
    dynamic dims (rows, length, k) and the stream.  ``backend="cpu_sim"`` gives the lane-explicit
    simulation for TileLang's ``"c"`` target (see the module docstring).
    """
    symbol = symbol or variant.variant_name(program.name)
    if not symbol.isidentifier():
        raise ValueError(f"symbol {symbol!r} is not an identifier")
    return _Emitter(program, variant, backend).emit(symbol)


def replace(variant: RowVariant, **kw) -> RowVariant:
    return dataclasses.replace(variant, **kw)

