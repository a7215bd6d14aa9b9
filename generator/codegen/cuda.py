"""Derived forms -> CUDA variants through the kernel templates, and the C++ that launches them.

A *bridge* per template reads the engine's analysis of an op, checks that the cascade has the shape the
template schedules (and says precisely why not otherwise), and renders the engine's formulas into the
template's math interface; nothing op-specific is typed here. Per variant the template emits a TileLang
program, which is lowered (in parallel processes, cached by the program's digest) to a .cu with a renamed
launcher. The bridge also writes the body of the op's `impl_cuda`: variant selection, argument checks the
kernel relies on, workspaces, and the launch calls, generated from each launcher's parameter list by name.
"""

from __future__ import annotations

import ast
import hashlib
import importlib.util
import os
import sys
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import sympy as sp

from .. import __version__
from ..spec import OpSpec
from ..symbolic.expr import Cast, entrysum, idiv, isin
from ..symbolic.forms import Analysis, OpAnalysis, ReductionForm
from .files import write_if_changed
from .glue import SCALAR_TYPES, CudaGlue
from .tl_print import TLPrinter


class BridgeError(ValueError):
    """The cascade does not have the shape a template schedules."""


@dataclass(frozen=True)
class Job:
    """One CUDA variant to lower: the TileLang program text and where its .cu goes."""

    symbol: str
    family: str
    program: str  # python source with make_prim_func()
    header: tuple[tuple[str, str], ...] = ()


@dataclass
class Plan:
    jobs: list[Job] = field(default_factory=list)
    body: list[str] = field(default_factory=list)  # impl_cuda body (uses the lowered launchers by name)
    families: tuple[str, ...] = ()


# --------------------------------------------------------------------------------------------- lowering
def _program_digest(job: Job) -> str:
    return hashlib.sha256((job.program + job.family + job.symbol + __version__).encode()).hexdigest()[:16]


def _lower_one(args: tuple[str, str, str, str, str]) -> tuple[str, str, list[tuple], int | None]:
    """Worker: import the program, lower it; returns (symbol, .cu source, params, smem)."""
    symbol, family, program_path, digest, header = args
    from .cuda_lower import lower_to_cuda

    spec = importlib.util.spec_from_file_location(f"redfuser_prog_{symbol}", program_path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    pass_configs = getattr(mod, "PASS_CONFIGS", None) or None
    hdr = dict(ast.literal_eval(header))
    hdr["program-digest"] = digest
    low = lower_to_cuda(mod.make_prim_func(), family, symbol, generator_version=__version__,
                        pass_configs=pass_configs, header=hdr)
    params = [(p.name, p.kind, p.dtype, p.host_c_type) for p in low.params]
    return symbol, low.source, params, low.dynamic_smem_bytes


def _cached(cu: Path, digest: str) -> bool:
    if not cu.exists():
        return False
    head = cu.read_text()[:4000]
    return f"program-digest: {digest}" in head and (cu.with_suffix(".params")).exists()


def lower_all(jobs: list[Job], out_dir: Path, workers: int, log: Callable[[str], None]) -> dict[str, dict]:
    """Lower every job (cached by program digest); returns symbol -> {path, params, family}."""
    out: dict[str, dict] = {}
    todo = []
    for job in jobs:
        fam_dir = out_dir / job.family
        prog = fam_dir / f"{job.symbol}.py"
        cu = fam_dir / f"{job.symbol}.cu"
        write_if_changed(prog, job.program)
        digest = _program_digest(job)
        out[job.symbol] = {"path": cu, "family": job.family}
        if _cached(cu, digest):
            out[job.symbol]["params"] = ast.literal_eval(cu.with_suffix(".params").read_text())
            continue
        todo.append((job.symbol, job.family, str(prog), digest, repr(job.header)))
    log(f"  {len(jobs) - len(todo)} variant(s) unchanged, {len(todo)} to lower with TileLang")
    if todo:
        n = max(1, min(workers or (os.cpu_count() or 1), len(todo)))
        import multiprocessing

        ctx = multiprocessing.get_context("spawn")
        done = 0
        with ProcessPoolExecutor(max_workers=n, mp_context=ctx) as pool:
            for symbol, source, params, _smem in pool.map(_lower_one, todo):
                done += 1
                cu = out[symbol]["path"]
                write_if_changed(cu, source)
                write_if_changed(cu.with_suffix(".params"), repr(params))
                out[symbol]["params"] = params
                log(f"  lowered {done}/{len(todo)}: {symbol}")
    return out


# --------------------------------------------------------------------------------------------- helpers
def _py_to_cpp(text: str, names: dict[str, str]) -> str:
    """A small Python condition (template preconditions) as C++: names mapped, // -> division."""

    def conv(n: ast.AST) -> str:
        if isinstance(n, ast.BoolOp):
            op = " && " if isinstance(n.op, ast.And) else " || "
            return "(" + op.join(conv(v) for v in n.values) + ")"
        if isinstance(n, ast.UnaryOp) and isinstance(n.op, ast.Not):
            return f"(!{conv(n.operand)})"
        if isinstance(n, ast.UnaryOp) and isinstance(n.op, ast.USub):
            return f"(-{conv(n.operand)})"
        if isinstance(n, ast.Compare):
            parts = []
            left = conv(n.left)
            for op, right in zip(n.ops, n.comparators):
                r = conv(right)
                sym = {ast.Lt: "<", ast.LtE: "<=", ast.Gt: ">", ast.GtE: ">=", ast.Eq: "==", ast.NotEq: "!="}[type(op)]
                parts.append(f"({left} {sym} {r})")
                left = r
            return "(" + " && ".join(parts) + ")"
        if isinstance(n, ast.BinOp):
            sym = {ast.Add: "+", ast.Sub: "-", ast.Mult: "*", ast.FloorDiv: "/", ast.Mod: "%"}[type(n.op)]
            return f"({conv(n.left)} {sym} {conv(n.right)})"
        if isinstance(n, ast.Name):
            if n.id not in names:
                raise BridgeError(f"precondition {text!r}: unknown name {n.id}")
            return names[n.id]
        if isinstance(n, ast.Constant):
            return repr(n.value).lower() if isinstance(n.value, bool) else repr(n.value)
        raise BridgeError(f"precondition {text!r}: unsupported syntax {ast.unparse(n)}")

    return conv(ast.parse(text, mode="eval").body)


def _call(symbol: str, params: list[tuple], args: dict[str, str]) -> str:
    """`<symbol>_call(...)` with each parameter bound by name."""
    out = []
    for name, kind, _dtype, ctype in params:
        if kind == "stream":
            out.append("s")
            continue
        if name not in args:
            raise BridgeError(f"{symbol}: no value for launcher parameter '{name}'")
        out.append(f"({ctype})({args[name]})" if kind != "pointer" else args[name])
    return f"{symbol}_call({', '.join(out)})"


def declarations(lowered: dict[str, dict]) -> list[str]:
    lines = []
    for symbol, info in sorted(lowered.items()):
        args = ", ".join(f"{c} {n}" for n, _k, _d, c in info["params"])
        lines += [
            f'extern "C" int {symbol}_init(void);',
            f'extern "C" int {symbol}_call({args});',
            f'extern "C" const char* {symbol}_get_last_error(void);',
        ]
    return lines


def _variant_object(symbol: str, op: str, family: str) -> str:
    return (f"static redfuser::CudaVariant kV_{symbol}{{\"{op}\", \"{symbol}\", \"{family}\", "
            f"&{symbol}_init, &{symbol}_get_last_error}};")


# --------------------------------------------------------------------------------------------- attention
def _only(items: list, what: str) -> object:
    if len(items) != 1:
        raise BridgeError(f"the stream_attention template needs exactly one {what}, found {len(items)}")
    return items[0]


def attention_math(a: Analysis):
    """The engine's forms of an attention-shaped cascade as the template's AttentionMath."""
    from .templates import stream_attention as sa

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
    from .templates import stream_attention as sa

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
            f"      redfuser::launch(kV_{fwd}, ctx, [&](void* s) {{ return {_call(fwd, lowered[fwd]['params'], args)}; }});",
            "    } else {",
            "      Tensor opart = torch::stable::new_empty(qq, {ns, A.sz_B, A.sz_Sq, A.sz_H, A.sz_D}, ScalarType::Float);",
            f"      Tensor spart = torch::stable::new_empty(qq, {{{nst}, ns, A.sz_B, A.sz_H, A.sz_Sq}}, ScalarType::Float);",
            f"      redfuser::launch(kV_{split}, ctx, [&](void* s) {{ return {_call(split, lowered[split]['params'], args)}; }});",
            f"      redfuser::launch(kV_{comb}, ctx, [&](void* s) {{ return {_call(comb, lowered[comb]['params'], args)}; }});",
            "    }",
            "    launched = true;",
            "  }",
        ]
    L += [
        "  check(launched, kOp, \"no CUDA kernel for \", dtype_name(dt), \", head dim \", D, \" on \", fam);",
        "} while (false);",
    ]
    return L


# --------------------------------------------------------------------------------------------- resident row
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
        from .templates import resident_row as rr

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
        from .templates import resident_row as rr

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
        from .templates import resident_row as rr

        over = self.ir.indices[self.ir.over]
        for ix in sorted(expr.atoms(sp.Indexed), key=str):
            name = str(ix.base.label)
            if name not in self.ir.tensors or ix in self.names:
                continue
            if ix.indices[-1] != over or len(ix.indices) != 1:
                raise self.fail(f"read {ix} is neither a row element nor a per-element vector")
            if name not in self.loaded:
                self.steps.append(rr.Load(f"ld_{name}", name, fill="0.0"))
                self.loaded[name] = f"ld_{name}"
            self.names[ix] = self.loaded[name]

    def reduction(self, f: ReductionForm) -> None:
        from .templates import resident_row as rr

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
        from .templates import resident_row as rr

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
    from .templates import resident_row as rr

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
    from .templates import resident_row as rr

    flags = [n for n, _ in op.cases[0].ir.specialization]
    per_case = {tuple(v for _, v in a.ir.specialization): _RowBridge(spec, a).build() for a in op.cases}

    def cond(name: str, value) -> str:
        arg = spec.arg(name)
        if getattr(arg, "optional", False) and not hasattr(arg, "type"):
            return f"has_{name} != 0" if value == "present" else f"has_{name} == 0"
        if arg.type == "bool":
            return f"{name} != 0" if value else f"{name} == 0"
        return f"{name} == {arg.choices.index(value)}"

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
    from .templates import resident_row as rr

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
        "  bool launched = false;",
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
    for o in spec.outputs:
        t_args[o.name] = f"c.{o.name}.mutable_data_ptr()"
    args = {**t_args, **{k: v for k, v in names.items()}, ir_k: f"A.p_{ir_k}"}
    args["num_tokens"] = names[ir_rows]
    caps_by = {}
    for fam, dtype, cap, sym, pre in plan.entries:  # type: ignore[attr-defined]
        caps_by.setdefault((fam, dtype), []).append((cap, sym, pre))
    for (fam, dtype), items in caps_by.items():
        L.append(f"  if (!launched && fam == \"{fam}\" && dt == {SCALAR_TYPES[dtype]}) {{")
        for cap, sym, pre in sorted(items):
            L.append(f"    if (!launched && {names[ir_len]} <= {cap}) {{")
            for cond, msg in pre:
                L.append(f"      check({_py_to_cpp(cond, {**names, ir_k: f'A.p_{ir_k}'})}, kOp, \"{msg}\");")
            L.append(f"      redfuser::launch(kV_{sym}, ctx, [&](void* s) {{ return {_call(sym, lowered[sym]['params'], args)}; }});")
            L.append("      launched = true;")
            L.append("    }")
        L.append("  }")
    L += [
        (f"  check(launched, kOp, \"no CUDA kernel for \", dtype_name(dt), \" with {ir_len} = \", {names[ir_len]}, "
         f"\" (the largest built is {max(c for _, _, c, _, _ in plan.entries)})\");"),  # type: ignore[attr-defined]
        "} while (false);",
    ]
    return L


# --------------------------------------------------------------------------------------------- entry point
TEMPLATES = {"stream_attention": (attention_plan, attention_body), "resident_row": (row_plan, row_body)}


def cuda_plan(spec: OpSpec, op: OpAnalysis, families: list[str], log: Callable[[str], None]):
    """The op's CUDA variants (a Plan and its body maker), or None when it gets no CUDA kernel."""
    cv = spec.variants.cuda
    fams = [f for f in families if f in cv.families]
    if cv.template not in TEMPLATES:
        log(f"{spec.name}: no kernel template '{cv.template}' in this generator yet: CPU only")
        return None
    if not fams:
        log(f"{spec.name}: none of the requested families {families} is supported ({cv.families}): CPU only")
        return None
    if not cv.dtypes:
        log(f"{spec.name}: no CUDA dtype selected: CPU only")
        return None
    make_plan, make_body = TEMPLATES[cv.template]
    plan = make_plan(spec, op, fams)
    log(f"{spec.name}: {len(plan.jobs)} CUDA variant(s) from template {cv.template}")
    return plan, make_body


def cuda_glue(spec: OpSpec, planned, lowered: dict[str, dict]) -> tuple[CudaGlue, dict[str, list[Path]]]:
    """The op's launch code and .cu files, once `lower_all` has lowered (at least) its plan's jobs."""
    plan, make_body = planned
    mine = {j.symbol: lowered[j.symbol] for j in plan.jobs}
    body = make_body(spec, plan, mine)
    decl = declarations(mine) + [""] + [_variant_object(s, spec.name, i["family"]) for s, i in sorted(mine.items())]
    decl += getattr(plan, "support", [])
    files: dict[str, list[Path]] = {}
    for sym, info in sorted(mine.items()):
        files.setdefault(info["family"], []).append(info["path"])
    glue = CudaGlue(declarations=decl, body=body, variants=[(s, i["family"]) for s, i in sorted(mine.items())])
    return glue, files


def cuda_for_op(spec: OpSpec, op: OpAnalysis, families: list[str], out_dir: Path, jobs: int,
                log: Callable[[str], None]) -> tuple[CudaGlue | None, dict[str, list[Path]]]:
    """One op alone: plan, lower, glue (`emit` plans every op first and lowers all variants in one pool)."""
    planned = cuda_plan(spec, op, families, log)
    if planned is None:
        return None, {}
    return cuda_glue(spec, planned, lower_all(planned[0].jobs, Path(out_dir), jobs, log))


__all__ = ["BridgeError", "attention_math", "cuda_for_op", "cuda_glue", "cuda_plan", "isin", "lower_all", "row_program", "sys"]
