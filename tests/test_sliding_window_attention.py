"""sliding_window_attention, an op made only of specs/sliding_window_attention.yaml (sliding window + tanh
soft-capping), through torch.ops.redfuser on the CPU (and CUDA where there is one), judged by ACCEPTANCE.md's rule:
max|out - ref| <= 2 * max|plain - ref| + 1e-5 with ref float64 (float32 for half inputs) and plain the same math in
the inputs' dtype; lse within 1e-3 where finite, with the same infinities. Reference: tests/spec_references.py."""

from __future__ import annotations

import itertools

import pytest
import torch
from spec_references import sliding_window_attention as reference

import redfuser_ops  # noqa: F401  (loads the library)

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
DTYPES = {"cpu": [torch.float32, torch.float16, torch.bfloat16], "cuda": [torch.float16, torch.bfloat16]}
op = torch.ops.redfuser.sliding_window_attention


def inputs(B, Sq, Sk, H, Hk, D, dtype, device, gen):
    """q a transposed (B, H, Sq, D) tensor; k, v slices of one packed (B, Sk, 2, Hk, D): strided views."""
    q = (3 * torch.randn(B, H, Sq, D, generator=gen)).to(dtype).to(device).transpose(1, 2)
    kv = torch.randn(B, Sk, 2, Hk, D, generator=gen).to(dtype).to(device)
    return q, kv[:, :, 0], kv[:, :, 1]


def judge(q, k, v, window, softcap, scale=None):
    out, lse = op(q, k, v, window, softcap, scale)
    ref_dtype = torch.float64 if q.dtype == torch.float32 else torch.float32
    qc, kc, vc = q.cpu(), k.cpu(), v.cpu()
    r_out, r_lse = reference(qc, kc, vc, window, softcap, scale, dtype=ref_dtype)
    p_out, _ = reference(qc, kc, vc, window, softcap, scale, dtype=q.dtype)
    assert out.shape == q.shape and out.dtype == q.dtype and lse.shape == (q.shape[0], q.shape[2], q.shape[1])
    out, lse = out.cpu().to(ref_dtype), lse.cpu().to(ref_dtype)
    err, plain = (out - r_out).abs().max().item(), (p_out.to(ref_dtype) - r_out).abs().max().item()
    assert err <= 2 * plain + 1e-5, (err, plain)
    finite = torch.isfinite(r_lse)
    assert torch.equal(torch.isfinite(lse), finite) and torch.equal(lse[~finite], r_lse[~finite])
    if finite.any():
        assert (lse[finite] - r_lse[finite]).abs().max().item() <= 1e-3
    assert torch.isfinite(out).all()


SHAPES = [
    (1, 1, 1),          # one key
    (17, 113, 1),       # each row sees only its diagonal key
    (113, 203, 64),     # window inside one 64-key chunk or across two
    (128, 217, 100),
    (256, 128, 4096),   # window wider than the keys: plain causal; rows past Sk see nothing (out 0, lse -inf)
    (200, 213, 150),    # window over 3-4 chunks: leading chunks skipped, both bounds inside chunks, key tail
    (1023, 1024, 333),  # on the CPU the same paths at 10x the cost: marked slow there (`pytest -m slow`)
]
CASES = [pytest.param(d, *c, marks=[pytest.mark.slow] if d == "cpu" and c[0] > 1000 else [], id=f"{c[0]}-{c[1]}-{c[2]}-{d}")
         for d in DEVICES for c in SHAPES]


@pytest.mark.parametrize("device, Sq, Sk, window", CASES)
@pytest.mark.parametrize("D", [64, 128])
def test_matches_reference(device, Sq, Sk, window, D):
    gen = torch.Generator().manual_seed(Sq * 5 + Sk + window + D)
    for dtype, (H, Hk) in itertools.product(DTYPES[device], [(4, 4), (4, 1)]):
        q, k, v = inputs(2, Sq, Sk, H, Hk, D, dtype, device, gen)
        judge(q, k, v, window, softcap=20.0 if dtype == torch.float32 else 50.0)


def test_default_scale_and_softcap():
    gen = torch.Generator().manual_seed(3)
    q, k, v = inputs(1, 33, 40, 2, 2, 64, torch.float32, "cpu", gen)
    out, lse = op(q, k, v, 8)
    r_out, r_lse = reference(q, k, v, 8, 50.0, 64**-0.5)
    assert torch.allclose(out.double(), r_out, atol=1e-5) and torch.allclose(lse.double(), r_lse, atol=1e-4)


@pytest.mark.parametrize("window, softcap, message", [(0, 50.0, "the window must hold at least one key"),
                                                      (4, 0.0, "softcap must be positive")])
def test_bad_arguments(window, softcap, message):
    q, k, v = inputs(1, 4, 4, 2, 2, 64, torch.float32, "cpu", torch.Generator().manual_seed(0))
    with pytest.raises(RuntimeError, match=message):
        op(q, k, v, window, softcap)


def _samples():
    gen = torch.Generator().manual_seed(11)
    return [(*inputs(2, 9, 21, 4, 2, 64, torch.float32, "cpu", gen), 5, 30.0, None),
            (*inputs(1, 40, 17, 2, 1, 64, torch.float32, "cpu", gen), 3, 10.0, 0.2),
            (*inputs(1, 5, 5, 2, 2, 64, torch.bfloat16, "cpu", gen), 1, 50.0, None)]


@pytest.mark.parametrize("sample", range(3))
def test_opcheck(sample):
    torch.library.opcheck(op.default, _samples()[sample])


def test_torch_compile_fullgraph():
    q, k, v = inputs(2, 40, 50, 4, 2, 64, torch.float32, "cpu", torch.Generator().manual_seed(6))

    def layer(q, k, v):
        out, lse = op(q * 2, k, v, 16, 30.0)
        return out.sum(-1), lse

    a, b = torch.compile(layer, fullgraph=True)(q, k, v)
    c, d = layer(q, k, v)
    assert torch.allclose(a, c, rtol=1e-5, atol=1e-5) and torch.equal(b, d)
