"""softmax_cross_entropy and logsumexp, ops made only of their YAML specs (one pass over rows of any length), on
the CPU through torch.ops.redfuser, judged by ACCEPTANCE.md's rule: max|out - ref| <= 2 * max|plain - ref| + 1e-5,
ref in float64, plain the same math in the inputs' dtype. References: tests/spec_references.py."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from spec_references import logsumexp as lse_reference
from spec_references import softmax_cross_entropy as ce_reference

import redfuser_ops  # noqa: F401  (loads the library)

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
ROWS = [(1, 1), (17, 113), (113, 1023), (4, 32000), (2, 131072)]  # vocabulary-size rows too


def judge(out, ref, plain):
    err, plain_err = (out.double() - ref).abs().max().item(), (plain.double() - ref).abs().max().item()
    assert err <= 2 * plain_err + 1e-5, (err, plain_err)


def logits_of(T, V, dtype, gen):
    """(T, V) logits as a strided view (every other column of a wider tensor), with a spread like a model's."""
    return (4 * torch.randn(T, 2 * V, generator=gen)).to(dtype)[:, ::2]


@pytest.mark.parametrize("T, V", ROWS)
@pytest.mark.parametrize("eps", [0.0, 0.1])
@pytest.mark.parametrize("index_dtype", [torch.int64, torch.int32])
def test_cross_entropy_matches_reference(T, V, eps, index_dtype):
    gen = torch.Generator().manual_seed(T * 7 + V + int(eps * 10))
    for dtype in DTYPES:
        x = logits_of(T, V, dtype, gen)
        target = torch.randint(0, V, (T,), generator=gen)
        target[::3] = -100  # ignored tokens
        target = target.to(index_dtype)
        out = torch.ops.redfuser.softmax_cross_entropy(x, target, eps)
        assert out.shape == (T,) and out.dtype == torch.float32
        ref = ce_reference(x, target, eps)
        judge(out, ref, ce_reference(x, target, eps, dtype=dtype))
        assert torch.equal(out[::3], torch.zeros_like(out[::3]))
        # the reference is torch's cross_entropy (reduction='none')
        tl = F.cross_entropy(x.double(), target.long(), reduction="none", label_smoothing=eps)
        assert torch.allclose(ref, tl, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("dtype", DTYPES)
def test_cross_entropy_targets_at_the_edges_of_the_row(dtype):
    """Targets at the first and last class and on both sides of the CPU kernel's 512-element chunks (it reads the
    target's logit once per row at its index rather than selecting it from every element); a target logit of -inf
    gives an infinite loss and a NaN one a NaN loss."""
    V = 1537
    targets = [0, V - 1, 0, 1, 510, 511, 512, 513, 1023, 1024, 1535, V - 1]
    gen = torch.Generator().manual_seed(11)
    x = (4 * torch.randn(len(targets), V, generator=gen)).to(dtype)
    x[0, 0] = float("-inf")
    x[1, V - 1] = float("nan")
    target = torch.tensor(targets)
    for eps in (0.0, 0.1):
        out = torch.ops.redfuser.softmax_cross_entropy(x, target, eps)
        assert out[0] == float("inf") and out[1].isnan()
        judge(out[2:], ce_reference(x[2:], target[2:], eps), ce_reference(x[2:], target[2:], eps, dtype=dtype))


def test_cross_entropy_ignore_index_and_default_arguments():
    gen = torch.Generator().manual_seed(2)
    x = logits_of(9, 50, torch.float32, gen)
    target = torch.randint(0, 50, (9,), generator=gen)
    target[4] = 7
    out = torch.ops.redfuser.softmax_cross_entropy(x, target, 0.0, 7)
    assert out[4] == 0 and torch.allclose(out.double(), ce_reference(x, target, 0.0, 7), atol=1e-5)
    assert torch.allclose(torch.ops.redfuser.softmax_cross_entropy(x, target).double(), ce_reference(x, target),
                          atol=1e-5)


@pytest.mark.parametrize("eps, message", [(-0.1, "label_smoothing must be in"), (1.5, "label_smoothing must be in")])
def test_cross_entropy_bad_arguments(eps, message):
    x, target = torch.randn(3, 5), torch.zeros(3, dtype=torch.int64)
    with pytest.raises(RuntimeError, match=message):
        torch.ops.redfuser.softmax_cross_entropy(x, target, eps)
    with pytest.raises(RuntimeError, match="target"):
        torch.ops.redfuser.softmax_cross_entropy(x, target.float(), 0.0)


@pytest.mark.parametrize("T, V", ROWS)
def test_logsumexp_matches_reference(T, V):
    gen = torch.Generator().manual_seed(T + V)
    for dtype in DTYPES:
        x = logits_of(T, V, dtype, gen)
        out = torch.ops.redfuser.logsumexp(x)
        assert out.shape == (T,) and out.dtype == torch.float32
        judge(out, lse_reference(x), lse_reference(x, dtype=dtype))


def test_few_long_rows_split_across_threads():
    """A row kernel's rows per task follow the row length (ROW_TASK_ELEMENTS): 3 rows of 70,000 go to separate
    threads. Every row must still be its own, whatever thread computes it."""
    gen = torch.Generator().manual_seed(7)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        for T in (1, 2, 3, 5):
            x = logits_of(T, 70_000, torch.float32, gen)
            x[T // 2] += 3.0  # rows that differ: a swapped or repeated row shows
            judge(torch.ops.redfuser.logsumexp(x), lse_reference(x), lse_reference(x, dtype=torch.float32))
            target = torch.randint(0, 70_000, (T,), generator=gen)
            out = torch.ops.redfuser.softmax_cross_entropy(x, target, 0.1)
            judge(out, ce_reference(x, target, 0.1), ce_reference(x, target, 0.1, dtype=torch.float32))
    finally:
        torch.set_num_threads(threads)


def test_logsumexp_infinities():
    x = torch.tensor([[float("-inf")] * 5, [0.0, float("-inf"), 1.0, float("-inf"), 2.0]])
    out = torch.ops.redfuser.logsumexp(x)
    assert out[0] == float("-inf") and torch.allclose(out[1:].double(), lse_reference(x[1:]), atol=1e-6)


def _samples():
    gen = torch.Generator().manual_seed(11)
    x = logits_of(5, 37, torch.float32, gen)
    return [(torch.ops.redfuser.softmax_cross_entropy.default, (x, torch.randint(0, 37, (5,), generator=gen), 0.1)),
            (torch.ops.redfuser.softmax_cross_entropy.default,
             (x.bfloat16(), torch.randint(0, 37, (5,), generator=gen).int(), 0.0, 3)),
            (torch.ops.redfuser.logsumexp.default, (x,)),
            (torch.ops.redfuser.logsumexp.default, (x.half(),))]


@pytest.mark.parametrize("sample", range(4))
def test_opcheck(sample):
    op, args = _samples()[sample]
    torch.library.opcheck(op, args)


def test_torch_compile_fullgraph():
    gen = torch.Generator().manual_seed(6)
    x = logits_of(8, 300, torch.float32, gen)
    target = torch.randint(0, 300, (8,), generator=gen)

    def loss(x, target):
        per_token = torch.ops.redfuser.softmax_cross_entropy(x * 2, target, 0.1)
        return per_token.mean() + torch.ops.redfuser.logsumexp(x).square().mean()

    a = torch.compile(loss, fullgraph=True)(x, target)
    assert torch.allclose(a, loss(x, target), rtol=1e-6)
