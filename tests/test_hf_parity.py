"""HF checkpoint conversion against transformers itself: tiny random Qwen3.5 / Qwen3-Next models built
offline, saved with ``save_pretrained``, converted, and compared logit for logit in fp32.

Covered: key/value head ratio 1 and 2, full-attention interval 2 and 4 (with G = 2 stacked layer groups),
tied and untied embeddings, odd sizes, attention bias, Qwen3-Next dense and MoE (top-k renormalised or
not, MoE on every layer or every other one), the released multimodal Qwen3.5 layout, sharded
safetensors, ``pytorch_model.bin`` with transformers' fused in-memory experts, bf16, the command line,
and export back to a directory transformers loads.
"""

import copy
import json
import os
import subprocess
import sys

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytestmark = [pytest.mark.torch, pytest.mark.slow]
transformers = pytest.importorskip("transformers")

import jax.numpy as jnp  # noqa: E402
from safetensors.numpy import load_file, save_file  # noqa: E402

import ready_jax as rj  # noqa: E402
from convert import hf_target  # noqa: E402
from ready_jax.checkpoint import flat_state  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
REL_TOL = 1e-4  # max |ours - HF| / max |HF| over the logits, fp32
BATCH, SEQ = 2, 24
# Odd sizes on purpose: hidden 40, head_dim 12 with a rotary dim of 6, vocab 97, dk 8 != dv 6.
BASE = dict(vocab_size=97, hidden_size=40, intermediate_size=24, num_attention_heads=2, num_key_value_heads=1,
            head_dim=12, partial_rotary_factor=0.5, linear_num_key_heads=2, linear_key_head_dim=8,
            linear_value_head_dim=6, rms_norm_eps=1e-6)


def _layer_types(interval: int, num_layers: int) -> list[str]:
    return ["full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(num_layers)]


# name -> (family, config overrides). Interval 4 uses 8 layers so that the 4-layer group is stacked twice.
MOE = dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=10, shared_expert_intermediate_size=14)
CONFIGS = {
    "qwen3_5-kv1-int4-untied-bias": ("qwen3_5", dict(
        linear_num_value_heads=2, num_hidden_layers=8, layer_types=_layer_types(4, 8),
        tie_word_embeddings=False, attention_bias=True, head_dim=16, partial_rotary_factor=0.25)),
    "qwen3_5-kv2-int2-tied": ("qwen3_5", dict(
        linear_num_value_heads=4, num_hidden_layers=4, layer_types=_layer_types(2, 4),
        tie_word_embeddings=True)),
    "qwen3_next-dense-kv2-int2": ("qwen3_next", dict(
        linear_num_value_heads=4, num_hidden_layers=4, layer_types=_layer_types(2, 4),
        tie_word_embeddings=False, **MOE, mlp_only_layers=[0, 1, 2, 3])),
    "qwen3_next-moe8top2-norm-kv1-int4": ("qwen3_next", dict(
        linear_num_value_heads=2, num_hidden_layers=8, layer_types=_layer_types(4, 8),
        tie_word_embeddings=False, **MOE, norm_topk_prob=True)),
    "qwen3_next-moe8top2-nonorm-step2-kv2-int2-tied": ("qwen3_next", dict(
        linear_num_value_heads=4, num_hidden_layers=4, layer_types=_layer_types(2, 4),
        tie_word_embeddings=True, **MOE, norm_topk_prob=False, decoder_sparse_step=2)),
}


def _randomise(model, seed: int) -> None:
    """Unit-scale weights, so logits are O(1) and every path matters (HF's std-0.02 init gives near-zero
    activations that would hide errors), and random norm / decay parameters, which HF initialises to
    constants: a zero-centred vs one-centred norm or a swapped A_log / dt_bias would otherwise pass."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            if name.endswith("linear_attn.norm.weight"):  # gated norm: plain weight around one
                p.copy_(1.0 + 0.3 * noise)
            elif name.endswith(("norm.weight", "A_log", "dt_bias", ".bias")):
                p.copy_(0.3 * noise)
            elif "conv1d" in name:
                p.copy_(0.5 * noise)
            else:  # linear / expert weights: fan-in is the last axis; embeddings unit normal
                p.copy_(noise * (1.0 if "embed_tokens" in name else p.shape[-1] ** -0.5))


def _build_hf(family: str, overrides: dict, seed: int = 0):
    torch.manual_seed(seed)
    if family == "qwen3_5":
        config = transformers.Qwen3_5TextConfig(**{**BASE, **overrides})
        model = transformers.Qwen3_5ForCausalLM(config)
    else:
        config = transformers.Qwen3NextConfig(**{**BASE, **overrides})
        model = transformers.Qwen3NextForCausalLM(config)
        model.set_experts_implementation("eager")  # the per-expert loop; grouped_mm needs aligned strides
    model.set_attn_implementation("eager")
    _randomise(model, seed)
    return model.eval()


def _input_ids(seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, BASE["vocab_size"], (BATCH, SEQ))


def _hf_logits(model, ids: np.ndarray) -> np.ndarray:
    with torch.no_grad():
        return model(torch.as_tensor(ids)).logits.float().numpy()


@pytest.fixture(scope="module")
def hf_models(tmp_path_factory):
    """name -> (HF model, its save_pretrained directory), built once for the module."""
    built = {}
    for name, (family, overrides) in CONFIGS.items():
        model = _build_hf(family, overrides)
        path = tmp_path_factory.mktemp(name)
        model.save_pretrained(path)
        built[name] = (model, path)
    return built


@pytest.fixture(scope="module")
def converted(hf_models):
    """name -> the fp32 conversion of each HF directory."""
    return {name: rj.Target.from_hf(path) for name, (_, path) in hf_models.items()}


def _flat_np(target) -> dict[str, np.ndarray]:
    return {k: np.asarray(v) for k, v in flat_state(target.params).items()}


def _assert_same_params(a, b) -> None:
    fa, fb = _flat_np(a), _flat_np(b)
    assert fa.keys() == fb.keys()
    for key in fa:
        assert fa[key].dtype == fb[key].dtype, key
        np.testing.assert_array_equal(fa[key], fb[key], err_msg=key)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_logits_match_transformers(name, hf_models, converted, record_property):
    model, _ = hf_models[name]
    ids = _input_ids()
    ref = _hf_logits(model, ids)
    ours = np.asarray(converted[name].forward(ids))
    abs_err = float(np.max(np.abs(ours - ref)))
    rel_err = abs_err / float(np.max(np.abs(ref)))
    record_property("max_abs_err", abs_err)
    record_property("rel_err", rel_err)
    print(f"\n[parity] {name}: max|logit| {np.max(np.abs(ref)):.3f}  max abs err {abs_err:.3e}  "
          f"rel {rel_err:.3e}")
    assert rel_err <= REL_TOL, f"{name}: logits differ from transformers (rel err {rel_err:.2e})"


@pytest.mark.parametrize("name", ["qwen3_5-kv1-int4-untied-bias", "qwen3_next-moe8top2-norm-kv1-int4"])
def test_hidden_layer_index_is_hf_hidden_states_plus_one(name, hf_models, converted):
    """``hidden_layers=(l,)`` is HF's ``output_hidden_states[l + 1]`` (the output of decoder layer l)."""
    model, _ = hf_models[name]
    target = converted[name]
    ids = _input_ids(1)
    with torch.no_grad():
        ref = model(torch.as_tensor(ids), output_hidden_states=True).hidden_states
    layers = tuple(range(target.config.num_hidden_layers - 1))  # HF's last entry is after the final norm
    out = target.prefill(target.init_cache(BATCH, SEQ), jnp.asarray(ids), hidden_layers=layers)
    for slot, layer in enumerate(layers):
        want = ref[layer + 1].float().numpy()
        err = np.max(np.abs(np.asarray(out.hidden[slot]) - want)) / np.max(np.abs(want))
        assert err <= REL_TOL, f"layer {layer}: rel err {err:.2e}"


@pytest.mark.parametrize("name", list(CONFIGS))
def test_export_state_is_the_saved_state(name, hf_models, converted):
    """HF -> ours -> HF reproduces save_pretrained's tensors exactly, key for key."""
    _, path = hf_models[name]
    saved = load_file(os.path.join(path, "model.safetensors"))
    layout = "qwen3_next" if name.startswith("qwen3_next") else "qwen3_5_text"
    exported = hf_target.export_hf_state(converted[name], layout)
    assert exported.keys() == saved.keys()
    for key, value in saved.items():
        np.testing.assert_array_equal(exported[key], value, err_msg=key)


def test_save_pretrained_writes_per_expert_moe_keys(hf_models):
    """What transformers 5 writes for Qwen3-Next MoE: one tensor per expert, not its fused in-memory form."""
    _, path = hf_models["qwen3_next-moe8top2-norm-kv1-int4"]
    keys = set(load_file(os.path.join(path, "model.safetensors")))
    assert "model.layers.0.mlp.experts.7.gate_proj.weight" in keys
    assert "model.layers.0.mlp.experts.7.down_proj.weight" in keys
    assert not any(k.endswith("experts.gate_up_proj") for k in keys)
    assert "model.layers.0.linear_attn.in_proj_qkvz.weight" in keys


def test_multimodal_qwen3_5_layout(hf_models, converted, tmp_path):
    """Released Qwen3.5 checkpoints: a qwen3_5 wrapper config, the text model under model.language_model,
    plus a vision tower and MTP heads that are deliberately ignored."""
    name = "qwen3_5-kv1-int4-untied-bias"
    _, path = hf_models[name]
    text_config = json.loads((path / "config.json").read_text())
    text_config.pop("architectures")
    wrapper = {"architectures": ["Qwen3_5ForConditionalGeneration"], "model_type": "qwen3_5",
               "text_config": text_config, "vision_config": {"depth": 1, "hidden_size": 8},
               "image_token_id": 90, "video_token_id": 91, "vision_start_token_id": 92,
               "vision_end_token_id": 93, "tie_word_embeddings": False}
    tensors = {k.replace("model.", "model.language_model.", 1) if k.startswith("model.") else k: v
               for k, v in load_file(os.path.join(path, "model.safetensors")).items()}
    rng = np.random.default_rng(0)
    for fake in ("model.visual.blocks.0.attn.qkv.weight", "model.visual.merger.linear_fc1.weight",
                 "mtp.fc.weight", "mtp.layers.0.self_attn.q_proj.weight", "mtp.norm.weight"):
        tensors[fake] = rng.standard_normal((3, 5)).astype(np.float32)
    save_file(tensors, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    (tmp_path / "config.json").write_text(json.dumps(wrapper))

    target = rj.Target.from_hf(tmp_path)
    assert target.config == converted[name].config
    _assert_same_params(target, converted[name])


def test_sharded_safetensors(hf_models, converted, tmp_path):
    name = "qwen3_next-moe8top2-norm-kv1-int4"
    model, _ = hf_models[name]
    model.save_pretrained(tmp_path, max_shard_size="40KB")
    shards = [f for f in os.listdir(tmp_path) if f.endswith(".safetensors")]
    assert len(shards) > 1 and (tmp_path / "model.safetensors.index.json").exists()
    _assert_same_params(rj.Target.from_hf(tmp_path), converted[name])


@pytest.mark.parametrize("name", ["qwen3_next-moe8top2-nonorm-step2-kv2-int2-tied", "qwen3_5-kv2-int2-tied"])
def test_pytorch_bin_of_the_in_memory_state_dict(name, hf_models, converted, tmp_path):
    """``torch.save(model.state_dict())``: transformers' fused experts (gate_up_proj [E, 2I, D]) and, for
    tied models, a redundant lm_head.weight equal to the embedding, which is dropped."""
    model, path = hf_models[name]
    state = model.state_dict()
    if "moe" in name:
        assert "model.layers.1.mlp.experts.gate_up_proj" in state
    else:
        assert "lm_head.weight" in state
    torch.save(state, tmp_path / "pytorch_model.bin")
    (tmp_path / "config.json").write_text((path / "config.json").read_text())
    _assert_same_params(rj.Target.from_hf(tmp_path), converted[name])


def test_sharded_bfloat16_pytorch_bin(hf_models, converted, tmp_path):
    """Sharded .bin of bf16 tensors (numpy has no bf16: read bit-exactly via ml_dtypes) -> a bf16 target
    equal to the fp32 conversion rounded to bf16."""
    name = "qwen3_5-kv2-int2-tied"
    model, path = hf_models[name]
    state = {k: v.to(torch.bfloat16) for k, v in model.state_dict().items() if k != "lm_head.weight"}
    keys = sorted(state)
    halves = {"pytorch_model-00001-of-00002.bin": keys[::2], "pytorch_model-00002-of-00002.bin": keys[1::2]}
    for shard, shard_keys in halves.items():
        torch.save({k: state[k] for k in shard_keys}, tmp_path / shard)
    weight_map = {k: shard for shard, shard_keys in halves.items() for k in shard_keys}
    (tmp_path / "pytorch_model.bin.index.json").write_text(json.dumps({"weight_map": weight_map}))
    (tmp_path / "config.json").write_text((path / "config.json").read_text())
    ours = _flat_np(rj.Target.from_hf(tmp_path, dtype=jnp.bfloat16))
    for key, value in _flat_np(converted[name]).items():
        assert ours[key].dtype == jnp.bfloat16, key
        np.testing.assert_array_equal(ours[key], value.astype(jnp.bfloat16), err_msg=key)


def test_cli_bfloat16_round_trip(hf_models, tmp_path):
    """bf16 safetensors -> (CLI subprocess, --dtype bfloat16) -> project checkpoint -> (CLI, --export-hf)
    -> HF safetensors bit-identical to the bf16 source."""
    model, _ = hf_models["qwen3_next-moe8top2-nonorm-step2-kv2-int2-tied"]
    src, ours, back = tmp_path / "hf_bf16", tmp_path / "ours", tmp_path / "hf_back"
    copy.deepcopy(model).to(torch.bfloat16).save_pretrained(src)
    command = [sys.executable, "-m", "convert.hf_target", str(src), str(ours), "--dtype", "bfloat16"]
    proc = subprocess.run(command, capture_output=True, text=True, cwd=REPO)
    assert proc.returncode == 0, proc.stderr
    target = rj.Target.load(ours)
    assert target.dtype == jnp.bfloat16
    assert hf_target.main([str(ours), str(back), "--export-hf"]) == 0
    source = load_file(os.path.join(src, "model.safetensors"))
    exported = load_file(os.path.join(back, "model.safetensors"))
    assert exported.keys() == source.keys()
    for key, value in source.items():
        assert value.dtype == exported[key].dtype == np.dtype("bfloat16"), key
        np.testing.assert_array_equal(exported[key].view(np.uint16), value.view(np.uint16), err_msg=key)
    assert json.loads((back / "config.json").read_text())["dtype"] == "bfloat16"


@pytest.mark.parametrize("name, layout", [("qwen3_next-moe8top2-norm-kv1-int4", "qwen3_next"),
                                          ("qwen3_5-kv2-int2-tied", "qwen3_5"),
                                          ("qwen3_5-kv1-int4-untied-bias", "qwen3_5_text")])
def test_export_loads_in_transformers(name, layout, hf_models, converted, tmp_path):
    """export_hf writes a directory AutoModelForCausalLM loads, giving the original model's logits."""
    model, _ = hf_models[name]
    hf_target.export_hf(converted[name], tmp_path, layout=layout)
    kwargs = {"experts_implementation": "eager"} if layout == "qwen3_next" else {}
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32,
                                                                 attn_implementation="eager", **kwargs).eval()
    ids = _input_ids(seed=1)
    np.testing.assert_allclose(_hf_logits(reloaded, ids), _hf_logits(model, ids), rtol=0, atol=1e-5)
    assert rj.TargetConfig.from_hf(tmp_path) == converted[name].config
