"""Paged decode-attention (MLA-class) template: derived math in, TileLang source out.

The template owns the *schedule* of attention over a paged cache in which V is a prefix of the cached
key row; the *math* (score, row states, guards, weight, corrections, output, log-sum-exp, merge of
segments) comes from the symbolic engine as the same :class:`~.stream_attention.AttentionMath` the
streaming template takes, and the per-tile online update is emitted by the same code
(``stream_attention.emit_online_update``).  What the bridge adds by role (:class:`PagedRoles`): the
mask limit of a row (text over the row's length and coordinates), the layout of the packed rows and the
log-sum-exp layout.

Data layout (all dense; the launcher makes them so)
----------------------------------------------------
* ``Q (batch, n_rows, DK)``: the query rows of one sequence, packed: row ``r = a * heads + h`` where
  ``a`` is the outer row coordinate (``n_a = n_rows / heads`` of them) and ``h`` the inner one.
* ``KV (n_blocks, PAGE, DK)``: the cache, pages of ``PAGE`` rows; V is its first ``DV`` channels.
* ``BT (batch, max_blocks)`` int32: page of each ``PAGE``-row block of a sequence.
* ``LENS (batch,)`` int32: keys of each sequence.
* ``O (batch, n_rows, DV)``, i.e. (batch, n_a, heads, DV); ``LSE (batch, n_rows)`` float32 in (h, a) order
  (at ``h * n_a + a``), i.e. (batch, heads, n_a).  Split-KV: ``Opart (NS, batch, n_rows, DV)`` and ``Spart
  (n_states, NS, batch, n_rows)`` float32 with the same orders, which is the streaming template's partial
  layout, so its combine program (the engine's merge form) merges them.

Schedule
--------
One CTA per (``block_m`` packed rows, sequence[, segment]): all heads of a sequence share every cache
tile, which is loaded once per CTA (``Hq x Sq <= block_m``: once per sequence).  The contraction is split
at ``DV`` into two GEMMs (``Q[:, :DV] K[:, :DV]^T + Q[:, DV:] K[:, DV:]^T``) so that P@V reads the same
shared tile ``KV_shared`` as the first GEMM: V is never loaded twice.  Tiles of ``block_n`` keys
(``PAGE % block_n == 0``) are gathered through ``BT``: tile ``kt`` is rows ``(kt % (PAGE/block_n)) *
block_n`` of page ``BT[b, kt * block_n / PAGE]``.

Guards on untrusted data: the length is clamped to ``[0, PAGE * max_blocks]``; the table entry index to
``[0, max_blocks)``; a page index outside ``[0, n_blocks)`` is clamped into it, so no load leaves the
cache (such a row attends over the clamped page's rows: defined, finite for a finite cache, and
meaningless -- the spec requires in-use entries in ``[0, NB)``).  Entries past the length are never read.
Every tile is masked with the row's limit (``mask_limit``, from the IR's mask; it never exceeds the
length), and V rows at or past the length are zeroed in shared memory before P@V (a garbage NaN there
would otherwise make ``0 * NaN``).  The loop runs at least one tile: an empty sequence or segment
processes a fully masked tile, so the states stay neutral (out 0, lse -inf from the engine's forms).

Split-KV: the number of segments ``NS`` is a launch size chosen on the host from host-known sizes only
(batch, rows, the table width); each CTA derives its tile range from the length it reads on the device,
so a CUDA graph captured once replays correctly with new lengths.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from ...families import family
from . import stream_attention as sa

TEMPLATE_VERSION = "paged_attention/1"
# split-KV plan (host-known sizes only): at least this many keys per segment, at most this many segments
SPLIT_MIN_KEYS = 256
SPLIT_MAX_SEGMENTS = 64

# the families this template lowers for -> the arch TileLang targets (generator/families.py)
FAMILIES = {f: family(f).lower_arch for f in ("sm80", "sm90a", "sm100a")}
DTYPES = sa.DTYPES


@dataclass(frozen=True)
class PagedRoles:
    """What the bridge found by role, as template text.

    ``mask_limit`` is row-context text over ``kv_len`` (the sequence's length), ``row_a`` / ``row_h`` (the
    row's outer / inner packed coordinate), ``n_a`` / ``heads`` (their extents) and the math params: a key
    ``j`` is seen by the row iff ``j < mask_limit``; it must never exceed ``kv_len``.  A spec whose
    specialisations differ only in the mask (causal or not) gives one kernel: ``mask_limit`` then selects on
    ``mask_flag`` once per row, which costs nothing in the key loop and halves the variants."""

    mask_limit: str
    flag: bool  # the limit reads ``mask_flag`` (a 0/1 kernel argument: the spec's flag, e.g. causal)
    dim_k: int  # contraction width of the score (the cached row)
    page: int  # rows per cache page


@dataclass(frozen=True)
class PagedConfig:
    family: str
    dtype: str
    dim_v: int
    block_m: int
    block_n: int
    threads: int
    num_stages: int
    split_kv: bool = False
    # warp-specialized (TMA) families: registers of the producer warpgroup after setmaxnreg.dec and of the
    # consumers after setmaxnreg.inc; 0 keeps TileLang's 24 / 240
    producer_regs: int = 0
    consumer_regs: int = 0

    @property
    def arch(self) -> str:
        return FAMILIES[self.family]

    def variant_name(self, op: str) -> str:
        dt = {"float16": "fp16", "bfloat16": "bf16"}[self.dtype]
        split = "_splitkv" if self.split_kv else ""
        return f"{op}__{dt}_v{self.dim_v}{split}__{self.family}"

    def combine_variant_name(self, op: str) -> str:
        dt = {"float16": "fp16", "bfloat16": "bf16"}[self.dtype]
        return f"{op}_combine__{dt}_v{self.dim_v}__{self.family}"


# (block_m, block_n, threads, num_stages) per family.  sm90a: 64 packed rows (WGMMA needs 64-row tiles:
# Hq = 16 is padded to 64 rows rather than falling back to HMMA), two cache tiles in flight.  sm80: one
# source serves sm_80/86/89, so Q (16 x DK) + one page (64 x DK) must fit sm_86/89's 99 KB; four warps that
# each hold all 16 rows (one m16 MMA tile) keep the row layouts of S and O alike; one stage (TileLang 0.1.15
# fails to pipeline cp.async with a dynamic extent), run as a plain loop (see emit_paged_program).
_TILES = {
    "sm90a": (64, 64, 256, 2),
    "sm100a": (64, 64, 256, 2),
    "sm80": (16, 64, 128, 1),
}


def default_config(family: str, dtype: str, dim_v: int, split_kv: bool = False) -> PagedConfig:
    if family not in FAMILIES:
        raise ValueError(f"unknown arch family {family!r}; expected one of {sorted(FAMILIES)}")
    if dtype not in DTYPES:
        raise ValueError(f"unsupported dtype {dtype!r}; expected one of {sorted(DTYPES)}")
    bm, bn, threads, stages = _TILES[family]
    cfg = PagedConfig(family, dtype, dim_v, bm, bn, threads, stages, split_kv)
    if split_kv and family != "sm80":
        # the segment bounds push the producer's page-gather loop past 24 registers (5 spills seen at 24)
        cfg = dataclasses.replace(cfg, producer_regs=40, consumer_regs=232)
    return cfg


def shared_bytes(cfg: PagedConfig, roles: PagedRoles) -> int:
    """Shared memory of the main kernel's tiles (Q once, the cache tile per stage, P)."""
    esize = 2
    return esize * (roles.dim_k * (cfg.block_m + cfg.block_n * max(cfg.num_stages, 1)) + cfg.block_m * cfg.block_n)


# --------------------------------------------------------------------------------------------
# Emission
# --------------------------------------------------------------------------------------------

_HEADER = '''\
# Generated by redfuser-ops {version} from {source}; do not edit.
# variant: {variant}
# math: {math_digest}
# schedule: family={family} arch={arch} dtype={dtype} DK={DK} DV={DV} page={page}
#           block_m={bm} block_n={bn} threads={threads} num_stages={stages} split_kv={split}
import tilelang.language as T

VARIANT = {variant!r}
TARGET_ARCH = {arch!r}
KERNEL_SYMBOL = {symbol!r}
PARAMS = {params!r}  # float32 scalar kernel arguments after the tensors, in this order
PASS_CONFIGS = {{'tl.enable_fast_math': True}}
'''


def _check(math: sa.AttentionMath, cfg: PagedConfig, roles: PagedRoles) -> None:
    if roles.page % cfg.block_n or cfg.block_n % 16 or cfg.block_m % 16:
        raise ValueError(f"block_n {cfg.block_n} must divide the page {roles.page}; tiles must be multiples of 16")
    if not 0 < cfg.dim_v < roles.dim_k or cfg.dim_v % 16 or (roles.dim_k - cfg.dim_v) % 16:
        raise ValueError(f"V width {cfg.dim_v} must be a multiple of 16 below the row width {roles.dim_k}")
    names = sa._names(roles.mask_limit) - set(LIMIT_NAMES) - set(math.params)
    if names:
        raise ValueError(f"mask limit {roles.mask_limit!r}: unknown names {sorted(names)}")


LIMIT_NAMES = ("kv_len", "row_a", "row_h", "n_a", "heads", "mask_flag")


def call_int_args(cfg: PagedConfig, roles: PagedRoles) -> tuple[str, ...]:
    """int32 arguments of the launcher after the float params: ``heads`` [and ``mask_flag``], then the dynamic
    dims in order of first appearance."""
    dims = ("batch", "n_rows", "n_blocks", "max_blocks") + (("num_splits",) if cfg.split_kv else ())
    return ("heads",) + (("mask_flag",) if roles.flag else ()) + dims


def emit_paged_program(math: sa.AttentionMath, roles: PagedRoles, cfg: PagedConfig, symbol: str) -> str:
    """TileLang source of the main kernel.  Arguments: Q, KV, BT, LENS, O|Opart, LSE|Spart, *params, heads."""
    _check(math, cfg, roles)
    plan = sa._plan(math)
    BM, BN, DK, DV, PAGE = cfg.block_m, cfg.block_n, roles.dim_k, cfg.dim_v, roles.page
    DR = DK - DV
    nst = len(plan.state_names)
    src = sa._Src()
    src(0, _HEADER.format(version=TEMPLATE_VERSION, source="generator/codegen/templates/paged_attention.py",
                          variant=symbol, math_digest=sa._math_digest(math), family=cfg.family, arch=cfg.arch,
                          dtype=cfg.dtype, DK=DK, DV=DV, page=PAGE, bm=BM, bn=BN,
                          threads=cfg.threads, stages=cfg.num_stages, split=cfg.split_kv, symbol=symbol,
                          params=tuple(math.params)))
    src(0, f"CALL_INT_ARGS = {call_int_args(cfg, roles)!r}")
    if cfg.split_kv:
        src(0, f"STATE_ORDER = {tuple(plan.state_names)!r}  # first axis of Spart")
    src(0, "")
    src(0, "")
    src(0, "def make_prim_func():")
    src(1, f"dtype = {DTYPES[cfg.dtype]}")
    src(1, "accum_dtype = T.float32")
    dims = call_int_args(cfg, roles)[2 if roles.flag else 1:]
    src(1, f"{', '.join(dims)} = T.dynamic({', '.join(dims)!r})")
    src(0, "")
    src(1, "@T.prim_func")
    src(1, f"def {symbol}(")
    src(2, f"Q: T.Tensor((batch, n_rows, {DK}), dtype),")
    src(2, f"KV: T.Tensor((n_blocks, {PAGE}, {DK}), dtype),")
    src(2, "BT: T.Tensor((batch, max_blocks), T.int32),")
    src(2, "LENS: T.Tensor((batch,), T.int32),")
    if cfg.split_kv:
        src(2, f"Opart: T.Tensor((num_splits, batch, n_rows, {DV}), accum_dtype),")
        src(2, f"Spart: T.Tensor(({nst}, num_splits, batch, n_rows), accum_dtype),")
    else:
        src(2, f"O: T.Tensor((batch, n_rows, {DV}), dtype),")
        src(2, "LSE: T.Tensor((batch, n_rows), accum_dtype),")
    for p in math.params:
        src(2, f"{p}: T.float32,")
    src(2, "heads: T.int32,")
    if roles.flag:
        src(2, "mask_flag: T.int32,")
    src(1, "):")
    n_rb = f"T.ceildiv(n_rows, {BM})"
    grid = f"{n_rb} * num_splits" if cfg.split_kv else n_rb
    src(2, f"with T.Kernel({grid}, batch, threads={cfg.threads}) as (bx, by):")
    b = 3
    src(b, "T.assume(batch > 0 and n_rows > 0 and n_blocks > 0 and max_blocks > 0 and heads > 0)")
    src(b, "T.assume(n_rows % heads == 0)")
    if cfg.split_kv:
        src(b, "T.assume(num_splits > 0)")
    if cfg.producer_regs:
        src(b, f"T.annotate_producer_reg_dealloc({cfg.producer_regs})")
    if cfg.consumer_regs:
        src(b, f"T.annotate_consumer_reg_alloc({cfg.consumer_regs})")
    src(b, f"Q_shared = T.alloc_shared(({BM}, {DV}), dtype)")
    src(b, f"QR_shared = T.alloc_shared(({BM}, {DR}), dtype)")
    src(b, f"KV_shared = T.alloc_shared(({BN}, {DV}), dtype)")
    src(b, f"KR_shared = T.alloc_shared(({BN}, {DR}), dtype)")
    src(b, f"acc_s = T.alloc_fragment(({BM}, {BN}), accum_dtype)")
    src(b, f"acc_p = T.alloc_fragment(({BM}, {BN}), dtype)")
    src(b, f"P_shared = T.alloc_shared(({BM}, {BN}), dtype)")
    src(b, f"acc_o = T.alloc_fragment(({BM}, {DV}), accum_dtype)")
    if plan.uses_scratch:
        src(b, f"acc_t = T.alloc_fragment(({BM}, {BN}), accum_dtype)")
    sa.emit_row_fragments(src, b, plan, BM)
    src(b, f"lim = T.alloc_fragment(({BM},), T.int32)")
    src(b, "")
    if cfg.split_kv:
        src(b, "split = T.truncmod(bx, num_splits)")
        src(b, f"r0 = T.truncdiv(bx, num_splits) * {BM}")
    else:
        src(b, f"r0 = bx * {BM}")
    src(b, "n_a = T.truncdiv(n_rows, heads)")
    # an untrusted length never walks past the table
    src(b, f"kv_len = T.min(T.max(LENS[by], 0), max_blocks * {PAGE})")
    src(b, f"n_tiles = T.ceildiv(kv_len, {BN})")
    if cfg.split_kv:
        src(b, "per_split = T.truncdiv(n_tiles + num_splits - 1, num_splits)")
        src(b, "t_begin = T.min(split * per_split, n_tiles)")
        src(b, "t_end = T.min(t_begin + per_split, n_tiles)")
    else:
        src(b, "t_begin = 0")
        src(b, "t_end = n_tiles")
    src(b, "t_stop = T.max(t_end, t_begin + 1)  # never zero iterations: an empty range runs one masked tile")
    src(b, "")
    src(b, f"T.copy(Q[by, r0:r0 + {BM}, 0:{DV}], Q_shared)")
    src(b, f"T.copy(Q[by, r0:r0 + {BM}, {DV}:{DK}], QR_shared)")
    src(b, "T.fill(acc_o, 0)")
    sa.emit_row_init(src, b, plan, BM)
    pmap = {p: p for p in math.params}
    lmap = {**pmap, "kv_len": "kv_len", "n_a": "n_a", "heads": "heads", "mask_flag": "mask_flag",
            "row_a": "T.truncdiv(r0 + i, heads)", "row_h": "T.truncmod(r0 + i, heads)"}
    src(b, f"for i in T.Parallel({BM}):")
    src(b + 1, f"lim[i] = T.min({sa.render(roles.mask_limit, lmap, 'mask limit')}, kv_len)")
    src(b, "")

    body = sa._Src()

    def stmt(_role: str, text: str) -> None:
        body(0, text)

    per_page = PAGE // BN
    blk = "kt" if per_page == 1 else f"T.truncdiv(kt, {per_page})"
    off = "0" if per_page == 1 else f"T.truncmod(kt, {per_page}) * {BN}"
    span = f"0:{BN}" if per_page == 1 else f"{off}:{off} + {BN}"
    stmt("load", f"page = T.min(T.max(BT[by, T.min({blk}, max_blocks - 1)], 0), n_blocks - 1)")
    stmt("load", f"T.copy(KV[page, {span}, 0:{DV}], KV_shared)")
    stmt("load", f"T.copy(KV[page, {span}, {DV}:{DK}], KR_shared)")
    # FullCol: the warpgroups split the key columns of S and the V columns of O (a 64-row WGMMA each);
    # P reaches P@V through shared memory (the fragment layouts of S and of a register A operand differ)
    pol = "policy=T.GemmWarpPolicy.FullCol"
    stmt("gemm", f"T.gemm(Q_shared, KV_shared, acc_s, transpose_B=True, clear_accum=True, {pol})")
    stmt("gemm", f"T.gemm(QR_shared, KR_shared, acc_s, transpose_B=True, {pol})")
    score = sa.render(math.score, {**pmap, "acc_s": "acc_s[i, j]"}, "score")
    mask_value = sa.render(math.mask_value, pmap, "mask_value")
    stmt("mask", f"for i, j in T.Parallel({BM}, {BN}):\n"
                 f"    acc_s[i, j] = T.if_then_else(kt * {BN} + j < lim[i], {score}, {mask_value})")
    sa.emit_online_update(plan, BM, BN, stmt)
    # V rows at or past the length: zero (P is 0 there, but 0 * NaN garbage is NaN)
    stmt("mask_v", f"if (kt + 1) * {BN} > kv_len:\n"
                   f"    for r, c in T.Parallel({BN}, {DV}):\n"
                   f"        if kt * {BN} + r >= kv_len:\n"
                   f"            KV_shared[r, c] = T.cast(0, dtype)")
    stmt("rescale", f"for i, d in T.Parallel({BM}, {DV}):\n    acc_o[i, d] *= acc_scale[i]")
    stmt("gemm", "T.copy(acc_p, P_shared)")
    stmt("gemm", f"T.gemm(P_shared, KV_shared, acc_o, {pol})")
    if cfg.num_stages > 1:
        src(b, f"for kt in T.Pipelined(t_begin, t_stop, num_stages={cfg.num_stages}):")
    else:  # one stage: a plain loop (TileLang's pipeline planner refuses the V-row zeroing as a second writer)
        src(b, "for kt in T.serial(t_begin, t_stop):")
    for ln in body.lines:
        src(b + 1, ln)
    src(b, "")
    lse_at = "T.truncmod(r0 + i, heads) * n_a + T.truncdiv(r0 + i, heads)"  # (h, a) order
    if cfg.split_kv:
        src(b, f"T.copy(acc_o, Opart[split, by, r0:r0 + {BM}, :])")
        src(b, f"for i in T.Parallel({BM}):")
        src(b + 1, "if r0 + i < n_rows:")
        for k, name in enumerate(plan.state_names):
            src(b + 2, f"Spart[{k}, split, by, {lse_at}] = {sa._frag(name)}[i]")
    else:
        omap = {**sa._final_mapping(plan), "o": "acc_o[i, d]"}
        src(b, f"for i, d in T.Parallel({BM}, {DV}):")
        src(b + 1, f"acc_o[i, d] = {sa.render(math.out, omap, 'out')}")
        src(b, f"T.copy(acc_o, O[by, r0:r0 + {BM}, :])")
        src(b, f"for i in T.Parallel({BM}):")
        src(b + 1, "if r0 + i < n_rows:")
        src(b + 2, f"LSE[by, {lse_at}] = {sa.render(math.lse, sa._final_mapping(plan), 'lse')}")
    src(0, "")
    src(1, f"return {symbol}")
    return src.text()


def combine_config(cfg: PagedConfig) -> sa.AttentionConfig:
    """The split-KV partials are laid out as the streaming template's (Opart (NS, B, Sq, H, DV) and Spart
    (n_states, NS, B, H, Sq) once ``n_rows = Sq * H`` is unpacked), so its combine program merges them."""
    return sa.AttentionConfig(cfg.family, cfg.dtype, cfg.dim_v, False, 0, 0, 0, 0, split_kv=True)


def emit_combine_program(math: sa.AttentionMath, cfg: PagedConfig, symbol: str) -> str:
    """The streaming template's combine (the engine's merge form) over this template's partials.  Launcher
    ints: num_splits, batch, seqlen_q (the outer packed extent), heads."""
    return sa.emit_combine_program(math, combine_config(cfg), symbol)


# --------------------------------------------------------------------------------------------
# Split plan (host-known sizes only) and the same rule in C++
# --------------------------------------------------------------------------------------------


def choose_num_splits(batch: int, n_rows: int, max_keys: int, block_m: int, block_n: int, num_sms: int,
                      min_chunk: int, max_splits: int) -> int:
    """Segments per sequence from sizes the host knows without reading device memory: the table's capacity
    ``max_keys`` stands for the length (the device clips each segment to the real length)."""
    return sa.choose_num_splits(batch, 1, n_rows, max_keys, block_m, block_n, num_sms, max_splits=max_splits,
                                min_tiles_per_split=max(1, min_chunk // block_n))


# --------------------------------------------------------------------------------------------
# CPU simulation of the schedule (numpy): the same tiles, gather, masks, online update and merge
# --------------------------------------------------------------------------------------------


def simulate(math: sa.AttentionMath, roles: PagedRoles, cfg: PagedConfig, q, kv, block_table, lens,
             params: dict[str, float], heads: int, num_splits: int = 1, p_dtype=None, mask_flag: int = 0):
    """Run the emitted schedule on numpy arrays; returns (O (batch, n_rows, DV), LSE (batch, n_rows)).

    q (batch, n_rows, DK), kv (n_blocks, PAGE, DK), block_table (batch, max_blocks), lens (batch,).  Mirrors
    the program: row blocks of ``block_m``, the clamped length and page indices, tiles of ``block_n``
    gathered through the table, the row limit, the online update (the streaming template's own numpy
    version), V rows past the length zeroed, P cast to ``p_dtype``, segments and the merge form."""
    import numpy as np

    with np.errstate(all="ignore"):
        return _simulate(math, roles, cfg, q, kv, block_table, lens, params, heads, num_splits, p_dtype, mask_flag,
                         np)


def _simulate(math, roles, cfg, q, kv, bt, lens, params, heads, num_splits, p_dtype, mask_flag, np):
    plan = sa._plan(math)
    f32 = np.float32
    nT = sa._NpT(np)
    B, n_rows, DK = q.shape
    n_blocks, PAGE, _ = kv.shape
    max_blocks = bt.shape[1]
    BM, BN, DV = cfg.block_m, cfg.block_n, cfg.dim_v
    n_a = n_rows // heads
    base = {"T": nT, "accum_dtype": f32, **{p: f32(v) for p, v in params.items()}}

    def ev(expr, env):
        return np.asarray(eval(compile(expr, "<math>", "eval"), {"__builtins__": {}}, {**base, **env}), f32)

    out = np.zeros((B, n_rows, DV), f32)
    lse = np.zeros((B, n_rows), f32)
    opart = np.zeros((num_splits, B, n_rows, DV), f32)
    spart = np.zeros((len(plan.state_names), num_splits, B, n_rows), f32)
    rows_all = np.arange(n_rows)
    lse_at = (rows_all % heads) * n_a + rows_all // heads
    for by in range(B):
        kv_len = min(max(int(lens[by]), 0), max_blocks * PAGE)
        n_tiles = -(-kv_len // BN)
        per = -(-n_tiles // num_splits)
        for r0 in range(0, n_rows, BM):
            r = np.arange(r0, r0 + BM)
            valid = r < n_rows
            qt = np.zeros((BM, DK), f32)
            qt[valid] = q[by, r[valid]].astype(f32)
            env_l = {"kv_len": kv_len, "n_a": n_a, "heads": heads, "row_a": r // heads, "row_h": r % heads,
                     "mask_flag": mask_flag}
            lim = np.minimum(np.broadcast_to(ev(roles.mask_limit, env_l), (BM,)), kv_len)
            for split in range(num_splits):
                t_begin = min(split * per, n_tiles)
                t_end = min(t_begin + per, n_tiles)
                st = {s.name: np.broadcast_to(ev(s.init, {}), (BM,)).astype(f32).copy() for s in math.states}
                guards = {}
                for g in math.guards:
                    guards[g.name] = ev(g.expr, {**st, **{n + "_new": v for n, v in st.items()}})
                acc_o = np.zeros((BM, DV), f32)
                for kt in range(t_begin, max(t_end, t_begin + 1)):
                    blk = min((kt * BN) // PAGE, max_blocks - 1)
                    page = min(max(int(bt[by, blk]), 0), n_blocks - 1)
                    off = (kt % (PAGE // BN)) * BN
                    tile = kv[page, off:off + BN].astype(f32)
                    # einsum, not BLAS: no thread pool (a contended one made this 50x slower on 2 cores)
                    raw = np.einsum("ic,jc->ij", qt[:, :DV], tile[:, :DV]) + np.einsum("ic,jc->ij", qt[:, DV:], tile[:, DV:])
                    cols = kt * BN + np.arange(BN)
                    s = np.where(cols[None, :] < lim[:, None], ev(math.score, {"acc_s": raw}), ev(math.mask_value, {}))
                    p, scale = sa.simulate_online_update(math, plan, st, guards, s, ev, p_dtype, np)
                    v = np.where((cols < kv_len)[:, None], tile[:, :DV], f32(0))
                    acc_o = (acc_o * scale[:, None] + np.einsum("ij,jd->id", p, v)).astype(f32)
                if num_splits == 1:
                    env = {n: val[:, None] for n, val in {**st, **guards}.items()}
                    o_fin = np.broadcast_to(ev(math.out, {**env, "o": acc_o}), acc_o.shape)
                    out[by, r[valid]] = o_fin[valid]
                    lse[by, lse_at[r[valid]]] = np.broadcast_to(ev(math.lse, {**st, **guards}), (BM,))[valid]
                else:
                    opart[split, by, r[valid]] = acc_o[valid]
                    for k, name in enumerate(plan.state_names):
                        spart[k, split, by, lse_at[r[valid]]] = st[name][valid]
    if num_splits == 1:
        return out, lse
    # the merge: the streaming template's combine, on the partials unpacked to (.., Sq, H, DV) / (.., H, Sq)
    o_m, l_m = sa._simulate_merge(math, plan, opart.reshape(num_splits, B, n_a, heads, DV),
                                  spart.reshape(-1, num_splits, B, heads, n_a), f32, base, np)
    return o_m.reshape(B, n_rows, DV), l_m.reshape(B, n_rows)


def replace(cfg: PagedConfig, **kw) -> PagedConfig:
    return dataclasses.replace(cfg, **kw)
