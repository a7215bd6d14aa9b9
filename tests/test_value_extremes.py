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
