"""mla_decode on the GPU (marker `gpu`): every output written (poisoned beforehand), out-of-range table entries
in use never reading outside the cache, and capture in a CUDA graph replayed with new lengths and new tables
(the split plan comes from host-known sizes, so one graph serves every length up to the table's capacity)."""

from __future__ import annotations

import pytest
import torch

import redfuser_ops  # noqa: F401 - loads the library: torch.ops.redfuser.*
from bench.poison import Stats, poisoned_call

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

PAGE = 64
# (B, Sq, Hq, max_blocks, causal, dtype): code path each shape exercises
SHAPES = [
    (2, 1, 16, 70, False, torch.bfloat16),   # small batch, long table: split-KV + combine
    (3, 4, 16, 5, True, torch.float16),      # speculative decode, causal, 64 packed rows, no split
    (2, 2, 128, 40, True, torch.bfloat16),   # 256 rows: four CTAs per sequence
    (64, 1, 16, 8, False, torch.bfloat16),   # a full grid: no split
]


def _inputs(B, Sq, Hq, mb, dtype, lens, seed):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    nb = B * mb + 1
    q = torch.randn(B, Sq, Hq, 576, device="cuda", dtype=dtype, generator=gen)
    kv = torch.randn(nb, PAGE, 1, 576, device="cuda", dtype=dtype, generator=gen)
    table = torch.randperm(nb, device="cuda", generator=gen)[: B * mb].to(torch.int32).reshape(B, mb)
    seqlens = torch.tensor(lens, dtype=torch.int32, device="cuda")
    for b, n in enumerate(lens):  # NaN garbage past the length in the last page, huge values in unused entries
        used = -(-n // PAGE)
        if n % PAGE:
            kv[table[b, used - 1], n % PAGE:] = float("nan")
        table[b, used:] = 2**31 - 1
    return q, kv, table, seqlens


def _lens(B, mb, seed):
    gen = torch.Generator().manual_seed(seed)
    lens = torch.randint(0, mb * PAGE + 1, (B,), generator=gen).tolist()
    lens[0] = mb * PAGE  # a full table
    if B > 1:
        lens[1] = 0  # an empty sequence
    return lens


def _judge(q, kv, table, seqlens, causal, out, lse):
    from redfuser_ops import reference as ref

    kv = torch.nan_to_num(kv)  # the reference cuts at the length after reading whole pages
    r_out, r_lse = ref.mla_decode(q, kv, table, seqlens, 512, None, causal, dtype=torch.float32)
    p_out, _ = ref.mla_decode(q, kv, table, seqlens, 512, None, causal, dtype=q.dtype)
    assert torch.isfinite(out).all(), "NaN/inf in out: an element the kernel did not write, or garbage read"
    plain = (p_out.float() - r_out).abs().max().item()
    err = (out.float() - r_out).abs().max().item()
    assert err <= 2 * plain + 1e-5, (err, plain)
    fin = torch.isfinite(r_lse)
    assert torch.equal(torch.isfinite(lse), fin) and torch.equal(lse[~fin], r_lse[~fin])
    if fin.any():
        assert (lse[fin] - r_lse[fin]).abs().max().item() <= 1e-3


def _id(s):
    return "B{}_Sq{}_Hq{}_MB{}_{}_{}".format(*s[:4], "causal" if s[4] else "full", str(s[5])[6:])


@pytest.mark.parametrize("shape", SHAPES, ids=_id)
def test_mla_writes_every_output(shape):
    B, Sq, Hq, mb, causal, dtype = shape
    q, kv, table, seqlens = _inputs(B, Sq, Hq, mb, dtype, _lens(B, mb, 1), 1)
    stats = Stats()
    out, lse = poisoned_call(torch.ops.redfuser.mla_decode.default, (q, kv, table, seqlens, 512, None, causal),
                             stats=stats)
    torch.cuda.synchronize()
    assert stats.hits == 1, f"poisoning did not reach the outputs: {stats.misses}"
    _judge(q, kv, table, seqlens, causal, out, lse)


def test_out_of_range_pages_in_use_stay_inside_the_cache():
    """An in-use entry outside [0, NB) is clamped into the cache: the row reads the last (or first) page."""
    B, Sq, Hq, mb = 2, 1, 16, 3
    q, kv, table, seqlens = _inputs(B, Sq, Hq, mb, torch.bfloat16, [3 * PAGE, 100], 2)
    kv = torch.nan_to_num(kv)
    nb = kv.shape[0]
    bad = table.clone()
    bad[0, 1], bad[1, 0] = nb + 1000, -5
    out, lse = torch.ops.redfuser.mla_decode(q, kv, bad, seqlens, 512, None, False)
    torch.cuda.synchronize()
    clamped = bad.clamp(0, nb - 1)
    clamped[1, 2:] = 0
    _judge(q, kv, clamped, seqlens, False, out, lse)


@pytest.mark.parametrize("shape", [SHAPES[0], SHAPES[1], SHAPES[2]], ids=_id)
def test_mla_in_cuda_graph_with_new_lengths(shape):
    B, Sq, Hq, mb, causal, dtype = shape
    q, kv, table, seqlens = _inputs(B, Sq, Hq, mb, dtype, _lens(B, mb, 3), 3)
    fn = torch.ops.redfuser.mla_decode
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2):
            fn(q, kv, table, seqlens, 512, None, causal)
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out, lse = fn(q, kv, table, seqlens, 512, None, causal)
    for seed in (4, 5, 6):  # new lengths, pages and queries in the same buffers
        nq, nkv, ntable, nlens = _inputs(B, Sq, Hq, mb, dtype, _lens(B, mb, seed), seed)
        q.copy_(nq)
        kv.copy_(nkv)
        table.copy_(ntable)
        seqlens.copy_(nlens)
        g.replay()
        torch.cuda.synchronize()
        e_out, e_lse = fn(q, kv, table, seqlens, 512, None, causal)
        assert torch.equal(out, e_out) and torch.equal(lse, e_lse), "graph replay differs from an eager call"
        _judge(q, kv, table, seqlens, causal, out, lse)
