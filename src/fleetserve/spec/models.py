"""Model catalog.

Shapes are copied from each model's HuggingFace ``config.json`` (repository named
above each entry); ``max_context`` is its ``max_position_embeddings``. Weights and
KV are fp16/bf16 (``dtype_bytes=2``).
"""

from __future__ import annotations

from fleetserve.spec.types import ModelSpec

MODELS: dict[str, ModelSpec] = {
    # meta-llama/Llama-2-7b-hf
    "llama-2-7b": ModelSpec(
        name="llama-2-7b",
        arch="llama",
        num_layers=32,
        hidden_size=4096,
        num_heads=32,
        num_kv_heads=32,
        head_dim=128,
        intermediate_size=11008,
        vocab_size=32000,
        max_context=4096,
    ),
    # meta-llama/Llama-2-13b-hf
    "llama-2-13b": ModelSpec(
        name="llama-2-13b",
        arch="llama",
        num_layers=40,
        hidden_size=5120,
        num_heads=40,
        num_kv_heads=40,
        head_dim=128,
        intermediate_size=13824,
        vocab_size=32000,
        max_context=4096,
    ),
    # meta-llama/Llama-2-70b-hf (GQA: 8 KV heads)
    "llama-2-70b": ModelSpec(
        name="llama-2-70b",
        arch="llama",
        num_layers=80,
        hidden_size=8192,
        num_heads=64,
        num_kv_heads=8,
        head_dim=128,
        intermediate_size=28672,
        vocab_size=32000,
        max_context=4096,
    ),
    # huggyllama/llama-30b (LLaMA-1 "30B", 32.5B parameters)
    "llama-30b": ModelSpec(
        name="llama-30b",
        arch="llama",
        num_layers=60,
        hidden_size=6656,
        num_heads=52,
        num_kv_heads=52,
        head_dim=128,
        intermediate_size=17920,
        vocab_size=32000,
        max_context=2048,
    ),
    # huggyllama/llama-65b
    "llama-65b": ModelSpec(
        name="llama-65b",
        arch="llama",
        num_layers=80,
        hidden_size=8192,
        num_heads=64,
        num_kv_heads=64,
        head_dim=128,
        intermediate_size=22016,
        vocab_size=32000,
        max_context=2048,
    ),
    # meta-llama/Llama-3.1-8B
    "llama-3.1-8b": ModelSpec(
        name="llama-3.1-8b",
        arch="llama",
        num_layers=32,
        hidden_size=4096,
        num_heads=32,
        num_kv_heads=8,
        head_dim=128,
        intermediate_size=14336,
        vocab_size=128256,
        max_context=131072,
    ),
    # meta-llama/Llama-3.1-70B
    "llama-3.1-70b": ModelSpec(
        name="llama-3.1-70b",
        arch="llama",
        num_layers=80,
        hidden_size=8192,
        num_heads=64,
        num_kv_heads=8,
        head_dim=128,
        intermediate_size=28672,
        vocab_size=128256,
        max_context=131072,
    ),
    # meta-llama/Llama-3.2-90B-Vision, text part (``text_config``). The text decoder has
    # num_hidden_layers=100, of which 20 (``cross_attention_layers`` = 3, 8, ..., 98) are
    # cross-attention layers. Choice: num_layers=100 so the weights of all 100 layers are
    # counted (each cross-attention layer is counted as a self-attention-sized layer, which
    # misses only its q/k norms and 2 gate scalars), and cross_attn_layers=20 so per-token
    # KV covers only the 80 self-attention layers: cross-attention KV belongs to the image
    # tokens (fixed per image, not per text token) and text-only requests skip those layers.
    # The vision encoder (~0.9B parameters) is not modelled.
    "llama-3.2-90b": ModelSpec(
        name="llama-3.2-90b",
        arch="llama",
        num_layers=100,
        hidden_size=8192,
        num_heads=64,
        num_kv_heads=8,
        head_dim=128,
        intermediate_size=28672,
        vocab_size=128256,
        max_context=131072,
        cross_attn_layers=20,
    ),
    # Qwen/Qwen2.5-14B (q/k/v biases)
    "qwen-2.5-14b": ModelSpec(
        name="qwen-2.5-14b",
        arch="qwen2",
        num_layers=48,
        hidden_size=5120,
        num_heads=40,
        num_kv_heads=8,
        head_dim=128,
        intermediate_size=13824,
        vocab_size=152064,
        max_context=131072,
    ),
    # Qwen/Qwen2.5-72B
    "qwen-2.5-72b": ModelSpec(
        name="qwen-2.5-72b",
        arch="qwen2",
        num_layers=80,
        hidden_size=8192,
        num_heads=64,
        num_kv_heads=8,
        head_dim=128,
        intermediate_size=29568,
        vocab_size=152064,
        max_context=131072,
    ),
    # facebook/opt-6.7b (ffn_dim=16384; tie_word_embeddings defaults to true)
    "opt-6.7b": ModelSpec(
        name="opt-6.7b",
        arch="opt",
        num_layers=32,
        hidden_size=4096,
        num_heads=32,
        num_kv_heads=32,
        head_dim=128,
        intermediate_size=16384,
        vocab_size=50272,
        max_context=2048,
        tied_embeddings=True,
    ),
}
