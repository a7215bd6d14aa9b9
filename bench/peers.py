"""What a user would otherwise write or call: the peers the ops are measured against.

Attention: torch's scaled_dot_product_attention with each backend, plain attention (matmul, softmax, matmul) in
eager torch, and torch.compile of that plain attention. MoE routing: softmax or sigmoid scoring, optional
grouped selection and top-k in eager torch (the way vLLM's grouped_topk and fused_topk do it), and
torch.compile of it. Written here from the ops' meaning; nothing is copied from those projects.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor

# ----------------------------------------------------------------------------------------------------------
# Attention, on (B, S, H, D) tensors like the op; peers that want (B, H, S, D) get transposed views
# ----------------------------------------------------------------------------------------------------------

SDPA_BACKENDS = {"flash": "FLASH_ATTENTION", "efficient": "EFFICIENT_ATTENTION", "cudnn": "CUDNN_ATTENTION",
                 "math": "MATH"}


def sdpa_context(backend: str | None) -> Callable[[], contextlib.AbstractContextManager]:
    """A context that pins SDPA to `backend` (None: torch's own choice)."""
    if backend is None:
        return contextlib.nullcontext
    from torch.nn.attention import SDPBackend, sdpa_kernel

    member = getattr(SDPBackend, SDPA_BACKENDS[backend])
    return functools.partial(sdpa_kernel, [member])


def sdpa_attention(causal: bool, groups: int) -> Callable[[Tensor, Tensor, Tensor], Tensor]:
    """F.scaled_dot_product_attention on (B, S, H, D) views; its causal mask is top-left aligned, the same as
    the op's bottom-right one only for Sq == Sk, so causal cases with Sq != Sk are not given to it."""
    kwargs = {"enable_gqa": True} if groups > 1 else {}

    def run(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                           is_causal=causal, **kwargs)
        return o.transpose(1, 2)

    return run


def plain_attention(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, scale: float, groups: int) -> Tensor:
    """softmax(q k^T * scale) v with torch ops in the inputs' dtype; `mask` True where a key is hidden."""
    qt, kt, vt = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    if groups > 1:
        kt = kt.repeat_interleave(groups, dim=1)
        vt = vt.repeat_interleave(groups, dim=1)
    s = torch.matmul(qt, kt.transpose(-1, -2)) * scale
    if mask is not None:
        s = s.masked_fill(mask, float("-inf"))
    p = torch.softmax(s, dim=-1)
    return torch.matmul(p, vt).transpose(1, 2)


def causal_mask(Sq: int, Sk: int, device) -> Tensor:
    """True where query i may not see key j (bottom-right aligned: j > i + Sk - Sq)."""
    i = torch.arange(Sq, device=device)[:, None]
    j = torch.arange(Sk, device=device)[None, :]
    return j > i + (Sk - Sq)


@functools.cache
def compiled_plain_attention(scale: float, groups: int, masked: bool) -> Callable[..., Tensor]:
    """torch.compile of plain_attention with dynamic shapes; one compiled function per (scale, groups, masked),
    the mask passed as an input so that cases of other lengths reuse the graph."""
    _raise_dynamo_cache_limits()

    def attention(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None) -> Tensor:
        return plain_attention(q, k, v, mask if masked else None, scale, groups)

    return torch.compile(attention, dynamic=True)


# ----------------------------------------------------------------------------------------------------------
# MoE routing
# ----------------------------------------------------------------------------------------------------------

def torch_route(logits: Tensor, bias: Tensor | None, topk: int, scoring: str, renormalize: bool, n_group: int,
                topk_group: int, scale: float) -> tuple[Tensor, Tensor]:
    """Router in plain torch: scores in fp32, a group score (the best expert, or the best two with a bias),
    the best topk_group groups kept, top-k over the kept experts; weights are the unbiased scores."""
    scores = torch.softmax(logits.float(), dim=-1) if scoring == "softmax" else torch.sigmoid(logits.float())
    choice = scores + bias if bias is not None else scores
    if n_group > 1:
        T = choice.shape[0]
        grouped = choice.view(T, n_group, -1)
        if bias is not None:
            gscore = grouped.topk(2, dim=-1).values.sum(dim=-1)
        else:
            gscore = grouped.amax(dim=-1)
        gidx = gscore.topk(topk_group, dim=-1, sorted=False).indices
        gmask = torch.zeros_like(gscore).scatter_(1, gidx, 1.0)
        emask = gmask.unsqueeze(-1).expand_as(grouped).reshape(T, -1)
        choice = choice.masked_fill(emask == 0, float("-inf"))
    ids = choice.topk(topk, dim=-1, sorted=True).indices
    weights = scores.gather(1, ids)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    if scale != 1.0:
        weights = weights * scale
    return weights, ids.to(torch.int32)


@functools.cache
def compiled_torch_route(topk: int, scoring: str, renormalize: bool, n_group: int, topk_group: int,
                         scale: float) -> Callable[..., tuple[Tensor, Tensor]]:
    """torch.compile of torch_route for one router configuration, dynamic in the number of tokens."""
    _raise_dynamo_cache_limits()

    def route(logits: Tensor, bias: Tensor | None) -> tuple[Tensor, Tensor]:
        return torch_route(logits, bias, topk, scoring, renormalize, n_group, topk_group, scale)

    return torch.compile(route, dynamic=True)


# ----------------------------------------------------------------------------------------------------------
# MLA decode (absorbed: the queries are already in the latent space), over a paged cache
# ----------------------------------------------------------------------------------------------------------

def torch_mla_decode(q: Tensor, kv_cache: Tensor, block_table: Tensor, cache_seqlens: Tensor, head_dim_v: int,
                     scale: float, causal: bool) -> tuple[Tensor, Tensor]:
    """What a user writes in torch: gather every sequence's pages into a padded (B, MB * page, 576) tensor, one
    batched matmul for the scores (all heads and query tokens of a sequence at once), a masked float32 softmax,
    one matmul with V (the first head_dim_v channels of the gathered rows). Returns out (B, Sq, Hq, dv) in q's
    dtype and lse (B, Hq, Sq) float32."""
    B, Sq, Hq, D = q.shape
    rows = kv_cache[block_table.long()].reshape(B, -1, D)                     # (B, N, D)
    s = torch.matmul(q.reshape(B, Sq * Hq, D), rows.transpose(1, 2)).float() * scale  # (B, Sq*Hq, N)
    j = torch.arange(rows.shape[1], device=q.device)
    limit = cache_seqlens.long()[:, None]                                      # (B, 1)
    if causal:
        t = torch.arange(Sq, device=q.device).repeat_interleave(Hq)           # row t * Hq + h -> t
        limit = limit - (Sq - 1 - t)[None, :]                                 # (B, Sq*Hq)
    hidden = j[None, None, :] >= limit[..., None]
    s = s.masked_fill(hidden, float("-inf"))
    lse = torch.logsumexp(s, dim=-1)
    p = torch.exp(s - lse[..., None]).to(q.dtype)
    out = torch.matmul(p, rows[..., :head_dim_v]).reshape(B, Sq, Hq, head_dim_v)
    return out, lse.reshape(B, Sq, Hq).transpose(1, 2)


@functools.cache
def compiled_torch_mla_decode(head_dim_v: int, scale: float, causal: bool) -> Callable[..., tuple[Tensor, Tensor]]:
    """torch.compile of torch_mla_decode, dynamic in the sizes."""
    _raise_dynamo_cache_limits()

    def mla(q: Tensor, kv_cache: Tensor, block_table: Tensor, cache_seqlens: Tensor) -> tuple[Tensor, Tensor]:
        return torch_mla_decode(q, kv_cache, block_table, cache_seqlens, head_dim_v, scale, causal)

    return torch.compile(mla, dynamic=True)


def _raise_dynamo_cache_limits() -> None:
    """Each (dtype, config) is a recompilation of the same function: allow enough of them."""
    cfg = torch._dynamo.config
    for name in ("cache_size_limit", "recompile_limit"):
        if hasattr(cfg, name):
            setattr(cfg, name, max(getattr(cfg, name), 128))
    for name in ("accumulated_cache_size_limit", "accumulated_recompile_limit"):
        if hasattr(cfg, name):
            setattr(cfg, name, max(getattr(cfg, name), 1024))


# ----------------------------------------------------------------------------------------------------------
# fp8 GEMM with per-token quantisation of the activations
# ----------------------------------------------------------------------------------------------------------

def per_token_fp8(x: Tensor, eps: float = 1e-12) -> tuple[Tensor, Tensor]:
    """Per-row dynamic e4m3 quantisation in torch: (q (M, K) float8_e4m3fn, s (M, 1) float32), x ~ q * s."""
    s = x.abs().amax(dim=1, keepdim=True).float().clamp(min=eps) / 448.0
    q = (x.float() / s).clamp(-448.0, 448.0).to(torch.float8_e4m3fn)
    return q, s


def two_pass_scaled_mm(x: Tensor, w: Tensor, w_scale: Tensor, out_dtype: torch.dtype) -> Tensor:
    """What a user runs on CUDA without a fused kernel: quantise x per token in torch, then torch._scaled_mm with
    row-wise scales (x's per row, w's per output channel)."""
    q, s = per_token_fp8(x)
    sw = w_scale.float().expand(w.shape[0]).reshape(1, -1).contiguous()
    return torch._scaled_mm(q, w.t(), scale_a=s, scale_b=sw, out_dtype=out_dtype)


def two_pass_torch(x: Tensor, w_f32: Tensor, w_scale: Tensor, out_dtype: torch.dtype) -> Tensor:
    """The same two passes where torch has no fp8 GEMM (the CPU): quantise, then a float32 matmul of the e4m3
    values with the weight's e4m3 values held in float32 (converted once, as a user would), scaled per row and
    per channel."""
    q, s = per_token_fp8(x)
    return ((q.float() @ w_f32.t()) * s * w_scale.float().reshape(1, -1)).to(out_dtype)
