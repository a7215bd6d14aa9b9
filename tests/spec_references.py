"""References of the ops made only of their YAML spec (specs/*.yaml that redfuser_ops names nowhere), written from
their meaning in plain torch, one per op. `dtype=torch.float64` gives the reference a result is judged against; the
op's own low-precision dtype gives the "plain" implementation a user would write (ACCEPTANCE.md's rule).
Shipped ops keep theirs in redfuser_ops/reference.py."""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor


def sliding_window_attention(q: Tensor, k: Tensor, v: Tensor, window: int, softcap: float = 50.0,
                             softmax_scale: float | None = None,
                             dtype: torch.dtype = torch.float64) -> tuple[Tensor, Tensor]:
    """Query i sees keys i + Sk - Sq - window < j <= i + Sk - Sq; scores softcap * tanh(scale * q.k / softcap).
    out (B, Sq, H, D), lse (B, H, Sq); a row that sees no key gives out 0 and lse -inf."""
    _, Sq, H, D = q.shape
    Sk, Hk = k.shape[1], k.shape[2]
    scale = D**-0.5 if softmax_scale is None else softmax_scale
    qd = q.to(dtype).transpose(1, 2)
    kd = k.to(dtype).transpose(1, 2).repeat_interleave(H // Hk, dim=1)
    vd = v.to(dtype).transpose(1, 2).repeat_interleave(H // Hk, dim=1)
    s = softcap * torch.tanh((qd @ kd.transpose(-1, -2)) * scale / softcap)
    i = torch.arange(Sq, device=q.device)[:, None]
    j = torch.arange(Sk, device=q.device)[None, :]
    diag = i + Sk - Sq
    s = s.masked_fill((j > diag) | (j <= diag - window), float("-inf"))
    lse = torch.logsumexp(s, dim=-1)
    p = torch.exp(s - lse[..., None])
    p = torch.where(torch.isfinite(lse)[..., None], p, torch.zeros((), dtype=p.dtype, device=p.device))
    return (p @ vd).transpose(1, 2), lse


def softmax_cross_entropy(logits: Tensor, target: Tensor, label_smoothing: float = 0.0, ignore_index: int = -100,
                          dtype: torch.dtype = torch.float64) -> Tensor:
    """loss[t] = (1 - eps) * (lse_t - x[t, target_t]) + eps * (lse_t - mean_e x[t, e]) (without the mean where
    eps = 0, as torch: a -inf logit would make it -inf and the loss NaN); 0 where target == ignore."""
    x = logits.to(dtype)
    lse = torch.logsumexp(x, dim=-1)
    ignored = target == ignore_index
    picked = x.gather(-1, torch.where(ignored, 0, target).long()[:, None])[:, 0]
    loss = lse - picked
    if label_smoothing > 0:
        loss = (1 - label_smoothing) * loss + label_smoothing * (lse - x.mean(dim=-1))
    return torch.where(ignored, torch.zeros((), dtype=dtype), loss)


def logsumexp(x: Tensor, dtype: torch.dtype = torch.float64) -> Tensor:
    """log(sum_e exp(x[t, e])) per row."""
    return torch.logsumexp(x.to(dtype), dim=-1)


E4M3_MAX = 448.0
E4M3_MIN_SCALE = 1.0 / (448.0 * 512.0)  # vLLM's per-token floor: an all-zero row quantises to exact zeros


def rms_norm_fp8_quant(x: Tensor, weight: Tensor, eps: float = 1e-6,
                       dtype: torch.dtype = torch.float64) -> tuple[Tensor, Tensor]:
    """y = x * rsqrt(mean_j x^2 + eps) * weight; scale[t] = max(max_j |y[t, j]| / 448, 1 / (448 * 512));
    returns (y / scale clamped to [-448, 448], not rounded to e4m3, and scale), both in `dtype`."""
    xd = x.to(dtype)
    y = xd * torch.rsqrt(xd.square().mean(dim=-1, keepdim=True) + eps) * weight.to(dtype)
    scale = (y.abs().amax(dim=-1) / E4M3_MAX).clamp(min=E4M3_MIN_SCALE)
    return (y / scale[:, None]).clamp(-E4M3_MAX, E4M3_MAX), scale


def softmax(x: Tensor, dtype: torch.dtype = torch.float64) -> Tensor:
    """exp(x - max) / sum(exp(x - max)) per row; a row of -inf gives zeros."""
    xd = x.to(dtype)
    p = torch.softmax(xd, dim=-1)
    return torch.where(torch.isneginf(xd).all(dim=-1, keepdim=True), torch.zeros((), dtype=dtype), p)


def vocab_topk(logits: Tensor, k: int, dtype: torch.dtype = torch.float64) -> tuple[Tensor, Tensor]:
    """Per row the k largest logits in descending order (equal ones to the lower index, NaN after every number):
    (exp(x - m) / sum_v exp(x[v] - m) at them, in `dtype`, m the row max (NaN and +inf propagate as in that formula);
    their int64 ids). The order is computed on the logits' exact values, whatever `dtype` is."""
    x = logits.double()
    nan = torch.isnan(x)
    ids = torch.empty(x.shape[0], k, dtype=torch.int64)
    for t in range(x.shape[0]):
        row = x[t].numpy()
        order = np.lexsort((np.arange(row.size), -np.where(nan[t].numpy(), 0.0, row), nan[t].numpy()))
        ids[t] = torch.from_numpy(order[:k].astype(np.int64))
    xd = logits.to(dtype)
    m = xd.amax(dim=-1, keepdim=True)
    p = torch.exp(xd.gather(-1, ids) - m) / torch.exp(xd - m).sum(dim=-1, keepdim=True)
    return p, ids
