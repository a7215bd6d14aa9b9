"""Bridge: the engine's forms of a quantise-then-contract cascade -> the quant_gemm template's QuantMath, plus the
plan (variants to lower) and the body of the op's impl_cuda. The same (plan, body) interface as the entries of
cuda.TEMPLATES.

Bound by role, never by an op's names. The cascade must be: rows (one index), a streamed axis, and
- per-row scalar states over the streamed axis whose terms read one element of a 2-D tensor X[row, k];
- exactly one sum carried over a free index c, whose term is ``cast_q(arg) * W[c, k]`` (a rounding cast to a
  quantised dtype of an expression of that X element and the states, times a read of a second 2-D tensor,
  possibly widened): the GEMM;
- one output indexed (row, c), over the final states, the sum, float params, axis sizes and 1-D tensors read at
  c or at a constant.
Everything the kernel computes comes from the engine: the states' terms and corrections, their guards, the
quantisation argument, the accumulator's correction (online form), the merge form (split-K) and the output of
every specialisation (optional tensors become ``has_<name>`` flags tested at run time).
"""

from __future__ import annotations

from dataclasses import dataclass

import sympy as sp

from ...spec import OpSpec
from ...symbolic.expr import Cast
from ...symbolic.forms import Analysis, OpAnalysis
from ..bridge import BridgeError, Job, Plan, launch_call, merge_terms
from ..bridge import RolePrinter as _RolePrinter
from ..glue import SCALAR_TYPES
from ..tl_print import TLPrinter
from . import quant_gemm as qg


class QuantBridgeError(BridgeError):
    """The cascade does not have the shape the quant_gemm template schedules."""


@dataclass(frozen=True)
class Roles:
    x: str  # the streamed operand (rows, depth)
    w: str  # the quantised GEMM operand (cols, depth)
    rows: str  # axis names of the spec for each role
    cols: str
    depth: str
    out: str  # the output
    vectors: tuple[tuple[str, str], ...]  # (tensor, axis of its length)


def _one(items: list, what: str, where: str):
    if len(items) != 1:
        raise QuantBridgeError(f"{where}: quant_gemm needs exactly one {what}, found {len(items)}")
    return items[0]


def _case_math(a: Analysis):
    """Per specialisation: (states, guards, quant, quant dtype, acc correction, merge, output expr, roles)."""
    ir = a.ir
    where = f"{ir.op} [{ir.label}]"
    if len(a.passes) != 1 or any(f.stage != "stream" for f in a.reductions):
        raise QuantBridgeError(f"{where}: quant_gemm streams one pass over the contraction axis")
    if len(ir.rows) != 1:
        raise QuantBridgeError(f"{where}: quant_gemm needs one row index, found {len(ir.rows)}")
    if ir.mask not in (sp.true, True):
        raise QuantBridgeError(f"{where}: quant_gemm has no mask over the streamed axis")
    over = ir.indices[ir.over]
    row = ir.indices[ir.rows[0]]
    acc = _one([f for f in a.reductions if f.free], "sum carried over a free index (the GEMM)", where)
    states = [f for f in a.reductions if not f.free]
    if acc.op != "sum" or acc.kind not in ("*", "none") or any(f.selection or f.payloads for f in a.reductions):
        raise QuantBridgeError(f"{where}: the carried reduction must be a sum corrected by a factor")
    if any(f.where not in (sp.true, True) for f in a.reductions):
        raise QuantBridgeError(f"{where}: quant_gemm reductions are unconditional")
    col = ir.indices[_one(list(acc.free), "free index of the sum", where)]
    lets = {x.symbol: x.expr for x in ir.element_lets}
    term = acc.term.xreplace(lets)
    # the GEMM term: cast_q(arg) * W[col, k] (W possibly widened)
    factors = sp.Mul.make_args(term)
    qcast = [f for f in factors if isinstance(f, Cast) and not f.has(col)]
    wread = [f for f in factors if f.has(col)]
    q = _one(qcast, "quantising cast of a row element in the sum's term", where)
    wf = _one(wread, f"factor of the sum's term that depends on {col}", where)
    if len(factors) != 2:
        raise QuantBridgeError(f"{where}: the sum's term must be quantised(x) * w, got {acc.term}")
    if q.dtype not in qg.QUANT_DTYPES:
        raise QuantBridgeError(f"{where}: quant_gemm quantises to {sorted(qg.QUANT_DTYPES)}, not {q.dtype}")
    w_ix = wf.args[0] if isinstance(wf, Cast) and wf.dtype == "float32" else wf
    if not (isinstance(w_ix, sp.Indexed) and tuple(w_ix.indices) == (col, over)):
        raise QuantBridgeError(f"{where}: the GEMM operand must be a read W[{col}, {over}], got {wf}")
    x_reads = q.atoms(sp.Indexed)
    x_ix = _one(sorted(x_reads, key=str), "tensor read inside the quantised value", where)
    if tuple(x_ix.indices) != (row, over):
        raise QuantBridgeError(f"{where}: the quantised value must read X[{row}, {over}], got {x_ix}")
    x_name, w_name = str(x_ix.base.label), str(w_ix.base.label)
    xsym = sp.Symbol("x__elem", real=True)
    st = {f.name: a.symbols[f.name] for f in states}
    guards = {g.state: g for g in a.guards}
    names: dict[sp.Basic, str] = {s: n for n, s in ir.scalars.items()}
    names[x_ix] = "x"
    names[xsym] = "x"
    for n, roles in st.items():
        names[roles["old"]] = f"{n}_old"
        names[roles["new"]] = f"{n}_new"
        names[roles["new_safe"]] = f"{n}_safe" if n in guards else f"{n}_new"
    tl = TLPrinter(names, where)
    out_states = []
    for f in states:
        t = f.term.xreplace(lets)
        if t.atoms(sp.Indexed) - {x_ix}:
            raise QuantBridgeError(f"{where}: state {f.name} must read only {x_ix}, its term is {f.term}")
        if f.op not in ("max", "min", "sum"):
            raise QuantBridgeError(f"{where}: state {f.name}: op {f.op} is not a row reduction")
        init = TLPrinter({}, where)(f.neutral) if f.op != "sum" else "T.float32(0)"
        corr = None if f.kind == "none" else tl(f.correction)
        out_states.append(qg.State(f.name, f.op, init, tl(t), corr, "mul" if f.kind != "+" else "add"))
    out_guards = []
    for n, g in guards.items():
        out_guards.append(qg.Guard(f"{n}_safe", TLPrinter({st[n]["new"]: f"{n}_new"}, where)(g.apply(st[n]["new"]))))
    # zero-filled elements past the end of the streamed axis (the last tile) must not change any result
    zero = {x_ix: 0}
    for f in states:
        t0 = sp.simplify(f.term.xreplace(lets).xreplace(zero))
        ok = t0 == f.neutral or (f.op == "max" and t0 == 0 and f.term.xreplace(lets).is_nonnegative)
        if not ok:
            raise QuantBridgeError(f"{where}: state {f.name}: a zero element past the end contributes {t0}")
    quant = tl(q.args[0])
    acc_corr = tl(acc.correction) if acc.kind == "*" else "T.float32(1)"
    # merge form (split-K): segments' states combined in order, the sum corrected from each segment's states
    m_names, merge_states = merge_terms(states, st, guards, {s: n for n, s in ir.scalars.items()},
                                        lambda names: TLPrinter(names, where))
    merge_guards = tuple(qg.Guard(f"{n}_safe", TLPrinter({st[n]["new"]: n}, where)(g.apply(st[n]["new"])))
                         for n, g in guards.items())
    acc_seg = sp.Symbol("acc__seg")
    merge_acc = (TLPrinter({**m_names, acc_seg: "acc_seg"}, where)(acc_seg * acc.correction)
                 if acc.kind == "*" else "acc_seg")
    # the output
    o = _one([o for o in a.outputs if tuple(o.index) == (ir.rows[0], acc.free[0])], "output indexed (row, col)",
             where)
    if len(a.outputs) != 1:
        raise QuantBridgeError(f"{where}: quant_gemm writes one output, the spec has {len(a.outputs)}")
    axis_role = {ir.extents[ir.rows[0]]: "rows", ir.extents[acc.free[0]]: "cols", ir.extents[ir.over]: "depth"}
    o_names: dict[sp.Basic, str] = {s: n for n, s in ir.scalars.items()}
    o_names.update({ir.states[n]: n for n in st})
    o_names.update({a.symbols[n]["safe"]: f"{n}_safe" for n in guards})
    o_names[ir.states[acc.name]] = "acc"
    o_names.update({ext: role for ext, role in axis_role.items()})
    vectors: list[tuple[str, sp.Basic]] = []
    for ix in sorted(o.value.atoms(sp.Indexed), key=str):
        if len(ix.indices) != 1:
            raise QuantBridgeError(f"{where}: the output may read vectors only, not {ix}")
        v = str(ix.base.label)
        if ix.indices[0] == col:
            o_names[ix] = f"{v}[col]"
        elif ix.indices[0].is_Integer:
            o_names[ix] = f"{v}[{int(ix.indices[0])}]"
        else:
            raise QuantBridgeError(f"{where}: vector read {ix} is neither at the output column nor at a constant")
        vectors.append((v, ix.base))
    roles = {"x": x_name, "w": w_name, "rows": str(ir.extents[ir.rows[0]]), "cols": str(ir.extents[acc.free[0]]),
                 "depth": str(ir.extents[ir.over]), "out": o.name}
    return {"states": tuple(out_states), "guards": tuple(out_guards), "quant": quant, "quant_dtype": q.dtype,
                "acc_correction": acc_corr, "merge_states": tuple(merge_states), "merge_guards": merge_guards,
                "merge_acc": merge_acc, "out": o.value, "out_names": o_names, "vectors": [v for v, _ in vectors],
                "roles": roles, "axis_role": axis_role, "where": where}


def quant_math(spec: OpSpec, op: OpAnalysis) -> tuple[qg.QuantMath, Roles]:
    """The engine's forms of every specialisation as one QuantMath (optional tensors: run-time flags)."""
    cases = [_case_math(a) for a in op.cases]
    first = cases[0]
    for key in ("states", "guards", "quant", "quant_dtype", "acc_correction", "merge_states", "merge_guards",
                "merge_acc", "roles"):
        if any(c[key] != first[key] for c in cases[1:]):
            raise QuantBridgeError(f"{spec.name}: the specialisations differ in {key}; quant_gemm runs one "
                                   "schedule and branches only in the output")
    ir = op.cases[0].ir
    roles = first["roles"]
    # vectors in spec order, with the role (or own dim) of their length
    read = {v for c in cases for v in c["vectors"]}
    vectors, lengths = [], {}
    for t in spec.tensors:
        if t.name not in read:
            continue
        if len(t.shape) != 1:
            raise QuantBridgeError(f"{spec.name}: the output reads {t.name}, which is not a vector")
        length = first["axis_role"].get(ir.axes.get(t.shape[0]), None)
        if length is None:
            length = lengths.setdefault(t.shape[0], f"len_{t.name}")
        if length in ("rows", "depth"):
            raise QuantBridgeError(f"{spec.name}: vector {t.name} has length {t.shape[0]}: read at the column")
        vectors.append(qg.Vector(f"v_{t.name}", length))
    flags = [f"has_{t.name}" for t in spec.tensors if t.optional]
    for t in spec.tensors:
        if t.optional and t.name in (roles["x"], roles["w"]):
            raise QuantBridgeError(f"{spec.name}: GEMM operand {t.name} cannot be optional")

    def out_text(c) -> str:
        names = dict(c["out_names"])
        for ix in c["out"].atoms(sp.Indexed):
            names[ix] = "v_" + names[ix]
        for ax, length in lengths.items():
            names[ir.axes[ax]] = length
        return _RolePrinter(names, c["where"])(c["out"])

    by_spec = {tuple(v for _, v in a.ir.specialization): out_text(c) for a, c in zip(op.cases, cases)}
    flag_names = [n for n, _ in op.cases[0].ir.specialization]
    for n in flag_names:
        if not getattr(spec.arg(n), "optional", False) or hasattr(spec.arg(n), "type"):
            raise QuantBridgeError(f"{spec.name}: specialising argument {n} is not an optional tensor")

    def tree(items: dict, depth: int) -> str:
        if depth == len(flag_names):
            return _one(list(items.values()), "output per specialisation", spec.name)
        yes = {k: v for k, v in items.items() if k[depth] == "present"}
        no = {k: v for k, v in items.items() if k[depth] != "present"}
        if not yes or not no:
            return tree(yes or no, depth + 1)
        a_, b_ = tree(yes, depth + 1), tree(no, depth + 1)
        return a_ if a_ == b_ else f"T.if_then_else(has_{flag_names[depth]} != 0, {a_}, {b_})"

    out = tree(by_spec, 0)
    params = tuple(n for n in ir.scalars)
    math = qg.QuantMath(states=first["states"], guards=first["guards"], quant=first["quant"],
                        quant_dtype=first["quant_dtype"], acc_correction=first["acc_correction"], out=out,
                        merge_states=first["merge_states"], merge_guards=first["merge_guards"],
                        merge_acc=first["merge_acc"], vectors=tuple(vectors), flags=tuple(flags), params=params)
    qg.check_math(math)
    r = Roles(roles["x"], roles["w"], roles["rows"], roles["cols"], roles["depth"], roles["out"],
              tuple((v.name[2:], v.length) for v in vectors))
    return math, r


# --------------------------------------------------------------------------------------------- plan and body
def quant_plan(spec: OpSpec, op: OpAnalysis, families: list[str]):
    """Variants per family: a single-segment kernel per X dtype writing X's dtype (the default output), a split-K
    kernel per X dtype, and a merge kernel per output dtype. Other output dtypes take the split path (with one
    segment when the split plan says 1): every combination runs, and the build compiles 2 + 2 + 3 files, not
    the 6 single-segment kernels of every (X, output) pair."""
    math, roles = quant_math(spec, op)
    cv = spec.variants.cuda
    static = dict(cv.static)
    form = str(static.get("form", ("online",))[0])
    plan = Plan(families=tuple(families))
    hdr = (("spec", spec.file), ("template", qg.TEMPLATE_VERSION))
    entries = []
    for fam in families:
        for odt in qg.OUT_DTYPES:
            cfg = qg.default_config(fam, cv.dtypes[0], odt, form=form)
            merge = cfg.merge_variant_name(spec.name)
            plan.jobs.append(Job(merge, fam, qg.emit_merge_program(math, cfg, merge), hdr))
        for xdt in cv.dtypes:
            split = qg.default_config(fam, xdt, split=True, form=form)
            split_sym = split.variant_name(spec.name)
            plan.jobs.append(Job(split_sym, fam, qg.emit_program(math, split, split_sym), hdr))
            cfg = qg.default_config(fam, xdt, xdt, form=form)
            sym = cfg.variant_name(spec.name)
            plan.jobs.append(Job(sym, fam, qg.emit_program(math, cfg, sym), hdr))
            for odt in qg.OUT_DTYPES:
                merge = qg.default_config(fam, xdt, odt).merge_variant_name(spec.name)
                entries.append((fam, xdt, odt, cfg, sym if odt == xdt else None, split_sym, merge))
    plan.entries = entries  # type: ignore[attr-defined]
    plan.math = math  # type: ignore[attr-defined]
    plan.roles = roles  # type: ignore[attr-defined]
    plan.support = ["", qg.NUM_SPLITS_CPP]  # type: ignore[attr-defined]
    return plan


def quant_body(spec: OpSpec, plan, lowered: dict[str, dict]) -> list[str]:
    """impl_cuda: dense aligned operands, float32 vectors, the split-K plan from host sizes, one launch per call."""
    math: qg.QuantMath = plan.math
    r: Roles = plan.roles
    fams = ", ".join(f'"{f}"' for f in plan.families)
    opt = {t.name for t in spec.tensors if t.optional}
    L = [
        "Args& A = c.A;",
        f"redfuser::CudaContext ctx(kOp, {r.x}, {{{fams}}});",
        "const std::string fam = ctx.family();",
        "do {",
        f"  if (A.sz_{r.rows} == 0 || A.sz_{r.cols} == 0) break;  // nothing to compute",
        f"  check(A.sz_{r.depth} > 0, kOp, \"on CUDA {r.depth} must be at least 16 (it is 0)\");",
        f"  const ScalarType dt = {r.x}.scalar_type();",
        f"  const ScalarType odt = c.{r.out}.scalar_type();",
        "  // the kernels read dense rows from 16-byte aligned storage: anything else is copied first",
        "  auto dense = [&](const Tensor& t) {",
        "    Tensor d = torch::stable::contiguous(t);",
        "    if (reinterpret_cast<uintptr_t>(d.const_data_ptr()) % 16 == 0) return d;",
        "    Tensor out = torch::stable::new_empty(d, d.sizes());",
        "    torch::stable::copy_(out, d);",
        "    return out;",
        "  };",
        "  auto as_float = [&](const Tensor& t) {  // epilogue vectors are read as dense, aligned float32",
        "    if (t.scalar_type() == ScalarType::Float) return dense(t);",
        "    Tensor out = torch::stable::new_empty(t, t.sizes(), ScalarType::Float);",
        "    torch::stable::copy_(out, t);",
        "    return out;",
        "  };",
        f"  const Tensor xx = dense({r.x});",
        f"  const Tensor ww = dense({r.w});",
    ]
    args = {"X": "const_cast<void*>(xx.const_data_ptr())", "W": "const_cast<void*>(ww.const_data_ptr())",
            "Out": f"c.{r.out}.mutable_data_ptr()", "Spart": "spart.mutable_data_ptr()",
            "Cpart": "cpart.mutable_data_ptr()", "rows": f"A.sz_{r.rows}", "cols": f"A.sz_{r.cols}",
            "depth": f"A.sz_{r.depth}", "num_splits": "ns"}
    first_required = next(name for name, _ in r.vectors if name not in opt) if any(
        n not in opt for n, _ in r.vectors) else None
    for name, length in r.vectors:
        if name in opt:
            dummy = f"vec_{first_required}" if first_required else "xx"
            L.append(f"  const Tensor vec_{name} = A.has_{name} ? as_float(*{name}) : {dummy};  // unread if absent")
        else:
            L.append(f"  const Tensor vec_{name} = as_float({name});")
        args[f"v_{name}"] = f"const_cast<void*>(vec_{name}.const_data_ptr())"
        if length != "cols":
            args[length] = f"vec_{name}.size(0)" if name not in opt else f"(A.has_{name} ? vec_{name}.size(0) : 1)"
    for f in math.flags:
        args[f] = f"(A.{f} ? 1 : 0)"
    for p in math.params:
        args[p] = f"static_cast<float>(A.p_{p})"
    L += [
        f"  const int64_t rows = A.sz_{r.rows}, cols = A.sz_{r.cols}, depth = A.sz_{r.depth};",
        "  check(rows * depth < (int64_t(1) << 31) && cols * depth < (int64_t(1) << 31) &&",
        "        rows * cols < (int64_t(1) << 31), kOp, \"on CUDA every operand must have fewer than 2^31 elements\");",
        "  const int32_t sms = redfuser::device_sm_count(kOp, ctx.device());",
        "  bool launched = false;",
    ]
    nst = len(math.states)
    for fam, xdt, odt, cfg, sym, split_sym, merge in plan.entries:
        L += [
            f"  if (!launched && fam == \"{fam}\" && dt == {SCALAR_TYPES[xdt]} && odt == {SCALAR_TYPES[odt]}) {{",
            (f"    const int ns = quant_gemm_num_splits(rows, cols, depth, {cfg.block_m}, {cfg.block_n}, "
             f"{cfg.block_k}, sms);"),
        ]
        if sym is not None:
            L += [
                "    if (ns <= 1) {",
                f"      redfuser::launch(kV_{sym}, ctx, [&](void* s) {{ return {launch_call(sym, lowered[sym]['params'], args)}; }});",
                "    } else {",
            ]
        else:
            L += ["    {  // this output dtype has no single-segment kernel: split path, one segment or more"]
        L += [
            f"      Tensor spart = torch::stable::new_empty(xx, {{{nst}, ns, rows}}, ScalarType::Float);",
            "      Tensor cpart = torch::stable::new_empty(xx, {ns, rows, cols}, ScalarType::Float);",
            (f"      redfuser::launch(kV_{split_sym}, ctx, [&](void* s) {{ return "
             f"{launch_call(split_sym, lowered[split_sym]['params'], args)}; }});"),
            (f"      redfuser::launch(kV_{merge}, ctx, [&](void* s) {{ return "
             f"{launch_call(merge, lowered[merge]['params'], args)}; }});"),
            "    }",
            "    launched = true;",
            "  }",
        ]
    L += [
        "  check(launched, kOp, \"no CUDA kernel for x \", dtype_name(dt), \" and output \", dtype_name(odt), \" on \", fam);",
        "} while (false);",
    ]
    return L
