"""stream_row's final pass (outputs indexed by the streamed axis) on the CPU: specs/rms_norm_fp8_quant.yaml (RMS norm +
per-token FP8 quantisation; a column tensor, the weight) and specs/row_softmax.yaml (probabilities per element).

The template's ``cpu_sim`` emission (the CTA's 256 threads explicit) is lowered for TileLang's ``"c"`` target,
compiled and run; the per-element outputs come back as float32 (the value the CUDA kernel converts in its store) and
are rounded here by torch to the output's dtype (float8_e4m3fn / float16 / bfloat16, round to nearest even), then
judged against the float64 references of tests/spec_references.py: q within one e4m3 unit of the e4m3 rounding of
the reference, the scale within float32 rounding; softmax by ACCEPTANCE's rule (error at most twice torch's own
softmax in the inputs' dtype, + 1e-5). Rows with tails, rows of several chunks, zero rows, -inf / NaN rows,
strided and misaligned rows and weights.
"""

from __future__ import annotations

import ctypes
import functools

import numpy as np
import pytest
import torch
from spec_references import E4M3_MIN_SCALE
from spec_references import rms_norm_fp8_quant as rq_reference
from spec_references import softmax as softmax_reference
from test_stream_row_template import _device_rows, engine, judge
from tl_c_sim import compile_c_program

from generator.codegen.templates import stream_row as sr
from generator.codegen.templates.stream_row_bridge import stream_math, stream_plan

TDT = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
DTYPES = list(TDT)
# a tail only (1, 7, 113, 4095), exactly one chunk, a chunk + 1, hidden sizes of several chunks with a tail
LENGTHS = [1, 7, 113, 4095, 4096, 4097, 7168, 10000]


@functools.cache
def build(name: str, dtype: str):
    """(row kernel, merge program, final program, math), each emitted for the C target, compiled, loaded."""
    spec, op = engine(name)
    math, _ = stream_math(spec, op)
    v, symbol = sr.StreamVariant(dtype), f"simf_{name}_{dtype}"
    lib, _ = compile_c_program(sr.emit_stream_row_program(math, v, symbol, backend="cpu_sim"), symbol)
    merge, _ = compile_c_program(sr.emit_stream_row_merge(math, v, symbol + "_m", backend="cpu_sim"), symbol + "_m")
    final, _ = compile_c_program(sr.emit_stream_row_final(math, v, symbol + "_f", backend="cpu_sim"), symbol + "_f")
    return lib, merge, final, math


def _column(w: torch.Tensor, dtype: str, misalign: bool) -> tuple[np.ndarray, torch.Tensor]:
    buf, seen = _device_rows(w[None, :], dtype, w.shape[0], misalign)
    return buf, seen[0]


def run(name: str, x: torch.Tensor, dtype: str, cols=(), fparams=(), ld=None, misalign=False, sms=None):
    """(per-row outputs, per-element outputs as float32, the rows as the kernel sees them, the columns likewise).
    ``sms``: split rows as impl_cuda does on a GPU with that many SMs (row kernel, merge program, final program);
    None: one CTA per row."""
    lib, merge, final, math = build(name, dtype)
    T_, L = x.shape
    ld = ld or L
    buf, seen = _device_rows(x, dtype, ld, misalign)
    colbufs = [_column(c, dtype, misalign) for c in cols]
    outs = [np.full(T_, -777.0, dtype=np.float32) for _ in math.outputs]
    elems = [np.full((T_, L), np.nan, dtype=np.float32) for _ in math.elem_outputs]  # poisoned: all written?
    chunk = sr.StreamVariant(dtype).chunk
    ns, cps = sr.split_plan(T_, L, sms, chunk) if sms else (1, max(1, L // chunk))
    ws = np.full((len(math.states), T_, ns), np.nan, dtype=np.float32)
    P = ctypes.c_void_p
    rows_ = [P(buf.ctypes.data)]
    tail = [ctypes.c_int32(L)]
    params = [ctypes.c_float(v) for v in fparams]
    cols_elems = [P(b.ctypes.data) for b, _ in colbufs] + [P(e.ctypes.data) for e in elems]
    dims = [ctypes.c_int32(T_), ctypes.c_int32(ld), ctypes.c_int32(ns), ctypes.c_int32(L)]
    args = rows_ + [P(o.ctypes.data) for o in outs] + [P(ws.ctypes.data)] + cols_elems + tail
    assert lib.call(*args, ctypes.c_int32(cps), *params, *dims) == 0
    if ns == 1:
        assert np.all(np.isnan(ws))  # one CTA per row: the workspace is never touched
    else:
        assert all(np.isnan(e).all() for e in elems) and all((o == -777.0).all() for o in outs)
        assert merge.call(*[P(o.ctypes.data) for o in outs], P(ws.ctypes.data), *tail, *params,
                          ctypes.c_int32(T_), ctypes.c_int32(ns)) == 0
        assert final.call(*rows_, P(ws.ctypes.data), *cols_elems, *tail, ctypes.c_int32(cps), *params, *dims) == 0
    run.last_split = ns
    return outs, elems, seen, [s for _, s in colbufs]


def e4m3_unit(v: torch.Tensor) -> torch.Tensor:
    """The spacing of e4m3fn values at |v| (subnormals below 2^-6 have spacing 2^-9)."""
    return torch.exp2(torch.floor(torch.log2(v.abs().clamp(min=2.0**-6))) - 3)


def judge_quant(qv, scale, seen, wseen, eps):
    """qv: the kernel's float32 values before the e4m3 store; returns the fraction equal to the reference's q."""
    q = torch.from_numpy(qv).to(torch.float8_e4m3fn).double()
    ref_v, ref_s = rq_reference(seen, wseen, eps)
    ref_q = ref_v.to(torch.float8_e4m3fn).double()
    same_nan = torch.isnan(ref_q) & torch.isnan(q)
    assert torch.equal(torch.isnan(q), torch.isnan(ref_q))
    unit = e4m3_unit(torch.maximum(q.abs(), ref_q.abs()))
    assert (((q - ref_q).abs() <= unit) | same_nan).all(), ((q - ref_q).abs() / unit).nan_to_num().max().item()
    s = torch.from_numpy(scale).double()
    fin = torch.isfinite(ref_s)
    assert torch.equal(torch.isnan(s), torch.isnan(ref_s))
    rel = ((s[fin] - ref_s[fin]).abs() / ref_s[fin]).max().item() if fin.any() else 0.0
    assert rel <= 5e-6, rel
    return (q[~same_nan] == ref_q[~same_nan]).double().mean().item()


def rows(T_, L, seed, spread=3.0):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(T_, L, generator=gen) * spread * torch.rand(T_, 1, generator=gen).add(0.05)


def weight(L, seed):
    return 1 + 0.5 * torch.randn(L, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("L", LENGTHS)
def test_rms_norm_fp8_quant_sim(dtype, L):
    x, w = rows(3, L, L), weight(L, L + 1)
    for eps in (1e-6, 1e-2):
        (scale,), (qv,), seen, (wseen,) = run("rms_norm_fp8_quant", x, dtype, cols=[w], fparams=[eps])
        exact = judge_quant(qv, scale, seen, wseen, eps)
        assert exact >= 0.99 or L < 100, exact


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_rms_norm_fp8_quant_sim_zero_saturated_and_nonfinite_rows(dtype):
    L = 5000
    x, w = rows(6, L, 4), weight(L, 5)
    x[1] = 0  # floor scale, exact zeros
    x[2, 4500] = float("nan")  # in the tail chunk: NaN scale and q
    x[3, 10] = float("inf")  # in a full chunk: NaN (inf * rsqrt(inf))
    x[4] = 0
    x[4, 4999] = -3.0  # one element: q = -448 exactly
    (scale,), (qv,), seen, (wseen,) = run("rms_norm_fp8_quant", x, dtype, cols=[w], fparams=[1e-6])
    q = torch.from_numpy(qv).to(torch.float8_e4m3fn).float()
    assert scale[1] == np.float32(E4M3_MIN_SCALE) and (q[1] == 0).all()
    assert np.isnan(scale[2]) and torch.isnan(q[2]).all() and np.isnan(scale[3]) and torch.isnan(q[3]).all()
    assert q[4, 4999] == -448 and (q[4, :4999] == 0).all()
    judge_quant(qv, scale, seen, wseen, 1e-6)
    # a weight of zeros: floor scales and zeros everywhere
    (scale,), (qv,), _, _ = run("rms_norm_fp8_quant", x[[0, 5]], dtype, cols=[torch.zeros(L)], fparams=[1e-6])
    assert (scale == np.float32(E4M3_MIN_SCALE)).all() and (qv == 0).all()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("ld_extra, misalign", [(8, False), (3, False), (0, True)])
def test_rms_norm_fp8_quant_sim_strided_and_misaligned(dtype, ld_extra, misalign):
    """Row stride beyond the row (vector path when 16-byte alignment holds, else element by element), base pointers
    of the rows and of the weight off a 16-byte boundary (element path)."""
    L = 9000
    x, w = rows(4, L, 6), weight(L, 7)
    (scale,), (qv,), seen, (wseen,) = run("rms_norm_fp8_quant", x, dtype, cols=[w], fparams=[1e-6],
                                          ld=L + ld_extra, misalign=misalign)
    assert judge_quant(qv, scale, seen, wseen, 1e-6) >= 0.99


def judge_softmax(ov, seen, dtype):
    out = torch.from_numpy(ov).to(TDT[dtype]).double()
    ref = softmax_reference(seen)
    plain = torch.softmax(seen.to(TDT[dtype]), dim=-1).double()  # torch in the inputs' dtype
    judge(out.numpy(), ref.numpy(), plain.nan_to_num(0.0).numpy())


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("L", LENGTHS + [32000])
def test_row_softmax_sim(dtype, L):
    x = 4 * rows(3, L, L + 11, spread=1.0)
    _, (ov,), seen, _ = run("row_softmax", x, dtype)
    judge_softmax(ov, seen, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_row_softmax_sim_infinite_rows(dtype):
    """A row of -inf gives zeros; -inf elements probability 0; a first chunk of -inf (the guard) then finite."""
    L = 5000
    x = 4 * rows(5, L, 3, spread=1.0)
    x[0] = float("-inf")
    x[1, ::3] = float("-inf")
    x[2, :4096] = float("-inf")
    x[3, 4998] = float("nan")  # NaN anywhere: a NaN row
    _, (ov,), seen, _ = run("row_softmax", x, dtype)
    out = torch.from_numpy(ov)
    assert (out[0] == 0).all() and (out[1, ::3] == 0).all() and (out[2, :4096] == 0).all()
    assert torch.isnan(out[3]).all()
    keep = [0, 1, 2, 4]
    judge_softmax(ov[keep], seen[keep], dtype)
    (_, (ov,), seen, _) = run("row_softmax", x, dtype, ld=L + 5)  # odd row stride: the element path
    judge_softmax(ov[keep], seen[keep], dtype)


def test_plan_has_merge_and_final_programs_and_binds_roles():
    spec, op = engine("rms_norm_fp8_quant")
    math, roles = stream_math(spec, op)
    assert roles["cols"] == ("weight",) and roles["elem_outputs"] == ("q",) and roles["outputs"] == ("scale",)
    assert math.elem_outputs[0][1] == "float8_e4m3fn" and math.n_cols == 1 and not math.whole_row
    plan = stream_plan(spec, op, ["sm80", "sm90a"])
    n_dt = len(spec.variants.cuda.dtypes)
    # per family: a row kernel and a final program per dtype, one merge program
    assert len(plan.jobs) == 2 * (2 * n_dt + 1)
    assert sum("_merge_" in j.symbol for j in plan.jobs) == 2 and sum("_final__" in j.symbol for j in plan.jobs) == 2 * n_dt
    spec, op = engine("row_softmax")
    math, _ = stream_math(spec, op)
    assert math.elem_outputs[0][1] == "row"  # stored in x's dtype
    with pytest.raises(ValueError, match="final program"):
        sr.emit_stream_row_final(engine_math("logsumexp"), sr.StreamVariant("float32"), "f")


def engine_math(name: str):
    return stream_math(*engine(name))[0]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("L", [16384, 50001])
def test_split_rows_final_program(dtype, L):
    """Few long rows split across CTAs: segments' states merged by the merge program (per-row outputs, and the final
    states in slot 0 of the workspace), then the final program writes each segment's per-element outputs; every
    element written (poisoned beforehand), the same results as one CTA per row. A row whose first segments hold only
    -inf (neutral states merged), a zero row (floor scale)."""
    x, w = rows(3, L, L + 3), weight(L, 9)
    x[2, : L // 2] = float("-inf")
    _, (ov,), seen, _ = run("row_softmax", x, dtype, sms=132)
    assert run.last_split > 1
    judge_softmax(ov, seen, dtype)
    assert (ov[2, : L // 2] == 0).all()
    x[2] = 0.0
    (scale,), (qv,), seen, (wseen,) = run("rms_norm_fp8_quant", x, dtype, cols=[w], fparams=[1e-6], sms=132)
    assert run.last_split > 1 and scale[2] == np.float32(E4M3_MIN_SCALE)
    assert judge_quant(qv, scale, seen, wseen, 1e-6) >= 0.99
    (scale1,), _, _, _ = run("rms_norm_fp8_quant", x, dtype, cols=[w], fparams=[1e-6])
    assert run.last_split == 1 and np.allclose(scale1, scale, rtol=2e-6)  # the same up to the order of the sums
