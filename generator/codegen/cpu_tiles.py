"""Row blocks and GEMM tiles for the generated CPU kernels (the block mode of cpu._Kernel).

A row kernel loads every element of a streamed operand (attention's K and V, the MLA cache, the fp8 weight) once
per row. Where the engine's forms let several rows share that operand, the kernel runs a block of rows at a time
instead, and a chunk of the reduction axis per step:

- which rows share it is read off the IR: the streamed factors of the contractions and folds depend on some row
  indices (K[b, j, g, c]: b and the GQA head g = h // (H / Hk); the cache: b through the page table; the weight:
  none). Their row-dependent parts are the block's *key*: rows are walked with the key's indices outermost, and a
  block is split at run time into runs of rows with equal keys (a GQA group, the query rows of one head).
- a contraction sum_c R[row, c] * E[j, c] (R the row-invariant factor the row kernel already hoists) becomes
  one GEMM tile per chunk: dots[rows, j] = R_block x E_tile^T, with E packed once per chunk for the whole run.
- a fold of a free-index state, acc[n] += w_j * F[j, n] (the P x V of attention, x_q x W^T of the quantised
  GEMM), becomes acc[rows, n] += W[rows, j] x F_tile[j, n], with F packed (fp8 decoded) once per chunk and
  column tile; the weights W are computed per row exactly as the row kernel computes them, after the row's online
  correction, and are 0 where the element is not counted by that row.
Everything else (masks, element lets, corrections, guards, epilogues, outputs) is the row kernel's code, run per
row of the run with that row's states bound (bind_row). Nothing here knows an op.

Soundness of the tiles: a packed element is read with the bindings of a row for which it is in the mask (or
counted), so no read happens that the row kernel would not do; a row that does not count an element multiplies
it by a weight of exactly 0, which is exact unless the packed value is inf/NaN, and a tile holding one is folded
element by element over counted elements only, as the row kernel does.
"""

from __future__ import annotations

from dataclasses import dataclass

import sympy as sp

from ..spec import DTYPE_BYTES
from ..symbolic.expr import Cast, cast_float32
from .cpp import let_type
from .cpu_params import CHUNK, TARGET_CLONES, UNROLL

RBLK = 128  # most rows of one block (the M side of the GEMM tiles)
SHARE_ROWS = 32  # blocks smaller than this are not split in two per thread (block_dispatch)
NT_RUN = 32  # runs of at most this many rows take a contraction's rows unpacked, in the NT tile
# ... except on bf16 pairs, which runs of at least this many rows take (transposing the tile into pair words pays
# for itself at the pair tile's twice the rate; 1 thread, AMD EPYC, MLA decode B4 ctx4096: Hq16 7.6-7.9 -> 5.7-5.9
# ms, Hq8 5.6 -> 5.2 ms, Hq4 even, Hq2 5 % slower)
PAIR_RUN = 8
NTILE = 256  # columns of a free index per packed tile of a GEMM fold
MEMO_BYTES = 1 << 22  # most bytes of packed tiles one tile site keeps per call (rf::TileMemo)
WCHUNK = 256  # the chunk of block kernels with an NT fold (block_chunk)
SCHUNK = 128  # the chunk of block kernels with a GEMM sum (block_chunk)
SCHUNK_OPEN = 256  # ... where no mask hides elements from rows (block_chunk)


@dataclass
class GemmSum:
    """A contraction computed per chunk as dots[rows, j] = rowbuf[rows, c] x pack[c, j]."""

    s: sp.Sum
    c: sp.Symbol
    key: tuple  # the hoisted row factor's key in _Kernel.hoisted
    elem: sp.Expr  # the streamed factor, read per element
    dots: str
    pack: str


@dataclass
class GemmFold:
    """A fold acc[rows, n] += w[rows, j] x pack[j, n] of a state carried over one free index."""

    name: str
    outer: sp.Expr  # the weight w_j (no free index)
    inner: sp.Expr  # the streamed factor F[j, n]
    free: str
    wbuf: str
    pack: str


@dataclass
class BlockPlan:
    sums: list[GemmSum]
    folds: dict[str, GemmFold]
    keys: list[sp.Expr]  # row-dependent parts of the streamed factors: rows with equal keys share them
    order: list[str]  # row indices, outermost first, in which blocks are cut
    late: set[str]  # element lets that read the contractions


def block_chunk(k) -> int:
    """The chunk of a block kernel: CHUNK elements, or WCHUNK where a fold reads a weight along its rows (the NT
    tiles of _pack_fold_nt): each chunk reads a stretch of every weight row, and 64 bytes of fp8 per row and
    chunk cost a cache and TLB miss each (rows are K bytes apart). With a GEMM sum: SCHUNK_OPEN where the mask is
    statically true, else SCHUNK. Each chunk costs every row of the block its passes over the chunk's scores (mask,
    max, exp, sum, the online correction of the free state), so fewer, longer chunks amortise that; but where a
    mask hides part of a chunk from a row (causal attention at the diagonal) the hidden part is computed and
    dropped, and that waste grows with the chunk. Measured on the attention spec at 1 thread (alternating runs, Zen 4):
    256 against 128, full attention 6-8 % faster (bf16 and fp32, d64 and d128), causal 3-21 % slower; 512 slower
    than 128 on both. The rule also gives 256 to decode (no mask), where runs are a GQA group of a few rows and
    nothing is amortised: 5-8 % slower at 4 rows per run (memory-bound; the chunk is fixed when the kernel is
    emitted, the run length known only at run time)."""

    if any(_nt_fold(k, g) for g in k.plan.folds.values()):
        return WCHUNK
    if k.plan.sums:
        return SCHUNK_OPEN if k.ir.mask in (sp.true, True) else SCHUNK
    return CHUNK


def _nt_fold(k, g: GemmFold) -> bool:
    return not _unit_last(k, g.inner, k.ir.indices[g.free]) and _direct_over_last(k, g.inner, g.free)


def _ntile(k) -> int:
    """Rows of n per packed tile of an NT fold: the tile stays at NTILE x CHUNK floats."""

    return max(16, NTILE * CHUNK // k.chunk)


# --------------------------------------------------------------------------------------------- the plan
def block_plan(k) -> BlockPlan | None:
    """The block plan of a kernel, or None where the row kernel is kept (selections, no contraction, or a
    contraction that is not a product of a hoisted row factor and a streamed factor)."""
    ir, a = k.ir, k.a
    if any(f.selection for f in a.reductions):
        return None
    lets = k.sorted_element_lets()
    first = k.mask_lets()
    rest = [x for x in lets if x.name not in first]
    with_sum = [x for x in lets if isinstance(x.expr, sp.Basic) and x.expr.atoms(sp.Sum)]
    late: set[str] = set()
    if with_sum:
        late = k.contraction_lets(rest) or set()
        if not late or any(x.name in first for x in with_sum):
            return None
    hoist = {key: fac for fac, _c, key in k.hoist_targets()}
    sums: list[GemmSum] = []
    for s in sorted({s for x in rest if x.name in late for s in x.expr.atoms(sp.Sum)}, key=str):
        c = s.limits[0][0]
        facs = list(s.function.args) if s.function.is_Mul else [s.function]
        rows_at = [n for n, f in enumerate(facs)
                   if isinstance(f, sp.Indexed) and (str(f.base.label), tuple(f.indices)) in hoist]
        if len(rows_at) != 1:
            return None
        row_fac = facs[rows_at[0]]
        elem = sp.Mul(*[f for n, f in enumerate(facs) if n != rows_at[0]])
        if ir.over not in k.index_deps(elem) or c not in elem.free_symbols:
            return None
        sums.append(GemmSum(s, c, (str(row_fac.base.label), tuple(row_fac.indices)), elem,
                            k.fresh("dots"), k.fresh("pk")))
    state_syms = {sym for roles in a.symbols.values() for sym in roles.values()}
    folds: dict[str, GemmFold] = {}
    for p in a.passes:
        forms = [f for f in a.reductions if f.stage == "stream" and f.pass_no == p.number]
        for level in k.levels(forms):
            _scalar, others = k.level_split(level)
            if len(others) != 1:
                continue
            f = others[0]
            split = k.blockable_fold([f])
            if split is None or len(f.free) != 1:
                continue
            outer, inner = split
            if ir.over not in k.index_deps(inner) or inner.free_symbols & state_syms or inner.atoms(sp.Sum):
                continue
            mine = set(a.symbols.get(f.name, {}).values())
            # the fold is applied after the whole chunk of every row: nothing later in the chunk may read it
            if any(g is not f and (f.name in g.online_deps or (g.term is not None and g.term.free_symbols & mine))
                   for g in forms):
                continue
            folds[f.name] = GemmFold(f.name, outer, inner, f.free[0], k.fresh("wts"), k.fresh("pk"))
    if not sums and not folds:
        return None
    keys: list[sp.Expr] = []
    for e in [g.elem for g in sums] + [g.inner for g in folds.values()]:
        _row_keys(k, e, keys)
    deps = _deps(k, keys)
    order = [n for n in ir.rows if n in deps] + [n for n in ir.rows if n not in deps]
    return BlockPlan(sums, folds, keys, order, late)


def _run_shared_lets(k) -> list[str] | None:
    """The element lets a block's first per-row loop writes (mask_and_early_lets: the mask's lets, the early lets
    and, under a mask, the others' mask values), where that loop's results are the same for every row of a run:
    the mask and those lets, with the element lets they read expanded, depend on no row index except through the
    run's keys (replaced by placeholders) or through a row let of key indices that are keys themselves (MLA's
    cache_seqlens[b] and page block_table[b, j / 64], b the key: 128 heads computed them again per chunk, ~7 % of
    the op). None where some row may differ (a causal mask reads the query position), and where the loop computes
    nothing (no mask, no early let: it only sets the flags)."""
    ir, plan = k.ir, k.plan
    rows = set(ir.rows)
    element = {let.symbol: let for let in ir.element_lets}
    first = k.mask_lets()
    lets = [x for x in k.sorted_element_lets() if x.name in first or
            (x.name not in plan.late or ir.mask not in (sp.true, True))]
    written = [x for x in lets if x.name in first or x.name not in plan.late]  # computed in the loop

    def expand(e: sp.Basic) -> sp.Basic:
        subs = {sym: expand(element[sym].expr) for sym in e.free_symbols if sym in element}
        return e.xreplace(subs) if subs else e

    if ir.mask in (sp.true, True) and not written:  # the loop only sets every flag: nothing to share
        return None
    exprs = [sp.sympify(ir.mask)] + [x.expr for x in written]
    if not all(isinstance(e, sp.Basic) for e in exprs) or any(e.atoms(sp.Sum) for e in exprs):
        return None
    marks = {key: sp.Dummy(f"key{n}") for n, key in enumerate(plan.keys)}
    bare = {str(key) for key in plan.keys if isinstance(key, sp.Symbol) and str(key) in rows}
    for e in exprs:
        if (k.index_deps(expand(e).xreplace(marks)) & rows) - bare:
            return None
    return [x.name for x in lets]


def _deps(k, keys: list) -> set:
    return set().union(*[k.index_deps(x) for x in keys]) if keys else set()


def _key_deps(k) -> set:
    """The row indices the block's key depends on (rows differing only in the others share the streamed tiles)."""
    return _deps(k, k.plan.keys)


COLS_MIN = 256  # fewest columns of a split free index per task (split_axis)


def split_axis(k) -> str | None:
    """The free index of the GEMM folds whose columns the tasks of one block may share out, or None. Where there
    are fewer blocks than threads (one token through a quantised GEMM: one block), each task takes a range of the
    columns (of n in acc[n]) and computes the rows' scalar states itself: the states of the split index are only
    folded, corrected and stored column by column, so a task needs none of the others' columns. Allowed where
    every state with free indices is such a fold over the one index, no epilogue reads one, and every output that
    reads one loops over that index (its other outputs are written by the first task of the block)."""
    a, plan = k.a, k.plan
    frees = {g.free for g in plan.folds.values()}
    if len(frees) != 1:
        return None
    n = frees.pop()
    carried = [f for f in a.reductions if f.free]
    if any(f.free != (n,) or f.name not in plan.folds for f in carried):
        return None
    syms = {sym for f in carried for sym in a.symbols.get(f.name, {}).values()} | {k.ir.states[f.name] for f in carried}
    if any(f.stage == "epilogue" and (f.free or (f.term is not None and f.term.free_symbols & syms))
           for f in a.reductions):
        return None
    for o in a.outputs:
        if getattr(o.value, "free_symbols", set()) & syms and n not in o.index:
            return None
    return n


def _row_keys(k, e: sp.Basic, out: list) -> None:
    """Append to `out` the row-dependent parts of a streamed factor: index expressions that depend on rows only
    (b, g), and the row indices themselves where an index mixes rows with the element (a page read per b and j)."""
    ir = k.ir
    rows = set(ir.rows)
    element_lets = {x.symbol: x for x in ir.lets if x.kind == "element"}

    def add(x: sp.Basic) -> None:
        if all(x != y for y in out):
            out.append(x)

    def walk(x: sp.Basic) -> None:
        if isinstance(x, sp.Indexed):
            for i in x.indices:
                d = k.index_deps(i)
                if not d & rows:
                    continue
                if d <= rows:
                    add(i)
                else:
                    walk(i)
            return
        if isinstance(x, sp.Symbol):
            if x in element_lets:
                walk(element_lets[x].expr)
                return
            if k.index_deps(x) & rows:  # a row index or a row let
                add(x)
            return
        for arg in x.args:
            walk(arg)

    walk(e)


# --------------------------------------------------------------------------------------------- storage
def block_storage(k) -> None:
    """Element arrays of one chunk for every row of a block, the packed tiles and the per-row buffers."""
    ir, plan, ch = k.ir, k.plan, k.chunk
    for let in ir.element_lets:
        ty = let_type(let)
        k.emit(f"std::vector<{ty}> bel_{let.name}_v({ch * RBLK});")
        k.emit(f"{ty}* bel_{let.name} = bel_{let.name}_v.data();")
    for flag in ("ok", "cnt"):
        k.emit(f"std::vector<uint8_t> bel_{flag}_v({ch * RBLK});")
        k.emit(f"uint8_t* bel_{flag} = bel_{flag}_v.data();")
    nk = max(1, len(plan.keys))
    if any(not _nt_fold(k, g) for g in plan.folds.values()) or plan.sums:
        inner = [f"ex_{n}" for n in plan.order if n not in _key_deps(k)]
        k.emit("// packed tiles kept for the call (rf::TileMemo) where later blocks of rows share this one's key: "
               "more rows per key than a block has")
        k.emit(f"const bool memo_on = {' * '.join(inner) or '1'} > rb_n;")
    for g in plan.sums:
        c = g.c.name
        k.emit(f"std::vector<float> b{g.dots}_v({ch * RBLK});  // {g.s}")
        k.emit(f"float* b{g.dots} = b{g.dots}_v.data();")
        k.emit(f"std::vector<float> {g.pack}_v(ex_{c} * {ch});  // the streamed factor, [element][c] (short runs)")
        k.emit(f"float* {g.pack} = {g.pack}_v.data();")
        k.emit("// the streamed factor's tiles in panels of 32 elements, [c][32] each (or [c / 2][element] pairs), one "
               "per chunk; flags: elements packed from the operand")
        k.emit(f"rf::TileMemo {g.pack}_memo(memo_on ? (ex_{k.ir.over} + {ch - 1}) / {ch} : 0, ex_{c} * {ch}, {ch}, "
               f"{nk + 1}, {MEMO_BYTES});")
        k.emit(f"uint8_t {g.pack}_real[{ch}];")
        if _row_read(k, g):
            ty = k.types[str(g.elem.base.label)]
            k.emit(f"std::vector<{ty}> {g.pack}_zero_v(ex_{g.c.name});  // the row of an element no row reads")
            k.emit(f"const {ty}* {g.pack}_rows[{ch}];  // where each element's row of the streamed factor starts")
        bt = pairs_sum(k, g)
        if bt:
            c = g.c.name
            k.emit("// bf16 operands on a CPU with AVX512_BF16: the tile on pairs of c (rf::gemm_tile_bf16)")
            k.emit(f"const bool {g.pack}_bf = std::is_same<{bt}, rf::bf16_t>::value && rf::bf16_dot() && ex_{c} % 2 == 0;")
            k.emit(f"const rf::bf16x2_t* {g.pack}_w[{ch}];  // the element rows read as pairs")
            k.emit(f"std::vector<uint32_t> {g.pack}a_v({g.pack}_bf ? {RBLK} * (ex_{c} / 2) : 0);  // the rows' factor "
                   "as pairs")
            k.emit(f"uint32_t* {g.pack}a = {g.pack}a_v.data();")
    for g in plan.folds.values():
        k.emit(f"std::vector<float> b{g.wbuf}_v({ch * RBLK});  // weights of the fold of {g.name}")
        k.emit(f"float* b{g.wbuf} = b{g.wbuf}_v.data();")
        if _nt_fold(k, g):
            k.emit(f"std::vector<float> {g.pack}_v({ch * _ntile(k)});  // the streamed factor, [{g.free}][element]")
            k.emit(f"float* {g.pack} = {g.pack}_v.data();")
            k.emit(f"std::vector<float> {g.wbuf}t_v({ch * RBLK});  // a long run's weights in panels of 32 rows, "
                   "[element][32] each (rf::gemm_tile_panels_tc)")
            k.emit(f"float* {g.wbuf}t = {g.wbuf}t_v.data();")
            k.emit(f"const float* {g.wbuf}_rows[{RBLK}];")
            if pairs_nt(k, g):
                tile, half = _ntile(k), ch // 2
                k.emit("// bf16-valued operands on a CPU with AVX512_BF16: the long runs' tile on pairs of elements")
                k.emit(f"const bool {g.pack}_bf = rf::bf16_dot();")
                k.emit(f"std::vector<uint32_t> {g.pack}w_v({g.pack}_bf ? {tile * half} : 0);  // [{g.free}][element / 2]")
                k.emit(f"std::vector<float> {g.pack}ht_v({g.pack}_bf ? {tile * half} : 0);  // [element / 2][{g.free}], "
                       "pairs as bit patterns")
                k.emit(f"float* {g.pack}ht = {g.pack}ht_v.data();")
                k.emit(f"const rf::bf16x2_t* {g.pack}_wr[{tile}];")
                k.emit(f"if ({g.pack}_bf) for (int64_t x = 0; x < {tile}; ++x) "
                       f"{g.pack}_wr[x] = reinterpret_cast<const rf::bf16x2_t*>({g.pack}w_v.data() + x * {half});")
                k.emit(f"std::vector<uint32_t> {g.wbuf}h_v({g.pack}_bf ? {RBLK * half} : 0);  // the weights as pairs")
                k.emit(f"uint32_t* {g.wbuf}h = {g.wbuf}h_v.data();")
        else:
            n = g.free
            k.emit(f"// the streamed factor's tiles in panels of 32 {n}, [element][32] each (or [element / 2][{n}] "
                   "pairs), one per chunk and column tile of ldp columns; flags: elements packed from the operand")
            k.emit(f"const int64_t {g.pack}_ldp = std::min<int64_t>({NTILE}, (ex_{n} + 31) / 32 * 32);")
            k.emit(f"const int64_t {g.pack}_ntl = (ex_{n} + {g.pack}_ldp - 1) / {g.pack}_ldp;  // column tiles per chunk")
            k.emit(f"rf::TileMemo {g.pack}_memo(memo_on ? (ex_{k.ir.over} + {ch - 1}) / {ch} * {g.pack}_ntl : 0, "
                   f"{ch} * {g.pack}_ldp, {ch}, {nk + 2}, {MEMO_BYTES});")
            k.emit(f"uint8_t {g.pack}_real[{ch}];")
            k.emit(f"std::vector<float> {g.pack}_v({ch} * {g.pack}_ldp);  // a pair tile's float pack (an inf/NaN)")
            k.emit(f"float* {g.pack} = {g.pack}_v.data();")
        bt = pairs_fold(k, g)
        if bt:
            k.emit("// bf16 operands on a CPU with AVX512_BF16: the tile on pairs of elements (rf::gemm_tile_bf16)")
            k.emit(f"const bool {g.pack}_bf = std::is_same<{bt}, rf::bf16_t>::value && rf::bf16_dot();")
            k.emit(f"std::vector<uint32_t> {g.wbuf}h_v({g.pack}_bf ? {RBLK * (ch // 2)} : 0);  // the weights as pairs")
            k.emit(f"uint32_t* {g.wbuf}h = {g.wbuf}h_v.data();")
            k.emit(f"std::vector<{bt}> {g.pack}_zero_v({g.pack}_bf ? ex_{g.free} : 0);  // the row of an element "
                   "no row counts")
            k.emit(f"const {bt}* {g.pack}_rows[{ch}];  // where each element's row starts (at {g.free} = 0)")
    k.emit(f"uint8_t row_sees[{RBLK}];  // per row of the block: whether the mask shows it any element of the chunk")
    k.emit(f"int8_t frow_ok[{ch}];  // per element of the chunk: the first row of the run that reads it, from r0 "
           "(rf::first_rows)")
    k.emit(f"int8_t frow_cnt[{ch}];  // ... and the first that counts it")
    for n in ir.rows:
        k.emit(f"int64_t rix_{n}[{RBLK}];")
    for let in ir.row_lets:  # computed once per block: the packs bind a row per element (a GQA group's idiv)
        k.emit(f"{let_type(let)} rlt_{let.name}[{RBLK}];")
    k.emit(f"double rkey[{RBLK * max(1, len(plan.keys))}];  // the streamed operand's row-dependent indices")
    if any(visible_bounds(k)):
        k.emit(f"int64_t rvis_lo[{RBLK}], rvis_hi[{RBLK}];  // per row: the range of {ir.over} its mask's linear bounds "
               "leave (visible_bounds)")


def _state_size(f) -> str:
    return " * ".join([f"ex_{n}" for n in f.free] or ["int64_t(1)"])


def bind_row(k, var: str, light: bool = False, guards_of: tuple = ()) -> None:
    """Declare the row kernel's names for row `var` of the block: row indices, row lets, element arrays and (unless
    light) states, hoisted row factors, contraction results, fold weights and the final guards of earlier passes."""
    ir, plan, ch = k.ir, k.plan, k.chunk
    for n in ir.rows:
        k.emit(f"const int64_t ix_{n} = rix_{n}[{var}];")
        k.emit(f"(void)ix_{n};")
    for let in ir.row_lets:
        ty = let_type(let)
        k.emit(f"const {ty} lt_{let.name} = rlt_{let.name}[{var}];")
        k.emit(f"(void)lt_{let.name};")
    for let in ir.element_lets:
        ty = let_type(let)
        k.emit(f"{ty}* el_{let.name} = bel_{let.name} + {var} * {ch};")
        k.emit(f"(void)el_{let.name};")
    k.emit(f"uint8_t* el_ok = bel_ok + {var} * {ch};")
    k.emit(f"uint8_t* el_cnt = bel_cnt + {var} * {ch};")
    k.emit("(void)el_ok; (void)el_cnt;")
    if light:
        return
    for f in k.a.reductions:
        if f.free:
            k.emit(f"float* st_{f.name} = bst_{f.name} + {var} * ({_state_size(f)});")
        else:
            k.emit(f"float& st_{f.name} = bst_{f.name}[{var}];")
        k.emit(f"(void)st_{f.name};")
    for buf, _fac, c, _key in k.hoist_fill:
        k.emit(f"float* {buf} = b{buf} + {var} * ex_{c.name};")
        k.emit(f"(void){buf};")
    for g in plan.sums:
        k.emit(f"float* {g.dots} = b{g.dots} + {var} * {ch};")
        k.emit(f"(void){g.dots};")
    for g in plan.folds.values():
        k.emit(f"float* {g.wbuf} = b{g.wbuf} + {var} * {ch};")
        k.emit(f"(void){g.wbuf};")
    for f in guards_of:
        k.emit_guard(f.name, None)


def _per_row(k, guards_of: tuple = ()) -> None:
    k.block("for (int64_t rb = r0; rb < r1; ++rb)")
    bind_row(k, "rb", guards_of=guards_of)


# --------------------------------------------------------------------------------------------- the function
def emit_blocked(k, head: str) -> str:
    ir, a, plan, ch = k.ir, k.a, k.plan, k.chunk
    k.lines = []
    k.preamble()
    nk = max(1, len(plan.keys))
    if k.cols:
        n = k.cols
        k.block("for (int64_t task = blk_begin; task < blk_end; ++task)")
        k.emit(f"// task = block x ncol + part: the part's columns of {n}, a multiple of 16 wide (split_axis)")
        k.emit("const int64_t blk = task / ncol;")
        k.emit("const int64_t cpart = task % ncol;")
        k.emit(f"const int64_t col_lo = ex_{n} * cpart / ncol / 16 * 16;")
        k.emit(f"const int64_t col_hi = cpart + 1 == ncol ? ex_{n} : ex_{n} * (cpart + 1) / ncol / 16 * 16;")
    else:
        k.block("for (int64_t blk = blk_begin; blk < blk_end; ++blk)")
    k.emit("const int64_t p0 = blk * rb_n;")
    k.emit("const int64_t nrow = std::min<int64_t>(A.rows - p0, rb_n);")
    k.emit(f"// rows of the block, walked in the order ({', '.join(plan.order)}): the streamed operand's indices first;")
    k.emit("// the first row's indices by division, then counted up row by row, and each row let computed again only")
    k.emit("// where an index it reads has moved (a GQA group's two divisions per row were ~3 % of the block function)")
    for n in plan.order:
        k.emit(f"int64_t cx_{n} = 0;")
    k.block("")
    k.emit("int64_t rem = p0;")
    for n in reversed(plan.order):
        k.emit(f"cx_{n} = rem % ex_{n};")
        k.emit(f"rem /= ex_{n};")
    k.end()
    for let in ir.row_lets:
        k.emit(f"{let_type(let)} pl_{let.name} = 0;")
    k.block("for (int64_t rb = 0; rb < nrow; ++rb)")
    for n in plan.order:
        k.emit(f"const int64_t ix_{n} = cx_{n};")
        k.emit(f"rix_{n}[rb] = ix_{n};")
    for let in ir.row_lets:
        moved = "".join(f" || ix_{n} != rix_{n}[rb - 1]" for n in plan.order if n in let.indices)
        k.emit(f"if (rb == 0{moved}) pl_{let.name} = {k.pr.val(let.expr, let.symbol)};")
        k.emit(f"const {let_type(let)} lt_{let.name} = pl_{let.name};")
        k.emit(f"rlt_{let.name}[rb] = lt_{let.name};")
    k.emit(f"rkey[rb * {nk}] = 0.0;")
    for q, key in enumerate(plan.keys):
        k.emit(f"rkey[rb * {nk} + {q}] = static_cast<double>({k.pr(key)});")
    los, his = visible_bounds(k)
    if los or his:
        k.emit(f"int64_t vlo = 0, vhi = ex_{ir.over};")
        for x in los:
            k.emit(f"vlo = std::max<int64_t>(vlo, {x});")
        for x in his:
            k.emit(f"vhi = std::min<int64_t>(vhi, {x});")
        k.emit("rvis_lo[rb] = vlo;")
        k.emit("rvis_hi[rb] = vhi;")
    carry = ""
    for depth, n in enumerate(reversed(plan.order)):
        if depth == len(plan.order) - 1:
            carry += f"++cx_{n};"
        else:
            carry += f"if (++cx_{n} == ex_{n}) {{ cx_{n} = 0; "
    k.emit(carry + " }" * (len(plan.order) - 1))
    k.end()
    k.emit("// runs of rows with equal keys share the packed tiles")
    k.block("for (int64_t r0 = 0, r1 = 0; r0 < nrow; r0 = r1)")
    k.emit("r1 = r0 + 1;")
    k.emit(f"while (r1 < nrow && std::equal(rkey + r1 * {nk}, rkey + (r1 + 1) * {nk}, rkey + r0 * {nk})) ++r1;")
    if los or his:
        k.emit(f"// the chunks of {ir.over} some row of the run may see (the union of their ranges, aligned to chunks): "
               "the others are hidden from every row and skipped whole")
        k.emit(f"int64_t vis_lo = ex_{ir.over}, vis_hi = 0;")
        k.emit("for (int64_t q = r0; q < r1; ++q) { vis_lo = std::min(vis_lo, rvis_lo[q]); "
               "vis_hi = std::max(vis_hi, rvis_hi[q]); }")
        k.emit(f"const int64_t c_begin = vis_lo < vis_hi ? vis_lo / {ch} * {ch} : 0;")
        k.emit("const int64_t c_end = vis_lo < vis_hi ? vis_hi : 0;")
        chunks = f"for (int64_t c0 = c_begin; c0 < c_end; c0 += {ch})"
        whole = _whole_chunks_skip_mask(k, los, his)
    else:
        whole = False
        chunks = f"for (int64_t c0 = 0; c0 < ex_{ir.over}; c0 += {ch})"
    _per_row(k)
    for buf, fac, c, key in k.hoist_fill:
        _fill_row_factor(k, buf, fac, c, key)
    k.end()
    done: list = []
    for i, p in enumerate(a.passes):
        forms = [f for f in a.reductions if f.stage == "stream" and f.pass_no == p.number]
        before = tuple(f for f in done if not f.free)
        k.emit(f"// ---- pass {p.number}: {', '.join(f.name for f in forms) or '-'}")
        if forms:
            _per_row(k, before)
            for f in forms:
                k.init_state(f)
            k.end()
            k.block(chunks)
            k.emit(f"const int64_t cn = std::min<int64_t>({ch}, ex_{ir.over} - c0);")
            _per_row(k, before)
            if whole:
                k.emit("// a chunk inside the row's range is all visible (every conjunct of the mask is one of its "
                       "bounds, and the loop below computes nothing else): its flags set at once")
                k.block("if (c0 >= rvis_lo[rb] && c0 + cn <= rvis_hi[rb])")
                k.emit("std::memset(el_ok, 1, static_cast<size_t>(cn));")
                k.emit("row_sees[rb] = cn > 0;")
                k.emit("continue;")
                k.end()
            shared = _run_shared_lets(k)
            if shared is not None:
                k.emit("// a later row of the run: the mask and the lets above read only the run's keys and the "
                       "element, so its flags and lets are the first row's")
                k.block("if (rb > r0)")
                for name in ["ok", *shared]:
                    k.emit(f"std::memcpy(el_{name}, bel_{name} + r0 * {ch}, static_cast<size_t>(cn) * "
                           f"sizeof(*el_{name}));")
                k.emit("row_sees[rb] = row_sees[r0];")
                k.emit("continue;")
                k.end()
            k.block("for (int64_t jj = 0; jj < cn; ++jj)")
            k.mask_and_early_lets(plan.late)
            k.end()
            if ir.mask in (sp.true, True):  # every element is seen (a memchr per row and chunk: ~1 % of attention)
                k.emit("row_sees[rb] = cn > 0;")
            else:
                k.emit("// whether the row sees any element of the chunk (the first ok byte: at once where the mask "
                       "shows all)")
                k.emit("row_sees[rb] = std::memchr(el_ok, 1, static_cast<size_t>(cn)) != nullptr;")
            k.end()
            for g in plan.sums:
                _pack_sum(k, g)
            _per_row(k, before)
            k.block("if (!row_sees[rb])")
            k.emit("// a chunk the mask hides from this row (causal attention past the diagonal) adds nothing to its "
                   "states: its updates are skipped, its elements counted nowhere and its fold weights 0")
            k.emit("std::fill(el_cnt, el_cnt + cn, uint8_t(0));")
            for g in plan.folds.values():
                k.emit(f"std::fill({g.wbuf}, {g.wbuf} + {ch}, 0.0f);")
            k.emit("continue;")
            k.end()
            k.block("for (int64_t jj = 0; jj < cn; ++jj)")
            k.late_lets(plan.late, {g.s: g.dots for g in plan.sums})
            k.emit(f"el_cnt[jj] = {k.counted()};")
            k.end()
            k.chunk_levels(forms)
            k.end()
            for f in forms:
                if f.name in plan.folds:
                    _pack_fold(k, plan.folds[f.name], f)
            k.end()
        _per_row(k, before)
        for f in forms:
            if not f.free:
                k.emit_guard(f.name, None)
        for f in a.reductions:
            if f.stage == "epilogue" and f.pass_no == p.number:
                k.epilogue(f)
        if i == len(a.passes) - 1:
            k.outputs()
        k.end()
        done += [f for f in a.reductions if f.pass_no == p.number]
    k.end()
    k.end()
    body = "\n".join(k.lines)

    return (f"// specialisation {ir.label} (blocks of rows sharing the streamed operand, GEMM tiles)\n{head}"
            f"{TARGET_CLONES}static void blocks_case{k.index}(const Args& A, int64_t blk_begin, int64_t blk_end, "
            f"int64_t rb_n{', int64_t ncol' if k.cols else ''}) {{\n{body}\n}}\n")


def _whole_chunks_skip_mask(k, los: list[str], his: list[str]) -> bool:
    """Whether a chunk inside a row's range needs no pass of its mask: every conjunct of the mask is a bound of
    visible_bounds (so the range is exactly where the mask holds), and the mask pass computes nothing else (no let
    the mask reads; every other element let comes after the contraction and is filled only where masked)."""
    ir = k.ir
    parts = ir.mask.args if isinstance(ir.mask, sp.And) else (ir.mask,)
    if not (los or his) or len(los) + len(his) != len(parts) or k.mask_lets():
        return False
    return all(let.name in k.plan.late for let in ir.element_lets)


def visible_bounds(k) -> tuple[list[str], list[str]]:
    """([lower bounds], [upper bounds]) on the streamed index that the mask puts on the elements a row sees, as C++
    int64 expressions over the row's bindings (lower inclusive, upper exclusive), from the mask's conjuncts that are
    linear in it with coefficient +-1 against an integer expression of row indices, row lets, sizes, scalars and
    tensor reads at row indices (causal attention's j <= i + Sk - Sq, a length's j < lens[b], a window's lower end).
    Other conjuncts are left out, which only widens the range: every element a row sees lies inside it, so a chunk
    outside every row's range of a run is hidden from all of them. No bounds for a kernel with a term cache (its
    per-chunk states are kept for every chunk)."""
    ir = k.ir
    mask = ir.mask
    if mask in (sp.true, True) or not isinstance(mask, sp.Basic) or k.tcache is not None:
        return [], []
    j = ir.indices[ir.over]
    row = ({ir.indices[n] for n in ir.rows} | {let.symbol for let in ir.row_lets} | set(ir.axes.values())
           | set(ir.scalars.values()))

    def of_row(x: sp.Basic) -> bool:  # known once the row's indices are: no element's index, let or state
        reads = [r for r in x.atoms(sp.Indexed) if str(r.base.label) in ir.tensors]
        labels = {r.base.label for r in reads}
        return (all(set().union(*[i.free_symbols for i in r.indices]) <= row for r in reads)
                and all(s in row or s in labels or s in reads for s in x.free_symbols))

    flip = {sp.LessThan: sp.GreaterThan, sp.GreaterThan: sp.LessThan,
            sp.StrictLessThan: sp.StrictGreaterThan, sp.StrictGreaterThan: sp.StrictLessThan}
    los: list[str] = []
    his: list[str] = []
    for c in mask.args if isinstance(mask, sp.And) else (mask,):
        if type(c) not in flip:
            continue
        e = sp.expand(c.lhs - c.rhs)
        a = e.coeff(j)
        rest = sp.expand(e - a * j)
        if a not in (1, -1) or not of_row(rest) or not k.pr.is_int(rest):
            continue
        # a * j + rest REL 0: j REL -rest (a = 1), or j FLIP(REL) rest (a = -1)
        rel, x = (type(c), -rest) if a == 1 else (flip[type(c)], rest)
        bound = f"static_cast<int64_t>({k.pr(x)})"
        if rel is sp.LessThan:
            his.append(f"{bound} + 1")
        elif rel is sp.StrictLessThan:
            his.append(bound)
        elif rel is sp.GreaterThan:
            los.append(bound)
        else:
            los.append(f"{bound} + 1")
    return los, his


def _any_live(k, flags: str) -> None:
    """Open a block that runs only where some row of the run has some element of the chunk in `flags`: a chunk that
    no row sees (causal attention past the diagonal) adds nothing, so its tile is neither packed nor multiplied."""
    ch = k.chunk
    if flags == "ok":
        k.emit("bool live = false;")
        k.emit("for (int64_t q = r0; q < r1; ++q) live = live || row_sees[q];")
    else:  # a row's flags ORed (vectorises), rows until one has any
        k.emit("uint8_t live = 0;")
        k.emit(f"for (int64_t q = r0; q < r1 && !live; ++q) for (int64_t jj = 0; jj < cn; ++jj) live |= bel_{flags}[q * {ch} + jj];")
    k.block("if (live)")


def _first_rows(k, flags: str) -> None:
    """frow_<flags>[jj] = the first row of the run for which element jj of the chunk is in `flags` (ok or cnt), from
    r0, or -1, for jj < cn: computed once per chunk and run, for every pack over the elements that follows."""
    k.emit(f"rf::first_rows(bel_{flags}, {k.chunk}, r0, r1, cn, frow_{flags});")


def _first_row(k, flags: str, cond: str = "true") -> None:
    """rs = the first row of the run for which element jj is in `flags` (ok or cnt), or -1 (_first_rows)."""
    first = f"frow_{flags}[jj]"
    none = f"{first} < 0" if cond == "true" else f"!({cond}) || {first} < 0"  # (past cn: not read)
    k.emit(f"const int64_t rs = {none} ? -1 : r0 + {first};")


def _pair_run(g: GemmSum) -> str:
    """The condition under which a run's contraction tile is on bf16 pairs (the one place that decides it: the
    row factor's pairs are filled under it and the tile reads them under it)."""
    return f"{g.pack}_bf && r1 - r0 >= {PAIR_RUN}"


def _fill_row_factor(k, buf: str, fac: sp.Indexed, c: sp.Symbol, key: tuple) -> None:
    """One row's hoisted contraction factor (the q row of q . k) widened into its row buffer, and the pairs of
    the tiles on bf16 pairs (used by runs of PAIR_RUN rows or more only). Where such a tile reads the factor as a
    bf16 input contiguous along c, such a run's pairs are that row's bits as they are (element 2p in a word's low
    half: little-endian memory order), and the row buffer, which only the float tiles and shorter runs read, is not
    filled (the widening and the rounding back were ~20 % of bf16 attention's block function)."""
    cn = c.name
    pairs = [g for g in k.plan.sums if g.key == key and pairs_sum(k, g)]
    saved = k.hoisted.pop(key)
    widen = (f"for (int64_t ix_{cn} = 0; ix_{cn} < ex_{cn}; ++ix_{cn}) "
             f"{buf}[ix_{cn}] = {k.pr.flt(fac)};")
    k.hoisted[key] = saved
    name = str(fac.base.label)
    raw = bool(pairs) and name in k.native and _unit_last(k, fac, c)
    if raw:
        g = pairs[0]
        first = tuple(sp.Integer(0) if i == c else i for i in fac.indices)
        k.block(f"if (std::is_same<{k.types[name]}, rf::bf16_t>::value && {_pair_run(g)})")
        k.emit("// a run on bf16 pairs: the row's words are its bf16 bits as they are")
        for h in pairs:
            k.emit(f"std::memcpy({h.pack}a + rb * (ex_{cn} / 2), &{k.tensor_element(name, first)}, "
                   f"ex_{cn} * sizeof({k.types[name]}));")
        k.end("} else {")
        k.ind += 1
    k.emit(widen)
    for g in pairs:
        k.emit(f"if ({_pair_run(g)}) rf::pairs_from_floats(1, ex_{cn}, {buf}, ex_{cn}, "
               f"{g.pack}a + rb * (ex_{cn} / 2), ex_{cn} / 2);")
    if raw:
        k.end()


def _pack_sum(k, g: GemmSum) -> None:
    ch = k.chunk
    c = g.c.name
    k.block("")
    k.emit(f"// {g.s}: the streamed factor packed once for the run, then one GEMM tile")
    _any_live(k, "ok")
    buf = k.hoisted[g.key].split("[")[0]
    one = _unit_last(k, g.elem, g.c)
    if one:
        k.block("if (r1 - r0 == 1)")
        k.emit("// a run of one row (MHA decode): nothing to share, so no pack: dot products from the operand itself")
        k.emit(f"const float* rq = b{buf} + r0 * ex_{c};")
        _one_row(k, "ok", lambda u: (
            [f"float d{u} = 0.0f;"],
            f"d{u} += rq[ix_{c}] * {k.pr.flt(g.elem)};",
            [f"b{g.dots}[r0 * {ch} + jb + {u}] = d{u};"]), c, None)
        k.end("} else {")
        k.ind += 1
    _first_rows(k, "ok")
    if _row_read(k, g):
        k.emit("// the chunk's rows of the operand, contiguous along the contraction")
        name = str(g.elem.base.label)
        first = tuple(sp.Integer(0) if i == g.c else i for i in g.elem.indices)
        _each_element(k, f"{g.pack}_rows[jj] = {g.pack}_zero_v.data(); {g.pack}_real[jj] = 0;",
                      f"{g.pack}_rows[jj] = &{k.tensor_element(name, first)}; {g.pack}_real[jj] = 1;")
        pairs = pairs_sum(k, g)
        k.block(f"if (r1 - r0 <= {NT_RUN}" + (f" && !({_pair_run(g)}))" if pairs else ")"))
        k.emit("// a short run (decode heads): the rows as they are, widened, and the NT tile: a transpose per tile "
               "costs as much as the GEMM at so few rows" + (" (on bf16 pairs, at fewer than PAIR_RUN)" if pairs else ""))
        k.emit(f"for (int64_t jj = 0; jj < {ch}; ++jj) for (int64_t ix_{c} = 0; ix_{c} < ex_{c}; ++ix_{c}) "
               f"{g.pack}[jj * ex_{c} + ix_{c}] = rf::ld({g.pack}_rows[jj][ix_{c}]);")
        k.emit(f"rf::gemm_tile_nt(r1 - r0, {ch}, ex_{c}, b{buf} + r0 * ex_{c}, ex_{c}, {g.pack}, ex_{c}, "
               f"b{g.dots} + r0 * {ch}, {ch}, false);")
        k.end("} else {")
        k.ind += 1
        _memo_find(k, g.pack, 1)
        if pairs:
            k.block(f"if ({_pair_run(g)})")
            k.emit("// bf16 pairs: the rows read as words of two c, transposed into the [c / 2][element] tile")
            k.block("if (!hit)")
            k.emit(f"for (int64_t jj = 0; jj < {ch}; ++jj) "
                   f"{g.pack}_w[jj] = reinterpret_cast<const rf::bf16x2_t*>({g.pack}_rows[jj]);")
            k.emit(f"rf::pack_transposed({ch}, ex_{c} / 2, {g.pack}_w, pt, {ch});")
            k.end()
            k.emit(f"rf::gemm_tile_bf16(r1 - r0, {ch}, ex_{c} / 2, {g.pack}a + r0 * (ex_{c} / 2), ex_{c} / 2, "
                   f"reinterpret_cast<const uint32_t*>(pt), {ch}, b{g.dots} + r0 * {ch}, {ch}, false);")
            k.end("} else {")
            k.ind += 1
        k.emit("// a long run: transposed 8 x 8 at a time into the tile's panels of 32 elements, [c][32] each")
        k.emit(f"if (!hit) rf::pack_transposed_panels({ch}, ex_{c}, {g.pack}_rows, pt, ex_{c} * 32);")
        _score_gemm(k, g, buf)
        if pairs:
            k.end()
        k.end()
    else:
        _each_element(k, f"{g.pack}_real[jj] = 0;", f"{g.pack}_real[jj] = 1;")
        _memo_find(k, g.pack, 1)
        k.block("if (!hit)")
        at = f"pt[jj / 32 * (ex_{c} * 32) + ix_{c} * 32 + jj % 32]"  # the tile's panels of 32 elements, [c][32] each
        _each_element(k, f"for (int64_t ix_{c} = 0; ix_{c} < ex_{c}; ++ix_{c}) {at} = 0.0f;",
                      f"for (int64_t ix_{c} = 0; ix_{c} < ex_{c}; ++ix_{c}) {at} = {k.pr.flt(g.elem)};")
        k.end()
        _score_gemm(k, g, buf)
    if one:
        k.end()
    k.end()
    k.end()


def _each_element(k, dead: str, live: str, flags: str = "ok") -> None:
    """For each element jj of the chunk: `live` with the names of the first row of the run for which it is in
    `flags` (ok: read, cnt: counted) bound, or `dead` where no row has it (and for jj past the chunk's end)."""
    k.block(f"for (int64_t jj = 0; jj < {k.chunk}; ++jj)")
    _first_row(k, flags, "jj < cn")
    k.block("if (rs < 0)")
    k.emit(dead)
    k.emit("continue;")
    k.end()
    bind_row(k, "rs", light=True)
    k.emit(f"const int64_t ix_{k.ir.over} = c0 + jj;")
    k.emit(f"(void)ix_{k.ir.over};")
    k.emit(live)
    k.end()


def _score_gemm(k, g: GemmSum, buf: str) -> None:
    ch, c = k.chunk, g.c.name
    k.emit(f"rf::gemm_tile_panels(r1 - r0, {ch}, ex_{c}, b{buf} + r0 * ex_{c}, ex_{c}, pt, ex_{c} * 32, "
           f"b{g.dots} + r0 * {ch}, {ch}, false);")


def _memo_find(k, pack: str, extra: int, index: str | None = None) -> None:
    """slot, hit and pt (the slot's tile) for this run's tile of `pack` (rf::TileMemo): tagged by the run's key,
    the chunk's start and, for a fold (extra 2), the column tile's start n0."""
    nk = max(1, len(k.plan.keys))
    k.emit(f"double tag[{nk + extra}];")
    k.emit(f"std::copy(rkey + r0 * {nk}, rkey + (r0 + 1) * {nk}, tag);")
    k.emit(f"tag[{nk}] = static_cast<double>(c0);")
    if extra == 2:
        k.emit(f"tag[{nk + 1}] = static_cast<double>(n0);")
    k.emit("bool hit = false;")
    k.emit(f"const int64_t slot = {pack}_memo.find({index or f'c0 / {k.chunk}'}, tag, {pack}_real, hit);")
    k.emit(f"float* pt = {pack}_memo.tile(slot);")


def _row_read(k, g: GemmSum) -> bool:
    """Whether a contraction's streamed factor is one read of an input, unit-strided along the contraction index
    (and indexed by it nowhere else): each element's factor is then a contiguous row, wherever it lies (a page of
    a paged cache), and the pack transposes rows."""
    return isinstance(g.elem, sp.Indexed) and _unit_last(k, g.elem, g.c)


def _group(k, name: str) -> str:
    """The tensor whose dtype a tensor follows (itself where it names its own)."""
    return k.spec.arg(name).same_as or name


def pairs_sum(k, g: GemmSum) -> str | None:
    """The element type parameter under which a contraction's tile may run on bf16 pairs (rf::gemm_tile_bf16), or
    None: its streamed factor is one read of a native input (a template parameter; the kernel's flag `<pack>_bf`
    holds only where it is bf16 at run time), and its row factor reads an input of the same dtype, so that there the
    float row buffer holds bf16 values exactly and the pair products are the float tile's products."""
    if not _row_read(k, g):
        return None
    name = str(g.elem.base.label)
    ty = k.types.get(name, "")
    if not ty.startswith("T_") or _group(k, g.key[0]) != _group(k, name):
        return None
    return ty


def pairs_fold(k, g: GemmFold) -> str | None:
    """The element type parameter under which a fold's tile may run on bf16 pairs, or None: its streamed factor is
    one read of a native input along the free index with unit stride (its rows are contiguous) and it is not an NT
    fold. The weights are rounded to bf16 for the pair products (nearest-even, a relative 2^-9 per weight, as a
    bf16 attention rounds its probabilities before P x V); the states they are normalised by are summed in float."""
    if _nt_fold(k, g) or _row_start(k, g) is None:
        return None
    ty = k.types.get(str(g.inner.base.label), "")
    return ty if ty.startswith("T_") else None


BF16_VALUES = ("bfloat16", "float8_e4m3fn")  # dtypes whose every value is a bf16 value


def _bf16_valued(k, e: sp.Expr) -> bool:
    """Whether every value e takes is a bf16 value, by its form: a cast to bf16 or e4m3, or a read (widened to float32
    or not) of a tensor whose dtypes all are bf16 or e4m3."""
    if isinstance(e, cast_float32):
        return _bf16_valued(k, e.args[0])
    if isinstance(e, Cast):
        return e.dtype in BF16_VALUES
    if isinstance(e, sp.Indexed):
        arg = k.spec.arg(str(e.base.label))
        dtypes = k.spec.arg(arg.same_as).dtypes if arg.same_as else arg.dtypes
        return bool(dtypes) and all(d in BF16_VALUES for d in dtypes)
    return False


def pairs_nt(k, g: GemmFold) -> bool:
    """Whether an NT fold (a weight W[n, j] read along the chunk) may run on bf16 pairs: its weight and its streamed
    factor are bf16 values by their form (the e4m3 quantised activations and the fp8 weight of a quantised GEMM),
    so the pair products are exactly the float tile's."""
    return _nt_fold(k, g) and _bf16_valued(k, g.outer) and _bf16_valued(k, g.inner)


def _unit_last(k, e: sp.Expr, axis: sp.Symbol) -> bool:
    """Whether every tensor read in e that depends on `axis` has it as its last index (a unit stride for the float
    and native inputs, see the glue): the one-row paths loop over `axis` innermost, straight from the tensor."""
    reads = [x for x in e.atoms(sp.Indexed) if axis in x.free_symbols]
    return bool(reads) and all(x.indices[-1] == axis and str(x.base.label) in k.floats
                               and not any(axis in i.free_symbols for i in x.indices[:-1]) for x in reads)


def _one_row(k, flags: str, parts, axis: str, fold: str | None) -> None:
    """The elements of a chunk for the one row r0 of a run where `flags` holds, UNROLL at a time where it holds
    for all of them (one pass over `axis` serves them all), else one at a time. parts(u) gives (lines before the
    axis loop, the element's term in it, lines after it) for element jb + u; with `fold`, the terms are summed
    into `fold + ...` per axis index, else each term is a statement."""

    ir, ch = k.ir, k.chunk
    bind_row(k, "r0", light=True)
    k.emit("int64_t jb = 0;")

    def group(width: int, cond: str) -> None:
        k.block(cond)
        saved = dict(k.local)
        pre, terms, post = [], [], []
        for u in range(width):
            k.local.update(k.element_overrides(u, "jb"))
            k.emit(f"const int64_t ix_{ir.over}_{u} = c0 + jb + {u};")
            k.emit(f"(void)ix_{ir.over}_{u};")
            a, t, b = parts(u)
            pre += a
            terms.append(t)
            post += b
            k.local = dict(saved)
        for line in pre:
            k.emit(line)
        body = f"{fold} + {' + '.join(terms)};" if fold else "{ " + " ".join(terms) + " }"
        lo, hi = k.bounds(axis) if fold else ("0", f"ex_{axis}")
        k.emit(f"for (int64_t ix_{axis} = {lo}; ix_{axis} < {hi}; ++ix_{axis}) {body}")
        for line in post:
            k.emit(line)
        k.end()

    k.block(f"for (; jb + {UNROLL} <= cn; jb += {UNROLL})")
    group(UNROLL, f"if ({' && '.join(f'bel_{flags}[r0 * {ch} + jb + {u}]' for u in range(UNROLL))})")
    k.emit("else")
    k.block(f"for (int64_t u = 0; u < {UNROLL}; ++u)")
    k.emit("const int64_t jb0 = jb;")
    k.emit("jb = jb0 + u;")
    group(1, f"if (bel_{flags}[r0 * {ch} + jb])")
    k.emit("jb = jb0;")
    k.end()
    k.end()
    k.block("for (; jb < cn; ++jb)")
    group(1, f"if (bel_{flags}[r0 * {ch} + jb])")
    k.end()


def emit_fold_weights(k, g: GemmFold) -> None:
    """In place of the row kernel's fold: the weight of every element of the chunk for this row (0 where the
    element is not counted); the fold itself runs as a GEMM tile after every row of the run. Whether an element
    counts is read from its values where they tell (cpu._Kernel.counted_by_value): the flag bytes of el_cnt in this
    float loop made GCC vectorise it 64 elements a step (one vector of bytes, four of floats) and spill the exp's
    mask registers to the stack."""
    ir = k.ir
    k.emit(f"// weights of the fold of {g.name} (applied as a GEMM tile after the run's rows)")
    k.block("for (int64_t jj = 0; jj < cn; ++jj)")
    k.emit(f"const int64_t ix_{ir.over} = c0 + jj;")
    k.emit(f"(void)ix_{ir.over};")
    cond = k.counted_by_value() or "el_cnt[jj]"
    arg = g.outer.args[0] if isinstance(g.outer, sp.exp) else None
    if arg is not None and k.branch_free(arg):
        # exp(x): the exponents (-inf where the element does not count: weight exp(-inf) = 0), then rf::exp_sum,
        # the exp in place and the weights' sum, which a sum of the same weights takes (cpu._Kernel.direct_folds)
        if cond == "true":
            k.emit(f"{g.wbuf}[jj] = {k.pr.flt(arg)};")
        else:
            k.emit(f"const float x = {k.pr.flt(arg)};")
            k.emit(f"{g.wbuf}[jj] = {cond} ? x : -rf::kInf;")
        k.end()
        total = k.fresh("wsum")
        k.emit(f"const float {total} = rf::exp_sum({g.wbuf}, cn);")
        k.emit(f"(void){total};")
        k.wsums[g.wbuf] = total
        k.local = {}
        return
    if cond == "true":  # every element counts
        k.emit(f"{g.wbuf}[jj] = {k.pr.flt(g.outer)};")
    elif k.branch_free(g.outer):
        k.emit(f"const float v = {k.pr.flt(g.outer)};")
        k.emit(f"{g.wbuf}[jj] = {cond} ? v : 0.0f;")
    else:
        k.emit(f"{g.wbuf}[jj] = {cond} ? {k.pr.flt(g.outer)} : 0.0f;")
    k.end()
    k.local = {}


def _pack_fold(k, g: GemmFold, f) -> None:
    ir, ch = k.ir, k.chunk
    n = g.free
    size = _state_size(f)
    k.block("")
    k.emit(f"// fold of {g.name}: the streamed factor packed once per column tile for the run, then one GEMM tile")
    k.emit(f"const int64_t szf = {size};")
    _any_live(k, "cnt")
    if _nt_fold(k, g):
        _pack_fold_nt(k, g)
        return
    one = _unit_last(k, g.inner, k.ir.indices[n])
    if one:
        k.block("if (r1 - r0 == 1)")
        k.emit("// a run of one row: the row kernel's fold, over counted elements, straight from the operand")
        k.emit(f"float* acc = bst_{g.name} + r0 * szf;")
        _one_row(k, "cnt", lambda u: (
            [f"const float w{u} = b{g.wbuf}[r0 * {ch} + jb + {u}];"],
            f"w{u} * {k.pr.flt(g.inner)}",
            []), n, f"acc[ix_{n}] = acc[ix_{n}]")
        k.end("} else {")
        k.ind += 1
    lo, hi = k.bounds(n)
    pairs = pairs_fold(k, g)
    _first_rows(k, "cnt")
    if pairs:
        _fold_pair_rows(k, g)
    else:
        _counted_flags(k, g)
    ldp = f"{g.pack}_ldp"
    k.block(f"for (int64_t n0 = {lo}; n0 < {hi}; n0 += {ldp})")
    k.emit(f"const int64_t nt = std::min<int64_t>({ldp}, {hi} - n0);")
    _memo_find(k, g.pack, 2, f"c0 / {ch} * {g.pack}_ntl + (n0 - ({lo})) / {ldp}")
    if pairs:
        k.emit("// bf16 pairs (a tile with an inf/NaN takes the float path below, packed outside the memo)")
        k.block(f"if constexpr (std::is_same<{pairs}, rf::bf16_t>::value)")
        k.block(f"if ({g.pack}_bf)")
        k.emit(f"if (!hit) {g.pack}_memo.word(slot) = rf::pack_pairs_interleaved((cn + 1) / 2, nt, {g.pack}_rows, n0, "
               f"reinterpret_cast<uint32_t*>(pt), {ldp});")
        k.block(f"if (!{g.pack}_memo.word(slot))")
        k.emit(f"rf::gemm_tile_bf16(r1 - r0, nt, (cn + 1) / 2, {g.wbuf}h + r0 * {ch // 2}, {ch // 2}, "
               f"reinterpret_cast<const uint32_t*>(pt), {ldp}, bst_{g.name} + r0 * szf + n0, szf, true);")
        k.emit("continue;")
        k.end()
        k.emit(f"pt = {g.pack};")
        k.emit("hit = false;")
        k.end()
        k.end()
    k.emit("uint32_t bad = 0;  // a packed inf/NaN: fold element by element over counted elements only")
    k.block("if (!hit)")
    k.block("for (int64_t jj = 0; jj < cn; ++jj)")
    _first_row(k, "cnt")
    k.emit(f"float* dst = pt + jj * 32;  // element jj's row of 32 columns in each panel, [element][32] ({ch} * 32 apart)")
    k.block("if (rs < 0)")
    k.emit(f"for (int64_t x0 = 0; x0 < nt; x0 += 32) std::fill(dst + x0 * {ch}, dst + x0 * {ch} + 32, 0.0f);")
    k.emit("continue;")
    k.end()
    bind_row(k, "rs", light=True)
    k.emit(f"const int64_t ix_{ir.over} = c0 + jj;")
    k.emit(f"(void)ix_{ir.over};")
    row = _row_start(k, g)
    if row:
        k.emit(f"const int64_t ix_{n} = n0;  // the tile's first column: the row from there on, packed by vectors")
        k.emit(f"bad |= rf::pack_row_panels(&{row}, nt, dst, {ch} * 32) ? 1u : 0u;")
    else:
        k.emit(f"float vals[{NTILE}];  // the factor's values at this element's columns n0 .. n0 + nt, then packed")
        k.emit(f"for (int64_t ix_{n} = n0; ix_{n} < n0 + nt; ++ix_{n}) vals[ix_{n} - n0] = {k.pr.flt(g.inner)};")
        k.emit(f"bad |= rf::pack_row_panels(vals, nt, dst, {ch} * 32) ? 1u : 0u;")
    k.end()
    k.emit(f"if (pt != {g.pack}) {g.pack}_memo.word(slot) = bad;")
    k.end("} else {")
    k.emit(f"  bad = {g.pack}_memo.word(slot);")
    k.emit("}")
    _tile_or_counted(k, g, f"rf::gemm_tile_panels(r1 - r0, nt, cn, b{g.wbuf} + r0 * {ch}, {ch}, pt, {ch} * 32, "
                     f"bst_{g.name} + r0 * szf + n0, szf, true);", f"pt[x / 32 * {ch * 32} + jj * 32 + x % 32]")
    k.end()
    k.end()
    k.end()
    if one:
        k.end()
    k.end()
    k.end()


def _row_start(k, g: GemmFold) -> str | None:
    """The element that a fold's streamed factor reads, where that factor is one read of an input whose rows are
    contiguous along the free index (the row from that element on is at hand, for rf::pack_row_panels); else None
    (an expression of reads: packed value by value)."""
    if not isinstance(g.inner, sp.Indexed) or not _unit_last(k, g.inner, k.ir.indices[g.free]):
        return None
    return k.tensor_element(str(g.inner.base.label), g.inner.indices)


def _fold_pair_rows(k, g: GemmFold) -> None:
    """For a fold on bf16 pairs: the run's weights as pairs of elements (rounded to bf16), and where each element's
    row of the streamed factor starts, read with the bindings of the first row that counts it (the zero row where
    none does, and past the chunk's end, which also makes the last pair whole)."""
    ch = k.chunk
    free = k.ir.indices[g.free]
    first = tuple(sp.Integer(0) if i == free else i for i in g.inner.indices)
    k.block(f"if ({g.pack}_bf)")
    k.emit(f"rf::pairs_from_floats(r1 - r0, cn, b{g.wbuf} + r0 * {ch}, {ch}, {g.wbuf}h + r0 * {ch // 2}, {ch // 2});")
    _each_element(k, f"{g.pack}_rows[jj] = {g.pack}_zero_v.data(); {g.pack}_real[jj] = 0;",
                  f"{g.pack}_rows[jj] = &{k.tensor_element(str(g.inner.base.label), first)}; {g.pack}_real[jj] = 1;",
                  "cnt")
    k.end("} else {")
    k.ind += 1
    _counted_flags(k, g)
    k.end()


def _counted_flags(k, g: GemmFold) -> None:
    """The fold tile's memo flags where no pair pass set them: the elements some row of the run counts."""
    ch = k.chunk
    k.emit(f"for (int64_t jj = 0; jj < {ch}; ++jj) {g.pack}_real[jj] = jj < cn && frow_cnt[jj] >= 0;  "
           "// the elements some row counts")


def _tile_or_counted(k, g: GemmFold, tile: str | list[str], packed: str) -> None:
    """The GEMM tile call (or lines) where the packed tile is finite, else the fold element by element over counted
    elements only (packed: the packed value of element jj and column x). Leaves the else branch's row loop open."""
    ch = k.chunk
    k.block("if (!bad)")
    for line in [tile] if isinstance(tile, str) else tile:
        k.emit(line)
    k.end("} else {")
    k.ind += 1
    k.block("for (int64_t q = r0; q < r1; ++q)")
    k.block("for (int64_t jj = 0; jj < cn; ++jj)")
    k.emit(f"if (!bel_cnt[q * {ch} + jj]) continue;")
    k.emit(f"const float w = b{g.wbuf}[q * {ch} + jj];")
    k.emit(f"float* acc = bst_{g.name} + q * szf + n0;")
    k.emit(f"for (int64_t x = 0; x < nt; ++x) acc[x] = acc[x] + w * {packed};")
    k.end()


def _direct_over_last(k, e: sp.Expr, n: str) -> bool:
    """Whether the streamed factor e reads its tensors as T[..., free n ..., element index last] with plain indices
    and nothing of the row (a weight W[n, k]): then it is packed row by row of n, contiguous along the element,
    for an NT tile, and every read is in bounds whatever the mask says."""
    ir = k.ir
    over, free = ir.indices[ir.over], ir.indices[n]
    reads = list(e.atoms(sp.Indexed))
    if not reads or e.free_symbols - {over, free} - set(reads) - {x.base.label for x in reads}:
        return False
    return all(x.indices[-1] == over and all(i in (over, free) for i in x.indices)
               and sum(i == over for i in x.indices) == 1 for x in reads)


PREFETCH_ROWS = 16  # how far ahead (rows of n) an NT pack prefetches its weight rows


def _elem_bytes(k, name: str) -> int:
    """The widest element of a tensor's dtypes (bytes), as the kernel reads it."""
    if name in k.floats and name not in k.native:
        return 4  # converted to float32 by the glue
    arg = k.spec.arg(name)
    dtypes = k.spec.arg(arg.same_as).dtypes if arg.same_as else arg.dtypes
    return max(DTYPE_BYTES[d] for d in dtypes or ("float32",))


def _prefetch_rows(k, g: GemmFold) -> None:
    """Prefetch the chunk's stretch of the weight row PREFETCH_ROWS ahead, one cache line at a time: the rows are K
    elements apart, so each stretch is on its own page and the hardware prefetcher does not follow (an fp8 weight
    of 4096 x 4096 at one token: 23 -> 14 ms on a Zen 3 EPYC). Rows past the tensor are not prefetched."""
    ir = k.ir
    free = ir.indices[g.free]
    for x in sorted(g.inner.atoms(sp.Indexed), key=str):
        name = str(x.base.label)
        step = max(1, 64 // _elem_bytes(k, name))
        y = x.xreplace({free: free + PREFETCH_ROWS})
        r = k.tensor_read(name, y.indices)
        addr = r[len("rf::ld("):-1] if r.startswith("rf::ld(") else None
        if addr is None:
            continue
        k.block(f"if (ix_{g.free} + {PREFETCH_ROWS} < ex_{g.free})")
        k.emit(f"for (int64_t jj = 0; jj < cn; jj += {step}) {{ const int64_t ix_{ir.over} = c0 + jj; "
               f"__builtin_prefetch(&{addr}); }}")
        k.end()


def _e4m3_weight(k, g: GemmFold) -> str | None:
    """The tensor of an NT fold whose streamed factor is one e4m3 weight W[n, j] read as it is (widened to float32),
    else None."""
    e = g.inner.args[0] if isinstance(g.inner, cast_float32) else g.inner
    if not isinstance(e, sp.Indexed) or k.types.get(str(e.base.label)) != "rf::e4m3_t":
        return None
    ir = k.ir
    return str(e.base.label) if tuple(e.indices) == (ir.indices[g.free], ir.indices[ir.over]) else None


def _e4m3_one_row(k, g: GemmFold) -> None:
    """In an NT fold's column tile: for a run of one row (a GEMV: one token) over an e4m3 weight with unit stride
    along the chunk, each weight row decoded and dotted with the row's weights in one pass (rf::e4m3_row_dots),
    instead of decoded into the tile and read back by a one-row GEMM tile (twice the time at M = 1). A weight row
    with a NaN byte is summed again over the counted elements only, as the tile path's fallback does."""
    w = _e4m3_weight(k, g)
    if w is None:
        return
    ch, tile = k.chunk, _ntile(k)
    k.block(f"if (r1 - r0 == 1 && st_{w}[1] == 1)")
    k.emit("// one row: each weight row decoded and dotted in one pass (no tile to write and read back)")
    k.emit(f"const float* xq = b{g.wbuf} + r0 * {ch};")
    k.emit(f"const uint8_t* cnt = bel_cnt + r0 * {ch};")
    k.emit(f"float* acc = bst_{g.name} + r0 * szf + n0;")
    k.emit(f"float dots[{tile}];")
    k.emit(f"uint8_t nanrow[{tile}];")
    k.emit(f"const uint8_t* wrow = reinterpret_cast<const uint8_t*>(t_{w} + n0 * st_{w}[0] + c0);")
    k.block(f"if (rf::e4m3_row_dots(nt, cn, wrow, st_{w}[0], xq, dots, nanrow))")
    k.block("for (int64_t x = 0; x < nt; ++x)")
    k.emit("if (!nanrow[x]) continue;")
    k.emit("float s = 0.0f;")
    k.emit(f"for (int64_t jj = 0; jj < cn; ++jj) if (cnt[jj]) s += rf::e4m3_to_float(wrow[x * st_{w}[0] + jj]) * xq[jj];")
    k.emit("dots[x] = s;")
    k.end()
    k.end()
    k.emit("for (int64_t x = 0; x < nt; ++x) acc[x] += dots[x];")
    k.emit("continue;")
    k.end()


def _pack_fold_nt(k, g: GemmFold) -> None:
    """_pack_fold for a factor F[j, n] = W[n, j]: packed [n][element] (contiguous reads of W along the chunk, all
    in bounds: _direct_over_last; an e4m3 weight decoded by rf::e4m3_to_floats), then one GEMM tile acc[rows, n] +=
    w[rows, j] x pack[n, j]^T: for a long run as acc^T = pack x w^T (rf::gemm_tile_panels_tc, the run's weights
    transposed into panels once per chunk; measured on the quantised GEMM spec, M128 N4096 K4096, 1 thread, Xeon:
    37.7 -> 34.9 ms against transposing every tile, and 34.9 -> 33.8 ms with the vector decode; also for runs of 16
    or 32 rows, which fill its columns), else the NT tile (lane sums, no transpose). Elements no row counts get
    weight 0 from every row; a tile with an inf/NaN is folded over counted elements only."""
    ir, ch = k.ir, k.chunk
    n, tile = g.free, _ntile(k)
    lo, hi = k.bounds(n)
    pairs = pairs_nt(k, g)
    if pairs:
        k.emit(f"const bool pairs = {g.pack}_bf && r1 - r0 > {NT_RUN};  // a long run on bf16 pairs")
        k.emit(f"if (pairs) rf::pairs_from_floats(r1 - r0, cn, b{g.wbuf} + r0 * {ch}, {ch}, {g.wbuf}h + r0 * {ch // 2}, "
               f"{ch // 2});")
    tc = f"r1 - r0 > {NT_RUN} || (r1 - r0) % 16 == 0"
    k.block(f"if ({f'!pairs && ({tc})' if pairs else tc})")
    k.emit("// a long run (or one of 16 or 32 rows): its weights transposed once per chunk into panels of 32 rows, "
           "the tile's streamed operand")
    k.emit(f"for (int64_t q = r0; q < r1; ++q) {g.wbuf}_rows[q - r0] = b{g.wbuf} + q * {ch};")
    k.emit(f"rf::pack_transposed_panels(r1 - r0, cn, {g.wbuf}_rows, {g.wbuf}t, {ch * 32});")
    k.end()
    k.block(f"for (int64_t n0 = {lo}; n0 < {hi}; n0 += {tile})")
    k.emit(f"const int64_t nt = std::min<int64_t>({tile}, {hi} - n0);")
    _e4m3_one_row(k, g)
    k.emit("uint32_t bad = 0;  // a packed inf/NaN: fold element by element over counted elements only")
    k.block(f"for (int64_t ix_{n} = n0; ix_{n} < n0 + nt; ++ix_{n})")
    k.emit(f"float* dst = {g.pack} + (ix_{n} - n0) * {ch};")
    _prefetch_rows(k, g)
    w = _e4m3_weight(k, g)
    if w is not None:
        k.block(f"if (st_{w}[1] == 1)")
        k.emit("// an e4m3 weight row contiguous along the chunk: decoded by vectors (rf::e4m3_to_floats)")
        k.emit(f"bad |= rf::e4m3_to_floats(reinterpret_cast<const uint8_t*>(t_{w} + ix_{n} * st_{w}[0] + c0), cn, dst) "
               "? 1u : 0u;")
        k.emit("continue;")
        k.end()
    k.block("for (int64_t jj = 0; jj < cn; ++jj)")
    k.emit(f"const int64_t ix_{ir.over} = c0 + jj;")
    k.emit(f"const float v = {k.pr.flt(g.inner)};")
    k.emit("dst[jj] = v;")
    k.emit("bad |= rf::is_finite_bits(v) ? 0u : 1u;")
    k.end()
    k.end()
    acc, wts = f"bst_{g.name} + r0 * szf + n0, szf, true);", f"b{g.wbuf} + r0 * {ch}, {ch}"
    lines = [f"if ({tc}) {{",
             f"  // a long run: acc^T = tile x weights^T on the register-blocked tile, the tile's rows of {n} as they",
             "  // are, the sums added to acc transposed (the NT tile's lane sums cost more at many rows, and",
             "  // transposing each tile into panels cost a shuffle per element); also a run of 16 or 32 rows, which",
             "  // fills the tile's columns (the quantised GEMM at 1 thread, Xeon: NT faster at 12 and 20 rows,",
             "  // the transposed tile at 16)",
             f"  rf::gemm_tile_panels_tc(nt, r1 - r0, cn, {g.pack}, {ch}, {g.wbuf}t, {ch * 32}, {acc}",
             "} else {",
             f"  rf::gemm_tile_nt(r1 - r0, nt, cn, {wts}, {g.pack}, {ch}, {acc}",
             "}"]
    if pairs:
        half = ch // 2
        lines = ["if (pairs) {",
                 (f"  // bf16 pairs: the decoded rows as words of two elements (exact: bf16 values), transposed to "
                 f"[element / 2][{n}]"),
                 f"  rf::pairs_from_floats(nt, cn, {g.pack}, {ch}, {g.pack}w_v.data(), {half});",
                 f"  rf::pack_transposed(nt, (cn + 1) / 2, {g.pack}_wr, {g.pack}ht, {tile});",
                 (f"  rf::gemm_tile_bf16(r1 - r0, nt, (cn + 1) / 2, {g.wbuf}h + r0 * {half}, {half}, "
                 f"reinterpret_cast<const uint32_t*>({g.pack}ht), {tile}, {acc}"),
                 "} else " + lines[0], *lines[1:]]
    _tile_or_counted(k, g, lines, f"{g.pack}[x * {ch} + jj]")
    k.end()
    k.end()
    k.end()
    k.end()
    k.end()


def block_dispatch(call: str, cols: str | None = None, folds_only: bool = False) -> str:
    """run_cpu's body for a block kernel: blocks of up to RBLK rows, two blocks per thread where there are several
    threads (the second evens out uneven blocks: causal rows), but one per thread where two would be under
    SHARE_ROWS rows: every block packs (or decodes) the streamed operand once, so halving small blocks doubles that
    work (a quantised GEMM at 16 rows; at one thread, 128 rows decoded the fp8 weight twice for no balance).
    With `cols` (the extent of the split_axis index), fewer blocks than threads share out their columns, at least
    COLS_MIN per task: ncol tasks per block. `folds_only` (a kernel whose only tiles are folds over those columns:
    a task of a column range repeats only the rows' scalar states, not a contraction): blocks of up to RBLK rows
    whatever the threads, which then share out columns (each weight element decoded once, not once per block)."""
    whole = folds_only and cols is not None  # blocks of RBLK rows: no two-per-thread split to work out
    rows = f"std::min<int64_t>({RBLK}, A.rows)" if whole else (
        f"std::min<int64_t>({RBLK}, half >= {SHARE_ROWS} ? half : (A.rows + nthr - 1) / nthr)")
    head = ("(void)grain; const int64_t nthr = std::max<int64_t>(1, static_cast<int64_t>(torch::stable::get_num_threads())); "
            + ("" if whole else "const int64_t half = nthr == 1 ? A.rows : (A.rows + 2 * nthr - 1) / (2 * nthr); ")
            + f"const int64_t rb_n = std::max<int64_t>(1, {rows}); "
            "const int64_t nblk = (A.rows + rb_n - 1) / rb_n; ")
    if cols is None:
        return head + f"redfuser::parallel_rows(nblk, 1, [&](int64_t b, int64_t e) {{ {call}(A, b, e, rb_n); }});"
    return head + ("const int64_t ncol = nblk == 0 || nblk >= nthr ? 1 : std::max<int64_t>(1, std::min<int64_t>("
                   f"(nthr + nblk - 1) / nblk, ({cols}) / {COLS_MIN})); "
                   f"redfuser::parallel_rows(nblk * ncol, 1, [&](int64_t b, int64_t e) {{ {call}(A, b, e, rb_n, ncol); }});")
