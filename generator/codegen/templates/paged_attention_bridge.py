"""Bridge: the engine's forms of a paged decode-attention cascade -> the paged_attention template.

Everything is bound by role, never by name:

* the *score*: the one element let holding a contraction ``sum_c Q[rows.., c] * C[page, j % P, .., c]``
  times scalar params; ``Q`` is the read without the streamed index, ``C`` (the cache) the read through the
  *page indirection* -- an element let ``BT[batch, j // P]`` (P: the page rows);
* the *weighted sum*: the carried reduction whose term is (weight) x ``C[page, j % P, .., d]``: V must be
  the same cache rows, a prefix ``d < DV <= DK`` of the contraction's channels (read once);
* the *rows*: the row index that indexes the table is the batch; the other rows, in the order of the
  query's indices, are packed ``a * heads + h``; the outputs must be laid out (batch, a, h, d) and
  (batch, a, h) or (batch, h, a);
* the *mask*: ``j < limit`` (or ``j <= limit - 1``) where ``limit`` reads one per-sequence length
  ``L[batch]`` and is ``L[batch]`` plus integer terms in the packed row coordinates and the axis extents
  that never exceed 0 (so no row sees past the length);
* the online update, guards, empty-row values and merge form: the engine's, rendered into the same
  :class:`AttentionMath` the streaming template takes.

A spec that differs only in names gives the same kernel text (tests/test_paged_attention.py).
"""

from __future__ import annotations

import dataclasses

import sympy as sp

from ...spec import OpSpec
from ...symbolic.expr import idiv
from ...symbolic.forms import Analysis, OpAnalysis
from ..bridge import merge_terms
from ..tl_print import TLPrinter
from . import paged_attention as pa
from . import stream_attention as sa


def _err(where: str, msg: str):
    from ..bridge import BridgeError

    return BridgeError(f"{where}: paged_attention: {msg}")


def _one(items: list, where: str, what: str):
    if len(items) != 1:
        raise _err(where, f"needs exactly one {what}, found {len(items)}")
    return items[0]


def find_roles(a: Analysis) -> dict:
    """The cascade's objects by role (see the module doc); raises BridgeError naming what does not fit."""
    ir = a.ir
    where = f"{ir.op} [{ir.label}]"
    j = ir.indices[ir.over]
    if len(a.passes) != 1 or any(f.stage != "stream" for f in a.reductions):
        raise _err(where, "one streaming pass over the keys is needed")
    score_let = _one([x for x in ir.element_lets if x.expr.atoms(sp.Sum)], where, "score let with a contraction")
    contraction = _one(sorted(score_let.expr.atoms(sp.Sum), key=str), where, "contraction in the score")
    (c, c_lo, c_hi), = contraction.limits
    reads = sorted(contraction.function.atoms(sp.Indexed), key=str)
    if len(reads) != 2 or sp.simplify(contraction.function - reads[0] * reads[1]) != 0:
        raise _err(where, f"the contraction must be a product of two reads, got {contraction.function}")
    page_lets = [x for x in ir.element_lets if isinstance(x.expr, sp.Indexed) and x.expr.has(j)]
    page_let = _one(page_lets, where, "page indirection let (table[batch, j // page])")
    cache = _one([r for r in reads if r.has(page_let.symbol)], where, "cache read through the page let")
    query = _one([r for r in reads if not r.has(j) and not r.has(page_let.symbol)], where, "query read")
    table = page_let.expr
    if len(table.indices) != 2 or not isinstance(table.indices[1], idiv) or table.indices[1].args[0] != j:
        raise _err(where, f"the page let must be table[batch, j // page], got {table}")
    page_rows = int(table.indices[1].args[1])
    batch = table.indices[0]
    rows = [ir.indices[r] for r in ir.rows]
    if batch not in rows:
        raise _err(where, f"the table's first index {batch} must be a row (the sequence)")
    ci = cache.indices
    if ci[0] != page_let.symbol or sp.simplify(ci[1] - sp.Mod(j, page_rows)) != 0 or ci[-1] != c or any(
            not x.is_Integer for x in ci[2:-1]):
        raise _err(where, f"the cache read must be C[page, j % {page_rows}, <constants>, c], got {cache}")
    if query.indices[-1] != c or query.indices[0] != batch or set(query.indices[1:-1]) != set(rows) - {batch}:
        raise _err(where, f"the query read must be Q[batch, rows.., c], got {query}")
    packed = list(query.indices[1:-1])
    if len(packed) != 2:
        raise _err(where, f"two packed row coordinates are needed (e.g. token, head), got {packed}")
    # the weighted sum and its V read
    forms = [f for f in a.reductions]
    acc = _one([f for f in forms if f.free], where, "weighted sum carried over a free index")
    if acc.op != "sum" or acc.kind not in ("*", "none") or any(f.selection for f in forms):
        raise _err(where, "the carried reduction must be a sum corrected by a factor")
    d = ir.indices[_one(list(acc.free), where, "free index of the weighted sum")]
    v_read = _one([x for x in acc.term.atoms(sp.Indexed) if d in x.free_symbols], where, "V read")
    if v_read.base != cache.base or v_read.indices[:-1] != ci[:-1] or v_read.indices[-1] != d:
        raise _err(where, f"V must be the cache rows of the score ({cache.base}[page, ...]), got {v_read}")
    weight = sp.simplify(acc.term / v_read)
    if weight.has(d):
        raise _err(where, f"the weighted sum must be (element weight) x V, got {acc.term}")
    # the mask: j < limit, limit = L[batch] + (integer terms <= 0)
    mask = ir.mask
    if isinstance(mask, sp.StrictLessThan) and mask.lhs == j:
        limit = mask.rhs
    elif isinstance(mask, sp.LessThan) and mask.lhs == j:
        limit = mask.rhs + 1
    else:
        raise _err(where, f"the mask must bound the key index from above (j < limit), got {mask}")
    lens = _one(sorted(limit.atoms(sp.Indexed), key=str), where, "per-sequence length read in the mask")
    if lens.indices != (batch,):
        raise _err(where, f"the length read must be L[batch], got {lens}")
    rest = sp.expand(limit - lens)
    extents = {ir.extents[ir.rows[rows.index(x)]]: x for x in packed}
    at_max = rest.xreplace({x: ext - 1 for ext, x in extents.items()})
    if rest.has(lens) or not (sp.simplify(at_max) <= 0) is sp.true or any(
            not sp.expand(rest).coeff(x).is_nonnegative for x in packed):
        raise _err(where, f"the mask limit {limit} must never exceed the length {lens} (and grow with the row)")
    return {"where": where, "j": j, "c": c, "dk": int(c_hi - c_lo + 1), "d": d, "score_let": score_let, "contraction": contraction,
                "query": query, "cache": cache, "table": table, "page_rows": page_rows, "batch": batch, "packed": packed,
                "acc": acc, "v_read": v_read, "weight": weight, "limit": limit, "lens": lens, "extents": extents}


def paged_math(a: Analysis) -> tuple[sa.AttentionMath, pa.PagedRoles, dict]:
    """The engine's forms as the template's (AttentionMath, PagedRoles)."""
    ir = a.ir
    r = find_roles(a)
    where = r["where"]
    acc = r["acc"]
    states = [f for f in a.reductions if not f.free]
    st = {f.name: a.symbols[f.name] for f in states}
    guards = {g.state: g for g in a.guards}
    params = {s: n for n, s in ir.scalars.items()}
    acc_s = sp.Symbol("acc_s", real=True)
    score = r["score_let"].expr.xreplace({r["contraction"]: acc_s})
    if score.free_symbols - {acc_s} - set(params):
        raise _err(where, f"the score {r['score_let'].expr} must be (params) x (the contraction)")
    mask_value = a.mask_value.get(r["score_let"].symbol)
    if mask_value is None:
        raise _err(where, "no score value makes every term neutral (needed for masked keys)")

    def printer(extra: dict) -> TLPrinter:
        return TLPrinter({r["score_let"].symbol: "s", **params, **extra}, where)

    # loop context: _old / _new / guarded values of the states
    loop = {}
    for name, roles in st.items():
        loop[roles["old"]] = f"{name}_old"
        loop[roles["new"]] = f"{name}_new"
        loop[roles["new_safe"]] = f"{name}_safe" if name in guards else f"{name}_new"
    tl = printer(loop)
    row_states, guard_list = [], []
    for f in states:
        if f.op not in ("max", "min", "sum"):
            raise _err(where, f"state {f.name}: {f.op} is not a row reduction")
        init = printer({})(f.neutral) if f.op != "sum" else "T.float32(0)"
        corr = None if f.kind == "none" else tl(f.correction)
        row_states.append(sa.RowState(f.name, f.op, init, tl(f.term), corr, "add" if f.kind == "+" else "mul"))
    for name, g in guards.items():
        guard_list.append(sa.Guard(f"{name}_safe", printer({st[name]["new"]: f"{name}_new"})(g.apply(st[name]["new"]))))
    # output context: final states and the accumulator
    final = {ir.states[n]: n for n in st}
    final[ir.states[acc.name]] = "o"
    outs = {o.index: o for o in a.outputs}
    batch_row = ir.rows[[ir.indices[x] for x in ir.rows].index(r["batch"])]
    a_row, h_row = (ir.rows[[ir.indices[x] for x in ir.rows].index(p)] for p in r["packed"])
    free_name = acc.free[0]
    out_o = outs.get((batch_row, a_row, h_row, free_name))
    lse_rows = [k for k in outs if free_name not in k]
    if out_o is None or len(outs) != 2 or len(lse_rows) != 1:
        raise _err(where, f"outputs must be out ({batch_row}, {a_row}, {h_row}, {free_name}) and one per-row value")
    lse_index = lse_rows[0]
    if lse_index != (batch_row, h_row, a_row):
        raise _err(where, f"the per-row output must be laid out ({batch_row}, {h_row}, {a_row})")
    # merge context
    merge_names, terms = merge_terms(states, st, guards, {}, printer)
    merge_states = [sa.MergeState(name, term) for name, term in terms]
    merge_guards = [sa.Guard(f"{n}_safe", printer({st[n]["new"]: n})(g.apply(st[n]["new"]))) for n, g in guards.items()]
    o_seg = sp.Symbol("o__seg")
    acc_term = printer({**merge_names, o_seg: "o_seg"})(o_seg * acc.correction) if acc.kind == "*" else "o_seg"
    texts = [printer({acc_s: "acc_s"})(score)]
    used = [n for n in ir.scalars if any(n in sa._names(t) for t in texts)]
    math = sa.AttentionMath(
        score=texts[0],
        mask_value=printer({})(mask_value),
        states=tuple(row_states),
        guards=tuple(guard_list),
        weight=tl(r["weight"]),
        acc_correction=tl(acc.correction) if acc.kind != "none" else "T.float32(1)",
        out=printer(final)(out_o.value),
        lse=printer(final)(outs[lse_index].value),
        merge=sa.MergeForm(tuple(merge_states), tuple(merge_guards), acc_term),
        params=tuple(used),
    )
    # the mask limit as integer text over the template's role names
    ext_a, ext_h = (ext for ext, x in r["extents"].items() if x == r["packed"][0]), \
        (ext for ext, x in r["extents"].items() if x == r["packed"][1])
    role_syms = {r["lens"]: sp.Symbol("kv_len"), r["packed"][0]: sp.Symbol("row_a"),
                 r["packed"][1]: sp.Symbol("row_h"), next(ext_a): sp.Symbol("n_a"), next(ext_h): sp.Symbol("heads")}
    limit = sp.expand(r["limit"].xreplace(role_syms))
    if limit.free_symbols - {sp.Symbol(n) for n in ("kv_len", "row_a", "row_h", "n_a", "heads")}:
        raise _err(where, f"the mask limit {r['limit']} reads more than the length, the rows and their extents")
    roles = pa.PagedRoles(mask_limit=sp.sstr(limit), flag=False, dim_k=r["dk"], page=r["page_rows"])
    return math, roles, r


def kernel_math(op: OpAnalysis) -> tuple[sa.AttentionMath, pa.PagedRoles, dict, str | None]:
    """One kernel for every specialisation: they may differ in the mask limit only, selected at run time by a
    0/1 ``mask_flag`` (the spec's one bool flag).  Returns (math, roles, role objects, flag name or None)."""
    from ..bridge import BridgeError

    flags = [n for n, _ in op.cases[0].ir.specialization]
    per_case = {tuple(v for _, v in a.ir.specialization): paged_math(a) for a in op.cases}
    (math, roles, r), *others = per_case.values()
    if any(m != math or dataclasses.replace(ro, mask_limit="") != dataclasses.replace(roles, mask_limit="")
           for m, ro, _ in others):
        raise BridgeError(f"{op.cases[0].ir.op}: paged_attention: the specialisations must differ in the mask only")
    limits = {key: ro.mask_limit for key, (_, ro, _) in per_case.items()}
    if len(set(limits.values())) == 1:
        return math, roles, r, None
    if len(flags) != 1 or set(limits) != {(False,), (True,)}:
        raise BridgeError(f"{op.cases[0].ir.op}: paged_attention selects the mask on one bool flag, got {flags}")
    limit = f"T.if_then_else(mask_flag != 0, {limits[(True,)]}, {limits[(False,)]})"
    return math, dataclasses.replace(roles, mask_limit=limit, flag=True), r, flags[0]


# --------------------------------------------------------------------------------------------- plan and body
def paged_plan(spec: OpSpec, op: OpAnalysis, families: list[str]):
    from ..bridge import Job, Plan

    cv = spec.variants.cuda
    static = dict(cv.static)
    math, roles, r, flag = kernel_math(op)
    plan = Plan(families=tuple(families))
    dv_extent = op.cases[0].ir.extents[str(r["d"])]
    dv_values = static.get(str(dv_extent), (512,)) if isinstance(dv_extent, sp.Symbol) else (int(dv_extent),)
    hdr = (("spec", spec.file), ("template", pa.TEMPLATE_VERSION))
    entries = []
    for fam in families:
        for dtype in cv.dtypes:
            for dv in dv_values:
                cfg = pa.default_config(fam, dtype, int(dv))
                scfg = pa.default_config(fam, dtype, int(dv), split_kv=True)  # its own register split
                fwd, split = cfg.variant_name(spec.name), scfg.variant_name(spec.name)
                comb = scfg.combine_variant_name(spec.name)
                plan.jobs.append(Job(fwd, fam, pa.emit_paged_program(math, roles, cfg, fwd), hdr))
                plan.jobs.append(Job(split, fam, pa.emit_paged_program(math, roles, scfg, split), hdr))
                plan.jobs.append(Job(comb, fam, pa.emit_combine_program(math, scfg, comb), hdr))
                entries.append((fam, dtype, int(dv), cfg, fwd, split, comb))
    plan.entries = entries  # type: ignore[attr-defined]
    plan.math = (math, roles, r, flag)  # type: ignore[attr-defined]
    plan.dv_param = str(dv_extent) if isinstance(dv_extent, sp.Symbol) else None  # type: ignore[attr-defined]
    plan.support = ["", sa.NUM_SPLITS_CPP]  # type: ignore[attr-defined]
    return plan


def _axis_of(spec: OpSpec, tensor: str, dim: int) -> str:
    return str(spec.arg(tensor).shape[dim])


def paged_body(spec: OpSpec, plan, lowered: dict[str, dict]) -> list[str]:
    """impl_cuda: dense inputs, the empty cases, the split plan from host-known sizes, one launch per variant."""
    from ..bridge import launch_call as _call
    from ..glue import SCALAR_TYPES

    math, roles, r, flag = plan.math
    q, kv = str(r["query"].base.label), str(r["cache"].base.label)
    bt, lens = str(r["table"].base.label), str(r["lens"].base.label)
    o_name, lse_name = (o.name for o in spec.outputs)
    sz = {k: f"A.sz_{_axis_of(spec, t, d)}" for k, t, d in (("B", q, 0), ("NB", kv, 0), ("MB", bt, 1))}
    a_axis, h_axis = (_axis_of(spec, q, 1 + i) for i in range(2))
    dv_sym = plan.dv_param
    fams = ", ".join(f'"{f}"' for f in plan.families)
    min_chunk, max_splits = pa.SPLIT_MIN_KEYS, pa.SPLIT_MAX_SEGMENTS  # the template's split plan (README)
    dv_expr = f"A.p_{dv_sym}" if dv_sym else str(plan.entries[0][2])
    L = [
        "Args& A = c.A;",
        f"redfuser::CudaContext ctx(kOp, {q}, {{{fams}}});",
        "const std::string fam = ctx.family();",
        "do {",
        f"  const int64_t rows = A.sz_{a_axis} * A.sz_{h_axis};  // packed query rows of one sequence",
        f"  if ({sz['B']} == 0 || rows == 0) break;  // nothing to compute",
        f"  if ({sz['MB']} == 0 || {sz['NB']} == 0) {{  // no page to read: every sequence is empty",
        f"    torch::stable::zero_(c.{o_name});",
        f"    torch::stable::fill_(c.{lse_name}, -std::numeric_limits<double>::infinity());",
        "    break;",
        "  }",
        f"  const ScalarType dt = {q}.scalar_type();",
        "  // the kernels read dense, 16-byte aligned tensors: anything else is copied first",
        "  auto dense = [&](const Tensor& t) {",
        "    Tensor x = torch::stable::contiguous(t);",
        "    if (reinterpret_cast<uintptr_t>(x.const_data_ptr()) % 16 == 0) return x;",
        "    Tensor y = torch::stable::new_empty(x, x.sizes());",
        "    torch::stable::copy_(y, x);",
        "    return y;",
        "  };",
        f"  const Tensor qq = dense({q}), kk = dense({kv}), tt = dense({bt}), ll = dense({lens});",
        "  // sizes are int32 kernel arguments (the length clamp computes MB * page in int32); addressing is 64-bit",
        f"  for (int64_t s : {{{sz['B']}, rows, {sz['NB']}, {sz['MB']} * {roles.page}}})",
        "    check(s < (int64_t(1) << 31), kOp, \"sizes must fit in int32 on CUDA\");",
        "  const int32_t sms = redfuser::device_sm_count(kOp, ctx.device());",
        "  bool launched = false;",
    ]
    nst = len(math.states)
    for fam, dtype, dv, cfg, fwd, split, comb in plan.entries:
        cond = f'fam == "{fam}" && dt == {SCALAR_TYPES[dtype]} && {dv_expr} == {dv}'
        args = {"Q": "const_cast<void*>(qq.const_data_ptr())", "KV": "const_cast<void*>(kk.const_data_ptr())",
                "BT": "const_cast<void*>(tt.const_data_ptr())", "LENS": "const_cast<void*>(ll.const_data_ptr())",
                "O": f"c.{o_name}.mutable_data_ptr()", "LSE": f"c.{lse_name}.mutable_data_ptr()",
                "Opart": "opart.mutable_data_ptr()", "Spart": "spart.mutable_data_ptr()",
                "heads": f"A.sz_{h_axis}", "seqlen_q": f"A.sz_{a_axis}", "batch": sz["B"], "n_rows": "rows", "n_blocks": sz["NB"],
                "max_blocks": sz["MB"], "num_splits": "ns"}
        args.update({p: f"static_cast<float>(A.p_{p})" for p in math.params})
        if flag is not None:
            args["mask_flag"] = f"A.f_{flag} ? 1 : 0"
        L += [
            f"  if ({cond}) {{",
            "    // the split plan from host-known sizes only (the table's capacity stands for the length):",
            "    // no device read, so the launch sequence can be captured in a CUDA graph",
            (f"    const int ns = choose_num_splits({sz['B']}, 1, rows, {sz['MB']} * {roles.page}, {cfg.block_m}, "
             f"{cfg.block_n}, sms, {max_splits}, {max(1, min_chunk // cfg.block_n)});"),
            "    if (ns <= 1) {",
            f"      redfuser::launch(kV_{fwd}, ctx, [&](void* s) {{ return {_call(fwd, lowered[fwd]['params'], args)}; }});",
            "    } else {",
            f"      Tensor opart = torch::stable::new_empty(qq, {{ns, {sz['B']}, rows, {dv}}}, ScalarType::Float);",
            f"      Tensor spart = torch::stable::new_empty(qq, {{{nst}, ns, {sz['B']}, rows}}, ScalarType::Float);",
            f"      redfuser::launch(kV_{split}, ctx, [&](void* s) {{ return {_call(split, lowered[split]['params'], args)}; }});",
            f"      redfuser::launch(kV_{comb}, ctx, [&](void* s) {{ return {_call(comb, lowered[comb]['params'], args)}; }});",
            "    }",
            "    launched = true;",
            "  }",
        ]
    L += [
        (f"  check(launched, kOp, \"no CUDA kernel for \", dtype_name(dt), \" with {dv_sym or 'V width'} = \", {dv_expr}, "
        "\" on \", fam);"),
        "} while (false);",
    ]
    return L
