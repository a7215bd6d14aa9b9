"""Streaming (FlashAttention-class) forward template: derived math in, TileLang source out.

The template owns the *schedule* (tiles, loads, GEMMs, masking, tails, split-KV, pipelining) and
none of the *math*: every per-element and per-row formula (score, per-row reduction states, guards,
the weight of the V-weighted sum, corrections, the final output, the log-sum-exp and the merge of
partial states) comes in as expression text inside an :class:`AttentionMath`, produced by the
symbolic engine.  The template only renames the identifiers of those expressions onto its buffers.

Expression language (what the engine emits, what this module renders)
----------------------------------------------------------------------
Python expression text over ``T.<intrinsic>(...)`` (TileLang's names: ``T.exp``, ``T.exp2``,
``T.log``, ``T.log2``, ``T.max``, ``T.min``, ``T.abs``, ``T.if_then_else``, ``T.infinity``,
``T.float32``), ``accum_dtype``, numeric literals, comparison/arithmetic operators and the names
below.  Every other name is an error (caught at emit time, naming the offending expression).

* element context (one score element of the current K/V tile):
  ``s`` (the scaled, masked score), the row names.
* row context (one query row), inside the loop:
  ``<x>_old`` value of state ``x`` before this tile, ``<x>_new`` (or ``<x>``) after this tile's
  update (only for states updated earlier in ``states``, or ``x`` itself in its own correction),
  guard names ``<g>`` (computed from ``_new`` values) and *old guards*: a name ``<x>_old_<suffix>``
  where ``<x>_<suffix>`` is a guard evaluates that guard's expression on ``_old`` values;
  scalar kernel parameters (``AttentionMath.params``, e.g. ``softmax_scale``).
* output context (one (row, d) element after the last tile): ``o`` (the V-weighted accumulator),
  final state names ``<x>``, guards, params.
* merge context (split-KV combine): ``<x>_seg`` is segment p's partial value of state ``x``,
  ``o_seg`` segment p's accumulator element, ``<x>`` the merged value of an earlier state in
  ``merge.states`` (or ``<x>_new``), merged guards.

Generated program (one per variant)
-----------------------------------
A ``.py`` module holding ``make_prim_func()``, which returns an ``@T.prim_func`` with
    Q (B, Sq, H, D) strided, K/V (B, Sk, Hk, D) strided (last dim contiguous), O (B, Sq, H, D)
    contiguous, LSE (B, H, Sq) float32, then the float32 params;
split-KV: O/LSE are replaced by ``Opart (NS, B, Sq, H, D)`` and ``Spart (n_states, NS, B, H, Sq)``
float32 workspaces, and a separate combine program reads them.  B, Sq, Sk, H, Hk, NS and all
strides are int32 values known only at run time.  See ``emit_attention_program``.

Launcher contract (TLWrapper's ``call``, or ``cuda_lower.lower_to_cuda``'s ``<symbol>_call``)
------------------------------------------------------------------------------------------------
``call(Q, K, V, O|Opart, LSE|Spart, *params, *CALL_INT_ARGS, stream)``; the generated module
names ``CALL_INT_ARGS`` (batch, seqlen_q, heads, seqlen_k, heads_kv, [num_splits], q_sb, q_ss,
q_sh, k_sb, k_ss, k_sh, v_sb, v_ss, v_sh) and ``STRIDE_UNIT``: q/k/v strides (batch, seq, head)
are passed in elements (TMA families) or in units of 8 elements (sm80).  The caller checks:
last dim contiguous; every other stride a multiple of 8 elements (16 bytes) and >= 0 and < 2**31;
data pointers 16-byte aligned; all sizes >= 1 and < 2**31; H % Hk == 0.  Anything else (a
broadcast stride-0 input, odd strides) is made contiguous by the caller first.  O is contiguous.
Kernel-side addressing is 64-bit, so tensors may exceed 2**31 elements.

Why strides are arguments: on sm90a/sm100a the strides go into the TMA descriptors that the
launcher builds per call (TileLang's ``T.StridedTensor`` with dynamic strides lowers to
``cuTensorMapEncodeTiled`` with ``(int64_t)stride * 2`` byte strides), so q/k/v slices of a
packed projection or BHSD-transposed views are read in place.  On sm80 (cp.async) TileLang
cannot prove 16-byte alignment of a dynamic element stride (``T.assume`` does not reach the
vectorizer) and falls back to 2-byte loads; strides given as ``8 * s`` make the alignment
structural and give 16-byte ``cp.async`` with zero fill.

Schedule
--------
One CTA per (q-block of ``block_m`` rows, head, batch[, segment]); causal q-blocks run in reverse
order (most keys first).  K/V tiles of ``block_n`` keys: QK^T (fp32 accumulator) -> score ->
mask (only tiles ``kt >= n_full``: key tail or causal diagonal; full tiles skip the compare) ->
per-row states in ``math.states`` order, each followed by the guards it enables -> weight P
(computed once when it equals a state's term) cast to the input dtype -> accumulator correction
-> P@V.  Causal loop bound: tiles past the last key the block's last row sees are never loaded.
The loop always runs at least one tile: a q-block that sees no key (Sq > Sk) or an empty segment
processes the fully masked tile ``kt == n_tiles`` (zero-filled or masked), so its states stay
neutral and no TMA load is left in flight.  Out-of-range K/V rows arrive as zeros (TMA OOB fill,
``cp.async`` with source size 0), so masked P = 0 never meets NaN garbage.  The epilogue applies
``out`` and ``lse`` (or stores raw partial states + o for split-KV); rows past Sq are not stored.
"""

from __future__ import annotations

import ast
import dataclasses
import math as _pymath
from dataclasses import dataclass, field

from ...families import family

TEMPLATE_VERSION = "stream_attention/1"

# --------------------------------------------------------------------------------------------
# Math as data (filled by the symbolic engine; tests write the softmax one by hand)
# --------------------------------------------------------------------------------------------

_REDUCE_OPS = ("max", "min", "sum")


@dataclass(frozen=True)
class RowState:
    """A per-row scalar reduction state over the key axis, e.g. the running max ``m``.

    Online update for one tile (``⊕`` = ``op``, ``⊗`` = ``correction_op``)::

        x_new = (x_old ⊗ correction) ⊕ (⊕_j term_j)        (correction None: x_old ⊕ ⊕_j term_j)
    """

    name: str
    op: str  # "max" | "min" | "sum"
    init: str  # neutral element, row context, e.g. "-T.infinity(accum_dtype)"
    term: str  # element context, e.g. "s" or "T.exp(s - m_safe)"
    correction: str | None = None  # row context, e.g. "T.exp(m_old - m_safe)"
    correction_op: str = "mul"  # "mul" | "add": how the correction applies to x_old


@dataclass(frozen=True)
class Guard:
    """A finite stand-in for a state value, e.g. ``m_safe`` (0 where ``m_new`` is -inf)."""

    name: str
    expr: str  # row context over ``<x>_new`` / ``<x>`` of the states it guards


@dataclass(frozen=True)
class MergeState:
    """Merge of one state over segments: ``X = ⊕_p term_p`` (``⊕`` and init from the RowState)."""

    name: str
    term: str  # merge context, e.g. "m_seg" or "l_seg * T.exp(m_seg - m_safe)"


@dataclass(frozen=True)
class MergeForm:
    """How partial (states, o) of independent key segments combine (split-KV)."""

    states: tuple[MergeState, ...]
    guards: tuple[Guard, ...]  # row context over merged values, e.g. m_safe of the merged m
    acc_term: str  # merge context: segment contribution to o, e.g. "o_seg * T.exp(m_seg - m_safe)"


@dataclass(frozen=True)
class AttentionMath:
    score: str  # element context over ``acc_s`` (the raw Q.K^T element) and params
    mask_value: str  # value of ``s`` for masked elements (makes every term neutral)
    states: tuple[RowState, ...]
    guards: tuple[Guard, ...]
    weight: str  # element context: the P of P@V
    acc_correction: str  # row context: factor applied to the o accumulator before adding P@V
    out: str  # output context: final output element
    lse: str  # row context over final states: the log-sum-exp (-inf, never NaN, for empty rows)
    merge: MergeForm
    params: tuple[str, ...] = ("softmax_scale",)  # float32 scalar kernel arguments, in order


@dataclass(frozen=True)
class KeyBand:
    """The keys query row ``r`` sees: ``lo <= j < hi`` (and always ``0 <= j < seqlen_k``).

    ``lo`` and ``hi`` are affine int32 expressions over ``r``, ``seqlen_q``, ``seqlen_k``, the int kernel
    arguments in ``params`` and the per-sequence values in ``tensors`` (``blen0`` is ``Blen0[b]``, an int32 buffer
    of one value per batch: key lengths of a padded batch) (``None``: unbounded on that side). Per K/V tile the schedule derives from them which
    tiles every row of a q-block sees completely (no compare), which it sees in part (masked compare) and which
    none of its rows sees (never loaded): the bounds of a block are the band's values at its first and last rows,
    exact for affine bounds.
    """

    name: str  # how variant names spell this mask, e.g. "causal"
    lo: str | None = None
    hi: str | None = None
    params: tuple[str, ...] = ()  # int32 kernel arguments the bounds read, after the float params
    tensors: tuple[str, ...] = ()  # per-sequence int32 values the bounds read: blen0 = Blen0[batch], ...


# bottom-right aligned causal: query r sees keys j <= r + seqlen_k - seqlen_q
CAUSAL = KeyBand("causal", hi="r + 1 + seqlen_k - seqlen_q")


# --------------------------------------------------------------------------------------------
# Schedule configuration
# --------------------------------------------------------------------------------------------

# the families this template lowers for -> the arch TileLang targets (generator/families.py)
FAMILIES = {f: family(f).lower_arch for f in ("sm80", "sm90a", "sm100a")}
DTYPES = {"float16": "T.float16", "bfloat16": "T.bfloat16"}
HEAD_DIMS = (64, 128, 256)


@dataclass(frozen=True)
class AttentionConfig:
    family: str  # "sm80" | "sm90a" | "sm100a"
    dtype: str  # "float16" | "bfloat16"
    head_dim: int
    causal: bool
    block_m: int
    block_n: int
    threads: int
    num_stages: int
    split_kv: bool = False
    # warp-specialized (TMA) families: registers per thread of the producer warpgroup after
    # setmaxnreg.dec and of the consumers after setmaxnreg.inc; 0 keeps TileLang's 24 / 240
    producer_regs: int = 0
    consumer_regs: int = 0
    combine_block_m: int = 16  # rows per CTA of the combine kernel
    combine_threads: int = 128
    extra: tuple[tuple[str, object], ...] = field(default=())
    band: KeyBand | None = None  # the mask, when it is not the causal one that ``causal`` names

    @property
    def arch(self) -> str:
        return FAMILIES[self.family]

    @property
    def key_band(self) -> KeyBand | None:
        """The keys each row sees (None: all of them)."""
        if self.band is not None:
            return self.band
        return CAUSAL if self.causal else None

    def variant_name(self, op: str = "stream_attention") -> str:
        dt = {"float16": "fp16", "bfloat16": "bf16"}[self.dtype]
        kind = self.key_band.name if self.key_band is not None else "full"
        split = "_splitkv" if self.split_kv else ""
        return f"{op}__{dt}_d{self.head_dim}_{kind}{split}__{self.family}"

    def combine_variant_name(self, op: str = "stream_attention") -> str:
        """The combine kernel does not depend on causal: one per (dtype, D, family)."""
        dt = {"float16": "fp16", "bfloat16": "bf16"}[self.dtype]
        return f"{op}_combine__{dt}_d{self.head_dim}__{self.family}"


# Tile tables: (block_m, block_n, threads, num_stages), chosen per (family, D).
# sm80: one source serves sm_80/86/89, so shared memory must fit sm_86/89's 99 KB per block, and
# num_stages must be 1 (TileLang 0.1.15 fails to pipeline cp.async with a dynamic loop extent).
_TILES = {
    ("sm80", 64): (128, 64, 256, 1),  # 128 threads needed 229-254 registers
    ("sm80", 128): (128, 64, 256, 1),
    ("sm80", 256): (64, 32, 128, 1),  # 64x64 needs 255 registers and spilled (split)
    ("sm90a", 64): (128, 128, 256, 2),
    ("sm90a", 128): (128, 128, 256, 2),
    ("sm90a", 256): (128, 64, 256, 2),
    ("sm100a", 64): (128, 128, 256, 2),
    ("sm100a", 128): (128, 128, 256, 2),
    ("sm100a", 256): (128, 64, 256, 2),
}


def default_config(family: str, dtype: str, head_dim: int, causal: bool, split_kv: bool = False,
                   band: KeyBand | None = None) -> AttentionConfig:
    if family not in FAMILIES:
        raise ValueError(f"unknown arch family {family!r}; expected one of {sorted(FAMILIES)}")
    if dtype not in DTYPES:
        raise ValueError(f"unsupported dtype {dtype!r}; expected one of {sorted(DTYPES)}")
    if head_dim not in HEAD_DIMS:
        raise ValueError(f"unsupported head_dim {head_dim}; expected one of {HEAD_DIMS}")
    bm, bn, threads, stages = _TILES[(family, head_dim)]
    cfg = AttentionConfig(family, dtype, head_dim, causal, bm, bn, threads, stages, split_kv, band=band)
    if (split_kv or (cfg.key_band is not None and cfg.key_band.lo is not None)) and uses_tma(cfg):
        # the segment bounds, or a band's lower bound, push the producer's TMA loop past 24 registers (5 spills seen)
        cfg = dataclasses.replace(cfg, producer_regs=40, consumer_regs=232)
    return cfg


# --------------------------------------------------------------------------------------------
# Split-KV heuristic (pure integer arithmetic: portable to the C++ launcher as is)
# --------------------------------------------------------------------------------------------


def choose_num_splits(
    batch: int,
    heads: int,
    seqlen_q: int,
    seqlen_k: int,
    block_m: int,
    block_n: int,
    num_sms: int,
    max_splits: int = 64,
    min_tiles_per_split: int = 4,
) -> int:
    """Number of key segments for one call; 1 means the single-segment kernel.

    Split only when the grid of (q-blocks x heads x batch) CTAs fills less than 80 % of one wave
    and each segment keeps at least ``min_tiles_per_split`` K/V tiles.  Among the allowed counts,
    take the smallest whose wave efficiency (CTAs / (waves * SMs)) is within 85 % of the best one.
    """
    n_ctas = ((seqlen_q + block_m - 1) // block_m) * heads * batch
    n_tiles = (seqlen_k + block_n - 1) // block_n
    if n_ctas <= 0 or n_tiles <= 0 or num_sms <= 0:
        return 1
    if n_ctas * 5 >= num_sms * 4:
        return 1
    limit = min(max_splits, n_tiles // min_tiles_per_split, 2 * num_sms)
    if limit < 2:
        return 1
    # efficiency in units of 1/1000, integer only
    effs = []
    best = 0
    for s in range(1, limit + 1):
        total = n_ctas * s
        waves = (total + num_sms - 1) // num_sms
        eff = total * 1000 // (waves * num_sms)
        effs.append(eff)
        best = max(best, eff)
    for s in range(1, limit + 1):
        if effs[s - 1] * 100 >= best * 85:
            return s
    return 1


# The same rule in C++ for the launcher (generated into the op's glue); a test checks that both agree.
NUM_SPLITS_CPP = """\
static int choose_num_splits(int64_t batch, int64_t heads, int64_t seqlen_q, int64_t seqlen_k, int64_t block_m,
                             int64_t block_n, int64_t num_sms, int64_t max_splits = 64,
                             int64_t min_tiles_per_split = 4) {
  const int64_t n_ctas = ((seqlen_q + block_m - 1) / block_m) * heads * batch;
  const int64_t n_tiles = (seqlen_k + block_n - 1) / block_n;
  if (n_ctas <= 0 || n_tiles <= 0 || num_sms <= 0) return 1;
  if (n_ctas * 5 >= num_sms * 4) return 1;
  int64_t limit = max_splits;
  if (n_tiles / min_tiles_per_split < limit) limit = n_tiles / min_tiles_per_split;
  if (2 * num_sms < limit) limit = 2 * num_sms;
  if (limit < 2) return 1;
  int64_t best = 0;
  for (int64_t s = 1; s <= limit; ++s) {
    const int64_t total = n_ctas * s, waves = (total + num_sms - 1) / num_sms;
    const int64_t eff = total * 1000 / (waves * num_sms);
    if (eff > best) best = eff;
  }
  for (int64_t s = 1; s <= limit; ++s) {
    const int64_t total = n_ctas * s, waves = (total + num_sms - 1) / num_sms;
    if ((total * 1000 / (waves * num_sms)) * 100 >= best * 85) return static_cast<int>(s);
  }
  return 1;
}
"""


# --------------------------------------------------------------------------------------------
# Expression renaming
# --------------------------------------------------------------------------------------------

_T_FUNCS = {"exp", "exp2", "log", "log2", "max", "min", "abs", "if_then_else", "infinity", "float32", "sqrt", "tanh",
            "sin", "cos"}
_FREE = {"T", "accum_dtype"}


class _Rename(ast.NodeTransformer):
    def __init__(self, mapping: dict[str, str], where: str):
        self.mapping = mapping
        self.where = where

    def visit_Attribute(self, node: ast.Attribute):
        if isinstance(node.value, ast.Name) and node.value.id == "T":
            if node.attr not in _T_FUNCS:
                raise ValueError(f"{self.where}: T.{node.attr} is not an allowed intrinsic")
            return node
        raise ValueError(f"{self.where}: attribute access {ast.unparse(node)!r} is not allowed")

    def visit_Name(self, node: ast.Name):
        if node.id in _FREE:
            return node
        if node.id not in self.mapping:
            raise ValueError(f"{self.where}: unknown name {node.id!r} (known: {sorted(self.mapping)})")
        return ast.parse(self.mapping[node.id], mode="eval").body


def _names(expr: str) -> set[str]:
    tree = ast.parse(expr, mode="eval")
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Name) and node.id not in _FREE:
            out.add(node.id)
    return out


def render(expr: str, mapping: dict[str, str], where: str) -> str:
    """Rename the names of ``expr`` through ``mapping`` (name -> TileLang text)."""
    try:
        tree = ast.parse(expr, mode="eval")
    except SyntaxError as exc:
        raise ValueError(f"{where}: cannot parse {expr!r}: {exc}") from exc
    return ast.unparse(_Rename(mapping, f"{where} ({expr!r})").visit(tree))


def _norm(expr: str) -> str:
    """Canonical text of an expression (for CSE by equality)."""
    return ast.unparse(ast.parse(expr, mode="eval"))


def _old_guard_name(guard: Guard, states: tuple[RowState, ...]) -> tuple[str, str] | None:
    """``m_safe`` guarding state ``m`` -> (``m_old_safe``, ``m``)."""
    for st in states:
        pre = st.name + "_"
        if guard.name.startswith(pre):
            return f"{st.name}_old_{guard.name[len(pre):]}", st.name
    return None


def _to_old(expr: str, states: tuple[RowState, ...]) -> str:
    """Rewrite a guard expression over ``_new`` values to the same expression over ``_old``."""
    mapping = {}
    for st in states:
        mapping[st.name] = f"{st.name}_old"
        mapping[f"{st.name}_new"] = f"{st.name}_old"
    tree = ast.parse(expr, mode="eval")

    class _R(ast.NodeTransformer):
        def visit_Name(self, node):
            if node.id in mapping:
                return ast.copy_location(ast.Name(id=mapping[node.id], ctx=ast.Load()), node)
            return node

    return ast.unparse(_R().visit(tree))


# --------------------------------------------------------------------------------------------
# Validation and planning of the per-tile update
# --------------------------------------------------------------------------------------------


@dataclass
class _Plan:
    math: AttentionMath
    state_names: list[str]
    guard_names: list[str]
    old_guards: dict[str, tuple[str, str]]  # old guard name -> (guard expr over _old, guard name)
    guard_after: dict[str, int]  # guard -> index of the state after whose update it is computed
    p_in_place_state: int | None  # index of the state whose term is the weight (CSE)
    uses_scratch: list[int]  # states whose term needs a scratch tile


def _plan(math: AttentionMath) -> _Plan:
    states = math.states
    names = [s.name for s in states]
    if len(set(names)) != len(names) or not names:
        raise ValueError("AttentionMath.states must be a non-empty list of distinct names")
    for st in states:
        if st.op not in _REDUCE_OPS:
            raise ValueError(f"state {st.name}: op {st.op!r} not in {_REDUCE_OPS}")
        if st.correction_op not in ("mul", "add"):
            raise ValueError(f"state {st.name}: correction_op {st.correction_op!r} not in ('mul', 'add')")
        if not st.name.isidentifier() or st.name in ("s", "o", "T"):
            raise ValueError(f"state name {st.name!r} is reserved or not an identifier")
    guard_names = [g.name for g in math.guards]
    if len(set(guard_names)) != len(guard_names):
        raise ValueError("guard names must be distinct")
    # names read anywhere in the loop (terms, corrections, weight, acc correction)
    loop_refs: set[str] = set()
    for st in states:
        loop_refs |= _names(st.term)
        if st.correction is not None:
            loop_refs |= _names(st.correction)
    loop_refs |= _names(math.weight) | _names(math.acc_correction)
    old_guards = {}
    for g in math.guards:
        og = _old_guard_name(g, states)
        if og is not None and og[0] in loop_refs:
            old_guards[og[0]] = (_to_old(g.expr, states), g.name)

    # which state each guard needs: the last state (by index) whose _new / bare name it reads
    guard_after = {}
    for g in math.guards:
        refs = _names(g.expr)
        idx = -1
        for k, st in enumerate(states):
            if st.name in refs or f"{st.name}_new" in refs:
                idx = max(idx, k)
        for other in refs:
            if other in guard_after:
                idx = max(idx, guard_after[other])
        if idx < 0:
            raise ValueError(f"guard {g.name}: reads no state ({g.expr!r})")
        guard_after[g.name] = idx

    # CSE of P: the last state whose term text equals the weight, and no later state reads s
    norm = _norm
    p_state = None
    w = norm(math.weight)
    for k, st in enumerate(states):
        if norm(st.term) == w:
            p_state = k
    if p_state is not None:
        for st in states[p_state + 1 :]:
            if "s" in _names(st.term):
                p_state = None
                break
    scratch = []
    for k, st in enumerate(states):
        if k == p_state or norm(st.term) == "s":
            continue
        scratch.append(k)
    return _Plan(math, names, guard_names, old_guards, guard_after, p_state, scratch)


# --------------------------------------------------------------------------------------------
# Source emission helpers
# --------------------------------------------------------------------------------------------


class _Src:
    def __init__(self):
        self.lines: list[str] = []

    def __call__(self, indent: int, text: str = ""):
        for ln in text.split("\n"):
            self.lines.append(("    " * indent + ln) if ln else "")

    def text(self) -> str:
        return "\n".join(self.lines) + "\n"


def _frag(name: str) -> str:
    return f"st_{name}"


def _guard_frag(name: str) -> str:
    return f"gd_{name}"


def _row_mapping(plan: _Plan, updated: int, i: str = "i", with_new_self: int | None = None) -> dict[str, str]:
    """Names visible in row context once states[:updated] hold their new values.

    Guards are visible once the states they read are updated; a guard computed after state k
    is not visible to state k's own term or correction.
    """
    mp: dict[str, str] = {p: p for p in plan.math.params}
    for k, name in enumerate(plan.state_names):
        mp[f"{name}_old"] = f"{_frag(name)}_old[{i}]"
        if k < updated or k == with_new_self:
            mp[name] = f"{_frag(name)}[{i}]"
            mp[f"{name}_new"] = f"{_frag(name)}[{i}]"
    for g in plan.math.guards:
        if plan.guard_after[g.name] < updated:
            mp[g.name] = f"{_guard_frag(g.name)}[{i}]"
    for og in plan.old_guards:
        mp[og] = f"{_guard_frag(og)}[{i}]"
    return mp


def _final_mapping(plan: _Plan) -> dict[str, str]:
    """Names visible after the last tile: final states, guards, params (no ``_old`` values)."""
    mp: dict[str, str] = {p: p for p in plan.math.params}
    for name in plan.state_names:
        mp[name] = f"{_frag(name)}[i]"
    for g in plan.math.guards:
        mp[g.name] = f"{_guard_frag(g.name)}[i]"
    return mp


def _reduce_fn(op: str) -> str:
    return {"max": "T.reduce_max", "min": "T.reduce_min", "sum": "T.reduce_sum"}[op]


def _combine(op: str, a: str, b: str) -> str:
    return {"max": f"T.max({a}, {b})", "min": f"T.min({a}, {b})", "sum": f"{a} + {b}"}[op]


def _apply_corr(cop: str, x: str, corr: str) -> str:
    return f"{x} * ({corr})" if cop == "mul" else f"{x} + ({corr})"


_HEADER = '''\
# Generated by redfuser-ops {version} from {source}; do not edit.
# variant: {variant}
# math: {math_digest}
# schedule: family={family} arch={arch} dtype={dtype} D={D} causal={causal} block_m={bm} block_n={bn}
#           threads={threads} num_stages={stages} split_kv={split}
import tilelang.language as T

VARIANT = {variant!r}
TARGET_ARCH = {arch!r}
KERNEL_SYMBOL = {symbol!r}
PARAMS = {params!r}  # float32 scalar kernel arguments after the tensors, in this order
PASS_CONFIGS = {pass_configs!r}
'''


def _math_digest(math: AttentionMath) -> str:
    import hashlib

    return hashlib.sha256(repr(math).encode()).hexdigest()[:16]


def _pass_configs(cfg: AttentionConfig) -> dict:
    return {"tl.enable_fast_math": True}


# --------------------------------------------------------------------------------------------
# Forward (single- or multi-segment) program
# --------------------------------------------------------------------------------------------


def emit_attention_program(math: AttentionMath, cfg: AttentionConfig, symbol: str | None = None) -> str:
    """TileLang source of the forward kernel for one variant (``make_prim_func()`` inside).

    Kernel arguments, in order (``call()`` of TLWrapper appends the dynamic sizes/strides in order
    of first appearance, then the stream):
      single: Q, K, V, O, LSE, *params
      split:  Q, K, V, Opart, Spart, *params   (NS = number of segments, dynamic)
    """
    plan = _plan(math)
    D, BM, BN = cfg.head_dim, cfg.block_m, cfg.block_n
    if D % 16 or BM % 16 or BN % 16:
        raise ValueError("head_dim, block_m and block_n must be multiples of 16")
    symbol = symbol or cfg.variant_name()
    nst = len(plan.state_names)
    src = _Src()
    src(
        0,
        _HEADER.format(
            version=TEMPLATE_VERSION,
            source="generator/codegen/templates/stream_attention.py",
            variant=cfg.variant_name(),
            math_digest=_math_digest(math),
            family=cfg.family,
            arch=cfg.arch,
            dtype=cfg.dtype,
            D=D,
            causal=cfg.causal,
            bm=BM,
            bn=BN,
            threads=cfg.threads,
            stages=cfg.num_stages,
            split=cfg.split_kv,
            symbol=symbol,
            params=tuple(math.params),
            pass_configs=_pass_configs(cfg),
        ),
    )
    src(0, f"CALL_INT_ARGS = {call_int_args(cfg)!r}  # int32 arguments after the float params")
    src(0, f"STRIDE_UNIT = {1 if uses_tma(cfg) else 8}  # q/k/v strides are passed in units of this many elements")
    if cfg.split_kv:
        src(0, f"STATE_ORDER = {tuple(plan.state_names)!r}  # first axis of Spart")
    src(0, "")
    src(0, "")
    src(0, "def make_prim_func():")
    src(1, f"dtype = {DTYPES[cfg.dtype]}")
    src(1, "accum_dtype = T.float32")
    _emit_forward_signature(src, math, cfg, symbol, nst)
    n_qb = f"T.ceildiv(seqlen_q, {BM})"
    grid_x = f"{n_qb} * num_splits" if cfg.split_kv else n_qb
    src(2, f"with T.Kernel({grid_x}, heads, batch, threads={cfg.threads}) as (bx, by, bz):")
    b = 3
    _emit_assumptions(src, b, strides=uses_tma(cfg))
    if cfg.split_kv:
        src(b, "T.assume(num_splits > 0)")
    if cfg.producer_regs:
        src(b, f"T.annotate_producer_reg_dealloc({cfg.producer_regs})")
    if cfg.consumer_regs:
        src(b, f"T.annotate_consumer_reg_alloc({cfg.consumer_regs})")
    src(b, f"Q_shared = T.alloc_shared(({BM}, {D}), dtype)")
    src(b, f"K_shared = T.alloc_shared(({BN}, {D}), dtype)")
    src(b, f"V_shared = T.alloc_shared(({BN}, {D}), dtype)")
    if not cfg.split_kv:
        src(b, f"O_shared = T.alloc_shared(({BM}, {D}), dtype)")
    src(b, f"acc_s = T.alloc_fragment(({BM}, {BN}), accum_dtype)")
    src(b, f"acc_p = T.alloc_fragment(({BM}, {BN}), dtype)")
    src(b, f"acc_o = T.alloc_fragment(({BM}, {D}), accum_dtype)")
    if plan.uses_scratch:
        src(b, f"acc_t = T.alloc_fragment(({BM}, {BN}), accum_dtype)")
    emit_row_fragments(src, b, plan, BM)
    src(b, "")
    # ---- block coordinates
    if cfg.split_kv:
        # truncating division: operands are non-negative, and TIR's floor division would keep
        # sign tests (and spill registers in the epilogue) on a dynamic divisor
        src(b, "split = T.truncmod(bx, num_splits)")
        qb_lin = "T.truncdiv(bx, num_splits)"
    else:
        qb_lin = "bx"
    band = cfg.key_band
    if band is not None and band.hi is not None:
        # heaviest q-blocks (most keys under a causal-like upper bound) first
        src(b, f"q_blk = {n_qb} - 1 - {qb_lin}")
    else:
        src(b, f"q_blk = {qb_lin}")
    src(b, f"q0 = q_blk * {BM}")
    src(b, "kv_head = T.truncdiv(by, T.truncdiv(heads, heads_kv))")
    for t in _band_tensors(cfg):
        src(b, f"{t} = {_buffer(t)}[bz]")
    # tiles [tile_lo, n_tiles) hold every key some row of the block sees; tiles [full_lo, n_full) are seen
    # completely by every row (affine bounds take their extremes over the block at its first and last row)
    if band is not None and band.hi is not None:
        hi0, hi1 = _band_at(band, band.hi, "q0"), _band_at(band, band.hi, f"q0 + {BM - 1}")
        src(b, f"kv_end = T.max(T.min(seqlen_k, T.max({hi0}, {hi1})), 0)")
        src(b, f"n_full = T.max(T.min(seqlen_k, T.min({hi0}, {hi1})), 0) // {BN}")
        src(b, f"n_tiles = T.ceildiv(kv_end, {BN})")
    else:  # no upper bound: every tile up to seqlen_k (no `kv_end = seqlen_k` alias: TileLang would take a
        # let-bound copy of a dynamic dim for a launcher parameter of its own)
        src(b, f"n_full = seqlen_k // {BN}")
        src(b, f"n_tiles = T.ceildiv(seqlen_k, {BN})")
    if band is not None and band.lo is not None:
        lo0, lo1 = _band_at(band, band.lo, "q0"), _band_at(band, band.lo, f"q0 + {BM - 1}")
        kv_end = "kv_end" if band.hi is not None else "seqlen_k"
        src(b, f"tile_lo = T.min(T.max(T.min({lo0}, {lo1}), 0), {kv_end}) // {BN}")
        src(b, f"full_lo = T.ceildiv(T.max(T.max({lo0}, {lo1}), 0), {BN})")
    else:
        src(b, "tile_lo = 0")
    if cfg.split_kv:
        src(b, "per_split = T.truncdiv(n_tiles - tile_lo + num_splits - 1, num_splits)")
        src(b, "t_begin = T.min(tile_lo + split * per_split, n_tiles)")
        src(b, "t_end = T.min(t_begin + per_split, n_tiles)")
    else:
        src(b, "t_begin = tile_lo")
        src(b, "t_end = n_tiles")
    # Never run zero iterations: an empty range (a q-block that sees no key, an empty segment)
    # runs one tile at kt == n_tiles, which the mask removes entirely (every key index there is
    # >= kv_end >= every row's limit), so states stay neutral and o stays 0.  This keeps the
    # TMA load of Q (waited on inside the loop) from being left in flight.
    src(b, "t_stop = T.max(t_end, t_begin + 1)")
    src(b, "")
    src(b, f"T.copy(Q[bz, q0:q0 + {BM}, by, :], Q_shared)")
    src(b, "T.fill(acc_o, 0)")
    emit_row_init(src, b, plan, BM)
    src(b, "")
    _emit_loop(src, b, plan, cfg)
    src(b, "")
    # ---- epilogue
    if cfg.split_kv:
        src(b, f"T.copy(acc_o, Opart[split, bz, q0:q0 + {BM}, by, :])")
        src(b, f"for i in T.Parallel({BM}):")
        src(b + 1, "if q0 + i < seqlen_q:")
        for k, name in enumerate(plan.state_names):
            src(b + 2, f"Spart[{k}, split, bz, by, q0 + i] = {_frag(name)}[i]")
    else:
        omap = _final_mapping(plan)
        omap["o"] = "acc_o[i, d]"
        src(b, f"for i, d in T.Parallel({BM}, {D}):")
        src(b + 1, f"acc_o[i, d] = {render(math.out, omap, 'out')}")
        src(b, "T.copy(acc_o, O_shared)")
        if uses_tma(cfg):
            # every thread that wrote O_shared with generic stores fences them towards the async proxy before
            # the barrier that precedes the TMA store (the PTX memory model; CUTLASS and FA3 do the same): the
            # fence TileLang emits is the elected thread's only
            src(b, "T.fence_proxy_async()")
        src(b, f"T.copy(O_shared, O[bz, q0:q0 + {BM}, by, :])")
        lmap = _final_mapping(plan)
        src(b, f"for i in T.Parallel({BM}):")
        src(b + 1, "if q0 + i < seqlen_q:")
        src(b + 2, f"LSE[bz, by, q0 + i] = {render(math.lse, lmap, 'lse')}")
    src(0, "")
    src(1, f"return {symbol}")
    return src.text()


def _band_at(band: KeyBand, expr: str, row: str) -> str:
    """A bound of the band at query row ``row`` (TileLang text)."""
    names = {"r": f"({row})", "seqlen_q": "seqlen_q", "seqlen_k": "seqlen_k", **{p: p for p in band.params},
             **{t: t for t in band.tensors}}
    return render(expr, names, f"mask bound of {band.name}")


def uses_tma(cfg: AttentionConfig) -> bool:
    """TMA families take Q/K/V as strided tensors (element strides in the TMA descriptors)."""
    return cfg.family in ("sm90a", "sm100a")


# Trailing int32 arguments of TLWrapper's call(), after the tensors and the float params.
# TMA families: element strides; sm80: strides in units of 8 elements (16 bytes).
def call_int_args(cfg: AttentionConfig) -> tuple[str, ...]:
    args = ["batch", "seqlen_q", "heads", "seqlen_k", "heads_kv"]
    if cfg.split_kv:
        args.append("num_splits")
    for t in "qkv":
        args += [f"{t}_sb", f"{t}_ss", f"{t}_sh"]
    return tuple(args)


def _emit_forward_signature(src: _Src, math: AttentionMath, cfg: AttentionConfig, symbol: str, nst: int) -> None:
    D = cfg.head_dim
    ints = call_int_args(cfg)
    if uses_tma(cfg):
        # dynamic sizes bound from the buffers; TLWrapper appends them to call() in order of
        # first appearance (all shapes, then the strides), which call_int_args mirrors
        src(1, f"{', '.join(ints)} = T.dynamic({', '.join(ints)!r})")
        src(0, "")
        src(1, "@T.prim_func")
        src(1, f"def {symbol}(")
        src(2, f"Q: T.StridedTensor((batch, seqlen_q, heads, {D}), (q_sb, q_ss, q_sh, 1), dtype),")
        src(2, f"K: T.StridedTensor((batch, seqlen_k, heads_kv, {D}), (k_sb, k_ss, k_sh, 1), dtype),")
        src(2, f"V: T.StridedTensor((batch, seqlen_k, heads_kv, {D}), (v_sb, v_ss, v_sh, 1), dtype),")
        if cfg.split_kv:
            src(2, f"Opart: T.Tensor((num_splits, batch, seqlen_q, heads, {D}), accum_dtype),")
            src(2, f"Spart: T.Tensor(({nst}, num_splits, batch, heads, seqlen_q), accum_dtype),")
        else:
            src(2, f"O: T.Tensor((batch, seqlen_q, heads, {D}), dtype),")
            src(2, "LSE: T.Tensor((batch, heads, seqlen_q), accum_dtype),")
        for t in _band_tensors(cfg):
            src(2, f"{_buffer(t)}: T.Tensor((batch,), T.int32),")
        for p in math.params:
            src(2, f"{p}: T.float32,")
        for p in _band_params(cfg):
            src(2, f"{p}: T.int32,")
        src(1, "):")
        return
    # sm80: pointers + explicit int32 sizes; strides in units of 8 elements, so that TileLang can
    # prove 16-byte alignment and emit 16-byte cp.async (with element strides it emits 2-byte loads)
    src(0, "")
    src(1, "@T.prim_func")
    src(1, f"def {symbol}(")
    outs = ("Opart", "Spart") if cfg.split_kv else ("O", "LSE")
    for name in ("Q", "K", "V") + outs + tuple(_buffer(t) for t in _band_tensors(cfg)):
        src(2, f"{name}_ptr: T.ptr,")
    for p in math.params:
        src(2, f"{p}: T.float32,")
    for p in _band_params(cfg):
        src(2, f"{p}: T.int32,")
    for a in ints:
        src(2, f"{a}: T.int32,")
    src(1, "):")
    src(2, f"Q = T.make_tensor(Q_ptr, (batch, seqlen_q, heads, {D}), dtype, strides=(q_sb * 8, q_ss * 8, q_sh * 8, 1))")
    src(2, f"K = T.make_tensor(K_ptr, (batch, seqlen_k, heads_kv, {D}), dtype, strides=(k_sb * 8, k_ss * 8, k_sh * 8, 1))")
    src(2, f"V = T.make_tensor(V_ptr, (batch, seqlen_k, heads_kv, {D}), dtype, strides=(v_sb * 8, v_ss * 8, v_sh * 8, 1))")
    if cfg.split_kv:
        src(2, f"Opart = T.make_tensor(Opart_ptr, (num_splits, batch, seqlen_q, heads, {D}), accum_dtype)")
        src(2, f"Spart = T.make_tensor(Spart_ptr, ({nst}, num_splits, batch, heads, seqlen_q), accum_dtype)")
    else:
        src(2, f"O = T.make_tensor(O_ptr, (batch, seqlen_q, heads, {D}), dtype)")
        src(2, "LSE = T.make_tensor(LSE_ptr, (batch, heads, seqlen_q), accum_dtype)")
    for t in _band_tensors(cfg):
        src(2, f"{_buffer(t)} = T.make_tensor({_buffer(t)}_ptr, (batch,), T.int32)")


def _band_params(cfg: AttentionConfig) -> tuple[str, ...]:
    return cfg.key_band.params if cfg.key_band is not None else ()


def _band_tensors(cfg: AttentionConfig) -> tuple[str, ...]:
    return cfg.key_band.tensors if cfg.key_band is not None else ()


def _buffer(value: str) -> str:
    """The buffer holding a per-sequence band value: blen0 -> Blen0."""
    return value[0].upper() + value[1:]


def _emit_assumptions(src: _Src, b: int, strides: bool) -> None:
    """Preconditions the launcher checks; they simplify index arithmetic (GQA head division)."""
    src(b, "T.assume(batch > 0 and heads > 0 and heads_kv > 0 and seqlen_q > 0 and seqlen_k > 0)")
    src(b, "T.assume(heads % heads_kv == 0)")
    if strides:
        for t in "qkv":
            src(b, f"T.assume({t}_sb % 8 == 0 and {t}_ss % 8 == 0 and {t}_sh % 8 == 0)")


def _emit_guards(src: _Src, b: int, plan: _Plan, after: list[int], BM: int, initial: bool = False) -> int:
    """Emit the guards computed right after each state index in ``after``; returns #statements."""
    n = 0
    todo = [g for g in plan.math.guards if plan.guard_after[g.name] in after]
    if not todo:
        return 0
    mp = _row_mapping(plan, len(plan.state_names) if initial else max(after) + 1, i="i")
    src(b, f"for i in T.Parallel({BM}):")
    for g in todo:
        src(b + 1, f"{_guard_frag(g.name)}[i] = {render(g.expr, mp, f'guard {g.name}')}")
    n += 1
    return n


def emit_row_fragments(src: _Src, b: int, plan: _Plan, BM: int) -> None:
    """Per-row fragments of the online update: each state (current, old, tile reduction), guards, old guards
    and the accumulator's correction ``acc_scale``."""
    for name in plan.state_names:
        src(b, f"{_frag(name)} = T.alloc_fragment(({BM},), accum_dtype)")
        src(b, f"{_frag(name)}_old = T.alloc_fragment(({BM},), accum_dtype)")
        src(b, f"{_frag(name)}_red = T.alloc_fragment(({BM},), accum_dtype)")
    for g in plan.math.guards:
        src(b, f"{_guard_frag(g.name)} = T.alloc_fragment(({BM},), accum_dtype)")
    for og in plan.old_guards:
        src(b, f"{_guard_frag(og)} = T.alloc_fragment(({BM},), accum_dtype)")
    src(b, f"acc_scale = T.alloc_fragment(({BM},), accum_dtype)")


def emit_row_init(src: _Src, b: int, plan: _Plan, BM: int) -> None:
    """The states' neutral values and the guards of them (valid even when the loop runs zero times)."""
    init_map = {p: p for p in plan.math.params}
    for st in plan.math.states:
        src(b, f"T.fill({_frag(st.name)}, {render(st.init, init_map, f'init of {st.name}')})")
    _emit_guards(src, b, plan, list(range(len(plan.math.states))), BM, initial=True)


def emit_online_update(plan: _Plan, BM: int, BN: int, stmt) -> None:
    """The per-tile online update of the row states from the scores in ``acc_s`` (BM x BN fragment).

    Emits, through ``stmt(role, text)``: the old state values (and old guards), each state's reduction,
    correction and the guards it enables, the weight P (in ``acc_s``, cast into ``acc_p``) and the
    accumulator's correction in ``acc_scale``.  Shared by the templates that stream keys in tiles.
    """
    math = plan.math
    # ---- old values
    lines = [f"for i in T.Parallel({BM}):"]
    for name in plan.state_names:
        lines.append(f"    {_frag(name)}_old[i] = {_frag(name)}[i]")
    if plan.old_guards:
        ogmap = _row_mapping(plan, 0, i="i")
        for og, (expr, _g) in plan.old_guards.items():
            lines.append(f"    {_guard_frag(og)}[i] = {render(expr, ogmap, f'old guard {og}')}")
    stmt("softmax", "\n".join(lines))
    # ---- states in order
    scale_done = False
    for k, st in enumerate(math.states):
        emap = _row_mapping(plan, k, i="i")
        emap["s"] = "acc_s[i, j]"
        red = f"{_frag(st.name)}_red"
        if k == plan.p_in_place_state:
            term = render(st.term, emap, f"term of {st.name}")
            stmt("softmax", f"for i, j in T.Parallel({BM}, {BN}):\n    acc_s[i, j] = {term}")
            stmt("softmax", f"{_reduce_fn(st.op)}(acc_s, {red}, dim=1)")
        elif k in plan.uses_scratch:
            term = render(st.term, emap, f"term of {st.name}")
            stmt("softmax", f"for i, j in T.Parallel({BM}, {BN}):\n    acc_t[i, j] = {term}")
            stmt("softmax", f"{_reduce_fn(st.op)}(acc_t, {red}, dim=1)")
        else:  # term is the score itself
            stmt("softmax", f"{_reduce_fn(st.op)}(acc_s, {red}, dim=1)")
        cmap = _row_mapping(plan, k, i="i", with_new_self=None)
        old = f"{_frag(st.name)}_old[i]"
        if st.correction is not None:
            corr = render(st.correction, cmap, f"correction of {st.name}")
            if not scale_done and _norm(st.correction) == _norm(math.acc_correction):
                # CSE: the accumulator's correction is this state's correction; everything it
                # reads (old values, states and guards before this one) is final here
                stmt("softmax", f"for i in T.Parallel({BM}):\n    acc_scale[i] = {corr}")
                scale_done = True
                corr = "acc_scale[i]"
            old = _apply_corr(st.correction_op, old, corr)
        stmt(
            "softmax",
            f"for i in T.Parallel({BM}):\n    {_frag(st.name)}[i] = {_combine(st.op, old, f'{red}[i]')}",
        )
        # guards that become computable now
        g_src = _Src()
        if _emit_guards(g_src, 0, plan, [k], BM):
            stmt("softmax", g_src.text().rstrip("\n"))
    # ---- weight P (in place in acc_s unless CSE'd above)
    allmap = _row_mapping(plan, len(plan.state_names), i="i")
    allmap["s"] = "acc_s[i, j]"
    if plan.p_in_place_state is None:
        w = render(math.weight, allmap, "weight")
        stmt("softmax", f"for i, j in T.Parallel({BM}, {BN}):\n    acc_s[i, j] = {w}")
    stmt("softmax", "T.copy(acc_s, acc_p)")
    if not scale_done:
        rmap = _row_mapping(plan, len(plan.state_names), i="i")
        corr = render(math.acc_correction, rmap, "acc_correction")
        stmt("softmax", f"for i in T.Parallel({BM}):\n    acc_scale[i] = {corr}")


def _emit_loop(src: _Src, b: int, plan: _Plan, cfg: AttentionConfig) -> None:
    math = plan.math
    BM, BN = cfg.block_m, cfg.block_n
    body = _Src()
    stmts: list[str] = []  # role of each top-level statement, for the manual pipeline schedule

    def stmt(role: str, text: str):
        stmts.append(role)
        body(0, text)

    stmt("load_k", f"T.copy(K[bz, kt * {BN}:(kt + 1) * {BN}, kv_head, :], K_shared)")
    stmt("gemm_qk", "T.gemm(Q_shared, K_shared, acc_s, transpose_B=True, clear_accum=True, policy=T.GemmWarpPolicy.FullRow)")
    # ---- score and mask
    smap = {p: p for p in math.params}
    smap["acc_s"] = "acc_s[i, j]"
    score = render(math.score, smap, "score")
    mask_value = render(math.mask_value, {p: p for p in math.params}, "mask_value")
    band = cfg.key_band
    if band is not None and band.hi is not None:
        limit = f"T.min(seqlen_k, {_band_at(band, band.hi, 'q0 + i')})"
    else:
        limit = "seqlen_k"
    masked = f"T.if_then_else(kt * {BN} + j < {limit}, {score}, {mask_value})"
    partial = "kt >= n_full"
    if band is not None and band.lo is not None:
        masked = f"T.if_then_else(kt * {BN} + j >= {_band_at(band, band.lo, 'q0 + i')}, {masked}, {mask_value})"
        partial = "kt < full_lo or kt >= n_full"
    stmt(
        "softmax",
        "\n".join(
            [
                f"if {partial}:",
                f"    for i, j in T.Parallel({BM}, {BN}):",
                f"        acc_s[i, j] = {masked}",
                "else:",
                f"    for i, j in T.Parallel({BM}, {BN}):",
                f"        acc_s[i, j] = {score}",
            ]
        ),
    )
    emit_online_update(plan, BM, BN, stmt)
    stmt("rescale", f"for i, d in T.Parallel({BM}, {cfg.head_dim}):\n    acc_o[i, d] *= acc_scale[i]")
    stmt("load_v", f"T.copy(V[bz, kt * {BN}:(kt + 1) * {BN}, kv_head, :], V_shared)")
    stmt("gemm_pv", "T.gemm(acc_p, V_shared, acc_o, policy=T.GemmWarpPolicy.FullRow)")

    # TileLang 0.1.15 (auto warp specialization) ignored manual order/stage annotations here:
    # the loop body is emitted as is and pipelined by num_stages.
    head = f"for kt in T.Pipelined(t_begin, t_stop, num_stages={cfg.num_stages}):"
    src(b, head)
    for ln in body.lines:
        src(b + 1, ln)


# --------------------------------------------------------------------------------------------
# Combine program (split-KV): merge partial (states, o) of the segments
# --------------------------------------------------------------------------------------------


def emit_combine_program(math: AttentionMath, cfg: AttentionConfig, symbol: str | None = None) -> str:
    """TileLang source of the combine kernel: Opart, Spart -> O, LSE.

    Arguments: Opart (NS, B, Sq, H, D) f32, Spart (n_states, NS, B, H, Sq) f32, O (B, Sq, H, D)
    dtype, LSE (B, H, Sq) f32, *params.
    """
    plan = _plan(math)
    mf = math.merge
    by_name = {s.name: s for s in math.states}
    if [m.name for m in mf.states] != plan.state_names:
        raise ValueError("merge.states must list the same states as AttentionMath.states, in order")
    D, CM = cfg.head_dim, cfg.combine_block_m
    nst = len(plan.state_names)
    symbol = symbol or cfg.combine_variant_name()
    src = _Src()
    src(
        0,
        _HEADER.format(
            version=TEMPLATE_VERSION,
            source="generator/codegen/templates/stream_attention.py (combine)",
            variant=cfg.combine_variant_name(),
            math_digest=_math_digest(math),
            family=cfg.family,
            arch=cfg.arch,
            dtype=cfg.dtype,
            D=D,
            causal=cfg.causal,
            bm=CM,
            bn=0,
            threads=cfg.combine_threads,
            stages=0,
            split=True,
            symbol=symbol,
            params=tuple(math.params),
            pass_configs=_pass_configs(cfg),
        ),
    )
    src(0, 'CALL_INT_ARGS = ("num_splits", "batch", "seqlen_q", "heads")  # int32 arguments after the float params')
    src(0, f"STATE_ORDER = {tuple(plan.state_names)!r}  # first axis of Spart")
    src(0, "")
    src(0, "")
    src(0, "def make_prim_func():")
    src(1, f"dtype = {DTYPES[cfg.dtype]}")
    src(1, "accum_dtype = T.float32")
    src(1, 'num_splits, batch, seqlen_q, heads = T.dynamic("num_splits, batch, seqlen_q, heads")')
    src(0, "")
    src(1, "@T.prim_func")
    src(1, f"def {symbol}(")
    src(2, f"Opart: T.Tensor((num_splits, batch, seqlen_q, heads, {D}), accum_dtype),")
    src(2, f"Spart: T.Tensor(({nst}, num_splits, batch, heads, seqlen_q), accum_dtype),")
    src(2, f"O: T.Tensor((batch, seqlen_q, heads, {D}), dtype),")
    src(2, "LSE: T.Tensor((batch, heads, seqlen_q), accum_dtype),")
    for p in math.params:
        src(2, f"{p}: T.float32,")
    src(1, "):")
    src(2, f"with T.Kernel(T.ceildiv(seqlen_q, {CM}), heads, batch, threads={cfg.combine_threads}) as (bx, by, bz):")
    b = 3
    src(b, "T.assume(num_splits > 0 and batch > 0 and heads > 0 and seqlen_q > 0)")
    src(b, f"acc_o = T.alloc_fragment(({CM}, {D}), accum_dtype)")
    for name in plan.state_names:
        src(b, f"{_frag(name)} = T.alloc_fragment(({CM},), accum_dtype)")
    for g in mf.guards:
        src(b, f"{_guard_frag(g.name)} = T.alloc_fragment(({CM},), accum_dtype)")
    src(b, f"q0 = bx * {CM}")
    init_map = {p: p for p in math.params}
    for name in plan.state_names:
        src(b, f"T.fill({_frag(name)}, {render(by_name[name].init, init_map, f'init of {name}')})")
    src(b, "T.fill(acc_o, 0)")

    # reads clamp the row (rows past seqlen_q are computed on duplicates and never stored)
    row = "T.min(q0 + i, seqlen_q - 1)"

    def mmap(upto: int, with_o: bool) -> dict[str, str]:
        mp = {p: p for p in math.params}
        for k, name in enumerate(plan.state_names):
            mp[f"{name}_seg"] = f"Spart[{k}, p, bz, by, {row}]"
            if k < upto:
                mp[name] = f"{_frag(name)}[i]"
                mp[f"{name}_new"] = f"{_frag(name)}[i]"
        for g in mf.guards:
            mp[g.name] = f"{_guard_frag(g.name)}[i]"
        if with_o:
            mp["o_seg"] = f"Opart[p, bz, {row}, by, d]"
        return mp

    # guard dependencies in the merge: after the last merged state they read
    g_after = {}
    for g in mf.guards:
        refs = _names(g.expr)
        idx = -1
        for k, name in enumerate(plan.state_names):
            if name in refs or f"{name}_new" in refs:
                idx = max(idx, k)
        g_after[g.name] = idx
    for k, ms in enumerate(mf.states):
        op = by_name[ms.name].op
        term = render(ms.term, mmap(k, False), f"merge term of {ms.name}")
        src(b, "for p in T.serial(num_splits):")
        src(b + 1, f"for i in T.Parallel({CM}):")
        src(b + 2, f"{_frag(ms.name)}[i] = {_combine(op, f'{_frag(ms.name)}[i]', term)}")
        todo = [g for g in mf.guards if g_after[g.name] == k]
        if todo:
            gmap = mmap(k + 1, False)
            src(b, f"for i in T.Parallel({CM}):")
            for g in todo:
                src(b + 1, f"{_guard_frag(g.name)}[i] = {render(g.expr, gmap, f'merge guard {g.name}')}")
    acc = render(mf.acc_term, mmap(nst, True), "merge acc_term")
    src(b, "for p in T.serial(num_splits):")
    src(b + 1, f"for i, d in T.Parallel({CM}, {D}):")
    src(b + 2, f"acc_o[i, d] = acc_o[i, d] + {acc}")
    # final output and lse from the merged states (same expressions as the single-segment kernel)
    omap = {p: p for p in math.params}
    for name in plan.state_names:
        omap[name] = f"{_frag(name)}[i]"
    for g in mf.guards:
        omap[g.name] = f"{_guard_frag(g.name)}[i]"
    omap_o = dict(omap)
    omap_o["o"] = "acc_o[i, d]"
    src(b, f"for i, d in T.Parallel({CM}, {D}):")
    src(b + 1, "if q0 + i < seqlen_q:")
    src(b + 2, f"O[bz, q0 + i, by, d] = T.Cast(dtype, {render(math.out, omap_o, 'out')})")
    src(b, f"for i in T.Parallel({CM}):")
    src(b + 1, "if q0 + i < seqlen_q:")
    src(b + 2, f"LSE[bz, by, q0 + i] = {render(math.lse, omap, 'lse')}")
    src(0, "")
    src(1, f"return {symbol}")
    return src.text()


# --------------------------------------------------------------------------------------------
# Reference executor: runs the *same* schedule and expressions in numpy (no GPU needed)
# --------------------------------------------------------------------------------------------


class _NpT:
    """Numpy stand-ins for the ``T.`` intrinsics an AttentionMath may use."""

    def __init__(self, np):
        self.np = np

    def exp(self, x):
        return self.np.exp(x)

    def exp2(self, x):
        return self.np.exp2(x)

    def log(self, x):
        return self.np.log(x)

    def log2(self, x):
        return self.np.log2(x)

    def max(self, a, b):
        return self.np.maximum(a, b)

    def min(self, a, b):
        return self.np.minimum(a, b)

    def abs(self, x):
        return self.np.abs(x)

    def sqrt(self, x):
        return self.np.sqrt(x)

    def if_then_else(self, c, a, b):
        return self.np.where(c, a, b)

    def infinity(self, dtype):
        return self.np.float32(_pymath.inf)

    def float32(self, x):
        return self.np.float32(x)

    def tanh(self, x):
        return self.np.tanh(x)

    def sin(self, x):
        return self.np.sin(x)

    def cos(self, x):
        return self.np.cos(x)


def simulate(
    math: AttentionMath,
    q,
    k,
    v,
    causal: bool,
    params: dict[str, float],
    block_m: int = 64,
    block_n: int = 64,
    num_splits: int = 1,
    p_dtype=None,
):
    """Execute the emitted schedule on numpy arrays (float32 math), returning (out, lse).

    q (B, Sq, H, D), k/v (B, Sk, Hk, D); ``causal`` is a bool (the bottom-right causal mask or none) or a
    :class:`KeyBand`, whose int params are read from ``params``. Mirrors the generated program tile by tile: q-blocks,
    causal loop bounds, tail/causal masking of boundary tiles, the per-tile state updates with
    guards and corrections, the weight cast to ``p_dtype`` before P@V, split-KV segments and the
    merge.  Out-of-range K/V rows are zero (as TMA / predicated loads deliver them).
    """
    import numpy as np

    with np.errstate(all="ignore"):  # NaN/inf propagate exactly as on the GPU; tests inspect them
        return _simulate(math, q, k, v, causal, params, block_m, block_n, num_splits, p_dtype, np)


def _simulate(math, q, k, v, causal, params, block_m, block_n, num_splits, p_dtype, np):
    plan = _plan(math)
    nT = _NpT(np)
    f32 = np.float32
    B, Sq, H, D = q.shape
    _, Sk, Hk, _ = k.shape
    groups = H // Hk
    out = np.zeros((B, Sq, H, D), f32)
    lse = np.zeros((B, H, Sq), f32)
    opart = np.zeros((num_splits, B, Sq, H, D), f32)
    spart = np.zeros((len(plan.state_names), num_splits, B, H, Sq), f32)
    base_env = {"T": nT, "accum_dtype": f32}
    band = causal if isinstance(causal, KeyBand) else (CAUSAL if causal else None)
    int_env = {"seqlen_q": Sq, "seqlen_k": Sk}
    if band is not None:
        int_env.update({p: int(params[p]) for p in band.params})
    per_batch = {t: np.asarray(params[t]) for t in band.tensors} if band is not None else {}
    base_env.update({p: f32(val) for p, val in params.items()
                     if band is None or (p not in band.params and p not in band.tensors)})

    def bound(expr, rows):
        val = eval(compile(expr, "<band>", "eval"), {"__builtins__": {}}, {**int_env, "r": rows})
        return np.broadcast_to(np.asarray(val, np.int64), rows.shape)  # a bound that does not read the row

    def ev(expr, env):
        with np.errstate(all="ignore"):
            return np.asarray(eval(compile(expr, "<math>", "eval"), {"__builtins__": {}}, {**base_env, **env}), f32)

    n_qb = -(-Sq // block_m)
    for bz in range(B):
        int_env.update({t: int(vals[bz]) for t, vals in per_batch.items()})
        for by in range(H):
            kvh = by // groups
            for qb in range(n_qb):
                q0 = qb * block_m
                rows = np.arange(q0, q0 + block_m)
                qt = np.zeros((block_m, D), f32)
                valid_rows = rows < Sq
                qt[valid_rows] = q[bz, rows[valid_rows], by].astype(f32)
                # the band's bounds per row (ints), and the block's tile ranges from its first and last row
                hi_r = bound(band.hi, rows) if band is not None and band.hi is not None else None
                lo_r = bound(band.lo, rows) if band is not None and band.lo is not None else None
                if hi_r is not None:
                    kv_end = max(min(Sk, max(hi_r[0], hi_r[-1])), 0)
                    n_full = max(min(Sk, min(hi_r[0], hi_r[-1])), 0) // block_n
                else:
                    kv_end, n_full = Sk, Sk // block_n
                tile_lo, full_lo = 0, 0
                if lo_r is not None:
                    tile_lo = min(max(min(lo_r[0], lo_r[-1]), 0), kv_end) // block_n
                    full_lo = -(-max(max(lo_r[0], lo_r[-1]), 0) // block_n)
                n_tiles = -(-kv_end // block_n)
                per = -(-(n_tiles - tile_lo) // num_splits)
                for split in range(num_splits):
                    t_begin = min(tile_lo + split * per, n_tiles)
                    t_end = min(t_begin + per, n_tiles)
                    st = {}
                    for s_ in math.states:
                        st[s_.name] = np.broadcast_to(ev(s_.init, {}), (block_m,)).astype(f32).copy()
                    acc_o = np.zeros((block_m, D), f32)
                    guards = {}

                    def genv(extra, st=st, guards=guards):
                        return state_env(st, guards, extra)

                    for g in math.guards:
                        guards[g.name] = ev(g.expr, genv({}))
                    for kt in range(t_begin, t_end):
                        cols = np.arange(kt * block_n, (kt + 1) * block_n)
                        kt_ = np.zeros((block_n, D), f32)
                        vt_ = np.zeros((block_n, D), f32)
                        vc = cols < Sk
                        kt_[vc] = k[bz, cols[vc], kvh].astype(f32)
                        vt_[vc] = v[bz, cols[vc], kvh].astype(f32)
                        raw = qt @ kt_.T
                        score = ev(math.score, {"acc_s": raw})
                        if kt < full_lo or kt >= n_full:
                            lim = np.minimum(Sk, hi_r) if hi_r is not None else np.full(block_m, Sk)
                            ok = cols[None, :] < lim[:, None]
                            if lo_r is not None:
                                ok &= cols[None, :] >= lo_r[:, None]
                            s = np.where(ok, score, ev(math.mask_value, {}))
                        else:
                            s = score
                        p, scale = simulate_online_update(math, plan, st, guards, s, ev, p_dtype, np)
                        acc_o = (acc_o * scale[:, None] + p @ vt_).astype(f32)
                    sl = rows[valid_rows]
                    if num_splits == 1:
                        env_o = {key: (val[:, None] if np.ndim(val) == 1 else val) for key, val in genv({}).items()}
                        env_o["o"] = acc_o
                        o_fin = np.broadcast_to(ev(math.out, env_o), acc_o.shape)
                        out[bz, sl, by] = o_fin[valid_rows]
                        lse[bz, by, sl] = np.broadcast_to(ev(math.lse, genv({})), (block_m,))[valid_rows]
                    else:
                        opart[split, bz, sl, by] = acc_o[valid_rows]
                        for idx, name in enumerate(plan.state_names):
                            spart[idx, split, bz, by, sl] = st[name][valid_rows]
    if num_splits == 1:
        return out, lse
    return _simulate_merge(math, plan, opart, spart, out.dtype, base_env, np)


def state_env(st: dict, guards: dict, extra: dict) -> dict:
    """Names of the current states (bare and ``_new``), the guards and ``extra``, for evaluating math text."""
    env = {}
    for name, val in st.items():
        env[name] = val
        env[name + "_new"] = val
    env.update(guards)
    env.update(extra)
    return env


def simulate_online_update(math: AttentionMath, plan: _Plan, st: dict, guards: dict, s, ev, p_dtype, np):
    """One tile's online update in numpy, as ``emit_online_update`` emits it: updates the row states ``st``
    and ``guards`` in place from the masked scores ``s`` (rows x keys); returns (P, accumulator correction)."""
    f32 = np.float32

    def genv(extra):
        return state_env(st, guards, extra)

    old = {f"{n}_old": val.copy() for n, val in st.items()}
    oldg = {}
    for og, (expr, _g) in plan.old_guards.items():
        oldg[og] = ev(expr, old)
    updated = {}
    for idx, s_ in enumerate(math.states):
        env_e = {**old, **oldg, **guards, "s": s}
        for n, val in updated.items():
            env_e[n] = val[:, None]
            env_e[n + "_new"] = val[:, None]
        env_e = {
            key: (val[:, None] if key != "s" and np.ndim(val) == 1 else val) for key, val in env_e.items()
        }
        term = np.broadcast_to(ev(s_.term, env_e), s.shape)
        red = {"max": np.max, "min": np.min, "sum": np.sum}[s_.op](term, axis=1)
        env_r = {**old, **oldg, **guards}
        for n, val in updated.items():
            env_r[n] = val
            env_r[n + "_new"] = val
        o_val = old[f"{s_.name}_old"]
        if s_.correction is not None:
            c = ev(s_.correction, env_r)
            o_val = o_val * c if s_.correction_op == "mul" else o_val + c
        new = {"max": np.maximum, "min": np.minimum, "sum": np.add}[s_.op](o_val, red).astype(f32)
        updated[s_.name] = new
        st[s_.name] = new
        for g in math.guards:
            if plan.guard_after[g.name] == idx:
                guards[g.name] = ev(g.expr, genv({}))
    env_e = {**old, **oldg}
    env_e.update(genv({}))
    env_e = {key: (val[:, None] if np.ndim(val) == 1 else val) for key, val in env_e.items()}
    env_e["s"] = s
    p = np.broadcast_to(ev(math.weight, env_e), s.shape)
    if p_dtype is not None:
        p = p.astype(p_dtype).astype(f32)
    env_r = {**old, **oldg}
    env_r.update(genv({}))
    scale = ev(math.acc_correction, env_r)
    return p, scale


def _simulate_merge(math, plan, opart, spart, _dt, base_env, np):
    f32 = np.float32
    mf = math.merge
    by_name = {s.name: s for s in math.states}
    NS, B, Sq, H, D = opart.shape

    def ev(expr, env):
        with np.errstate(all="ignore"):
            return np.asarray(eval(compile(expr, "<math>", "eval"), {"__builtins__": {}}, {**base_env, **env}), f32)

    merged = {}
    guards = {}
    shape = (B, H, Sq)
    for k, ms in enumerate(mf.states):
        acc = np.broadcast_to(ev(by_name[ms.name].init, {}), shape).astype(f32).copy()
        for p in range(NS):
            env = {f"{n}_seg": spart[i, p] for i, n in enumerate(plan.state_names)}
            for n, val in merged.items():
                env[n] = val
                env[n + "_new"] = val
            env.update(guards)
            t = ev(ms.term, env)
            acc = {"max": np.maximum, "min": np.minimum, "sum": np.add}[by_name[ms.name].op](acc, t).astype(f32)
        merged[ms.name] = acc
        for g in mf.guards:
            refs = _names(g.expr)
            if ms.name in refs or f"{ms.name}_new" in refs:
                env = dict(merged)
                env.update({n + "_new": val for n, val in merged.items()})
                env.update(guards)
                guards[g.name] = ev(g.expr, env)
    acc_o = np.zeros((B, Sq, H, D), f32)
    for p in range(NS):
        env = {}
        for i, n in enumerate(plan.state_names):
            env[f"{n}_seg"] = spart[i, p].transpose(0, 2, 1)[..., None]
        for n, val in merged.items():
            env[n] = val.transpose(0, 2, 1)[..., None]
        for n, val in guards.items():
            env[n] = val.transpose(0, 2, 1)[..., None]
        env["o_seg"] = opart[p]
        acc_o = (acc_o + ev(mf.acc_term, env)).astype(f32)
    env = {n: val.transpose(0, 2, 1)[..., None] for n, val in merged.items()}
    env.update({n: val.transpose(0, 2, 1)[..., None] for n, val in guards.items()})
    env["o"] = acc_o
    out = np.broadcast_to(ev(math.out, env), acc_o.shape).astype(f32)
    env = dict(merged)
    env.update(guards)
    lse = np.broadcast_to(ev(math.lse, env), (B, H, Sq)).astype(f32)
    return out, lse


def replace(cfg: AttentionConfig, **kw) -> AttentionConfig:
    return dataclasses.replace(cfg, **kw)
