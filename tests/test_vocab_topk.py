"""vocab_topk, an op made only of its YAML spec (specs/vocab_topk.yaml: top-k of a vocabulary for sampling, one pass
over rows of any length), on the CPU through torch.ops.redfuser. Ids must equal the float64 reference exactly (the
order of the row's own values, ties to the lower id, NaN after every number); probabilities are judged by
ACCEPTANCE.md's rule against float64, the plain computation in float32. Reference: tests/spec_references.py."""

from __future__ import annotations

import pytest
import torch
from spec_references import vocab_topk as topk_reference

import redfuser_ops  # noqa: F401  (loads the library)

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
CASES = [(1, 1, 1), (17, 113, 5), (64, 1000, 50), (4, 32000, 64), (2, 131072, 20), (3, 2000, 300)]


def check(x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    probs, ids = torch.ops.redfuser.vocab_topk(x, k)
    assert probs.shape == ids.shape == (x.shape[0], k) and probs.dtype == torch.float32 and ids.dtype == torch.int64
    ref_p, ref_i = topk_reference(x, k)
    plain_p, _ = topk_reference(x, k, dtype=torch.float32)
    assert torch.equal(ids, ref_i)
    assert torch.equal(torch.isnan(probs), torch.isnan(ref_p))
    fin = ~torch.isnan(ref_p)
    err = (probs.double()[fin] - ref_p[fin]).abs().max().item() if fin.any() else 0.0
    plain_err = (plain_p.double()[fin] - ref_p[fin]).abs().max().item() if fin.any() else 0.0
    assert err <= 2 * plain_err + 1e-5, (err, plain_err)
    return probs, ids


@pytest.mark.parametrize("T, V, k", CASES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_matches_reference(T, V, k, dtype):
    gen = torch.Generator().manual_seed(T * V + k)
    x = (4 * torch.randn(T, 2 * V, generator=gen)).to(dtype)[:, ::2]  # a strided view, as a model's slice
    check(x, k)


def test_ties_nan_and_infinities():
    gen = torch.Generator().manual_seed(2)
    x = torch.randint(-3, 4, (6, 5000), generator=gen).float()
    x[1] = 0.0
    x[1, 1::2] = -0.0  # -0.0 ties +0.0: the lower id first
    x[2, [7, 4000]] = float("nan")
    x[3] = float("-inf")
    x[4, [9, 99]] = float("inf")
    x[5, :4990] = float("-inf")
    probs, ids = check(x, 64)
    assert ids[1].tolist() == list(range(64)) and ids[3].tolist() == list(range(64))
    assert torch.isnan(probs[[2, 3, 4]]).all() and (probs[5, 10:] == 0).all()
    # NaN logits rank after every number
    probs, ids = check(torch.tensor([[float("nan"), 1.0, float("-inf"), float("nan")]]), 4)
    assert ids.tolist() == [[1, 2, 0, 3]]


def test_agrees_with_torch_topk_without_ties():
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(8, 50000, generator=gen)
    probs, ids = torch.ops.redfuser.vocab_topk(x, 40)
    want = torch.softmax(x.double(), dim=-1).topk(40, dim=-1)
    assert torch.equal(ids, want.indices)
    assert torch.allclose(probs.double(), want.values, rtol=1e-5, atol=1e-9)


@pytest.mark.parametrize("k, message", [(0, "k must be positive"), (6, "k must not exceed")])
def test_bad_arguments(k, message):
    with pytest.raises(Exception, match=message):
        torch.ops.redfuser.vocab_topk(torch.randn(2, 5), k)


def test_opcheck():
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(5, 300, generator=gen)
    torch.library.opcheck(torch.ops.redfuser.vocab_topk.default, (x, 7))
    torch.library.opcheck(torch.ops.redfuser.vocab_topk.default, (x.bfloat16(), 1))


def test_torch_compile_fullgraph():
    gen = torch.Generator().manual_seed(6)
    x = torch.randn(4, 3000, generator=gen)

    def sample_weights(x):
        probs, ids = torch.ops.redfuser.vocab_topk(x * 0.5, 10)
        return probs / probs.sum(-1, keepdim=True), ids

    a = torch.compile(sample_weights, fullgraph=True)(x)
    b = sample_weights(x)
    assert torch.equal(a[1], b[1]) and torch.allclose(a[0], b[0], rtol=1e-6)
