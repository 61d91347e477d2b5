"""Tests of fleetserve.spec: catalogs, HF config loading and memory math."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fleetserve.errors import ConfigError, InputError, UnknownNameError
from fleetserve.spec import (
    GPUS,
    MODELS,
    GpuSpec,
    ModelSpec,
    fits,
    get_gpu,
    get_model,
    kv_capacity_blocks,
    kv_capacity_bytes,
    kv_capacity_tokens,
    load_hf_config,
    min_tp,
    weight_bytes_per_gpu,
)

GiB = 2**30

# --- catalogs ----------------------------------------------------------------

GPU_NAMES = [
    "a100-40gb",
    "a100-80gb",
    "a800-80gb",
    "h100-80gb",
    "h200-141gb",
    "rtx4090-24gb",
    "v100-32gb",
    "l4-24gb",
]
MODEL_NAMES = [
    "llama-2-7b",
    "llama-2-13b",
    "llama-2-70b",
    "llama-30b",
    "llama-65b",
    "llama-3.1-8b",
    "llama-3.1-70b",
    "llama-3.2-90b",
    "qwen-2.5-14b",
    "qwen-2.5-72b",
    "opt-6.7b",
]


def test_catalog_names_exact() -> None:
    assert sorted(GPUS) == sorted(GPU_NAMES)
    assert sorted(MODELS) == sorted(MODEL_NAMES)
    for name, g in GPUS.items():
        assert g.name == name
        assert get_gpu(name) is g
    for name, m in MODELS.items():
        assert m.name == name
        assert get_model(name) is m


def test_gpu_figures() -> None:
    a100 = get_gpu("a100-40gb")
    assert a100.hbm_bytes == 40 * GiB == 42_949_672_960
    assert a100.bf16_flops == pytest.approx(312e12)
    assert get_gpu("h100-80gb").bf16_flops == pytest.approx(989.4e12)
    assert get_gpu("rtx4090-24gb").intra_node_link == "pcie"
    assert get_gpu("l4-24gb").intra_node_link == "pcie"
    assert get_gpu("a800-80gb").intra_node_bw < get_gpu("a100-80gb").intra_node_bw
    for g in GPUS.values():
        assert g.intra_node_bw > g.network_bw  # a node's links beat the network


def test_lookup_case_insensitive() -> None:
    assert get_gpu("A100-40GB").name == "a100-40gb"
    assert get_model("LLaMA-2-13B").name == "llama-2-13b"


def test_unknown_gpu_suggests() -> None:
    with pytest.raises(UnknownNameError) as ei:
        get_gpu("a100-40")
    assert "a100-40gb" in str(ei.value)
    assert "GPU" in str(ei.value)


def test_unknown_model_suggests() -> None:
    with pytest.raises(UnknownNameError) as ei:
        get_model("llama2-13b")
    assert "'llama-2-13b'" in str(ei.value)
    with pytest.raises(UnknownNameError):
        get_model("/no/such/dir/config.json")


# --- model math ----------------------------------------------------------------


def test_llama2_13b_kv_per_token() -> None:
    # 2 (K, V) x 40 layers x 40 heads x 128 dims x 2 bytes = 819,200 B ~ 0.8 MB
    assert get_model("llama-2-13b").kv_bytes_per_token == 819_200


def test_mell_section3_llama13b_on_a100_40gb() -> None:
    """Mell §III: LLaMA-13B on an A100-40GB holds about 5 requests of 4,096 tokens."""
    m, g = get_model("llama-2-13b"), get_gpu("a100-40gb")
    assert m.weight_bytes / GiB == pytest.approx(24, abs=0.5)  # "roughly 24 GB"
    per_request = 4096 * m.kv_bytes_per_token
    assert per_request / GiB == pytest.approx(3.2, rel=0.05)  # "3.2 GB" (3.125 GiB)
    assert per_request / 1e9 == pytest.approx(3.2, rel=0.05)  # (3.36 GB)
    assert kv_capacity_tokens(m, g, mem_util=1.0) // 4096 == 5


@pytest.mark.parametrize(
    ("name", "published"),
    [
        ("llama-2-7b", 6.74e9),
        ("llama-2-13b", 13.0e9),
        ("llama-2-70b", 69.0e9),
        ("llama-3.1-8b", 8.03e9),
        ("llama-3.1-70b", 70.6e9),
        ("qwen-2.5-14b", 14.7e9),
        ("qwen-2.5-72b", 72.7e9),
        ("opt-6.7b", 6.7e9),
        ("llama-30b", 32.5e9),
        ("llama-65b", 65.2e9),
        # 88.6B published for the whole vision model; the vision encoder is not modelled.
        ("llama-3.2-90b", 88.6e9),
    ],
)
def test_param_counts(name: str, published: float) -> None:
    assert get_model(name).num_params == pytest.approx(published, rel=0.02)


def test_llama_3_2_90b_kv_counts_self_attention_layers_only() -> None:
    m = get_model("llama-3.2-90b")
    assert m.num_layers == 100
    assert m.cross_attn_layers == 20
    assert m.kv_layers == 80
    assert m.kv_bytes_per_token == 80 * 2 * 8 * 128 * 2
    # weights cover all 100 layers
    assert m.weight_bytes == pytest.approx(100 * m.weight_bytes_per_layer, rel=0.03)


def test_cross_attn_layers_validated() -> None:
    base = get_model("llama-2-7b")
    with pytest.raises(ConfigError):
        dataclasses.replace(base, cross_attn_layers=32)
    with pytest.raises(ConfigError):
        dataclasses.replace(base, cross_attn_layers=-1)


# --- HF config loading -----------------------------------------------------------

LLAMA_2_13B_CONFIG: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"],
    "bos_token_id": 1,
    "eos_token_id": 2,
    "hidden_act": "silu",
    "hidden_size": 5120,
    "initializer_range": 0.02,
    "intermediate_size": 13824,
    "max_position_embeddings": 4096,
    "model_type": "llama",
    "num_attention_heads": 40,
    "num_hidden_layers": 40,
    "num_key_value_heads": 40,
    "pretraining_tp": 1,
    "rms_norm_eps": 1e-05,
    "rope_scaling": None,
    "tie_word_embeddings": False,
    "torch_dtype": "float16",
    "vocab_size": 32000,
}
QWEN_2_5_14B_CONFIG: dict[str, Any] = {
    "architectures": ["Qwen2ForCausalLM"],
    "hidden_act": "silu",
    "hidden_size": 5120,
    "intermediate_size": 13824,
    "max_position_embeddings": 131072,
    "max_window_layers": 48,
    "model_type": "qwen2",
    "num_attention_heads": 40,
    "num_hidden_layers": 48,
    "num_key_value_heads": 8,
    "rms_norm_eps": 1e-05,
    "rope_theta": 1000000.0,
    "sliding_window": 131072,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "use_sliding_window": False,
    "vocab_size": 152064,
}
OPT_6_7B_CONFIG: dict[str, Any] = {
    "activation_function": "relu",
    "architectures": ["OPTForCausalLM"],
    "do_layer_norm_before": True,
    "ffn_dim": 16384,
    "hidden_size": 4096,
    "max_position_embeddings": 2048,
    "model_type": "opt",
    "num_attention_heads": 32,
    "num_hidden_layers": 32,
    "torch_dtype": "float16",
    "vocab_size": 50272,
    "word_embed_proj_dim": 4096,
}
MLLAMA_90B_CONFIG: dict[str, Any] = {
    "architectures": ["MllamaForConditionalGeneration"],
    "model_type": "mllama",
    "text_config": {
        "model_type": "mllama_text_model",
        "cross_attention_layers": list(range(3, 100, 5)),
        "hidden_size": 8192,
        "intermediate_size": 28672,
        "max_position_embeddings": 131072,
        "num_attention_heads": 64,
        "num_hidden_layers": 100,
        "num_key_value_heads": 8,
        "tie_word_embeddings": False,
        "vocab_size": 128256,
    },
    "vision_config": {"hidden_size": 1280},
}


def _write(tmp_path: Path, cfg: dict[str, Any] | str, sub: str = "m") -> Path:
    folder = tmp_path / sub
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "config.json"
    path.write_text(cfg if isinstance(cfg, str) else json.dumps(cfg), encoding="utf-8")
    return path


def _same_shape(a: ModelSpec, b: ModelSpec) -> bool:
    return dataclasses.replace(a, name="x") == dataclasses.replace(b, name="x")


@pytest.mark.parametrize(
    ("cfg", "catalog"),
    [
        (LLAMA_2_13B_CONFIG, "llama-2-13b"),
        (QWEN_2_5_14B_CONFIG, "qwen-2.5-14b"),
        (OPT_6_7B_CONFIG, "opt-6.7b"),
        (MLLAMA_90B_CONFIG, "llama-3.2-90b"),
    ],
)
def test_hf_loader_matches_catalog(tmp_path: Path, cfg: dict[str, Any], catalog: str) -> None:
    path = _write(tmp_path, cfg)
    spec = load_hf_config(path)
    assert spec.name == str(path)
    assert _same_shape(spec, get_model(catalog))
    # folder path, and through get_model (str and Path)
    assert _same_shape(load_hf_config(path.parent), spec)
    assert _same_shape(get_model(str(path.parent)), spec)
    assert _same_shape(get_model(path), spec)


def test_hf_defaults(tmp_path: Path) -> None:
    cfg = dict(LLAMA_2_13B_CONFIG)
    del cfg["num_key_value_heads"]  # defaults to num_attention_heads
    del cfg["tie_word_embeddings"]  # llama default: false
    spec = load_hf_config(_write(tmp_path, cfg))
    assert spec.num_kv_heads == 40
    assert spec.head_dim == 128  # hidden / heads
    assert spec.tied_embeddings is False
    cfg["head_dim"] = 64
    assert load_hf_config(_write(tmp_path, cfg, "b")).head_dim == 64
    # model_type missing but architectures given
    cfg2 = dict(QWEN_2_5_14B_CONFIG)
    del cfg2["model_type"]
    assert load_hf_config(_write(tmp_path, cfg2, "c")).arch == "qwen2"


def test_hf_missing_field(tmp_path: Path) -> None:
    cfg = dict(LLAMA_2_13B_CONFIG)
    del cfg["intermediate_size"]
    path = _write(tmp_path, cfg)
    with pytest.raises(InputError) as ei:
        load_hf_config(path)
    assert str(path) in str(ei.value)
    assert "intermediate_size" in str(ei.value)
    assert ei.value.field == "intermediate_size"
    assert ei.value.file == str(path)


def test_hf_opt_needs_ffn_dim(tmp_path: Path) -> None:
    cfg = dict(OPT_6_7B_CONFIG)
    del cfg["ffn_dim"]
    with pytest.raises(InputError, match="ffn_dim"):
        load_hf_config(_write(tmp_path, cfg))


@pytest.mark.parametrize("bad", [0, -4, "40", 40.5, True])
def test_hf_invalid_field(tmp_path: Path, bad: object) -> None:
    cfg = dict(LLAMA_2_13B_CONFIG, num_hidden_layers=bad)
    with pytest.raises(InputError, match="num_hidden_layers"):
        load_hf_config(_write(tmp_path, cfg))


def test_hf_bad_gqa_ratio(tmp_path: Path) -> None:
    cfg = dict(LLAMA_2_13B_CONFIG, num_key_value_heads=3)
    path = _write(tmp_path, cfg)
    with pytest.raises(InputError) as ei:
        load_hf_config(path)
    assert str(path) in str(ei.value)
    assert ei.value.field == "num_key_value_heads"


def test_hf_not_json(tmp_path: Path) -> None:
    path = _write(tmp_path, "{ this is not json")
    with pytest.raises(InputError) as ei:
        load_hf_config(path)
    assert str(path) in str(ei.value)
    assert "JSON" in str(ei.value)
    with pytest.raises(InputError, match="JSON object"):
        load_hf_config(_write(tmp_path, "[1, 2]", "list"))


def test_hf_unsupported_model_type(tmp_path: Path) -> None:
    cfg = dict(LLAMA_2_13B_CONFIG, model_type="gpt2", architectures=["GPT2LMHeadModel"])
    with pytest.raises(InputError) as ei:
        load_hf_config(_write(tmp_path, cfg))
    msg = str(ei.value)
    assert "gpt2" in msg
    for supported in ("llama", "qwen2", "opt"):
        assert supported in msg


def test_hf_missing_file(tmp_path: Path) -> None:
    with pytest.raises(InputError, match=r"config\.json"):
        load_hf_config(tmp_path)  # folder without config.json


# --- memory math -------------------------------------------------------------------


def test_weight_bytes_per_gpu() -> None:
    m = get_model("llama-2-13b")
    assert weight_bytes_per_gpu(m, 1) == m.weight_bytes
    assert weight_bytes_per_gpu(m, 3) == math.ceil(m.weight_bytes / 3)
    with pytest.raises(ConfigError):
        weight_bytes_per_gpu(m, 0)


def test_kv_capacity_formula() -> None:
    m, g = get_model("llama-2-7b"), get_gpu("a100-80gb")
    budget = math.floor(g.hbm_bytes * 0.9)
    expected = 2 * (budget - math.ceil(m.weight_bytes / 2))
    assert kv_capacity_bytes(m, g, tp=2) == expected
    assert kv_capacity_tokens(m, g, tp=2) == expected // m.kv_bytes_per_token
    assert kv_capacity_blocks(m, g, tp=2) == expected // m.kv_bytes_per_token // 16
    assert kv_capacity_blocks(m, g, tp=2, block_size=32) == (expected // m.kv_bytes_per_token // 32)
    with pytest.raises(ConfigError):
        kv_capacity_blocks(m, g, block_size=0)


@pytest.mark.parametrize(("tp", "mem_util"), [(0, 0.9), (-1, 0.9), (1, 0.0), (1, 1.01), (1, -0.5)])
def test_capacity_argument_validation(tp: int, mem_util: float) -> None:
    m, g = get_model("llama-2-7b"), get_gpu("a100-80gb")
    with pytest.raises(ConfigError):
        kv_capacity_bytes(m, g, tp=tp, mem_util=mem_util)
    with pytest.raises(ConfigError):
        fits(m, g, tp=tp, mem_util=mem_util)


def test_70b_on_one_a100_40gb_does_not_fit() -> None:
    m, g = get_model("llama-2-70b"), get_gpu("a100-40gb")
    assert not fits(m, g)
    with pytest.raises(ConfigError) as ei:
        kv_capacity_bytes(m, g)
    msg = str(ei.value)
    assert "llama-2-70b" in msg
    assert "a100-40gb" in msg
    assert "138.0 GB" in msg
    assert "38.7 GB" in msg
    assert "tp >= 4" in msg
    assert "\n" not in msg
    with pytest.raises(ConfigError):
        kv_capacity_tokens(m, g)


def test_min_tp_70b_a100_40gb() -> None:
    m, g = get_model("llama-2-70b"), get_gpu("a100-40gb")
    # Arithmetic: 68.98e9 params x 2 B = 137.95e9 B of weights. Each GPU offers
    # floor(40 GiB x 0.9) = 38,654,705,664 B: 2 GPUs 77.3e9 (too little), 4 GPUs 154.6e9.
    per_gpu = math.floor(40 * GiB * 0.9)
    assert per_gpu == 38_654_705_664
    assert 2 * per_gpu < m.weight_bytes < 4 * per_gpu
    assert min_tp(m, g) == 4
    assert not fits(m, g, tp=2)
    assert fits(m, g, tp=4)
    assert kv_capacity_bytes(m, g, tp=4) == 4 * per_gpu - 4 * math.ceil(m.weight_bytes / 4)
    assert min_tp(get_model("llama-2-7b"), g) == 1


def test_min_tp_none_fits() -> None:
    with pytest.raises(ConfigError, match=r"llama-3\.2-90b"):
        min_tp(get_model("llama-3.2-90b"), get_gpu("l4-24gb"), max_tp=4)


def test_kv_replicated_when_tp_exceeds_kv_heads() -> None:
    m, g = get_model("llama-2-70b"), get_gpu("a100-80gb")
    assert kv_capacity_tokens(m, g, tp=16) == kv_capacity_bytes(m, g, tp=16) // (
        2 * m.kv_bytes_per_token
    )


def _tokens_or_minus_one(model: ModelSpec, gpu: GpuSpec, tp: int, mem_util: float) -> int:
    if not fits(model, gpu, tp, mem_util):
        with pytest.raises(ConfigError):
            kv_capacity_tokens(model, gpu, tp, mem_util)
        return -1
    return kv_capacity_tokens(model, gpu, tp, mem_util)


@settings(max_examples=200, deadline=None)
@given(
    model=st.sampled_from(sorted(MODELS)),
    gpu=st.sampled_from(sorted(GPUS)),
    tp=st.sampled_from([1, 2, 4, 8, 16]),
    tp_step=st.sampled_from([1, 2, 4]),
    mem_util=st.floats(min_value=0.05, max_value=1.0),
    mu_step=st.floats(min_value=0.0, max_value=0.95),
)
def test_capacity_monotone_in_tp_and_mem_util(
    model: str, gpu: str, tp: int, tp_step: int, mem_util: float, mu_step: float
) -> None:
    m, g = MODELS[model], GPUS[gpu]
    base = _tokens_or_minus_one(m, g, tp, mem_util)
    assert _tokens_or_minus_one(m, g, tp * tp_step, mem_util) >= base
    more_mu = min(1.0, mem_util + mu_step)
    assert _tokens_or_minus_one(m, g, tp, more_mu) >= base
