"""Tight per-dtype checks on the CPU library (issue 17), each on inputs where the right answer is known exactly:

- fp8_quant_gemm: when a row's abs-max is its first element, the online quantisation uses the final scale from
  the first chunk on, so the result equals the two-pass path (quantise with the row's scale, then GEMM) up to the
  float32 summation order; on any row it stays within a few e4m3 units (per element: the quantisation steps of its
  terms) of the two-pass path.
- fp16/bf16 outputs: on inputs where the float32 computation is exact (sums of few-bit values, a power-of-two
  divisor, integer fp8 GEMMs with a power-of-two scale), every output equals the float64 result rounded to the
  output type (round to nearest even: torch's conversion), element for element.
- moe_route with NaN rows (softmax and sigmoid scoring, with and without groups): the ids equal the reference's
  (redfuser_ops/reference.py: NaN keys after every other key, ties to the lower id) id for id.
"""

from __future__ import annotations

import pytest
import torch

import redfuser_ops  # noqa: F401 - loads the library
from redfuser_ops import reference as ref

HALF = [torch.float16, torch.bfloat16]


# --------------------------------------------------------------------------------------------- fp8_quant_gemm
def _e4m3_ulp(v: torch.Tensor) -> torch.Tensor:
    """The spacing of e4m3 values at |v| (3 mantissa bits; subnormals step 2^-9)."""
    a = v.abs().clamp(min=2.0**-6)
    return torch.exp2(torch.floor(torch.log2(a)) - 3)


def _fp8_inputs(M, N, K, x_dtype, seed, max_first):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(M, K, generator=g) * torch.exp2(torch.randint(-3, 4, (M, 1), generator=g).float())
    if max_first:  # the row's abs-max in the first element, of either sign
        sign = torch.where(torch.rand(M, generator=g) < 0.5, -1.0, 1.0)
        x[:, 0] = sign * 2 * x[:, 1:].abs().amax(dim=1)
    x = x.to(x_dtype)
    w = (torch.randn(N, K, generator=g) * 0.3).to(torch.float8_e4m3fn)  # subnormals included (|w| < 2^-6)
    ws = torch.rand(N, generator=g) + 0.5
    return x, w, ws


@pytest.mark.parametrize("M, N, K", [(5, 16, 64), (9, 48, 528), (3, 32, 2048)])
def test_fp8_first_element_max_equals_two_pass(M, N, K):
    """float32 x: with few-bit inputs (bf16) x / s can be exactly halfway between two e4m3 values, and the kernel's
    division (x times 1/s under -ffast-math) may then round the other way; random float32 values are never there."""
    x, w, ws = _fp8_inputs(M, N, K, torch.float32, M * N + K, max_first=True)
    out = torch.ops.redfuser.fp8_quant_gemm(x, w, ws, None, torch.float32)
    two = ref.fp8_quant_gemm_two_pass(x, w, ws).double()
    xf = x.double()
    s = (xf.abs().amax(dim=1, keepdim=True) / 448).float().double()
    q = torch.clamp(x.float() / s.float(), -448, 448).to(torch.float8_e4m3fn).double()
    mag = (q.abs() @ w.double().abs().T) * s * ws.double()  # sum of |terms|: the float32 summation error scale
    err = (out.double() - two).abs()
    assert (err <= 4 * K * 2.0**-24 * mag + 1e-30).all(), (err / mag).max().item()


@pytest.mark.parametrize("x_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("M, N, K", [(7, 32, 272), (4, 16, 1024)])
def test_fp8_within_e4m3_units_of_two_pass(x_dtype, M, N, K):
    x, w, ws = _fp8_inputs(M, N, K, x_dtype, 7 * M + K, max_first=False)
    out = torch.ops.redfuser.fp8_quant_gemm(x, w, ws, None, torch.float32).double()
    two = ref.fp8_quant_gemm_two_pass(x, w, ws).double()
    xf = x.double()
    s = xf.abs().amax(dim=1, keepdim=True) / 448
    # one e4m3 unit per element: the sum over k of |w| times the quantisation step of x[m, k] / s, scaled back
    unit = (_e4m3_ulp(xf / s) @ w.double().abs().T) * s * ws.double()
    err = (out - two).abs()
    assert (err <= 3 * unit).all(), (err / unit).max().item()


def _exact_fp8(M, N, K, seed):
    """Integer inputs whose fp8 GEMM is exact in float32: x rows with abs-max 448 (scale exactly 1) and entries
    in [-16, 16] (e4m3 values), w integers in [-8, 8], power-of-two w_scale, bias on a 2^-10 grid."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(-16, 17, (M, K), generator=g).float()
    x[:, torch.randint(0, K, (1,), generator=g).item()] = 448.0
    w = torch.randint(-8, 9, (N, K), generator=g).float().to(torch.float8_e4m3fn)
    ws = torch.exp2(torch.randint(-2, 2, (N,), generator=g).float())
    bias = torch.randint(-2**12, 2**12, (N,), generator=g).float() / 1024
    return x, w, ws, bias


@pytest.mark.parametrize("out_dtype", HALF)
def test_fp8_half_output_is_the_exact_result_rounded(out_dtype):
    x, w, ws, bias = _exact_fp8(6, 64, 96, 11)
    exact = ref.fp8_quant_gemm(x, w, ws, bias)  # float64; the two-pass path is exact on these inputs
    assert torch.equal(ref.fp8_quant_gemm_two_pass(x, w, ws, bias).double(), exact)
    out = torch.ops.redfuser.fp8_quant_gemm(x, w, ws, bias, out_dtype)
    want = exact.to(out_dtype)
    assert out.dtype == out_dtype
    assert torch.equal(out, want), (out.float() - want.float()).abs().max().item()
    assert not torch.equal(exact.to(out_dtype).double(), exact)  # the inputs do exercise the rounding


# --------------------------------------------------------------------------------------------- attention
def _few_bit(shape, g, dtype):
    """Values (1 + m / 128) * 2^e * sign with e in [-2, 1]: exact in fp16 and bf16, and every sum of up to 64 of
    them is exact in float32."""
    m = torch.randint(0, 128, shape, generator=g).float()
    e = torch.randint(-2, 2, shape, generator=g).float()
    sign = torch.where(torch.rand(shape, generator=g) < 0.5, -1.0, 1.0)
    return (sign * (1 + m / 128) * torch.exp2(e)).to(dtype)


@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize("Sk", [2, 4, 64])
def test_attention_half_output_is_the_exact_mean_rounded(dtype, Sk):
    """q = 0: every score is 0, every weight exp(0) = 1, l = Sk; out = the mean of the value rows, exact in float32."""
    g = torch.Generator().manual_seed(Sk)
    B, Sq, H, Hk, D = 2, 3, 4, 2, 64
    q = torch.zeros(B, Sq, H, D, dtype=dtype)
    k = _few_bit((B, Sk, Hk, D), g, dtype)
    v = _few_bit((B, Sk, Hk, D), g, dtype)
    out, _ = torch.ops.redfuser.fused_attention(q, k, v, False, None)
    exact, _ = ref.fused_attention(q, k, v)
    want = exact.to(dtype)
    assert torch.equal(out, want), (out.float() - want.float()).abs().max().item()
    if Sk > 2:
        assert not torch.equal(want.double(), exact)  # some means are not representable: rounding is exercised


@pytest.mark.parametrize("dtype", HALF)
def test_mla_half_output_is_the_exact_mean_rounded(dtype):
    g = torch.Generator().manual_seed(5)
    B, Hq, NB = 2, 4, 4
    q = torch.zeros(B, 1, Hq, 576, dtype=dtype)
    kv = _few_bit((NB, 64, 1, 576), g, dtype)
    table = torch.tensor([[2, 0], [1, 3]], dtype=torch.int32)
    lens = torch.tensor([64, 128], dtype=torch.int32)
    out, _ = torch.ops.redfuser.mla_decode(q, kv, table, lens, 512, None, False)
    exact, _ = ref.mla_decode(q, kv, table, lens)
    want = exact.to(dtype)
    assert torch.equal(out, want), (out.float() - want.float()).abs().max().item()
    assert not torch.equal(want.double(), exact)


# --------------------------------------------------------------------------------------------- routing, NaN rows
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("scoring", ["softmax", "sigmoid"])
@pytest.mark.parametrize("grouped", [False, True])
def test_nan_rows_route_like_the_reference(dtype, scoring, grouped):
    E, topk = 64, 6
    ng, tg = (8, 3) if grouped else (1, 1)
    g = torch.Generator().manual_seed(17)
    lg = torch.randn(10, E, generator=g)
    lg[0, 3] = float("nan")       # one NaN
    lg[1] = float("nan")          # all NaN
    lg[2, ::3] = float("nan")     # every third NaN
    lg[3, :40] = float("nan")     # NaN in front, finite behind
    lg[4, 5:] = float("nan")      # finite in front only (fewer than topk after group selection)
    lg[5, [0, 9, 33]] = float("nan")
    lg[6, 60] = float("nan")
    lg[6, 2] = float("-inf")
    lg[7, [1, 62]] = float("nan")
    lg[7, 30] = float("inf")
    lg[8] = torch.round(lg[8] * 2) / 2  # ties
    lg[8, 10] = float("nan")
    lg[9, 40:] = float("nan")
    b = (torch.randn(E, generator=g) * 0.1) if grouped else None
    x = lg.to(dtype)
    w, ids = torch.ops.redfuser.moe_route(x, topk, scoring, True, b, ng, tg, 1.0)
    rw, rids = ref.moe_route(x, topk, scoring, True, b, ng, tg)
    assert torch.equal(ids.long(), rids), (ids, rids)
    assert torch.allclose(w.double(), rw, rtol=1e-5, atol=1e-6, equal_nan=True)
