"""Bridge: the engine's forms of a one-pass row cascade with per-row results -> the stream_row template's RowMath,
plus the plan (variants to lower) and the body of the op's impl_cuda (the (plan, body) pair of cuda.TEMPLATES).

Bound by role, never by an op's names. The cascade must have one row index and one pass over the streamed axis in
which every reduction is a scalar max/min/sum (a `where=` predicate selects its neutral element for the elements
that fail it); every term reads the streamed element only through
one 2-D tensor read at (row, streamed index) (possibly through element lets), the streamed index itself, per-row
reads of 1-D integer tensors, reads of 1-D *column* tensors at the streamed index (a norm's weight, in the row
tensor's dtype), and scalars. An output is indexed by the row (written once per row) or by (row, streamed index): a
per-element output, written in the template's final pass over the row from the final states, stored as float32,
float16, bfloat16, float8_e4m3fn or the row tensor's dtype (an outermost cast to that dtype is the store's
conversion). One top-k selection over the row (a key that reads no state; `where=`, payloads) may stream with the
states; its outputs, indexed (row, rank), read the entries (`sel.value[r]`, `sel.index[r]`, payloads), the final states
and the parameters, stored as float32/int32/int64; such rows run one CTA each (never split). What the
kernel computes comes from the engine: the states' terms, their online corrections and guards, the merge form
(merge_terms) and the outputs.
"""

from __future__ import annotations

from dataclasses import replace

import sympy as sp

from ...spec import OpSpec
from ...symbolic.algebra import MONOIDS
from ...symbolic.expr import Cast
from ...symbolic.forms import Analysis, OpAnalysis
from ..bridge import BridgeError, Job, Plan, launch_call, merge_terms
from ..bridge import RolePrinter as _Printer
from ..glue import SCALAR_TYPES
from . import stream_row as sr

INT_DTYPES = ("int64", "int32")


def _fail(where: str, msg: str) -> BridgeError:
    return BridgeError(f"{where}: stream_row: {msg}")


def _case_math(spec: OpSpec, a: Analysis) -> tuple[sr.RowMath, dict]:
    ir = a.ir
    where = f"{ir.op} [{ir.label}]"
    if len(ir.rows) != 1:
        raise _fail(where, f"needs one row index, found {len(ir.rows)}")
    if len(a.passes) != 1 or any(f.stage != "stream" for f in a.reductions):
        raise _fail(where, "streams one pass over the row; this cascade needs "
                    f"{len(a.passes)} pass(es) and {sum(f.stage != 'stream' for f in a.reductions)} epilogue(s)")
    if ir.mask not in (sp.true, True):
        raise _fail(where, "has no mask over the streamed axis")
    sels = [f for f in a.reductions if f.selection]
    if len(sels) > 1:
        raise _fail(where, f"selects more than once ({', '.join(f.name for f in sels)}): one top-k per row")
    for f in a.reductions:
        if f.free:
            raise _fail(where, f"reduction {f.name} is carried over {', '.join(f.free)}: per-row states only")
        if f.selection and f.k is None:
            raise _fail(where, f"reduction {f.name} ({f.op}) selects one element: stream_row selects top-k")
        if not f.selection and f.op not in sr.OPS:
            raise _fail(where, f"reduction {f.name}: op {f.op} not in {sr.OPS}")
    sel = sels[0] if sels else None
    over = ir.indices[ir.over]
    row = ir.indices[ir.rows[0]]
    row_axis = str(ir.extents[ir.rows[0]])
    length_axis = str(ir.extents[ir.over])
    lets = {x.symbol: x.expr for x in ir.element_lets}

    def expand(e: sp.Basic) -> sp.Basic:
        for _ in range(len(lets) + 1):
            e = e.xreplace(lets)
        return e

    # roles of the tensors read by the terms and the outputs
    reads = set()
    for f in a.reductions:
        reads |= expand(f.term).atoms(sp.Indexed) | expand(sp.sympify(f.where)).atoms(sp.Indexed)
        for p in f.payloads:
            reads |= expand(p.term).atoms(sp.Indexed)
    entries = {}  # a selection's entries read by the outputs: top.value[r] -> kv, top.index[r] -> kix, ...
    if sel is not None:
        fields = {"value": "kv", "index": "kix", **{p.name: f"kp{i}" for i, p in enumerate(sel.payloads)}}
        entries = {sp.IndexedBase(f"{sel.name}.{fl}"): nm for fl, nm in fields.items()}
    for o in a.outputs:
        reads |= {ix for ix in expand(o.value).atoms(sp.Indexed) if ix.base not in entries}
    row_reads = sorted({ix for ix in reads if tuple(ix.indices) == (row, over)}, key=str)
    if len(row_reads) != 1:
        raise _fail(where, f"needs exactly one row tensor read at [{row}, {over}], found "
                    f"{[str(x) for x in row_reads] or 'none'}")
    x_read = row_reads[0]
    x_name = str(x_read.base.label)
    if len(spec.arg(x_name).shape) != 2:
        raise _fail(where, f"the row tensor {x_name} must be 2-D")
    index_reads, col_reads = [], []
    for ix in sorted(reads - {x_read}, key=str):
        name = str(ix.base.label)
        arg = spec.arg(name)
        if tuple(ix.indices) == (over,):
            if len(arg.shape) != 1 or getattr(arg, "optional", False) or arg.same_as != x_name:
                raise _fail(where, f"read {ix}: a column tensor (read at [{over}]) must be 1-D, not optional, and "
                            f"have the row tensor's dtype (dtype: {x_name})")
            col_reads.append(ix)
            continue
        if tuple(ix.indices) != (row,):
            raise _fail(where, f"read {ix}: besides the row tensor only per-row reads t[{row}] and column reads "
                        f"t[{over}] are streamed")
        if any(d not in INT_DTYPES for d in (arg.dtypes or ())) or not arg.dtypes:
            raise _fail(where, f"per-row tensor {name} must be an integer index tensor ({'/'.join(INT_DTYPES)})")
        if getattr(arg, "optional", False):
            raise _fail(where, f"per-row tensor {name} cannot be optional")
        index_reads.append(ix)
    index_names = [str(ix.base.label) for ix in index_reads]
    iparams = [n for n, _ in ir.scalars.items() if spec.arg(n).type == "int"]
    fparams = [n for n, _ in ir.scalars.items() if spec.arg(n).type == "float"]
    others = [n for n in ir.scalars if n not in iparams + fparams]
    if others:
        raise _fail(where, f"scalar(s) {others} are flags: stream_row takes int and float parameters only")
    names: dict[sp.Basic, str] = {x_read: "x", over: "e", ir.extents[ir.over]: "L"}
    names.update({ix: f"r{k}" for k, ix in enumerate(index_reads)})
    names.update({ix: f"c{k}" for k, ix in enumerate(col_reads)})
    names.update({ir.scalars[n]: f"ip{k}" for k, n in enumerate(iparams)})
    names.update({ir.scalars[n]: f"fp{k}" for k, n in enumerate(fparams)})
    rows_states = [f for f in a.reductions if not f.selection]
    pos = {f.name: f"s{i}" for i, f in enumerate(rows_states)}
    guards = {g.state: g for g in a.guards}
    st = {}
    for f in rows_states:
        sy = a.symbols[f.name]
        p = pos[f.name]
        st[p] = sy
        names[ir.states[f.name]] = p
        names[sy["new"]] = p
        names[sy["old"]] = f"{p}_old"
        names[sy["new_safe"]] = f"{p}_safe" if f.name in guards else p
        names[sy["safe"]] = f"{p}_safe" if f.name in guards else p

    def old_safe(e: sp.Basic) -> sp.Basic:  # a guarded old value, inline
        sub = {}
        for n, g in guards.items():
            sub[a.symbols[n]["old_safe"]] = g.apply(a.symbols[n]["old"])
        for f in rows_states:
            if f.name not in guards:
                sub[a.symbols[f.name]["old_safe"]] = a.symbols[f.name]["old"]
        return e.xreplace(sub)

    tl = _Printer(names, where, sr.INF)
    states = []
    for f in rows_states:
        term = expand(f.term)
        if f.where not in (sp.true, True):  # where=: an element that fails the predicate contributes the neutral
            term = sp.Piecewise((term, expand(f.where)), (MONOIDS[f.op].neutral, True))
        bad = term.atoms(sp.Indexed) - {x_read} - set(index_reads) - set(col_reads)
        if bad:
            raise _fail(where, f"state {f.name} reads {sorted(map(str, bad))}")
        g = guards.get(f.name)
        guard = (_Printer({a.symbols[f.name]["new"]: pos[f.name]}, where, sr.INF)(g.apply(a.symbols[f.name]["new"]))
                 if g else None)
        corr = None if f.kind == "none" else tl(old_safe(f.correction))
        states.append(sr.State(f.op, tl(term), corr, "add" if f.kind == "+" else "mul", guard))
    # the merge form: a segment's states corrected to the merged ones (names: s<i>_seg, s<i>, s<i>_safe)
    select = None
    if sel is not None:
        key = expand(sel.term)
        bad = (key.atoms(sp.Indexed) | expand(sp.sympify(sel.where)).atoms(sp.Indexed)) - {x_read} - \
            set(index_reads) - set(col_reads)
        bad |= {ix for p in sel.payloads for ix in expand(p.term).atoms(sp.Indexed)} - {x_read} - set(index_reads) \
            - set(col_reads)
        if bad:
            raise _fail(where, f"selection {sel.name} reads {sorted(map(str, bad))}")
        cond = None if sel.where in (sp.true, True) else tl(expand(sel.where))
        select = sr.Selection(tl(key), cond, tuple(tl(expand(p.term)) for p in sel.payloads))
    forms = [replace(f, name=pos[f.name]) for f in a.reductions if not f.selection]
    base = {s: names[s] for s in [*ir.scalars.values(), ir.extents[ir.over], *index_reads]}
    _, terms = merge_terms(forms, st, {pos[n]: g for n, g in guards.items()}, base,
                           lambda nm: _Printer(nm, where, sr.INF))
    outputs, elem, kout = [], [], []
    for o in a.outputs:
        dtype = next(x.dtype for x in spec.outputs if x.name == o.name)
        if sel is not None and len(o.index) == 2 and o.index[0] == ir.rows[0] and o.index[1] != ir.over:
            kout.append((o.name, _k_output(where, o, dtype, sel, ir, entries, names)))
            continue
        if tuple(o.index) == (ir.rows[0], ir.over):
            elem.append((o.name, _elem_output(where, o, dtype, x_name, expand, tl)))
            continue
        if tuple(o.index) != (ir.rows[0],):
            raise _fail(where, f"output {o.name} is indexed ({', '.join(o.index)}): stream_row writes per-row "
                        f"results and per-element results indexed ({ir.rows[0]}, {ir.over})")
        if dtype != "float32":
            raise _fail(where, f"output {o.name} is {dtype}: stream_row writes float32")
        if o.per_element:
            raise _fail(where, f"output {o.name} reads elements of the row after the pass")
        outputs.append(tl(o.value))
    if sel is not None and not kout:
        raise _fail(where, f"no output reads the entries of the selection {sel.name}")
    math = sr.RowMath(tuple(states), tuple(t for _, t in terms), tuple(outputs), len(index_reads), len(iparams),
                      len(fparams), len(col_reads), tuple(e for _, e in elem), select, tuple(e for _, e in kout))
    sr.check_math(math)
    elem_names = {n for n, _ in elem}
    roles = {"x": x_name, "rows": row_axis, "length": length_axis, "index": tuple(index_names),
             "iparams": tuple(iparams), "fparams": tuple(fparams),
             "outputs": tuple(o.name for o in a.outputs if o.name not in elem_names | {n for n, _ in kout}),
             "cols": tuple(str(ix.base.label) for ix in col_reads), "elem_outputs": tuple(n for n, _ in elem),
             "k_outputs": tuple(n for n, _ in kout)}
    return math, roles


def _k_output(where: str, o, dtype: str, sel, ir, entries: dict, names: dict) -> tuple[str, str]:
    """(value text, store dtype) of an output of the selection's entries, indexed (row, rank)."""
    r = ir.indices[o.index[1]]
    if ir.extents[o.index[1]] != sel.k:
        raise _fail(where, f"output {o.name} is indexed by {o.index[1]} of extent {ir.extents[o.index[1]]}, not the "
                    f"selection's k = {sel.k}")
    if dtype not in sr.K_DTYPES:
        raise _fail(where, f"output {o.name} is {dtype}: the entries of a selection are stored as "
                    f"{'/'.join(sr.K_DTYPES)}")
    value = o.value
    for ix in value.atoms(sp.Indexed):
        if ix.base not in entries:
            raise _fail(where, f"output {o.name} reads {ix}: an entry's output reads the entries, states and "
                        "parameters only")
        if tuple(ix.indices) != (r,):
            raise _fail(where, f"output {o.name} reads {ix}: entries are read at the output's own rank {r}")
    knames = {**names, **{ix: entries[ix.base] for ix in value.atoms(sp.Indexed)}, r: "j"}
    if isinstance(value, Cast) and value.dtype == dtype:  # the store's own conversion
        value = value.args[0]
    try:
        return _Printer(knames, where, sr.INF)(value), dtype
    except ValueError as exc:
        raise _fail(where, f"output {o.name}: {exc}") from exc


def _elem_output(where: str, o, dtype: str, x_name: str, expand, tl) -> tuple[str, str]:
    """(float32 value text, store dtype) of a per-element output; the store dtype ``row`` is the row tensor's."""
    store = "row" if dtype == x_name else dtype
    if store != "row" and store not in sr.OUT_DTYPES:
        raise _fail(where, f"per-element output {o.name} is {dtype}: stream_row stores {'/'.join(sr.OUT_DTYPES)} "
                    "or the row tensor's dtype")
    value = expand(o.value)
    if isinstance(value, Cast) and value.dtype == store:  # the store's own conversion
        value = value.args[0]
    try:
        return tl(value), store
    except ValueError as exc:
        raise _fail(where, f"per-element output {o.name}: {exc}") from exc


def stream_math(spec: OpSpec, op: OpAnalysis) -> tuple[sr.RowMath, dict]:
    if len(op.cases) != 1:
        flags = [n for n, _ in op.cases[0].ir.specialization]
        raise BridgeError(f"{spec.name}: stream_row: the cascade is specialised on {flags}; stream_row runs one "
                          "schedule without run-time branches")
    return _case_math(spec, op.cases[0])


def stream_plan(spec: OpSpec, op: OpAnalysis, families: list[str]) -> Plan:
    math, roles = stream_math(spec, op)
    cv = spec.variants.cuda
    bad = [f for f in families if f not in sr.FAMILIES]
    if bad:
        raise BridgeError(f"{spec.name}: stream_row has no variants for {bad} (families {sr.FAMILIES})")
    plan = Plan(families=tuple(families))
    hdr = (("spec", spec.file), ("template", sr.TEMPLATE_VERSION))
    entries = []
    for fam in families:
        merge = None
        if not math.whole_row:  # a selection is never split: no merge program
            merge = sr.StreamVariant(cv.dtypes[0], fam).merge_name(spec.name)
            plan.jobs.append(Job(merge, fam, sr.emit_stream_row_merge(math, sr.StreamVariant(cv.dtypes[0], fam),
                                                                      merge), hdr))
        for dt in cv.dtypes:
            v = sr.StreamVariant(dt, fam)
            sym = v.variant_name(spec.name)
            plan.jobs.append(Job(sym, fam, sr.emit_stream_row_program(math, v, sym), hdr))
            final = None
            if math.elem_outputs:  # split rows' per-element outputs: written after the merge, per segment
                final = v.final_name(spec.name)
                plan.jobs.append(Job(final, fam, sr.emit_stream_row_final(math, v, final), hdr))
            entries.append((fam, dt, sym, merge, v.chunk, final))
    plan.entries = entries  # type: ignore[attr-defined]
    plan.math = math  # type: ignore[attr-defined]
    plan.roles = roles  # type: ignore[attr-defined]
    plan.support = ["", sr.SPLIT_CPP]  # type: ignore[attr-defined]
    return plan


def stream_body(spec: OpSpec, plan, lowered: dict[str, dict]) -> list[str]:
    """impl_cuda: rows with unit element stride (else copied), int64 index tensors, contiguous column tensors (else
    copied), launches over row chunks whose int32 offsets fit; few long rows are split across CTAs (segments' states
    in a float32 workspace, then the merge program, then for per-element outputs the final program) unless the
    cascade selects (one CTA per row)."""
    r = plan.roles
    x = r["x"]
    fams = ", ".join(f'"{f}"' for f in plan.families)
    rows, length = f"A.sz_{r['rows']}", f"A.sz_{r['length']}"
    L = [
        "Args& A = c.A;",
        f"redfuser::CudaContext ctx(kOp, {x}, {{{fams}}});",
        "const std::string fam = ctx.family();",
        "do {",
        f"  if ({rows} == 0) break;  // nothing to compute",
        f"  check({length} < (int64_t(1) << 31), kOp, \"on CUDA a row must have fewer than 2^31 elements\");",
        f"  const ScalarType dt = {x}.scalar_type();",
        "  // rows are read with unit element stride and a row stride of at least the row length: else copied",
        f"  const bool rows_ok = ({x}.size(1) <= 1 || {x}.stride(1) == 1) && ({rows} <= 1 || {x}.stride(0) >= {length});",
        f"  const Tensor xx = rows_ok ? {x} : torch::stable::contiguous({x});",
        # the row stride; batch_chunk below keeps (n - 1) * ld + L within int32 whenever a launch has two rows or
        # more (a launch of one row never multiplies by it)
        f"  const int64_t ld = {rows} <= 1 ? {length} : xx.stride(0);",
    ]
    for k, name in enumerate(r["index"]):
        L += [
            f"  Tensor idx{k} = {name};  // the kernel reads dense int64 indices: int32 or strided ones are copied",
            f"  if ({name}.scalar_type() != ScalarType::Long || {name}.stride(0) != 1) {{",
            f"    idx{k} = torch::stable::new_empty({name}, {{{name}.size(0)}}, ScalarType::Long);",
            f"    torch::stable::copy_(idx{k}, {name});",
            "  }",
        ]
    for k, name in enumerate(r["cols"]):
        L += [
            f"  const Tensor col{k} = {name}.stride(0) == 1 ? {name} : torch::stable::contiguous({name});",
        ]
    per_row = [("xx", x)] + [(f"idx{k}", n) for k, n in enumerate(r["index"])] + [(f"c.{o}", o) for o in r["outputs"]]
    per_row += [(f"c.{o}", o) for o in r["elem_outputs"] + r["k_outputs"]]
    extents = ", ".join(f"{{\"{n}\", {t}.stride(0), redfuser::batch_extent({t})}}" for t, n in per_row)
    L += [
        (f"  const int64_t rchunk = redfuser::batch_chunk(kOp, {rows}, {{{extents}}}, "
         "std::numeric_limits<int32_t>::max());"),
        f"  for (int64_t r0 = 0; r0 < {rows}; r0 += rchunk) {{",
        f"  const int64_t n_launch = std::min(rchunk, {rows} - r0);",
        "  bool launched = false;",
        "  int64_t ns = 1, cps = 0;",
        ("  stream_row_split_plan(n_launch, " + length + ", sms, chunk, ns, cps);" if not plan.math.whole_row else
         f"  cps = std::max<int64_t>(1, {length} / chunk);  // a selection: one CTA per row, never split"),
        "  // the segments' states (unused when a row is one segment: an output stands in for it)",
        (f"  Tensor ws = ns > 1 ? torch::stable::new_empty(xx, {{{len(plan.math.states)}, n_launch, ns}}, "
         f"ScalarType::Float) : c.{(r['outputs'] + r['elem_outputs'] + r['k_outputs'])[0]};"),
    ]
    kd = f"c.{r['k_outputs'][0]}.size(1)" if r["k_outputs"] else None  # a row's entries: the outputs' 2nd extent
    if kd:  # the selection's entries: one list of at most KCAP per thread
        L.insert(L.index("  bool launched = false;"),
                 f"  check({kd} <= {sr.KCAP}, kOp, \"on CUDA a row selects at most {sr.KCAP} entries, got \", {kd});")
    args = {"X": "redfuser::batch_ptr(xx, r0)", "L": length, "n_rows": "n_launch", "ld": "ld",
            "WS": "ws.mutable_data_ptr()", "n_split": "ns", "cps": "cps"}
    for k, _ in enumerate(r["index"]):
        args[f"R{k}"] = f"redfuser::batch_ptr(idx{k}, r0)"
    for k, o in enumerate(r["outputs"]):
        args[f"O{k}"] = f"redfuser::batch_ptr(c.{o}, r0)"
    for k, _ in enumerate(r["cols"]):
        args[f"C{k}"] = f"redfuser::batch_ptr(col{k}, 0)"
    for k, o in enumerate(r["elem_outputs"]):
        args[f"E{k}"] = f"redfuser::batch_ptr(c.{o}, r0)"
    if r["cols"] or r["elem_outputs"]:
        args["lo"] = length
    for k, o in enumerate(r["k_outputs"]):
        args[f"K{k}"] = f"redfuser::batch_ptr(c.{o}, r0)"
    if kd:
        args["kd"] = kd
    for k, p in enumerate(r["iparams"]):
        args[f"ip{k}"] = f"A.p_{p}"
    for k, p in enumerate(r["fparams"]):
        args[f"fp{k}"] = f"A.p_{p}"
    chunks = {chunk for _, _, _, _, chunk, _ in plan.entries}
    if len(chunks) != 1:
        raise BridgeError(f"{spec.name}: stream_row variants differ in chunk size {sorted(chunks)}")
    L.insert(L.index("  bool launched = false;"), f"  const int64_t chunk = {chunks.pop()};")
    if not plan.math.whole_row:  # the split plan needs the SM count
        L.insert(L.index("do {"), "const int64_t sms = redfuser::device_sm_count(kOp, ctx.device());")
    for fam, dt, sym, merge, _, final in plan.entries:
        L += [
            f"  if (!launched && fam == \"{fam}\" && dt == {SCALAR_TYPES[dt]}) {{",
            f"    redfuser::launch(kV_{sym}, ctx, [&](void* s) {{ return {launch_call(sym, lowered[sym]['params'], args)}; }});",
        ]
        if merge:
            L += [
                "    if (ns > 1) {",
                f"      redfuser::launch(kV_{merge}, ctx, [&](void* s) {{ return {launch_call(merge, lowered[merge]['params'], args)}; }});",
            ]
            if final:  # per-element outputs of split rows, from the merged states
                L.append(f"      redfuser::launch(kV_{final}, ctx, [&](void* s) {{ return "
                         f"{launch_call(final, lowered[final]['params'], args)}; }});")
            L.append("    }")
        L += [
            "    launched = true;",
            "  }",
        ]
    L += [
        "  check(launched, kOp, \"no CUDA kernel for \", dtype_name(dt), \" on \", fam);",
        "  }",
        "} while (false);",
    ]
    return L
