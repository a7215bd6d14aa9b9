"""logsumexp, softmax_cross_entropy and vocab_topk on CUDA: the stream_row template (GPU only; marker `gpu`).

Outputs poisoned beforehand (every row written), rows with tails and of a 128k vocabulary, strided and
misaligned rows (the element-by-element path), int64 and int32 targets, label smoothing, ignore_index, -inf and NaN
rows, a CUDA graph replay on the current stream. Judged by ACCEPTANCE.md's rule against float64 (on the CPU)."""

from __future__ import annotations

import pytest
import torch
from spec_references import logsumexp as lse_reference
from spec_references import softmax_cross_entropy as ce_reference
from spec_references import vocab_topk as topk_reference

import redfuser_ops  # noqa: F401 - loads the library: torch.ops.redfuser.*
from bench.poison import poisoned_call

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
ROWS = [(1, 1), (7, 113), (33, 4095), (5, 4097), (64, 32000), (16, 128256), (3, 262144)]


def _judge(out, ref, plain):
    out = out.cpu().double()
    fin = torch.isfinite(ref)
    assert torch.equal(torch.isnan(out), torch.isnan(ref))
    assert torch.equal(out[~fin & ~torch.isnan(ref)], ref[~fin & ~torch.isnan(ref)])
    err = (out[fin] - ref[fin]).abs().max().item() if fin.any() else 0.0
    plain_err = (plain.double()[fin] - ref[fin]).abs().max().item() if fin.any() else 0.0
    assert err <= 2 * plain_err + 1e-5, (err, plain_err)


def _logits(T, V, dtype, seed, strided=False):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    x = (4 * torch.randn(T, 2 * V if strided else V, device="cuda", generator=gen)).to(dtype)
    return x[:, ::2] if strided else x


@pytest.mark.parametrize("T, V", ROWS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_logsumexp_cuda(T, V, dtype):
    x = _logits(T, V, dtype, T + V)
    out = poisoned_call(torch.ops.redfuser.logsumexp, (x,))
    xc = x.cpu()
    _judge(out, lse_reference(xc), lse_reference(xc, dtype=torch.float32))


@pytest.mark.parametrize("T, V", ROWS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("index_dtype", [torch.int64, torch.int32])
def test_cross_entropy_cuda(T, V, dtype, index_dtype):
    x = _logits(T, V, dtype, 3 * T + V)
    gen = torch.Generator(device="cuda").manual_seed(T)
    target = torch.randint(0, V, (T,), device="cuda", generator=gen)
    target[::3] = -100
    target = target.to(index_dtype)
    for eps in (0.0, 0.1):
        out = poisoned_call(torch.ops.redfuser.softmax_cross_entropy, (x, target, eps))
        xc, tc = x.cpu(), target.cpu()
        _judge(out, ce_reference(xc, tc, eps), ce_reference(xc, tc, eps, dtype=torch.float32))
        assert torch.all(out[::3] == 0)


@pytest.mark.parametrize("dtype", DTYPES)
def test_strided_and_misaligned_rows(dtype):
    x = _logits(9, 10001, dtype, 1, strided=True)  # element stride 2: copied to dense rows
    out = torch.ops.redfuser.logsumexp(x)
    _judge(out, lse_reference(x.cpu()), lse_reference(x.cpu(), dtype=torch.float32))
    wide = _logits(9, 10008, dtype, 2)[:, 1:10001]  # row stride 10008, base off 16 bytes: element path
    out = torch.ops.redfuser.logsumexp(wide)
    _judge(out, lse_reference(wide.cpu()), lse_reference(wide.cpu(), dtype=torch.float32))


def test_nonfinite_rows():
    x = _logits(4, 9000, torch.float32, 5)
    x[0] = float("-inf")
    x[1, 8999] = float("nan")
    x[2, :4096] = float("-inf")
    out = torch.ops.redfuser.logsumexp(x)
    assert out[0].item() == float("-inf") and torch.isnan(out[1])
    _judge(out, lse_reference(x.cpu()), lse_reference(x.cpu(), dtype=torch.float32))


def test_cuda_graph_current_stream():
    x = _logits(32, 50000, torch.bfloat16, 7)
    target = torch.randint(0, 50000, (32,), device="cuda")
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        torch.ops.redfuser.softmax_cross_entropy(x, target, 0.1)  # warm-up (module init) outside capture
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, stream=s):
            out = torch.ops.redfuser.softmax_cross_entropy(x, target, 0.1)
        x.copy_(_logits(32, 50000, torch.bfloat16, 8))
        g.replay()
    torch.cuda.synchronize()
    xc, tc = x.cpu(), target.cpu()
    _judge(out, ce_reference(xc, tc, 0.1), ce_reference(xc, tc, 0.1, dtype=torch.float32))


@pytest.mark.parametrize("T, V, k", [(1, 1, 1), (7, 113, 5), (33, 4097, 64), (64, 32000, 50), (16, 128256, 50),
                                     (3, 262144, 1)])
@pytest.mark.parametrize("dtype", DTYPES)
def test_vocab_topk_cuda(T, V, k, dtype):
    """Ids equal the reference exactly (and the CPU op's); probabilities by the rule."""
    x = _logits(T, V, dtype, 5 * T + V + k, strided=V == 4097)
    probs, ids = poisoned_call(torch.ops.redfuser.vocab_topk, (x, k))
    xc = x.cpu()
    ref_p, ref_i = topk_reference(xc, k)
    assert torch.equal(ids.cpu(), ref_i)
    _judge(probs, ref_p, topk_reference(xc, k, dtype=torch.float32)[0])
    assert torch.equal(ids.cpu(), torch.ops.redfuser.vocab_topk(xc, k)[1])


def test_vocab_topk_ties_nonfinite_and_limit():
    x = torch.randint(-3, 4, (5, 20000), device="cuda").float()
    x[1] = float("-inf")
    x[2, [5, 19999]] = float("nan")
    x[3, [9, 10000]] = float("inf")
    x[4, 1::2] = -0.0
    x[4, ::2] = 0.0
    probs, ids = torch.ops.redfuser.vocab_topk(x, 64)
    ref_p, ref_i = topk_reference(x.cpu(), 64)
    assert torch.equal(ids.cpu(), ref_i) and ids[4].tolist() == list(range(64))
    assert torch.equal(torch.isnan(probs.cpu()), torch.isnan(ref_p))
    with pytest.raises(Exception, match="at most 64 entries"):
        torch.ops.redfuser.vocab_topk(x, 65)
