"""Qwen3.5-MoE targets against transformers itself: tiny random ``Qwen3_5MoeForCausalLM`` and
``Qwen3_5MoeForConditionalGeneration`` models (a one-block vision tower, ignored) built offline in fp32, saved with
``save_pretrained`` and loaded with ``rj.Target.from_hf``.

Covered: logits, hidden states and the Gated DeltaNet recurrent and conv states after a prompt; greedy tokens
against HF ``generate``; speculative greedy equal to autoregressive greedy with a random drafter (bf16, float32);
the per-expert keys save_pretrained writes, the fused experts of released checkpoints and of a raw state dict,
under ``model.`` and ``model.language_model.``; export back to both layouts, which transformers loads; and the
config fields Qwen3.5-MoE does not have, refused by name.
"""

import json
import os

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.torch

import jax.numpy as jnp  # noqa: E402
from safetensors.numpy import load_file, save_file  # noqa: E402
from test_hf_parity import BASE, REL_TOL, _hf_logits, _layer_types, _randomise  # noqa: E402

import ready_jax as rj  # noqa: E402
from convert import hf_target  # noqa: E402
from ready_jax import hf_format  # noqa: E402
from ready_jax.checkpoint import flat_state  # noqa: E402

BATCH, SEQ = 2, 24
MOE = dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=10, shared_expert_intermediate_size=14)
# Every layer of a Qwen3.5-MoE model is sparse; the two differ in depth, interval, head ratios, tying and bias.
CONFIGS = {
    "moe8top2-kv1-int4-untied": dict(linear_num_value_heads=2, num_hidden_layers=8, layer_types=_layer_types(4, 8),
                                     tie_word_embeddings=False, **MOE),
    "moe8top2-kv2-int2-tied-bias": dict(linear_num_value_heads=4, num_hidden_layers=4,
                                        layer_types=_layer_types(2, 4), tie_word_embeddings=True,
                                        attention_bias=True, head_dim=16, partial_rotary_factor=0.25, **MOE),
}
WRAPPED = "moe8top2-kv1-int4-untied"  # also built as the multimodal wrapper, as Qwen3.5-35B-A3B is released
VISION = dict(depth=1, hidden_size=16, intermediate_size=16, num_heads=2, out_hidden_size=BASE["hidden_size"],
              patch_size=2, spatial_merge_size=1, temporal_patch_size=1, num_position_embeddings=4)


def _text_config(name: str):
    dense_free = {k: v for k, v in BASE.items() if k != "intermediate_size"}
    return transformers.Qwen3_5MoeTextConfig(**{**dense_free, **CONFIGS[name]})


def _eager(model):
    model.set_attn_implementation("eager")
    model.set_experts_implementation("eager")  # the per-expert loop; grouped_mm needs aligned strides
    return model


def _build(name: str, wrapper: bool = False, seed: int = 0):
    """The text model, or the multimodal wrapper holding that same text model (and a random vision tower)."""
    torch.manual_seed(seed)
    text = transformers.Qwen3_5MoeForCausalLM(_text_config(name))
    _randomise(_eager(text), seed)
    if not wrapper:
        return text.eval()
    config = transformers.Qwen3_5MoeConfig(text_config=_text_config(name).to_dict(), vision_config=VISION,
                                           tie_word_embeddings=CONFIGS[name]["tie_word_embeddings"])
    model = transformers.Qwen3_5MoeForConditionalGeneration(config)
    _randomise(_eager(model), seed)
    model.model.language_model.load_state_dict(text.model.state_dict())
    model.lm_head.load_state_dict(text.lm_head.state_dict())
    return model.eval()


def _ids(seed: int = 0, batch: int = BATCH, length: int = SEQ) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, BASE["vocab_size"], (batch, length))


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """name -> (HF model, its save_pretrained directory, the fp32 conversion); ``wrapped`` is the multimodal one."""
    out = {}
    for name, wrapper in [*((n, False) for n in CONFIGS), ("wrapped", True)]:
        model = _build(WRAPPED if wrapper else name, wrapper)
        path = tmp_path_factory.mktemp(name)
        model.save_pretrained(path)
        out[name] = (model, path, rj.Target.from_hf(path))
    return out


def _flat(target) -> dict[str, np.ndarray]:
    return {k: np.asarray(v) for k, v in flat_state(target.params).items()}


def _assert_same_params(a, b) -> None:
    fa, fb = _flat(a), _flat(b)
    assert fa.keys() == fb.keys()
    for key in fa:
        np.testing.assert_array_equal(fa[key], fb[key], err_msg=key)


@pytest.mark.parametrize("name", [*CONFIGS, "wrapped"])
def test_logits_match_transformers(name, built, record_property):
    model, _, target = built[name]
    ids = _ids()
    ref = _hf_logits(model, ids)
    ours = np.asarray(target.forward(ids))
    abs_err = float(np.max(np.abs(ours - ref)))
    rel_err = abs_err / float(np.max(np.abs(ref)))
    record_property("max_abs_err", abs_err)
    print(f"\n[parity] qwen3_5_moe {name}: max|logit| {np.max(np.abs(ref)):.3f}  max abs err {abs_err:.3e}  "
          f"rel {rel_err:.3e}")
    assert target.config.model_type == "qwen3_5_moe_text" and target.config.intermediate_size == 0
    assert all(map(target.config.is_moe_layer, range(target.config.num_hidden_layers)))
    assert rel_err <= REL_TOL, f"{name}: logits differ from transformers (rel err {rel_err:.2e})"


def test_hidden_and_delta_net_states_match_transformers(built):
    """After a prompt: ``hidden_layers=(l,)`` is HF's ``hidden_states[l + 1]``; each Gated DeltaNet layer's
    recurrent state is HF's ``recurrent_states`` and its conv state the last K-1 of HF's K ``conv_states``."""
    model, _, target = built["moe8top2-kv1-int4-untied"]
    config, ids = target.config, _ids(1)
    with torch.no_grad():
        ref = model(torch.as_tensor(ids), use_cache=True, output_hidden_states=True)
    layers = tuple(range(config.num_hidden_layers - 1))  # HF's last entry is after the final norm
    out = target.prefill(target.init_cache(BATCH, SEQ), jnp.asarray(ids), hidden_layers=layers)
    for slot, layer in enumerate(layers):
        want = ref.hidden_states[layer + 1].float().numpy()
        err = np.max(np.abs(np.asarray(out.hidden[slot]) - want)) / np.max(np.abs(want))
        assert err <= REL_TOL, f"hidden state of layer {layer}: rel err {err:.2e}"
    p = config.group_size
    for layer in config.linear_layers:
        entry, hf = out.cache.layers[layer % p], ref.past_key_values.layers[layer]
        state, conv = np.asarray(entry.state[layer // p]), np.asarray(entry.conv[layer // p])
        want_state = hf.recurrent_states[0].float().numpy()                         # [B, H_v, d_k, d_v]
        want_conv = np.swapaxes(hf.conv_states[0].float().numpy(), 1, 2)[:, 1:]     # [B, K-1, C]
        np.testing.assert_allclose(state, want_state, rtol=0, atol=1e-4 * np.max(np.abs(want_state)),
                                   err_msg=f"recurrent state of layer {layer}")
        np.testing.assert_allclose(conv, want_conv, rtol=0, atol=1e-5 * np.max(np.abs(want_conv)),
                                   err_msg=f"conv state of layer {layer}")


@pytest.mark.slow
@pytest.mark.parametrize("name", [*CONFIGS, "wrapped"])
def test_greedy_tokens_match_transformers_generate(name, built):
    model, _, target = built[name]
    ids, new = _ids(2, length=11), 12
    with torch.no_grad():
        ref = model.generate(torch.as_tensor(ids), max_new_tokens=new, do_sample=False, min_new_tokens=new,
                             pad_token_id=0)[:, ids.shape[1]:].numpy()
    ours = rj.generate(target, ids, new).tokens
    np.testing.assert_array_equal(ours, ref)


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_speculative_greedy_equals_autoregressive(dtype, built):
    """A random drafter on the converted target (ragged prompts): rounds that reject drafts, and the same tokens."""
    _, path, _ = built["moe8top2-kv1-int4-untied"]
    target = rj.Target.from_hf(path, dtype=jnp.dtype(dtype))
    rng = np.random.default_rng(3)
    prompts = [rng.integers(0, BASE["vocab_size"], n) for n in (5, 13)]
    drafter = rj.Drafter.init(target.config, rj.DrafterConfig(block_size=4, num_layers=1, intermediate_size=32,
                                                              markov_rank=4), seed=0)
    ar = rj.generate(target, prompts, 16)
    spec = rj.generate(target, prompts, 16, drafter=drafter)
    np.testing.assert_array_equal(spec.tokens, ar.tokens)
    assert spec.tau < drafter.config.block_size + 1


def test_drafter_width_is_not_defaulted_from_a_target_without_a_dense_mlp():
    with pytest.raises(ValueError, match="no dense MLP width .* give intermediate_size"):
        rj.DrafterConfig(block_size=4, num_layers=1).resolve(rj.TargetConfig.qwen3_5_35b_a3b())


@pytest.mark.parametrize("name", [*CONFIGS, "wrapped"])
def test_save_pretrained_writes_per_expert_keys_and_export_reproduces_them(name, built):
    """HF -> ours -> HF gives save_pretrained's tensors exactly, key for key (vision tower aside)."""
    _, path, target = built[name]
    saved = {k: v for k, v in load_file(os.path.join(path, "model.safetensors")).items()
             if not k.startswith("model.visual.")}
    prefix = "model.language_model" if name == "wrapped" else "model"
    assert f"{prefix}.layers.0.mlp.experts.7.gate_proj.weight" in saved
    assert f"{prefix}.layers.0.linear_attn.in_proj_qkv.weight" in saved
    assert not any(k.endswith("experts.gate_up_proj") for k in saved)
    exported = hf_target.export_hf_state(target, "qwen3_5_moe" if name == "wrapped" else "qwen3_5_moe_text")
    assert exported.keys() == saved.keys()
    for key, value in saved.items():
        np.testing.assert_array_equal(exported[key], value, err_msg=key)


def test_wrapper_config_and_its_text_model_give_one_target(built):
    assert built["wrapped"][2].config == built[WRAPPED][2].config
    _assert_same_params(built["wrapped"][2], built[WRAPPED][2])


@pytest.mark.parametrize("name", ["moe8top2-kv2-int2-tied-bias", "wrapped"])
def test_fused_experts_of_a_raw_state_dict(name, built, tmp_path):
    """Released Qwen3.5-MoE checkpoints store experts fused (``mlp.experts.gate_up_proj`` [E, 2I, D],
    ``mlp.experts.down_proj`` [E, D, I]), as transformers holds them in memory: the raw state dict, vision tower,
    and (tied) a redundant lm_head.weight equal to the embedding included."""
    model, path, target = built[name]
    state = {k: v.detach().numpy().copy() for k, v in model.state_dict().items()}
    prefix = "model.language_model" if name == "wrapped" else "model"
    assert state[f"{prefix}.layers.1.mlp.experts.gate_up_proj"].shape == (8, 20, BASE["hidden_size"])
    save_file(state, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    (tmp_path / "config.json").write_text((path / "config.json").read_text())
    _assert_same_params(rj.Target.from_hf(tmp_path), target)


@pytest.mark.slow
@pytest.mark.parametrize("name, layout", [("moe8top2-kv2-int2-tied-bias", "qwen3_5_moe_text"),
                                          ("moe8top2-kv1-int4-untied", "qwen3_5_moe")])
def test_export_loads_in_transformers(name, layout, built, tmp_path):
    """export_hf (the command line's --export-hf) writes a directory AutoModelForCausalLM loads, giving the original
    model's logits, and converting it back gives the same config."""
    model, _, target = built[name]
    hf_target.export_hf(target, tmp_path, layout=layout)
    assert json.loads((tmp_path / "config.json").read_text())["model_type"] == layout
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32,
                                                                 attn_implementation="eager",
                                                                 experts_implementation="eager").eval()
    ids = _ids(seed=1)
    np.testing.assert_allclose(_hf_logits(reloaded, ids), _hf_logits(model, ids), rtol=0, atol=1e-5)
    assert rj.TargetConfig.from_hf(tmp_path) == target.config


def test_default_export_layout_is_the_family_of_the_config():
    config = rj.TargetConfig.qwen3_5_35b_a3b()
    assert hf_format.default_layout(config) == "qwen3_5_moe_text"
    for layout in ("qwen3_5_moe_text", "qwen3_5_moe", "qwen3_next"):
        assert rj.TargetConfig.from_hf(hf_format.hf_config(config, layout)) == (
            config if layout != "qwen3_next" else rj.TargetConfig(**{**config.to_dict(), "model_type": "qwen3_next"}))
    with pytest.raises(ValueError, match="has no MoE layers; export this model with layout 'qwen3_next' or"):
        hf_format.hf_config(config, "qwen3_5")


def test_qwen3_next_with_dense_layers_or_plain_top_k_has_no_qwen3_5_moe_layout():
    base = rj.TargetConfig(**{**rj.TargetConfig.qwen3_5_35b_a3b().to_dict(), "model_type": "qwen3_next",
                              "num_hidden_layers": 4, "layer_types": _layer_types(4, 4)})
    for change, why in ((dict(mlp_only_layers=(0,), intermediate_size=64), "dense layers"),
                        (dict(norm_topk_prob=False), "norm_topk_prob false")):
        config = rj.TargetConfig(**{**base.to_dict(), **change})
        with pytest.raises(ValueError, match=f"this model has {why}; export it with layout 'qwen3_next'"):
            hf_format.export_bindings(config, "qwen3_5_moe")


def test_transformers_default_config_is_the_35b_a3b_geometry():
    """transformers' Qwen3.5-MoE defaults are Qwen3.5-35B-A3B's sizes; the preset adds its context, RoPE base and
    EOS from the released config.json."""
    ours = rj.TargetConfig.from_hf(transformers.Qwen3_5MoeConfig().to_dict())
    preset = rj.TargetConfig.qwen3_5_35b_a3b()
    differ = {k for k, v in preset.to_dict().items() if ours.to_dict()[k] != v}
    assert differ == {"rope_theta", "max_position_embeddings", "eos_token_ids"}, differ


@pytest.mark.parametrize("field, value", [("mlp_only_layers", [0]), ("decoder_sparse_step", 2),
                                          ("norm_topk_prob", False)])
def test_qwen3_next_knobs_qwen3_5_moe_lacks_are_refused_by_name(field, value):
    text = transformers.Qwen3_5MoeTextConfig(num_hidden_layers=4).to_dict()
    assert rj.TargetConfig.from_hf({**text, field: {"mlp_only_layers": [], "decoder_sparse_step": 1,
                                                    "norm_topk_prob": True}[field]}).num_experts == 256
    with pytest.raises(ValueError, match=f"{field} .* is not supported: a qwen3_5_moe_text model has"):
        rj.TargetConfig.from_hf({**text, field: value})


def test_intermediate_size_is_not_read_and_other_fields_are_still_strict():
    text = transformers.Qwen3_5MoeTextConfig(num_hidden_layers=4).to_dict()
    assert rj.TargetConfig.from_hf({**text, "intermediate_size": 6144}).intermediate_size == 0
    with pytest.raises(ValueError, match=r"unrecognised config field\(s\) \['router_jitter'\]"):
        rj.TargetConfig.from_hf({**text, "router_jitter": 0.1})
    with pytest.raises(ValueError, match="a 'qwen3_5_moe' wrapper holds a text_config of model_type 'qwen3_5_text'"):
        rj.TargetConfig.from_hf({"model_type": "qwen3_5_moe", "text_config": {**text, "model_type": "qwen3_5_text"}})
