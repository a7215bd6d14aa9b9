"""Row ops on rows far from 0 (logits shifted by -1e4 .. +1e4, and rows of one element): the results are shift-
equivariant in exact arithmetic, and the online forms must keep them so in float32 -- a running max that does not
start at -inf, or a correction that is not applied, makes exp underflow or overflow here. Compared with float64.
"""

from __future__ import annotations

import pytest
import torch

import redfuser_ops  # noqa: F401 - loads the library


def _rows(T, V, shift, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(T, V, generator=g) * 3 + shift


@pytest.mark.parametrize("shift", [-1.0e4, -300.0, 0.0, 300.0, 1.0e4])
@pytest.mark.parametrize("T, V", [(3, 1), (5, 7), (4, 3000)])
def test_logsumexp_of_shifted_rows(shift, T, V):
    x = _rows(T, V, shift, V)
    out = torch.ops.redfuser.logsumexp(x).double()
    ref = torch.logsumexp(x.double(), dim=-1)
    assert torch.isfinite(out).all()
    assert ((out - ref).abs() <= 1e-6 * ref.abs() + 1e-4).all(), (out - ref).abs().max().item()


@pytest.mark.parametrize("shift", [-1.0e4, -300.0, 300.0, 1.0e4])
@pytest.mark.parametrize("T, V", [(3, 1), (6, 50), (2, 5000)])
def test_cross_entropy_of_shifted_rows(shift, T, V):
    x = _rows(T, V, shift, 7 + V)
    target = torch.randint(0, V, (T,), generator=torch.Generator().manual_seed(V))
    out = torch.ops.redfuser.softmax_cross_entropy(x, target, 0.0, -100).double()
    ref = torch.nn.functional.cross_entropy(x.double(), target, reduction="none")
    # the loss is lse - x[target]: both near the shift, so float32 inputs carry an absolute error ~ |shift| * 2^-24
    assert ((out - ref).abs() <= 4 * abs(shift) * 2.0**-24 + 1e-4).all(), (out - ref).abs().max().item()


DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("eps", [0.0, 0.1])
@pytest.mark.parametrize("V", [50, 3000])
def test_cross_entropy_with_masked_classes(device, eps, V):
    """Classes masked out with -inf logits (constrained decoding, padded vocabularies): without label smoothing the
    loss is finite, as in torch (the mean of the logits, -inf there, takes no part: 0 * inf made it NaN); with it
    the smoothing term is +inf; a -inf target logit makes the loss +inf either way."""
    g = torch.Generator().manual_seed(V)
    x = torch.randn(6, V, generator=g) * 3
    x[:, 1::7] = float("-inf")
    x[5, :] = float("-inf")
    x[5, 3] = 1.0  # one class left
    target = torch.tensor([0, 2, V - 1, 1, 8, 3])  # row 3's and row 4's targets are masked classes (1, 8)
    for dtype in (torch.float32, torch.bfloat16):
        xd = x.to(dtype).to(device)
        out = torch.ops.redfuser.softmax_cross_entropy(xd, target.to(device), eps).double().cpu()
        ref = torch.nn.functional.cross_entropy(x.to(dtype).double(), target, reduction="none", label_smoothing=eps)
        assert torch.equal(out.isinf(), ref.isinf()) and not out.isnan().any(), (out, ref)
        fin = ref.isfinite()
        assert fin.sum() == (0 if eps else 4)
        assert ((out[fin] - ref[fin]).abs() <= 1e-5 * ref[fin].abs() + 1e-5).all(), (out, ref)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("V", [1, 50, 3000])
def test_logsumexp_of_rows_with_infinities(device, V):
    """log(sum(exp(x))) of a row holding +inf is +inf, as in torch (the online form's l is exp(inf - inf) = NaN
    there); a row of -inf gives -inf, a -inf element is a 0 term, a NaN makes the row NaN."""
    g = torch.Generator().manual_seed(V)
    x = torch.randn(6, V, generator=g) * 3
    x[0, V // 2] = float("inf")
    x[1, :] = float("-inf")
    x[2, ::2] = float("-inf")
    x[3, 0] = float("nan")
    x[4, -1] = float("inf")
    x[4, 0] = float("-inf")
    x[5, 0] = float("inf")
    x[5, -1] = float("nan")
    for dtype in (torch.float32, torch.bfloat16):
        out = torch.ops.redfuser.logsumexp(x.to(dtype).to(device)).double().cpu()
        ref = torch.logsumexp(x.to(dtype).double(), dim=-1)
        assert torch.equal(out.isnan(), ref.isnan()) and torch.equal(out.isposinf(), ref.isposinf()), (out, ref)
        assert torch.equal(out.isneginf(), ref.isneginf()), (out, ref)
        fin = ref.isfinite()
        assert ((out[fin] - ref[fin]).abs() <= 1e-5 * ref[fin].abs() + 1e-5).all(), (out, ref)
