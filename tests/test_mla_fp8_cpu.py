"""mla_decode and fp8_quant_gemm on CPU (their CUDA templates come later), judged by the rules of ACCEPTANCE.md."""

from __future__ import annotations

import pytest
import torch

import redfuser_ops
from redfuser_ops import reference as ref


def _paged(B, Sq, Hq, lens, dtype, gen, page=64):
    """A paged cache with shuffled blocks and garbage in unused table entries."""
    mb = max(1, max((n + page - 1) // page for n in lens))
    nb = B * mb + 3
    kv = torch.randn(nb, page, 1, 576, generator=gen).to(dtype)
    perm = torch.randperm(nb, generator=gen)
    table = torch.full((B, mb), 10**6, dtype=torch.int32)  # unused entries hold any value
    for b, n in enumerate(lens):
        used = (n + page - 1) // page
        table[b, :used] = perm[b * mb: b * mb + used].int()
    q = torch.randn(B, Sq, Hq, 576, generator=gen).to(dtype)
    return q, kv, table, torch.tensor(lens, dtype=torch.int32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("Sq, Hq, lens", [(1, 16, [1, 64, 65, 300]), (4, 2, [0, 5, 130]), (2, 128, [17])])
def test_mla_decode_matches_reference(dtype, causal, Sq, Hq, lens):
    gen = torch.Generator().manual_seed(len(lens) * 10 + Sq)
    q, kv, table, seqlens = _paged(len(lens), Sq, Hq, lens, dtype, gen)
    out, lse = torch.ops.redfuser.mla_decode(q, kv, table, seqlens, 512, None, causal)
    ref_dtype = torch.float64 if dtype == torch.float32 else torch.float32
    r_out, r_lse = ref.mla_decode(q, kv, table, seqlens, 512, None, causal, dtype=ref_dtype)
    p_out, _ = ref.mla_decode(q, kv, table, seqlens, 512, None, causal, dtype=dtype)
    assert out.shape == (len(lens), Sq, Hq, 512) and out.dtype == dtype and lse.shape == (len(lens), Hq, Sq)
    plain_err = (p_out.to(ref_dtype) - r_out).abs().max().item()
    assert (out.to(ref_dtype) - r_out).abs().max().item() <= 2 * plain_err + 1e-5
    finite = torch.isfinite(r_lse)
    assert torch.equal(torch.isfinite(lse), finite)
    assert torch.equal(lse.to(ref_dtype)[~finite], r_lse[~finite])
    assert (lse.to(ref_dtype)[finite] - r_lse[finite]).abs().max().item() <= 1e-3
    if 0 in lens:  # an empty sequence: out 0, lse -inf
        b = lens.index(0)
        assert torch.all(out[b] == 0) and torch.all(lse[b] == float("-inf"))


def test_mla_decode_head_dim_v_and_checks():
    gen = torch.Generator().manual_seed(3)
    q, kv, table, seqlens = _paged(2, 1, 4, [10, 70], torch.float32, gen)
    out, _ = redfuser_ops.mla_decode(q, kv, table, seqlens, head_dim_v=128, softmax_scale=0.1)
    r_out, _ = ref.mla_decode(q, kv, table, seqlens, 128, 0.1)
    assert out.shape[-1] == 128 and (out.double() - r_out).abs().max().item() < 1e-5
    with pytest.raises(RuntimeError, match="head_dim_v must not exceed the cached row width 576"):
        torch.ops.redfuser.mla_decode(q, kv, table, seqlens, 600)
    with pytest.raises(RuntimeError, match="kv_cache.size.1. must equal 64"):
        torch.ops.redfuser.mla_decode(q, kv[:, :32], table, seqlens)


def _fp8_inputs(M, N, K, x_dtype, gen, per_channel=True):
    x = torch.randn(M, K, generator=gen).to(x_dtype)
    w = (torch.randn(N, K, generator=gen) * 0.5).to(torch.float8_e4m3fn)
    ws = torch.rand(N if per_channel else 1, generator=gen) + 0.5
    return x, w, ws


@pytest.mark.parametrize("x_dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("M, N, K", [(1, 16, 16), (17, 32, 64), (113, 48, 272)])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("per_channel", [True, False])
def test_fp8_quant_gemm_matches_reference(x_dtype, M, N, K, bias, per_channel):
    gen = torch.Generator().manual_seed(M + N + K)
    x, w, ws = _fp8_inputs(M, N, K, x_dtype, gen, per_channel)
    x[M // 2] = 0  # an all-zero row: exact zeros (or the bias), never NaN
    b = torch.randn(N, generator=gen) if bias else None
    out = torch.ops.redfuser.fp8_quant_gemm(x, w, ws, b)
    assert out.dtype == x_dtype and out.shape == (M, N)
    wsf = ws if per_channel else ws.expand(N)
    r = ref.fp8_quant_gemm(x, w, wsf, b)
    two = ref.fp8_quant_gemm_two_pass(x, w, wsf, b).double()
    tol = 2 * (two - r).abs().max().item() + 1e-2 * r.abs().max().item()
    assert (out.double() - r).abs().max().item() <= tol
    zero_row = out[M // 2].double()
    expected = b.to(x_dtype).double() if bias else torch.zeros(N, dtype=torch.float64)
    assert torch.equal(zero_row, expected)


def test_fp8_out_dtype_and_checks():
    gen = torch.Generator().manual_seed(1)
    x, w, ws = _fp8_inputs(5, 16, 32, torch.bfloat16, gen)
    assert torch.ops.redfuser.fp8_quant_gemm(x, w, ws, None, torch.float32).dtype == torch.float32
    with pytest.raises(RuntimeError, match="K must be a multiple of 16"):
        torch.ops.redfuser.fp8_quant_gemm(x[:, :24], w[:, :24], ws)
    with pytest.raises(RuntimeError, match="w_scale must have N entries or 1"):
        torch.ops.redfuser.fp8_quant_gemm(x, w, torch.ones(3))
    with pytest.raises(RuntimeError, match="w must be float8_e4m3fn"):
        torch.ops.redfuser.fp8_quant_gemm(x, w.float(), ws)


@pytest.mark.parametrize("op", ["mla", "fp8"])
def test_opcheck_and_compile(op):
    gen = torch.Generator().manual_seed(2)
    if op == "mla":
        args = (*_paged(2, 2, 4, [10, 70], torch.float32, gen), 512, None, True)
        fn = torch.ops.redfuser.mla_decode.default
    else:
        x, w, ws = _fp8_inputs(7, 16, 32, torch.float32, gen)
        args = (x, w, ws, None, None)
        fn = torch.ops.redfuser.fp8_quant_gemm.default
    # opcheck's schema test compares tensors with ops torch has no CPU kernel for on float8 (mul on Float8_e4m3fn)
    utils = ("test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")
    torch.library.opcheck(fn, args, test_utils=utils if op == "fp8" else "ALL")
    compiled = torch.compile(lambda *a: fn(*a), fullgraph=True)
    got, want = compiled(*args), fn(*args)
    for g, w_ in zip(got if isinstance(got, tuple) else (got,), want if isinstance(want, tuple) else (want,)):
        assert torch.equal(g, w_)
