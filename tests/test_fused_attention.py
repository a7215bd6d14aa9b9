"""fused_attention through torch.ops.redfuser, judged by the rule of ACCEPTANCE.md:
max|out - ref| <= 2 * max|plain - ref| + 1e-5, with ref in float64 (float32 for half-precision inputs, whose plain
error is orders of magnitude above a float32 reference's) and plain the same attention written with torch ops in
the inputs' dtype; lse within 1e-3 where finite, with the same infinities. Inputs are strided views.
"""

from __future__ import annotations

import itertools

import pytest
import torch
from cpu_features import bf16_pair_tiles, cpu_flag, ops_in_subprocess

import redfuser_ops
from redfuser_ops import reference as ref

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
# The CPU kernels run blocks of up to 64 query rows (a GQA group's rows together) against chunks of 64 keys; the
# shapes below reach every path of that: one key, exact chunk multiples, key tails, several chunks and row blocks,
# causal rows that see no key (Sq > Sk) and causal chunks skipped past the diagonal (Sq < Sk).
SHAPES = [
    (1, 1),      # one key, one row
    (1, 128),    # decode: one row, two whole chunks
    (113, 203),  # tails on both lengths; 4 chunks; 2-6 row blocks
    (128, 217),  # whole row blocks, key tail
    (200, 256),  # exact chunk multiple over 4 chunks, causal skips whole chunks
    (257, 192),  # Sq > Sk by 65: a whole row block of causal rows that see no key
    (40, 600),   # several of the CPU's longest chunks (256 keys, full attention) and a tail: the online correction
]
# the large shapes of the earlier suite: on the CPU the same paths at minutes of CPU time, marked slow there (run them
# with `pytest -m slow`); on CUDA (many q-blocks and key tiles, the split heuristic) they stay in the default run
LARGE = [(256, 512), (512, 256), (1023, 1024), (1024, 1023)]
CASES = [pytest.param(d, *s, marks=[pytest.mark.slow] if d == "cpu" and s in LARGE else [], id=f"{s[0]}-{s[1]}-{d}")
         for d in DEVICES for s in SHAPES + LARGE]
HEADS = [(6, 6), (6, 2), (6, 1)]  # MHA, GQA, MQA
DTYPES = {"cpu": [torch.float32, torch.float16, torch.bfloat16], "cuda": [torch.float16, torch.bfloat16]}


def strided_inputs(B, Sq, Sk, H, Hk, D, dtype, device, gen):
    """q as a (B, H, Sq, D) tensor seen as (B, Sq, H, D); k and v as slices of one packed (B, Sk, 2, Hk, D)."""
    q = torch.randn(B, H, Sq, D, generator=gen).to(dtype).to(device).transpose(1, 2)
    kv = torch.randn(B, Sk, 2, Hk, D, generator=gen).to(dtype).to(device)
    return q, kv[:, :, 0], kv[:, :, 1]


def judge(q, k, v, causal, scale=None):
    out, lse = torch.ops.redfuser.fused_attention(q, k, v, causal, scale)
    ref_dtype = torch.float64 if q.dtype == torch.float32 else torch.float32
    qc, kc, vc = q.cpu(), k.cpu(), v.cpu()
    r_out, r_lse = ref.fused_attention(qc, kc, vc, causal, scale, dtype=ref_dtype)
    p_out, _ = ref.fused_attention(qc, kc, vc, causal, scale, dtype=q.dtype)
    assert out.shape == q.shape and out.dtype == q.dtype
    assert lse.shape == (q.shape[0], q.shape[2], q.shape[1]) and lse.dtype == torch.float32
    out, lse = out.cpu().to(ref_dtype), lse.cpu().to(ref_dtype)
    plain_err = (p_out.to(ref_dtype) - r_out).abs().max().item()
    err = (out - r_out).abs().max().item()
    assert err <= 2 * plain_err + 1e-5, (err, plain_err)
    finite = torch.isfinite(r_lse)
    assert torch.equal(torch.isfinite(lse), finite) and torch.equal(lse[~finite], r_lse[~finite])
    if finite.any():
        assert (lse[finite] - r_lse[finite]).abs().max().item() <= 1e-3
    assert torch.isfinite(out).all()
    return out, lse


@pytest.mark.parametrize("D", [64, 128, 256])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("device, Sq, Sk", CASES)
def test_fused_attention_matches_reference(device, D, causal, Sq, Sk):
    gen = torch.Generator().manual_seed(D * 7 + Sq * 3 + Sk + causal)
    for dtype, (H, Hk), B in itertools.product(DTYPES[device], HEADS, [1, 3]):
        q, k, v = strided_inputs(B, Sq, Sk, H, Hk, D, dtype, device, gen)
        judge(q, k, v, causal)


@pytest.mark.parametrize("device", DEVICES)
def test_fully_masked_rows_give_zero_and_minus_inf(device):
    # causal with Sq > Sk: query i sees keys j <= i + Sk - Sq, so the first Sq - Sk rows see none
    gen = torch.Generator().manual_seed(1)
    dtype = DTYPES[device][-1]
    q, k, v = strided_inputs(2, 37, 5, 4, 2, 64, dtype, device, gen)
    out, lse = judge(q, k, v, True)
    assert torch.all(out[:, :32] == 0) and torch.all(lse[:, :, :32] == float("-inf"))
    assert torch.isfinite(lse[:, :, 32:]).all()


@pytest.mark.parametrize("device", DEVICES)
def test_softmax_scale_and_contiguous_inputs(device):
    gen = torch.Generator().manual_seed(2)
    dtype = DTYPES[device][0]
    q, k, v = (x.contiguous() for x in strided_inputs(2, 33, 70, 4, 4, 128, dtype, device, gen))
    judge(q, k, v, False, 0.3)
    judge(q, k, v, True, 1.7)


@pytest.mark.parametrize("device", DEVICES)
def test_large_scores_over_long_head_dims(device):
    """Scores of tens to hundreds (softmax_scale 1 to 3 at D 256): the output's error follows each score's, a sum
    of D products, and the weighted sum's, of up to 256 keys per CPU chunk. The CPU tile GEMM once summed them in
    one running sum each, 1.1-5.5x the error of torch's attention and past the 2x-plain rule in most draws here;
    in blocks of 128 (rf::GEMM_KC) its error is torch's."""
    gen = torch.Generator().manual_seed(11)
    for (Sq, Sk, scale), dtype in itertools.product([(33, 700, 3.0), (64, 512, 1.0), (17, 1000, 2.0)],
                                                    DTYPES[device]):
        for _ in range(3):
            q, k, v = strided_inputs(1, Sq, Sk, 4, 1, 256, dtype, device, gen)
            judge(q, k, v, False, scale)


def test_typed_wrapper():
    q, k, v = strided_inputs(1, 5, 9, 2, 1, 64, torch.float32, "cpu", torch.Generator().manual_seed(4))
    o1, l1 = redfuser_ops.fused_attention(q, k, v, causal=True)
    o2, l2 = torch.ops.redfuser.fused_attention(q, k, v, True, None)
    assert torch.equal(o1, o2) and torch.equal(l1, l2)
    assert "bottom-right" in redfuser_ops.fused_attention.__doc__


def _samples():
    gen = torch.Generator().manual_seed(5)
    a = strided_inputs(2, 17, 33, 4, 2, 64, torch.float32, "cpu", gen)
    b = strided_inputs(1, 8, 8, 2, 1, 128, torch.bfloat16, "cpu", gen)
    return [(*a, False, None), (*a, True, 0.25), (*b, True, None)]


@pytest.mark.parametrize("sample", range(3))
def test_opcheck(sample):
    torch.library.opcheck(torch.ops.redfuser.fused_attention.default, _samples()[sample])


def test_torch_compile_fullgraph():
    q, k, v = strided_inputs(2, 40, 50, 4, 2, 64, torch.float32, "cpu", torch.Generator().manual_seed(6))

    def layer(q, k, v):
        out, lse = redfuser_ops.fused_attention(q * 2, k, v, causal=True)
        return out.sum(-1), lse

    compiled = torch.compile(layer, fullgraph=True)
    a, b = compiled(q, k, v)
    c, d = layer(q, k, v)
    assert torch.allclose(a, c, rtol=1e-5, atol=1e-5) and torch.equal(b, d)


@pytest.mark.parametrize(
    "make, message",
    [
        (lambda: (torch.randn(1, 4, 2, 64).double(),) * 3, "q must be float32, float16 or bfloat16, got float64"),
        (lambda: (torch.randn(1, 4, 2, 64), torch.randn(1, 4, 2, 64).half(), torch.randn(1, 4, 2, 64)),
         "k must have the dtype of q (float32), got float16"),
        (lambda: (torch.randn(4, 2, 64),) * 3, "q must be 4-D (B, Sq, H, D), got a 3-D tensor"),
        (lambda: (torch.randn(1, 4, 3, 64), torch.randn(1, 4, 2, 64), torch.randn(1, 4, 2, 64)),
         "the query heads H must be a multiple of the key/value heads Hk (H = 3, Hk = 2)"),
        (lambda: (torch.randn(1, 4, 2, 64), torch.randn(1, 4, 2, 32), torch.randn(1, 4, 2, 32)),
         "k.size(3) must equal q.size(3) (D): got 32, expected 64"),
        (lambda: (torch.randn(1, 4, 2, 64), torch.randn(1, 5, 2, 64), torch.randn(1, 4, 2, 64)),
         "v.size(1) must equal k.size(1) (Sk): got 4, expected 5"),
        (lambda: (torch.randn(2, 4, 2, 64), torch.randn(1, 4, 2, 64), torch.randn(1, 4, 2, 64)),
         "k.size(0) must equal q.size(0) (B): got 1, expected 2"),
    ],
)
def test_bad_inputs_name_the_argument(make, message):
    with pytest.raises(RuntimeError) as exc:
        torch.ops.redfuser.fused_attention(*make())
    assert message in str(exc.value)
    assert "redfuser::fused_attention" in str(exc.value)


def test_empty_inputs():
    out, lse = torch.ops.redfuser.fused_attention(torch.randn(0, 4, 2, 64), torch.randn(0, 3, 2, 64),
                                                  torch.randn(0, 3, 2, 64))
    assert out.shape == (0, 4, 2, 64) and lse.shape == (0, 2, 4)
    out, lse = torch.ops.redfuser.fused_attention(torch.randn(1, 4, 2, 64), torch.randn(1, 0, 2, 64),
                                                  torch.randn(1, 0, 2, 64))
    assert torch.all(out == 0) and torch.all(lse == float("-inf"))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_blocks_keep_masked_infinities_out_of_other_rows(dtype):
    """CPU kernels run blocks of query rows against one packed K/V tile. Causal, Sq = Sk: only the last query row
    sees the last key; an inf in that key's value must reach that row and no other row of its block (a row that does
    not count a key multiplies it by a weight of 0, and 0 * inf is NaN). bf16: the pair tiles, where the CPU has
    them, see the inf in their pack and fold that tile in float."""
    gen = torch.Generator().manual_seed(3)
    q, k, v = strided_inputs(1, 40, 40, 4, 2, 64, dtype, "cpu", gen)
    v = v.clone()
    v[:, -1, :, 5] = float("inf")
    out, lse = torch.ops.redfuser.fused_attention(q, k, v, True, None)
    r_out, _ = ref.fused_attention(q[:, :-1], k[:, :-1], v[:, :-1], True, None, dtype=torch.float64)
    assert torch.isfinite(out[:, :-1]).all()
    assert (out[:, :-1].double() - r_out).abs().max().item() <= (1e-5 if dtype == torch.float32 else 2e-2)
    assert not torch.isfinite(out[:, -1, :, 5]).any() and torch.isfinite(lse).all()


def test_cpu_bf16_pair_tiles_and_float_tiles(tmp_path):
    """bf16 on a CPU with AVX512_BF16: with REDFUSER_CPU_BF16_DOT=1 the block kernels multiply their tiles as pairs
    of bf16 (scores exactly as the float tile, P rounded to bf16 for P x V); with 0 they keep the float tiles; by
    default they take the pairs on AMD CPUs only (rf::bf16_dot). Both pass the reference rule, causal and not, GQA,
    key tails and odd head dims (whose scores take the float tile: pairs of c need D even); where the CPU has the
    instruction the two differ (the pair tiles ran), elsewhere they are the same code and equal; the default run
    is one of the two, the one bf16_dot picks here."""
    gen = torch.Generator().manual_seed(11)
    cases = [(2, 150, 150, 6, 2, 64, True), (1, 97, 203, 4, 4, 128, False), (1, 70, 45, 2, 1, 18, True),
             (1, 64, 64, 2, 2, 17, False)]
    inputs = [(strided_inputs(B, Sq, Sk, H, Hk, D, torch.bfloat16, "cpu", gen), causal)
              for B, Sq, Sk, H, Hk, D, causal in cases]
    saved = [(tuple(t.contiguous() for t in qkv), c) for qkv, c in inputs]
    call = "[torch.ops.redfuser.fused_attention(q, k, v, c, None)[0] for (q, k, v), c in ins]"
    floats = ops_in_subprocess(tmp_path, saved, call, {"REDFUSER_CPU_BF16_DOT": "0"})
    pairs = ops_in_subprocess(tmp_path, saved, call, {"REDFUSER_CPU_BF16_DOT": "1"})
    instruction = cpu_flag("avx512_bf16")
    for ((q, k, v), causal), flt, par in zip(inputs, floats, pairs):
        out, _ = judge(q, k, v, causal)
        q2, k2, v2 = (t.contiguous() for t in (q, k, v))
        judge(q2, k2, v2, causal)
        # each path's result judged the same way (the reference rule against float64)
        r_out, _ = ref.fused_attention(q, k, v, causal, None, dtype=torch.float32)
        p_out, _ = ref.fused_attention(q, k, v, causal, None, dtype=torch.bfloat16)
        for res in (flt, par):
            assert (res.float() - r_out).abs().max().item() <= 2 * (p_out.float() - r_out).abs().max().item() + 1e-5
        assert torch.equal(par, flt) == (not instruction), instruction
        assert torch.equal(out.to(torch.bfloat16), par if bf16_pair_tiles() else flt)


@pytest.mark.parametrize("threads", [1, 2])
def test_cpu_tile_memo_equals_repacking(tmp_path, threads):
    """Blocks of rows that share a K/V head (the 128-query blocks of one head, the heads of one GQA group) reuse
    the K and V tiles packed by the first block that needed them (rf::TileMemo) where the same keys are read:
    causal rows with Sq < Sk see different parts of a chunk from block to block, and those chunks are packed
    again. With REDFUSER_CPU_TILE_MEMO=0 every tile is packed where it is used: the two must agree bit for bit
    (the same tiles, the same GEMMs) and pass the reference rule. An inf in V at a key that later blocks take
    from the memo (GQA: the next head's early rows share the run) stays out of the rows that do not count it."""
    gen = torch.Generator().manual_seed(12)
    cases = [(1, 200, 333, 2, 1, 64, True, torch.float32), (1, 300, 300, 4, 2, 64, True, torch.float32),
             (2, 260, 260, 2, 2, 128, False, torch.float32), (1, 200, 333, 4, 1, 64, True, torch.bfloat16),
             (1, 300, 300, 2, 1, 128, False, torch.bfloat16)]
    inputs = [(*(t.contiguous() for t in strided_inputs(B, Sq, Sk, H, Hk, D, dt, "cpu", gen)), causal)
              for B, Sq, Sk, H, Hk, D, causal, dt in cases]
    for dt in (torch.float32, torch.bfloat16):
        q, k, v = (t.contiguous() for t in strided_inputs(1, 300, 300, 4, 1, 64, dt, "cpu", gen))
        v[0, 200, 0, 5] = float("inf")  # key 200: causal rows below 200 do not count it
        inputs.append((q, k, v, True))
    repacked = ops_in_subprocess(tmp_path, inputs,
                                 "[torch.ops.redfuser.fused_attention(q, k, v, c, None) for q, k, v, c in ins]",
                                 {"REDFUSER_CPU_TILE_MEMO": "0"}, threads)
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for n, ((q, k, v, causal), (r_out, r_lse)) in enumerate(zip(inputs, repacked)):
            out, lse = torch.ops.redfuser.fused_attention(q, k, v, causal, None)
            assert torch.equal(out, r_out) and torch.equal(lse, r_lse), n
            if n < len(cases):
                judge(q, k, v, causal)
            else:
                assert torch.isfinite(out[:, :200]).all() and not torch.isfinite(out[:, 200:, 0]).all()
    finally:
        torch.set_num_threads(old)


@pytest.mark.parametrize("threads", [1, 3])
def test_cpu_row_blocks_across_threads(threads):
    """Blocks of rows are cut in the order (b, kv head, query) and split into runs that share a K/V head: GQA with
    a short query length puts several heads and batches into one block; every thread count gives the same rows."""
    gen = torch.Generator().manual_seed(4)
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for Sq, Sk, H, Hk in [(3, 77, 8, 2), (1, 130, 6, 1), (45, 45, 2, 2)]:
            q, k, v = strided_inputs(3, Sq, Sk, H, Hk, 64, torch.float32, "cpu", gen)
            judge(q, k, v, Sq > 1)
    finally:
        torch.set_num_threads(old)


@pytest.mark.parametrize("threads", [2, 3])
def test_cpu_wide_heads_share_columns_across_threads(threads):
    """Fewer rows than threads with D >= 512: the CPU kernel shares the columns of o out across tasks (each
    recomputing the row's scores and softmax state; lse written by the first). One row gives exactly the 1-thread
    result; runs of several rows judged by the reference (1 thread packs them as one GEMM run, more threads as
    runs of one row: a different summation order)."""
    gen = torch.Generator().manual_seed(6)
    old = torch.get_num_threads()
    try:
        q, k, v = strided_inputs(1, 1, 300, 1, 1, 512, torch.float32, "cpu", gen)
        torch.set_num_threads(1)
        one = torch.ops.redfuser.fused_attention(q, k, v, False, None)
        torch.set_num_threads(threads)
        many = judge(q, k, v, False)
        assert torch.equal(one[0], many[0].float()) and torch.equal(one[1], many[1].float())
        for Sq, H, Hk, D in [(2, 1, 1, 768), (1, 2, 1, 512), (1, 2, 2, 640)]:
            q, k, v = strided_inputs(1, Sq, 200, H, Hk, D, torch.float32, "cpu", gen)
            judge(q, k, v, Sq > 1)
    finally:
        torch.set_num_threads(old)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_cpu_one_row_runs_and_half_kv_in_place(dtype):
    """Runs of one row (MHA decode: every (b, h) has its own K/V) take the CPU kernels' unpacked path (dot products
    and the fold straight from K/V); half-precision K/V are read in their dtype and widened per tile, also with a
    non-unit last-dimension stride (copied to unit stride in the glue, in their dtype). A key that only the second
    query row sees holds inf in V: the first row (a run of its own: 2 rows give blocks of 1) must stay finite."""
    gen = torch.Generator().manual_seed(5)
    for B, Sq, Sk, H in [(3, 1, 77, 4), (2, 1, 130, 1), (1, 1, 64, 2)]:
        q, k, v = strided_inputs(B, Sq, Sk, H, H, 64, dtype, "cpu", gen)
        judge(q, k, v, False)
        kt = torch.randn(B, Sk, H, 2 * 64, generator=gen).to(dtype)[..., ::2]  # last-dimension stride 2
        assert kt.stride(-1) == 2
        judge(q, kt, v, False)
    q, k, v = strided_inputs(1, 2, 5, 1, 1, 64, dtype, "cpu", gen)
    v = v.clone()
    v[:, -1, :, 3] = float("inf")
    out, lse = torch.ops.redfuser.fused_attention(q, k, v, True, None)
    r_out, _ = ref.fused_attention(q[:, :1], k[:, :-1], v[:, :-1], True, None, dtype=torch.float64)
    assert torch.isfinite(out[:, 0]).all() and torch.isfinite(lse).all()
    assert (out[:, :1].double() - r_out).abs().max().item() <= (1e-5 if dtype == torch.float32 else 2e-2)
    assert not torch.isfinite(out[:, 1, :, 3]).any()
