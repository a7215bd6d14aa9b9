"""Derived forms -> C++ CPU kernels, one function per specialisation, parallel over rows.

The kernel is the online form, literally: for each row, for each pass, the reduction axis is processed in
chunks; per chunk the element values are computed once, then the states of the pass are updated level by
level (a state's correction c(D_old -> D_new) is applied, then the chunk's terms are folded in), guards give
the safe values, resident (epilogue) reductions run after their pass, and the outputs are written from the
final states. Every formula is printed from the engine's sympy forms; nothing here knows an op.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import sympy as sp

from ..spec import OpSpec, ScalarArg, TensorArg
from ..symbolic.algebra import MONOIDS
from ..symbolic.expr import (
    cast_bfloat16,
    cast_e4m3,
    cast_float16,
    entrysum,
    idiv,
    is_bool,
    isin,
)
from ..symbolic.forms import Analysis, OpAnalysis, ReductionForm, element_atoms
from ..symbolic.order import Condition, increasing_in
from .cpp import CppPrinter, float_literal, let_type
from .cpu_params import (
    CHUNK,
    LANES,
    ROW_CHUNK,
    ROW_TASK_ELEMENTS,
    SEL_CHUNK,
    TARGET_CLONES,
    TCACHE_MAX,
    UNROLL,
)
from .cpu_tiles import (
    RBLK,
    block_chunk,
    block_dispatch,
    block_plan,
    block_storage,
    emit_blocked,
    emit_fold_weights,
    split_axis,
)


@dataclass
class TermCache:
    """A sum's terms kept per element of the row, so that a per-element output that is the term times a row
    constant (softmax's exp(y - m) / l is exp(y - m_c) times exp(m_c - m) / l, m_c the max when the element's
    chunk was summed) costs a multiplication instead of a second exp. `states` are the chunk-time states in the
    term, saved per chunk as the ratio's `fresh` symbols; `ratios` the outputs' row constants."""

    form: str
    states: list[tuple[sp.Symbol, sp.Symbol]]  # (state symbol in the term, its per-chunk copy in the ratios)
    ratios: dict[str, sp.Expr]


CPP_TYPES = {
    "float32": "float",
    "float16": "rf::half_t",
    "bfloat16": "rf::bf16_t",
    "float8_e4m3fn": "rf::e4m3_t",
    "int32": "int32_t",
    "int64": "int64_t",
}


def _sel_fields(analysis: Analysis) -> dict[str, ReductionForm]:
    return {f.name: f for f in analysis.reductions if f.selection}


# --------------------------------------------------------------------------------------------- types
@dataclass(frozen=True)
class TypeParam:
    """A template parameter of the kernels: the element type of one or more tensors, chosen at run time."""

    name: str  # "T_q"
    field: str  # Args member holding the runtime dtype, e.g. "dt_q"
    dtypes: tuple[str, ...]


FLOATS = ("float32", "float16", "bfloat16")


def _pin(f: ReductionForm) -> tuple[str, sp.Expr] | None:
    """(g, value) where a reduction's where is (value == g) for its one free index g: each element belongs to exactly
    one g (a per-group selection's where=group == g)."""
    where = f.where
    if len(f.free) != 1 or not isinstance(where, sp.Eq):
        return None
    for side, other in ((where.lhs, where.rhs), (where.rhs, where.lhs)):
        if isinstance(side, sp.Symbol) and side.name == f.free[0]:
            return side.name, other
    return None


def float_inputs(spec: OpSpec) -> list[str]:
    """Floating-point tensor arguments: the glue hands them to the CPU kernels as float32 (a half-precision input
    converted once), except the native ones (native_inputs), which keep their dtype and get a unit last stride."""
    out = []
    for t in spec.tensors:
        dts = spec.arg(t.same_as).dtypes if t.same_as else t.dtypes
        if dts and set(dts) <= set(FLOATS):
            out.append(t.name)
    return out


def _tensor_reads(e) -> set[str]:
    if not isinstance(e, sp.Basic):
        return set()
    return {str(x.base.label) for x in e.atoms(sp.Indexed)}


def native_inputs(op: OpAnalysis) -> set[str]:
    """Floating inputs that the CPU kernels read in their own dtype instead of the whole tensor converted to float32
    by the glue per call. Where any specialisation is a row kernel: all of them (each element is widened where it is
    read, by branch-free bit arithmetic that vectorises; the glue's conversion was a second pass over the input and a
    float32 copy twice its size: a log-sum-exp over bf16 rows of 128k, 1 thread: 1.80 -> 1.49 ms). Where every
    specialisation is a block kernel: the tensors read only as a streamed factor of its GEMM tiles, widened per
    packed tile in the pack loops (the whole paged MLA cache, referenced or not, otherwise), or as a contraction's
    row factor (the q row of q . k, widened into its row buffer once per row, or taken as it is for bf16 pairs: the
    glue's float32 copy of a bf16 q and the kernel's read of it were ~4 % of bf16 attention's time)."""
    spec = op.spec
    floats = float_inputs(spec)
    types = {t.name: "float" for t in spec.tensors}
    out: set[str] | None = None
    for n, a in enumerate(op.cases):
        k = _Kernel(spec, a, n, types, native=set())
        if k.plan is None:  # a row kernel: every floating input is read in its own dtype
            return set(floats)
        packed = set().union(*[_tensor_reads(g.elem) for g in k.plan.sums],
                             *[_tensor_reads(g.inner) for g in k.plan.folds.values()])
        # a contraction's row factor (the q row of q . k) is read once per row into its row buffer, widened there
        planned = {g.key for g in k.plan.sums}
        packed |= {key[0] for _, _, key in k.hoist_targets() if key in planned}
        sums = {g.s: sp.Symbol(f"_packed_sum{i}") for i, g in enumerate(k.plan.sums)}
        elsewhere: set[str] = set()
        for let in a.ir.lets:
            elsewhere |= _tensor_reads(let.expr.xreplace(sums) if isinstance(let.expr, sp.Basic) else let.expr)
        elsewhere |= _tensor_reads(a.ir.mask)
        for f in a.reductions:
            if f.name not in k.plan.folds:
                elsewhere |= _tensor_reads(f.body) | _tensor_reads(f.term) | _tensor_reads(f.where)
            else:  # the fold's weight is computed per row; only its streamed factor is packed
                elsewhere |= _tensor_reads(k.plan.folds[f.name].outer) | _tensor_reads(f.where)
            for p in f.payloads:
                elsewhere |= _tensor_reads(p.term)
        for o in a.outputs:
            elsewhere |= _tensor_reads(o.value)
        mine = {t for t in packed if t in floats and t not in elsewhere}
        out = mine if out is None else out & mine
    return out or set()


def type_params(spec: OpSpec, native: set[str] | frozenset[str] = frozenset()) -> tuple[dict[str, str], list[TypeParam]]:
    """C++ element type (a literal type or a template parameter name) of every tensor argument and output.
    Floating inputs are float (converted by the glue) except the `native` ones, which share one template parameter
    per group of tensors of one dtype (k and v: the dtype of q)."""
    types: dict[str, str] = {}
    params: list[TypeParam] = []
    floats = float_inputs(spec)
    groups: dict[str, str] = {}
    for t in spec.tensors:
        if t.name in native:
            base = t.same_as or t.name
            if base not in groups:
                groups[base] = f"T_{t.name}"
                dts = spec.variants.cpu_dtypes if base == spec.tensors[0].name else spec.arg(base).dtypes
                params.append(TypeParam(f"T_{t.name}", f"dt_{t.name}", tuple(d for d in dts if d in CPP_TYPES)))
            types[t.name] = groups[base]
        elif t.name in floats:
            types[t.name] = "float"
        elif t.same_as:
            types[t.name] = types[t.same_as]
        elif len(t.dtypes) == 1:
            types[t.name] = CPP_TYPES[t.dtypes[0]]
        else:
            types[t.name] = f"T_{t.name}"
            params.append(TypeParam(f"T_{t.name}", f"dt_{t.name}", tuple(d for d in t.dtypes if d in CPP_TYPES)))
    for o in spec.outputs:
        key = f"out:{o.name}"
        if o.dtype in CPP_TYPES:
            types[key] = CPP_TYPES[o.dtype]
        elif o.dtype in types or " or " in o.dtype:  # follows an input's dtype (or a ScalarType argument)
            src = o.dtype.split(" or ")[-1].strip()
            base = spec.arg(src)
            if " or " not in o.dtype and (base.same_as or src) in groups:  # the dtype of a native group: its type
                types[key] = groups[base.same_as or src]
                continue
            dts = (spec.arg(base.same_as).dtypes if base.same_as else base.dtypes) if " or " not in o.dtype else FLOATS
            if src == spec.tensors[0].name and " or " not in o.dtype:
                dts = spec.variants.cpu_dtypes
            types[key] = f"T_out_{o.name}"
            params.append(TypeParam(f"T_out_{o.name}", f"odt_{o.name}", tuple(d for d in dts if d in CPP_TYPES)))
        else:
            raise ValueError(f"{spec.name}: output dtype '{o.dtype}' is not understood")
    return types, params


# --------------------------------------------------------------------------------------------- one kernel
class _Kernel:
    def __init__(self, spec: OpSpec, a: Analysis, index: int, types: dict[str, str], native: set[str]):
        self.spec = spec
        self.a = a
        self.ir = a.ir
        self.index = index
        self.types = types
        self.lines: list[str] = []
        self.ind = 1
        self.tmp = 0
        self.sels = _sel_fields(a)
        self.hoisted: dict[sp.Basic, str] = {}  # row-invariant contraction factors -> row buffers
        self.local: dict[sp.Basic, str] = {}  # temporaries (cse, contractions)
        self.wsums: dict[str, str] = {}  # a fold weights' buffer -> the variable holding their sum (rf::exp_sum)
        self.pr = CppPrinter(self.resolve, selects=True)
        self.floats = set(float_inputs(spec))  # unit last-dimension stride (the glue sees to it)
        self.native = native  # read in their own dtype (see native_inputs)
        self.tabled = self.row_invariant_lets()
        self.key_arrays = {f.name for f in a.reductions if f.stage == "stream" and self.precomputed_key(f)}
        self.exprs = self.kernel_exprs()
        self.members = self.member_tables()
        self.plan = block_plan(self)
        # selections made on an element value their key increases with (by_value), under a per-row condition
        self.byv = {f.name: bv for f in a.reductions if (bv := self.by_value(f)) is not None}
        self.skips = self.skippable_passes()
        self.cols = split_axis(self) if self.plan is not None else None  # columns split across tasks (cpu_tiles)
        # rows of plain element math (no block plan, selection, carried index or contraction) stream in longer
        # chunks: the per-chunk work (the states' corrections, folding the vector lanes) is then a small part
        plain = self.plan is None and not any(f.selection or f.free for f in a.reductions) and \
            not any(let.expr.has(sp.Sum) for let in self.ir.element_lets if isinstance(let.expr, sp.Basic))
        # (a selection's kernel: fewer, longer chunks offer fewer candidates to the scalar insertion, k per chunk,
        # and scan for them once per row of up to 256 elements, a router's whole row)
        if plain:
            self.chunk = ROW_CHUNK
        elif self.plan is not None:
            self.chunk = block_chunk(self)
        else:
            self.chunk = SEL_CHUNK if any(f.selection for f in a.reductions) else CHUNK
        self.tcache = self.term_cache() if plain and len(a.passes) == 1 else None
        for f in a.reductions:
            for d in f.online_deps:
                dep = a.form(d)
                if dep.free or dep.selection:
                    raise NotImplementedError(
                        f"{spec.name}: '{f.name}' is corrected for '{d}', a state carried over free indices or a "
                        "selection; the CPU emitter corrects only for scalar states")

    # ------------------------------------------------------------------ output helpers
    def emit(self, line: str = "") -> None:
        self.lines.append(("  " * self.ind + line) if line else "")

    def block(self, head: str) -> None:
        self.emit(f"{head} {{" if head else "{")
        self.ind += 1

    def end(self, tail: str = "}") -> None:
        self.ind -= 1
        self.emit(tail)

    def fresh(self, stem: str) -> str:
        self.tmp += 1
        return f"{stem}{self.tmp}"

    # ------------------------------------------------------------------ names
    def resolve(self, e: sp.Basic) -> str | None:
        ir = self.ir
        if e in self.local:
            return self.local[e]
        if isinstance(e, sp.Symbol):
            n = e.name
            if n in ir.indices and ir.indices[n] == e:
                return f"ix_{n}"
            if n in ir.axes and ir.axes[n] == e:
                return f"sz_{n}"
            if n in ir.scalars and ir.scalars[n] == e:
                return f"p_{n}"
            for let in ir.lets:
                if let.symbol == e:
                    if let.kind == "row":
                        return f"lt_{n}"
                    return f"el_{n}[jj]"
            for s, roles in self.a.symbols.items():
                for role, sym in roles.items():
                    if sym == e:
                        if role == "cur":
                            return self.state_ref(s)
                        return f"st_{s}_{role}"
            return None
        if isinstance(e, sp.Indexed):
            label = str(e.base.label)
            if label in ir.tensors:
                return self.tensor_read(label, e.indices)
            if "." in label:
                sel, fld = label.split(".", 1)
                return self.sel_ref(sel, fld, e.indices[0])
            return None
        if isinstance(e, entrysum):
            sel, fld = str(e.args[0].label).split(".", 1)
            f = self.sels[sel]
            off = self.free_offset(f)
            return f"rf::sel_sum({self.sel_array(sel, fld)} + {off}, st_{sel}_ok + {off}, K_{sel})"
        if isinstance(e, isin):
            sel, _ = str(e.args[1].label).split(".", 1)
            if sel in self.members:
                over = self.ir.reduction(sel).over
                member = f"rf::sel_member(mem_{sel}, ex_{over}, {self.pr(e.args[0])})"
                # a table of all ones (its pass skipped): no load per element (the loop is unswitched on all_)
                return f"(all_{sel} || {member})" if sel in self.skipped_sels() else member
            f = self.sels[sel]
            off = self.free_offset(f)
            return f"rf::sel_has(st_{sel}_idx + {off}, st_{sel}_ok + {off}, K_{sel}, {self.pr(e.args[0])})"
        if isinstance(e, sp.Sum):
            raise TypeError(f"contraction {e} outside a let")
        return None

    def tensor_read(self, name: str, indices: tuple) -> str:
        if (name, tuple(indices)) in self.hoisted:
            return self.hoisted[(name, tuple(indices))]
        return f"rf::ld({self.tensor_element(name, indices)})"

    def tensor_element(self, name: str, indices: tuple) -> str:
        """The C++ lvalue of one element of input `name`."""
        last = len(indices) - 1
        unit = name in self.floats  # the glue gives float inputs a unit last-dimension stride
        off = " + ".join(f"({self.pr(i)})" if (unit and d == last) else f"({self.pr(i)}) * st_{name}[{d}]"
                         for d, i in enumerate(indices))
        return f"t_{name}[{off}]"

    def free_offset(self, f: ReductionForm) -> str:
        if not f.free:
            return "0"
        out = f"ix_{f.free[0]}"
        for n in f.free[1:]:
            out = f"({out}) * ex_{n} + ix_{n}"
        return f"({out}) * K_{f.name}" if f.selection else out

    def bounds(self, n: str) -> tuple[str, str]:
        """The range of free index n this kernel covers: all of it, or a task's columns (cpu_tiles.split_axis)."""
        return ("col_lo", "col_hi") if n == self.cols else ("0", f"ex_{n}")

    def state_span(self, f: ReductionForm) -> tuple[str, str]:
        """The part [lo, hi) of a state with free indices (flat) that this kernel initialises and corrects: a task's
        columns where the state is carried over the split index alone, else all of it."""
        if f.free == (self.cols,):
            return self.bounds(self.cols)
        return "0", " * ".join(f"ex_{n}" for n in f.free)

    def state_ref(self, name: str) -> str:
        f = self.a.form(name)
        if f.free:
            return f"st_{name}[{self.free_offset(f)}]"
        return f"st_{name}"

    def sel_array(self, sel: str, field: str) -> str:
        if field == "value":
            return f"st_{sel}_key"
        if field == "index":
            return f"st_{sel}_idx"
        return f"st_{sel}_pl_{field}"

    def sel_ref(self, sel: str, field: str, entry: sp.Basic) -> str:
        f = self.sels[sel]
        return f"{self.sel_array(sel, field)}[{self.free_offset(f)} + {self.pr(entry)}]"

    # ------------------------------------------------------------------ the function
    def function(self, template: list[str]) -> str:
        ir = self.ir
        head = f"template <{', '.join('class ' + t for t in template)}>\n" if template else ""
        if self.plan is not None:
            return emit_blocked(self, head)
        name = f"rows_case{self.index}"
        self.lines = []
        self.preamble()
        self.block("for (int64_t row = row_begin; row < row_end; ++row)")
        self.decode_row()
        for p in self.a.passes:
            self.run_pass(p.number)
        self.outputs()
        self.end()
        body = "\n".join(self.lines)
        label = ir.label
        return (f"// specialisation {label}\n{head}{TARGET_CLONES}static void {name}(const Args& A, int64_t row_begin, "
                f"int64_t row_end) {{\n{body}\n}}\n")

    def preamble(self) -> None:
        ir, spec = self.ir, self.spec
        for t in spec.tensors:
            self.emit(f"const {self.types[t.name]}* __restrict__ t_{t.name} = "
                      f"static_cast<const {self.types[t.name]}*>(A.t_{t.name});")
            self.emit(f"const int64_t* st_{t.name} = A.st_{t.name};")
        for o in spec.outputs:
            ty = self.types[f"out:{o.name}"]
            self.emit(f"{ty}* __restrict__ o_{o.name} = static_cast<{ty}*>(A.o_{o.name});")
            self.emit(f"const int64_t* ost_{o.name} = A.ost_{o.name};")
        for n in ir.axes:
            self.emit(f"const int64_t sz_{n} = A.sz_{n};")
        for n, s in ir.scalars.items():
            ty = "int64_t" if s.is_integer else "float"
            self.emit(f"const {ty} p_{n} = static_cast<{ty}>(A.p_{n});")
        for n, ext in ir.extents.items():
            self.emit(f"const int64_t ex_{n} = {self.pr(ext)};")
        self.emit(f"(void)sz_{next(iter(ir.axes))};")
        # selection sizes and storage
        for f in self.a.reductions:
            if f.selection:
                self.emit(f"const int64_t K_{f.name} = std::max<int64_t>(1, {self.pr(f.k)});")
        for f in self.a.reductions:
            size = " * ".join([f"ex_{n}" for n in f.free] or ["int64_t(1)"])
            if f.selection:
                total = f"({size}) * K_{f.name}"
                self.emit(f"std::vector<float> buf_{f.name}_key({total});")
                self.emit(f"std::vector<int64_t> buf_{f.name}_idx({total});")
                self.emit(f"std::vector<uint8_t> buf_{f.name}_ok({total});")
                self.emit(f"float* st_{f.name}_key = buf_{f.name}_key.data();")
                self.emit(f"int64_t* st_{f.name}_idx = buf_{f.name}_idx.data();")
                self.emit(f"uint8_t* st_{f.name}_ok = buf_{f.name}_ok.data();")
                for p in f.payloads:
                    self.emit(f"std::vector<float> buf_{f.name}_pl_{p.name}({total});")
                    self.emit(f"float* st_{f.name}_pl_{p.name} = buf_{f.name}_pl_{p.name}.data();")
                if f.name in self.members:
                    self.emit(f"std::vector<uint8_t> buf_mem_{f.name}(std::max<int64_t>(1, ex_{self.ir.reduction(f.name).over}));")
                    self.emit(f"uint8_t* mem_{f.name} = buf_mem_{f.name}.data();")
                if self.pinned_value(f) is not None:  # each set's bar (rf::sel_offers), kept by the insertions
                    self.emit(f"std::vector<int32_t> buf_{f.name}_bar({size});")
                    self.emit(f"int32_t* bar_{f.name} = buf_{f.name}_bar.data();")
            elif self.plan is not None:  # one state per row of a block, bound per row (cpu_tiles.bind_row)
                self.emit(f"std::vector<float> buf_{f.name}(({size}) * {RBLK});")
                self.emit(f"float* bst_{f.name} = buf_{f.name}.data();")
            elif f.free:
                self.emit(f"std::vector<float> buf_{f.name}({size});")
                self.emit(f"float* st_{f.name} = buf_{f.name}.data();")
        if self.plan is not None:
            block_storage(self)
        else:
            self.chunk_storage()
        self.hoist_buffers()
        self.let_tables()

    def chunk_storage(self) -> None:
        """Element arrays of one chunk of one row."""
        ir = self.ir
        for let in ir.element_lets:
            ty = let_type(let)
            self.emit(f"{ty} el_{let.name}[{self.chunk}];")
        self.emit(f"uint8_t el_ok[{self.chunk}];   // mask holds")
        self.emit(f"uint8_t el_cnt[{self.chunk}];  // counted by non-selection reductions (mask, not the mask value)")
        if self.tcache is not None:
            ch = self.chunk
            self.emit(f"// the terms of {self.tcache.form}, kept for the per-element outputs (TermCache); a row longer "
                      f"than {TCACHE_MAX} keeps none (tc_n 0: every chunk writes the first {ch})")
            self.emit(f"const int64_t tc_n = ex_{ir.over} <= {TCACHE_MAX} ? ex_{ir.over} : 0;")
            self.emit(f"const int64_t tc_chunks = (tc_n + {ch - 1}) / {ch};")
            self.term_out_flag()
            self.emit("// (not zeroed: every element a row reads back was written by its chunk)")
            self.emit(f"std::unique_ptr<float[]> tcache_v(new float[tc_out ? 1 : tc_n + {ch}]);")
            self.emit("float* tcache = tcache_v.get();")
            self.emit("std::vector<float> tcr_v(tc_chunks + 1);")
            self.emit("float* tcr = tcr_v.data();")
            for n, (x, _fresh) in enumerate(self.tcache.states):
                self.emit(f"std::vector<float> tcm{n}_v(tc_chunks + 1);  // {x} per chunk")
                self.emit(f"float* tcm{n} = tcm{n}_v.data();")
        for f in self.a.reductions:
            if f.name in self.key_arrays:
                self.emit(f"float elk_{f.name}[{self.chunk}];  // selection keys of a chunk, computed branch-free")

    def term_cache(self) -> TermCache | None:
        """The sum whose terms serve the per-element outputs over the streamed axis (see TermCache), or None: the
        ratio output / term (the term's states replaced by their per-chunk copies) must not depend on the
        element. It is proved by simplification, which holds for finite values; the output checks at run time
        that every chunk's ratio is finite and recomputes the elements otherwise."""
        a, ir = self.a, self.ir
        outs = [o for o in a.outputs if o.per_element and o.index[-1] == ir.over
                and [n for n in o.index if n not in ir.rows] == [ir.over]]
        if not outs:
            return None
        state_syms = {sym for roles in a.symbols.values() for sym in roles.values()}
        for level in self.levels([f for f in a.reductions if f.stage == "stream"]):
            scalar, _rest = self.level_split(level)
            for f in scalar:
                if f.op != "sum" or f.term is None:
                    continue
                states = [(x, sp.Symbol(f"tcm{n}", real=True))
                          for n, x in enumerate(sorted(f.term.free_symbols & state_syms, key=str))]
                term = f.term.xreplace(dict(states))
                ratios = {}
                for o in outs:
                    r = sp.simplify(self.stored_value(o) / term)
                    if not element_atoms(ir, r) and not r.has(sp.Sum) and r.is_finite is not False:
                        ratios[o.name] = r
                if ratios:
                    return TermCache(f.name, states, ratios)
        return None

    def stored_value(self, o: Any) -> sp.Basic:
        """An output's value, less a rounding to its own type that the store does anyway."""
        store_rounds = {"rf::e4m3_t": cast_e4m3, "rf::half_t": cast_float16, "rf::bf16_t": cast_bfloat16}
        value = o.value
        if type(value) is store_rounds.get(self.types.get(f"out:{o.name}", "")):
            value = value.args[0]  # the store rounds to the output's type: the same value, one conversion
        return value

    def row_invariant_lets(self) -> set[str]:
        """Element lets that depend on the reduction index and on sizes and scalar arguments only (the expert group
        of e, e // (E / n_group)): the same for every row, so they are computed once per call into a table instead
        of once per row and pass (an integer division per element and pass otherwise). Without a mask every
        element's value is needed anyway; under a mask only division-free expressions are tabled, since a masked
        element's value is never computed in the row loop (unless the mask itself reads it)."""
        ir = self.ir
        allowed = {ir.indices[ir.over], *ir.axes.values(), *ir.scalars.values()}
        mask_read = self.mask_lets()
        out = set()
        for let in ir.element_lets:
            e = let.expr
            if not isinstance(e, sp.Expr) or e.atoms(sp.Indexed) or e.atoms(sp.Sum):
                continue
            if not e.free_symbols <= allowed or ir.indices[ir.over] not in e.free_symbols:
                continue
            if (ir.mask not in (sp.true, True) and let.name not in mask_read
                    and e.atoms(idiv, sp.Mod, sp.floor, sp.ceiling)):
                continue
            out.add(let.name)
        return out

    def let_tables(self) -> None:
        ir = self.ir
        for let in self.sorted_element_lets():
            if let.name not in self.tabled:
                continue
            ty = let_type(let)
            self.emit(f"std::vector<{ty}> tab_{let.name}(ex_{ir.over});  // row-invariant element let")
            self.emit(f"for (int64_t ix_{ir.over} = 0; ix_{ir.over} < ex_{ir.over}; ++ix_{ir.over}) "
                      f"tab_{let.name}[ix_{ir.over}] = {self.pr.val(let.expr, let.symbol)};")

    def member_tables(self) -> set[str]:
        """Selections over a resident index (no free index) that an isin reads: once complete, each row marks its
        selected indices in a table of the index's extent, and isin reads one byte instead of testing every entry."""
        used = {str(m.args[1].label).split(".", 1)[0] for _, x in self.exprs for m in x.atoms(isin)}
        return {f.name for f in self.a.reductions
                if f.name in used and f.selection and f.stage == "epilogue" and not f.free}

    def kernel_exprs(self) -> list[tuple[str | None, sp.Basic]]:
        """Every expression the kernel evaluates, with the reduction whose term it is (None for the others: wheres,
        payloads, element and row lets, outputs; a state let is part of the terms that read it)."""
        exprs = [(f.name, f.term) for f in self.a.reductions]
        exprs += [(None, x) for f in self.a.reductions for x in (f.where, *(p.term for p in f.payloads))]
        exprs += [(None, x.expr) for x in self.ir.lets if x.kind != "state"] + [(None, o.value) for o in self.a.outputs]
        return [(owner, x) for owner, x in exprs if isinstance(x, sp.Basic)]

    def reads(self, e: sp.Basic, name: str) -> bool:
        """Whether e reads reduction `name`: its state symbols or a field of its selection."""
        mine = set(self.a.symbols.get(name, {}).values())
        return bool(e.free_symbols & mine) or any(str(b.label).split(".", 1)[0] == name
                                                  for b in e.atoms(sp.IndexedBase))

    def skippable_passes(self) -> dict[int, list[ReductionForm]]:
        """Passes a row may skip: pass number -> the selections S that make it skippable. S is a resident selection
        over an index a, with no where, read only through its membership table (isin): when a's extent is at most
        S's k (known per call: n_group <= topk_group, a router without groups) it keeps every index of a whatever
        the keys (each is offered once and every offered one fits, a NaN key too), so its table is all ones. A pass
        whose stream reductions are selections read by nothing but the keys of such S, and whose resident
        reductions are such S, is then skipped: the router's per-group pass when there is one group."""
        skips: dict[int, list[ReductionForm]] = {}
        if self.plan is not None:
            return skips
        full = []
        for f in self.a.reductions:
            if f.name not in self.members or f.where not in (sp.true, True):
                continue
            rest = [e.xreplace({m: sp.true for m in e.atoms(isin)}) for owner, e in self.exprs if owner != f.name]
            if not any(self.reads(e, f.name) for e in rest):
                full.append(f)
        for p in self.a.passes:
            stream = [f for f in self.a.reductions if f.stage == "stream" and f.pass_no == p.number]
            resident = [f for f in self.a.reductions if f.stage == "epilogue" and f.pass_no == p.number]
            if not stream or not resident or any(f not in full for f in resident) or \
                    any(not f.selection for f in stream):
                continue
            others = [e for owner, e in self.exprs if all(owner != r.name for r in resident)]
            if not any(self.reads(e, f.name) for f in stream for e in others):
                skips[p.number] = resident
        return skips

    def skipped_sels(self) -> set[str]:
        """The selections whose pass a row skips when their index's extent is at most their k (skippable_passes)."""
        return {f.name for full in self.skips.values() for f in full}

    def value_read(self, name: str) -> bool:
        """Whether any expression of the kernel (terms, wheres, payloads, lets, outputs) reads selection name's keys."""
        return any(str(b.label) == f"{name}.value" for _, x in self.exprs for b in x.atoms(sp.IndexedBase))

    def by_value(self, f: ReductionForm) -> tuple[sp.Symbol, list[Condition]] | None:
        """For a candidate selection of a row kernel whose keys nothing reads (only its indices and payloads): an
        element value v its key strictly increases with (symbolic.order), and the conditions on the row's constants
        for it. Where they hold the row is selected on v (the same order; equal v, equal keys) and the key computed
        only for the entries it keeps (a softmax router: no exp per element in the selection pass)."""
        if (self.plan is not None or f.stage != "stream" or f.free or f.name not in self.key_arrays
                or isinstance(f.term, sp.Symbol) or self.value_read(f.name)):
            return None
        ir = self.ir
        constants = {*ir.scalars.values(), *ir.axes.values(), *(x.symbol for x in ir.lets if x.kind == "row")}
        for g in self.a.reductions:  # the states complete before this pass
            if g.pass_no < f.pass_no and not g.free and not g.selection:
                constants |= {s for role, s in self.a.symbols.get(g.name, {}).items() if role in ("cur", "safe")}
        for let in ir.element_lets:
            if let.symbol in f.term.free_symbols and not let.symbol.is_integer:
                conds = increasing_in(f.term, let.symbol, frozenset(constants))
                if conds is not None:
                    return let.symbol, conds
        return None

    def by_value_flag(self, f: ReductionForm) -> None:
        """`const bool byv_<name>`: this row's constants meet the conditions of the selection's by_value order."""
        tests = []
        for c in self.byv[f.name][1]:
            v = self.pr.flt(c.expr)
            tests.append(f"rf::is_finite_bits({v})" + (f" && ({v}) > 0.0f" if c.positive else ""))
        self.emit(f"const bool byv_{f.name} = {' && '.join(tests) or 'true'};  // selected on "
                  f"{self.byv[f.name][0]}, the key increasing with it")

    def precomputed_key(self, f: ReductionForm) -> bool:
        """A selection whose key does not depend on its free indices or on integer values gets its chunk's keys
        in a branch-free (vectorisable) loop before the insertions; the insertion then reads them. A masked
        element's key is computed from its mask value and never inserted."""
        if not f.selection or f.term is None:
            return False
        if isinstance(f.term, sp.Symbol):  # already an element value: copied only for sel_candidates/sel_offers
            return not f.free or _pin(f) is not None
        free_syms = {self.ir.indices[n] for n in f.free}
        if f.term.free_symbols & free_syms:
            return False
        if self.branch_free(f.term):
            return True
        # reads indexed by the row and streamed indices only (a bias[e]), where there is no mask: in bounds for
        # every element of a chunk
        ix = {self.ir.indices[n] for n in (*self.ir.rows, self.ir.over)}
        ints = {x for x in f.term.free_symbols if getattr(x, "is_integer", False)}
        return (self.ir.mask in (sp.true, True) and ints <= ix and not f.term.atoms(idiv, sp.Mod)
                and all(set().union(*(sp.sympify(i).free_symbols for i in r.indices)) <= ix
                        for r in f.term.atoms(sp.Indexed)))

    def hoist_buffers(self) -> None:
        """Row-invariant factors of contractions (the q row of q . k) are converted once per row."""
        self.hoist_fill: list[tuple[str, sp.Indexed, sp.Symbol, str]] = []
        for fac, c, key in self.hoist_targets():
            buf = self.fresh("rowbuf")
            if self.plan is not None:  # one row of the factor per row of a block
                self.emit(f"std::vector<float> {buf}_v(ex_{c.name} * {RBLK});")
                self.emit(f"float* b{buf} = {buf}_v.data();")
            else:
                self.emit(f"std::vector<float> {buf}_v(ex_{c.name});")
                self.emit(f"float* {buf} = {buf}_v.data();")
            self.hoisted[key] = f"{buf}[ix_{c.name}]"
            self.hoist_fill.append((buf, fac, c, key))

    def hoist_targets(self) -> list[tuple[sp.Indexed, sp.Symbol, tuple]]:
        """(factor, contraction index, key) of each row-invariant contraction factor, once per key."""
        ir = self.ir
        over = ir.indices[ir.over]
        out: list[tuple[sp.Indexed, sp.Symbol, tuple]] = []
        for let in ir.element_lets:
            for s in let.expr.atoms(sp.Sum):
                c = s.limits[0][0]
                body = s.function
                for fac in (body.args if body.is_Mul else (body,)):
                    if not isinstance(fac, sp.Indexed) or str(fac.base.label) not in ir.tensors:
                        continue
                    deps = self.index_deps(fac)
                    if ir.over in deps or over in fac.free_symbols or c not in fac.free_symbols:
                        continue
                    if any(d not in ir.rows and d != c.name for d in deps):
                        continue
                    key = (str(fac.base.label), tuple(fac.indices))
                    if all(key != x[2] for x in out):
                        out.append((fac, c, key))
        return out

    def index_deps(self, e: sp.Basic) -> set[str]:
        ir = self.ir
        out: set[str] = set()
        for s in e.free_symbols:
            if s.name in ir.indices and ir.indices[s.name] == s:
                out.add(s.name)
            else:
                for let in ir.lets:
                    if let.symbol == s:
                        out |= set(let.indices)
        return out

    def decode_row(self) -> None:
        ir = self.ir
        self.emit("int64_t rem = row;")
        for n in reversed(ir.rows):
            self.emit(f"const int64_t ix_{n} = rem % ex_{n};")
            self.emit(f"rem /= ex_{n};")
        self.emit("(void)rem;")
        for let in ir.row_lets:
            ty = let_type(let)
            self.emit(f"const {ty} lt_{let.name} = {self.pr.val(let.expr, let.symbol)};")
        if self.tcache is not None:
            self.term_row()
        for buf, fac, c, key in self.hoist_fill:
            saved = self.hoisted.pop(key)
            self.emit(f"for (int64_t ix_{c.name} = 0; ix_{c.name} < ex_{c.name}; ++ix_{c.name}) "
                      f"{buf}[ix_{c.name}] = {self.pr.flt(fac)};")
            self.hoisted[key] = saved

    # ------------------------------------------------------------------ passes
    def levels(self, forms: list[ReductionForm]) -> list[list[ReductionForm]]:
        level: dict[str, int] = {}
        for f in forms:
            level[f.name] = 1 + max([level[d] for d in f.online_deps if d in level] + [-1])
        n = max(level.values(), default=-1) + 1
        return [[f for f in forms if level[f.name] == lv] for lv in range(n)]

    def run_pass(self, number: int) -> None:
        a = self.a
        forms = [f for f in a.reductions if f.stage == "stream" and f.pass_no == number]
        self.emit(f"// ---- pass {number}: {', '.join(f.name for f in forms) or '-'}")
        full = self.skips.get(number)
        if full:  # every index kept whatever the keys (skippable_passes): the pass is not needed
            over = {f.name: self.ir.reduction(f.name).over for f in full}
            for f in full:
                self.emit(f"const bool all_{f.name} = ex_{over[f.name]} <= K_{f.name};  // its table all ones")
            self.block(f"if ({' && '.join(f'all_{f.name}' for f in full)})")
            for f in full:
                self.emit(f"std::memset(mem_{f.name}, 1, static_cast<size_t>(ex_{over[f.name]}));")
            self.end("} else {")
            self.ind += 1
            self.pass_body(number, forms)
            self.end()
            return
        self.pass_body(number, forms)

    def point_sum(self, f: ReductionForm) -> tuple[sp.Expr, sp.Expr] | None:
        """(g, value) for a sum whose term picks one element of the row by its index, value where over == g else 0,
        with g free of the streamed index (a cross-entropy's target logit): the sum is value at over = g where g is
        in the row, else 0, read once per row after the pass instead of selected from every element (a 64-bit
        compare and a select per element). Row kernels without a mask only, for a sum that nothing reads during
        its pass."""
        over = self.ir.indices[self.ir.over]
        if (self.plan is not None or self.ir.mask not in (sp.true, True) or f.op != "sum" or f.stage != "stream"
                or f.selection or f.free or f.payloads or f.online_deps or f.kind != "none"
                or f.where not in (sp.true, True) or not isinstance(f.term, sp.Piecewise) or len(f.term.args) != 2
                or any(f.name in g.online_deps for g in self.a.reductions)):
            return None
        (value, cond), (other, rest) = f.term.args
        if other != 0 or rest not in (sp.true, True) or not isinstance(cond, sp.Eq):
            return None
        g = cond.rhs if cond.lhs == over else cond.lhs if cond.rhs == over else None
        if g is None or over in g.free_symbols or g.is_integer is not True:  # e == 2.5 holds nowhere: no index
            return None
        lets = {let.symbol: let.expr for let in self.ir.element_lets}
        for _ in range(len(lets) + 1):  # the element lets written out, so that the value reads at over = g
            value = value.xreplace(lets)
        if value.free_symbols & set(lets) or value.atoms(sp.Sum):
            return None
        return g, value

    def point_sums(self, points: dict[str, tuple[sp.Expr, sp.Expr]]) -> None:
        """After a pass: each point_sum, {sum: (g, value)}, read at its one element (see there)."""
        over = self.ir.over
        for name, (g, value) in points.items():
            self.block("")
            self.emit(f"const int64_t ix_{over} = {self.pr(g)};")
            self.emit(f"if (ix_{over} >= 0 && ix_{over} < ex_{over}) st_{name} = st_{name} + {self.pr.flt(value)};")
            self.end()

    def pass_body(self, number: int, forms: list[ReductionForm]) -> None:
        a = self.a
        for f in forms:
            self.init_state(f)
            if f.name in self.byv:
                self.by_value_flag(f)
        points = {f.name: p for f in forms if (p := self.point_sum(f)) is not None}
        streamed = [f for f in forms if f.name not in points]
        if streamed:
            self.block(f"for (int64_t c0 = 0; c0 < ex_{self.ir.over}; c0 += {self.chunk})")
            self.emit(f"const int64_t cn = std::min<int64_t>({self.chunk}, ex_{self.ir.over} - c0);")
            if self.plan is None:
                self.stream_prefetch()
            self.element_prologue(streamed)
            self.chunk_levels(streamed)
            self.end()
        self.point_sums(points)
        for f in forms:
            if not f.free and not f.selection:
                self.emit_guard(f.name, None)
        for f in a.reductions:
            if f.stage == "epilogue" and f.pass_no == number:
                self.epilogue(f)
                if f.name in self.members:
                    self.emit(f"rf::sel_mark(mem_{f.name}, ex_{self.ir.reduction(f.name).over}, st_{f.name}_idx, "
                              f"st_{f.name}_ok, K_{f.name});")

    def chunk_levels(self, forms: list[ReductionForm]) -> None:
        """The states of a pass updated with one chunk, level by level (old/new values and their guards)."""
        for f in forms:
            if not f.free and not f.selection:
                self.emit(f"const float st_{f.name}_old = st_{f.name};")
                self.emit_guard(f.name, "old")
        for level in self.levels(forms):
            self.run_level(level)
            if self.tcache is not None and any(f.name == self.tcache.form for f in level):
                for n, (x, _fresh) in enumerate(self.tcache.states):
                    self.emit(f"tcm{n}[tc_n ? c0 / {self.chunk} : 0] = {self.pr.flt(x)};")
            for f in level:
                if not f.free and not f.selection:
                    self.emit(f"const float st_{f.name}_new = st_{f.name};")
                    self.emit_guard(f.name, "new")
                    self.emit(f"(void)st_{f.name}_new; (void)st_{f.name}_old;")

    def emit_guard(self, name: str, role: str | None) -> None:
        g = self.a.guard(name)
        if g is None:
            return
        src = f"st_{name}_{role}" if role else f"st_{name}"
        dst = f"st_{name}_{role}_safe" if role else f"st_{name}_safe"
        expr = src
        for point, safe in reversed(g.points):
            expr = f"({src} == {float_literal(float(point))} ? {float_literal(float(safe))} : {expr})"
        self.emit(f"const float {dst} = {expr};")
        self.emit(f"(void){dst};")

    def init_state(self, f: ReductionForm) -> None:
        if f.selection:
            size = " * ".join([f"ex_{n}" for n in f.free] or ["int64_t(1)"])
            self.emit(f"rf::sel_clear(st_{f.name}_key, st_{f.name}_idx, st_{f.name}_ok, ({size}) * K_{f.name});")
            for p in f.payloads:  # an entry left unfilled carries 0, not the previous row's payload (as on CUDA)
                self.emit(f"std::fill(st_{f.name}_pl_{p.name}, st_{f.name}_pl_{p.name} + ({size}) * K_{f.name}, 0.0f);")
            if self.pinned_value(f) is not None:
                self.emit(f"std::fill(bar_{f.name}, bar_{f.name} + {size}, std::numeric_limits<int32_t>::min());")
            return
        neutral = float_literal(float(f.neutral))
        if f.free:
            lo, hi = self.state_span(f)
            start = f"st_{f.name}" if lo == "0" else f"st_{f.name} + {lo}"
            self.emit(f"std::fill({start}, st_{f.name} + {hi}, {neutral});")
        elif self.plan is not None:  # a reference into the block's state array
            self.emit(f"st_{f.name} = {neutral};")
        else:
            self.emit(f"float st_{f.name} = {neutral};")

    def stream_prefetch(self) -> None:
        """Prefetch of the chunk after next of every input that the element lets read at unit stride along the
        streamed axis: a row kernel reads a chunk and then computes on it, and the hardware's stream prefetch alone
        leaves it waiting on memory at the next chunk (a softmax over 32000-long rows: 5-15 %). Addresses past the
        row (the next row, or past the tensor) are harmless: a prefetch does not fault. Rows of one chunk are a
        plain stream of whole rows, left to the hardware."""
        ir = self.ir
        over = ir.indices[ir.over]
        seen: set[tuple] = set()
        for let in self.sorted_element_lets():
            for acc in sorted(let.expr.atoms(sp.Indexed), key=str):
                name, idx = str(acc.base.label), tuple(acc.indices)
                if name not in self.floats or idx[-1] != over or any(i.has(over) for i in idx[:-1]) \
                        or (name, idx) in seen or (name, idx) in self.hoisted:
                    continue
                seen.add((name, idx))
                ahead = tuple(idx[:-1]) + (sp.Symbol("pf_at", integer=True),)
                self.local[ahead[-1]] = "pf_at"
                elem = self.tensor_element(name, ahead)
                del self.local[ahead[-1]]
                self.block(f"if (ex_{ir.over} > {self.chunk})")  # (rows of one chunk: a plain stream, left to the CPU)
                self.emit(f"const int64_t pf_at = c0 + {2 * self.chunk};  // {name}: the chunk after next")
                self.emit(f"const char* pf = reinterpret_cast<const char*>(&{elem});")
                self.emit(f"for (int64_t k = 0; k < {self.chunk} * int64_t(sizeof({self.types[name]})); k += 64) "
                          "__builtin_prefetch(pf + k);")
                self.end()

    def element_prologue(self, forms: list[ReductionForm]) -> None:
        """Per chunk: the element lets the mask reads (for every element), the mask, the other element lets (only
        where the mask holds) and the counted flags. Contractions (the q . k of attention) are computed for UNROLL
        elements at a time where the mask holds for all of them (one pass over the contraction axis feeds UNROLL
        accumulators, so the row-invariant factor is loaded once for all); the lets that read them follow."""
        lets = self.sorted_element_lets()
        first = self.mask_lets()
        rest = [x for x in lets if x.name not in first]
        late = self.contraction_lets(rest) or set()
        self.block("for (int64_t jj = 0; jj < cn; ++jj)")
        self.mask_and_early_lets(late)
        if late:
            self.end()
            sums = sorted({s for x in rest if x.name in late for s in x.expr.atoms(sp.Sum)}, key=str)
            bufs = {s: self.blocked_contraction(s) for s in sums}
            self.block("for (int64_t jj = 0; jj < cn; ++jj)")
            self.late_lets(late, bufs)
        self.emit(f"el_cnt[jj] = {self.counted()};  // && short-circuits: masked elements are not read")
        self.end()

    def late_lets(self, late: set[str], bufs: dict) -> None:
        """Inside a loop over jj: where the mask holds, the lets in `late`, reading contraction sums from `bufs`."""
        ir = self.ir
        self.emit(f"const int64_t ix_{ir.over} = c0 + jj;")
        self.emit(f"(void)ix_{ir.over};")
        # without a mask every element is ok: no flag to read (and the lets' stores are not conditional)
        self.emit("const bool ok = true;" if ir.mask in (sp.true, True) else "const bool ok = el_ok[jj];")
        self.block("if (ok)")
        saved = dict(self.local)
        self.local.update({s: f"{buf}[jj]" for s, buf in bufs.items()})
        for let in self.sorted_element_lets():
            if let.name in late:
                self.emit_let(let)
        self.local = saved
        self.end()

    def mask_and_early_lets(self, late: set[str]) -> None:
        """Inside a loop over jj: the mask lets, the mask (el_ok), the mask values of the other element lets and,
        where the mask holds, the lets that are not in `late`."""
        ir, a = self.ir, self.a
        lets = self.sorted_element_lets()
        first = self.mask_lets()
        rest = [x for x in lets if x.name not in first]
        self.emit(f"const int64_t ix_{ir.over} = c0 + jj;")
        for let in lets:
            if let.name in first:
                self.emit_let(let)
        self.emit(f"const bool ok = {self.pr(ir.mask)};")
        self.emit("el_ok[jj] = ok;")
        # a masked element's lets hold their mask values; without a mask every let is computed for every element
        # (here or after the contraction), so there is nothing to fill (a store per element and let: 4 % of the
        # samples of an fp32 attention's block function under perf; end to end within the noise of the machine)
        for let in rest if ir.mask not in (sp.true, True) else []:
            fill = a.mask_value.get(let.symbol)
            fv = float_literal(float(fill)) if fill is not None else ("0" if let.symbol.is_integer else "0.0f")
            self.emit(f"el_{let.name}[jj] = {fv};")
        early = [x for x in rest if x.name not in late]
        if early:
            self.block("if (ok)")
            for let in early:
                self.emit_let(let)
            self.end()

    def off_mask_values(self) -> list[str]:
        """Per let with a mask value: the test that element jj's value is not at it."""
        return [f"!({self.pr(atom)} == {float_literal(float(value))})" for atom, value in self.a.mask_value.items()]

    def counted(self) -> str:
        """Whether element jj (where ok) is counted by the non-selection reductions: not at a mask value."""
        return " && ".join(["ok", *self.off_mask_values()])

    def counted_by_value(self) -> str | None:
        """`counted` without the flags of the mask, where the element's values tell: without a mask every element
        is ok, and with one, masked elements hold their mask values in every let that has one (mask_and_early_lets
        fills them), so an element counts exactly when no such let holds its mask value ("true" where no let has
        one). None where that does not hold (a mask value held by a let the mask itself reads, or none at all)."""
        filled = {let.symbol for let in self.ir.element_lets if let.name not in self.mask_lets()}
        if self.ir.mask not in (sp.true, True) and not (self.a.mask_value and set(self.a.mask_value) <= filled):
            return None
        return " && ".join(self.off_mask_values()) or "true"

    def contraction_lets(self, lets: list) -> set[str] | None:
        """The lets holding a contraction or reading one (through other lets), when every contraction's summand
        reads only indices, tensors, row values and lets outside that set (so it can be computed for several
        elements at once after them); None when there is nothing to block or it cannot be."""
        ir = self.ir
        if not any(isinstance(x.expr, sp.Basic) and x.expr.atoms(sp.Sum) for x in lets):
            return None
        late: set[str] = set()
        changed = True
        while changed:
            changed = False
            for x in lets:
                if x.name in late or not isinstance(x.expr, sp.Basic):
                    continue
                syms = x.expr.free_symbols
                if x.expr.atoms(sp.Sum) or any(y.symbol in syms for y in lets if y.name in late):
                    late.add(x.name)
                    changed = True
        late_syms = {x.symbol for x in lets if x.name in late}
        for x in lets:
            if x.name not in late:
                continue
            for s in x.expr.atoms(sp.Sum):
                if len(s.limits) != 1 or s.function.atoms(sp.Sum) or s.function.free_symbols & late_syms:
                    return None
                if x.name in self.tabled or ir.indices[ir.over] not in s.function.free_symbols:
                    return None
        return late

    def element_overrides(self, u: int, base: str) -> dict:
        """Names of the reduction index and of the element lets for element `base + u` of a chunk."""
        ir = self.ir
        out = {ir.indices[ir.over]: f"ix_{ir.over}_{u}"}
        for let in ir.element_lets:
            out[let.symbol] = f"el_{let.name}[{base} + {u}]"
        return out

    def blocked_contraction(self, s: sp.Sum) -> str:
        """sum over c of the summand, for every element of the chunk where the mask holds, UNROLL at a time."""
        ir = self.ir
        c = s.limits[0][0]
        buf = self.fresh("dots")
        self.emit(f"float {buf}[{self.chunk}];  // {s}")
        scalar_body = f"{self.pr.flt(s.function)}"
        saved = dict(self.local)
        parts = []
        for u in range(UNROLL):
            self.local.update(self.element_overrides(u, "jb"))
            parts.append(self.pr.flt(s.function))
            self.local = dict(saved)
        self.block("")
        self.emit("int64_t jb = 0;")
        self.block(f"for (; jb + {UNROLL} <= cn; jb += {UNROLL})")
        self.block(f"if ({' && '.join(f'el_ok[jb + {u}]' for u in range(UNROLL))})")
        for u in range(UNROLL):
            self.emit(f"const int64_t ix_{ir.over}_{u} = c0 + jb + {u};")
        self.emit(f"float {', '.join(f'd{u} = 0.0f' for u in range(UNROLL))};")
        self.block(f"for (int64_t ix_{c.name} = 0; ix_{c.name} < ex_{c.name}; ++ix_{c.name})")
        for u in range(UNROLL):
            self.emit(f"d{u} += {parts[u]};")
        self.end()
        for u in range(UNROLL):
            self.emit(f"{buf}[jb + {u}] = d{u};")
        self.end("} else {")
        self.ind += 1
        self.scalar_contraction(buf, c, scalar_body, f"jb + {UNROLL}", start="jb")
        self.end()
        self.end()
        self.scalar_contraction(buf, c, scalar_body, "cn", start="jb")
        self.end()
        return buf

    def scalar_contraction(self, buf: str, c: sp.Symbol, body: str, stop: str, start: str) -> None:
        ir = self.ir
        self.block(f"for (int64_t jj = {start}; jj < {stop}; ++jj)")
        self.emit("if (!el_ok[jj]) continue;")
        self.emit(f"const int64_t ix_{ir.over} = c0 + jj;")
        self.emit("float d = 0.0f;")
        self.emit(f"for (int64_t ix_{c.name} = 0; ix_{c.name} < ex_{c.name}; ++ix_{c.name}) d += {body};")
        self.emit(f"{buf}[jj] = d;")
        self.end()

    def mask_lets(self) -> set[str]:
        """Element lets the mask reads, directly or through other lets."""
        ir = self.ir
        by_symbol = {let.symbol: let for let in ir.element_lets}
        todo = list(ir.mask.free_symbols) if isinstance(ir.mask, sp.Basic) else []
        out: set[str] = set()
        while todo:
            let = by_symbol.get(todo.pop())
            if let is not None and let.name not in out:
                out.add(let.name)
                todo += list(let.expr.free_symbols) if isinstance(let.expr, sp.Basic) else []
        return out

    def sorted_element_lets(self) -> list:
        ir = self.ir
        lets = list(ir.element_lets)
        done: list = []
        while lets:
            for let in lets:
                deps = {s for s in let.expr.free_symbols} if isinstance(let.expr, sp.Basic) else set()
                if all(d != other.symbol for other in lets if other is not let for d in deps):
                    done.append(let)
                    lets.remove(let)
                    break
            else:
                raise ValueError(f"{ir.op}: cyclic element lets")
        return done

    def emit_let(self, let) -> None:
        if let.name in self.tabled:
            self.emit(f"el_{let.name}[jj] = tab_{let.name}[ix_{self.ir.over}];")
            return
        expr = let.expr
        for s in sorted(expr.atoms(sp.Sum), key=str):
            if s in self.local:  # computed already (blocked contractions)
                continue
            name = self.fresh("dot")
            c = s.limits[0][0]
            self.emit(f"float {name} = 0.0f;")
            self.block(f"for (int64_t ix_{c.name} = 0; ix_{c.name} < ex_{c.name}; ++ix_{c.name})")
            self.emit(f"{name} += {self.pr.flt(s.function)};")
            self.end()
            self.local[s] = name
        self.emit(f"el_{let.name}[jj] = {self.pr.val(expr, let.symbol)};")

    # ------------------------------------------------------------------ one level of a pass
    def run_level(self, level: list[ReductionForm]) -> None:
        for f in level:
            self.correct(f)
        scalar, rest = self.level_split(level)
        reuse = self.shared_weights(scalar, rest)
        if reuse:  # the GEMM fold's weights first: the sums below add them up instead of computing them again
            self.element_loop(rest, branch=True)
        if scalar:  # branch-free: masked elements hold the mask value and contribute the neutral element
            self.element_loop(scalar, branch=False, reuse=reuse)
        if rest and not reuse:
            self.element_loop(rest, branch=True)

    def shared_weights(self, scalar: list[ReductionForm], rest: list[ReductionForm]) -> dict[str, str]:
        """{sum: weight buffer} for the scalar sums of a level whose term is the weight of the level's GEMM fold
        (softmax's denominator and the weights of its weighted sum are both exp(s - m)): an uncounted element has
        weight 0, and a masked one holds the mask value, where the scalar path already takes the term to be 0."""
        if self.plan is None or len(rest) != 1 or rest[0].name not in self.plan.folds:
            return {}
        g = self.plan.folds[rest[0].name]
        return {f.name: g.wbuf for f in scalar if f.op == "sum" and f.term == g.outer}

    def level_split(self, level: list[ReductionForm]) -> tuple[list[ReductionForm], list[ReductionForm]]:
        """(branch-free scalar sums and maxima, the others) of one level."""
        unmasked = self.ir.mask in (sp.true, True)  # every element of a chunk counts and may be read
        scalar = [f for f in level if not f.selection and not f.free and f.where in (sp.true, True)
                  and (unmasked or (self.a.mask_value and not f.term.atoms(sp.Indexed)))]
        return scalar, [f for f in level if f not in scalar]

    def correct(self, f: ReductionForm) -> None:
        kinds = [(f.kind, f.correction, None)] + [(p.kind, p.correction, p.name) for p in f.payloads]
        for kind, c, payload in kinds:
            if kind == "none":
                continue
            cname = f"cr_{f.name}" + (f"_{payload}" if payload else "")
            self.emit(f"const float {cname} = {self.pr.flt(c)};")
            op = "*" if kind == "*" else "+"
            if f.selection:  # the engine refuses a corrected key or payload (forms._classify): entries stay as chosen
                raise ValueError(f"{self.ir.op}: selection '{f.name}' has a correction; the engine refuses those")
            if f.free:
                lo, hi = self.state_span(f)
                # x * 1 is x, bit for bit (-0, inf and NaN included): a factor of exactly 1 (the running max did not
                # move, as in most chunks after the first) skips the pass over the state (a quantised GEMM's row of
                # 4096 accumulators per chunk). Not for "+": -0 + 0 is +0.
                skip = f"if ({cname} != 1.0f) " if kind == "*" else ""
                self.emit(f"{skip}for (int64_t r = {lo}; r < {hi}; ++r) st_{f.name}[r] = st_{f.name}[r] {op} {cname};")
            else:
                self.emit(f"st_{f.name} = st_{f.name} {op} {cname};")

    def element_loop(self, forms: list[ReductionForm], branch: bool, reuse: dict[str, str] | None = None) -> None:
        """One chunk's elements folded into the states of `forms`; a sum named in `reuse` adds up that buffer of
        the chunk's weights (shared_weights) instead of its term."""
        reuse = reuse or {}
        if not branch:  # vectorisable reductions into LANES partial results (a sum and a NaN-propagating max alike)
            self.block("")
            accs = {}
            # a max/min folds its lanes as int32 keys ordered as the floats (NaN past every number): an integer
            # max vectorises, a NaN-propagating float select does not
            keyed = {"max": "hi", "min": "lo"}
            # folds done by a helper over a whole buffer of the chunk instead (direct_folds)
            direct = self.direct_folds(forms, reuse)
            direct.update(self.kept_exp_sum(forms, reuse, direct))
            for f in forms:
                acc = self.fresh("acc")
                accs[f.name] = acc
                neutral = float_literal(float(f.neutral))
                self.emit(f"float {acc} = {neutral};")
                if f.name in direct:
                    continue
                if f.op in keyed:
                    self.emit(f"int32_t {acc}_l[{LANES}];")
                    self.emit(f"for (int u = 0; u < {LANES}; ++u) {acc}_l[u] = rf::fkey_{keyed[f.op]}({neutral});")
                else:
                    self.emit(f"float {acc}_l[{LANES}];")
                    self.emit(f"for (int u = 0; u < {LANES}; ++u) {acc}_l[u] = {neutral};")
            lane = [f for f in forms if f.name not in direct]
            self.lane_loops(lane, accs, reuse, keyed)
            for f in forms:
                acc = accs[f.name]
                if f.name in direct:
                    self.emit(f"{acc} = {self.fold(f.op, acc, direct[f.name])};")
                elif f.op in keyed:  # the lanes' keys folded as integers (vectorises), one key turned back
                    self.emit(f"for (int u = 1; u < {LANES}; ++u) {acc}_l[0] = rf::k{f.op}({acc}_l[0], {acc}_l[u]);")
                    self.emit(f"{acc} = {self.fold(f.op, acc, f'rf::unkey({acc}_l[0])')};")
                elif f.op == "sum":  # pairwise, in vectors (a chain of scalar adds was 3 % of attention)
                    self.emit(f"{acc} = {acc} + rf::lanes_total<{LANES}>({acc}_l);")
                else:
                    self.emit(f"for (int u = 0; u < {LANES}; ++u) {acc} = {self.fold(f.op, acc, acc + '_l[u]')};")
                self.emit(f"st_{f.name} = {self.fold(f.op, f'st_{f.name}', acc)};")
            self.end()
            self.local = {}
            return
        self.branch_loop(forms)

    def direct_folds(self, forms: list[ReductionForm], reuse: dict[str, str]) -> dict[str, str]:
        """{form: C++ value} of the branch-free folds of one chunk that a helper of cpu_math.h computes over a whole
        buffer in place of the lane loop, in the lane loop's order where it matters (a sum): a sum of a GEMM fold's
        weights that emit_fold_weights already added up with rf::exp_sum, and a max of an element let's values
        (its buffer el_<name>, written for every element of the chunk, masked ones holding the mask value, as the
        lane loop reads it): rf::max_of (one vmaxps a step on AVX-512 where the keyed lanes took 8-10 instructions)."""
        out = {}
        for f in forms:
            if f.name in reuse:
                if f.op == "sum" and reuse[f.name] in self.wsums:
                    out[f.name] = self.wsums[reuse[f.name]]
            elif f.op == "max" and (buf := self.let_buffer(f.term)) is not None:
                out[f.name] = f"rf::max_of({buf}, cn)"
        return out

    def kept_exp_sum(self, forms: list[ReductionForm], reuse: dict[str, str], direct: dict[str, str]) -> dict[str, str]:
        """The term cache's sum (TermCache) where its term is exp(x), x branch-free: x for the chunk written where
        the terms are kept (the row's slots of the chunk), then rf::exp_sum there, the exp in place and their sum
        in the lane loop's order ({form: its C++ value}, with direct_folds'). The generated lane loop kept its 16
        partial sums in a stack array, so each step waited on the last one's store (a row softmax: ~20 % of it)."""
        tc = self.tcache
        f = next((g for g in forms if tc is not None and g.name == tc.form), None)
        if f is None or f.op != "sum" or f.name in reuse or f.name in direct or not isinstance(f.term, sp.exp) \
                or not self.branch_free(f.term.args[0]):
            return {}
        ir = self.ir
        self.block("for (int64_t jj = 0; jj < cn; ++jj)")
        self.emit(f"const int64_t ix_{ir.over} = c0 + jj;")
        self.emit(f"(void)ix_{ir.over};")
        self.emit(f"tcrow[(tc_n ? c0 : 0) + jj] = {self.pr.flt(f.term.args[0])};  // the exponent, exp in place below")
        self.end()
        return {f.name: "rf::exp_sum(tcrow + (tc_n ? c0 : 0), cn)"}

    def let_buffer(self, e: sp.Basic) -> str | None:
        """The chunk buffer of an element let's values (el_<name>) where e is that let's symbol, else None."""
        if not isinstance(e, sp.Symbol) or e in self.local:
            return None
        if any(let.symbol == e and let.kind != "row" for let in self.ir.lets):
            return f"el_{e.name}"
        return None

    def lane_loops(self, forms: list[ReductionForm], accs: dict[str, str], reuse: dict[str, str],
                   keyed: dict[str, str]) -> None:
        """The lane loop of element_loop's branch-free folds `forms` (and the chunk's tail one element at a time)."""
        if not forms:
            return
        ir = self.ir
        # the chunk's constants (a state's function, 1 / sqrt(ss / N + eps)) once per chunk, not per element
        before = dict(self.local)
        hoisted = [self.hoist(f.term) if f.name not in reuse else sp.Symbol(self.fresh("wref"), real=True)
                   for f in forms]
        for f, h in zip(forms, hoisted):
            if f.name in reuse:
                self.local[h] = f"{reuse[f.name]}[jj]"
        kept = {k: v for k, v in self.local.items() if k not in before}

        def element_terms() -> list[sp.Basic]:  # the terms of element jj (their cse temporaries emitted first)
            return [self.kept_term(f, t) for f, t in zip(forms, self.cse(hoisted))]

        self.emit("int64_t jl = 0;")
        self.block(f"for (; jl + {LANES} <= cn; jl += {LANES})")
        # the lane loop must stay a loop until the vectoriser sees it (one vector op per element op): fully
        # unrolled early, gcc vectorised the jl loop instead, across lanes, with a transpose per step
        self.emit("#pragma GCC unroll 1")
        self.block(f"for (int u = 0; u < {LANES}; ++u)")
        self.emit("const int64_t jj = jl + u;")
        self.emit(f"const int64_t ix_{ir.over} = c0 + jj;")
        self.emit(f"(void)ix_{ir.over};")
        for f, t in zip(forms, element_terms()):
            lane = accs[f.name] + "_l[u]"
            if f.op in keyed:
                self.emit(f"{lane} = rf::k{f.op}({lane}, rf::fkey_{keyed[f.op]}({self.pr.flt(t)}));")
            else:
                self.emit(f"{lane} = {self.fold(f.op, lane, self.pr.flt(t))};")
        self.end()
        self.end()
        self.local = dict(kept)
        self.block("for (int64_t jj = jl; jj < cn; ++jj)")
        self.emit(f"const int64_t ix_{ir.over} = c0 + jj;")
        self.emit(f"(void)ix_{ir.over};")
        for f, t in zip(forms, element_terms()):
            self.emit(f"{accs[f.name]} = {self.fold(f.op, accs[f.name], self.pr.flt(t))};")
        self.end()

    def branch_loop(self, forms: list[ReductionForm]) -> None:
        """element_loop's folds with branches: selections, folds over free indices, masked or counted elements."""
        ir = self.ir
        keyed = [f for f in forms if f.name in self.key_arrays and f.name not in self.byv]
        if keyed:
            self.key_loop(keyed)
        for f in forms:
            if f.name in self.byv:  # the element value as the key where the row allows it, else the key
                self.emit(f"if (byv_{f.name}) for (int64_t jj = 0; jj < cn; ++jj) "
                          f"elk_{f.name}[jj] = {self.pr.flt(self.byv[f.name][0])};")
                self.key_loop([f], "else ")
        if self.plan is not None and len(forms) == 1 and forms[0].name in self.plan.folds:
            emit_fold_weights(self, self.plan.folds[forms[0].name])
            return
        split = self.blockable_fold(forms)
        if split is None:
            self.element_body(forms, "0", "cn")
            self.local = {}
            return
        # a sum carried over free indices (o[d] += p_j v[j, d]): UNROLL elements per pass over the free indices,
        # where all of them count; the others one at a time
        f, (outer, inner) = forms[0], split
        self.block("")
        pre = self.branch_free(outer)
        if pre:  # the element factor (p_j) for the whole chunk in one vectorisable loop
            wbuf = self.fresh("elw")
            self.emit(f"float {wbuf}[{self.chunk}];")
            self.block("for (int64_t jj = 0; jj < cn; ++jj)")
            self.emit(f"const int64_t ix_{ir.over} = c0 + jj;")
            self.emit(f"(void)ix_{ir.over};")
            self.emit(f"{wbuf}[jj] = {self.pr.flt(outer)};")
            self.end()
        self.emit("int64_t jb = 0;")
        self.block(f"for (; jb + {UNROLL} <= cn; jb += {UNROLL})")
        self.block(f"if ({' && '.join(f'el_cnt[jb + {u}]' for u in range(UNROLL))})")
        saved = dict(self.local)
        ws, vs = [], []
        for u in range(UNROLL):
            self.local.update(self.element_overrides(u, "jb"))
            self.emit(f"const int64_t ix_{ir.over}_{u} = c0 + jb + {u};")
            self.emit(f"(void)ix_{ir.over}_{u};")
            w = self.fresh("w")
            self.emit(f"const float {w} = {f'{wbuf}[jb + {u}]' if pre else self.pr.flt(outer)};")
            ws.append(w)
            vs.append(self.pr.flt(inner))
            self.local = dict(saved)
        n = self.free_loops(f)
        target = self.state_ref(f.name)
        self.emit(f"{target} = {target} + {' + '.join(f'{w} * {v}' for w, v in zip(ws, vs))};")
        for _ in range(n):
            self.end()
        self.end("} else {")
        self.ind += 1
        self.element_body(forms, "jb", f"jb + {UNROLL}")
        self.end()
        self.end()
        self.element_body(forms, "jb", "cn")
        self.end()
        self.local = {}

    def key_loop(self, forms: list[ReductionForm], head: str = "") -> None:
        """The chunk's keys of selections `forms` into their arrays, in one branch-free loop (after `head`)."""
        ir = self.ir
        self.block(f"{head}for (int64_t jj = 0; jj < cn; ++jj)")
        self.emit(f"const int64_t ix_{ir.over} = c0 + jj;")
        self.emit(f"(void)ix_{ir.over};")
        for f in forms:
            self.emit(f"elk_{f.name}[jj] = {self.pr.flt(f.term)};")
        self.end()

    def branch_free(self, e: sp.Expr) -> bool:
        """Whether e may be evaluated for every element of a chunk, masked ones included: float arithmetic only, and
        tensor reads only where there is no mask (a masked element's indices need not be in bounds)."""
        if any(getattr(x, "is_integer", False) for x in e.free_symbols) or e.atoms(idiv, sp.Mod):
            return False
        return not e.atoms(sp.Indexed) or self.ir.mask in (sp.true, True)

    def blockable_fold(self, forms: list[ReductionForm]) -> tuple[sp.Expr, sp.Expr] | None:
        """(factor without the free indices, factor with them) of a lone sum over free indices, or None."""
        if len(forms) != 1:
            return None
        f = forms[0]
        if f.selection or f.where not in (sp.true, True):
            return None
        outer, inner = self.split_free(f)
        if outer == 1 or inner == 1:
            return None
        return outer, inner

    def split_free(self, f: ReductionForm) -> tuple[sp.Expr, sp.Expr]:
        """A sum's term over free indices as (factors without them, factors with them); (1, term) otherwise."""
        free_syms = {self.ir.indices[n] for n in f.free}
        if not (f.free and f.term.is_Mul and f.op == "sum"):
            return sp.Integer(1), f.term
        return (sp.Mul(*[x for x in f.term.args if not (x.free_symbols & free_syms)]),
                sp.Mul(*[x for x in f.term.args if x.free_symbols & free_syms]))

    def element_body(self, forms: list[ReductionForm], start: str, stop: str) -> None:
        """Each element of [start, stop) of the chunk folded into the states, one at a time. A scalar sum is folded
        into a chunk accumulator first and added to its state after the loop (a float32 sum of a long row element by
        element into one state loses ~1e-4 of its value to rounding at 50k elements), unless another form of this
        loop reads that state."""
        ir = self.ir
        saved = dict(self.local)
        whole = (start, stop) == ("0", "cn")
        cands = [f for f in forms if self.candidate_selection(f)] if whole else []
        pinned = [f for f in forms if self.pinned_value(f) is not None] if whole else []
        forms = [f for f in forms if f not in cands and f not in pinned]
        chunk = {}
        for f in forms:
            if f.op != "sum" or f.free or f.selection:
                continue
            mine = {ir.states.get(f.name), *self.a.symbols.get(f.name, {}).values()} - {None}
            read = set().union(*[sp.sympify(g.term).free_symbols | sp.sympify(g.where).free_symbols
                                 for g in forms if g is not f])
            if not mine & read:
                chunk[f.name] = self.fresh(f"ck_{f.name}")
        for v in chunk.values():
            self.emit(f"float {v} = 0.0f;")
        self.chunk_acc = chunk
        if forms:
            self.block(f"for (int64_t jj = {start}; jj < {stop}; ++jj)")
            self.emit(f"const int64_t ix_{ir.over} = c0 + jj;")
            self.emit(f"(void)ix_{ir.over};")
            for f in forms:
                self.block("do")
                self.emit("if (!el_cnt[jj]) break;" if not f.selection else "if (!el_ok[jj]) break;")
                if f.selection:
                    self.insert(f)
                else:
                    self.fold_term(f)
                self.end("} while (false);")
            self.end()
        self.chunk_acc = {}
        for name, v in chunk.items():
            self.emit(f"st_{name} = st_{name} + {v};")
        for f in cands:
            self.candidate_insertions(f)
        for f in pinned:
            self.pinned_insertions(f)
        self.local = saved

    def pinned_value(self, f: ReductionForm) -> sp.Expr | None:
        """For a selection kept per value of one free index g whose where pins each element to one g (where =
        (value == g)) and whose chunk keys are in an array: the value. Its insertions go through rf::sel_offers."""
        pin = _pin(f)
        if not (pin and f.selection and f.stage == "stream" and f.name in self.key_arrays and pin[1].is_integer):
            return None
        return pin[1]

    def pinned_insertions(self, f: ReductionForm) -> None:
        """The insertions of a selection kept per set (pinned_value): each element's set (-1 out of range) in one
        loop, then per 16 elements only those rf::sel_offers finds above their set's bar."""
        ir, g = self.ir, f.free[0]
        sets = self.fresh(f"els_{f.name}")
        self.emit(f"int32_t {sets}[{self.chunk}];")
        self.block("for (int64_t jj = 0; jj < cn; ++jj)")
        self.emit(f"const int64_t ix_{ir.over} = c0 + jj;")
        self.emit(f"(void)ix_{ir.over};")
        self.emit(f"const int64_t v = el_ok[jj] ? int64_t({self.pr(self.pinned_value(f))}) : int64_t(-1);")
        self.emit(f"{sets}[jj] = (v >= 0 && v < ex_{g}) ? static_cast<int32_t>(v) : -1;")
        self.end()
        if not f.payloads:  # one entry per set: its best so far, kept without branches on the keys
            self.block(f"if (K_{f.name} == 1) for (int64_t jj = 0; jj < cn; ++jj)")
            self.emit(f"const int32_t s = {sets}[jj];")
            self.emit("if (s < 0) continue;")
            self.emit(f"const int32_t o = rf::sel_okey(elk_{f.name}[jj]);")
            self.emit(f"const bool b = o > bar_{f.name}[s];  // elements come in index order: an equal key loses")
            self.emit(f"st_{f.name}_key[s] = b ? elk_{f.name}[jj] : st_{f.name}_key[s];")
            self.emit(f"st_{f.name}_idx[s] = b ? c0 + jj : st_{f.name}_idx[s];")
            self.emit(f"st_{f.name}_ok[s] |= static_cast<uint8_t>(b);")
            self.emit(f"bar_{f.name}[s] = b ? o : bar_{f.name}[s];")
            self.end("} else {")
            self.ind += 1
        self.block("for (int64_t j0 = 0; j0 < cn; j0 += 16)")
        offs, no = self.fresh("ofs"), self.fresh("no")
        self.emit(f"int64_t {offs}[16];")
        self.emit(f"const int64_t {no} = rf::sel_offers<16>(elk_{f.name} + j0, el_ok + j0, {sets} + j0, bar_{f.name}, "
                  f"cn - j0, {offs});")
        self.block(f"for (int64_t oi = 0; oi < {no}; ++oi)")
        self.emit(f"const int64_t jj = j0 + {offs}[oi];")
        self.emit(f"const int64_t ix_{ir.over} = c0 + jj;")
        self.block("do")
        self.insert(f)
        self.end("} while (false);")
        self.end()
        self.end()
        if not f.payloads:
            self.end()

    def candidate_selection(self, f: ReductionForm) -> bool:
        """A selection with one set of entries per row (no free index) and its chunk's keys in an array: only the
        chunk's candidates (rf::sel_candidates: its k best offered elements above the last entry) are inserted."""
        return f.selection and not f.free and f.name in self.key_arrays

    def candidate_insertions(self, f: ReductionForm) -> None:
        """The insertions of a candidate selection: the offered elements (mask and where) marked in a loop, the
        chunk's candidates found among them, and only those inserted (the where is not tested again)."""
        ir = self.ir
        off = self.free_offset(f)
        offered = "el_ok"
        if f.where not in (sp.true, True):
            offered = self.fresh(f"elo_{f.name}")
            self.emit(f"uint8_t {offered}[{self.chunk}];")
            self.block("for (int64_t jj = 0; jj < cn; ++jj)")
            self.emit(f"const int64_t ix_{ir.over} = c0 + jj;")
            self.emit(f"(void)ix_{ir.over};")
            both = "&&" if f.where.atoms(sp.Indexed) else "&"  # a read only where the mask holds
            self.emit(f"{offered}[jj] = el_ok[jj] {both} ({self.pr(f.where)});")
            self.end()
        cand, nc = self.fresh(f"cnd_{f.name}"), self.fresh("nc")
        self.emit(f"int64_t {cand}[{self.chunk}];")
        self.emit(f"const int64_t {nc} = rf::sel_candidates<{self.chunk}>(elk_{f.name}, {offered}, cn, "
                  f"st_{f.name}_key + {off}, st_{f.name}_ok + {off}, K_{f.name}, {cand});")
        self.block(f"for (int64_t ci = 0; ci < {nc}; ++ci)")
        self.emit(f"const int64_t jj = {cand}[ci];")
        self.emit(f"const int64_t ix_{ir.over} = c0 + jj;")
        self.block("do")
        self.insert(f, offered=True)
        self.end("} while (false);")
        self.end()

    def cse(self, exprs: list[sp.Expr]) -> list[sp.Expr]:
        repl, reduced = sp.cse(exprs, symbols=sp.numbered_symbols("cse"), optimizations=None)
        for sym, value in repl:
            name = self.fresh("t")
            is_int = bool(getattr(value, "is_integer", False))
            ty = "int64_t" if is_int else "float"
            self.emit(f"const {ty} {name} = {self.pr(value) if is_int else self.pr.flt(value)};")
            self.local[sym] = name
        return reduced

    def term_output(self) -> Any | None:
        """The output whose rows hold the kept terms themselves (TermCache), or None: the one output they serve,
        where it can be float32 (its row is then scaled in place, so the output's first-touch stores overlap the
        exps instead of forming a pass of their own) and the kernel is not split by columns."""
        tc = self.tcache
        if len(tc.ratios) != 1 or self.cols is not None:
            return None
        o = next(x for x in self.a.outputs if x.name in tc.ratios)
        ty = self.types[f"out:{o.name}"]
        return o if ty == "float" or ty.startswith("T_") else None  # float32, or a type parameter that may be

    def term_out_flag(self) -> None:
        """`tc_out`: whether this call keeps the terms in the output's rows (term_output; its instance is float32,
        its rows unit-stride and kept at all), in which case the shared buffer is not allocated."""
        o = self.term_output()
        if o is None:
            self.emit("const bool tc_out = false;")
            return
        ty, cond = self.types[f"out:{o.name}"], f"tc_n > 0 && ost_{o.name}[{len(o.index) - 1}] == 1"
        if ty == "float":
            self.emit(f"const bool tc_out = {cond};")
            return
        self.emit("bool tc_out = false;  // the kept terms in the output's rows (a float32 instance only)")
        self.emit(f"if constexpr (std::is_same<{ty}, float>::value) tc_out = {cond};")

    def term_row(self) -> None:
        """`tcrow`, where this row's kept terms go: the output's row where tc_out holds, else the shared buffer."""
        o = self.term_output()
        if o is None:
            self.emit("float* tcrow = tcache;")
            return
        last = len(o.index) - 1
        row = " + ".join(f"ix_{n} * ost_{o.name}[{d}]" for d, n in enumerate(o.index) if d != last) or "0"
        self.emit(f"float* tcrow = tc_out ? reinterpret_cast<float*>(&o_{o.name}[{row}]) : tcache;")

    def kept_term(self, f: ReductionForm, t: sp.Basic) -> sp.Basic:
        """t, and for the term cache's sum also stored as element c0 + jj of the row (TermCache)."""
        if self.tcache is None or f.name != self.tcache.form:
            return t
        name = self.fresh("tv")
        self.emit(f"const float {name} = {self.pr.flt(t)};")
        self.emit(f"tcrow[(tc_n ? c0 : 0) + jj] = {name};")
        sym = sp.Symbol(name, real=True)
        self.local[sym] = name
        return sym

    def fold(self, op: str, acc: str, value: str) -> str:
        if op == "sum":
            return f"{acc} + {value}"
        return f"rf::{op}({acc}, {value})"

    def free_loops(self, f: ReductionForm) -> int:
        for n in f.free:
            self.block(f"for (int64_t ix_{n} = 0; ix_{n} < ex_{n}; ++ix_{n})")
        return len(f.free)

    def fold_term(self, f: ReductionForm) -> None:
        # the part of the term that does not depend on the free indices is computed once per element
        term = f.term
        outer, inner = self.split_free(f)
        if outer != 1:
            name = self.fresh("w")
            self.emit(f"const float {name} = {self.pr.flt(outer)};")
            self.local[outer] = name
            term = sp.Mul(outer, inner, evaluate=False) if inner != 1 else outer
        where = f.where
        n = self.free_loops(f)
        guard = "" if where in (sp.true, True) else f"if ({self.pr(where)}) "
        target = getattr(self, "chunk_acc", {}).get(f.name) or self.state_ref(f.name)
        value = self.pr.flt(term)
        self.emit(f"{guard}{target} = {self.fold(f.op, target, value)};")
        for _ in range(n):
            self.end()

    def insert(self, f: ReductionForm, offered: bool = False) -> None:
        """Offer this element to a selection (per free index where it applies); offered: its where holds."""
        where = sp.true if offered else f.where
        n_loops = 0
        pinned = None if offered else _pin(f)
        if pinned:
            g, value = pinned
            self.emit(f"const int64_t ix_{g} = {self.pr(value)};")
            self.emit(f"if (ix_{g} < 0 || ix_{g} >= ex_{g}) break;")
            where = sp.true
        else:
            n_loops = self.free_loops(f)
        if where not in (sp.true, True):
            self.emit(f"if (!({self.pr(where)})) {'continue' if n_loops else 'break'};")
        off = self.free_offset(f)
        pre = f.name in self.key_arrays
        self.emit(f"const float key = {f'elk_{f.name}[jj]' if pre else self.pr.flt(f.term)};")
        self.emit(f"float* kk = st_{f.name}_key + {off};")
        self.emit(f"int64_t* ii = st_{f.name}_idx + {off};")
        self.emit(f"uint8_t* oo = st_{f.name}_ok + {off};")
        self.emit(f"const int64_t pos = rf::sel_position(kk, ii, oo, K_{f.name}, key, ix_{self.ir.over});")
        self.block(f"if (pos < K_{f.name})")
        self.emit(f"rf::sel_shift(kk, pos, K_{f.name}); rf::sel_shift(ii, pos, K_{f.name}); "
                  f"rf::sel_shift(oo, pos, K_{f.name});")
        self.emit(f"kk[pos] = key; ii[pos] = ix_{self.ir.over}; oo[pos] = 1;")
        for p in f.payloads:
            arr = f"st_{f.name}_pl_{p.name} + {off}"
            value = "key" if p.term == f.term else self.pr.flt(p.term)
            if value == "key" and f.name in self.byv:  # the key itself where the entries hold element values
                value = f"(byv_{f.name} ? {self.pr.flt(p.term)} : key)"
            self.emit(f"{{ float* pp = {arr}; rf::sel_shift(pp, pos, K_{f.name}); pp[pos] = {value}; }}")
        if pinned and self.pinned_value(f) is not None:  # the set's bar follows its last entry
            self.emit(f"bar_{f.name}[ix_{pinned[0]}] = oo[K_{f.name} - 1] ? rf::sel_okey(kk[K_{f.name} - 1]) : "
                      "std::numeric_limits<int32_t>::min();")
        self.end()
        for _ in range(n_loops):
            self.end()

    # ------------------------------------------------------------------ epilogues and outputs
    def epilogue(self, f: ReductionForm) -> None:
        over = self.ir.reduction(f.name).over
        self.emit(f"// resident reduction {f.name} over {over}")
        self.init_state(f)
        self.block(f"for (int64_t ix_{over} = 0; ix_{over} < ex_{over}; ++ix_{over})")
        if f.selection:
            self.block("do")
            where = f.where
            if where not in (sp.true, True):
                self.emit(f"if (!({self.pr(where)})) break;")
            off = self.free_offset(f)
            self.emit(f"const float key = {self.pr.flt(f.body)};")
            self.emit(f"float* kk = st_{f.name}_key + {off};")
            self.emit(f"int64_t* ii = st_{f.name}_idx + {off};")
            self.emit(f"uint8_t* oo = st_{f.name}_ok + {off};")
            self.emit(f"const int64_t pos = rf::sel_position(kk, ii, oo, K_{f.name}, key, ix_{over});")
            self.block(f"if (pos < K_{f.name})")
            self.emit(f"rf::sel_shift(kk, pos, K_{f.name}); rf::sel_shift(ii, pos, K_{f.name}); "
                      f"rf::sel_shift(oo, pos, K_{f.name});")
            self.emit(f"kk[pos] = key; ii[pos] = ix_{over}; oo[pos] = 1;")
            for p in f.payloads:
                self.emit(f"{{ float* pp = st_{f.name}_pl_{p.name} + {off}; rf::sel_shift(pp, pos, K_{f.name}); "
                          f"pp[pos] = {self.pr.flt(p.expr)}; }}")
            self.end()
            self.end("} while (false);")
        else:
            where = f.where
            guard = "" if where in (sp.true, True) else f"if ({self.pr(where)}) "
            target = self.state_ref(f.name)
            self.emit(f"{guard}{target} = {self.fold(f.op, target, self.pr.flt(f.body))};")
        self.end()

    def hoist(self, expr: sp.Basic, loops: tuple[str, ...] = ()) -> sp.Basic:
        """expr with its parts that do not vary along the streamed axis (nor the indices of `loops`) computed once: each is
        emitted here as a `const` and replaced by a fresh symbol that the printer resolves to it. In a product the
        invariant factors become one (a division by a row constant becomes a multiplication by its reciprocal,
        computed once); in a sum the invariant terms become one. Row-invariant tensor reads (a target index
        target[t]) are read once. Boolean parts and contractions stay where they are."""

        varying = set(element_atoms(self.ir, expr)) | {self.ir.indices[n] for n in loops}

        def moves(e: sp.Basic) -> bool:
            return any(e.has(v) for v in varying)

        def worth(e: sp.Basic) -> bool:
            if isinstance(e, sp.Indexed):  # a read of an input tensor, not of a selection's entries
                return str(e.base.label) in self.ir.tensors
            return (isinstance(e, sp.Expr) and not e.is_Atom and not e.has(sp.Sum, entrysum, isin)
                    and not is_bool(e) and not self.pr.is_int(e))

        def lift(e: sp.Basic) -> sp.Basic:
            name = self.fresh("hv")
            whole = self.pr.is_int(e)
            self.emit(f"const {'int64_t' if whole else 'float'} {name} = {self.pr(e) if whole else self.pr.flt(e)};")
            sym = sp.Symbol(name, integer=True) if whole else sp.Symbol(name, real=True)
            self.local[sym] = name
            return sym

        def walk(e: sp.Basic) -> sp.Basic:
            if not isinstance(e, sp.Basic) or e in self.local:
                return e
            if not moves(e):
                return lift(e) if worth(e) else e
            if e.is_Atom or isinstance(e, sp.Indexed):
                return e
            if isinstance(e, (sp.Mul, sp.Add)) and not self.pr.is_int(e):
                fixed = [a for a in e.args if not moves(a)]
                rest = [walk(a) for a in e.args if moves(a)]
                if fixed:
                    part = e.func(*fixed)
                    rest.append(lift(part) if worth(part) and part not in self.local else part)
                return e.func(*rest, evaluate=False)
            if isinstance(e, sp.Piecewise):
                return sp.Piecewise(*[(walk(v), walk(c)) for v, c in e.args], evaluate=False)
            if isinstance(e, (sp.Sum, entrysum, isin)):
                return e
            return e.func(*[walk(a) for a in e.args], evaluate=False) if isinstance(e, sp.Expr) else \
                e.func(*[walk(a) for a in e.args])

        return walk(expr)

    def outputs(self) -> None:
        ir = self.ir
        for o in self.a.outputs:
            spec_out = next(x for x in self.spec.outputs if x.name == o.name)
            loops = [n for n in o.index if n not in ir.rows]
            self.emit(f"// output {o.name}")
            value = self.stored_value(o)
            whole = self.cols is not None and self.cols not in loops
            if whole:  # not split by columns: written by the block's first task (cpu_tiles.split_axis)
                self.block("if (cpart == 0)")
            cached = self.tcache is not None and o.name in self.tcache.ratios
            if cached:
                self.cached_output(o)
            if o.per_element:  # row constants of a per-element value: once per row, not once per element
                value = self.hoist(value, tuple(loops))
            last = len(o.index) - 1
            # an output whose innermost index is one of its loops (the streamed index of a per-element output, the
            # free index of a state: attention's d) gets a copy of its loops for a unit inner stride (the usual
            # case: outputs are allocated contiguous), which the compiler can vectorise
            unit = bool(loops) and o.index[last] == loops[-1]
            if unit:
                self.block(f"if (ost_{o.name}[{last}] == 1)")
            saved = dict(self.local)
            self.output_loops(o, loops, value, unit)
            if unit:
                self.end()
                self.block("else")
                self.local = saved
                self.output_loops(o, loops, value, False)
                self.end()
            if cached:
                self.end()
            if whole:
                self.end()
            del spec_out

    def cached_output(self, o: Any) -> None:
        """Open `if (the kept terms serve) { ... } else {` for a per-element output of the term cache: each element
        is its kept term times its chunk's ratio (TermCache). The caller's loops, recomputing every element, go
        in the else branch, taken for rows longer than TCACHE_MAX and where a ratio is not finite."""
        ir, tc, ch = self.ir, self.tcache, self.chunk
        self.emit(f"// output {o.name} from the kept terms of {tc.form}: the term times its chunk's ratio")
        for n, (_x, fresh) in enumerate(tc.states):
            self.local[fresh] = f"tcm{n}[tc]"
        self.emit("bool tc_ok = tc_n > 0;")
        self.block("for (int64_t tc = 0; tc < tc_chunks; ++tc)")
        self.emit(f"tcr[tc] = {self.pr.flt(tc.ratios[o.name])};")
        self.emit("tc_ok = tc_ok && rf::is_finite_bits(tcr[tc]);")
        self.end()
        for _x, fresh in tc.states:
            del self.local[fresh]
        self.block("if (tc_ok)")
        self.block("for (int64_t tc = 0; tc < tc_chunks; ++tc)")
        self.emit("const float r = tcr[tc];")
        self.emit(f"const int64_t e1 = std::min<int64_t>(ex_{ir.over}, (tc + 1) * {ch});")
        for unit in (True, False):
            self.emit(f"if (ost_{o.name}[{len(o.index) - 1}] == 1)" if unit else "else")
            self.emit(f"  for (int64_t ix_{ir.over} = tc * {ch}; ix_{ir.over} < e1; ++ix_{ir.over}) "
                      f"rf::store(&o_{o.name}[{_out_offset(o, unit)}], tcrow[ix_{ir.over}] * r);")
        self.end()
        self.end("} else {")
        self.ind += 1

    def output_loops(self, o: Any, loops: list[str], value: sp.Basic, unit: bool) -> None:
        ir = self.ir
        for n in loops:
            lo, hi = self.bounds(n)
            self.block(f"for (int64_t ix_{n} = {lo}; ix_{n} < {hi}; ++ix_{n})")
        if o.per_element:
            self.emit("const int64_t jj = 0;")
            self.emit(f"const int64_t c0 = ix_{ir.over};")
            self.emit("(void)c0;")
            for let in self.sorted_element_lets():
                self.emit_let(let)
        off = _out_offset(o, unit)
        ty = self.types[f"out:{o.name}"]
        if ty in ("int32_t", "int64_t"):  # indices stay integers (through a float, int64 ones would round)
            self.emit(f"o_{o.name}[{off}] = static_cast<{ty}>({self.pr(value)});")
        else:
            self.emit(f"rf::store(&o_{o.name}[{off}], {self.pr.flt(value)});")
        for _ in loops:
            self.end()


def _out_offset(o: Any, unit: bool) -> str:
    """The element offset of output `o` at its loop indices (its innermost stride 1 where `unit`)."""
    last = len(o.index) - 1
    return " + ".join(f"ix_{n}" if unit and d == last else f"ix_{n} * ost_{o.name}[{d}]" for d, n in enumerate(o.index))


# --------------------------------------------------------------------------------------------- the file
def _args_struct(spec: OpSpec, a0: Analysis) -> list[str]:
    ir = a0.ir
    lines = ["struct Args {"]
    for t in spec.tensors:
        lines.append(f"  const void* t_{t.name} = nullptr;  // {t.name}{' (optional)' if t.optional else ''}")
        lines.append(f"  int64_t st_{t.name}[{len(t.shape)}] = {{}};  // element strides")
        lines.append(f"  ScalarType dt_{t.name} = ScalarType::Float;")
    for o in spec.outputs:
        lines.append(f"  void* o_{o.name} = nullptr;")
        lines.append(f"  int64_t ost_{o.name}[{len(o.shape)}] = {{}};")
        lines.append(f"  ScalarType odt_{o.name} = ScalarType::Float;")
    for n in ir.axes:
        lines.append(f"  int64_t sz_{n} = 0;")
    for a in spec.scalars:
        if a.type == "int":
            lines.append(f"  int64_t p_{a.name} = 0;")
        elif a.type == "float":
            lines.append(f"  double p_{a.name} = 0.0;  // when_null already applied")
        elif a.type == "bool":
            lines.append(f"  bool f_{a.name} = false;")
        elif a.type == "str":
            lines.append(f"  int f_{a.name} = 0;  // index into {list(a.choices)}")
    for t in spec.tensors:
        if t.optional:
            lines.append(f"  bool has_{t.name} = false;")
    lines.append("  int64_t rows = 0;  // product of the row extents")
    lines.append("};")
    return lines


def _case_condition(spec: OpSpec, a: Analysis) -> str:
    parts = []
    for name, value in a.ir.specialization:
        arg = spec.arg(name)
        if isinstance(arg, TensorArg):
            parts.append(f"A.has_{name} == {'true' if value == 'present' else 'false'}")
        elif isinstance(arg, ScalarArg) and arg.type == "bool":
            parts.append(f"A.f_{name} == {'true' if value else 'false'}")
        else:
            parts.append(f"A.f_{name} == {arg.choices.index(value)}")
    return " && ".join(parts) or "true"


def cpu_header(op: OpAnalysis) -> str:
    spec = op.spec
    lines = [
        "#pragma once",
        "#include \"runtime.h\"",
        "",
        f"namespace redfuser::gen::{spec.name} {{",
        "",
        *_args_struct(spec, op.cases[0]),
        "",
        "// Runs the CPU kernel of the specialisation the flags select, parallel over rows.",
        "void run_cpu(const Args& A);",
        "",
        f"}}  // namespace redfuser::gen::{spec.name}",
        "",
    ]
    return "\n".join(lines)


def cpu_source(op: OpAnalysis, header_name: str) -> str:
    spec = op.spec
    native = native_inputs(op)
    types, params = type_params(spec, native)
    template = [p.name for p in params]
    out = [
        f"#include \"{header_name}\"",
        "",
        "#include <algorithm>",
        "#include <cmath>",
        "#include <memory>",
        "#include <type_traits>",
        "#include <vector>",
        "",
        "#include \"cpu_math.h\"",
        "",
        f"namespace redfuser::gen::{spec.name} {{",
        "namespace rf = redfuser::cpu;",
        "",
    ]
    kernels = [_Kernel(spec, a, n, types, native) for n, a in enumerate(op.cases)]
    for k in kernels:
        out.append(k.function(template))
    # dispatch: case by flags, then element types, then rows (or blocks of rows) in parallel
    out.append("void run_cpu(const Args& A) {")
    for n, a in enumerate(op.cases):
        targs = f"<{', '.join(template)}>" if template else ""
        if kernels[n].plan is not None:
            cols = kernels[n].cols
            body = block_dispatch(f"blocks_case{n}{targs}", _args_expr(kernels[n], a.ir.extents[cols]) if cols else None,
                                  folds_only=not kernels[n].plan.sums)
        else:
            body = (f"redfuser::parallel_rows(A.rows, grain, [&](int64_t b, int64_t e) {{ rows_case{n}{targs}(A, b, e); "
                    "});")
        for p in reversed(params):
            allowed = ", ".join(CPP_TYPES[d] for d in p.dtypes)
            body = (f"rf::with_type<{allowed}>(\"{spec.name}\", \"{p.field[3:]}\", A.{p.field}, [&](auto tag_{p.name}) {{ "
                    f"using {p.name} = typename decltype(tag_{p.name})::type; {body} }});")
        grain = _grain(a)
        out.append(f"  if ({_case_condition(spec, a)}) {{")
        if kernels[n].plan is None and grain > 1:  # long rows: fewer rows per task, so few rows still use every thread
            over = _args_expr(kernels[n], a.ir.extents[a.ir.over])
            out.append(f"    const int64_t grain = std::max<int64_t>(1, std::min<int64_t>({grain}, "
                       f"{ROW_TASK_ELEMENTS} / std::max<int64_t>(1, static_cast<int64_t>({over}))));")
        else:
            out.append(f"    const int64_t grain = {grain};")
        out.append(f"    {body}")
        out.append("    return;")
        out.append("  }")
    out.append(f"  redfuser::fail(\"{spec.name}\", \"no CPU kernel for this combination of arguments\");")
    out.append("}")
    out.append("")
    out.append(f"}}  // namespace redfuser::gen::{spec.name}")
    out.append("")
    return "\n".join(out)


def _args_expr(k: _Kernel, e: sp.Expr) -> str:
    """An extent as run_cpu reads it: sizes and parameters from the Args struct (extents are made of axes and
    parameters)."""
    return re.sub(r"\b(sz|p)_(\w+)", r"A.\1_\2", k.pr(e))


def _grain(a: Analysis) -> int:
    """Rows per task: enough work per task that the thread pool's overhead stays small."""
    return 4 if a.ir.element_lets and any(x.expr.atoms(sp.Sum) for x in a.ir.element_lets) else 64


__all__ = ["CPP_TYPES", "MONOIDS", "cpu_header", "cpu_source", "element_atoms", "is_bool", "native_inputs", "type_params"]
