"""moe_route through torch.ops.redfuser against the float64 reference (redfuser_ops.reference).

ids must equal the reference's exactly (ties to the lower id); weights within 1e-5 (fp32 logits) or 2e-2
(fp16/bf16). Logits and bias are drawn on a grid of 1/64, so exact ties happen (and test the tie rule); a row
where two different candidates' float64 keys are closer than float32 can resolve (relative 1e-6) is drawn
again, since any float32 implementation may order those by rounding.
"""

from __future__ import annotations

import itertools

import pytest
import torch

import redfuser_ops
from redfuser_ops import reference as ref

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
EXPERTS = [6, 16, 64, 160, 256, 384, 512]
TOPKS = [1, 2, 6, 8]
TOKENS = [1, 7, 33, 1000]


def _near_tie(keys: torch.Tensor, order: torch.Tensor, upto: int) -> torch.Tensor:
    """Rows where two keys next to each other in selection order (positions 0..upto) differ by less than
    float32 can resolve (relative 1e-6) without being equal."""
    k = torch.gather(keys, -1, order[..., : upto + 1])
    gap = (k[..., :-1] - k[..., 1:]).abs()
    near = (gap > 0) & (gap < 1e-6 * k[..., :-1].abs().clamp_min(1e-30))
    return near.reshape(near.shape[0], -1).any(dim=1)


def draw(T, E, dtype, bias, n_group, topk, topk_group, scoring, gen):
    """Logits (and bias) on a 1/64 grid, re-drawing rows whose selection would be decided by rounding: the
    order of the top-k candidates and the next one, of each group's best two, and of the kept groups."""
    logits = torch.round(torch.randn(T, E, generator=gen, dtype=torch.float64) * 2 * 64) / 64
    b = torch.round(torch.randn(E, generator=gen, dtype=torch.float64) * 64) / 64 if bias else None
    size = E // n_group
    for _ in range(100):
        lg = logits.to(dtype)
        _, _, key, gscore = ref.moe_route(lg, topk, scoring, False, b, n_group, topk_group, return_keys=True)
        groups = key.reshape(T, n_group, size)
        keep = torch.zeros(T, n_group, dtype=torch.bool)
        keep.scatter_(1, ref.selection_order(gscore)[:, :topk_group], True)
        cand = keep.repeat_interleave(size, dim=1)
        bad = _near_tie(key, ref.selection_order(key, cand), min(topk, E - 1))
        if n_group > 1:
            bad |= _near_tie(groups, ref.selection_order(groups), min(2, size - 1))
            bad |= _near_tie(gscore, ref.selection_order(gscore), min(topk_group, n_group - 1))
        if not bad.any():
            return lg, (b.float() if b is not None else None)
        logits[bad] = torch.round(torch.randn(int(bad.sum()), E, generator=gen, dtype=torch.float64) * 2 * 64) / 64
    raise AssertionError("could not draw logits without near ties")


def check(lg, topk, scoring, renorm, b, ng, tg, scale, device):
    w, ids = torch.ops.redfuser.moe_route(lg.to(device), topk, scoring, renorm, None if b is None else b.to(device),
                                          ng, tg, scale)
    rw, rids = ref.moe_route(lg, topk, scoring, renorm, b, ng, tg, scale)
    assert ids.dtype == torch.int32 and w.dtype == torch.float32
    assert ids.shape == (lg.shape[0], topk) and w.shape == (lg.shape[0], topk)
    assert torch.equal(ids.cpu().long(), rids), (ids.cpu(), rids)
    tol = 1e-5 if lg.dtype == torch.float32 else 2e-2
    err = (w.cpu().double() - rw).abs().max().item() if w.numel() else 0.0
    assert err <= tol, err


# grouped: DeepSeek-V3 style, 8 groups of which 4 are kept, wherever E allows it (E divisible by 8, topk experts
# fit in the kept groups); the path with the group reductions and 3 resident passes
SHAPES = [(e, k, g) for e in EXPERTS for k in TOPKS if k <= e
          for g in (False, True) if not g or (e % 8 == 0 and k <= 4 * (e // 8))]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("E, topk, grouped", SHAPES, ids=lambda v: str(v))
@pytest.mark.parametrize("scoring", ["softmax", "sigmoid"])
@pytest.mark.parametrize("bias", [False, True], ids=["nobias", "bias"])
@pytest.mark.parametrize("renorm", [False, True], ids=["raw", "renorm"])
def test_moe_route_matches_reference(device, E, topk, grouped, scoring, bias, renorm):
    ng, tg = (8, 4) if grouped else (1, 1)
    gen = torch.Generator().manual_seed(E * 1000 + topk * 10 + grouped)
    # every dtype at T in {1, 7, 33}; T = 1000 (the same per-row code, split over threads) once per case, its
    # dtype rotating over the cases so that each dtype meets T = 1000 in a third of them
    big = DTYPES[(E + topk + scoring.startswith("s") + bias + grouped + renorm) % 3]
    cases = [(T, d) for T, d in itertools.product(TOKENS, DTYPES) if T != 1000 or d == big]
    for T, dtype in cases:
        lg, b = draw(T, E, dtype, bias, ng, topk, tg, scoring, gen)
        check(lg, topk, scoring, renorm, b, ng, tg, 1.0 if not renorm else 2.5, device)


@pytest.mark.parametrize("device", DEVICES)
def test_ties_go_to_the_lower_expert_id(device):
    # every logit equal: the selection is 0, 1, ..., topk-1; with a bias the bias decides, equal biases by id
    lg = torch.zeros(3, 64)
    w, ids = torch.ops.redfuser.moe_route(lg.to(device), 6)
    assert ids.cpu().tolist() == [list(range(6))] * 3
    assert torch.allclose(w.cpu(), torch.full((3, 6), 1 / 64))
    b = torch.zeros(64)
    b[[40, 41, 50]] = 1.0
    _, ids = torch.ops.redfuser.moe_route(lg.to(device), 5, "sigmoid", False, b.to(device))
    assert ids.cpu().tolist() == [[40, 41, 50, 0, 1]] * 3


def test_softmax_scores_that_round_to_zero_keep_the_logit_order():
    """exp(x - m) / z is strictly increasing in x, so the softmax router selects on x: experts whose float32 score
    underflows to 0 are still ranked by their logits, as the float64 reference ranks them (a selection on the
    rounded scores would tie them and take the lower ids). CPU only: the CUDA kernels select on the rounded score."""
    lg = torch.full((2, 16), -200.0)
    lg[:, :4] = torch.tensor([0.0, -120.0, -110.0, -105.0])
    lg[1] = lg[1].flip(0)
    w, ids = torch.ops.redfuser.moe_route(lg, 4)
    _, rids = ref.moe_route(lg, 4)
    assert rids.tolist() == [[0, 3, 2, 1], [15, 12, 13, 14]]
    assert torch.equal(ids.long(), rids)
    assert w[:, 0].tolist() == [1.0, 1.0] and (w[:, 1:] == 0).all()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("scoring", ["softmax", "sigmoid"])
@pytest.mark.parametrize("grouped", [False, True])
def test_nan_and_inf_rows_give_valid_distinct_ids(device, dtype, scoring, grouped):
    E, topk = 160, 8
    ng, tg = (8, 4) if grouped else (1, 1)
    lg = torch.randn(8, E)
    lg[0, 3] = float("nan")
    lg[1] = float("nan")
    lg[2, 5] = float("inf")
    lg[3] = float("-inf")
    lg[4, :80] = float("-inf")
    lg[5, 7] = float("-inf")
    lg[6] = float("inf")
    lg[7, ::3] = float("nan")
    b = torch.randn(E) if grouped else None
    _, ids = torch.ops.redfuser.moe_route(lg.to(dtype).to(device), topk, scoring, True, None if b is None else b.to(device),
                                          ng, tg)
    ids = ids.cpu()
    assert ((ids >= 0) & (ids < E)).all()
    for row in ids.tolist():
        assert len(set(row)) == topk, row
    # a row whose only NaN is one element still selects like the reference among the finite ones
    _, rids = ref.moe_route(lg[5:6].to(dtype), topk, scoring, True, b, ng, tg)
    assert torch.equal(ids[5:6].long(), rids)


@pytest.mark.parametrize("device", DEVICES)
def test_strided_logits(device):
    gen = torch.Generator().manual_seed(3)
    base = torch.round(torch.randn(160, 40, generator=gen) * 128) / 64
    lg = base.t()  # (40, 160) with stride (1, 40)
    assert not lg.is_contiguous()
    check(lg, 6, "softmax", True, None, 8, 4, 1.0, device)
    check(base[:, ::2].t().contiguous().t().t(), 4, "sigmoid", False, None, 1, 1, 1.0, device)


def test_typed_wrapper_and_defaults():
    lg = torch.round(torch.randn(5, 64) * 64) / 64
    w1, i1 = redfuser_ops.moe_route(lg, 2)
    w2, i2 = torch.ops.redfuser.moe_route(lg, 2, "softmax", False, None, 1, 1, 1.0)
    assert torch.equal(i1, i2) and torch.equal(w1, w2)
    assert "ties to the lower expert id" in redfuser_ops.moe_route.__doc__


def _samples():
    gen = torch.Generator().manual_seed(11)
    lg = torch.randn(9, 64, generator=gen)
    return [
        (lg, 4),
        (lg.half(), 6, "sigmoid", True, torch.randn(64, generator=gen), 8, 4, 2.0),
        (lg.bfloat16(), 2, "softmax", False, None, 4, 2, 1.0),
    ]


@pytest.mark.parametrize("sample", range(3))
def test_opcheck(sample):
    args = _samples()[sample]
    torch.library.opcheck(torch.ops.redfuser.moe_route.default, args)


def test_torch_compile_fullgraph():
    lg = torch.round(torch.randn(33, 160) * 64) / 64
    b = torch.round(torch.randn(160) * 64) / 64

    def route(x):
        w, ids = redfuser_ops.moe_route(x, 8, "sigmoid", True, b, 8, 4, 2.5)
        return w * 2, ids

    compiled = torch.compile(route, fullgraph=True)
    w, ids = compiled(lg)
    rw, rids = route(lg)
    assert torch.equal(ids, rids) and torch.allclose(w, rw)


@pytest.mark.parametrize(
    "call, message",
    [
        (lambda: torch.ops.redfuser.moe_route(torch.randn(4, 16, dtype=torch.float64), 2),
         "logits must be float32, float16 or bfloat16, got float64"),
        (lambda: torch.ops.redfuser.moe_route(torch.randn(16), 2), "logits must be 2-D (T, E), got a 1-D tensor"),
        (lambda: torch.ops.redfuser.moe_route(torch.randn(4, 16), 2, "softmax", False, torch.randn(15)),
         "bias.size(0) must equal logits.size(1) (E): got 15, expected 16"),
        (lambda: torch.ops.redfuser.moe_route(torch.randn(4, 16), 2, "softmax", False, torch.randn(16).double()),
         "bias must be float32, got float64"),
        (lambda: torch.ops.redfuser.moe_route(torch.randn(4, 16), 2, "softmax", False, None, 3, 1),
         "the experts E must be divisible by n_group (E = 16, n_group = 3)"),
        (lambda: torch.ops.redfuser.moe_route(torch.randn(4, 16), 17), "topk must not exceed the experts in the kept groups"),
        (lambda: torch.ops.redfuser.moe_route(torch.randn(4, 16), 0), "topk must be at least 1"),
        (lambda: torch.ops.redfuser.moe_route(torch.randn(4, 16), 2, "relu"),
         "scoring must be one of 'softmax', 'sigmoid', got 'relu'"),
        (lambda: torch.ops.redfuser.moe_route(torch.randn(4, 16), 2, "softmax", False, None, 4, 5),
         "topk_group must not exceed n_group"),
    ],
)
def test_bad_inputs_name_the_argument(call, message):
    with pytest.raises(RuntimeError) as exc:
        call()
    assert message in str(exc.value)
    assert "redfuser::moe_route" in str(exc.value)


def test_empty_batch():
    w, ids = torch.ops.redfuser.moe_route(torch.randn(0, 64), 4)
    assert w.shape == (0, 4) and ids.shape == (0, 4)
