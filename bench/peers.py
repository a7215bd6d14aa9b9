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
# MLA decode and the fp8 quantised GEMM
# ----------------------------------------------------------------------------------------------------------

def absorbed_mla(q: Tensor, kv_cache: Tensor, block_table: Tensor, cache_seqlens: Tensor, head_dim_v: int,
                 scale: float) -> Tensor:
    """Absorbed MLA decode in eager torch, in the inputs' dtype: each sequence's pages gathered into one
    (B, L, 576) tensor, scores = q k^T (heads and query tokens as rows), keys past the sequence length masked,
    softmax in fp32, out = p V with V the first head_dim_v channels of the same rows."""
    B, Sq, Hq, Dqk = q.shape
    rows = kv_cache[block_table.long()].reshape(B, -1, Dqk)  # B x (MB * page) x 576
    s = torch.matmul(q.reshape(B, Sq * Hq, Dqk), rows.transpose(1, 2)) * scale
    hidden = torch.arange(rows.shape[1], device=q.device)[None, :] >= cache_seqlens[:, None].long()
    s = s.masked_fill(hidden[:, None, :], float("-inf"))
    p = torch.softmax(s.float(), dim=-1).to(q.dtype)
    return torch.matmul(p, rows[..., :head_dim_v]).reshape(B, Sq, Hq, head_dim_v)


@functools.cache
def compiled_absorbed_mla(head_dim_v: int, scale: float) -> Callable[..., Tensor]:
    _raise_dynamo_cache_limits()

    def mla(q: Tensor, kv_cache: Tensor, block_table: Tensor, cache_seqlens: Tensor) -> Tensor:
        return absorbed_mla(q, kv_cache, block_table, cache_seqlens, head_dim_v, scale)

    return torch.compile(mla, dynamic=True)


def quantise_then_mm(x: Tensor, w: Tensor, w_scale: Tensor) -> Tensor:
    """Per-token fp8 quantisation in torch, then an fp32 GEMM against the decoded weight (the two-pass path)."""
    xf = x.float()
    s = torch.clamp(xf.abs().amax(dim=1, keepdim=True), min=1e-12) / 448.0
    xq = torch.clamp(xf / s, -448.0, 448.0).to(torch.float8_e4m3fn).float()
    return ((xq @ w.float().T) * s * w_scale.reshape(1, -1)).to(x.dtype)


@functools.cache
def compiled_quantise_then_mm() -> Callable[..., Tensor]:
    _raise_dynamo_cache_limits()
    return torch.compile(quantise_then_mm, dynamic=True)
