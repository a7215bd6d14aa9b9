"""An interpreter of TileLang frontend programs: runs the PrimFunc that ``@T.prim_func`` builds (before any lowering
pass) on the CPU with numpy, so that the program text a template emits is what a test executes.

TileLang's own CPU route (the ``"c"`` target) cannot lower tile programs with fragments and ``T.gemm`` (layout
inference fails), so this walks the frontend TIR instead:

- the grid: ``T.Kernel``'s ``blockIdx`` bindings become loops over every block, in order (blocks share nothing but
  global memory, so any order is a valid schedule); thread indices are refused where a program reads them;
- inside a block, ``T.Parallel`` nests run vectorised: each loop variable is bound to an index array on its own
  axis (``arange(n)`` broadcast), so one numpy operation does a whole tile; ``T.serial``/``T.Pipelined`` run in
  order (software pipelining does not change the result of a correct program);
- buffers: global tensors are the caller's numpy arrays, read through their strides; ``alloc_shared``/
  ``alloc_fragment``/``alloc_local`` get fresh arrays per block, filled with NaN (ints: a huge sentinel) so that a
  read before a write shows up in the result;
- values are float32/int64 numpy arrays; every value of a narrower float type (float16, bfloat16, float8_e4m3fn)
  is rounded to that type where the program casts to it or stores it (round to nearest even, e4m3 saturating at
  448 as CUDA's ``satfinite`` conversion); ``T.max``/``T.min`` on floats and max reductions ignore NaN operands as
  CUDA's ``fmaxf``/``fminf`` do;
- tile ops: ``T.copy`` (region to region; out-of-range elements of a global source read as 0 and out-of-range
  elements of a global destination are not written, as TileLang's bounds-checked copies and TMA do), ``T.fill``,
  ``T.gemm`` (float64 products, float32 accumulator), ``T.reduce_*``; ``T.assume`` is checked, so a test that breaks
  a kernel's assumption fails instead of passing by luck;
- every explicit load and store of a global tensor is bounds-checked per dimension on the lanes that execute it
  (``T.if_then_else`` evaluates only the branch each lane takes; an ``if`` masks its body): an access out of
  range raises :class:`OutOfBounds`.

What it does not model: data races between threads of a block (a tile program has none at this level: the
compiler inserts the barriers), the exact rounding of CUDA's fast-math intrinsics, and the tensor cores'
accumulation order.
"""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np

INT_POISON = -(1 << 40)


class InterpError(RuntimeError):
    """The program does something the interpreter does not model, or breaks one of its own assumptions."""


class OutOfBounds(InterpError):
    """An explicit load or store of a global tensor outside its shape."""


# ------------------------------------------------------------------------------------------------- numbers


def is_float(dtype: str) -> bool:
    return dtype.startswith(("float", "bfloat"))


def round_to(dtype: str, x):
    """``x`` (float32 values) rounded to ``dtype``, kept as float32 (or int64 for ints, bool for bools)."""
    if dtype == "float32":
        return np.float32(x) if np.ndim(x) == 0 else np.asarray(x, np.float32)
    if dtype == "float16":
        return np.asarray(x, np.float32).astype(np.float16).astype(np.float32)
    if dtype == "bfloat16":
        return np.asarray(x, np.float32).astype(ml_dtypes.bfloat16).astype(np.float32)
    if dtype == "float8_e4m3fn":
        a = np.asarray(x, np.float32)
        a = np.where(np.isnan(a), a, np.clip(a, -448.0, 448.0))  # satfinite: no NaN from overflow
        return a.astype(ml_dtypes.float8_e4m3fn).astype(np.float32)
    if dtype == "float64":
        return np.float64(x) if np.ndim(x) == 0 else np.asarray(x, np.float64)
    if dtype == "bool":
        return bool(x) if np.ndim(x) == 0 else np.asarray(x, bool)
    if dtype.startswith(("int", "uint")):
        if np.ndim(x) == 0:
            return int(np.trunc(x)) if isinstance(x, (float, np.floating)) else int(x)
        a = np.asarray(x)
        return (np.trunc(a) if a.dtype.kind == "f" else a).astype(np.int64)
    raise InterpError(f"dtype {dtype} is not modelled")


def storage(dtype: str):
    if is_float(dtype):
        return np.float32
    if dtype == "bool":
        return np.bool_
    return np.int64


def _truncdiv(a, b):
    if np.ndim(a) == 0 and np.ndim(b) == 0:
        q = abs(int(a)) // abs(int(b))
        return q if (a >= 0) == (b > 0) else -q
    a, b = np.asarray(a, np.int64), np.asarray(b, np.int64)
    q = np.abs(a) // np.abs(b)
    return np.where((a >= 0) == (b > 0), q, -q)


def _truncmod(a, b):
    return a - _truncdiv(a, b) * b


def _fmax(a, b):
    if isinstance(a, (int, np.integer)) and isinstance(b, (int, np.integer)):
        return max(a, b)
    if _is_int_value(a) and _is_int_value(b):
        return np.maximum(a, b)
    return np.fmax(a, b)


def _fmin(a, b):
    if isinstance(a, (int, np.integer)) and isinstance(b, (int, np.integer)):
        return min(a, b)
    if _is_int_value(a) and _is_int_value(b):
        return np.minimum(a, b)
    return np.fmin(a, b)


def _is_int_value(x) -> bool:
    return isinstance(x, (int, np.integer)) or (isinstance(x, np.ndarray) and x.dtype.kind in "iu")


def _land(a, b):
    if np.ndim(a) == 0 and np.ndim(b) == 0:
        return bool(a) and bool(b)
    return np.logical_and(a, b)


def _lor(a, b):
    if np.ndim(a) == 0 and np.ndim(b) == 0:
        return bool(a) or bool(b)
    return np.logical_or(a, b)


def _narrow(mask, cond):
    """The lanes of ``mask`` where ``cond`` holds (True = every lane)."""
    if mask is True:
        return cond
    return np.logical_and(mask, cond)


def _any(mask) -> bool:
    return bool(np.any(mask))


def _select(cond, a, b):
    if np.ndim(cond) == 0:
        return a if cond else b
    return np.where(cond, a, b)


_MATH: dict[str, Callable] = {
    "tirx.exp": np.exp, "tirx.exp2": np.exp2, "tirx.log": np.log, "tirx.log2": np.log2, "tirx.tanh": np.tanh,
    "tirx.sqrt": np.sqrt, "tirx.fabs": np.abs, "tirx.floor": np.floor, "tirx.ceil": np.ceil, "tirx.sin": np.sin,
    "tirx.cos": np.cos, "tirx.rsqrt": lambda x: 1 / np.sqrt(x), "tirx.sigmoid": lambda x: 1 / (1 + np.exp(-x)),
    "tirx.log1p": np.log1p, "tirx.exp10": lambda x: np.power(np.float32(10), x), "tirx.erf": None,
}
_NO_OPS = {"tl.fence_proxy_async", "tl.annotate_producer_reg_dealloc", "tl.annotate_consumer_reg_alloc",
           "tl.annotate_layout", "tl.annotate_padding", "tl.use_swizzle", "tl.disable_warp_group_reg_alloc",
           "tl.no_set_max_nreg", "tirx.tvm_storage_sync", "tl.sync_threads"}


# --------------------------------------------------------------------------------------------- buffers


@dataclass
class GlobalBuf:
    name: str
    flat: np.ndarray  # 1-D view over the memory the caller's array spans
    shape: tuple[int, ...]
    strides: tuple[int, ...]
    offset: int
    dtype: str


@dataclass
class LocalBuf:
    name: str
    data: np.ndarray
    dtype: str


def _flat_view(a: np.ndarray) -> np.ndarray:
    """A 1-D view of the elements a strided array spans (strides must be non-negative)."""
    st = [s // a.itemsize for s in a.strides]
    if any(s < 0 for s in st) or any(s * a.itemsize != b for s, b in zip(st, a.strides)):
        raise InterpError("arrays with negative or misaligned strides are not supported")
    span = 1 + sum((n - 1) * s for n, s in zip(a.shape, st)) if a.size else 0
    return np.lib.stride_tricks.as_strided(a, shape=(span,), strides=(a.itemsize,))


# ----------------------------------------------------------------------------------------- interpreter


class _State:
    """What one run sees: variable values and buffers (keyed by the buffer's data var)."""

    def __init__(self):
        self.vars: dict = {}
        self.bufs: dict = {}
        self.stats = {"blocks": 0, "tile_ops": 0}


class Interpreter:
    """Compiles a frontend PrimFunc once into closures; :meth:`run` executes it on numpy arrays."""

    def __init__(self, func, name: str | None = None):
        from tvm import tirx  # deferred: importing tvm costs seconds

        self.tirx = tirx
        self.func = func
        self.name = name or (str(func.attrs["global_symbol"]) if func.attrs else "prim_func")
        self._par_depth = 0  # depth of the enclosing T.Parallel nest while compiling
        self._par_total = 0
        self.body = self._stmt(func.body)

    # ----------------------------------------------------------------------------------- expressions
    def _expr(self, e) -> Callable[[_State, Any], Any]:
        t = self.tirx
        if isinstance(e, t.IntImm):
            v = bool(e.value) if str(e.dtype) == "bool" else int(e.value)
            return lambda s, m: v
        if isinstance(e, t.FloatImm):
            v = round_to(str(e.dtype), e.value) if str(e.dtype) != "float64" else float(e.value)
            return lambda s, m: v
        if isinstance(e, t.StringImm):
            v = e.value
            return lambda s, m: v
        if isinstance(e, t.Var):
            var = e

            def ev_var(s, m):
                try:
                    v = s.vars[var]
                except KeyError:
                    raise InterpError(f"{self.name}: variable {var.name} read before it is bound") from None
                if v is _THREAD:
                    raise InterpError(f"{self.name}: the program reads a thread index ({var.name}); only tile "
                                      "programs are modelled")
                return v

            return ev_var
        if isinstance(e, t.Cast):
            dt = str(e.dtype)
            a = self._expr(e.value)
            return lambda s, m: round_to(dt, a(s, m))
        binops = {
            t.Add: lambda x, y: x + y, t.Sub: lambda x, y: x - y, t.Mul: lambda x, y: x * y,
            t.FloorDiv: lambda x, y: x // y, t.FloorMod: lambda x, y: x % y, t.Mod: _truncmod,
            t.Min: _fmin, t.Max: _fmax, t.EQ: lambda x, y: x == y, t.NE: lambda x, y: x != y,
            t.LT: lambda x, y: x < y, t.LE: lambda x, y: x <= y, t.GT: lambda x, y: x > y,
            t.GE: lambda x, y: x >= y, t.And: _land, t.Or: _lor,
        }
        for cls, fn in binops.items():
            if isinstance(e, cls):
                return self._binop(e, fn)
        if isinstance(e, t.Div):
            fn = _truncdiv if not is_float(str(e.dtype)) else (lambda x, y: x / y)
            return self._binop(e, fn)
        if isinstance(e, t.Not):
            a = self._expr(e.a)
            return lambda s, m: (not a(s, m)) if np.ndim(a(s, m)) == 0 else np.logical_not(a(s, m))
        if isinstance(e, t.Select):
            c, a, b = self._expr(e.condition), self._expr(e.true_value), self._expr(e.false_value)
            return lambda s, m: _select(c(s, m), a(s, m), b(s, m))
        if isinstance(e, t.BufferLoad):
            return self._load(e)
        if isinstance(e, t.Call):
            return self._call(e)
        raise InterpError(f"{self.name}: expression {type(e).__name__} is not modelled: {e}")

    def _binop(self, e, fn):
        a, b = self._expr(e.a), self._expr(e.b)
        dt = str(e.dtype)
        narrow = dt in ("float16", "bfloat16", "float8_e4m3fn")
        if narrow:
            return lambda s, m: round_to(dt, fn(a(s, m), b(s, m)))
        return lambda s, m: fn(a(s, m), b(s, m))

    def _call(self, e):
        op = str(e.op.name)
        dt = str(e.dtype)
        args = [self._expr(x) if not isinstance(x, self.tirx.StringImm) else None for x in e.args]
        if op == "tirx.if_then_else":
            c, a, b = args

            def ite(s, m):
                cond = c(s, m)
                if np.ndim(cond) == 0:
                    return a(s, m) if cond else b(s, m)
                ma, mb = _narrow(m, cond), _narrow(m, np.logical_not(cond))
                va = a(s, ma) if _any(ma) else None
                vb = b(s, mb) if _any(mb) else None
                if va is None:
                    return vb
                if vb is None:
                    return va
                return np.where(cond, va, vb)

            return ite
        if op == "tl.infinity":
            v = round_to(dt, np.inf)
            return lambda s, m: v
        if op in _MATH and _MATH[op] is not None:
            fn = _MATH[op]
            (a,) = args
            if is_float(dt) and dt != "float64":
                return lambda s, m: round_to(dt, fn(np.float32(a(s, m)) if np.ndim(a(s, m)) == 0 else a(s, m)))
            return lambda s, m: fn(a(s, m))
        if op == "tirx.pow":
            a, b = args
            return lambda s, m: round_to(dt, np.power(a(s, m), b(s, m)))
        if op == "tl.launch_thread_idx":
            return lambda s, m: _THREAD
        raise InterpError(f"{self.name}: call {op} is not modelled")

    def _load(self, e):
        buf = e.buffer
        key = buf.data
        idx = [self._expr(i) for i in e.indices]
        name = buf.name

        def load(s, m):
            b = s.bufs.get(key)
            if b is None:
                raise InterpError(f"{self.name}: buffer {name} is not allocated here")
            ii = [f(s, m) for f in idx]
            return _read(b, ii, m)

        return load

    # ------------------------------------------------------------------------------------ statements
    def _stmt(self, st) -> Callable[[_State, Any], None]:
        t = self.tirx
        if isinstance(st, t.SeqStmt):
            parts = [self._stmt(x) for x in st.seq]

            def seq(s, m):
                for p in parts:
                    p(s, m)

            return seq
        if isinstance(st, t.SBlockRealize):
            return self._block(st.block)
        if isinstance(st, t.Bind):
            var, val = st.var, self._expr(st.value)

            def bind(s, m):
                s.vars[var] = val(s, m)

            return bind
        if isinstance(st, t.For):
            return self._for(st)
        if isinstance(st, t.IfThenElse):
            return self._if(st)
        if isinstance(st, t.BufferStore):
            return self._store(st)
        if isinstance(st, t.Evaluate):
            return self._evaluate(st)
        if isinstance(st, t.AttrStmt):
            body = self._stmt(st.body)
            return body
        if isinstance(st, (t.AllocBuffer, t.DeclBuffer)):
            buf = st.buffer

            def alloc(s, m):
                _alloc(s, buf, self._const_shape(buf))

            return alloc if isinstance(st, t.AllocBuffer) else (lambda s, m: None)
        raise InterpError(f"{self.name}: statement {type(st).__name__} is not modelled")

    def _const_shape(self, buf) -> tuple[int, ...]:
        try:
            return tuple(int(x) for x in buf.shape)
        except TypeError:
            raise InterpError(f"{self.name}: buffer {buf.name} has a symbolic shape {buf.shape}") from None

    def _block(self, blk):
        allocs = [(b, self._const_shape(b)) for b in blk.alloc_buffers]
        if len(blk.match_buffers):
            raise InterpError(f"{self.name}: match_buffer inside a block is not modelled")
        body = self._stmt(blk.body)
        init = self._stmt(blk.init) if blk.init is not None else None
        if init is not None:
            raise InterpError(f"{self.name}: block init is not modelled")

        def block(s, m):
            for b, shape in allocs:
                _alloc(s, b, shape)
            body(s, m)

        return block

    def _for(self, st):
        t = self.tirx
        var = st.loop_var
        lo, ext = self._expr(st.min), self._expr(st.extent)
        kind = int(st.kind)
        if kind == int(t.ForKind.THREAD_BINDING):
            tag = str(st.thread_binding.thread_tag)
            if not tag.startswith("blockIdx"):
                raise InterpError(f"{self.name}: thread binding {tag} is not modelled (tile programs only)")
            body = self._stmt(st.body)

            def grid(s, m):
                a, n = lo(s, m), ext(s, m)
                for v in range(a, a + n):
                    s.vars[var] = v
                    if not _inner_grid(st.body, t):
                        s.stats["blocks"] += 1
                    body(s, m)

            return grid
        if kind == int(t.ForKind.PARALLEL):
            outer = self._par_depth == 0
            if outer:
                self._par_total = _parallel_depth(st, t)
            axis, total = self._par_depth, self._par_total
            self._par_depth += 1
            try:
                body = self._stmt(st.body)
            finally:
                self._par_depth -= 1

            def par(s, m):
                a, n = lo(s, m), ext(s, m)
                if np.ndim(a) or np.ndim(n):
                    raise InterpError(f"{self.name}: a T.Parallel extent depends on a parallel index")
                shape = [1] * total
                shape[axis] = n
                s.vars[var] = (a + np.arange(n, dtype=np.int64)).reshape(shape)
                body(s, m)

            return par
        body = self._stmt(st.body)

        def serial(s, m):
            a, n = lo(s, m), ext(s, m)
            if np.ndim(a) or np.ndim(n):
                raise InterpError(f"{self.name}: a serial loop's bounds depend on a parallel index")
            for v in range(int(a), int(a) + int(n)):
                s.vars[var] = v
                body(s, m)

        return serial

    def _if(self, st):
        c = self._expr(st.condition)
        then = self._stmt(st.then_case)
        other = self._stmt(st.else_case) if st.else_case is not None else None

        def branch(s, m):
            cond = c(s, m)
            if np.ndim(cond) == 0:
                if cond:
                    then(s, m)
                elif other is not None:
                    other(s, m)
                return
            mt = _narrow(m, cond)
            if _any(mt):
                then(s, mt)
            if other is not None:
                mf = _narrow(m, np.logical_not(cond))
                if _any(mf):
                    other(s, mf)

        return branch

    def _store(self, st):
        buf = st.buffer
        key, name = buf.data, buf.name
        idx = [self._expr(i) for i in st.indices]
        val = self._expr(st.value)

        def store(s, m):
            b = s.bufs.get(key)
            if b is None:
                raise InterpError(f"{self.name}: buffer {name} is not allocated here")
            _write(b, [f(s, m) for f in idx], val(s, m), m)

        return store

    def _evaluate(self, st):
        t = self.tirx
        e = st.value
        if not isinstance(e, t.Call):
            f = self._expr(e)
            return lambda s, m: (f(s, m), None)[1]
        op = str(e.op.name)
        if op in _NO_OPS:
            return lambda s, m: None
        if op == "tirx.assume":
            c = self._expr(e.args[0])
            text = str(e.args[0])

            def assume(s, m):
                if not np.all(c(s, m)):
                    raise InterpError(f"{self.name}: the program assumes {text}, which does not hold here")

            return assume
        if op == "tl.tileop.copy":
            src, dst = self._region(e.args[0]), self._region(e.args[1])
            return self._tile(lambda s: _copy(src(s), dst(s)))
        if op == "tl.tileop.fill":
            dst, val = self._region(e.args[0]), self._expr(e.args[1])
            return self._tile(lambda s: _fill(dst(s), val(s, True)))
        if op == "tl.tileop.gemm":
            a, b, c = (self._region(x) for x in e.args[:3])
            ta, tb = bool(e.args[3]), bool(e.args[4])
            clear = self._expr(e.args[9])
            return self._tile(lambda s: _gemm(a(s), b(s), c(s), ta, tb, bool(clear(s, True))))
        if op == "tl.tileop.reduce":
            src, dst = self._region(e.args[0]), self._region(e.args[1])
            kind, dim, clear = str(e.args[2].value), int(e.args[3]), self._expr(e.args[4])
            return self._tile(lambda s: _reduce(src(s), dst(s), kind, dim, bool(clear(s, True))))
        raise InterpError(f"{self.name}: call {op} is not modelled")

    def _tile(self, fn):
        def tile(s, m):
            if m is not True:
                raise InterpError(f"{self.name}: a tile op under a per-lane condition is not modelled")
            s.stats["tile_ops"] += 1
            fn(s)

        return tile

    def _region(self, e):
        """A ``tl.region(buf[base...], access, extents...)`` argument (or a bare buffer load) as a closure giving
        (buffer state, base indices, extents)."""
        t = self.tirx
        if isinstance(e, t.Call) and str(e.op.name) == "tl.region":
            load = e.args[0]
            exts = [self._expr(x) for x in e.args[2:]]
        elif isinstance(e, t.BufferLoad):
            load, exts = e, [(lambda s, m: 1) for _ in e.indices]
        else:
            raise InterpError(f"{self.name}: tile-op argument {e} is not modelled")
        key, name = load.buffer.data, load.buffer.name
        base = [self._expr(i) for i in load.indices]

        def region(s):
            b = s.bufs.get(key)
            if b is None:
                raise InterpError(f"{self.name}: buffer {name} is not allocated here")
            return b, [int(f(s, True)) for f in base], [int(f(s, True)) for f in exts]

        return region

    # ------------------------------------------------------------------------------------------ run
    def run(self, *args, **kwargs) -> dict:
        """Run the program with its parameters in order (numpy arrays for buffers, numbers for scalars) or by
        name (a buffer's name, also where the parameter is a pointer that ``T.make_tensor`` views). Buffer shapes and strides bind the dynamic dimensions they name (and are checked against those
        given as scalars). Float buffers must be float32 arrays (holding values of the buffer's type), int ones
        int32/int64. Returns counters (blocks run, tile ops executed)."""
        t = self.tirx
        f = self.func
        names = param_names(f)
        given = dict(zip(names, args))
        for k, v in kwargs.items():
            if k in given:
                raise TypeError(f"parameter {k} given twice")
            given[k] = v
        missing = [n for n in names if n not in given]
        if missing:
            raise TypeError(f"{self.name}: missing parameters {missing}")
        s = _State()
        bufs = []
        for p, pname in zip(f.params, names):
            v = given[pname]
            if p in f.buffer_map:
                bufs.append((f.buffer_map[p], v))
            else:
                s.vars[p] = round_to(str(p.dtype), v)
        # bind dynamic dims from the arrays: plain vars first, then `var * c` strides, then check everything
        for buf, arr in bufs:
            if not isinstance(arr, np.ndarray):
                raise TypeError(f"{self.name}: {buf.name} must be a numpy array")
            want = storage(str(buf.dtype))
            if arr.dtype != want and not (want is np.int64 and arr.dtype == np.int32):
                raise TypeError(f"{self.name}: {buf.name} ({buf.dtype}) must be given as {np.dtype(want)}")
            if arr.ndim != len(buf.shape):
                raise ValueError(f"{self.name}: {buf.name} has {arr.ndim} dims, the program {len(buf.shape)}")
            st = tuple(x // arr.itemsize for x in arr.strides)
            for ex, val in list(zip(buf.shape, arr.shape)) + list(zip(buf.strides, st)):
                _unify(s, ex, val, t)
        for buf, arr in bufs:
            shape = tuple(int(self._expr(x)(s, True)) for x in buf.shape)
            if shape != arr.shape:
                raise ValueError(f"{self.name}: {buf.name} has shape {arr.shape}, the program expects {shape}")
            if len(buf.strides):
                strides = tuple(int(self._expr(x)(s, True)) for x in buf.strides)
                st = tuple(x // arr.itemsize for x in arr.strides)
                if any(a != b for a, b, n in zip(strides, st, shape) if n > 1):
                    raise ValueError(f"{self.name}: {buf.name} has strides {st}, the program expects {strides}")
            else:
                strides = tuple(x // arr.itemsize for x in arr.strides)
            s.bufs[buf.data] = GlobalBuf(buf.name, _flat_view(arr), shape, strides, int(self._expr(buf.elem_offset)(s, True)),
                                         str(buf.dtype))
        with np.errstate(all="ignore"):  # IEEE results as the GPU gives them (lanes a select drops compute too)
            self.body(s, True)
        return s.stats


_THREAD = object()


def param_names(func) -> list[str]:
    """The names :meth:`Interpreter.run` takes: a buffer parameter by its buffer's name, a scalar by its own."""
    return [str(func.buffer_map[p].name) if p in func.buffer_map else str(p.name) for p in func.params]


def _inner_grid(body, t) -> bool:
    return isinstance(body, t.For) and int(body.kind) == int(t.ForKind.THREAD_BINDING)


def _parallel_depth(st, t) -> int:
    """The deepest nest of T.Parallel loops starting at ``st`` (a parallel loop)."""
    best = 0

    def visit(n, d):
        nonlocal best
        if isinstance(n, t.For) and int(n.kind) == int(t.ForKind.PARALLEL):
            d += 1
            best = max(best, d)
            visit(n.body, d)
        elif isinstance(n, t.For):
            visit(n.body, d)
        elif isinstance(n, t.SeqStmt):
            for x in n.seq:
                visit(x, d)
        elif isinstance(n, t.IfThenElse):
            visit(n.then_case, d)
            if n.else_case is not None:
                visit(n.else_case, d)
        elif isinstance(n, (t.AttrStmt,)):
            visit(n.body, d)

    visit(st, 0)
    return best


def _unify(s: _State, ex, val: int, t) -> None:
    """Bind the dynamic dimension a shape or stride expression names (``n`` or ``n * c``); others are checked
    later."""
    if isinstance(ex, t.Var):
        if ex in s.vars and s.vars[ex] != val:
            raise ValueError(f"dimension {ex.name} is {s.vars[ex]} by one argument and {val} by another")
        s.vars[ex] = val
    elif isinstance(ex, t.Mul) and isinstance(ex.a, t.Var) and isinstance(ex.b, t.IntImm):
        c = int(ex.b.value)
        if val % c:
            raise ValueError(f"stride {val} is not a multiple of {c} ({ex})")
        _unify(s, ex.a, val // c, t)


def _alloc(s: _State, buf, shape) -> None:
    dt = str(buf.dtype)
    if is_float(dt):
        data = np.full(shape, np.nan, np.float32)
    elif dt == "bool":
        data = np.zeros(shape, bool)
    else:
        data = np.full(shape, INT_POISON, np.int64)
    s.bufs[buf.data] = LocalBuf(buf.name, data, dt)


# ------------------------------------------------------------------------------------- memory access


def _check(name, ii, shape, what):
    for d, (a, n) in enumerate(zip(ii, shape)):
        lo, hi = (a, a) if np.ndim(a) == 0 else ((a.min(), a.max()) if a.size else (0, 0))
        if lo < 0 or hi >= n:
            raise OutOfBounds(f"{what} {name}: index {lo if lo < 0 else hi} of dim {d} out of [0, {n})")


def _read(b, ii, mask):
    scalar = all(np.ndim(x) == 0 for x in ii)
    if scalar and (mask is True or np.ndim(mask) == 0):
        if isinstance(b, LocalBuf):
            _check(b.name, ii, b.data.shape, "load of")
            return b.data[tuple(int(x) for x in ii)]
        _check(b.name, ii, b.shape, "load of")
        return b.flat[b.offset + sum(int(x) * st for x, st in zip(ii, b.strides))]
    shape = np.broadcast_shapes(*(np.shape(x) for x in ii), np.shape(mask) if mask is not True else ())
    arrs = [np.broadcast_to(x, shape) for x in ii]
    if mask is not True:
        mk = np.broadcast_to(mask, shape)
        _check(b.name, [a[mk] for a in arrs], b.data.shape if isinstance(b, LocalBuf) else b.shape, "load of")
        arrs = [np.where(mk, a, 0) for a in arrs]  # lanes that do not run read element 0
    else:
        _check(b.name, arrs, b.data.shape if isinstance(b, LocalBuf) else b.shape, "load of")
    if isinstance(b, LocalBuf):
        return b.data[tuple(arrs)]
    off = b.offset + sum(a * st for a, st in zip(arrs, b.strides))
    return b.flat[off]


def _write(b, ii, val, mask):
    dt = b.dtype
    val = round_to(dt, val)
    shape_of = b.data.shape if isinstance(b, LocalBuf) else b.shape
    if all(np.ndim(x) == 0 for x in ii) and np.ndim(val) == 0 and (mask is True or np.ndim(mask) == 0):
        _check(b.name, ii, shape_of, "store to")
        if isinstance(b, LocalBuf):
            b.data[tuple(int(x) for x in ii)] = val
        else:
            b.flat[b.offset + sum(int(x) * st for x, st in zip(ii, b.strides))] = val
        return
    arrs = np.broadcast_arrays(*ii, val, *([mask] if mask is not True else []))
    if mask is not True:
        sel = arrs[-1]
        arrs = [a[sel] for a in arrs[:-1]]
    ii, v = arrs[:-1], arrs[-1]
    _check(b.name, ii, shape_of, "store to")
    if isinstance(b, LocalBuf):
        b.data[tuple(ii)] = v
    else:
        b.flat[b.offset + sum(a * st for a, st in zip(ii, b.strides))] = v


def _region_index(b, base, ext):
    """Index arrays of a region over its non-unit dims (in order) and the in-range mask (global buffers)."""
    nonunit = [d for d, e in enumerate(ext) if e != 1]
    nd = len(nonunit)
    ii = []
    for d, (a, e) in enumerate(zip(base, ext)):
        if e == 1:
            ii.append(np.full([1] * nd, a, np.int64) if nd else np.int64(a))
        else:
            shape = [1] * nd
            shape[nonunit.index(d)] = e
            ii.append((a + np.arange(e, dtype=np.int64)).reshape(shape))
    dims = tuple(ext[d] for d in nonunit)
    ii = [np.broadcast_to(x, dims) for x in ii]
    shape_of = b.data.shape if isinstance(b, LocalBuf) else b.shape
    ok = np.ones(dims, bool)
    for x, n in zip(ii, shape_of):
        ok &= (x >= 0) & (x < n)
    return ii, ok, dims


def _region_read(b, base, ext):
    ii, ok, _dims = _region_index(b, base, ext)
    if isinstance(b, LocalBuf):
        if not ok.all():
            raise OutOfBounds(f"tile op reads {b.name} out of range: base {base} extents {ext}")
        return b.data[tuple(ii)].astype(np.float64 if b.data.dtype == np.float32 else b.data.dtype)
    off = b.offset + sum(np.where(ok, x, 0) * st for x, st in zip(ii, b.strides))
    vals = b.flat[off]
    return np.where(ok, vals, 0)


def _region_write(b, base, ext, vals):
    ii, ok, dims = _region_index(b, base, ext)
    vals = round_to(b.dtype, np.broadcast_to(vals, dims))
    if isinstance(b, LocalBuf):
        if not ok.all():
            raise OutOfBounds(f"tile op writes {b.name} out of range: base {base} extents {ext}")
        b.data[tuple(ii)] = vals
        return
    sel = [x[ok] for x in ii]
    b.flat[b.offset + sum(x * st for x, st in zip(sel, b.strides))] = vals[ok]


def _copy(src, dst):
    (sb, sbase, sext), (db, dbase, dext) = src, dst
    s_dims = [e for e in sext if e != 1]
    d_dims = [e for e in dext if e != 1]
    if s_dims != d_dims:
        raise InterpError(f"T.copy {sb.name} -> {db.name}: region extents {sext} and {dext} differ")
    _region_write(db, dbase, dext, _region_read(sb, sbase, sext))


def _fill(dst, val):
    db, dbase, dext = dst
    _region_write(db, dbase, dext, val)


def _matrix(region):
    b, base, ext = region
    a = _region_read(b, base, ext)
    if a.ndim != 2:
        raise InterpError(f"T.gemm operand {b.name} is not a matrix region ({ext})")
    return np.asarray(a, np.float64)


def _matmul(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """float64 a @ b on one thread (with TileLang's runtime loaded, numpy's threaded BLAS takes ~30 ms for a
    128x64x64 product on a shared 2-core machine; torch on one thread takes ~0.1 ms)."""
    import torch

    n = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return (torch.from_numpy(np.ascontiguousarray(a)) @ torch.from_numpy(np.ascontiguousarray(b))).numpy()
    finally:
        torch.set_num_threads(n)


def _gemm(a, b, c, ta, tb, clear):
    A, B = _matrix(a), _matrix(b)
    prod = _matmul(A.T if ta else A, B.T if tb else B)
    if not clear:
        prod = prod + _matrix(c)
    cb, cbase, cext = c
    _region_write(cb, cbase, cext, prod.astype(np.float32))


_REDUCERS = {
    "sum": lambda x, d: np.sum(x, axis=d, dtype=np.float64),
    "abssum": lambda x, d: np.sum(np.abs(x), axis=d, dtype=np.float64),
    "max": lambda x, d: np.fmax.reduce(x, axis=d),
    "min": lambda x, d: np.fmin.reduce(x, axis=d),
    "absmax": lambda x, d: np.fmax.reduce(np.abs(x), axis=d),
}
_COMBINE = {"sum": np.add, "abssum": np.add, "max": np.fmax, "min": np.fmin, "absmax": np.fmax}


def _reduce(src, dst, kind, dim, clear):
    sb, sbase, sext = src
    db, dbase, dext = dst
    if kind not in _REDUCERS:
        raise InterpError(f"reduce kind {kind} is not modelled")
    x = _region_read(sb, sbase, sext).astype(np.float32)
    full_shape = [e for e in sext]
    x = x.reshape(full_shape)
    r = _REDUCERS[kind](x, dim)
    out_shape = [e for d, e in enumerate(sext) if d != dim]
    r = np.asarray(r).reshape(out_shape)
    if not clear:
        prev = _region_read(db, dbase, dext).reshape(out_shape)
        r = _COMBINE[kind](prev, r)
    _region_write(db, dbase, dext, np.asarray(r, np.float32).reshape([e for e in dext if e != 1] or ()))


# --------------------------------------------------------------------------------------------- loading


def load_program(text: str, path: Path, name: str = "emitted_program"):
    """The PrimFunc of an emitted program text (written to ``path``: TileLang reads the source with inspect)."""
    import tilelang  # noqa: F401  (registers the tl ops)

    path = Path(path)
    path.write_text(text)
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    try:
        spec.loader.exec_module(mod)
        return mod, mod.make_prim_func()
    finally:
        sys.modules.pop(name, None)


def interpret(text: str, path: Path, name: str = "emitted_program") -> tuple[Any, Interpreter]:
    """(module, Interpreter) of an emitted program text."""
    mod, func = load_program(text, path, name)
    return mod, Interpreter(func)


__all__ = ["InterpError", "Interpreter", "OutOfBounds", "interpret", "load_program", "round_to"]
