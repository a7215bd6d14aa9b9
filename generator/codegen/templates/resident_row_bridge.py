"""Bridge from the engine's forms of a row cascade to the resident_row template.

Each specialisation of the cascade becomes a straight-line step program (loads, maps, reductions, group
selections, top-k, epilogues); the specialisations are merged into one program that branches at run time on the
flags, and the op's ``impl_cuda`` body picks the variant by the row length's capacity.
"""

from __future__ import annotations

import sympy as sp

from ...spec import OpSpec
from ...symbolic.expr import Cast, entrysum, idiv, isin
from ...symbolic.forms import Analysis, OpAnalysis, ReductionForm
from ..bridge import BridgeError, Job, Plan, flag_test, launch_call, only, py_to_cpp
from ..glue import SCALAR_TYPES
from ..tl_print import TLPrinter


def _only(items: list, what: str) -> object:
    return only(items, what, "resident_row")


ROW_INF = "T.infinity('float32')"


class _RowBridge:
    """One specialisation of a row cascade as a straight-line step program of the resident_row template.

    The row is resident, so every reduction runs once its inputs are final: the engine's fused form with the
    final states read through their guards. Lets keep their names (Maps), so that the specialisations share
    steps when they are merged into one program."""

    def __init__(self, spec: OpSpec, a: Analysis):
        self.spec = spec
        self.a = a
        self.ir = a.ir
        self.where = f"{self.ir.op} [{self.ir.label}]"
        self.steps: list = []
        self.names: dict[sp.Basic, str] = {}
        self.loaded: dict[str, str] = {}
        self.group_let: sp.Symbol | None = None
        self.group_size = self.n_groups = ""
        self.group_sel: tuple[str, str, int] | None = None
        self.keep: dict[str, str] = {}  # selection over groups -> per-element predicate name
        self.topk = ""
        self.mapped: set[str] = set()

    def fail(self, msg: str) -> BridgeError:
        return BridgeError(f"{self.where}: {msg}")

    def tl(self, e: sp.Basic) -> str:
        return TLPrinter(self.names, self.where, ROW_INF)(e)

    def guarded(self, e: sp.Basic) -> sp.Basic:
        """An expression over current states, with guarded states replaced by their safe symbols."""
        sub = {self.ir.states[g.state]: self.a.symbols[g.state]["safe"] for g in self.a.guards}
        return e.xreplace(sub)

    def build(self) -> list:
        from . import resident_row as rr

        ir = self.ir
        over = ir.indices[ir.over]
        self.names[over] = "e"
        self.names.update({s: n for n, s in ir.scalars.items()})
        self.names.update({s: n for n, s in ir.axes.items()})
        for g in self.a.guards:  # a guarded state read by a reduction: its safe value, inline
            s = self.ir.states[g.state]
            safe = TLPrinter({s: g.state}, self.where, ROW_INF)(g.apply(s))
            for role in ("safe", "new_safe"):
                self.names[self.a.symbols[g.state][role]] = safe
        for let in ir.element_lets:
            inner = let.expr.args[0] if isinstance(let.expr, Cast) else let.expr
            if isinstance(inner, sp.Indexed) and inner.indices[-1] == over and len(inner.indices) == 2:
                self.steps.append(rr.Load(let.name, str(inner.base.label), fill="-T.infinity('float32')"))
                self.loaded[str(inner.base.label)] = let.name
                self.names[let.symbol] = let.name
            elif self._is_group(let):
                continue
        for f in self.a.reductions:
            self.name_lets()
            self.reduction(f)
        for o in self.a.outputs:
            self.output(o)
        return self.steps

    def _is_group(self, let) -> bool:
        """group = e // (length // n): contiguous groups of length // n elements."""
        e = let.expr
        if (isinstance(e, idiv) and e.args[0] == self.ir.indices[self.ir.over] and isinstance(e.args[1], idiv)
                and e.args[1].args[0] == self.ir.extents[self.ir.over]):
            n = e.args[1].args[1]
            self.group_size = f"{self.tl(e.args[1].args[0])} // {self.tl(n)}"
            self.n_groups = self.tl(n)
            self.group_let = let.symbol
            return True
        return False

    def name_lets(self) -> None:
        """Lets whose inputs are all available become Maps, in spec order; later expressions use their names."""
        from . import resident_row as rr

        ir = self.ir
        for let in ir.lets:
            if let.name in self.mapped or let.kind == "row" or let.symbol == self.group_let:
                continue
            if let.symbol in self.names or self.names.get(let.expr) == let.name:
                self.mapped.add(let.name)
                continue
            expr = self.guarded(let.expr) if let.kind == "state" else let.expr
            if not isinstance(expr, sp.Expr) or not expr.has(ir.indices[ir.over]) and not any(
                    expr.has(x.symbol) for x in ir.element_lets):
                continue
            states = {s for n, s in ir.states.items() if expr.has(s) or expr.has(self.a.symbols[n]["safe"])}
            if any(s.name not in self.done for s in states):
                continue
            if any(isinstance(ix.base, sp.IndexedBase) and "." in str(ix.base.label) for ix in expr.atoms(sp.Indexed)):
                continue
            self.load_reads(expr)
            self.steps.append(rr.Map(let.name, self.tl(expr)))
            self.names[expr] = let.name
            self.names[let.symbol] = let.name
            self.mapped.add(let.name)

    @property
    def done(self) -> set[str]:
        return {n for n, s in self.ir.states.items() if s in self.names}

    def load_reads(self, expr: sp.Basic) -> None:
        from . import resident_row as rr

        over = self.ir.indices[self.ir.over]
        for ix in sorted(expr.atoms(sp.Indexed), key=str):
            name = str(ix.base.label)
            if name not in self.ir.tensors or ix in self.names:
                continue
            row_element = (len(ix.indices) == 2 and ix.indices == (self.ir.indices[self.ir.rows[0]], over)
                           and len(self.ir.rows) == 1 and name == self.spec.tensors[0].name)
            if not row_element and (ix.indices[-1] != over or len(ix.indices) != 1):
                raise self.fail(f"read {ix} is neither a row element nor a per-element vector")
            if name not in self.loaded:  # a row element read in place, as an element let is (masked: -inf)
                fill = "-T.infinity('float32')" if row_element else "0.0"
                self.steps.append(rr.Load(f"ld_{name}", name, fill=fill))
                self.loaded[name] = f"ld_{name}"
            self.names[ix] = self.loaded[name]

    def reduction(self, f: ReductionForm) -> None:
        from . import resident_row as rr

        ir = self.ir
        term = f.term
        red = ir.reduction(f.name)
        if f.stage == "stream" and not f.selection:
            if f.free or f.where not in (sp.true, True):
                raise self.fail(f"row reduction {f.name} must be unconditional and scalar")
            self.load_reads(term)
            self.steps.append(rr.Reduce(f.name, f.op, self.tl(term)))
            self.names[ir.states[f.name]] = f.name
        elif f.stage == "stream" and f.selection and f.free:
            g = ir.indices[_only(list(f.free), "group index")]
            if not (isinstance(f.where, sp.Eq) and {f.where.lhs, f.where.rhs} == {self.group_let, g}):
                raise self.fail(f"per-group selection {f.name} must select where group == g")
            self.load_reads(term)
            self.group_sel = (f.name, self.tl(term), int(f.k))
        elif f.stage == "epilogue" and f.selection:
            if self.group_sel is None or not (
                    isinstance(f.body, entrysum) and str(f.body.args[0].label) == f"{self.group_sel[0]}.value"):
                raise self.fail(f"selection {f.name} over '{red.over}' must rank groups by their top values' sum")
            _, key, k = self.group_sel
            gs, ng = self.group_size, self.n_groups
            if k == 1:
                reduce = (rr.GroupReduce("gscore", "max", key, gs, ng),)
            else:  # the sum of the k best, or of all of a group smaller than k
                reduce = (rr.If(f"{gs} >= {k}", (rr.GroupReduce("gscore", "topk_sum", key, gs, ng, k=k),),
                                (rr.GroupReduce("gscore", "sum", key, gs, ng),)),)
            keep = f"keep_{f.name}"
            select = rr.GroupSelect(keep, "gscore", gs, ng, self.tl(f.k))
            # one group keeps every element: the selection is the identity
            self.steps.append(rr.If(f"{ng} > 1", reduce + (select,), (rr.Map(keep, "True", dtype="bool"),)))
            self.keep[f.name] = keep
        elif f.stage == "stream" and f.selection:
            where = None
            if f.where not in (sp.true, True):
                if not (isinstance(f.where, isin) and f.where.args[0] == self.group_let):
                    raise self.fail(f"selection {f.name}: predicate {f.where} is not a kept-group test")
                where = self.keep[str(f.where.args[1].label).split(".")[0]]
            self.load_reads(term)
            gather = []
            for p in f.payloads:  # a payload named after a let reads the let's Map
                self.load_reads(p.term)
                gather.append((f"{f.name}_{p.name}", p.name if p.name in self.mapped else self.tl(p.term)))
            self.steps.append(rr.TopK(f.name, key=self.tl(term), k=self.tl(f.k), where=where, gather=tuple(gather)))
            self.topk = f.name
            for p in f.payloads:
                self.names[sp.IndexedBase(f"{f.name}.{p.name}")] = f"{f.name}_{p.name}"
        elif f.stage == "epilogue" and not f.selection:
            body = f.body
            names = dict(self.names)
            for ix in body.atoms(sp.Indexed):
                if ix.base in self.names:
                    names[ix] = self.names[ix.base]
            self.steps.append(rr.Reduce(f.name, f.op, TLPrinter(names, self.where, ROW_INF)(body), over="k"))
            self.names[ir.states[f.name]] = f.name
        else:
            raise self.fail(f"reduction {f.name} ({f.op}, {f.stage}) has no resident_row step")

    def output(self, o) -> None:
        from . import resident_row as rr

        value = o.value
        if isinstance(value, sp.Indexed) and str(value.base.label) == f"{self.topk}.index":
            self.steps.append(rr.Store(o.name, self.topk))
            return
        names = dict(self.names)
        for ix in value.atoms(sp.Indexed):
            if ix.base in self.names:
                names[ix] = self.names[ix.base]
        self.steps.append(rr.Epilogue(f"out_{o.name}", TLPrinter(names, self.where, ROW_INF)(value)))
        self.steps.append(rr.Store(o.name, f"out_{o.name}"))


def _merge(a: list, b: list, cond: str) -> list:
    """Common prefix and suffix of two step lists, an If for the part that differs."""
    from . import resident_row as rr

    if a == b:
        return list(a)
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    m = 0
    while m < min(len(a), len(b)) - n and a[len(a) - 1 - m] == b[len(b) - 1 - m]:
        m += 1
    return a[:n] + [rr.If(cond, tuple(a[n:len(a) - m]), tuple(b[n:len(b) - m]))] + a[len(a) - m:]


def row_program(spec: OpSpec, op: OpAnalysis):
    """All specialisations of a row cascade as one step program, branching at run time on the flags."""
    from . import resident_row as rr

    for o in spec.outputs:
        if len(o.shape) != 2:
            raise BridgeError(f"{spec.name}: resident_row writes (rows, k) outputs; {o.name} has shape "
                              f"({', '.join(o.shape)}) (per-row results: the stream_row template)")
    flags = [n for n, _ in op.cases[0].ir.specialization]
    per_case = {tuple(v for _, v in a.ir.specialization): _RowBridge(spec, a).build() for a in op.cases}

    def cond(name: str, value) -> str:
        return flag_test(spec, name, value, lambda x: x)

    def tree(cases: dict[tuple, list], depth: int) -> list:
        if depth == len(flags):
            return _only(list(cases.values()), "case")
        values = sorted({key[depth] for key in cases}, key=str)
        branches = [(val, tree({k: s for k, s in cases.items() if k[depth] == val}, depth + 1)) for val in values]
        out = branches[-1][1]
        for val, steps in reversed(branches[:-1]):
            out = _merge(steps, out, cond(flags[depth], val))
        return out

    steps = tree(per_case, 0)
    t_names = [t.name for t in spec.tensors]
    first = t_names[0]
    inputs = [rr.Input(first)] + [rr.Input(n, dtype="float32", per_row=False) for n in t_names[1:]]
    outputs = [rr.Output(o.name, "int32" if o.dtype == "int32" else "float32") for o in spec.outputs]
    k_dim = str(op.cases[0].ir.extents[spec.outputs[0].index[-1]])
    # params: flags (bool 0/1, str: index of the choice), presence of optional tensors, ints, floats;
    # the k dim is a dim, not a param
    scalars = [a_ for a_ in spec.scalars if a_.name != k_dim]
    params = [rr.Param(a_.name, "int32") for a_ in scalars if a_.type in ("bool", "str")]
    params += [rr.Param(f"has_{t.name}", "int32") for t in spec.tensors if t.optional]
    params += [rr.Param(a_.name, "int32") for a_ in scalars if a_.type == "int"]
    params += [rr.Param(a_.name, "float32") for a_ in scalars if a_.type == "float"]
    length = str(op.cases[0].ir.extents[op.cases[0].ir.over])
    rows = "n_rows"  # the rows dim (its axis name could clash with the template's own names, e.g. T)
    prog = rr.StepProgram(spec.name, tuple(inputs), tuple(outputs), tuple(params), tuple(steps),
                          rows=rows, length=length, k=k_dim)
    rr.check_program(prog)
    return prog


def row_plan(spec: OpSpec, op: OpAnalysis, families: list[str]) -> Plan:
    from . import resident_row as rr

    prog = row_program(spec, op)
    cv = spec.variants.cuda
    caps = dict(cv.static).get("E_cap", (64, 128, 256, 512))
    plan = Plan(families=tuple(families))
    entries = []
    for fam in families:
        for dtype in cv.dtypes:
            for cap in caps:
                var = rr.RowVariant(dtype=dtype, e_cap=int(cap), family=fam)
                sym = var.variant_name(spec.name)
                text = rr.emit_resident_row_program(prog, var, sym)
                plan.jobs.append(Job(sym, fam, text, (("spec", spec.file), ("template", "resident_row"))))
                entries.append((fam, dtype, int(cap), sym, rr.preconditions(prog, var)))
    plan.entries = entries  # type: ignore[attr-defined]
    plan.program = prog  # type: ignore[attr-defined]
    return plan


def row_body(spec: OpSpec, plan: Plan, lowered: dict[str, dict]) -> list[str]:
    prog = plan.program  # type: ignore[attr-defined]
    ir_len, ir_rows, ir_k = prog.length, prog.rows, prog.k
    first = spec.tensors[0].name
    fams = ", ".join(f'"{f}"' for f in plan.families)
    row_axis = str(next(iter(spec.tensors)).shape[0])
    names = {ir_rows: "A.sz_" + row_axis, ir_len: "A.sz_" + ir_len}
    for a in spec.scalars:
        if a.type == "int":
            names[a.name] = f"A.p_{a.name}"
        elif a.type == "bool" or a.type == "str":
            names[a.name] = f"A.f_{a.name}"
        elif a.type == "float":
            names[a.name] = f"A.p_{a.name}"
    for t in spec.tensors:
        if t.optional:
            names[f"has_{t.name}"] = f"(A.has_{t.name} ? 1 : 0)"
    L = [
        "Args& A = c.A;",
        f"redfuser::CudaContext ctx(kOp, {first}, {{{fams}}});",
        "const std::string fam = ctx.family();",
        "do {",
        f"  if ({names[ir_rows]} == 0) break;  // nothing to compute",
        f"  const ScalarType dt = {first}.scalar_type();",
        "  // the kernel reads dense rows: other layouts are copied to a contiguous tensor first",
    ]
    t_args = {}
    for t in spec.tensors:
        # aten::contiguous returns the tensor itself when it is already dense
        if t.optional:
            L.append(f"  const Tensor {t.name}_c = A.has_{t.name} ? torch::stable::contiguous(*{t.name}) : {first};")
            t_args[t.name] = f"(A.has_{t.name} ? const_cast<void*>({t.name}_c.const_data_ptr()) : nullptr)"
        else:
            L.append(f"  const Tensor {t.name}_c = torch::stable::contiguous({t.name});")
            t_args[t.name] = f"const_cast<void*>({t.name}_c.const_data_ptr())"
    # launches over chunks of rows whose int32 offsets fit; the host offsets the per-row tensors' base pointers
    per_row = [(f"{first}_c", first)] + [(f"c.{o.name}", o.name) for o in spec.outputs]
    extents = ", ".join(f"{{\"{n}\", {x}.stride(0), redfuser::batch_extent({x})}}" for x, n in per_row)
    L.append(f"  const int64_t rchunk = redfuser::batch_chunk(kOp, {names[ir_rows]}, {{{extents}}}, "
             "std::numeric_limits<int32_t>::max());")
    L.append(f"  for (int64_t r_launch0 = 0; r_launch0 < {names[ir_rows]}; r_launch0 += rchunk) {{")
    L.append(f"  const int64_t n_launch_r = std::min(rchunk, {names[ir_rows]} - r_launch0);")
    L.append("  bool launched = false;")
    for x, n in per_row:
        t_args[n] = f"redfuser::batch_ptr({x}, r_launch0)"
    args = {**t_args, **{k: v for k, v in names.items()}, ir_k: f"A.p_{ir_k}"}
    args[ir_rows] = args["num_tokens"] = "n_launch_r"
    caps_by = {}
    for fam, dtype, cap, sym, pre in plan.entries:  # type: ignore[attr-defined]
        caps_by.setdefault((fam, dtype), []).append((cap, sym, pre))
    for (fam, dtype), items in caps_by.items():
        L.append(f"  if (!launched && fam == \"{fam}\" && dt == {SCALAR_TYPES[dtype]}) {{")
        for cap, sym, pre in sorted(items):
            L.append(f"    if (!launched && {names[ir_len]} <= {cap}) {{")
            for cond, msg in pre:
                L.append(f"      check({py_to_cpp(cond, {**names, ir_k: f'A.p_{ir_k}'})}, kOp, \"{msg}\");")
            L.append(f"      redfuser::launch(kV_{sym}, ctx, [&](void* s) {{ return {launch_call(sym, lowered[sym]['params'], args)}; }});")
            L.append("      launched = true;")
            L.append("    }")
        L.append("  }")
    L += [
        (f"  check(launched, kOp, \"no CUDA kernel for \", dtype_name(dt), \" with {ir_len} = \", {names[ir_len]}, "
         f"\" (the largest built is {max(c for _, _, c, _, _ in plan.entries)})\");"),  # type: ignore[attr-defined]
        "  }",
        "} while (false);",
    ]
    return L
