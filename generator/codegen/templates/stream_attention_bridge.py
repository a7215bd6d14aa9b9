"""Bridge from the engine's forms of an attention-shaped cascade to the stream_attention template.

It binds the cascade by role, never by name: the contraction of the score gives the Q and K reads, whose index
order gives the batch, query-row and head indices; the weighted sum's free factor is the V read; the K read's head
index gives the key/value heads (the same axis, or ``head // (H // Hk)``); the mask, read as affine constraints on
(query row, key), gives the band of keys each row sees (:class:`KeyBand`); the scalars the math reads become float
kernel arguments and the int arguments of the mask int ones; each specialisation of the flags is a variant, and the
values of an empty row come from the engine's outputs at the neutral states. Anything else is refused with the
reason. It renders the engine's formulas into :class:`AttentionMath` and writes the op's ``impl_cuda`` body (checks
the kernels rely on, the split-KV choice, one launch per variant) with the glue's own argument names.
"""

from __future__ import annotations

import math as _math
from dataclasses import dataclass

import sympy as sp

from ...spec import OpSpec
from ...symbolic.expr import idiv
from ...symbolic.forms import MONOIDS, Analysis, OpAnalysis, _numeric_at
from ..bridge import BridgeError, Job, Plan, flag_test, launch_call, merge_terms, only
from ..glue import SCALAR_TYPES
from ..tl_print import TLPrinter


def _only(items: list, what: str) -> object:
    return only(items, what, "stream_attention")


@dataclass(frozen=True)
class AttentionRoles:
    """What each name of the cascade is to the template (every field is a spec name)."""

    q: str
    k: str
    v: str
    out: str  # (batch, query, head, dim) output
    lse: str  # (batch, head, query) output
    batch: str  # axes
    query: str
    head: str
    key: str
    kv_head: str
    dim: str
    float_params: tuple[str, ...]  # scalars the math reads: kernel arguments fparam0, fparam1, ...
    int_params: tuple[str, ...]  # int scalars the mask reads: kernel arguments iparam0, ...
    empty: tuple[tuple[str, float], ...]  # output -> its value for a row that sees no key
    len_tensors: tuple[str, ...] = ()  # per-batch int tensors the mask reads (lens[batch]): buffers Blen0, ...


def _axis(e: sp.Basic, where: str, what: str) -> str:
    if not isinstance(e, sp.Symbol):
        raise BridgeError(f"{where}: the {what} extent must be an axis, got {e}")
    return e.name


def _roles(a: Analysis, contraction: sp.Sum, acc, where: str) -> tuple[dict, sp.Indexed]:
    """Bind batch / query / head / key / kv-head / dim by the reads of the score's contraction and of V."""
    ir = a.ir
    over = ir.indices[ir.over]
    c = contraction.limits[0][0]
    reads = sorted(contraction.function.atoms(sp.Indexed), key=str)
    if len(reads) != 2 or sp.simplify(contraction.function - reads[0] * reads[1]) != 0:
        raise BridgeError(f"{where}: the score's contraction must be a product of two reads (q . k), got "
                          f"{contraction.function}")
    k_read = _only([x for x in reads if x.has(over)], "K read (a contraction read indexed by the streamed axis)")
    q_read = _only([x for x in reads if not x.has(over)], "Q read (a contraction read free of the streamed axis)")
    rows = [ir.indices[r] for r in ir.rows]
    if len(rows) != 3 or len(q_read.indices) != 4 or q_read.indices[3] != c or set(q_read.indices[:3]) != set(rows):
        raise BridgeError(f"{where}: the Q read must be q[batch, query, head, c] over the three rows and the "
                          f"contraction index, got {q_read}")
    batch, query, head = q_read.indices[:3]
    k_name = str(k_read.base.label)
    k_shape = ir.tensor_args[k_name].shape
    if len(k_read.indices) != 4 or k_read.indices[0] != batch or k_read.indices[1] != over or k_read.indices[3] != c:
        raise BridgeError(f"{where}: the K read must be k[batch, key, kv_head, c], got {k_read}")
    g = k_read.indices[2]
    kv_axis = ir.axes.get(str(k_shape[2]))
    lets = {x.symbol: x.expr for x in ir.lets}
    g_expr = lets.get(g, g)
    if g_expr != head and not (kv_axis is not None and g_expr == idiv(head, idiv(ir.extents[str(head)], kv_axis))):
        raise BridgeError(f"{where}: the K read's head index must be the head or head // (H // Hk) (grouped "
                          f"heads), got {g_expr}")
    free = ir.indices[_only(list(acc.free), "free index of the weighted sum")]
    v_read = _only([x for x in acc.term.atoms(sp.Indexed) if free in x.free_symbols], "V read in the weighted sum")
    if tuple(v_read.indices) != (batch, over, g, free):
        raise BridgeError(f"{where}: the V read must be v[batch, key, kv_head, d] with the K read's kv_head, "
                          f"got {v_read}")
    if ir.extents[str(free)] != ir.extents[str(c)]:
        raise BridgeError(f"{where}: V's head dim ({ir.extents[str(free)]}) must be the q . k contraction's "
                          f"({ir.extents[str(c)]})")
    v_name = str(v_read.base.label)
    if ir.tensor_args[v_name].shape[:3] != k_shape[:3]:
        raise BridgeError(f"{where}: V {ir.tensor_args[v_name].shape} must have K's layout {k_shape}")
    q_name = str(q_read.base.label)
    read = {str(x.base.label) for f in a.reductions for x in f.term.atoms(sp.Indexed)}
    read |= {str(x.base.label) for let in ir.element_lets for x in let.expr.atoms(sp.Indexed)}
    extra = read & set(ir.tensors) - {q_name, k_name, v_name}
    if extra:
        raise BridgeError(f"{where}: stream_attention reads only q, k and v; this cascade also reads {sorted(extra)}")
    ax = {
        "batch": _axis(ir.extents[str(batch)], where, "batch"),
        "query": _axis(ir.extents[str(query)], where, "query"),
        "head": _axis(ir.extents[str(head)], where, "head"),
        "key": _axis(ir.extents[ir.over], where, "key"),
        "kv_head": str(k_shape[2]) if kv_axis is not None else _axis(ir.extents[str(head)], where, "head"),
        "dim": _axis(ir.extents[str(c)], where, "head dim"),
    }
    names = {"q": q_name, "k": k_name, "v": v_name, "query_index": query, "batch_index": batch,
             "head_index": head, "free": free}
    return {**ax, **names}, v_read


def _per_batch_reads(a: Analysis, mask: sp.Basic, batch: sp.Symbol | None, where: str):
    """The mask's tensor reads, each `lens[batch]` of a 1-D int tensor (per-sequence lengths), as symbols
    blen0, blen1, ... (in order of the tensor's name), or a refusal naming the read."""
    reads = sorted(mask.atoms(sp.Indexed), key=str)
    subst: dict[sp.Indexed, sp.Symbol] = {}
    tensors: list[str] = []
    for rd in reads:
        name = str(rd.base.label)
        arg = a.ir.tensor_args.get(name)
        if (batch is None or rd.indices != (batch,) or arg is None or len(arg.shape) != 1 or not arg.dtypes
                or not all(str(d).startswith("int") for d in arg.dtypes)):
            raise BridgeError(f"{where}: the mask reads {rd}; stream_attention takes tensor reads only as "
                              f"per-sequence values L[batch] of a 1-D int tensor")
        if name not in tensors:
            tensors.append(name)
        subst[rd] = sp.Symbol(f"blen{tensors.index(name)}", integer=True)
    return subst, tuple(tensors)


def key_band(a: Analysis, query: sp.Symbol, name: str, where: str, batch: sp.Symbol | None = None):
    """The mask as a band lo <= key < hi, each affine in the query row, the lengths, int arguments and per-sequence
    values L[batch] (or a refusal with the reason). Returns (band, int scalars read, per-batch tensors read)."""
    from . import stream_attention as sa

    ir = a.ir
    mask = ir.mask
    if mask in (sp.true, True):
        return None, (), ()
    j = ir.indices[ir.over]
    sq, sk = ir.extents[str(query)], ir.extents[ir.over]
    ints = {s: n for n, s in ir.scalars.items() if s.is_integer}
    subst, len_tensors = _per_batch_reads(a, mask, batch, where)
    mask = mask.xreplace(subst)
    known = {query: "r", sq: "seqlen_q", sk: "seqlen_k", **{s: str(s) for s in subst.values()}}
    atoms = mask.args if isinstance(mask, sp.And) else (mask,)
    lo: list[sp.Expr] = []
    hi: list[sp.Expr] = []
    for rel in atoms:
        if not isinstance(rel, (sp.Le, sp.Lt, sp.Ge, sp.Gt)):
            raise BridgeError(f"{where}: the mask term {rel} is not a bound on the key index (stream_attention "
                              f"masks a band lo(row) <= key < hi(row))")
        diff = sp.expand(rel.lhs - rel.rhs)
        cj = diff.coeff(j)
        rest = sp.expand(diff - cj * j)
        bad = rest.free_symbols - set(known) - set(ints)
        if cj not in (1, -1) or rest.has(j) or bad or not sp.Poly(rest, *sorted(rest.free_symbols, key=str) or [j]).is_linear:
            raise BridgeError(f"{where}: the mask term {rel} is not key +- (affine in the query row, the query and "
                              f"key lengths and int arguments)" + (f"; it reads {sorted(map(str, bad))}" if bad else ""))
        bound = -rest / cj  # key OP bound
        op = type(rel) if cj == 1 else {sp.Le: sp.Ge, sp.Lt: sp.Gt, sp.Ge: sp.Le, sp.Gt: sp.Lt}[type(rel)]
        if op is sp.Le:
            hi.append(bound + 1)
        elif op is sp.Lt:
            hi.append(bound)
        elif op is sp.Ge:
            lo.append(bound)
        else:
            lo.append(bound + 1)
    hi = [h for h in hi if sp.simplify(h - sk) != 0]  # key < Sk always holds
    lo = [x for x in lo if sp.simplify(x) != 0]  # key >= 0 always holds
    if len(hi) > 1 or len(lo) > 1:
        raise BridgeError(f"{where}: the mask {mask} has {len(lo)} lower and {len(hi)} upper bounds on the key; "
                          f"stream_attention takes at most one of each")
    used = sorted({ints[s] for b in lo + hi for s in b.free_symbols if s in ints})
    pnames = {ir.scalars[n]: f"iparam{k}" for k, n in enumerate(used)}

    def text(e: sp.Expr) -> str:
        e = sp.expand(e)
        const, _ = e.as_coeff_Add()
        # in the template's order of names (never the spec's), so that renaming the spec leaves the text alone
        order = ["r", "seqlen_q", "seqlen_k", *pnames.values(), *(f"blen{k}" for k in range(len(len_tensors)))]
        terms = sorted(((e.coeff(s), known.get(s) or pnames[s]) for s in e.free_symbols), key=lambda t: order.index(t[1]))
        if not const.is_Integer or not all(co.is_Integer for co, _ in terms):
            raise BridgeError(f"{where}: the mask bound {e} has non-integer coefficients")
        out = ""
        for co, nm in terms + [(const, "")]:
            co = int(co)
            if co == 0:
                continue
            mag = nm if abs(co) == 1 and nm else (f"{abs(co)} * {nm}" if nm else str(abs(co)))
            out += (" - " if co < 0 else " + ") + mag
        out = out.strip()
        return (out[2:] if out.startswith("+ ") else "-" + out[2:]) if out else "0"

    band = sa.KeyBand(name, lo=text(lo[0]) if lo else None, hi=text(hi[0]) if hi else None,
                      params=tuple(pnames.values()), tensors=tuple(f"blen{k}" for k in range(len(len_tensors))))
    return band, tuple(used), len_tensors


def _case_kind(a: Analysis, masked: bool) -> str:
    parts = []
    for name, value in a.ir.specialization:
        if value is True or value == "present":
            parts.append(name)
        elif value not in (False, None, "absent"):
            parts.append(str(value))
    return "_".join(parts) or ("masked" if masked else "full")


def _empty_values(a: Analysis, where: str) -> tuple[tuple[str, float], ...]:
    """Each output's value for a row that sees no key: its guarded value at the states' neutral elements."""
    ir = a.ir
    at = {ir.states[f.name]: float(MONOIDS[f.op].neutral) for f in a.reductions}
    out = []
    for o in a.outputs:
        vals = {_numeric_at(o.value, {**at, **{s: x for s in ir.scalars.values()}}) for x in (0.5, 3.0)}
        if len(vals) != 1 or any(_math.isnan(v) for v in vals):
            raise BridgeError(f"{where}: output {o.name} = {o.value} has no constant value for a row that sees no "
                              f"key (give it 'empty:')")
        out.append((o.name, vals.pop()))
    return tuple(out)


def attention_math(a: Analysis, kind: str | None = None):
    """The engine's forms of an attention-shaped cascade as the template's AttentionMath, its key band (None:
    every key) and the roles of the spec's names."""
    from . import stream_attention as sa

    ir = a.ir
    where = f"{ir.op} [{ir.label}]"
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
        raise BridgeError(f"{where}: the score {score_let.expr} must be a function of (params) and (q . k)")
    roles, v_read = _roles(a, contraction, acc, where)
    free = roles["free"]
    weight = sp.simplify(acc.term / v_read)
    if weight.has(free):
        raise BridgeError(f"{where}: the weighted sum must be (element weight) x V[j, d], got {acc.term}")
    band, int_params, len_tensors = key_band(a, roles["query_index"], kind or _case_kind(a, ir.mask not in (sp.true, True)),
                                             where, roles["batch_index"])
    mask_value = a.mask_value.get(score_let.symbol)
    if mask_value is None:
        raise BridgeError(f"{where}: no score value makes every term neutral (needed for masked keys)")

    # the scalars the math reads, as float kernel arguments fparam0, fparam1, ... (in argument order)
    math_exprs = [score_expr, weight, acc.correction] + [f.term for f in states] + [f.correction for f in states]
    math_exprs += [o.value for o in a.outputs]
    used = set().union(*[e.free_symbols for e in math_exprs if isinstance(e, sp.Basic)])
    float_params = tuple(n for n, s in ir.scalars.items() if s in used)
    pnames = {ir.scalars[n]: f"fparam{k}" for k, n in enumerate(float_params)}

    # names: the template's contexts
    st = {f.name: a.symbols[f.name] for f in states}
    guards = {g.state: g for g in a.guards}
    base: dict[sp.Basic, str] = {score_let.symbol: "s", **pnames}
    loop = dict(base)
    for name, rl in st.items():
        loop[rl["old"]] = f"{name}_old"
        loop[rl["new"]] = f"{name}_new"
        loop[rl["new_safe"]] = f"{name}_safe" if name in guards else f"{name}_new"
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
    b_, i_, h_ = (str(roles[x]) for x in ("batch_index", "query_index", "head_index"))
    out_o = by_layout.get((b_, i_, h_, acc.free[0]))
    out_lse = by_layout.get((b_, h_, i_))
    if out_o is None or out_lse is None or len(outs) != 2:
        raise BridgeError(f"{where}: outputs must be out (batch, query, head, d) and lse (batch, head, query)")
    merge_names, terms = merge_terms(states, st, guards, base, lambda names: TLPrinter(names, where))
    o_seg = sp.Symbol("o__seg")
    merge_states = [sa.MergeState(name, term) for name, term in terms]
    merge_guards = [sa.Guard(f"{n}_safe", TLPrinter({st[n]["new"]: n}, where)(g.apply(st[n]["new"])))
                    for n, g in guards.items()]
    math = sa.AttentionMath(
        score=TLPrinter({acc_s: "acc_s", **pnames}, where)(score_expr),
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
        params=tuple(pnames.values()),
    )
    binding = AttentionRoles(
        q=roles["q"], k=roles["k"], v=roles["v"], out=out_o.name, lse=out_lse.name,
        batch=roles["batch"], query=roles["query"], head=roles["head"], key=roles["key"],
        kv_head=roles["kv_head"], dim=roles["dim"], float_params=float_params, int_params=int_params,
        len_tensors=len_tensors,
        empty=_empty_values(a, where),
    )
    return math, band, binding


def attention_plan(spec: OpSpec, op: OpAnalysis, families: list[str]) -> Plan:
    from . import stream_attention as sa

    cv = spec.variants.cuda
    static = dict(cv.static)
    plan = Plan(families=tuple(families))
    cases = []
    for a in op.cases:
        spec_vals = dict(a.ir.specialization)
        if any(n in static and v not in static[n] for n, v in spec_vals.items()):
            continue  # a specialisation the spec does not compile for CUDA
        math, band, roles = attention_math(a)
        cases.append((a, math, band, roles))
    if not cases:
        raise BridgeError(f"{spec.name}: the cuda static values {static} leave no specialisation to compile")
    roles = cases[0][3]
    if any(c[3] != roles for c in cases):
        raise BridgeError(f"{spec.name}: the specialisations bind different names to the template's roles")
    kinds = [(band.name if band else "full") for _, _, band, _ in cases]
    if len(set(kinds)) != len(kinds):
        raise BridgeError(f"{spec.name}: two specialisations would share the variant name part {kinds}")
    entries = []
    for fam in families:
        for dtype in cv.dtypes:
            for D in static.get(roles.dim, sa.HEAD_DIMS):
                for a, math, band, _ in cases:
                    cfg = sa.default_config(fam, dtype, D, band is not None, band=band)
                    scfg = sa.default_config(fam, dtype, D, band is not None, split_kv=True, band=band)
                    fwd = cfg.variant_name(spec.name)
                    split = scfg.variant_name(spec.name)
                    comb = scfg.combine_variant_name(spec.name)
                    hdr = (("spec", spec.file), ("template", sa.TEMPLATE_VERSION))
                    plan.jobs.append(Job(fwd, fam, sa.emit_attention_program(math, cfg, fwd), hdr))
                    plan.jobs.append(Job(split, fam, sa.emit_attention_program(math, scfg, split), hdr))
                    if not any(j.symbol == comb for j in plan.jobs):
                        plan.jobs.append(Job(comb, fam, sa.emit_combine_program(math, scfg, comb), hdr))
                    conds = [flag_test(spec, n, v, lambda x: f"A.{x}" if x.startswith("has_") else f"A.f_{x}")
                             for n, v in a.ir.specialization]
                    entries.append((fam, dtype, D, conds, cfg, fwd, split, comb,
                                    1 if sa.uses_tma(cfg) else 8, len(math.states)))
    plan.entries = entries  # type: ignore[attr-defined]
    plan.roles = roles  # type: ignore[attr-defined]
    plan.support = ["", sa.NUM_SPLITS_CPP]  # type: ignore[attr-defined]
    return plan


def attention_body(spec: OpSpec, plan: Plan, lowered: dict[str, dict]) -> list[str]:
    """impl_cuda: checks the kernels rely on, the split heuristic, one launch per variant."""
    r: AttentionRoles = plan.roles  # type: ignore[attr-defined]
    q, k, v = r.q, r.k, r.v
    sz = {role: f"A.sz_{getattr(r, role)}" for role in ("batch", "query", "head", "key", "kv_head", "dim")}
    fams = ", ".join(f'"{f}"' for f in plan.families)
    dims = sorted({e[2] for e in plan.entries})  # type: ignore[attr-defined]
    empty = []
    for name, value in r.empty:
        if value == 0:
            empty.append(f"    torch::stable::zero_(c.{name});")
        else:
            lit = ("std::numeric_limits<double>::infinity()" if _math.isinf(value) else repr(value))
            empty.append(f"    torch::stable::fill_(c.{name}, {'-' if value < 0 and _math.isinf(value) else ''}{lit});")
    L = [
        "Args& A = c.A;",
        f"redfuser::CudaContext ctx(kOp, {q}, {{{fams}}});",
        "const std::string fam = ctx.family();",
        "do {",
        f"  if ({sz['batch']} == 0 || {sz['query']} == 0 || {sz['head']} == 0) break;  // nothing to compute",
        f"  if ({sz['key']} == 0) {{  // every row sees no key",
        *empty,
        "    break;",
        "  }",
        f"  const ScalarType dt = {q}.scalar_type();",
        f"  const int64_t D = {sz['dim']};",
        (f"  check({' || '.join(f'D == {d}' for d in dims)}, kOp, \"on CUDA the head dim must be "
         f"{', '.join(map(str, dims))}, got \", D);"),
        "  // the kernels read q/k/v through strides: last dim contiguous, other strides positive multiples of 8",
        "  // elements (an expanded, stride-0 dim is no TMA layout), 16-byte aligned data; anything else is copied to a",
        "  // contiguous tensor first. The batch stride may exceed int32: it only offsets base pointers on the host.",
        "  auto fits = [&](const Tensor& t) {",
        "    if (t.stride(3) != 1 || reinterpret_cast<uintptr_t>(t.const_data_ptr()) % 16 != 0) return false;",
        "    for (int d = 0; d < 3; ++d) if (t.stride(d) % 8 != 0 || t.stride(d) <= 0 || (d > 0 && t.stride(d) >= (int64_t(1) << 31))) return false;",
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
        f"  for (int64_t s : {{{sz['query']}, {sz['key']}, {sz['head']}, {sz['kv_head']}}})",
        # with int arguments in the mask's bounds (each below 2**30), lengths below 2**30 keep the bounds in int32
        (f"    check(s < (int64_t(1) << {30 if r.int_params or r.len_tensors else 31}), kOp, \"sizes must be below 2^"
         f"{30 if r.int_params or r.len_tensors else 31} on CUDA\");"),
    ]
    for n in r.int_params:
        L.append(f"  check(A.p_{n} >= -(int64_t(1) << 30) && A.p_{n} < (int64_t(1) << 30), kOp, "
                 f"\"{n} must fit in int32 on CUDA, got \", A.p_{n});")
    L += [
        (f"  check({sz['head']} <= 65535, kOp, \"on CUDA the query heads must be at most 65535 (a grid dimension), "
         f"got \", {sz['head']});"),
        "  // launches over chunks of batches: int32 offsets and the grid's batch dimension fit in each, and the host",
        "  // offsets the base pointers by b_launch0 * batch stride in 64-bit arithmetic (redfuser::batch_chunk, batch_ptr)",
        (f"  const int64_t bchunk = redfuser::batch_chunk(kOp, {sz['batch']}, {{{{\"{q}\", qq.stride(0), "
         f"redfuser::batch_extent(qq)}}, {{\"{k}\", kk.stride(0), redfuser::batch_extent(kk)}}, "
         f"{{\"{v}\", vv.stride(0), redfuser::batch_extent(vv)}}, "
         f"{{\"{r.out}\", c.{r.out}.stride(0), redfuser::batch_extent(c.{r.out})}}, "
         f"{{\"{r.lse}\", c.{r.lse}.stride(0), redfuser::batch_extent(c.{r.lse})}}}});"),
        "  // one batch per launch never steps the batch stride: a small valid one is passed (TMA: > 0, 16-byte multiple)",
        "  auto sbatch = [](const Tensor& t, int64_t n_launch_b) { return n_launch_b == 1 ? int64_t(8) : t.stride(0); };",
        "  const int32_t sms = redfuser::device_sm_count(kOp, ctx.device());",
        "  bool launched = false;",
    ]
    for i, t in enumerate(r.len_tensors):
        # per-sequence values of the mask (lens[batch]): read by the kernels as one int32 per batch
        L += [f"  Tensor blen{i} = torch::stable::new_empty({t}, {{{sz['batch']}}}, ScalarType::Int);",
              f"  torch::stable::copy_(blen{i}, {t});  // int64 -> int32 (values beyond int32 are not meaningful)"]
    params = {f"fparam{i}": f"static_cast<float>(A.p_{n})" for i, n in enumerate(r.float_params)}
    params.update({f"iparam{i}": f"A.p_{n}" for i, n in enumerate(r.int_params)})
    for fam, dtype, D, conds, cfg, fwd, split, comb, unit, nst in plan.entries:  # type: ignore[attr-defined]
        cond = " && ".join([f'fam == "{fam}"', f"dt == {SCALAR_TYPES[dtype]}", f"D == {D}", *conds])
        strides = {f"{t}_{s}": (f"sbatch({x}, n_launch_b) / {unit}" if d == 0 else f"{x}.stride({d}) / {unit}")
                   for t, x in (("q", "qq"), ("k", "kk"), ("v", "vv"))
                   for s, d in (("sb", 0), ("ss", 1), ("sh", 2))}
        dims_ = {"batch": "n_launch_b", "seqlen_q": sz["query"], "heads": sz["head"], "seqlen_k": sz["key"],
                 "heads_kv": sz["kv_head"], "num_splits": "ns"}
        ptrs = {"Q": "redfuser::batch_ptr(qq, b_launch0)", "K": "redfuser::batch_ptr(kk, b_launch0)",
                "V": "redfuser::batch_ptr(vv, b_launch0)", "O": f"redfuser::batch_ptr(c.{r.out}, b_launch0)",
                "LSE": f"redfuser::batch_ptr(c.{r.lse}, b_launch0)",
                "Opart": "opart.mutable_data_ptr()", "Spart": "spart.mutable_data_ptr()",
                **{f"Blen{i}{sfx}": f"redfuser::batch_ptr(blen{i}, b_launch0)"
                   for i in range(len(r.len_tensors)) for sfx in ("", "_ptr")}}
        args = {**strides, **dims_, **ptrs, **params}
        L += [
            f"  if ({cond}) for (int64_t b_launch0 = 0; b_launch0 < {sz['batch']}; b_launch0 += bchunk) {{",
            f"    const int64_t n_launch_b = std::min(bchunk, {sz['batch']} - b_launch0);",
            (f"    int ns = choose_num_splits(n_launch_b, {sz['head']}, {sz['query']}, {sz['key']}, "
             f"{cfg.block_m}, {cfg.block_n}, sms);"),
            "    // the split workspace (ns, n_launch_b, Sq, H, D) is indexed with int32 too",
            (f"    ns = static_cast<int>(std::min<int64_t>(ns, std::numeric_limits<int32_t>::max() / "
             f"std::max<int64_t>(1, n_launch_b * {sz['query']} * {sz['head']} * {sz['dim']})));"),
            "    if (ns <= 1) {",
            f"      redfuser::launch(kV_{fwd}, ctx, [&](void* s) {{ return {launch_call(fwd, lowered[fwd]['params'], args)}; }});",
            "    } else {",
            (f"      Tensor opart = torch::stable::new_empty(qq, {{ns, n_launch_b, {sz['query']}, {sz['head']}, "
             f"{sz['dim']}}}, ScalarType::Float);"),
            (f"      Tensor spart = torch::stable::new_empty(qq, {{{nst}, ns, n_launch_b, {sz['head']}, "
             f"{sz['query']}}}, ScalarType::Float);"),
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
