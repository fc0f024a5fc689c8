"""DeepSpec DSpark checkpoint conversion: strict table, round trip, the command line, and one draft block
against a small PyTorch forward written from DeepSpec's modeling code (torch only)."""

import dataclasses
import json

import numpy as np
import pytest
from safetensors.numpy import save_file

from convert import deepspec
from ready_jax.drafter import Drafter, SharedWeights
from ready_jax.drafter_config import ReaderConfig

D, V, H, H_KV, HD, FF, R_M = 32, 97, 4, 2, 8, 48, 8
IDS = (1, 3, 5)


def deepspec_config(**overrides) -> dict:
    """What DeepSpec's ``build_draft_config`` writes: the target's (Qwen3) config plus the draft fields."""
    base = dict(architectures=["Qwen3DSparkModel"], model_type="qwen3", hidden_size=D, intermediate_size=FF,
                num_attention_heads=H, num_key_value_heads=H_KV, head_dim=HD, num_hidden_layers=2,
                rms_norm_eps=1e-6, rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
                vocab_size=V, hidden_act="silu", attention_bias=False, tie_word_embeddings=False,
                layer_types=["full_attention"] * 2, use_sliding_window=False, sliding_window=None,
                max_position_embeddings=4096, torch_dtype="bfloat16", block_size=4, mask_token_id=V - 1,
                target_layer_ids=list(IDS), num_target_layers=8, num_anchors=512, enable_confidence_head=True,
                confidence_head_with_markov=True, markov_rank=R_M, markov_head_type="vanilla")
    base.update(overrides)
    return base


def deepspec_shapes(num_layers=2, markov=True, confidence=True) -> dict[str, tuple[int, ...]]:
    """Key names and shapes of ``Qwen3DSparkModel.state_dict()`` (torch ``Linear.weight`` is [out, in])."""
    shapes = {"embed_tokens.weight": (V, D), "lm_head.weight": (V, D), "fc.weight": (D, len(IDS) * D),
              "hidden_norm.weight": (D,), "norm.weight": (D,)}
    for i in range(num_layers):
        p = f"layers.{i}."
        shapes.update({p + "input_layernorm.weight": (D,), p + "post_attention_layernorm.weight": (D,),
                       p + "self_attn.q_proj.weight": (H * HD, D), p + "self_attn.k_proj.weight": (H_KV * HD, D),
                       p + "self_attn.v_proj.weight": (H_KV * HD, D), p + "self_attn.o_proj.weight": (D, H * HD),
                       p + "self_attn.q_norm.weight": (HD,), p + "self_attn.k_norm.weight": (HD,),
                       p + "mlp.gate_proj.weight": (FF, D), p + "mlp.up_proj.weight": (FF, D),
                       p + "mlp.down_proj.weight": (D, FF)})
    if markov:
        shapes.update({"markov_head.markov_w1.weight": (V, R_M), "markov_head.markov_w2.weight": (V, R_M)})
    if confidence:
        shapes.update({"confidence_head.proj.weight": (1, D + (R_M if markov else 0)),
                       "confidence_head.proj.bias": (1,)})
    return shapes


def random_state(shapes, seed=0, scale=0.1) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    state = {k: (rng.normal(size=s) * scale).astype(np.float32) for k, s in shapes.items()}
    for k in state:  # norms near one, like trained Qwen3 RMSNorm weights
        if k.endswith("norm.weight"):
            state[k] = (1.0 + state[k]).astype(np.float32)
    return state


def _assert_same_state(a: dict, b: dict):
    assert sorted(a) == sorted(b)
    for k in a:
        np.testing.assert_array_equal(np.asarray(a[k]), np.asarray(b[k]), err_msg=k)


@pytest.mark.parametrize("markov, confidence", [(True, True), (False, False), (True, False)])
def test_convert_then_export_is_identity(markov, confidence):
    raw = deepspec_config(markov_rank=R_M if markov else 0, enable_confidence_head=confidence,
                          confidence_head_with_markov=markov)
    state = random_state(deepspec_shapes(markov=markov, confidence=confidence))
    drafter, shared = deepspec.from_deepspec_state(deepspec.config_from_deepspec(raw), state)
    _assert_same_state(deepspec.to_deepspec_state(drafter, shared), state)
    assert deepspec.config_from_deepspec(deepspec.config_to_deepspec(drafter.config)) == drafter.config


def test_reader_extension_round_trips(tiny_target):
    cfg = deepspec.config_from_deepspec(deepspec_config())
    cfg = dataclasses.replace(cfg, reader=ReaderConfig(rank=4)).resolve(tiny_target.config)
    drafter = Drafter.init(tiny_target.config, cfg, seed=1)
    shared = SharedWeights.from_target(tiny_target)
    exported = deepspec.to_deepspec_state(drafter, shared)
    assert "layers.1.reader.key_basis" in exported and "layers.1.reader.o_proj.weight" in exported
    raw = deepspec.config_to_deepspec(drafter.config)
    back, back_shared = deepspec.from_deepspec_state(deepspec.config_from_deepspec(raw), exported)
    assert back.config == drafter.config
    _assert_same_state(back.flat_params(), drafter.flat_params())
    _assert_same_state(deepspec.to_deepspec_state(back, back_shared), exported)


def test_all_problems_are_reported_at_once():
    cfg = deepspec.config_from_deepspec(deepspec_config())
    state = random_state(deepspec_shapes())
    del state["layers.1.mlp.up_proj.weight"]
    state["layers.0.self_attn.k_proj.weight"] = state["layers.0.self_attn.k_proj.weight"].T
    state["layers.0.self_attn.rotary_emb.inv_freq"] = np.zeros(4, np.float32)
    state["lm_head.weight"] = np.zeros((V, D + 1), np.float32)
    with pytest.raises(ValueError, match="4 problem") as err:
        deepspec.from_deepspec_state(cfg, state)
    text = str(err.value)
    for needle in ("missing layers.1.mlp.up_proj.weight",
                   "misshaped layers.0.self_attn.k_proj.weight: expected (16, 32), got (32, 16)",
                   "unexpected layers.0.self_attn.rotary_emb.inv_freq", "misshaped lm_head.weight"):
        assert needle in text


@pytest.mark.parametrize("overrides, message", [
    (dict(markov_head_type="gated"), "markov_head_type 'gated'"),
    (dict(architectures=["Gemma4DSparkModel"]), "only Qwen3DSparkModel"),
    (dict(attention_bias=True), "biases"),
    (dict(rope_parameters={"rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0}), "RoPE scaling"),
    (dict(target_layer_ids=[-1, 3]), "embedding-output"),
    (dict(hidden_act="gelu"), "hidden_act 'gelu'"),
])
def test_unsupported_configs_are_errors(overrides, message):
    with pytest.raises(ValueError, match=message):
        deepspec.config_from_deepspec(deepspec_config(**overrides))


def test_command_line_round_trip(tiny_target, tmp_path, capsys):
    """Import with --target (checks the shared weights), then --export with the same target."""
    shared = SharedWeights.from_target(tiny_target)
    state = random_state(deepspec_shapes())
    state["embed_tokens.weight"] = np.asarray(shared.embedding)
    state["lm_head.weight"] = np.ascontiguousarray(np.asarray(shared.lm_head).T)  # save_file needs C order
    src, mine, back, target_dir = (tmp_path / n for n in ("deepspec", "mine", "back", "target"))
    src.mkdir()
    save_file(state, str(src / "model.safetensors"))
    (src / "config.json").write_text(json.dumps(deepspec_config()))
    tiny_target.save(str(target_dir))
    assert deepspec.main([str(src), str(mine), "--target", str(target_dir)]) == 0
    assert Drafter.load(str(mine)).config == deepspec.config_from_deepspec(deepspec_config())
    assert deepspec.main(["--export", str(mine), str(back), "--target", str(target_dir)]) == 0
    _assert_same_state(deepspec.read_state_dict(str(back)), state)
    assert deepspec.config_from_deepspec(json.loads((back / "config.json").read_text())) == \
        Drafter.load(str(mine)).config

    state["embed_tokens.weight"] = state["embed_tokens.weight"] + 1.0
    save_file(state, str(src / "model.safetensors"))
    assert deepspec.main([str(src), str(tmp_path / "other"), "--target", str(target_dir)]) == 1
    assert "trained for another target" in capsys.readouterr().err


# ---- numerics against a PyTorch forward written from DeepSpec's Qwen3DSparkModel --------------------------
def _torch_block(torch, sd, cfg, feats, anchor_pos, anchor):
    """DeepSpec's training-time block forward (context = all features, mask ``kv < anchor_pos``) and
    its inference sampling (greedy ``VanillaMarkov.sample_block_tokens``, ``predict_confidence_step``)."""
    eps, theta, g = cfg["rms_norm_eps"], cfg["rope_parameters"]["rope_theta"], cfg["block_size"]
    b, s, _ = feats.shape

    def norm(x, w):
        x32 = x.float()
        return w * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)

    def rope(x, pos):  # x [B, heads, T, hd], pos [B, T]
        inv = 1.0 / theta ** (torch.arange(0, HD, 2, dtype=torch.float32) / HD)
        freqs = pos[..., None].float() * inv
        emb = torch.cat([freqs, freqs], -1)[:, None]
        half = torch.cat([-x[..., HD // 2:], x[..., :HD // 2]], -1)
        return x * emb.cos() + half * emb.sin()

    def linear(x, key):
        return x @ sd[key].T

    ctx = norm(linear(feats, "fc.weight"), sd["hidden_norm.weight"])
    ids = torch.full((b, g), cfg["mask_token_id"], dtype=torch.long)
    ids[:, 0] = anchor
    h = sd["embed_tokens.weight"][ids]
    pos_ctx = torch.arange(s)[None].expand(b, s)
    pos_blk = anchor_pos[:, None] + torch.arange(g)[None]
    visible = torch.cat([pos_ctx < anchor_pos[:, None], torch.ones(b, g, dtype=torch.bool)], 1)  # [B, S+G]
    for i in range(cfg["num_hidden_layers"]):
        p = f"layers.{i}."
        x = norm(h, sd[p + "input_layernorm.weight"])
        q = norm(linear(x, p + "self_attn.q_proj.weight").view(b, g, H, HD), sd[p + "self_attn.q_norm.weight"])
        k = torch.cat([linear(ctx, p + "self_attn.k_proj.weight"), linear(x, p + "self_attn.k_proj.weight")], 1)
        v = torch.cat([linear(ctx, p + "self_attn.v_proj.weight"), linear(x, p + "self_attn.v_proj.weight")], 1)
        k = norm(k.view(b, s + g, H_KV, HD), sd[p + "self_attn.k_norm.weight"]).transpose(1, 2)
        v = v.view(b, s + g, H_KV, HD).transpose(1, 2)
        q, k = rope(q.transpose(1, 2), pos_blk), rope(k, torch.cat([pos_ctx, pos_blk], 1))
        k, v = k.repeat_interleave(H // H_KV, 1), v.repeat_interleave(H // H_KV, 1)
        scores = (q @ k.transpose(-1, -2)) * HD**-0.5
        scores = scores.masked_fill(~visible[:, None, None, :], float("-inf"))
        attn = (torch.softmax(scores.float(), -1) @ v).transpose(1, 2).reshape(b, g, H * HD)
        h = h + linear(attn, p + "self_attn.o_proj.weight")
        x = norm(h, sd[p + "post_attention_layernorm.weight"])
        up = torch.nn.functional.silu(linear(x, p + "mlp.gate_proj.weight")) * linear(x, p + "mlp.up_proj.weight")
        h = h + linear(up, p + "mlp.down_proj.weight")
    h = norm(h, sd["norm.weight"])
    base = linear(h, "lm_head.weight")
    w1, prev, tokens, logits = sd["markov_head.markov_w1.weight"], anchor, [], []
    for step in range(g):
        step_logits = base[:, step] + linear(w1[prev], "markov_head.markov_w2.weight")
        logits.append(step_logits)
        prev = step_logits.argmax(-1)
        tokens.append(prev)
    tokens = torch.stack(tokens, 1)
    prev_ids = torch.cat([anchor[:, None], tokens[:, :-1]], 1)
    features = torch.cat([h, w1[prev_ids]], -1)
    conf_logit = linear(features, "confidence_head.proj.weight") + sd["confidence_head.proj.bias"]
    return tokens, torch.stack(logits, 1), torch.sigmoid(conf_logit[..., 0])


@pytest.mark.torch
def test_draft_block_matches_pytorch_reference(tmp_path):
    torch = pytest.importorskip("torch")
    cfg = deepspec_config()
    state = random_state(deepspec_shapes(), seed=3, scale=0.3)
    torch.save({k: torch.from_numpy(v) for k, v in state.items()}, str(tmp_path / "pytorch_model.bin"))
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    drafter, shared = deepspec.load_deepspec(str(tmp_path))               # the weights-only .bin path

    rng = np.random.default_rng(4)
    b, s = 2, 9
    hidden = rng.normal(size=(len(IDS), b, s, D)).astype(np.float32)      # target features, layer by layer
    anchor_pos, anchor = np.array([9, 5]), np.array([7, 60])
    context = drafter.append_context(drafter.init_context(b, 16), hidden, anchor_pos)
    out = drafter.draft(context, anchor, shared)

    sd = {k: torch.from_numpy(v) for k, v in state.items()}
    feats = torch.from_numpy(np.concatenate(list(hidden), axis=-1))      # torch.cat(hidden_states[l+1], -1)
    tokens, logits, confidence = _torch_block(torch, sd, cfg, feats, torch.from_numpy(anchor_pos),
                                              torch.from_numpy(anchor))
    np.testing.assert_allclose(out.logits, logits.numpy(), atol=2e-5, rtol=1e-5)
    np.testing.assert_array_equal(out.tokens, tokens.numpy())
    np.testing.assert_allclose(out.confidence, confidence.numpy(), atol=1e-6)
