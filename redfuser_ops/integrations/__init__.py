"""Integrations of redfuser's ops into model libraries.

Each integration lives in its own submodule and imports its library lazily, so that importing
``redfuser_ops`` never needs it:

- :mod:`redfuser_ops.integrations.transformers` -- Hugging Face transformers: ``fused_attention`` as an
  ``AttentionInterface`` implementation and ``moe_route`` in place of the MoE routers of DeepSeek-V3,
  Qwen2-MoE / Qwen3-MoE and Mixtral (install with ``pip install "redfuser-ops[transformers]"``).
"""

__all__ = ["transformers"]
