"""rms_norm_fp8_quant and row_softmax on CUDA: stream_row's final pass writing per-element outputs (GPU only; marker
`gpu`). Never run here (no GPU in the session that wrote it).

Outputs poisoned beforehand (0xFF bytes: an e4m3 NaN, a NaN float), rows with tails and of several chunks, a strided
weight and strided / misaligned rows, zero rows, -inf and NaN rows, fp32/fp16/bf16. The CUDA result is judged
against the float64 references of tests/spec_references.py: q within one e4m3 unit, the scale within float32
rounding; softmax by ACCEPTANCE's rule; and against the library's own CPU kernels (same spec) where exact."""

from __future__ import annotations

import pytest
import torch
from spec_references import E4M3_MIN_SCALE
from spec_references import rms_norm_fp8_quant as rq_reference
from spec_references import softmax as softmax_reference

import redfuser_ops  # noqa: F401 - loads the library: torch.ops.redfuser.*
from bench.poison import poisoned_call

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
# (16, 16384), (3, 32000), (2, 131072): few long rows, split across CTAs (row kernel, merge, final program)
ROWS = [(1, 1), (7, 113), (33, 4095), (5, 4097), (64, 7168), (16, 16384), (3, 32000), (2, 131072)]


def _e4m3_unit(v: torch.Tensor) -> torch.Tensor:
    return torch.exp2(torch.floor(torch.log2(v.abs().clamp(min=2.0**-6))) - 3)


def _judge_quant(q, scale, x, w, eps):
    assert q.dtype == torch.float8_e4m3fn and scale.dtype == torch.float32 and q.shape == x.shape
    ref_v, ref_s = rq_reference(x.cpu(), w.cpu(), eps)
    ref_q = ref_v.to(torch.float8_e4m3fn).double()
    got = q.cpu().double()
    both_nan = torch.isnan(got) & torch.isnan(ref_q)
    assert torch.equal(torch.isnan(got), torch.isnan(ref_q))
    unit = _e4m3_unit(torch.maximum(got.abs(), ref_q.abs()))
    assert (((got - ref_q).abs() <= unit) | both_nan).all()
    s = scale.cpu().double()
    assert torch.equal(torch.isnan(s), torch.isnan(ref_s))
    fin = torch.isfinite(ref_s)
    if fin.any():
        assert ((s[fin] - ref_s[fin]).abs() / ref_s[fin]).max().item() <= 5e-6


def _rows(T, N, dtype, seed, strided=False):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(T, 2 * N if strided else N, device="cuda", generator=gen)
    x = x * 3 * torch.rand(T, 1, device="cuda", generator=gen).add(0.05)
    x = x.to(dtype)
    return x[:, ::2] if strided else x


@pytest.mark.parametrize("T, N", ROWS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_fp8_quant_cuda(T, N, dtype):
    x = _rows(T, N, dtype, T + N)
    w = (1 + 0.5 * torch.randn(2 * N, device="cuda")).to(dtype)[::2]  # a strided weight: copied
    for eps in (1e-6, 1e-2):
        q, scale = poisoned_call(torch.ops.redfuser.rms_norm_fp8_quant, (x, w, eps))
        _judge_quant(q, scale, x, w, eps)
        q_cpu, _ = torch.ops.redfuser.rms_norm_fp8_quant(x.cpu(), w.cpu(), eps)
        # both one e4m3 unit from the reference; the CPU kernels sum in another order: mostly equal bytes
        assert (q.cpu().view(torch.uint8) == q_cpu.view(torch.uint8)).double().mean() >= 0.99


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_fp8_quant_cuda_special_rows(dtype):
    x = _rows(6, 5000, dtype, 1).contiguous()
    w = torch.ones(5000, device="cuda", dtype=dtype)
    x[1] = 0  # floor scale, exact zeros
    x[2, 4500] = float("nan")  # NaN scale and q for the row
    x[3, 10] = float("inf")
    x[4] = 0
    x[4, 4999] = -3  # q = -448
    q, scale = torch.ops.redfuser.rms_norm_fp8_quant(x, w, 1e-6)
    qf = q.float().cpu()
    assert scale[1].item() == torch.tensor(E4M3_MIN_SCALE, dtype=torch.float32).item() and (qf[1] == 0).all()
    assert torch.isnan(scale[2]) and torch.isnan(qf[2]).all() and torch.isnan(scale[3]) and torch.isnan(qf[3]).all()
    assert qf[4, 4999] == -448 and (qf[4, :4999] == 0).all()
    _judge_quant(q, scale, x, w, 1e-6)
    wide = _rows(5, 9008, dtype, 2)[:, 1:9001]  # row stride 9008, base off 16 bytes: the element path
    w = torch.rand(9000, device="cuda").to(dtype)
    q, scale = torch.ops.redfuser.rms_norm_fp8_quant(wide, w, 1e-6)
    _judge_quant(q, scale, wide, w, 1e-6)


def _judge_softmax(out, x):
    ref = softmax_reference(x.cpu())
    plain = torch.softmax(x.cpu(), dim=-1).double().nan_to_num(0.0)
    got = out.cpu().double()
    assert out.dtype == x.dtype and out.shape == x.shape
    assert torch.equal(torch.isnan(got), torch.isnan(ref))
    fin = ~torch.isnan(ref)
    err = (got[fin] - ref[fin]).abs().max().item() if fin.any() else 0.0
    plain_err = (plain[fin] - ref[fin]).abs().max().item() if fin.any() else 0.0
    assert err <= 2 * plain_err + 1e-5, (err, plain_err)


@pytest.mark.parametrize("T, E", ROWS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_row_softmax_cuda(T, E, dtype):
    x = 4 * _rows(T, E, dtype, 7 * T + E)
    out = poisoned_call(torch.ops.redfuser.row_softmax, (x,))
    _judge_softmax(out, x)
    strided = 4 * _rows(T, E, dtype, E, strided=True)
    _judge_softmax(torch.ops.redfuser.row_softmax(strided), strided)


@pytest.mark.parametrize("dtype", DTYPES)
def test_row_softmax_cuda_infinite_rows(dtype):
    x = 4 * _rows(4, 9000, dtype, 3).contiguous()
    x[0] = float("-inf")  # zeros
    x[1, ::3] = float("-inf")
    x[2, :4096] = float("-inf")  # the first chunk all -inf, then finite
    x[3, 17] = float("nan")  # a NaN row
    out = torch.ops.redfuser.row_softmax(x)
    o = out.float().cpu()
    assert (o[0] == 0).all() and (o[1, ::3] == 0).all() and torch.isnan(o[3]).all()
    _judge_softmax(out[:3], x[:3])
