"""Reference implementations of the shipped ops, written from their meaning (ACCEPTANCE.md), in plain torch.

`dtype=torch.float64` gives the reference a result is judged against; the op's own low-precision dtype gives the
"plain" implementation a user would write, whose error against the reference sets the tolerance. Used by the
tests and the benchmarks; one per op.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["fp8_quant_gemm", "fp8_quant_gemm_two_pass", "fused_attention", "mla_decode", "moe_route", "selection_order"]


def fused_attention(q: Tensor, k: Tensor, v: Tensor, causal: bool = False, softmax_scale: float | None = None,
                    dtype: torch.dtype = torch.float64) -> tuple[Tensor, Tensor]:
    """out (B, Sq, H, D) in `dtype`, lse (B, H, Sq) float32-compatible in `dtype`; rows that see no key: 0, -inf."""
    _, Sq, H, D = q.shape
    Sk, Hk = k.shape[1], k.shape[2]
    scale = D**-0.5 if softmax_scale is None else softmax_scale
    g = H // Hk
    qd = q.to(dtype).transpose(1, 2)                                   # B H Sq D
    kd = k.to(dtype).transpose(1, 2).repeat_interleave(g, dim=1)       # B H Sk D
    vd = v.to(dtype).transpose(1, 2).repeat_interleave(g, dim=1)
    s = (qd @ kd.transpose(-1, -2)) * scale
    if causal:
        i = torch.arange(Sq, device=q.device)[:, None]
        j = torch.arange(Sk, device=q.device)[None, :]
        s = s.masked_fill(j > i + Sk - Sq, float("-inf"))
    lse = torch.logsumexp(s, dim=-1)
    p = torch.exp(s - lse[..., None])
    p = torch.where(torch.isfinite(lse)[..., None], p, torch.zeros((), dtype=p.dtype, device=p.device))
    out = (p @ vd).transpose(1, 2)
    return out, lse


def mla_decode(q: Tensor, kv_cache: Tensor, block_table: Tensor, cache_seqlens: Tensor, head_dim_v: int = 512,
               softmax_scale: float | None = None, causal: bool = False,
               dtype: torch.dtype = torch.float64) -> tuple[Tensor, Tensor]:
    """Attention of each sequence's queries over its paged cache rows; V = the first head_dim_v channels."""
    B, Sq, Hq, Dqk = q.shape
    page = kv_cache.shape[1]
    scale = Dqk**-0.5 if softmax_scale is None else softmax_scale
    out = torch.zeros(B, Sq, Hq, head_dim_v, dtype=dtype, device=q.device)
    lse = torch.full((B, Hq, Sq), float("-inf"), dtype=dtype, device=q.device)
    for b in range(B):
        n = int(cache_seqlens[b])
        if n == 0:
            continue
        blocks = block_table[b, : (n + page - 1) // page].long()
        rows = kv_cache[blocks, :, 0, :].reshape(-1, Dqk)[:n].to(dtype)  # n x 576
        s = torch.einsum("thc,jc->htj", q[b].to(dtype), rows) * scale   # Hq x Sq x n
        if causal:
            t = torch.arange(Sq, device=q.device)[:, None]
            j = torch.arange(n, device=q.device)[None, :]
            s = s.masked_fill(j >= n - (Sq - 1 - t), float("-inf"))
        l_ = torch.logsumexp(s, dim=-1)
        p = torch.exp(s - l_[..., None])
        p = torch.where(torch.isfinite(l_)[..., None], p, torch.zeros((), dtype=dtype, device=q.device))
        out[b] = torch.einsum("htj,jd->thd", p, rows[:, :head_dim_v])
        lse[b] = l_
    return out, lse


def selection_order(key: Tensor, candidates: Tensor | None = None) -> Tensor:
    """Indices of each row sorted by: candidates first, larger key first, NaN keys after all others, lower
    index first (the tie rule of moe_route)."""
    nan = torch.isnan(key)
    k = torch.where(nan, torch.full_like(key, float("-inf")), key)
    order = torch.sort(k, dim=-1, descending=True, stable=True).indices
    rank = nan.to(torch.int8)
    if candidates is not None:
        rank = rank + 2 * (~candidates).to(torch.int8)
    if bool(rank.any()):  # stable: keeps the key order inside each class
        order = torch.gather(order, -1, torch.sort(torch.gather(rank, -1, order), dim=-1, stable=True).indices)
    return order


def moe_route(logits: Tensor, topk: int, scoring: str = "softmax", renormalize: bool = False, bias: Tensor | None = None,
              n_group: int = 1, topk_group: int = 1, routed_scaling_factor: float = 1.0,
              dtype: torch.dtype = torch.float64, return_keys: bool = False):
    """weights (T, topk) and ids (T, topk) int64 in selection order. With return_keys, also the selection keys
    (T, E) and the group scores (T, n_group) the selection was made on."""
    x = logits.to(dtype)
    T, E = x.shape
    scores = torch.softmax(x, dim=-1) if scoring == "softmax" else torch.sigmoid(x)
    key = scores + bias.to(dtype) if bias is not None else scores
    size = E // n_group
    grouped = key.reshape(T, n_group, size)
    if bias is not None:
        gtop = selection_order(grouped)[..., : min(2, size)]
        gscore = torch.gather(grouped, -1, gtop).sum(-1)
    else:
        gscore = torch.gather(grouped, -1, selection_order(grouped)[..., :1]).squeeze(-1)
    keep_groups = selection_order(gscore)[:, :topk_group]
    keep = torch.zeros(T, n_group, dtype=torch.bool, device=x.device).scatter_(1, keep_groups, True)
    candidates = keep.repeat_interleave(size, dim=1)
    ids = selection_order(key, candidates)[:, :topk]
    weights = torch.gather(scores, 1, ids)
    if renormalize:
        s = weights.sum(-1, keepdim=True)
        weights = weights / torch.where(s == 0, torch.ones_like(s), s)
    weights = weights * routed_scaling_factor
    if return_keys:
        return weights, ids, key, gscore
    return weights, ids


def fp8_quant_gemm(x: Tensor, w: Tensor, w_scale: Tensor, bias: Tensor | None = None,
                   out_dtype: torch.dtype | None = None, dtype: torch.dtype = torch.float64) -> Tensor:
    """The reference: x @ (w * w_scale)^T (+ bias), no quantisation of x, in `dtype`."""
    ws = w.to(dtype) * w_scale.to(dtype).reshape(-1, 1)
    out = x.to(dtype) @ ws.T
    if bias is not None:
        out = out + bias.to(dtype)
    return out


def fp8_quant_gemm_two_pass(x: Tensor, w: Tensor, w_scale: Tensor, bias: Tensor | None = None,
                            eps: float = 1e-12) -> Tensor:
    """Quantise-then-GEMM in float32 (the contract's two_pass): per-row scale from the row's abs-max."""
    xf = x.float()
    s = torch.clamp(xf.abs().amax(dim=1, keepdim=True), min=eps) / 448.0
    q = torch.clamp(xf / s, -448.0, 448.0).to(torch.float8_e4m3fn).float()
    out = (q @ w.float().T) * s * w_scale.float().reshape(1, -1)
    if bias is not None:
        out = out + bias.float()
    return out
