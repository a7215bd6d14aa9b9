"""Unit tests of the TileLang frontend interpreter (tests/tl_interp.py) on small hand-written programs, each checked
against numpy: what it models (grid, T.Parallel with per-lane conditions, serial loops, tile ops, bounds-checked
copies, integer division, casts with rounding) and what it refuses (out-of-range loads and stores, a broken
``T.assume``, thread indices)."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("tilelang")

from tl_interp import InterpError, Interpreter, OutOfBounds, load_program, round_to

HEADER = "import tilelang.language as T\n\n\ndef make_prim_func():\n"


@pytest.fixture
def build(tmp_path):
    count = [0]

    def make(body: str) -> Interpreter:
        count[0] += 1
        name = f"interp_case_{count[0]}"
        _, func = load_program(HEADER + body, tmp_path / f"{name}.py", name)
        return Interpreter(func)

    return make


TILED_SOFTMAX = """
    n = T.dynamic("n")

    @T.prim_func
    def f(X: T.Tensor((n, 48), T.float16), Y: T.Tensor((n, 48), T.float32), M: T.Tensor((n,), T.float32)):
        with T.Kernel(T.ceildiv(n, 16), threads=128) as bx:
            xs = T.alloc_shared((16, 48), T.float16)
            s = T.alloc_fragment((16, 48), T.float32)
            m = T.alloc_fragment((16,), T.float32)
            l = T.alloc_fragment((16,), T.float32)
            T.copy(X[bx * 16:(bx + 1) * 16, :], xs)
            T.copy(xs, s)
            T.reduce_max(s, m, dim=1)
            for i, j in T.Parallel(16, 48):
                s[i, j] = T.exp(s[i, j] - m[i])
            T.reduce_sum(s, l, dim=1)
            for i, j in T.Parallel(16, 48):
                s[i, j] = s[i, j] / l[i]
            T.copy(s, Y[bx * 16:(bx + 1) * 16, :])
            for i in T.Parallel(16):
                if bx * 16 + i < n:
                    M[bx * 16 + i] = m[i]

    return f
"""


def test_tiled_softmax_with_a_tail(build):
    it = build(TILED_SOFTMAX)
    x = round_to("float16", np.random.default_rng(0).standard_normal((37, 48)).astype(np.float32) * 3)
    y, m = np.full((37, 48), np.nan, np.float32), np.full(37, np.nan, np.float32)
    stats = it.run(x, y, m)
    assert stats["blocks"] == 3
    e = np.exp(x - x.max(1, keepdims=True))
    np.testing.assert_allclose(y, e / e.sum(1, keepdims=True), rtol=1e-5, atol=1e-7)
    np.testing.assert_array_equal(m, x.max(1))


GEMM = """
    @T.prim_func
    def f(A: T.Tensor((40, 32), T.bfloat16), B: T.Tensor((24, 32), T.bfloat16), C: T.Tensor((40, 24), T.float32)):
        with T.Kernel(T.ceildiv(24, 16), T.ceildiv(40, 16), threads=128) as (bx, by):
            a = T.alloc_shared((16, 16), T.bfloat16)
            b = T.alloc_shared((16, 16), T.bfloat16)
            c = T.alloc_fragment((16, 16), T.float32)
            T.fill(c, 0)
            for k in T.Pipelined(2, num_stages=2):
                T.copy(A[by * 16, k * 16], a)
                T.copy(B[bx * 16, k * 16], b)
                T.gemm(a, b, c, transpose_B=True)
            T.copy(c, C[by * 16, bx * 16])

    return f
"""


def test_gemm_with_partial_tiles(build):
    it = build(GEMM)
    rng = np.random.default_rng(1)
    a = round_to("bfloat16", rng.standard_normal((40, 32)).astype(np.float32))
    b = round_to("bfloat16", rng.standard_normal((24, 32)).astype(np.float32))
    c = np.full((40, 24), np.nan, np.float32)
    it.run(a, b, c)
    np.testing.assert_allclose(c, a.astype(np.float64) @ b.T.astype(np.float64), rtol=1e-6, atol=1e-5)


LAZY_AND_MASKED = """
    n = T.dynamic("n")

    @T.prim_func
    def f(X: T.Tensor((n,), T.float32), Y: T.Tensor((64,), T.float32), k: T.int32):
        with T.Kernel(1, threads=64) as bx:
            for i in T.Parallel(64):
                # the load X[i] runs only on lanes with i < n: no out-of-range read
                Y[i] = T.if_then_else(i < n, X[T.min(i, 1000)] * 2, T.float32(-1))
            for i in T.Parallel(64):
                if i % 3 == 0 and i < k:
                    Y[i] = T.Cast(T.float32, T.truncdiv(i - 40, 7) * 1000 + T.truncmod(i - 40, 7)) + \\
                        T.Cast(T.float32, (i - 40) // 7) * T.float32(0.001)

    return f
"""


def test_lazy_select_masked_if_and_integer_division(build):
    it = build(LAZY_AND_MASKED)
    x = np.arange(10, dtype=np.float32)
    y = np.full(64, np.nan, np.float32)
    it.run(x, y, 50)
    want = np.where(np.arange(64) < 10, np.arange(64) * 2.0, -1.0)
    i = np.arange(64)
    sel = (i % 3 == 0) & (i < 50)
    d = i - 40
    trunc_q = np.trunc(d / 7).astype(int)
    want[sel] = (trunc_q * 1000 + (d - trunc_q * 7))[sel] + (np.floor_divide(d, 7) * 0.001)[sel]
    np.testing.assert_allclose(y, want.astype(np.float32), rtol=1e-6)


OOB_LOAD = """
    n = T.dynamic("n")

    @T.prim_func
    def f(X: T.Tensor((n,), T.float32), Y: T.Tensor((64,), T.float32)):
        with T.Kernel(1, threads=64) as bx:
            for i in T.Parallel(64):
                Y[i] = X[i]

    return f
"""


def test_out_of_range_load_is_an_error(build):
    it = build(OOB_LOAD)
    it.run(np.ones(64, np.float32), np.zeros(64, np.float32))
    with pytest.raises(OutOfBounds, match="load of X"):
        it.run(np.ones(63, np.float32), np.zeros(64, np.float32))


COPY_BOUNDS = """
    n = T.dynamic("n")

    @T.prim_func
    def f(X: T.Tensor((n, 8), T.float32), Y: T.Tensor((n, 8), T.float32)):
        with T.Kernel(T.ceildiv(n, 16), threads=64) as bx:
            s = T.alloc_shared((16, 8), T.float32)
            T.copy(X[bx * 16:(bx + 1) * 16, :], s)
            for i, j in T.Parallel(16, 8):
                s[i, j] = s[i, j] + 1
            T.copy(s, Y[bx * 16:(bx + 1) * 16, :])

    return f
"""


def test_copies_zero_fill_reads_and_drop_writes_past_the_end(build):
    it = build(COPY_BOUNDS)
    x = np.random.default_rng(2).standard_normal((21, 8)).astype(np.float32)
    y = np.full((21, 8), np.nan, np.float32)
    it.run(x, y)  # the second block reads rows 21..31 as 0 and does not write them
    np.testing.assert_array_equal(y, x + 1)


STRIDED_AND_ASSUME = """
    n, s0 = T.dynamic("n, s0")

    @T.prim_func
    def f(X: T.StridedTensor((n, 4), (s0, 1), T.float32), Y: T.Tensor((n,), T.float32)):
        with T.Kernel(1, threads=32) as bx:
            T.assume(s0 % 8 == 0)
            for r in T.serial(n):
                acc = T.alloc_local((1,), T.float32)
                acc[0] = 0
                for c in T.serial(4):
                    acc[0] = acc[0] + X[r, c] * (c + 1)
                Y[r] = acc[0]

    return f
"""


def test_strided_input_serial_loops_and_assume(build):
    it = build(STRIDED_AND_ASSUME)
    base = np.random.default_rng(3).standard_normal((5, 8)).astype(np.float32)
    y = np.zeros(5, np.float32)
    it.run(base[:, :4], y)  # row stride 8 elements
    np.testing.assert_allclose(y, base[:, :4] @ np.arange(1, 5, dtype=np.float32), rtol=1e-6)
    base6 = np.zeros((5, 6), np.float32)
    with pytest.raises(InterpError, match="assumes"):
        it.run(base6[:, :4], y)  # stride 6 breaks T.assume(s0 % 8 == 0)


CASTS = """
    @T.prim_func
    def f(X: T.Tensor((8,), T.float32), H: T.Tensor((8,), T.float16), B: T.Tensor((8,), T.bfloat16),
          E: T.Tensor((8,), T.float8_e4m3fn), R: T.Tensor((8,), T.float32)):
        with T.Kernel(1, threads=32) as bx:
            for i in T.Parallel(8):
                H[i] = T.Cast(T.float16, X[i])
                B[i] = T.Cast(T.bfloat16, X[i])
                E[i] = T.Cast(T.float8_e4m3fn, X[i])
                R[i] = T.max(X[i], T.float32(0)) + T.Cast(T.float32, T.Cast(T.int32, T.max(X[i], T.float32(-100))))

    return f
"""


def test_casts_round_to_nearest_even(build):
    it = build(CASTS)
    x = np.array([1 + 2**-11, 1 + 3 * 2**-11, 1 + 2**-8, 1 + 3 * 2**-8, 1000.0, -600.0, np.nan, -2.5], np.float32)
    h, b, e, r = (np.zeros(8, np.float32) for _ in range(4))
    it.run(x, h, b, e, r)
    np.testing.assert_array_equal(h[:2], [1.0, 1 + 2**-9])  # ties to even at fp16's half-ulp
    np.testing.assert_array_equal(b[2:4], [1.0, 1 + 2**-6])  # ... and at bf16's
    assert e[4] == 448 and e[5] == -448 and np.isnan(e[6])  # saturating e4m3, NaN kept
    assert e[7] == -2.5 and e[0] == 1.0
    # T.max ignores a NaN operand (fmaxf); float -> int truncates toward zero
    np.testing.assert_array_equal(r[[4, 5, 6, 7]], [2000.0, -100.0, -100.0, -2.0])


THREAD_INDEX = """
    @T.prim_func
    def f(Y: T.Tensor((128,), T.float32)):
        with T.Kernel(1, threads=128) as bx:
            tx = T.get_thread_binding(0)
            Y[tx] = 1.0

    return f
"""


def test_thread_indices_are_refused(build):
    try:
        it = build(THREAD_INDEX)
    except InterpError as exc:  # refused while compiling
        assert "thread" in str(exc)
        return
    with pytest.raises(InterpError, match="thread"):
        it.run(np.zeros(128, np.float32))


def test_read_before_write_poisons(build):
    it = build("""
    @T.prim_func
    def f(Y: T.Tensor((16,), T.float32)):
        with T.Kernel(1, threads=32) as bx:
            s = T.alloc_fragment((16,), T.float32)
            for i in T.Parallel(16):
                if i < 8:
                    s[i] = 1.0
            for i in T.Parallel(16):
                Y[i] = s[i]

    return f
""")
    y = np.zeros(16, np.float32)
    it.run(y)
    assert (y[:8] == 1).all() and np.isnan(y[8:]).all()
