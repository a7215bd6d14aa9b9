"""The streaming row template: per-row results of a one-pass cascade over rows of any length.

One CTA of ``THREADS`` threads per row. The row is streamed in chunks of ``THREADS * PER_THREAD`` elements; each
thread loads its ``PER_THREAD`` elements of a chunk with 16-byte vector loads (when the row stride and the base
pointer allow it, else element by element), widens them to float32 and updates its own copy of the row states by
the engine's *online form*: per state, in order, the chunk's reduction of the state's term (read with the states
already updated in this chunk, through their guards), then ``state = op(correct(state_old), chunk)``. The last,
partial chunk contributes the monoid's neutral value for elements past the row's end, so no term needs a mask
value. The threads' states are then combined by the engine's *merge form*: a butterfly of warp shuffles (5 rounds),
one slot per warp in shared memory, and thread 0 merges the warps' states in order and writes every output.

Outputs indexed by the streamed axis (per-element outputs: softmax probabilities, a norm's quantised values) take a
final pass: thread 0 also puts the row's final states in shared memory, every thread reads them back after a
barrier and streams its elements of the row again (the same chunks, loads and tail masking), writing each
per-element output cast to its dtype (float32, float16, bfloat16 or float8_e4m3fn). When few long rows are split
across CTAs, the final pass needs the whole row's states: the row kernel writes its segment's states, the merge
program merges them (and writes the per-row outputs) and puts the row's final states in slot 0 of the workspace, and
a third program, the *final* program (grid (rows, segments), like the row kernel), reads them there and writes the
per-element outputs of its segment's chunks.

A *selection* (one top-k over the row, ``Selection``) streams with the states: each thread keeps its own list of
its best ``KCAP`` entries as sorted 64-bit keys in registers (the order word of the float key above
``0xFFFFFFFF - e``, so equal keys go to the lower index and a NaN key ranks below -inf), offered per chunk (only when
an element beats the thread's k-th entry does the branch-free insertion run). After the states' merge, k rounds of
a block-wide maximum over the lists' heads (a 64-bit warp butterfly, one shared slot per warp) pick the row's
entries in order (the owner pops its head), and thread j writes entry j's outputs (``k_outputs``), reading its
element again for the key and the payloads. k <= ``KCAP``; such rows are never split.

Besides the row tensor, the terms and outputs may read *column* tensors ``c<k>``: 1-D tensors indexed by the
streamed axis alone (a norm's weight), in the row tensor's dtype, loaded next to the row's elements.

What the kernel computes comes from a :class:`RowMath` (made by stream_row_bridge.py from the engine's forms); its
texts use the template's canonical names:

* ``s<i>`` state i (the new value inside an update), ``s<i>_old`` its value before the chunk, ``s<i>_safe`` its
  guard, ``s<i>_seg`` a segment's value inside a merge term;
* ``x`` the element (float32), ``e`` its index in the row (int64), ``L`` the row length (int32), ``c<k>`` the
  k-th column tensor's element at ``e`` (float32);
* ``r<k>`` the row's value of the k-th per-row index tensor (int64), ``ip<k>`` / ``fp<k>`` int64 / float32
  parameters.

Backends
--------
``backend="cuda"`` is the kernel. ``backend="cpu_sim"`` emits the same schedule for TileLang's ``"c"`` target with
the threads made explicit: per-thread values get a leading thread axis, each per-thread block runs inside
``for tid in T.serial(THREADS)``, a shuffle reads another thread's copy and the shared slots are a plain array.
Chunking, element order, masking of the tail, the order of every merge and the output code are emitted by the same
code path, so the simulation checks the schedule and the engine's math (not nvcc or the hardware). bfloat16 rows
are passed as raw uint16 there (the C backend has no bfloat16) and widened by a shift. Per-element outputs are
written there as float32 (the value the CUDA kernel casts to the output's dtype in its store); the test applies that
rounding (torch's float8_e4m3fn / float16 / bfloat16 conversion, round to nearest even).
"""

from __future__ import annotations

import ast
import contextlib
from dataclasses import dataclass, replace

from .resident_row import _Rename, _Src

TEMPLATE_VERSION = "stream_row/1"
FAMILIES = ("sm80", "sm90a", "sm100a")
DTYPES = {"float32": 4, "float16": 2, "bfloat16": 2}
OPS = ("max", "min", "sum")
OUT_DTYPES = ("float32", "float16", "bfloat16", "float8_e4m3fn")  # per-element outputs ("row": the row's dtype)
K_DTYPES = ("float32", "int32", "int64")  # outputs of the selected entries
KCAP = 64  # entries a selection keeps per thread: the most a row can select on CUDA
_ARCH = {"sm80": "sm_80", "sm90a": "sm_90a", "sm100a": "sm_100a"}
INF = "T.infinity('float32')"
MERGE_ROWS = 128  # rows per CTA of the merge program

__all__ = ["DTYPES", "FAMILIES", "KCAP", "K_DTYPES", "SPLIT_CPP", "TEMPLATE_VERSION", "RowMath", "Selection", "State",
           "StreamVariant", "emit_stream_row_final", "emit_stream_row_merge", "emit_stream_row_program", "split_plan"]


@dataclass(frozen=True)
class State:
    """One row state: ``s = op(correct(s_old), op_{x in chunk} term)``; ``correction`` None: no correction,
    ``kind`` "mul" (``s_old * correction``) or "add" (``s_old + correction``); ``guard``: ``s<i>_safe`` from ``s<i>``
    (None: the state needs none)."""

    op: str
    term: str
    correction: str | None = None
    kind: str = "mul"
    guard: str | None = None


@dataclass(frozen=True)
class Selection:
    """A top-k selection over the row: the ``k`` offered elements with the largest ``key`` (float32, element
    context; it reads no state), equal keys to the lower index, NaN keys after every other key; an element is
    offered when ``where`` holds (None: always). ``payloads``: float32 values of the element kept with it."""

    key: str
    where: str | None = None
    payloads: tuple[str, ...] = ()


@dataclass(frozen=True)
class RowMath:
    states: tuple[State, ...]
    merge: tuple[str, ...]  # per state: a segment's value (``s<i>_seg``) corrected to the merged states
    outputs: tuple[str, ...]  # per output (float32): its value over the final states
    n_index: int = 0  # per-row int64 index tensors r0..
    n_iparams: int = 0
    n_fparams: int = 0
    n_cols: int = 0  # column tensors C0.. (read at the element's index e, in the row tensor's dtype)
    elem_outputs: tuple[tuple[str, str], ...] = ()  # per-element outputs: (float32 value, dtype of the store)
    select: Selection | None = None
    # outputs of the selected entries, (value, dtype of the store): per entry j (rank, 0 = the best), over the final
    # states, ``kv`` its key (float32), ``kix`` its element's index (int64), ``kp<i>`` its payloads; an entry
    # left unfilled (fewer than k offered elements) has kv = -inf, kix = -1, kp<i> = 0
    k_outputs: tuple[tuple[str, str], ...] = ()

    @property
    def whole_row(self) -> bool:
        """One CTA per row, never split: a selection's rounds need every thread's list in one CTA."""
        return self.select is not None


@dataclass(frozen=True)
class StreamVariant:
    dtype: str
    family: str = "sm90a"
    threads: int = 256
    per_thread: int = 16  # elements of a chunk per thread (a multiple of the vector width)

    @property
    def vec(self) -> int:
        return 16 // DTYPES[self.dtype]

    @property
    def chunk(self) -> int:
        return self.threads * self.per_thread

    @property
    def warps(self) -> int:
        return self.threads // 32

    def check(self) -> None:
        if self.dtype not in DTYPES:
            raise ValueError(f"stream_row: dtype {self.dtype} not in {sorted(DTYPES)}")
        if self.family not in FAMILIES:
            raise ValueError(f"stream_row: family {self.family} not in {FAMILIES}")
        if self.threads % 32 or not 32 <= self.threads <= 1024:
            raise ValueError("stream_row: threads must be a multiple of 32 in [32, 1024]")
        if self.per_thread % self.vec:
            raise ValueError(f"stream_row: per_thread must be a multiple of the vector width {self.vec}")

    def variant_name(self, op: str) -> str:
        short = {"float32": "fp32", "float16": "fp16", "bfloat16": "bf16"}[self.dtype]
        return f"{op}__{short}_t{self.threads}__{self.family}"

    def final_name(self, op: str) -> str:
        """The final pass of split rows with per-element outputs (it reads the row: one per dtype)."""
        return self.variant_name(f"{op}_final")

    def merge_name(self, op: str) -> str:
        """The merge program of split rows (one per family: it reads float32 states only)."""
        return f"{op}_merge__rows__{self.family}"


def split_plan(rows: int, length: int, sms: int, chunk: int) -> tuple[int, int]:
    """(n_split, full chunks per segment): a row is split across CTAs only when the rows alone would leave SMs idle
    (fewer than 2 CTAs per SM) and it has at least 4 full chunks; every segment gets 2 full chunks or more and none
    is empty. ``SPLIT_CPP`` is the same function for the op's impl_cuda."""
    n_full = length // chunk
    ns = 1
    if rows < 2 * sms and n_full >= 4:
        ns = min((2 * sms + rows - 1) // rows, n_full // 2)
    cps = max(1, (n_full + ns - 1) // ns)
    ns = max(1, (n_full + cps - 1) // cps) if n_full else 1
    return ns, cps


SPLIT_CPP = """\
// stream_row: segments per row and full chunks per segment (generator/codegen/templates/stream_row.py split_plan)
static inline void stream_row_split_plan(int64_t rows, int64_t length, int64_t sms, int64_t chunk, int64_t& ns,
                                         int64_t& cps) {
  const int64_t n_full = length / chunk;
  ns = 1;
  if (rows < 2 * sms && n_full >= 4) ns = std::min((2 * sms + rows - 1) / rows, n_full / 2);
  cps = std::max<int64_t>(1, (n_full + ns - 1) / ns);
  ns = n_full ? std::max<int64_t>(1, (n_full + cps - 1) / cps) : 1;
}"""


def check_math(m: RowMath) -> None:
    if not m.states:
        raise ValueError("stream_row: no row state")
    for i, s in enumerate(m.states):
        if s.op not in OPS:
            raise ValueError(f"stream_row: state s{i}: op {s.op} not in {OPS}")
        if s.kind not in ("mul", "add"):
            raise ValueError(f"stream_row: state s{i}: kind {s.kind}")
    if len(m.merge) != len(m.states):
        raise ValueError("stream_row: one merge term per state")
    for _, dt in m.elem_outputs:
        if dt not in OUT_DTYPES + ("row",):
            raise ValueError(f"stream_row: per-element output dtype {dt} not in {OUT_DTYPES}")
    for _, dt in m.k_outputs:
        if dt not in K_DTYPES:
            raise ValueError(f"stream_row: output dtype {dt} of the selected entries not in {K_DTYPES}")
    if bool(m.k_outputs) != bool(m.select):
        raise ValueError("stream_row: a selection needs outputs of its entries, and such outputs a selection")
    texts = [s.term for s in m.states] + [s.correction or "0" for s in m.states] + list(m.merge) + list(m.outputs)
    texts += [t for t, _ in m.elem_outputs] + [t for t, _ in m.k_outputs]
    if m.select:
        texts += [m.select.key, m.select.where or "True", *m.select.payloads]
    for text in texts:
        ast.parse(text, mode="eval")


def _neutral(op: str) -> str:
    return {"max": f"-{INF}", "min": INF, "sum": "T.float32(0.0)"}[op]


def _combine(op: str, a: str, b: str) -> str:
    """``a op b``; max and min propagate NaN (as the engine's math and the CPU kernels do; a bare T.max drops it).
    NaN is tested on the bits: TVM's simplifier folds ``b != b`` to False."""
    if op in ("max", "min"):
        nan = f"T.reinterpret({b}, \"uint32\") & T.uint32(0x7FFFFFFF) > T.uint32(0x7F800000)"
        less = f"{a} < {b}" if op == "max" else f"{b} < {a}"
        return f"T.if_then_else({less} or {nan}, {b}, {a})"
    return f"({a} + {b})"


class _Intrinsics(ast.NodeTransformer):
    """``T.max`` / ``T.min`` of the math -> selects that propagate NaN (CUDA's fmaxf/fminf drop it; the engine's math
    and the CPU kernels keep it); with ``sim``, ``T.abs(a)`` -> ``T.if_then_else(a < 0, -a, a)`` (TileLang's C
    target has no fabs)."""

    def __init__(self, sim: bool):
        self.sim = sim

    def visit_Call(self, node: ast.Call) -> ast.AST:
        self.generic_visit(node)
        f = node.func
        if not (isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name) and f.value.id == "T"):
            return node
        if f.attr in ("max", "min") and len(node.args) == 2:
            text = _combine(f.attr, ast.unparse(node.args[0]), ast.unparse(node.args[1]))
            return ast.parse(text, mode="eval").body
        if f.attr == "abs" and self.sim:
            a = ast.unparse(node.args[0])
            return ast.parse(f"T.if_then_else({a} < T.float32(0.0), -({a}), {a})", mode="eval").body
        return node


def _backend_math(m: RowMath, sim: bool) -> RowMath:
    """The math's texts with NaN-propagating max/min (and, for cpu_sim, the intrinsics the C target lacks)."""

    def tx(text: str | None) -> str | None:
        return text and ast.unparse(_Intrinsics(sim).visit(ast.parse(text, mode="eval")))

    states = tuple(State(s.op, tx(s.term), tx(s.correction), s.kind, tx(s.guard)) for s in m.states)
    sel = m.select and Selection(tx(m.select.key), tx(m.select.where), tuple(map(tx, m.select.payloads)))
    return replace(m, states=states, merge=tuple(map(tx, m.merge)), outputs=tuple(map(tx, m.outputs)),
                   elem_outputs=tuple((tx(t), d) for t, d in m.elem_outputs), select=sel,
                   k_outputs=tuple((tx(t), d) for t, d in m.k_outputs))


def _rename(text: str, mapping: dict[str, str]) -> str:
    return "(" + ast.unparse(_Rename(mapping).visit(ast.parse(text, mode="eval"))) + ")"


class _Emitter:
    def __init__(self, math: RowMath, v: StreamVariant, backend: str):
        if backend not in ("cuda", "cpu_sim"):
            raise ValueError(f"backend must be 'cuda' or 'cpu_sim', got {backend!r}")
        v.check()
        check_math(math)
        self.sim = backend == "cpu_sim"
        self.m, self.v = _backend_math(math, self.sim), v
        self.src = _Src()
        self.src.depth = 3
        self.decls: dict[str, tuple[str, int | None]] = {}
        self.n = len(math.states)

    # ---- storage ----------------------------------------------------------------------------------
    def decl(self, name: str, dtype: str, n: int | None = None) -> str:
        self.decls[name] = (dtype, n)
        return name

    def t(self, name: str) -> str:
        """A per-thread scalar."""
        return f"{name}[tid]" if self.sim else name

    def ta(self, name: str, idx: str) -> str:
        """A per-thread array element."""
        return f"{name}[tid, {idx}]" if self.sim else f"{name}[{idx}]"

    @contextlib.contextmanager
    def threads(self, n: int | None = None):
        """Per-thread code: all threads (sim: a loop over them)."""
        if self.sim:
            with self.src.block(f"for tid in T.serial({n or self.v.threads})"):
                yield
        else:
            yield

    def loop(self, var: str, n: int | str, kind: str = "unroll") -> str:
        return f"for {var} in T.{'serial' if self.sim else kind}({n})"

    # ---- names of the math's texts ------------------------------------------------------------------
    def base_names(self) -> dict[str, str]:
        names = {"L": "L"}
        for k in range(self.m.n_cols):
            names[f"c{k}"] = self.widen(self.ta(f"i_craw{k}", "i_k"))
        for k in range(self.m.n_index):
            names[f"r{k}"] = self.t(f"i_r{k}")
        for k in range(self.m.n_iparams):
            names[f"ip{k}"] = f"ip{k}"
        for k in range(self.m.n_fparams):
            names[f"fp{k}"] = f"fp{k}"
        return names

    def state_names(self, prefix: str = "") -> dict[str, str]:
        out = {}
        for i in range(self.n):
            out[f"s{i}"] = self.t(f"{prefix}s{i}")
            out[f"s{i}_safe"] = self.t(f"{prefix}s{i}_safe")
        return out

    def declare_states(self, prefix: str) -> None:
        for i in range(self.n):
            self.decl(f"{prefix}s{i}", "float32")
            self.decl(f"{prefix}s{i}_safe", "float32")

    def guards(self, prefix: str = "") -> None:
        names = {**self.base_names(), **self.state_names(prefix)}
        for i, s in enumerate(self.m.states):
            safe = _rename(s.guard, names) if s.guard else self.t(f"{prefix}s{i}")
            self.src(f"{self.t(f'{prefix}s{i}_safe')} = {safe}")

    # ---- the streamed part ---------------------------------------------------------------------------
    def widen(self, x: str) -> str:
        if self.v.dtype == "float32":
            return x
        if self.v.dtype == "bfloat16" and self.sim:
            return f"T.reinterpret(T.cast({x}, \"uint32\") << T.uint32(16), \"float32\")"
        return f"T.cast({x}, \"float32\")"

    def elem_index(self, chunk: str, k: str) -> str:
        V, NT = self.v.vec, self.v.threads
        return f"{chunk} * {self.v.chunk} + ({k} // {V}) * {NT * V} + tid * {V} + {k} % {V}"

    def load_chunk(self, chunk: str, vector: bool) -> None:
        """The thread's PER_THREAD elements of a full chunk into ``i_raw``."""
        V, NT = self.v.vec, self.v.threads
        with self.src.block(self.loop("i_u", self.v.per_thread // V)):
            self.src(f"i_e0 = {chunk} * {self.v.chunk} + i_u * {NT * V} + tid * {V}")
            kind = "vectorized" if vector else "unroll"
            with self.src.block(self.loop("i_v", V, kind)):
                self.src(f"{self.ta('i_raw', 'i_u * ' + str(V) + ' + i_v')} = X[i_row, i_e0 + i_v]")
            for k in range(self.m.n_cols):
                with self.src.block(self.loop("i_v", V, kind)):
                    self.src(f"{self.ta(f'i_craw{k}', 'i_u * ' + str(V) + ' + i_v')} = C{k}[i_e0 + i_v]")

    def load_tail(self) -> None:
        """The thread's elements of the last, partial chunk (zero past the row's end)."""
        zero = "T.uint16(0)" if (self.sim and self.v.dtype == "bfloat16") else f"T.cast(0, \"{self.v.dtype}\")"
        with self.src.block(self.loop("i_k", self.v.per_thread)):
            self.src(f"i_e = {self.elem_index('n_full', 'i_k')}")
            self.src(f"{self.ta('i_raw', 'i_k')} = T.if_then_else(i_e < L, X[i_row, i_e], {zero})")
            for k in range(self.m.n_cols):
                self.src(f"{self.ta(f'i_craw{k}', 'i_k')} = T.if_then_else(i_e < L, C{k}[i_e], {zero})")

    def update(self, chunk: str, tail: bool) -> None:
        """The engine's online form over the thread's elements of one chunk."""
        P = self.v.per_thread
        base = self.base_names()
        for i in range(self.n):
            self.src(f"{self.t(f's{i}_old')} = {self.t(f's{i}')}")
        for i, s in enumerate(self.m.states):
            acc = self.t("i_c")
            self.src(f"{acc} = {_neutral(s.op)}")
            with self.src.block(self.loop("i_k", P)):
                self.src(f"i_e = {self.elem_index(chunk, 'i_k')}")
                names = {**base, **self.state_names(), "x": self.widen(self.ta("i_raw", "i_k")),
                         "e": "T.cast(i_e, \"int64\")"}
                term = _rename(s.term, names)
                if tail:
                    term = f"T.if_then_else(i_e < L, {term}, {_neutral(s.op)})"
                self.src(f"{acc} = {_combine(s.op, acc, term)}")
            old = self.t(f"s{i}_old")
            if s.correction is not None:
                names = {**base, **self.state_names(), **{f"s{j}_old": self.t(f"s{j}_old") for j in range(self.n)}}
                c = _rename(s.correction, names)
                old = f"({old} * {c})" if s.kind == "mul" else f"({old} + {c})"
            self.src(f"{self.t(f's{i}')} = {_combine(s.op, old, acc)}")
            if s.guard:
                g = _rename(s.guard, {**base, **self.state_names()})
                self.src(f"{self.t(f's{i}_safe')} = {g}")
            else:
                self.src(f"{self.t(f's{i}_safe')} = {self.t(f's{i}')}")
        if self.m.select:
            self.offer(chunk, tail)

    # ---- the selection ---------------------------------------------------------------------------------
    def offer(self, chunk: str, tail: bool) -> None:
        """Offer the thread's elements of a chunk to its own list ``tk`` of the best entries, kept sorted
        (descending) as 64-bit keys: the key's order word (see ``order_word``) above ``0xFFFFFFFF - e`` (equal keys:
        the lower index is larger); 0 is an empty entry. The chunk's keys go to ``i_cand`` (0: not offered); only
        when one beats the thread's k-th entry (``i_thr``) does a loop insert them, best first, while they do: one
        copy of the branch-free insertion over the static list (registers) per load path, not one per element."""
        sel = self.m.select
        P = self.v.per_thread
        names = {**self.base_names()}
        ok, thr, best = self.t("i_ok"), self.t("i_thr"), self.t("i_best")
        tk, cand = (lambda q: self.ta("tk", q)), (lambda q: self.ta("i_cand", q))
        with self.src.block(self.loop("i_k", P)):
            self.src(f"i_e = {self.elem_index(chunk, 'i_k')}")
            names.update({"x": self.widen(self.ta("i_raw", "i_k")), "e": "T.cast(i_e, \"int64\")"})
            self.order_word(_rename(sel.key, names))
            self.src(f"{ok} = (T.cast({self.t('i_kb')}, \"uint64\") << T.uint64(32)) | "
                     "T.cast(T.uint32(4294967295) - T.cast(i_e, \"uint32\"), \"uint64\")")
            conds = (["i_e < L"] if tail else []) + ([_rename(sel.where, names)] if sel.where else [])
            value = f"T.if_then_else({' and '.join(conds)}, {ok}, T.uint64(0))" if conds else ok
            self.src(f"{cand('i_k')} = {value}")

        def chunk_best() -> None:
            self.src(f"{best} = {cand('0')}")
            with self.src.block(self.loop("i_k", f"1, {P}")):
                self.src(f"{best} = T.if_then_else({cand('i_k')} > {best}, {cand('i_k')}, {best})")

        chunk_best()
        with self.src.block(f"if {best} > {thr}"), self.src.block(f"for i_n in T.serial({P})"):
            chunk_best()
            with self.src.block(f"if {best} > {thr}"):
                # the list's loops are written out (static indices whatever the compiler unrolls: registers)
                for q in range(KCAP - 1, 0, -1):
                    self.src(f"{tk(q)} = T.if_then_else({tk(q)} > {best}, {tk(q)}, "
                             f"T.if_then_else({tk(q - 1)} > {best}, {best}, {tk(q - 1)}))")
                self.src(f"{tk(0)} = T.if_then_else({tk(0)} > {best}, {tk(0)}, {best})")
                for q in range(KCAP):
                    self.src(f"{thr} = T.if_then_else(i_kk == {q + 1}, {tk(q)}, {thr})")
                with self.src.block(self.loop("i_k", P)):
                    self.src(f"{cand('i_k')} = T.if_then_else({cand('i_k')} == {best}, T.uint64(0), {cand('i_k')})")

    def order_word(self, key: str) -> None:
        """``i_kb``: the uint32 order word of the float32 ``key``: larger keys larger, -0.0 as +0.0, NaN (1) below
        -inf (0x007FFFFF) and above an empty entry (0). Tested on the bits (TVM folds ``k != k``)."""
        kf, kb = self.t("i_kf"), self.t("i_kb")
        self.src(f"{kf} = {key}")
        self.src(f"{kb} = T.reinterpret({kf}, \"uint32\")")
        mag = f"({kb} & T.uint32(2147483647))"
        flip = f"({kb} ^ (T.reinterpret(T.reinterpret({kb}, \"int32\") >> 31, \"uint32\") | T.uint32(2147483648)))"
        self.src(f"{kb} = T.if_then_else({mag} > T.uint32(2139095040), T.uint32(1), "
                 f"T.if_then_else({mag} == T.uint32(0), T.uint32(2147483648), {flip}))")

    def select_rounds(self) -> None:
        """The row's k best entries from the threads' lists: per round, the largest head (a warp butterfly of
        64-bit maxima, one slot per warp in shared memory, every thread reads the warps' slots), whose owner
        pops it; the winners go to ``shw`` in order of rank (0: an empty entry)."""
        W = self.v.warps
        b, o, tk = self.t("i_b"), self.t("o_b"), lambda q: self.ta("tk", q)
        with self.src.block("for i_j in T.serial(i_kk)"):
            with self.threads():
                self.src(f"{b} = {tk('0')}")
            with self.src.block(self.loop("i_bf", 5)):
                with self.threads():
                    src = "i_b[tid ^ (16 >> i_bf)]" if self.sim else "T.shfl_xor(i_b, 16 >> i_bf)"
                    self.src(f"{o} = {src}")
                with self.threads():
                    self.src(f"{b} = T.if_then_else({o} > {b}, {o}, {b})")
            with self.threads(), self.src.block("if tid % 32 == 0"):
                self.src(f"shk[tid // 32] = {b}")
            if not self.sim:
                self.src("T.sync_threads()")
            with self.threads():
                self.src(f"{b} = shk[0]")
                for w in range(1, W):
                    self.src(f"{b} = T.if_then_else(shk[{w}] > {b}, shk[{w}], {b})")
                with self.src.block(f"if {tk('0')} == {b} and {b} != T.uint64(0)"):  # this thread's entry won
                    for q in range(KCAP - 1):
                        self.src(f"{tk(q)} = {tk(q + 1)}")
                    self.src(f"{tk(KCAP - 1)} = T.uint64(0)")
                with self.src.block("if tid == 0"):
                    self.src(f"shw[i_j] = {b}")
            if not self.sim:
                self.src("T.sync_threads()")

    def select_outputs(self) -> None:
        """Thread j < k writes the outputs of the entry of rank j: its element is read again (at its index) for the
        key and the payloads; the row's final states come from shared memory."""
        sel = self.m.select
        self.load_final_states()
        kv, kix = self.t("i_kv"), self.t("i_kix")
        with self.threads(), self.src.block("if tid < i_kk"):
            self.src(f"{self.t('i_b')} = shw[tid]")
            self.src(f"{kv} = -{INF}")
            self.src(f"{kix} = T.int64(-1)")
            for i in range(len(sel.payloads)):
                self.src(f"{self.t(f'i_kp{i}')} = T.float32(0.0)")
            with self.src.block(f"if {self.t('i_b')} != T.uint64(0)"):
                self.src(f"{kix} = T.cast(T.uint32(4294967295) - T.cast({self.t('i_b')} & T.uint64(4294967295), "
                         "\"uint32\"), \"int64\")")
                names = {**self.base_names(), "x": self.widen(f"X[i_row, {kix}]"), "e": kix}
                names.update({f"c{k}": self.widen(f"C{k}[{kix}]") for k in range(self.m.n_cols)})
                self.src(f"{kv} = {_rename(sel.key, names)}")
                for i, text in enumerate(sel.payloads):
                    self.src(f"{self.t(f'i_kp{i}')} = {_rename(text, names)}")
            names = {**self.base_names(), **self.state_names(), "kv": kv, "kix": kix, "j": "T.cast(tid, \"int64\")"}
            names.update({f"kp{i}": self.t(f"i_kp{i}") for i in range(len(sel.payloads))})
            for k, (text, dt) in enumerate(self.m.k_outputs):
                value = _rename(text, names)
                if dt != "float32":
                    value = f"T.cast({value}, \"{dt}\")"
                self.src(f"K{k}[i_row, tid] = {value}")

    def full_chunks(self, vector: bool) -> None:
        """This segment's full chunks [c_lo, c_hi) (one segment: all of them)."""
        with self.threads(), self.src.block(self.loop("i_cs", "c_hi - c_lo", "serial")):
            self.src("i_ch = c_lo + i_cs")
            self.load_chunk("i_ch", vector)
            self.update("i_ch", tail=False)

    def stream(self) -> None:
        V = self.v.vec
        with self.threads():
            for i, s in enumerate(self.m.states):
                self.src(f"{self.t(f's{i}')} = {_neutral(s.op)}")
            self.guards()
            if self.m.select:
                for q in range(KCAP):
                    self.src(f"{self.ta('tk', q)} = T.uint64(0)")
                self.src(f"{self.t('i_thr')} = T.uint64(0)")
            for k in range(self.m.n_index):
                self.src(f"{self.t(f'i_r{k}')} = R{k}[i_row]")
        self.segment_range()
        aligned = self.aligned()
        # the vector path: `ld % V == 0` is the whole condition of its own `if` (TileLang's vectorizer takes it
        # as a fact only then); the base pointer's alignment is tested inside it
        with self.src.block(f"if ld % {V} == 0"):
            with self.src.block(f"if {aligned}"):
                self.full_chunks(vector=True)
            with self.src.block("else"):
                self.full_chunks(vector=False)
        with self.src.block("else"):
            self.full_chunks(vector=False)
        with self.src.block(f"if i_seg == n_split - 1 and n_full * {self.v.chunk} < L"), self.threads():
            self.load_tail()
            self.update("n_full", tail=True)

    def segment_range(self) -> None:
        """Segment i_seg of n_split takes chunks [c_lo, c_hi) (cps per segment, from the host) and the last one the
        tail; a segment past the row's end keeps the neutral states (and writes nothing in a final pass)."""
        self.src(f"n_full = L // {self.v.chunk}")
        self.src("c_lo = T.min(i_seg * cps, n_full)")
        self.src("c_hi = T.min(c_lo + cps, n_full)")

    def aligned(self) -> str:
        """The base pointers of the row tensor and of every column tensor are 16-byte aligned."""
        ptrs = ["X[0, 0]"] + [f"C{k}[0]" for k in range(self.m.n_cols)]
        return " and ".join(f"T.reinterpret(T.address_of({p}), \"uint64\") % T.uint64(16) == T.uint64(0)"
                            for p in ptrs)

    # ---- the final pass (per-element outputs) ------------------------------------------------------
    def store_elems(self, chunk: str, tail: bool) -> None:
        """Per-element outputs of the thread's elements of one chunk (loaded in i_raw / i_craw<k>)."""
        names = {**self.base_names(), **self.state_names()}
        with self.src.block(self.loop("i_k", self.v.per_thread)):
            self.src(f"i_e = {self.elem_index(chunk, 'i_k')}")
            names.update({"x": self.widen(self.ta("i_raw", "i_k")), "e": "T.cast(i_e, \"int64\")"})
            ctx = self.src.block("if i_e < L") if tail else contextlib.nullcontext()
            with ctx:
                for k, (text, dt) in enumerate(self.m.elem_outputs):
                    value = _rename(text, names)
                    dt = self.v.dtype if dt == "row" else dt
                    if not self.sim and dt != "float32":
                        value = f"T.cast({value}, \"{dt}\")"
                    self.src(f"E{k}[i_row, i_e] = {value}")

    def final_pass_chunks(self, vector: bool, split: bool) -> None:
        """The full chunks of the final pass: all of them, or (split) this segment's [c_lo, c_hi)."""
        var, extent = ("i_cs", "c_hi - c_lo") if split else ("i_ch", "n_full")
        with self.threads(), self.src.block(self.loop(var, extent, "serial")):
            if split:
                self.src("i_ch = c_lo + i_cs")
            self.load_chunk("i_ch", vector)
            self.store_elems("i_ch", tail=False)

    def load_final_states(self, split: bool = False) -> None:
        """Every thread takes the row's final states: after a barrier, from shared memory (put there by thread 0);
        split: from slot 0 of the workspace (put there by the merge program)."""
        if not self.sim and not split:
            self.src("T.sync_threads()")
        with self.threads():
            for i in range(self.n):
                self.src(f"{self.t(f's{i}')} = {f'WS[{i}, i_row, 0]' if split else f'shf[{i}]'}")
            self.guards()
            for k in range(self.m.n_index):
                self.src(f"{self.t(f'i_r{k}')} = R{k}[i_row]")

    def final_pass(self, split: bool = False) -> None:
        """Every thread takes the row's final states (from shared memory; split: from the merge program's slot 0 of
        the workspace) and writes the per-element outputs of the row (split: of this segment)."""
        self.load_final_states(split)
        if split:
            self.segment_range()
        V = self.v.vec
        with self.src.block(f"if ld % {V} == 0"):
            with self.src.block(f"if {self.aligned()}"):
                self.final_pass_chunks(vector=True, split=split)
            with self.src.block("else"):
                self.final_pass_chunks(vector=False, split=split)
        with self.src.block("else"):
            self.final_pass_chunks(vector=False, split=split)
        last = "i_seg == n_split - 1 and " if split else ""
        with self.src.block(f"if {last}n_full * {self.v.chunk} < L"), self.threads():
            self.load_tail()
            self.store_elems("n_full", tail=True)

    # ---- the merge ------------------------------------------------------------------------------------
    def merge_pair(self, mine: dict[str, str], other: dict[str, str]) -> None:
        """``s<i>`` (this thread's) merged with the segment named by ``other``; the engine's merge form."""
        base = self.base_names()
        merged = {f"s{i}": self.t(f"n_s{i}") for i in range(self.n)}
        merged.update({f"s{i}_safe": self.t(f"n_s{i}_safe") for i in range(self.n)})
        for i, s in enumerate(self.m.states):
            seg_a = {f"s{j}_seg": mine[f"s{j}"] for j in range(self.n)}
            seg_b = {f"s{j}_seg": other[f"s{j}"] for j in range(self.n)}
            a = _rename(self.m.merge[i], {**base, **merged, **seg_a})
            b = _rename(self.m.merge[i], {**base, **merged, **seg_b})
            self.src(f"{self.t(f'n_s{i}')} = {_combine(s.op, a, b)}")
            g = _rename(s.guard, {**base, f"s{i}": self.t(f"n_s{i}")}) if s.guard else self.t(f"n_s{i}")
            self.src(f"{self.t(f'n_s{i}_safe')} = {g}")
        for i in range(self.n):
            self.src(f"{self.t(f's{i}')} = {self.t(f'n_s{i}')}")
            self.src(f"{self.t(f's{i}_safe')} = {self.t(f'n_s{i}_safe')}")

    def butterfly(self) -> None:
        mine = {f"s{i}": self.t(f"s{i}") for i in range(self.n)}
        other = {f"s{i}": self.t(f"o_s{i}") for i in range(self.n)}
        with self.src.block(self.loop("i_bf", 5)):
            with self.threads():
                for i in range(self.n):
                    src = f"s{i}[tid ^ (16 >> i_bf)]" if self.sim else f"T.shfl_xor(s{i}, 16 >> i_bf)"
                    self.src(f"{self.t(f'o_s{i}')} = {src}")
            with self.threads():
                self.merge_pair(mine, other)

    def across_warps(self) -> None:
        W = self.v.warps
        with self.threads(), self.src.block("if tid % 32 == 0"):
            for i in range(self.n):
                self.src(f"sh[{i}, tid // 32] = {self.t(f's{i}')}")
        if not self.sim:
            self.src("T.sync_threads()")
        # thread 0 merges the warps' states in warp order, then writes the outputs
        with self.threads(1), self.src.block("if tid == 0"):
            if W > 1:
                mine = {f"s{i}": self.t(f"s{i}") for i in range(self.n)}
                other = {f"s{i}": f"sh[{i}, i_w]" for i in range(self.n)}
                with self.src.block(self.loop("i_w", f"1, {W}", "serial")):
                    self.merge_pair(mine, other)
            if self.m.whole_row:  # never split (n_split == 1): the outputs, and the final states for all threads
                self.outputs()
                for i in range(self.n):
                    self.src(f"shf[{i}] = {self.t(f's{i}')}")
                return
            with self.src.block("if n_split == 1"):
                self.outputs()
                for i in range(self.n if self.m.elem_outputs else 0):  # the final states for the final pass
                    self.src(f"shf[{i}] = {self.t(f's{i}')}")
            with self.src.block("else"):  # a segment of a split row: its states, for the merge program
                for i in range(self.n):
                    self.src(f"WS[{i}, i_row, i_seg] = {self.t(f's{i}')}")

    def outputs(self) -> None:
        names = {**self.base_names(), **self.state_names()}
        for k, text in enumerate(self.m.outputs):
            self.src(f"O{k}[i_row] = {_rename(text, names)}")

    def merge_segments(self) -> None:
        """The merge program's row: the segments' states merged in order, then the outputs."""
        with self.threads(1):
            for k in range(self.m.n_index):
                self.src(f"{self.t(f'i_r{k}')} = R{k}[i_row]")
            for i in range(self.n):
                self.src(f"{self.t(f's{i}')} = WS[{i}, i_row, 0]")
            self.guards()
            mine = {f"s{i}": self.t(f"s{i}") for i in range(self.n)}
            other = {f"s{i}": f"WS[{i}, i_row, i_p]" for i in range(self.n)}
            with self.src.block(self.loop("i_p", "1, n_split", "serial")):
                self.merge_pair(mine, other)
            self.outputs()
            for i in range(self.n if self.m.elem_outputs else 0):  # the row's final states, for the final program
                self.src(f"WS[{i}, i_row, 0] = {self.t(f's{i}')}")

    # ---- the whole program --------------------------------------------------------------------------
    def emit(self, symbol: str, mode: str = "stream") -> str:
        """``mode``: "stream" (the row kernel), "merge" (split rows' segments merged) or "final" (the final pass of
        split rows with per-element outputs)."""
        m, v = self.m, self.v
        merge = mode == "merge"
        self.declare_states("")
        self.declare_states("n_")
        for i in range(self.n):
            self.decl(f"s{i}_old", "float32")
            self.decl(f"o_s{i}", "float32")
        self.decl("i_c", "float32")
        raw_dt = "uint16" if (self.sim and v.dtype == "bfloat16") else v.dtype
        self.decl("i_raw", raw_dt, v.per_thread)
        for k in range(m.n_cols):
            self.decl(f"i_craw{k}", raw_dt, v.per_thread)
        for k in range(m.n_index):
            self.decl(f"i_r{k}", "int64")
        if m.select and not merge:
            self.decl("tk", "uint64", KCAP)
            self.decl("i_cand", "uint64", v.per_thread)
            for nm, dt in (("i_ok", "uint64"), ("i_thr", "uint64"), ("i_best", "uint64"), ("i_b", "uint64"), ("o_b", "uint64"),
                           ("i_kf", "float32"), ("i_kb", "uint32"), ("i_kv", "float32"), ("i_kix", "int64")):
                self.decl(nm, dt)
            for i in range(len(m.select.payloads)):
                self.decl(f"i_kp{i}", "float32")
            self.src(f"i_kk = T.min(kd, {KCAP})")
        if merge:
            with self.src.block("if i_row < n_rows"):
                self.merge_segments()
        elif mode == "final":
            self.final_pass(split=True)
        else:
            self.stream()
            self.butterfly()
            self.across_warps()
            if m.elem_outputs:  # split rows take the merge and final programs instead
                with self.src.block("if n_split == 1"):
                    self.final_pass()
            if m.select:
                self.select_rounds()
                self.select_outputs()
        body = self.src.lines

        params = [] if merge else [f"X: T.Tensor((n_rows, ld), \"{raw_dt}\")"]
        params += [f"R{k}: T.Tensor((n_rows,), \"int64\")" for k in range(m.n_index)]
        if mode != "final":
            params += [f"O{k}: T.Tensor((n_rows,), \"float32\")" for k in range(len(m.outputs))]
        params += [f"WS: T.Tensor(({self.n}, n_rows, n_split), \"float32\")"]
        if not merge:
            params += [f"C{k}: T.Tensor((lo,), \"{raw_dt}\")" for k in range(m.n_cols)]
            params += [f"E{k}: T.Tensor((n_rows, lo), \"{'float32' if self.sim else dt.replace('row', v.dtype)}\")"
                       for k, (_, dt) in enumerate(m.elem_outputs)]
            params += [f"K{k}: T.Tensor((n_rows, kd), \"{dt}\")" for k, (_, dt) in enumerate(m.k_outputs)]
        params += ["L: T.int32"] + ([] if merge else ["cps: T.int32"])
        params += [f"ip{k}: T.int64" for k in range(m.n_iparams)]
        params += [f"fp{k}: T.float32" for k in range(m.n_fparams)]
        backend = "cpu_sim" if self.sim else "cuda"
        out = _Src()
        out(f"# Generated by redfuser-ops {TEMPLATE_VERSION} from generator/codegen/templates/stream_row.py; do not edit.")
        out(f"# variant: dtype={v.dtype} family={v.family} threads={v.threads} per_thread={v.per_thread} "
            f"vec={v.vec} backend={backend}")
        out("import tilelang.language as T")
        out("")
        out(f"KERNEL_SYMBOL = {symbol!r}")
        out(f"BACKEND = {backend!r}")
        out(f"TARGET_ARCH = {(_ARCH[v.family] if not self.sim else 'c')!r}")
        out(f"THREADS = {v.threads if not self.sim else 1}")
        dims = "n_rows, n_split" if merge else "n_rows, ld, n_split"
        if not merge and (m.n_cols or m.elem_outputs):
            dims += ", lo"  # the row length as a tensor extent: column tensors and per-element outputs (contiguous)
        if not merge and m.k_outputs:
            dims += ", kd"  # the entries of a row's selection: the outputs' second extent (contiguous rows)
        out(f"PARAM_ORDER = {tuple(p.split(':')[0] for p in params)!r}  # then {dims}, then the stream")
        out("PASS_CONFIGS = {}")
        out("")
        out("")
        out("def make_prim_func():")
        out.depth = 1
        out(f"{dims} = T.dynamic(\"{dims}\")")
        out("")
        out("@T.prim_func")
        out(f"def {symbol}(")
        for p in params:
            out(f"    {p},")
        out("):")
        out.depth = 2
        if merge:  # a thread per row
            if self.sim:
                out("with T.Kernel(n_rows, threads=1) as bx:")
                out.depth = 3
                out("i_row = bx")
            else:
                out(f"with T.Kernel(T.ceildiv(n_rows, {MERGE_ROWS}), threads={MERGE_ROWS}) as bx:")
                out.depth = 3
                out(f"i_row = bx * {MERGE_ROWS} + T.get_thread_binding(0)")
        else:  # a CTA per (segment, row)
            out(f"with T.Kernel(n_rows, n_split, threads={1 if self.sim else v.threads}) as (bx, by):")
            out.depth = 3
            out("i_row = bx")
            out("i_seg = by")
            if not self.sim:
                out("tid = T.get_thread_binding(0)")
                out(f"sh = T.alloc_shared(({self.n}, {v.warps}), \"float32\")")
                if m.whole_row or m.elem_outputs:
                    out(f"shf = T.alloc_shared(({self.n},), \"float32\")")
                if m.select:
                    out(f"shk = T.alloc_shared(({v.warps},), \"uint64\")")
                    out(f"shw = T.alloc_shared(({KCAP},), \"uint64\")")
            else:
                out(f"sh = T.alloc_local(({self.n}, {v.warps}), \"float32\")")
                if m.whole_row or m.elem_outputs:
                    out(f"shf = T.alloc_local(({self.n},), \"float32\")")
                if m.select:
                    out(f"shk = T.alloc_local(({v.warps},), \"uint64\")")
                    out(f"shw = T.alloc_local(({KCAP},), \"uint64\")")
        for nm in sorted(self.decls):
            dt, n = self.decls[nm]
            if self.sim:
                shape = f"({v.threads},)" if n is None else f"({v.threads}, {n})"
                out(f"{nm} = T.alloc_local({shape}, \"{dt}\")")
            elif n is None:
                out(f"{nm} = T.alloc_var(\"{dt}\")")
            else:
                out(f"{nm} = T.alloc_local(({n},), \"{dt}\")")
        out.lines += body
        out.depth = 1
        out("")
        out(f"return {symbol}")
        return "\n".join(out.lines) + "\n"


def emit_stream_row_merge(math: RowMath, variant: StreamVariant, symbol: str, backend: str = "cuda") -> str:
    """The merge program of split rows: a thread per row merges the n_split segments' states (WS) by the engine's
    merge form, in segment order, and writes the outputs. Arguments: R<k>, O<k>, WS, L, the parameters; the
    launcher appends n_rows and n_split, then the stream."""
    if not symbol.isidentifier():
        raise ValueError(f"symbol {symbol!r} is not an identifier")
    if math.whole_row:
        raise ValueError("stream_row: a cascade with a selection runs one CTA per row (no merge program)")
    return _Emitter(math, variant, backend).emit(symbol, mode="merge")


def emit_stream_row_final(math: RowMath, variant: StreamVariant, symbol: str, backend: str = "cuda") -> str:
    """The final pass of split rows with per-element outputs: grid (n_rows, n_split) like the row kernel; each CTA
    takes its row's final states from slot 0 of the workspace (written there by the merge program) and writes the
    per-element outputs of its segment's chunks (the last segment: the tail too). Arguments: X, R<k>, WS, C<k>,
    E<k>, L, cps, the parameters; the launcher appends n_rows, ld, n_split and lo, then the stream."""
    if not symbol.isidentifier():
        raise ValueError(f"symbol {symbol!r} is not an identifier")
    if not math.elem_outputs or math.whole_row:
        raise ValueError("stream_row: a final program writes the per-element outputs of split rows")
    return _Emitter(math, variant, backend).emit(symbol, mode="final")


def emit_stream_row_program(math: RowMath, variant: StreamVariant, symbol: str, backend: str = "cuda") -> str:
    """Python source (a module with ``make_prim_func()``) of one variant.

    Kernel arguments in order: the row tensor X (n_rows, ld) (ld: the row stride, in elements), the per-row index
    tensors R<k> (int64), the outputs O<k> (float32), the segments' states WS (states, n_rows, n_split), L (the row
    length), cps (full chunks per segment), the int64 and float32 parameters; the launcher appends n_rows, ld and
    n_split, then the stream. The grid is (n_rows, n_split): with n_split == 1 each CTA writes its row's outputs
    (WS is not touched), else the states of its segment into WS for the merge program."""
    if not symbol.isidentifier():
        raise ValueError(f"symbol {symbol!r} is not an identifier")
    return _Emitter(math, variant, backend).emit(symbol)
