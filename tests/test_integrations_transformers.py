"""redfuser_ops.integrations.transformers on tiny random-weight models built from transformers' own config
classes (nothing downloaded): the patched model generates the greedy tokens of the unpatched eager model,
its attention and routers really run torch.ops.redfuser.* (counted at the dispatcher), and the fallbacks
happen where the op does not cover the call (masks, autograd, soft-capping) and give the eager answer.
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

transformers = pytest.importorskip("transformers")

from redfuser_ops.integrations import transformers as rt

NEW_TOKENS = 16
VOCAB = 128

# family -> (config class, model class, config overrides, MoE layers); every config is tiny
# (hidden 64, 4 query heads, vocab 128) and GQA with 2 key/value heads unless said otherwise
FAMILIES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", {"num_hidden_layers": 2, "intermediate_size": 128}, 0),
    # MHA (Hk = H) and MQA (Hk = 1): the op maps heads by index, no repeat_kv
    "llama_mha": ("LlamaConfig", "LlamaForCausalLM",
                  {"num_hidden_layers": 2, "intermediate_size": 128, "num_key_value_heads": 4}, 0),
    "llama_mqa": ("LlamaConfig", "LlamaForCausalLM",
                  {"num_hidden_layers": 2, "intermediate_size": 128, "num_key_value_heads": 1}, 0),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM",
                {"num_hidden_layers": 2, "intermediate_size": 96, "num_local_experts": 8,
                 "num_experts_per_tok": 2}, 2),
    # Qwen2-MoE: shared expert, norm_topk_prob off (its default): top-k softmax weights as they are
    "qwen2_moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM",
                  {"num_hidden_layers": 2, "intermediate_size": 96, "moe_intermediate_size": 32,
                   "shared_expert_intermediate_size": 64, "num_experts": 8, "num_experts_per_tok": 2,
                   "norm_topk_prob": False}, 2),
    # Qwen3-MoE: q/k norms, head_dim 16, norm_topk_prob on
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM",
                  {"num_hidden_layers": 2, "intermediate_size": 96, "moe_intermediate_size": 32, "num_experts": 10,
                   "num_experts_per_tok": 3, "head_dim": 16, "norm_topk_prob": True}, 2),
    # DeepSeek-V3: MLA (q/k head dim 24, v head dim 16: zero-padded for the op), first layer dense, then
    # 16 experts in 4 groups, 2 groups kept, top-4, sigmoid + bias, renormalised, scaled by 2.5
    "deepseek_v3": ("DeepseekV3Config", "DeepseekV3ForCausalLM",
                    {"num_hidden_layers": 3, "first_k_dense_replace": 1, "num_key_value_heads": 4,
                     "intermediate_size": 96, "moe_intermediate_size": 32, "n_routed_experts": 16,
                     "num_experts_per_tok": 4, "n_group": 4, "topk_group": 2, "routed_scaling_factor": 2.5,
                     "q_lora_rank": 32, "kv_lora_rank": 16, "qk_rope_head_dim": 8, "qk_nope_head_dim": 16,
                     "v_head_dim": 16}, 2),
}


def tiny_model(family: str, seed: int = 0, **overrides):
    cfg_name, model_name, kw, _ = FAMILIES[family]
    args = {"vocab_size": VOCAB, "hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2,
            "max_position_embeddings": 256, "pad_token_id": 0}
    args.update(kw)
    args.update(overrides)
    config = getattr(transformers, cfg_name)(**args)
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = getattr(transformers, model_name)(config).eval()
    # DeepSeek-V3's selection bias is a zero buffer at init: make it matter
    for module in model.modules():
        if hasattr(module, "e_score_correction_bias"):
            with torch.no_grad():
                module.e_score_correction_bias.uniform_(-0.05, 0.05)
    return model


class OpCounter(TorchDispatchMode):
    """Counts the ops that reach the dispatcher, by schema name."""

    def __init__(self):
        super().__init__()
        self.counts: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.counts[func._schema.name] += 1
        return func(*args, **(kwargs or {}))

    @property
    def attention(self) -> int:
        return self.counts["redfuser::fused_attention"]

    @property
    def moe_route(self) -> int:
        return self.counts["redfuser::moe_route"]

    @property
    def sdpa(self) -> int:
        return sum(n for name, n in self.counts.items() if "scaled_dot_product" in name)


def greedy(model, input_ids, attention_mask=None):
    with torch.no_grad():
        return model.generate(input_ids, attention_mask=attention_mask, max_new_tokens=NEW_TOKENS,
                              min_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0)


def prompt(batch=2, length=9, seed=1):
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(1, VOCAB, (batch, length), generator=gen)


def layers(model) -> int:
    return model.config.num_hidden_layers


@pytest.mark.parametrize("family", list(FAMILIES))
def test_greedy_tokens_equal_eager_and_ops_run(family):
    model = tiny_model(family)
    ids = prompt()
    want = greedy(model, ids)
    with torch.no_grad():
        want_logits = model(ids).logits

    report = rt.apply_redfuser(model)
    assert report.attention and model.config._attn_implementation == "redfuser"
    assert report.n_routers == FAMILIES[family][3] and not report.skipped

    rt.reset_stats()
    with OpCounter() as ops:
        got = greedy(model, ids)
    assert torch.equal(got, want)
    # one prefill and NEW_TOKENS - 1 decode steps, each through every layer's attention and router
    steps = NEW_TOKENS
    assert ops.attention == layers(model) * steps
    assert ops.moe_route == FAMILIES[family][3] * steps
    assert ops.sdpa == 0
    assert rt.stats() == {"attention": ops.attention, **({"moe_route": ops.moe_route} if ops.moe_route else {})}

    with torch.no_grad():
        got_logits = model(ids).logits
    torch.testing.assert_close(got_logits, want_logits, rtol=1e-4, atol=1e-4)


def test_revert_and_idempotence(monkeypatch):
    monkeypatch.setattr(rt, "_CHECKED", {})  # run the routers' self-check here
    model = tiny_model("mixtral")
    ids = prompt(batch=1)
    want = greedy(model, ids)
    rt.reset_stats()
    first = rt.apply_redfuser(model)
    second = rt.apply_redfuser(model)
    assert rt.stats() == {}  # the routers' self-check at patch time is not counted
    assert first.routers == second.routers == {"MixtralTopKRouter": 2}
    router = model.model.layers[0].mlp.gate
    assert router.forward.__func__ is rt._mixtral_route  # bound once, not wrapped twice
    with OpCounter() as ops:
        assert torch.equal(greedy(model, ids), want)
    assert ops.attention > 0 and ops.moe_route > 0

    rt.revert_redfuser(model)
    assert model.config._attn_implementation == "eager"
    assert "forward" not in vars(router)
    with OpCounter() as ops:
        assert torch.equal(greedy(model, ids), want)
    assert ops.attention == ops.moe_route == 0


def test_family_functions_check_the_model_type():
    llama = tiny_model("llama")
    with pytest.raises(ValueError, match="mixtral"):
        rt.apply_redfuser_to_mixtral(llama)
    assert rt.apply_redfuser_to_llama(llama).attention
    assert rt.apply_redfuser_to_qwen3_moe(tiny_model("qwen3_moe")).routers == {"Qwen3MoeTopKRouter": 2}
    assert rt.apply_redfuser_to_qwen2_moe(tiny_model("qwen2_moe")).routers == {"Qwen2MoeTopKRouter": 2}
    assert rt.apply_redfuser_to_deepseek_v3(tiny_model("deepseek_v3")).routers == {"DeepseekV3TopkRouter": 2}
    # routers only: the attention stays eager
    mixtral = tiny_model("mixtral")
    report = rt.apply_redfuser_to_mixtral(mixtral, attention=False)
    assert not report.attention and mixtral.config._attn_implementation == "eager" and report.n_routers == 2


def test_padding_mask_falls_back_to_sdpa():
    # a left-padded batch: every step carries a padding mask, which fused_attention does not take
    model = tiny_model("llama")
    ids = prompt(batch=2)
    mask = torch.ones_like(ids)
    mask[0, :4] = 0
    ids = ids.masked_fill(mask == 0, 0)
    want = greedy(model, ids, mask)
    rt.apply_redfuser(model)
    rt.reset_stats()
    with OpCounter() as ops:
        got = greedy(model, ids, mask)
    assert torch.equal(got, want)
    assert ops.attention == 0
    assert ops.sdpa == layers(model) * NEW_TOKENS
    assert rt.stats() == {"attention_fallback:attention_mask": layers(model) * NEW_TOKENS}
    # the same model without padding runs the op again
    with OpCounter() as ops:
        greedy(model, ids[1:])
    assert ops.attention == layers(model) * NEW_TOKENS


def test_autograd_falls_back_and_backward_works():
    model = tiny_model("mixtral")
    rt.apply_redfuser(model)
    rt.reset_stats()
    ids = prompt(batch=1)
    with OpCounter() as ops:
        out = model(ids, labels=ids)
    assert ops.attention == ops.moe_route == 0
    out.loss.backward()
    assert model.model.layers[0].mlp.gate.weight.grad is not None
    assert rt.stats() == {"attention_fallback:autograd": 2, "moe_route_fallback:autograd": 2}
    # the loss equals the eager model's
    eager = tiny_model("mixtral")
    torch.testing.assert_close(out.loss, eager(ids, labels=ids).loss, rtol=1e-5, atol=1e-5)


def test_soft_capped_model_keeps_the_eager_answer():
    # Gemma-2 soft-caps its attention scores, which fused_attention does not do: either apply_redfuser leaves
    # its attention alone (transformers marks it _supports_sdpa = False, as 5.24 does) or every call falls
    # back to Gemma-2's own eager function; the op never runs and the tokens are eager's
    config = transformers.Gemma2Config(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                       num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                       attn_logit_softcapping=5.0, pad_token_id=0)
    torch.manual_seed(0)
    model = transformers.Gemma2ForCausalLM(config).eval()
    ids = prompt(batch=1)
    want = greedy(model, ids)
    report = rt.apply_redfuser(model)
    if model._supports_sdpa:
        assert report.attention
    else:
        assert not report.attention and "sdpa" in report.skipped[0]
        assert model.config._attn_implementation == "eager"
    rt.reset_stats()
    with OpCounter() as ops:
        assert torch.equal(greedy(model, ids), want)
    assert ops.attention == 0
    assert rt.stats() == ({"attention_fallback:softcap": layers(model) * NEW_TOKENS} if report.attention else {})


def test_softcap_call_falls_back_to_the_model_eager_function():
    # a soft-capped call that reaches the redfuser function anyway runs Gemma-2's own eager attention
    from transformers.models.gemma2 import modeling_gemma2

    config = transformers.Gemma2Config(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                       attn_logit_softcapping=5.0)
    module = modeling_gemma2.Gemma2Attention(config, layer_idx=1).eval()
    gen = torch.Generator().manual_seed(3)
    q = torch.randn(2, 4, 7, 16, generator=gen) * 3
    k, v = torch.randn(2, 2, 7, 16, generator=gen) * 3, torch.randn(2, 2, 7, 16, generator=gen)
    causal = torch.full((7, 7), torch.finfo(torch.float32).min).triu(1)[None, None]
    want, _ = modeling_gemma2.eager_attention_forward(module, q, k, v, causal, scaling=0.25, softcap=5.0)
    rt.reset_stats()
    with OpCounter() as ops:
        got, _ = rt.redfuser_attention_forward(module, q, k, v, None, scaling=0.25, softcap=5.0)
    torch.testing.assert_close(got, want)
    assert ops.attention == 0 and rt.stats() == {"attention_fallback:softcap": 1}
    # without soft-capping the same call is plain causal attention: the op runs, and agrees with sdpa
    with OpCounter() as ops:
        plain, _ = rt.redfuser_attention_forward(module, q, k, v, None, scaling=0.25)
    sdpa, _ = transformers.integrations.sdpa_attention.sdpa_attention_forward(module, q, k, v, None, scaling=0.25)
    assert ops.attention == 1
    torch.testing.assert_close(plain, sdpa, rtol=1e-5, atol=1e-5)


class _Heads(torch.nn.Module):
    def __init__(self, groups, is_causal=True):
        super().__init__()
        self.num_key_value_groups = groups
        self.is_causal = is_causal


# (B, H, Hk, Sq, Sk, Dqk, Dv, is_causal, dtype): the case each one covers
ATTENTION_CALLS = [
    (2, 4, 2, 9, 9, 16, 16, True, torch.float32),     # GQA prefill: causal
    (2, 4, 1, 1, 13, 16, 16, True, torch.float32),    # MQA decode: one query sees every key
    (1, 4, 4, 6, 11, 16, 16, True, torch.float32),    # empty static-cache prefill: sdpa's upper-left causal
    (1, 4, 4, 6, 6, 16, 16, False, torch.float32),    # bidirectional module (is_causal False)
    (2, 6, 2, 5, 5, 24, 16, True, torch.float32),     # MLA: v head dim < q/k head dim (v padded)
    (1, 4, 2, 5, 5, 8, 12, True, torch.float32),      # v head dim > q/k head dim (q, k padded)
    (2, 4, 2, 17, 17, 32, 32, True, torch.bfloat16),  # bf16
]


@pytest.mark.parametrize("B,H,Hk,Sq,Sk,Dqk,Dv,is_causal,dtype", ATTENTION_CALLS)
def test_attention_function_matches_sdpa(B, H, Hk, Sq, Sk, Dqk, Dv, is_causal, dtype):
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    gen = torch.Generator().manual_seed(B * 100 + Sq * 10 + Dqk)
    q = torch.randn(B, H, Sq, Dqk, generator=gen).to(dtype)
    k = torch.randn(B, Hk, Sk, Dqk, generator=gen).to(dtype)
    v = torch.randn(B, Hk, Sk, Dv, generator=gen).to(dtype)
    module = _Heads(H // Hk, is_causal)
    want, _ = sdpa_attention_forward(module, q.float(), k.float(), v.float(), None, scaling=Dqk**-0.5)
    plain, _ = sdpa_attention_forward(module, q, k, v, None, scaling=Dqk**-0.5)
    with OpCounter() as ops:
        got, weights = rt.redfuser_attention_forward(module, q, k, v, None, scaling=Dqk**-0.5)
    assert ops.attention == 1 and weights is None
    assert got.shape == (B, Sq, H, Dv) and got.dtype == dtype and got.is_contiguous()
    # ACCEPTANCE.md's rule against a float32 reference and the low-precision sdpa
    tol = 2 * (plain.float() - want).abs().max().item() + 1e-5
    assert (got.float() - want).abs().max().item() <= tol


def _dense(weights, ids, experts):
    return torch.zeros(ids.shape[0], experts).scatter_add_(1, ids, weights.float())


@pytest.mark.parametrize("family", ["mixtral", "qwen2_moe", "qwen3_moe", "deepseek_v3"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_router_outputs_match_the_model_router(family, dtype):
    model = tiny_model(family).to(dtype)
    router = next(m for m in model.modules() if type(m) in rt._router_classes())
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(37, model.config.hidden_size, generator=gen).to(dtype)
    with torch.no_grad():
        w_logits, w_weights, w_ids = router(x)
        rt.apply_redfuser(model)
        with OpCounter() as ops:
            g_logits, g_weights, g_ids = router(x)
    assert ops.moe_route == 1
    assert torch.equal(g_logits, w_logits)
    assert (g_weights.dtype, g_ids.dtype, g_ids.shape) == (w_weights.dtype, w_ids.dtype, w_ids.shape)
    # the same experts with the same weights (the ids' order may differ where the model's topk is unsorted)
    experts = router.num_experts
    tol = 1e-6 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(_dense(g_weights, g_ids, experts), _dense(w_weights, w_ids, experts),
                               rtol=tol, atol=tol)
    if family != "deepseek_v3":  # sorted torch.topk: descending, as moe_route
        assert torch.equal(g_ids, w_ids)


def test_router_self_check_refuses_a_mismatching_forward(monkeypatch):
    # pretend Qwen2-MoE's router always renormalises (it does not with norm_topk_prob False): the check at
    # patch time sees different weights and leaves the router alone
    model = tiny_model("qwen2_moe")
    ids = prompt(batch=1)
    want = greedy(model, ids)
    wrong = [k if k.cls != "Qwen2MoeTopKRouter" else rt._RouterKind(k.family, k.module, k.cls, rt._mixtral_route,
                                                                     k.attrs, k.bias)
             for k in rt._ROUTERS]
    monkeypatch.setattr(rt, "_ROUTERS", tuple(wrong))
    monkeypatch.setattr(rt, "_CHECKED", {})  # forget the checks of the real forwards
    report = rt.apply_redfuser(model)
    assert report.n_routers == 0 and len(report.skipped) == 2
    assert "per-expert routing weights differ" in report.skipped[0]
    with OpCounter() as ops:
        assert torch.equal(greedy(model, ids), want)
    assert ops.moe_route == 0 and ops.attention > 0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("family", ["llama", "mixtral", "deepseek_v3"])
def test_cuda_bf16_logits_close_to_sdpa(family):
    # head dim 64 (a CUDA variant of fused_attention); DeepSeek-V3's 24/16 is padded to 64
    over = {"head_dim": 64} if family != "deepseek_v3" else {}
    model = tiny_model(family, **over).to("cuda", torch.bfloat16)
    ids = prompt().cuda()
    model.set_attn_implementation("sdpa")
    with torch.no_grad():
        want = model(ids).logits.float()
    rt.apply_redfuser(model)
    with OpCounter() as ops, torch.no_grad():
        got = model(ids).logits.float()
    assert ops.attention == layers(model)
    assert (got - want).abs().max().item() <= 5e-2 * want.abs().max().item()
