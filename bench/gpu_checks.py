"""A few small CUDA calls of each op, checked against the reference on the CPU: the program that
bench/gpu_run.sh runs under `compute-sanitizer --tool memcheck` (with PYTORCH_NO_CUDA_MEMORY_CACHING=1, so that
every tensor is its own allocation and an access past its end is caught). `python -m bench.gpu_checks`.
Exit status 0 when every result is right, 1 otherwise.
"""

from __future__ import annotations

import sys

import torch


def _attention_ok(name: str, out, lse, r_out, r_lse, p_out) -> bool:
    """ACCEPTANCE.md's rule for attention outputs (out within twice the plain error, lse within 1e-3 where finite,
    the same infinities); prints one line."""
    err = (out.cpu().float() - r_out).abs().max().item()
    bound = 2 * (p_out.float() - r_out).abs().max().item() + 1e-5
    fin = torch.isfinite(r_lse)
    lse_ok = torch.equal(torch.isfinite(lse.cpu()), fin) and (
        not fin.any() or (lse.cpu()[fin] - r_lse[fin]).abs().max().item() <= 1e-3)
    ok = err <= bound and lse_ok
    print(f"{name}: err {err:.2e} <= {bound:.2e}, lse {'ok' if lse_ok else 'WRONG'}: {'ok' if ok else 'WRONG'}")
    return ok


def main() -> int:
    import redfuser_ops  # noqa: F401 - loads the library
    from redfuser_ops import reference as ref

    if not torch.cuda.is_available():
        print("gpu_checks: no CUDA device")
        return 1
    gen = torch.Generator().manual_seed(0)
    failures = []
    # (B, Sq, Sk, H, Hk, D, causal, dtype): a causal tail with empty rows, odd lengths, decode with split-KV
    for B, Sq, Sk, H, Hk, D, causal, dtype in [
        (1, 37, 5, 2, 1, 64, True, torch.bfloat16),
        (2, 67, 131, 4, 2, 128, True, torch.float16),
        (1, 1, 5000, 4, 1, 128, False, torch.bfloat16),
        (1, 129, 129, 2, 2, 256, False, torch.bfloat16),
    ]:
        q = torch.randn(B, Sq, H, D, generator=gen).to(dtype)
        k = torch.randn(B, Sk, Hk, D, generator=gen).to(dtype)
        v = torch.randn(B, Sk, Hk, D, generator=gen).to(dtype)
        out, lse = torch.ops.redfuser.fused_attention(q.cuda(), k.cuda(), v.cuda(), causal, None)
        torch.cuda.synchronize()
        r_out, r_lse = ref.fused_attention(q, k, v, causal, None, dtype=torch.float32)
        p_out, _ = ref.fused_attention(q, k, v, causal, None, dtype=dtype)
        name = f"fused_attention B{B} Sq{Sq} Sk{Sk} H{H}/{Hk} D{D} {'causal' if causal else 'full'} {dtype}"
        if not _attention_ok(name, out, lse, r_out, r_lse, p_out):
            failures.append(name)
    for T, E, topk, scoring, bias, ng, tg in [(5, 256, 8, "sigmoid", True, 8, 4), (3, 160, 6, "softmax", False, 8, 3),
                                              (1, 64, 6, "softmax", False, 1, 1)]:
        logits = (torch.round(torch.randn(T, E, generator=gen) * 128) / 64).to(torch.bfloat16)
        b = torch.round(torch.randn(E, generator=gen) * 64) / 64 if bias else None
        w, ids = torch.ops.redfuser.moe_route(logits.cuda(), topk, scoring, True, None if b is None else b.cuda(),
                                              ng, tg, 1.0)
        torch.cuda.synchronize()
        rw, rids = ref.moe_route(logits, topk, scoring, True, b, ng, tg, 1.0)
        ok = torch.equal(ids.cpu().long(), rids) and (w.cpu().double() - rw).abs().max().item() <= 2e-2
        name = f"moe_route T{T} E{E} top{topk} {scoring} groups {ng}/{tg}"
        print(f"{name}: {'ok' if ok else 'WRONG'}")
        if not ok:
            failures.append(name)
    # mla_decode: (lengths, Sq, Hq, causal, dtype): split-KV with an empty sequence and a tail page holding NaN
    # garbage, a causal multi-token case, 128 heads; unused table entries out of range
    for lens, Sq, Hq, causal, dtype in [([0, 4097], 1, 16, False, torch.bfloat16), ([65, 3], 3, 8, True, torch.float16),
                                        ([130], 2, 128, False, torch.bfloat16)]:
        page, B = 64, len(lens)
        mb = max(-(-n // page) for n in lens) + 1
        kv = torch.randn(B * mb, page, 1, 576, generator=gen).to(dtype)
        table = torch.randperm(B * mb, generator=gen).to(torch.int32).reshape(B, mb)
        for b, n in enumerate(lens):
            table[b, -(-n // page):] = -(2**31)
            if n % page:
                kv[table[b, n // page], n % page:] = float("nan")
        q = torch.randn(B, Sq, Hq, 576, generator=gen).to(dtype)
        seqlens = torch.tensor(lens, dtype=torch.int32)
        out, lse = torch.ops.redfuser.mla_decode(q.cuda(), kv.cuda(), table.cuda(), seqlens.cuda(), 512, None, causal)
        torch.cuda.synchronize()
        kv = torch.nan_to_num(kv)
        r_out, r_lse = ref.mla_decode(q, kv, table, seqlens, 512, None, causal, dtype=torch.float32)
        p_out, _ = ref.mla_decode(q, kv, table, seqlens, 512, None, causal, dtype=dtype)
        name = f"mla_decode lens {lens} Sq{Sq} Hq{Hq} {'causal' if causal else 'full'} {dtype}"
        if not _attention_ok(name, out, lse, r_out, r_lse, p_out):
            failures.append(name)
    # fp8_quant_gemm: split-K + merge (M 1), K and M tails with a bias and a per-tensor scale, one segment
    for M, N, K, per_channel, bias in [(1, 512, 2048, True, False), (67, 144, 1040, False, True),
                                       (300, 256, 256, True, True)]:
        x = torch.randn(M, K, generator=gen).to(torch.bfloat16)
        w = (torch.randn(N, K, generator=gen) * 0.1).to(torch.float8_e4m3fn)
        ws = torch.rand(N if per_channel else 1, generator=gen) + 0.5
        b = torch.randn(N, generator=gen) if bias else None
        out = torch.ops.redfuser.fp8_quant_gemm(x.cuda(), w.cuda(), ws.cuda(), None if b is None else b.cuda())
        torch.cuda.synchronize()
        r = ref.fp8_quant_gemm(x, w, ws.expand(N), b)
        two = ref.fp8_quant_gemm_two_pass(x, w, ws.expand(N), b).double()
        err = (out.cpu().double() - r).abs().max().item()
        bound = 2 * (two - r).abs().max().item() + 1e-2 * r.abs().max().item()
        name = f"fp8_quant_gemm M{M} N{N} K{K}"
        print(f"{name}: err {err:.2e} <= {bound:.2e}: {'ok' if err <= bound else 'WRONG'}")
        if not err <= bound:
            failures.append(name)
    print(f"gpu_checks: {len(failures)} wrong" + (": " + "; ".join(failures) if failures else ""))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
