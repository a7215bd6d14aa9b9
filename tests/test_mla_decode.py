"""mla_decode through the op on each device there is (CPU always, CUDA when torch sees a GPU), judged by the rules
of ACCEPTANCE.md against redfuser_ops.reference: shuffled pages, garbage in unused table entries and (on the
GPU) NaN in the cache rows past each length, lengths 0/1/63/64/65/4097 in one batch, Hq 1/16/128, Sq 1..4
causal and not; the CUDA path takes split-KV for the small batches here."""

from __future__ import annotations

import pytest
import torch

import redfuser_ops  # noqa: F401 - loads the library
from redfuser_ops import reference as ref

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
PAGE = 64


def _paged(lens, Sq, Hq, dtype, gen, device):
    B = len(lens)
    need = [-(-n // PAGE) for n in lens]
    mb = max(max(need), 1) + 1
    nb = sum(need) + 2
    kv = torch.randn(nb, PAGE, 1, 576, generator=gen).to(dtype)
    perm = torch.randperm(nb, generator=gen)
    table = torch.randint(-(2**31), 2**31 - 1, (B, mb), generator=gen, dtype=torch.int64).to(torch.int32)
    used = 0
    for b, n in enumerate(lens):
        table[b, : need[b]] = perm[used: used + need[b]].int()
        used += need[b]
        if n % PAGE and device == "cuda":  # garbage past the length (the CPU kernel is not asked to mask it)
            kv[table[b, need[b] - 1], n % PAGE:] = float("nan")
    q = torch.randn(B, Sq, Hq, 576, generator=gen).to(dtype)
    return q, kv, table, torch.tensor(lens, dtype=torch.int32)


def _judge(q, kv, table, seqlens, causal, out, lse):
    kv = torch.nan_to_num(kv)  # the reference reads whole pages before cutting at the length
    r_out, r_lse = ref.mla_decode(q, kv, table, seqlens, 512, None, causal, dtype=torch.float32)
    p_out, _ = ref.mla_decode(q, kv, table, seqlens, 512, None, causal, dtype=q.dtype)
    out, lse = out.cpu(), lse.cpu()
    assert torch.isfinite(out).all()
    plain = (p_out.float() - r_out).abs().max().item()
    assert (out.float() - r_out).abs().max().item() <= 2 * plain + 1e-5
    fin = torch.isfinite(r_lse)
    assert torch.equal(torch.isfinite(lse), fin) and torch.equal(lse[~fin], r_lse[~fin])
    if fin.any():  # a batch of empty sequences only has no finite lse
        assert (lse[fin] - r_lse[fin]).abs().max().item() <= 1e-3


# fp16 on the CPU: tests/test_mla_fp8_cpu.py
@pytest.mark.parametrize("device, dtype", [(d, t) for d in DEVICES for t in (torch.bfloat16, torch.float16)
                                           if d == "cuda" or t == torch.bfloat16],
                         ids=lambda x: {torch.bfloat16: "bf16", torch.float16: "fp16"}.get(x, x))
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("Hq, Sq, lens", [(1, 1, [0, 1, 63, 64, 65, 4097]), (16, 4, [0, 1, 63, 64, 65, 4097]),
                                          (128, 2, [65, 0, 700])], ids=["h1_s1", "h16_s4", "h128_s2"])
def test_mla_decode(device, dtype, causal, Hq, Sq, lens):
    gen = torch.Generator().manual_seed(Hq * 100 + Sq)
    q, kv, table, seqlens = _paged(lens, Sq, Hq, dtype, gen, device)
    out, lse = torch.ops.redfuser.mla_decode(q.to(device), kv.to(device), table.to(device), seqlens.to(device),
                                             512, None, causal)
    assert out.shape == (len(lens), Sq, Hq, 512) and out.dtype == dtype and lse.dtype == torch.float32
    _judge(q, kv, table, seqlens, causal, out, lse)
    for b, n in enumerate(lens):
        if n == 0:
            assert torch.all(out[b] == 0) and torch.all(lse[b] == float("-inf"))


@pytest.mark.parametrize("threads", [2, 3])
def test_cpu_latent_columns_shared_across_threads(threads):
    """One query row (B1 Hq1 Sq1) on several threads: the CPU kernel shares the 512 latent columns of the weighted
    sum out across tasks, each recomputing the scores; lse is written by the first task only. The result is the
    1-thread result exactly (empty rows included) and passes the reference."""
    gen = torch.Generator().manual_seed(16)
    old = torch.get_num_threads()
    try:
        for lens, causal in [([1000], False), ([0], False), ([130, 0], True)]:
            q, kv, table, seqlens = _paged(lens, 1, 1, torch.bfloat16, gen, "cpu")
            torch.set_num_threads(1)
            one = torch.ops.redfuser.mla_decode(q, kv, table, seqlens, 512, None, causal)
            torch.set_num_threads(threads)
            many = torch.ops.redfuser.mla_decode(q, kv, table, seqlens, 512, None, causal)
            assert torch.equal(one[0], many[0]) and torch.equal(one[1], many[1]), lens
            if max(lens):
                _judge(q, kv, table, seqlens, causal, *many)
            for b, n in enumerate(lens):
                if n == 0:
                    assert torch.all(many[0][b] == 0) and torch.all(many[1][b] == float("-inf"))
    finally:
        torch.set_num_threads(old)


def test_cpu_float_tiles_and_pair_tiles(tmp_path):
    """bf16 MLA on the CPU both ways, each in a fresh process: REDFUSER_CPU_BF16_DOT=0 keeps the float tiles (the
    Xeon's default: a sequence's heads, a run of up to 32 rows, take the NT score tile on the cache rows as they
    are), =1 the bf16 pair tiles where the CPU has AVX512_BF16 (runs of 8 heads or more; fewer take the NT tile
    again). Both pass the reference rule at Hq 4, 16 and 40 (a run past 32 rows: the transposed tile), causal and
    not; where the instruction exists the two differ (the pairs ran)."""
    from cpu_features import cpu_flag, ops_in_subprocess

    gen = torch.Generator().manual_seed(23)
    cases = [(_paged([70, 300], 1, 4, torch.bfloat16, gen, "cpu"), False),
             (_paged([129, 0, 64], 2, 16, torch.bfloat16, gen, "cpu"), True),
             (_paged([200], 1, 40, torch.bfloat16, gen, "cpu"), False)]
    call = "[torch.ops.redfuser.mla_decode(q, kv, t, n, 512, None, c) for (q, kv, t, n), c in ins]"
    floats = ops_in_subprocess(tmp_path, cases, call, {"REDFUSER_CPU_BF16_DOT": "0"})
    pairs = ops_in_subprocess(tmp_path, cases, call, {"REDFUSER_CPU_BF16_DOT": "1"})
    for ((q, kv, table, seqlens), causal), flt, par in zip(cases, floats, pairs):
        for out, lse in (flt, par):
            _judge(q, kv, table, seqlens, causal, out, lse)
    if cpu_flag("avx512_bf16"):
        assert not all(torch.equal(f[0], p[0]) for f, p in zip(floats, pairs))
