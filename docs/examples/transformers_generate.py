"""Greedy generation with small random-weight transformers models, eager vs sdpa vs redfuser.

Builds each model from transformers' own config class (seeded random weights, nothing downloaded),
generates with the model's eager attention, with transformers' sdpa, and after
``apply_redfuser(model)`` (fused_attention + moe_route), checks that all three give the same tokens and
prints a markdown table of the prefill time and the time per decoded token.

    python docs/examples/transformers_generate.py                 # CPU, 1 thread
    python docs/examples/transformers_generate.py --device cuda   # on a GPU (bf16)

Times are the minimum over --repeats runs (the runs of the three implementations are interleaved), so
that a shared machine's noise shows up as little as possible; the decode time per token is
(t(prefill + N tokens) - t(prefill + 1 token)) / (N - 1).
"""

from __future__ import annotations

import argparse
import platform
import time

import torch
import transformers

from redfuser_ops.integrations.transformers import (
    apply_redfuser,
    reset_stats,
    revert_redfuser,
    stats,
)

VOCAB = 1024
# name -> (config class, model class, config): small enough for a CPU, large enough that attention and
# routing are a visible part of a step. Llama: GQA 16/4 heads of 64; the MoE models: one dense layer
# where their config has one, then MoE layers.
MODELS = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", {
        "hidden_size": 1024, "intermediate_size": 2048, "num_hidden_layers": 4,
        "num_attention_heads": 16, "num_key_value_heads": 4}),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", {
        "hidden_size": 512, "intermediate_size": 512, "num_hidden_layers": 4, "num_attention_heads": 8,
        "num_key_value_heads": 2, "num_local_experts": 8, "num_experts_per_tok": 2}),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", {
        "hidden_size": 512, "intermediate_size": 1024, "moe_intermediate_size": 256, "num_hidden_layers": 4,
        "num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 64, "num_experts": 64,
        "num_experts_per_tok": 8, "norm_topk_prob": True}),
    "deepseek_v3": ("DeepseekV3Config", "DeepseekV3ForCausalLM", {
        "hidden_size": 512, "intermediate_size": 1024, "moe_intermediate_size": 128, "num_hidden_layers": 4,
        "first_k_dense_replace": 1, "num_attention_heads": 8, "num_key_value_heads": 8, "n_routed_experts": 64,
        "num_experts_per_tok": 8, "n_group": 8, "topk_group": 4, "routed_scaling_factor": 2.5,
        "q_lora_rank": 128, "kv_lora_rank": 128, "qk_rope_head_dim": 32, "qk_nope_head_dim": 64,
        "v_head_dim": 64}),
}


def build(name: str, device: str, dtype: torch.dtype):
    cfg_name, model_name, kw = MODELS[name]
    config = getattr(transformers, cfg_name)(vocab_size=VOCAB, max_position_embeddings=4096, pad_token_id=0, **kw)
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    return getattr(transformers, model_name)(config).to(device, dtype).eval()


def generate(model, ids, n: int):
    with torch.no_grad():
        return model.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0)


def timed(model, ids, n: int) -> float:
    if ids.is_cuda:
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    generate(model, ids, n)
    if ids.is_cuda:
        torch.cuda.synchronize()
    return time.perf_counter() - t0


def use(model, impl: str) -> None:
    revert_redfuser(model)
    if impl == "redfuser":
        report = apply_redfuser(model)
        assert report.attention and not report.skipped, report
    else:
        model.set_attn_implementation(impl)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--threads", type=int, default=1, help="torch CPU threads (default 1)")
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--prompt", type=int, default=512, help="prompt length")
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    dtype = torch.float32 if args.device == "cpu" else torch.bfloat16
    impls = ("eager", "sdpa", "redfuser")

    print(f"torch {torch.__version__}, transformers {transformers.__version__}, {platform.processor() or platform.machine()}, "
          f"device {args.device}, {args.threads} thread(s), {dtype}, batch {args.batch}, prompt {args.prompt}, "
          f"{args.new_tokens} new tokens, min of {args.repeats}")
    print()
    print("| model | attention | prefill ms | decode ms/token | vs eager | same tokens as eager |")
    print("|---|---|---:|---:|---:|---|")
    for name in args.models.split(","):
        model = build(name, args.device, dtype)
        reset_stats()
        gen = torch.Generator().manual_seed(1)
        ids = torch.randint(1, VOCAB, (args.batch, args.prompt), generator=gen).to(args.device)
        tokens, prefill, total = {}, {i: [] for i in impls}, {i: [] for i in impls}
        for impl in impls:  # warm-up and the tokens
            use(model, impl)
            tokens[impl] = generate(model, ids, args.new_tokens)
        for _ in range(args.repeats):
            for impl in impls:
                use(model, impl)
                prefill[impl].append(timed(model, ids, 1))
                total[impl].append(timed(model, ids, args.new_tokens))
        revert_redfuser(model)
        decode = {i: (min(total[i]) - min(prefill[i])) / (args.new_tokens - 1) for i in impls}
        for impl in impls:
            same = "yes" if torch.equal(tokens[impl], tokens["eager"]) else "NO"
            print(f"| {name} | {impl} | {1e3 * min(prefill[impl]):.1f} | {1e3 * decode[impl]:.2f} | "
                  f"{decode['eager'] / decode[impl]:.2f}x | {same} |")
    print()
    print(f"redfuser calls in the {name} runs:", stats())


if __name__ == "__main__":
    main()
