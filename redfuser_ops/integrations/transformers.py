"""redfuser ops inside Hugging Face transformers models (``pip install "redfuser-ops[transformers]"``).

Two things are replaced, both at run time on a model you already have (nothing in transformers is
edited, and :func:`revert_redfuser` undoes it):

**Attention.** :func:`register_attention` adds ``"redfuser"`` to transformers' ``AttentionInterface``
(and gives it sdpa's mask function in ``AttentionMaskInterface``, so the model builds exactly the masks
it builds for ``attn_implementation="sdpa"``). :func:`apply_redfuser` then switches the model to it with
``model.set_attn_implementation("redfuser")``; ``from_pretrained(..., attn_implementation="redfuser")``
works too once it is registered. A call runs ``torch.ops.redfuser.fused_attention`` when the attention it
asks for is plain ``softmax(scale * q k^T) v``, causal or not, with any number of key/value heads
(MHA/GQA/MQA), which is the case whenever the model hands over no mask: prefill and decode of unpadded
batches. Different q/k and v head dims (DeepSeek-V3's MLA) are zero-padded to one head dim, which leaves
the result exact. Everything else falls back, per call, to the path that transformers itself would take:

=================================================  ==========================================
the call has                                       falls back to
=================================================  ==========================================
an attention mask (padding, sliding window that    transformers' ``sdpa_attention_forward``
reaches back past the window, packed sequences,    with the same mask
prefix continuation with several new tokens,
custom 4-D masks)
dropout > 0, ``position_bias``, autograd           transformers' ``sdpa_attention_forward``
(inputs that require grad: the op has no backward),
a device or dtype the installed library has no
kernel for (CUDA: fp16/bf16, head dim <= 256, a
compiled arch family for the GPU)
``softcap``, attention sinks (``s_aux``/``sinks``),  the model's own ``eager_attention_forward``
``output_attentions=True``
=================================================  ==========================================

Models that declare no sdpa support (``_supports_sdpa = False``: Gemma-2's soft-capping, gpt-oss's
sinks) are not switched at all by :func:`apply_redfuser`. :func:`stats` counts the calls that ran the
op and the fallbacks by reason; each fallback reason is logged once (logger ``redfuser_ops``, INFO).

**MoE routers.** The router modules of these model families are re-bound to a forward that computes the
router logits exactly as before and then one ``torch.ops.redfuser.moe_route`` call:

- DeepSeek-V3 (``DeepseekV3TopkRouter``): sigmoid scores, ``e_score_correction_bias`` for selection,
  grouped selection (``n_group``/``topk_group``, group score = sum of its two best biased scores),
  ``norm_topk_prob``, ``routed_scaling_factor``; float32 weights.
- Qwen2-MoE / Qwen3-MoE (``Qwen2MoeTopKRouter``, ``Qwen3MoeTopKRouter``): softmax over all experts in
  float32, top-k, renormalised when ``norm_topk_prob``; weights cast to the logits' dtype.
- Mixtral (``MixtralTopKRouter``): softmax in float32, top-k, renormalised; float32 weights.

The new forward returns what the old one returns: ``(router_logits, weights, ids)`` with int64 ids. The
ids come in descending score order with ties to the lower expert id (DeepSeek-V3's own ``topk`` is
unsorted, so the order may differ there; the experts' sum does not depend on it). DeepSeek-V3 divides by
``sum + 1e-20`` where moe_route divides by ``sum`` (equal in float32 unless the selected sigmoids sum
below about 1e-13). A router falls back to its own forward when autograd needs its outputs (the op has
no backward), on devices other than CPU/CUDA, or on CUDA with more than 512 experts. Before a router
class is patched its new forward is checked once against the class's own forward on random weights and
inputs of the same configuration; if they disagree (a transformers version whose router differs) the
router is left alone and the report says why.

Usage::

    from redfuser_ops.integrations.transformers import apply_redfuser
    report = apply_redfuser(model)          # or apply_redfuser_to_deepseek_v3(model), ...
    model.generate(...)
"""

from __future__ import annotations

import copy
import logging
import sys
import types
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

try:
    import transformers
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask
    from transformers.modeling_utils import AttentionInterface
except ImportError as e:  # pragma: no cover - exercised only without the extra
    raise ImportError(
        "redfuser_ops.integrations.transformers needs Hugging Face transformers: "
        'pip install "redfuser-ops[transformers]"'
    ) from e

import redfuser_ops

__all__ = [
    "ATTENTION_NAME",
    "PatchReport",
    "apply_redfuser",
    "apply_redfuser_to_deepseek_v3",
    "apply_redfuser_to_llama",
    "apply_redfuser_to_mixtral",
    "apply_redfuser_to_qwen2_moe",
    "apply_redfuser_to_qwen3_moe",
    "redfuser_attention_forward",
    "register_attention",
    "reset_stats",
    "revert_redfuser",
    "stats",
]

ATTENTION_NAME = "redfuser"
"""The name under which :func:`redfuser_attention_forward` is registered in ``AttentionInterface``."""

logger = logging.getLogger("redfuser_ops")

_STATS: Counter[str] = Counter()
_LOGGED: set[str] = set()

_CUDA_ATTENTION_HEAD_DIMS = (64, 128, 256)  # fused_attention's CUDA variants (specs/fused_attention.yaml)
_CUDA_MOE_MAX_EXPERTS = 512  # moe_route's largest CUDA variant (E_cap)
_ATTENTION_DTYPES = {"cpu": (torch.float32, torch.float16, torch.bfloat16), "cuda": (torch.float16, torch.bfloat16)}
_ROUTE_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
# attention arguments that sdpa cannot honour: the model's eager function must run instead
_EAGER_ONLY_KWARGS = ("softcap", "s_aux", "sinks")


def stats() -> dict[str, int]:
    """Calls since the last :func:`reset_stats`: ``attention`` and ``moe_route`` (ran the op),
    ``attention_fallback:<reason>`` and ``moe_route_fallback:<reason>``."""
    return dict(_STATS)


def reset_stats() -> None:
    _STATS.clear()


def _count_fallback(kind: str, reason: str) -> None:
    key = f"{kind}_fallback:{reason}"
    _STATS[key] += 1
    if key not in _LOGGED:
        _LOGGED.add(key)
        logger.info("redfuser %s: falling back to transformers' own path (%s)", kind, reason)


def _cuda_family(device: torch.device, op: str) -> str | None:
    """The arch family of `op`'s CUDA kernels that runs on this GPU (the library's own rule), or None."""
    major, minor = torch.cuda.get_device_capability(device)
    families = _op_families(op)
    if not families:
        return None
    try:
        return torch.ops.redfuser._select_family(op, major, minor, ";".join(families))
    except RuntimeError:  # the library's message: no family of this op runs on this GPU
        return None


_OP_FAMILIES: dict[str, tuple[str, ...]] = {}


def _op_families(op: str) -> tuple[str, ...]:
    if op not in _OP_FAMILIES:
        variants = redfuser_ops.info()["ops"].get(op, {}).get("variants", [])
        _OP_FAMILIES[op] = tuple(sorted({v["family"] for v in variants if v["device"] == "cuda"}))
    return _OP_FAMILIES[op]


# ----------------------------------------------------------------------------------------------
# attention
# ----------------------------------------------------------------------------------------------


def _padded_head_dim(device: torch.device, d: int) -> int | None:
    """The head dim the op runs at for q/k head dim and v head dim up to `d` (None: no kernel)."""
    if device.type == "cpu":
        return d
    return next((c for c in _CUDA_ATTENTION_HEAD_DIMS if c >= d), None)


def _attention_fallback_reason(query, key, value, attention_mask, dropout, kwargs) -> tuple[str, str] | None:
    """(reason, path) when the call cannot run fused_attention; path is "sdpa" or "eager"."""
    for name in _EAGER_ONLY_KWARGS:
        if kwargs.get(name) is not None:
            return name, "eager"
    if kwargs.get("output_attentions", False):
        return "output_attentions", "eager"
    if attention_mask is not None:
        return "attention_mask", "sdpa"
    if kwargs.get("position_bias") is not None:
        return "position_bias", "sdpa"
    if dropout:
        return "dropout", "sdpa"
    if torch.is_grad_enabled() and (query.requires_grad or key.requires_grad or value.requires_grad):
        return "autograd", "sdpa"
    device = query.device
    if device.type not in _ATTENTION_DTYPES:
        return f"device {device.type}", "sdpa"
    if query.dtype not in _ATTENTION_DTYPES[device.type] or key.dtype != query.dtype or value.dtype != query.dtype:
        return f"dtype {query.dtype} on {device.type}", "sdpa"
    if device.type == "cuda" and _cuda_family(device, "fused_attention") is None:
        return "no CUDA kernels for this GPU in the installed library", "sdpa"
    if _padded_head_dim(device, max(query.shape[-1], value.shape[-1])) is None:
        return f"head dim {max(query.shape[-1], value.shape[-1])} on {device.type}", "sdpa"
    if query.shape[1] % key.shape[1] != 0:
        return "query heads not a multiple of key/value heads", "sdpa"
    return None


def _additive_mask(attention_mask, query, key, causal: bool):
    """The float mask an eager attention function adds to its scores, for what sdpa would have done
    with `attention_mask` (a bool mask from sdpa_mask, a float mask, or None with sdpa's is_causal)."""
    if attention_mask is None:
        q_len, kv_len = query.shape[2], key.shape[2]
        if not (causal and q_len > 1):
            return None
        # sdpa's is_causal: upper-left aligned (query i sees keys j <= i)
        keep = torch.ones(q_len, kv_len, dtype=torch.bool, device=query.device).tril()
        attention_mask = keep[None, None]
    if attention_mask.dtype == torch.bool:
        zero = torch.zeros((), dtype=query.dtype, device=query.device)
        return torch.where(attention_mask, zero, torch.finfo(query.dtype).min)
    return attention_mask


def _eager_fallback(module, query, key, value, attention_mask, dropout, scaling, is_causal, kwargs):
    eager = getattr(sys.modules.get(type(module).__module__), "eager_attention_forward", None)
    if eager is None:
        raise NotImplementedError(
            f"redfuser attention: {type(module).__name__} asks for a feature that neither fused_attention nor "
            "sdpa supports and its module defines no eager_attention_forward to fall back to; "
            'use attn_implementation="eager" for this model'
        )
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    mask = _additive_mask(attention_mask, query, key, bool(causal))
    return eager(module, query, key, value, mask, dropout=dropout, scaling=scaling, **kwargs)


def redfuser_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers attention function: query (B, H, Sq, Dqk), key (B, Hk, Sk, Dqk), value (B, Hk, Sk, Dv)
    -> (attn_output (B, Sq, H, Dv), None). Runs ``torch.ops.redfuser.fused_attention`` where the call is
    plain (causal) attention without a mask, else falls back (see the module docstring)."""
    fallback = _attention_fallback_reason(query, key, value, attention_mask, dropout, kwargs)
    if fallback is not None:
        reason, path = fallback
        _count_fallback("attention", reason)
        if path == "eager":
            return _eager_fallback(module, query, key, value, attention_mask, dropout, scaling, is_causal, kwargs)
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, is_causal=is_causal, **kwargs
        )

    q_len, kv_len = query.shape[2], key.shape[2]
    # Without a mask the model relies on sdpa's is_causal: causal only for several queries, upper-left
    # aligned. With kv_len > q_len that happens only for the prefill of an empty static cache, where sdpa
    # drops the (empty) keys past q_len; then upper-left and fused_attention's bottom-right agree.
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    causal = bool(causal) and q_len > 1
    if causal and kv_len > q_len:
        key, value = key[:, :, :q_len], value[:, :, :q_len]

    d_qk, d_v = query.shape[-1], value.shape[-1]
    d = _padded_head_dim(query.device, max(d_qk, d_v))
    if scaling is None:
        scaling = d_qk**-0.5
    # (B, H, S, D) -> (B, S, H, D): strided views, read in place by the op
    q, k, v = query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2)
    # zero columns change neither q.k nor the softmax, and give zero output columns
    if d_qk < d:
        q, k = F.pad(q, (0, d - d_qk)), F.pad(k, (0, d - d_qk))
    if d_v < d:
        v = F.pad(v, (0, d - d_v))
    out, _ = torch.ops.redfuser.fused_attention(q, k, v, causal, float(scaling))
    _STATS["attention"] += 1
    if d_v < d:
        out = out[..., :d_v].contiguous()
    return out, None


def register_attention() -> str:
    """Register ``"redfuser"`` in transformers' AttentionInterface (with sdpa's mask function in
    AttentionMaskInterface). Idempotent; returns the name to pass as ``attn_implementation``."""
    AttentionInterface.register(ATTENTION_NAME, redfuser_attention_forward)
    AttentionMaskInterface.register(ATTENTION_NAME, sdpa_mask)
    return ATTENTION_NAME


# ----------------------------------------------------------------------------------------------
# MoE routers
# ----------------------------------------------------------------------------------------------


def _route_fallback_reason(hidden_states: torch.Tensor, weight: torch.Tensor, num_experts: int) -> str | None:
    if torch.is_grad_enabled() and (hidden_states.requires_grad or weight.requires_grad):
        return "autograd"
    device = hidden_states.device
    if device.type not in ("cpu", "cuda"):
        return f"device {device.type}"
    if device.type == "cuda" and (num_experts > _CUDA_MOE_MAX_EXPERTS or _cuda_family(device, "moe_route") is None):
        return "no CUDA kernel for this GPU or expert count"
    return None


def _moe_route(logits, topk, scoring, renormalize, bias=None, n_group=1, topk_group=1, scale=1.0):
    if logits.dtype not in _ROUTE_DTYPES:
        logits = logits.float()
    weights, ids = torch.ops.redfuser.moe_route(
        logits, int(topk), scoring, bool(renormalize), bias, int(n_group), int(topk_group), float(scale)
    )
    _STATS["moe_route"] += 1
    return weights, ids.long()


def _router_forward(route: Callable) -> Callable:
    """A router forward: the logits and moe_route call of `route`, or the class's own forward where the
    op cannot run."""

    def forward(self, hidden_states):
        hidden_states = hidden_states.reshape(-1, self.hidden_dim)
        reason = _route_fallback_reason(hidden_states, self.weight, self.num_experts)
        if reason is not None:
            _count_fallback("moe_route", reason)
            return type(self).forward(self, hidden_states)
        return route(self, hidden_states)

    forward.__name__ = forward.__qualname__ = route.__name__
    return forward


@_router_forward
def _mixtral_route(self, hidden_states):
    router_logits = F.linear(hidden_states, self.weight)
    # softmax in float32, top-k, renormalised; the weights stay float32
    weights, ids = _moe_route(router_logits, self.top_k, "softmax", True)
    return router_logits, weights, ids


@_router_forward
def _qwen_moe_route(self, hidden_states):
    router_logits = F.linear(hidden_states, self.weight)
    # softmax in float32, top-k, renormalised only with norm_topk_prob; weights in the logits' dtype
    weights, ids = _moe_route(router_logits, self.top_k, "softmax", self.norm_topk_prob)
    return router_logits, weights.to(router_logits.dtype), ids


@_router_forward
def _deepseek_v3_route(self, hidden_states):
    router_logits = F.linear(hidden_states.type(torch.float32), self.weight.type(torch.float32))
    # sigmoid scores, biased grouped selection, optional renormalisation, scaling; float32 weights
    bias = self.e_score_correction_bias.float()
    weights, ids = _moe_route(router_logits, self.top_k, "sigmoid", self.norm_topk_prob, bias,
                              self.num_group, self.topk_group, self.routed_scaling_factor)
    return router_logits, weights, ids


@dataclass(frozen=True)
class _RouterKind:
    family: str
    module: str  # transformers.models.<module>
    cls: str
    forward: Callable
    attrs: tuple[str, ...]  # the configuration the forward reads (cache key of the self-check)
    bias: str | None = None


_ROUTERS = (
    _RouterKind("mixtral", "mixtral.modeling_mixtral", "MixtralTopKRouter", _mixtral_route,
                ("top_k", "num_experts", "hidden_dim")),
    _RouterKind("qwen2_moe", "qwen2_moe.modeling_qwen2_moe", "Qwen2MoeTopKRouter", _qwen_moe_route,
                ("top_k", "num_experts", "hidden_dim", "norm_topk_prob")),
    _RouterKind("qwen3_moe", "qwen3_moe.modeling_qwen3_moe", "Qwen3MoeTopKRouter", _qwen_moe_route,
                ("top_k", "num_experts", "hidden_dim", "norm_topk_prob")),
    _RouterKind("deepseek_v3", "deepseek_v3.modeling_deepseek_v3", "DeepseekV3TopkRouter",
                _deepseek_v3_route,
                ("top_k", "num_experts", "hidden_dim", "norm_topk_prob", "num_group", "topk_group",
                 "routed_scaling_factor"),
                bias="e_score_correction_bias"),
)


def _router_classes() -> dict[type, _RouterKind]:
    """The router classes of the installed transformers that redfuser replaces."""
    found = {}
    for kind in _ROUTERS:
        try:
            mod = __import__(f"transformers.models.{kind.module}", fromlist=[kind.cls])
        except ImportError:
            continue
        cls = getattr(mod, kind.cls, None)
        if cls is not None:
            found[cls] = kind
    return found


_CHECKED: dict[tuple, str | None] = {}


def _self_check(module: torch.nn.Module, kind: _RouterKind) -> str | None:
    """Run the class's own forward and redfuser's on a float32 CPU copy of `module` with random weights
    and inputs; None when they agree (same logits, same dense weights per expert, same dtypes), else what
    differs. Another transformers version whose router reads other attributes or returns other things
    fails here, and its routers are left alone."""
    missing = [a for a in (*kind.attrs, "weight", kind.bias or "weight") if not hasattr(module, a)]
    if missing:
        return f"the router has no attribute {', '.join(missing)} (another transformers version?)"
    key = (type(module), tuple(getattr(module, a) for a in kind.attrs))
    if key not in _CHECKED:
        try:
            _CHECKED[key] = _compare_on_probe(module, kind)
        except Exception as e:  # noqa: BLE001 - any failure of either forward on the probe: do not patch
            _CHECKED[key] = f"the probe run failed ({type(e).__name__}: {e})"
    return _CHECKED[key]


def _compare_on_probe(module: torch.nn.Module, kind: _RouterKind) -> str | None:
    gen = torch.Generator().manual_seed(0)
    probe = copy.deepcopy(module).to_empty(device="cpu").float()
    hidden = module.hidden_dim
    with torch.no_grad():
        probe.weight.copy_(torch.randn(probe.weight.shape, generator=gen) * hidden**-0.5)
        if kind.bias is not None:
            getattr(probe, kind.bias).copy_(torch.rand(getattr(probe, kind.bias).shape, generator=gen) * 0.1)
        x = torch.randn(64, hidden, generator=gen)
        want = type(probe).forward(probe, x)
        counted = _STATS["moe_route"]
        got = kind.forward(probe, x)
        if counted:  # stats() counts the model's calls, not this check's
            _STATS["moe_route"] = counted
        else:
            del _STATS["moe_route"]
    if not isinstance(want, tuple) or len(want) != 3:
        return "the router does not return (logits, weights, ids)"
    (w_logits, w_weights, w_ids), (g_logits, g_weights, g_ids) = want, got
    if not torch.equal(g_logits, w_logits):
        return "router logits differ"
    if (g_weights.dtype, g_ids.dtype, g_ids.shape) != (w_weights.dtype, w_ids.dtype, w_ids.shape):
        return (f"outputs differ in dtype/shape: weights {w_weights.dtype} vs {g_weights.dtype}, "
                f"ids {w_ids.dtype}{tuple(w_ids.shape)} vs {g_ids.dtype}{tuple(g_ids.shape)}")
    experts = module.num_experts
    dense_w = torch.zeros(x.shape[0], experts).scatter_add_(1, w_ids, w_weights.float())
    dense_g = torch.zeros(x.shape[0], experts).scatter_add_(1, g_ids, g_weights.float())
    if not torch.allclose(dense_g, dense_w, rtol=1e-5, atol=1e-6):
        return f"per-expert routing weights differ (max {(dense_g - dense_w).abs().max().item():.3g})"
    return None


# ----------------------------------------------------------------------------------------------
# applying and reverting
# ----------------------------------------------------------------------------------------------


@dataclass
class PatchReport:
    """What :func:`apply_redfuser` changed: ``attention`` is True when the model now runs the
    ``"redfuser"`` attention implementation; ``routers`` counts patched router modules by class;
    ``skipped`` says what was left alone and why."""

    attention: bool = False
    routers: dict[str, int] = field(default_factory=dict)
    skipped: list[str] = field(default_factory=list)

    @property
    def n_routers(self) -> int:
        return sum(self.routers.values())


_PREV_ATTN = "_redfuser_previous_attn_implementation"
_PATCHED = "_redfuser_router"


def apply_redfuser(model: torch.nn.Module, *, attention: bool = True, moe_router: bool = True,
                   families: tuple[str, ...] | None = None) -> PatchReport:
    """Switch `model` (a transformers ``PreTrainedModel``) to redfuser attention and replace its MoE
    routers of the covered families (``families`` restricts them: "mixtral", "qwen2_moe", "qwen3_moe",
    "deepseek_v3"). Idempotent; :func:`revert_redfuser` undoes it."""
    report = PatchReport()
    if attention:
        if not isinstance(model, transformers.PreTrainedModel):
            report.skipped.append(f"attention: {type(model).__name__} is not a transformers PreTrainedModel")
        elif not getattr(model, "_supports_sdpa", False):
            report.skipped.append(
                f"attention: {type(model).__name__} declares no sdpa support (features such as soft-capping or "
                "sinks that fused_attention does not cover); its attention is left unchanged"
            )
        else:
            register_attention()
            current = model.config._attn_implementation
            if current != ATTENTION_NAME:
                model.set_attn_implementation(ATTENTION_NAME)
                setattr(model, _PREV_ATTN, current)
            report.attention = model.config._attn_implementation == ATTENTION_NAME
    if moe_router:
        kinds = _router_classes()
        for name, module in model.named_modules():
            kind = kinds.get(type(module))
            if kind is None or (families is not None and kind.family not in families):
                continue
            if getattr(module, _PATCHED, False):
                report.routers[kind.cls] = report.routers.get(kind.cls, 0) + 1
                continue
            problem = _self_check(module, kind)
            if problem is not None:
                report.skipped.append(f"router {name} ({kind.cls}): self-check failed, left unchanged: {problem}")
                continue
            module.forward = types.MethodType(kind.forward, module)
            setattr(module, _PATCHED, True)
            report.routers[kind.cls] = report.routers.get(kind.cls, 0) + 1
    return report


def revert_redfuser(model: torch.nn.Module) -> None:
    """Undo :func:`apply_redfuser`: the previous attention implementation and the routers' own forwards."""
    previous = getattr(model, _PREV_ATTN, None)
    if previous is not None:
        model.set_attn_implementation(previous)
        delattr(model, _PREV_ATTN)
    for module in model.modules():
        if getattr(module, _PATCHED, False):
            del module.forward
            delattr(module, _PATCHED)


def _apply_family(model, model_types: tuple[str, ...], family: str | None, attention: bool, moe_router: bool):
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    if model_type not in model_types:
        raise ValueError(f"expected a model of type {' or '.join(model_types)}, got {model_type!r}")
    report = apply_redfuser(model, attention=attention, moe_router=moe_router and family is not None,
                            families=(family,) if family else ())
    if family is not None and moe_router and report.n_routers == 0 and not report.skipped:
        report.skipped.append(f"no {family} router found in the model")
    return report


def apply_redfuser_to_llama(model, *, attention: bool = True) -> PatchReport:
    """Llama-style models (MHA/GQA): redfuser attention."""
    return _apply_family(model, ("llama",), None, attention, False)


def apply_redfuser_to_mixtral(model, *, attention: bool = True, moe_router: bool = True) -> PatchReport:
    """Mixtral: redfuser attention and ``moe_route`` (softmax, top-k, renormalise) for its routers."""
    return _apply_family(model, ("mixtral",), "mixtral", attention, moe_router)


def apply_redfuser_to_qwen2_moe(model, *, attention: bool = True, moe_router: bool = True) -> PatchReport:
    """Qwen2-MoE: redfuser attention and ``moe_route`` (softmax, top-k, ``norm_topk_prob``)."""
    return _apply_family(model, ("qwen2_moe",), "qwen2_moe", attention, moe_router)


def apply_redfuser_to_qwen3_moe(model, *, attention: bool = True, moe_router: bool = True) -> PatchReport:
    """Qwen3-MoE: redfuser attention and ``moe_route`` (softmax, top-k, ``norm_topk_prob``)."""
    return _apply_family(model, ("qwen3_moe",), "qwen3_moe", attention, moe_router)


def apply_redfuser_to_deepseek_v3(model, *, attention: bool = True, moe_router: bool = True) -> PatchReport:
    """DeepSeek-V3: redfuser attention (MLA's q/k and v head dims zero-padded to one) and ``moe_route``
    (sigmoid, bias, grouped selection, ``norm_topk_prob``, ``routed_scaling_factor``)."""
    return _apply_family(model, ("deepseek_v3",), "deepseek_v3", attention, moe_router)
