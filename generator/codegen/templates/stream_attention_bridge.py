"""Bridge from the engine's forms of an attention-shaped cascade to the stream_attention template.

It checks that the cascade has the template's shape (one streaming pass, row states and one weighted sum fed by a
contraction; says precisely why not otherwise), renders the engine's formulas into :class:`AttentionMath`, and
writes the op's ``impl_cuda`` body (checks the kernels rely on, the split-KV choice, one launch per variant).
"""

from __future__ import annotations

import sympy as sp

from ...spec import OpSpec
from ...symbolic.forms import Analysis, OpAnalysis
from ..bridge import BridgeError, Job, Plan, launch_call, only
from ..glue import SCALAR_TYPES
from ..tl_print import TLPrinter


def _only(items: list, what: str) -> object:
    return only(items, what, "stream_attention")


def attention_math(a: Analysis):
    """The engine's forms of an attention-shaped cascade as the template's AttentionMath."""
    from . import stream_attention as sa

    ir = a.ir
    where = f"{ir.op} [{ir.label}]"
    over = ir.indices[ir.over]
    forms = [f for f in a.reductions if f.stage == "stream"]
    if len(a.passes) != 1 or any(f.stage != "stream" for f in a.reductions):
        raise BridgeError(f"{where}: stream_attention runs one streaming pass")
    acc = _only([f for f in forms if f.free], "weighted sum carried over a free index")
    states = [f for f in forms if not f.free]
    if acc.op != "sum" or acc.kind not in ("*", "none") or any(f.selection for f in forms):
        raise BridgeError(f"{where}: the carried reduction must be a sum corrected by a factor")
    score_let = _only([x for x in ir.element_lets if x.expr.atoms(sp.Sum)], "score let with a contraction")
    contraction = _only(sorted(score_let.expr.atoms(sp.Sum), key=str), "contraction in the score")
    acc_s = sp.Symbol("acc_s", real=True)
    score_expr = score_let.expr.xreplace({contraction: acc_s})
    if score_expr.free_symbols - {acc_s} - set(ir.scalars.values()):
        raise BridgeError(f"{where}: the score {score_let.expr} must be (params) x (q . k)")
    # the V read: the factor of the carried term that depends on its free index
    free = ir.indices[_only(list(acc.free), "free index of the weighted sum")]
    v_reads = [x for x in acc.term.atoms(sp.Indexed) if free in x.free_symbols]
    v_read = _only(v_reads, "V read in the weighted sum")
    weight = sp.simplify(acc.term / v_read)
    if weight.has(free) or not v_read.has(over):
        raise BridgeError(f"{where}: the weighted sum must be (element weight) x V[j, d], got {acc.term}")
    mask = ir.mask
    causal = mask not in (sp.true, True)
    if causal:
        i, j = ir.indices[ir.rows[1]], over
        sq, sk = ir.extents[ir.rows[1]], ir.extents[ir.over]
        if sp.simplify(mask.lhs - mask.rhs - (j - (i + sk - sq))) != 0 or not isinstance(mask, sp.Le):
            raise BridgeError(f"{where}: stream_attention masks bottom-right causal (j <= i + Sk - Sq); got {mask}")
    mask_value = a.mask_value.get(score_let.symbol)
    if mask_value is None:
        raise BridgeError(f"{where}: no score value makes every term neutral (needed for masked keys)")

    # names: the template's contexts
    st = {f.name: a.symbols[f.name] for f in states}
    guards = {g.state: g for g in a.guards}
    base: dict[sp.Basic, str] = {score_let.symbol: "s"}
    base.update({s: n for n, s in ir.scalars.items()})
    loop = dict(base)
    for name, roles in st.items():
        loop[roles["old"]] = f"{name}_old"
        loop[roles["new"]] = f"{name}_new"
        loop[roles["new_safe"]] = f"{name}_safe" if name in guards else f"{name}_new"
    tl = TLPrinter(loop, where)
    row_states = []
    for f in states:
        if f.op not in ("max", "min", "sum"):
            raise BridgeError(f"{where}: state {f.name}: op {f.op} is not a row reduction")
        init = TLPrinter({}, where)(f.neutral) if f.op != "sum" else "T.float32(0)"
        corr = None if f.kind == "none" else tl(f.correction)
        row_states.append(sa.RowState(f.name, f.op, init, tl(f.term), corr, "mul" if f.kind != "+" else "add"))
    guard_list = []
    for name, g in guards.items():
        expr = TLPrinter({st[name]["new"]: f"{name}_new"}, where)(g.apply(st[name]["new"]))
        guard_list.append(sa.Guard(f"{name}_safe", expr))
    out_names = dict(base)
    out_names.update({ir.states[n]: n for n in st})
    out_names[ir.states[acc.name]] = "o"
    outs = {o.name: o for o in a.outputs}
    by_layout = {o.index: o for o in a.outputs}
    rows = tuple(ir.rows)
    out_o = by_layout.get(rows[:3] + (acc.free[0],)) if len(rows) == 3 else None
    out_lse = by_layout.get((rows[0], rows[2], rows[1]))
    if out_o is None or out_lse is None or len(outs) != 2:
        raise BridgeError(f"{where}: outputs must be out (B, Sq, H, D) and lse (B, H, Sq)")
    merge_names = dict(base)
    for name, roles in st.items():
        merge_names[roles["old"]] = f"{name}_seg"
        merge_names[roles["new_safe"]] = f"{name}_safe" if name in guards else name
        merge_names[roles["new"]] = name
    o_seg = sp.Symbol("o__seg")
    merge_states = []
    for f in states:
        seg = sp.Symbol(f"{f.name}__seg")
        if f.kind == "none":
            term = f"{f.name}_seg"
        else:
            term = TLPrinter({**merge_names, seg: f"{f.name}_seg"}, where)(
                seg * f.correction if f.kind == "*" else seg + f.correction)
        merge_states.append(sa.MergeState(f.name, term))
    merge_guards = [sa.Guard(f"{n}_safe", TLPrinter({st[n]["new"]: n}, where)(g.apply(st[n]["new"])))
                    for n, g in guards.items()]
    math = sa.AttentionMath(
        score=TLPrinter({acc_s: "acc_s", **{s: n for n, s in ir.scalars.items()}}, where)(score_expr),
        mask_value=TLPrinter({}, where)(mask_value),
        states=tuple(row_states),
        guards=tuple(guard_list),
        weight=tl(weight),
        acc_correction=tl(acc.correction) if acc.kind != "none" else "T.float32(1)",
        out=TLPrinter(out_names, where)(out_o.value),
        lse=TLPrinter(out_names, where)(out_lse.value),
        merge=sa.MergeForm(tuple(merge_states), tuple(merge_guards),
                           TLPrinter({**merge_names, o_seg: "o_seg"}, where)(o_seg * acc.correction)
                           if acc.kind == "*" else "o_seg"),
        params=tuple(ir.scalars),
    )
    return math, causal


def attention_plan(spec: OpSpec, op: OpAnalysis, families: list[str]) -> Plan:
    from . import stream_attention as sa

    cv = spec.variants.cuda
    static = dict(cv.static)
    plan = Plan(families=tuple(families))
    maths = {}
    for a in op.cases:
        math, causal = attention_math(a)
        maths[causal] = math
    entries = []
    for fam in families:
        for dtype in cv.dtypes:
            for D in static.get("D", sa.HEAD_DIMS):
                for causal in static.get("causal", (False, True)):
                    math = maths[bool(causal)]
                    cfg = sa.default_config(fam, dtype, D, bool(causal))
                    scfg = sa.default_config(fam, dtype, D, bool(causal), split_kv=True)
                    fwd = cfg.variant_name(spec.name)
                    split = scfg.variant_name(spec.name)
                    comb = scfg.combine_variant_name(spec.name)
                    hdr = (("spec", spec.file), ("template", sa.TEMPLATE_VERSION))
                    plan.jobs.append(Job(fwd, fam, sa.emit_attention_program(math, cfg, fwd), hdr))
                    plan.jobs.append(Job(split, fam, sa.emit_attention_program(math, scfg, split), hdr))
                    if not any(j.symbol == comb for j in plan.jobs):
                        plan.jobs.append(Job(comb, fam, sa.emit_combine_program(math, scfg, comb), hdr))
                    entries.append((fam, dtype, D, bool(causal), cfg, fwd, split, comb,
                                    1 if sa.uses_tma(cfg) else 8, len(math.states)))
    plan.entries = entries  # type: ignore[attr-defined]
    plan.support = ["", sa.NUM_SPLITS_CPP]  # type: ignore[attr-defined]
    return plan


def attention_body(spec: OpSpec, plan: Plan, lowered: dict[str, dict]) -> list[str]:
    """impl_cuda: checks the kernels rely on, the split heuristic, one launch per variant."""
    q, k, v = (t.name for t in spec.tensors[:3])
    o_name, lse_name = (o.name for o in spec.outputs)
    fams = ", ".join(f'"{f}"' for f in plan.families)
    L = [
        "Args& A = c.A;",
        f"redfuser::CudaContext ctx(kOp, {q}, {{{fams}}});",
        "const std::string fam = ctx.family();",
        "do {",
        "  if (A.sz_B == 0 || A.sz_Sq == 0 || A.sz_H == 0) break;  // nothing to compute",
        "  if (A.sz_Sk == 0) {  // every row sees no key",
        f"    torch::stable::zero_(c.{o_name});",
        f"    torch::stable::fill_(c.{lse_name}, -std::numeric_limits<double>::infinity());",
        "    break;",
        "  }",
        f"  const ScalarType dt = {q}.scalar_type();",
        "  const int64_t D = A.sz_D;",
        "  check(D == 64 || D == 128 || D == 256, kOp, \"on CUDA the head dim must be 64, 128 or 256, got \", D);",
        "  // the kernels read q/k/v through strides: last dim contiguous, other strides multiples of 8",
        "  // elements, 16-byte aligned data; anything else is copied to a contiguous tensor first",
        "  auto fits = [&](const Tensor& t) {",
        "    if (t.stride(3) != 1 || reinterpret_cast<uintptr_t>(t.const_data_ptr()) % 16 != 0) return false;",
        "    for (int d = 0; d < 3; ++d) if (t.stride(d) % 8 != 0 || t.stride(d) < 0 || t.stride(d) >= (int64_t(1) << 31)) return false;",
        "    return true;",
        "  };",
        "  auto dense_copy = [&](const Tensor& t) {  // a fresh (aligned, contiguous) copy",
        "    Tensor out = torch::stable::new_empty(t, t.sizes());",
        "    torch::stable::copy_(out, t);",
        "    return out;",
        "  };",
        f"  const Tensor qq = fits({q}) ? {q} : dense_copy({q});",
        f"  const Tensor kk = fits({k}) ? {k} : dense_copy({k});",
        f"  const Tensor vv = fits({v}) ? {v} : dense_copy({v});",
        "  for (int64_t s : {A.sz_B, A.sz_Sq, A.sz_Sk, A.sz_H, A.sz_Hk})",
        "    check(s < (int64_t(1) << 31), kOp, \"sizes must fit in int32\");",
        "  const int32_t sms = redfuser::device_sm_count(kOp, ctx.device());",
        "  const float scale = static_cast<float>(A.p_softmax_scale);",
        "  bool launched = false;",
    ]
    for fam, dtype, D, causal, cfg, fwd, split, comb, unit, nst in plan.entries:  # type: ignore[attr-defined]
        cond = (f'fam == "{fam}" && dt == {SCALAR_TYPES[dtype]} && D == {D} && '
                f"A.f_causal == {'true' if causal else 'false'}")
        strides = {f"{t}_{s}": f"{x}.stride({d}) / {unit}" for t, x in (("q", "qq"), ("k", "kk"), ("v", "vv"))
                   for s, d in (("sb", 0), ("ss", 1), ("sh", 2))}
        dims = {"batch": "A.sz_B", "seqlen_q": "A.sz_Sq", "heads": "A.sz_H", "seqlen_k": "A.sz_Sk",
                "heads_kv": "A.sz_Hk", "softmax_scale": "scale", "num_splits": "ns"}
        ptrs = {"Q": "const_cast<void*>(qq.const_data_ptr())", "K": "const_cast<void*>(kk.const_data_ptr())",
                "V": "const_cast<void*>(vv.const_data_ptr())",
                "O": f"c.{o_name}.mutable_data_ptr()", "LSE": f"c.{lse_name}.mutable_data_ptr()",
                "Opart": "opart.mutable_data_ptr()", "Spart": "spart.mutable_data_ptr()"}
        args = {**strides, **dims, **ptrs}
        L += [
            f"  if ({cond}) {{",
            (f"    const int ns = choose_num_splits(A.sz_B, A.sz_H, A.sz_Sq, A.sz_Sk, {cfg.block_m}, "
             f"{cfg.block_n}, sms);"),
            "    if (ns <= 1) {",
            f"      redfuser::launch(kV_{fwd}, ctx, [&](void* s) {{ return {launch_call(fwd, lowered[fwd]['params'], args)}; }});",
            "    } else {",
            "      Tensor opart = torch::stable::new_empty(qq, {ns, A.sz_B, A.sz_Sq, A.sz_H, A.sz_D}, ScalarType::Float);",
            f"      Tensor spart = torch::stable::new_empty(qq, {{{nst}, ns, A.sz_B, A.sz_H, A.sz_Sq}}, ScalarType::Float);",
            f"      redfuser::launch(kV_{split}, ctx, [&](void* s) {{ return {launch_call(split, lowered[split]['params'], args)}; }});",
            f"      redfuser::launch(kV_{comb}, ctx, [&](void* s) {{ return {launch_call(comb, lowered[comb]['params'], args)}; }});",
            "    }",
            "    launched = true;",
            "  }",
        ]
    L += [
        "  check(launched, kOp, \"no CUDA kernel for \", dtype_name(dt), \", head dim \", D, \" on \", fam);",
        "} while (false);",
    ]
    return L
