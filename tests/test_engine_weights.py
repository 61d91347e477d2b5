"""Engine weight sources: seeded random weights, safetensors checkpoints, HF parity."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    import torch
else:
    torch = pytest.importorskip("torch")

from fleetserve.errors import ConfigError, InputError
from fleetserve.runtime.engine.config import (
    BUILTIN_MODELS,
    EngineModelConfig,
    RopeScaling,
    builtin_config,
    load_config,
)
from fleetserve.runtime.engine.model import dense_forward, layer_shapes
from fleetserve.runtime.engine.weights import (
    RandomWeights,
    SafetensorsCheckpoint,
    engine_names,
    hf_name,
    layer_tensors,
    load_weight_source,
    model_weights,
    save_checkpoint,
)
from fleetserve.spec.types import ModelSpec

safetensors_torch = pytest.importorskip("safetensors.torch")


def tiny_cfg(
    arch: str = "llama",
    *,
    tied: bool = False,
    bias: bool = False,
    scaling: RopeScaling | None = None,
    layers: int = 2,
) -> EngineModelConfig:
    spec = ModelSpec(
        name=f"test-{arch}",
        arch=arch,  # type: ignore[arg-type]
        num_layers=layers,
        hidden_size=64,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        intermediate_size=128,
        vocab_size=300,
        max_context=512,
        tied_embeddings=tied,
        dtype_bytes=4,
    )
    return EngineModelConfig(
        spec=spec,
        rope_theta=5000.0,
        rms_norm_eps=1e-5,
        attention_bias=bias,
        rope_scaling=scaling,
        bos_token_id=1,
        eos_token_ids=(2,),
    )


LLAMA3 = RopeScaling(
    factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=32
)
CASES = {
    "llama": tiny_cfg(),
    "qwen2": tiny_cfg("qwen2", bias=True),
    "tied": tiny_cfg(tied=True),
    # head_dim 16, theta 5000, original context 32: the low, smoothed and
    # high frequency bands of llama3 scaling are all present; 40 tokens > 32.
    "llama3": tiny_cfg(scaling=LLAMA3),
    "llama-attention-bias": tiny_cfg(bias=True),
}


def token_ids(n: int = 40, vocab: int = 300) -> list[int]:
    g = torch.Generator().manual_seed(0)
    return torch.randint(0, vocab, (n,), generator=g).tolist()


def ours(folder: Path) -> torch.Tensor:
    ck = SafetensorsCheckpoint(folder)
    with torch.no_grad():
        return dense_forward(ck.cfg, model_weights(ck), token_ids())


def hf_logits(folder: Path, arch: str) -> torch.Tensor:
    transformers = pytest.importorskip("transformers")
    cls = transformers.Qwen2ForCausalLM if arch == "qwen2" else transformers.LlamaForCausalLM
    m = cls.from_pretrained(folder, dtype=torch.float32, attn_implementation="eager").eval()
    with torch.no_grad():
        return m(torch.tensor([token_ids()])).logits[0]


# --- HuggingFace parity -----------------------------------------------------------------


@pytest.mark.parametrize("case", sorted(CASES))
def test_checkpoint_matches_transformers(tmp_path: Path, case: str) -> None:
    cfg = CASES[case]
    save_checkpoint(tmp_path, RandomWeights(cfg, seed=7))
    loaded = SafetensorsCheckpoint(tmp_path).cfg
    assert loaded.rope_theta == cfg.rope_theta
    assert loaded.rope_scaling == cfg.rope_scaling
    assert loaded.attention_bias == cfg.attention_bias
    assert loaded.spec.tied_embeddings == cfg.spec.tied_embeddings
    a = ours(tmp_path)
    b = hf_logits(tmp_path, cfg.spec.arch)
    assert a.shape == b.shape == (40, 300)
    assert a.abs().max() > 1.0  # not a degenerate comparison
    assert (a - b).abs().max().item() <= 1e-4


def test_llama3_scaling_changes_logits(tmp_path: Path) -> None:
    save_checkpoint(tmp_path / "plain", RandomWeights(CASES["llama"], seed=7))
    save_checkpoint(tmp_path / "scaled", RandomWeights(CASES["llama3"], seed=7))
    assert (ours(tmp_path / "plain") - ours(tmp_path / "scaled")).abs().max() > 1e-3


def test_reads_transformers_saved_sharded_checkpoint(tmp_path: Path) -> None:
    """transformers 5 writes rope_parameters (not rope_theta) and an index of shards."""
    transformers = pytest.importorskip("transformers")
    hf_cfg = transformers.LlamaConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=300,
        rope_theta=50000.0,
        rms_norm_eps=1e-5,
        rope_scaling={
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 32,
        },
        tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    m = transformers.LlamaForCausalLM(hf_cfg).eval()
    m.save_pretrained(tmp_path, max_shard_size="100KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    ck = SafetensorsCheckpoint(tmp_path)
    assert ck.cfg.rope_theta == 50000.0
    assert ck.cfg.rope_scaling == RopeScaling(8.0, 1.0, 4.0, 32)
    assert ck.cfg.spec.tied_embeddings
    with torch.no_grad():
        ref = m(torch.tensor([token_ids()])).logits[0]
        got = dense_forward(ck.cfg, model_weights(ck), token_ids())
    assert (got - ref).abs().max().item() <= 1e-4


def test_load_config_rope_parameters(tmp_path: Path) -> None:
    cfg = {
        "model_type": "qwen2",
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "vocab_size": 300,
        "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0},
    }
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    c = load_config(tmp_path)
    assert c.rope_theta == 1e6 and c.rope_scaling is None
    assert c.attention_bias and c.rms_norm_eps == 1e-6
    cfg["rope_parameters"] = {"rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match=r"yarn"):
        load_config(tmp_path)


# --- checkpoint layouts -----------------------------------------------------------------


def test_tied_checkpoint_has_no_lm_head(tmp_path: Path) -> None:
    cfg = CASES["tied"]
    src = RandomWeights(cfg, seed=3)
    assert torch.equal(src.tensor("lm_head"), src.tensor("embed"))
    save_checkpoint(tmp_path, src)
    saved = safetensors_torch.load_file(str(tmp_path / "model.safetensors"))
    assert "lm_head.weight" not in saved
    w = model_weights(SafetensorsCheckpoint(tmp_path))
    assert w.lm_head is w.embed


def test_several_files_without_index(tmp_path: Path) -> None:
    cfg = CASES["qwen2"]
    src = RandomWeights(cfg, seed=5)
    save_checkpoint(tmp_path, src)
    tensors = safetensors_torch.load_file(str(tmp_path / "model.safetensors"))
    (tmp_path / "model.safetensors").unlink()
    names = sorted(tensors)
    half = len(names) // 2
    safetensors_torch.save_file(
        {n: tensors[n] for n in names[:half]}, str(tmp_path / "a.safetensors")
    )
    safetensors_torch.save_file(
        {n: tensors[n] for n in names[half:]}, str(tmp_path / "b.safetensors")
    )
    ck = SafetensorsCheckpoint(tmp_path)
    for name in engine_names(cfg):
        assert torch.equal(ck.tensor(name), src.tensor(name)), name


def test_half_precision_checkpoint_comes_back_fp32(tmp_path: Path) -> None:
    cfg = CASES["llama"]
    save_checkpoint(tmp_path, RandomWeights(cfg, seed=5))
    f = str(tmp_path / "model.safetensors")
    safetensors_torch.save_file(
        {k: v.to(torch.bfloat16) for k, v in safetensors_torch.load_file(f).items()}, f
    )
    t = SafetensorsCheckpoint(tmp_path).tensor("layers.1.q")
    assert t.dtype == torch.float32 and t.shape == (64, 64)


# --- bad inputs -------------------------------------------------------------------------


def _rewrite(folder: Path, edit: dict[str, torch.Tensor | None]) -> None:
    f = str(folder / "model.safetensors")
    tensors = safetensors_torch.load_file(f)
    for k, v in edit.items():
        if v is None:
            del tensors[k]
        else:
            tensors[k] = v
    safetensors_torch.save_file(tensors, f)


def test_missing_tensor_names_folder_and_tensor(tmp_path: Path) -> None:
    save_checkpoint(tmp_path, RandomWeights(CASES["llama"], seed=1))
    _rewrite(tmp_path, {"model.layers.1.mlp.up_proj.weight": None})
    ck = SafetensorsCheckpoint(tmp_path)
    ck.tensor("layers.0.up")  # others still load
    with pytest.raises(InputError) as e:
        ck.tensor("layers.1.up")
    assert str(tmp_path) in str(e.value)
    assert "model.layers.1.mlp.up_proj.weight" in str(e.value)


def test_missing_lm_head_when_untied(tmp_path: Path) -> None:
    save_checkpoint(tmp_path, RandomWeights(CASES["llama"], seed=1))
    _rewrite(tmp_path, {"lm_head.weight": None})
    with pytest.raises(InputError, match=r"lm_head.weight"):
        model_weights(SafetensorsCheckpoint(tmp_path))


def test_wrong_shape_names_file_tensor_and_shapes(tmp_path: Path) -> None:
    save_checkpoint(tmp_path, RandomWeights(CASES["llama"], seed=1))
    _rewrite(tmp_path, {"model.layers.0.self_attn.k_proj.weight": torch.zeros(64, 64)})
    with pytest.raises(InputError) as e:
        SafetensorsCheckpoint(tmp_path).tensor("layers.0.k")
    msg = str(e.value)
    assert "model.safetensors" in msg
    assert "model.layers.0.self_attn.k_proj.weight" in msg
    assert "[64, 64]" in msg and "[32, 64]" in msg


def test_no_safetensors_files(tmp_path: Path) -> None:
    save_checkpoint(tmp_path, RandomWeights(CASES["llama"], seed=1))
    (tmp_path / "model.safetensors").unlink()
    with pytest.raises(InputError, match=r"no \*\.safetensors"):
        SafetensorsCheckpoint(tmp_path)


def test_index_naming_missing_shard(tmp_path: Path) -> None:
    save_checkpoint(tmp_path, RandomWeights(CASES["llama"], seed=1))
    index = {"weight_map": {"model.embed_tokens.weight": "model-00001-of-00002.safetensors"}}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(InputError, match=r"model-00001-of-00002.safetensors"):
        SafetensorsCheckpoint(tmp_path)


def test_nonzero_llama_o_proj_bias_is_refused(tmp_path: Path) -> None:
    save_checkpoint(tmp_path, RandomWeights(CASES["llama-attention-bias"], seed=1))
    ck = SafetensorsCheckpoint(tmp_path)
    ck.tensor("layers.0.o")  # zero bias: fine
    _rewrite(tmp_path, {"model.layers.0.self_attn.o_proj.bias": torch.ones(64)})
    with pytest.raises(ConfigError, match=r"o_proj.bias"):
        SafetensorsCheckpoint(tmp_path).tensor("layers.0.o")


def test_qwen2_without_bias_cannot_be_saved(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"attention_bias"):
        save_checkpoint(tmp_path, RandomWeights(tiny_cfg("qwen2", bias=False), seed=1))


def test_unknown_names(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as e:
        load_weight_source("tiny-llama-z")
    assert "tiny-llama-a" in str(e.value) and "tiny-llama-b" in str(e.value)
    with pytest.raises(ConfigError, match=r"tiny-llama-a"):
        load_weight_source(tmp_path / "nope")
    with pytest.raises(InputError, match=r"config.json"):
        load_weight_source(tmp_path)  # a folder without a checkpoint
    src = RandomWeights(CASES["llama"], seed=1)
    for bad in ("layers.2.q", "layers.0.q_bias", "layers.0.wq", "embedding", "layers.x.q"):
        with pytest.raises(KeyError, match=r"test-llama"):
            src.tensor(bad)


# --- random weights ---------------------------------------------------------------------


def test_random_weights_deterministic_and_order_independent() -> None:
    cfg = CASES["qwen2"]
    names = engine_names(cfg)
    a = {n: RandomWeights(cfg, 11).tensor(n) for n in names}
    src = RandomWeights(cfg, 11)
    b = {n: src.tensor(n) for n in reversed(names)}
    for n in names:
        assert torch.equal(a[n], b[n]), n
    assert len({src.stream(n) for n in names}) == len(names)
    c = RandomWeights(cfg, 12)
    assert not torch.equal(a["layers.0.q"], c.tensor("layers.0.q"))
    assert not torch.equal(a["layers.0.q"], a["layers.1.q"])
    assert not torch.equal(a["layers.0.q"], a["layers.0.k"][:32].repeat(2, 1))


def test_one_layer_regenerates_alone() -> None:
    cfg = tiny_cfg(layers=4)
    full = model_weights(RandomWeights(cfg, 3))
    part = model_weights(RandomWeights(cfg, 3), layers=[2])
    assert sorted(part.layers) == [2]
    fresh = layer_tensors(RandomWeights(cfg, 3), 2)
    assert list(fresh) == [s for s, _ in layer_shapes(cfg)]
    for short, t in fresh.items():
        assert torch.equal(t, full.layers[2][short])
        assert torch.equal(t, part.layers[2][short])


def test_random_weight_scales() -> None:
    cfg = CASES["qwen2"]
    src = RandomWeights(cfg, 0)
    ln = src.tensor("layers.0.ln1")
    assert not torch.allclose(ln, torch.ones_like(ln))
    assert abs(ln.mean().item() - 1.0) < 0.05
    q = src.tensor("layers.0.q")
    assert abs(q.std().item() - 1 / 64**0.5) < 0.01
    down = src.tensor("layers.0.down")
    assert abs(down.std().item() - 1 / 128**0.5) < 0.01
    assert src.tensor("layers.0.q_bias").abs().max() < 1.0
    for n in engine_names(cfg):
        assert src.tensor(n).dtype == torch.float32


def test_builtin_source_uses_config_seed() -> None:
    src = load_weight_source("tiny-llama-a")
    cfg = builtin_config("tiny-llama-a")
    assert isinstance(src, RandomWeights) and src.seed == cfg.seed
    assert torch.equal(
        src.tensor("layers.3.down"), RandomWeights(cfg, cfg.seed or 0).tensor("layers.3.down")
    )
    assert hf_name(cfg, "layers.3.down") == "model.layers.3.mlp.down_proj.weight"


@pytest.mark.parametrize("name", sorted(BUILTIN_MODELS))
def test_builtin_greedy_output_varies(name: str) -> None:
    src = load_weight_source(name)
    w = model_weights(src)
    ids = [256, *b"Hello"]
    out: list[int] = []
    with torch.no_grad():
        for _ in range(16):
            logits = dense_forward(src.cfg, w, ids)
            assert torch.isfinite(logits).all()
            nxt = int(logits[-1].argmax())
            ids.append(nxt)
            out.append(nxt)
    assert len(set(out)) >= 4, out


def test_builtin_roundtrip_through_checkpoint(tmp_path: Path) -> None:
    src = load_weight_source("tiny-llama-a")
    save_checkpoint(tmp_path, src)
    ck = load_weight_source(tmp_path)
    assert isinstance(ck, SafetensorsCheckpoint)
    assert ck.cfg.spec.num_layers == 4 and ck.cfg.bos_token_id == 256
    assert ck.cfg.eos_token_ids == (257,)
    for n in ("embed", "lm_head", "layers.3.gate"):
        assert torch.equal(ck.tensor(n), src.tensor(n))
