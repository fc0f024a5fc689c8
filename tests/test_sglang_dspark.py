"""SGLang DSpark draft conversion: the config readers (every place a field may sit, the engine's capture ids),
the strict table, round trips, the command line, and one draft block against a PyTorch forward written from
SGLang's ``DSparkDraftModel`` with target features taken at its capture points.

The reference is written here from SGLang 0.5.23's source (``models/dspark.py``, ``models/dflash.py``) rather
than run: its layers import CUDA-only kernels (``sgl_kernel``, ``sglang.kernels``), its config readers import
``triton`` at module level, and its attention runs through ``RadixAttention`` on a GPU backend over a paged KV
pool, none of which exists in a CPU environment. The reference keeps SGLang's structure: fused ``qkv_proj`` and
``gate_up_proj`` (stacked from the file's names as its loader does), the fused residual + RMSNorm, context K/V
written through ``kv_proj_only`` / ``apply_k_norm`` / ``apply_k_rope`` into a pool the block then attends over
non-causally, ``run_markov_block`` and ``DSparkConfidenceHead.predict``."""

import json

import numpy as np
import pytest
from safetensors.numpy import save_file

from convert import sglang_dspark
from ready_jax.drafter import Drafter, SharedWeights

D, V, H, H_KV, HD, FF, R_M, L_T = 32, 97, 4, 2, 8, 48, 8, 8   # the tiny target's sizes
IDS = (1, 4, 6)


def sglang_config(**overrides) -> dict:
    """A draft config as SGLang's DSpark drafts are published: draft fields at the top level and again under
    ``dspark_config``, ``rope_theta`` beside ``rope_parameters``."""
    base = dict(architectures=["DSparkDraftModel"], model_type="qwen3", hidden_size=D, intermediate_size=FF,
                num_attention_heads=H, num_key_value_heads=H_KV, head_dim=HD, num_hidden_layers=2,
                rms_norm_eps=1e-6, rope_theta=10000.0, rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
                vocab_size=V, hidden_act="silu", attention_bias=False, layer_types=["full_attention"] * 2,
                max_position_embeddings=4096, dtype="bfloat16", block_size=4, mask_token_id=V - 1,
                target_layer_ids=list(IDS), num_target_layers=L_T, enable_confidence_head=True,
                confidence_head_with_markov=True, markov_rank=R_M, markov_head_type="vanilla",
                dspark_config={"markov_rank": R_M, "mask_token_id": V - 1, "target_layer_ids": list(IDS)})
    base.update(overrides)
    return base


def sglang_shapes(num_layers=2, confidence=True) -> dict[str, tuple[int, ...]]:
    """The keys of an SGLang DSpark draft file: DeepSpec's names without the shared embedding and LM head."""
    shapes = {"fc.weight": (D, len(IDS) * D), "hidden_norm.weight": (D,), "norm.weight": (D,),
              "markov_head.markov_w1.weight": (V, R_M), "markov_head.markov_w2.weight": (V, R_M)}
    for i in range(num_layers):
        p = f"layers.{i}."
        shapes.update({p + "input_layernorm.weight": (D,), p + "post_attention_layernorm.weight": (D,),
                       p + "self_attn.q_proj.weight": (H * HD, D), p + "self_attn.k_proj.weight": (H_KV * HD, D),
                       p + "self_attn.v_proj.weight": (H_KV * HD, D), p + "self_attn.o_proj.weight": (D, H * HD),
                       p + "self_attn.q_norm.weight": (HD,), p + "self_attn.k_norm.weight": (HD,),
                       p + "mlp.gate_proj.weight": (FF, D), p + "mlp.up_proj.weight": (FF, D),
                       p + "mlp.down_proj.weight": (D, FF)})
    if confidence:
        shapes.update({"confidence_head.proj.weight": (1, D + R_M), "confidence_head.proj.bias": (1,)})
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


# ---- config ------------------------------------------------------------------------------------------------------
def test_published_layout_reads_and_round_trips():
    cfg = sglang_dspark.config_from_sglang(sglang_config())
    assert (cfg.block_size, cfg.target_layer_ids, cfg.mask_token_id, cfg.markov_rank) == (4, IDS, V - 1, R_M)
    assert cfg.confidence_head and cfg.confidence_with_markov and cfg.resolved
    assert sglang_dspark.config_from_sglang(sglang_dspark.config_to_sglang(cfg)) == cfg


@pytest.mark.parametrize("fields", [
    dict(dflash_config={"block_size": 4, "mask_token_id": V - 1, "target_layer_ids": list(IDS)}),
    dict(dspark_block_size=4, dspark_noise_token_id=V - 1, dspark_target_layer_ids=list(IDS), dspark_markov_rank=R_M),
])
def test_draft_fields_are_read_wherever_sglang_reads_them(fields):
    raw = sglang_config(**fields)
    for name in ("block_size", "mask_token_id", "target_layer_ids", "dspark_config"):
        raw.pop(name)
    raw["dspark_config"] = {"markov_rank": R_M}
    del raw["markov_rank"]
    cfg = sglang_dspark.config_from_sglang(raw)
    assert (cfg.block_size, cfg.target_layer_ids, cfg.mask_token_id, cfg.markov_rank) == (4, IDS, V - 1, R_M)


def test_disagreeing_places_are_refused_not_resolved_by_precedence():
    raw = sglang_config(dspark_target_layer_ids=[2, 4, 6])
    with pytest.raises(ValueError, match=r"target_layer_ids is given as .*dspark_target_layer_ids=\[2, 4, 6\]"):
        sglang_dspark.config_from_sglang(raw)


def test_engine_capture_ids_are_one_past_the_layer_outputs():
    """``aux_hidden_state_layer_ids`` name the residual stream *entering* a layer: the output of the one before."""
    raw = sglang_config(aux_hidden_state_layer_ids=[i + 1 for i in IDS])
    for name in ("target_layer_ids", "dspark_config"):
        raw.pop(name)
    assert sglang_dspark.config_from_sglang(raw).target_layer_ids == IDS
    with pytest.raises(ValueError, match=r"must be target_layer_ids \[1, 4, 6\] \+ 1"):
        sglang_dspark.config_from_sglang(sglang_config(eagle_aux_hidden_state_layer_ids=list(IDS)))


@pytest.mark.parametrize("overrides, message", [
    (dict(rope_parameters={"rope_type": "yarn", "rope_theta": 1e4, "factor": 32.0}), "RoPE scaling"),
    (dict(rope_scaling={"rope_type": "yarn", "factor": 32.0}), "rope_scaling"),
    (dict(markov_head_type="gated"), "markov_head_type 'gated'"),
    (dict(markov_rank=0, dspark_config={}), "needs a Markov head"),
    (dict(architectures=["DFlashDraftModel"]), "only DSparkDraftModel"),
    (dict(speculators_model_type="dspark"), "speculators_model_type"),
    (dict(layer_types=["sliding_attention"] * 2, sliding_window=64), "only full_attention"),
    (dict(use_gemma_norm=True), "use_gemma_norm"),
    (dict(is_causal=True), "is_causal"),
    (dict(sample_from_anchor=False), "sample_from_anchor"),
    (dict(draft_vocab_size=32), "draft_vocab_size"),
    (dict(dflash_config={"attention_sink_bias": True}), "dflash_config.attention_sink_bias"),
    (dict(rope_theta=1e6), "rope_theta differ"),
])
def test_unsupported_configs_are_errors(overrides, message):
    with pytest.raises(ValueError, match=message):
        sglang_dspark.config_from_sglang(sglang_config(**overrides))


# ---- weights -----------------------------------------------------------------------------------------------------
def test_convert_then_export_is_identity():
    cfg = sglang_dspark.config_from_sglang(sglang_config())
    state = random_state(sglang_shapes())
    drafter, shared = sglang_dspark.from_sglang_state(cfg, state)
    assert shared == {}
    _assert_same_state(sglang_dspark.to_sglang_state(drafter), state)


def test_model_prefix_shared_copies_and_rope_buffers_are_accepted():
    cfg = sglang_dspark.config_from_sglang(sglang_config())
    state = {"model." + k: v for k, v in random_state(sglang_shapes()).items()}
    state["lm_head.weight"] = np.zeros((V, D), np.float32)
    state["rotary_emb.inv_freq"] = (1.0 / 10000.0 ** (np.arange(0, HD, 2) / HD)).astype(np.float32)
    drafter, shared = sglang_dspark.from_sglang_state(cfg, state)
    assert list(shared) == ["lm_head.weight"]
    assert sorted(sglang_dspark.to_sglang_state(drafter)) == sorted(sglang_shapes())


def test_all_problems_are_reported_at_once():
    cfg = sglang_dspark.config_from_sglang(sglang_config())
    state = random_state(sglang_shapes())
    del state["layers.1.mlp.up_proj.weight"]
    state["layers.0.self_attn.k_proj.weight"] = state["layers.0.self_attn.k_proj.weight"].T
    state["model.fc.weight"] = state["fc.weight"]
    state["layers.0.self_attn.gate_proj.weight"] = np.zeros(4, np.float32)
    state["rotary_emb.inv_freq"] = np.ones(HD // 2, np.float32)
    with pytest.raises(ValueError, match="5 problem") as err:
        sglang_dspark.from_sglang_state(cfg, state)
    for needle in ("missing layers.1.mlp.up_proj.weight",
                   "misshaped layers.0.self_attn.k_proj.weight: expected (16, 32), got (32, 16)",
                   "name the same tensor", "unexpected layers.0.self_attn.gate_proj.weight",
                   "rotary_emb.inv_freq does not hold the RoPE frequencies"):
        assert needle in str(err.value)


def test_command_line_round_trip(tiny_target, tmp_path, capsys):
    state = random_state(sglang_shapes())
    src, mine, back, target_dir = (tmp_path / n for n in ("sglang", "mine", "back", "target"))
    src.mkdir()
    save_file(state, str(src / "model.safetensors"))
    (src / "config.json").write_text(json.dumps(sglang_config()))
    tiny_target.save(str(target_dir))
    assert sglang_dspark.main([str(src), str(mine), "--target", str(target_dir)]) == 0
    assert Drafter.load(str(mine)).config == sglang_dspark.config_from_sglang(sglang_config())
    assert sglang_dspark.main(["--export", str(mine), str(back), "--target", str(target_dir)]) == 0
    written = json.loads((back / "config.json").read_text())
    assert written["max_position_embeddings"] == tiny_target.config.max_position_embeddings
    assert sglang_dspark.config_from_sglang(written) == Drafter.load(str(mine)).config
    back_drafter, shared = sglang_dspark.load_sglang(str(back))
    _assert_same_state(sglang_dspark.to_sglang_state(back_drafter), state)

    state["embed_tokens.weight"] = np.ones((V, D), np.float32)
    save_file(state, str(src / "model.safetensors"))
    assert sglang_dspark.main([str(src), str(tmp_path / "other"), "--target", str(target_dir)]) == 1
    assert "trained for another target" in capsys.readouterr().err


# ---- numerics against a PyTorch forward written from SGLang's DSparkDraftModel -----------------------------------
def _sglang_block(torch, sd, cfg, embedding, lm_head, captured, prefix_len, bonus):
    """One DSpark proposal as SGLang computes it. ``captured`` [B, S, n*D]: the target's aux hidden states,
    concatenated; ``prefix_len`` [B] committed tokens; ``bonus`` [B] the anchor (the target's own token)."""
    eps, theta, g = cfg["rms_norm_eps"], cfg["rope_theta"], cfg["block_size"]
    b, s, _ = captured.shape
    q_size, kv_size = H * HD, H_KV * HD

    def rms(x, w, residual=None):  # RMSNorm(x) or RMSNorm(x, residual) -> (normed, x + residual)
        if residual is not None:
            x = x + residual
        x32 = x.float()
        out = w * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
        return out if residual is None else (out, x)

    def rope(x, pos):  # get_rope(is_neox_style=True): x [B, T, heads, hd], pos [B, T]
        inv = 1.0 / theta ** (torch.arange(0, HD, 2, dtype=torch.float32) / HD)
        freqs = pos[..., None].float() * inv
        cos, sin = freqs.cos()[:, :, None], freqs.sin()[:, :, None]
        x1, x2 = x[..., :HD // 2], x[..., HD // 2:]
        return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1)

    def fused(i, parts):  # the loader's stacked_params_mapping: shards concatenated along the output dim
        return torch.cat([sd[f"layers.{i}.{p}.weight"] for p in parts], 0)

    # write_target_hidden_kv: project_target_hidden, then per layer kv_proj_only + k_norm + k rope into the pool
    ctx = rms(captured @ sd["fc.weight"].T, sd["hidden_norm.weight"])
    pos_ctx = torch.arange(s)[None].expand(b, s)
    pool_k, pool_v = [], []
    for i in range(cfg["num_hidden_layers"]):
        kv = ctx @ fused(i, ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"])[q_size:].T
        k, v = kv.split([kv_size, kv_size], -1)
        k = rms(k.reshape(b, s, H_KV, HD), sd[f"layers.{i}.self_attn.k_norm.weight"])
        pool_k.append(rope(k, pos_ctx))
        pool_v.append(v.reshape(b, s, H_KV, HD))

    ids = torch.full((b, g), cfg["mask_token_id"], dtype=torch.long)
    ids[:, 0] = bonus
    hidden, residual = embedding[ids], None
    pos_blk = prefix_len[:, None] + torch.arange(g)[None]
    # the pool holds prefix_len committed tokens per row, then the block's own g slots (ENCODER_ONLY: all visible)
    visible = torch.cat([pos_ctx < prefix_len[:, None], torch.ones(b, g, dtype=torch.bool)], 1)
    for i in range(cfg["num_hidden_layers"]):
        p = f"layers.{i}."
        if residual is None:
            hidden, residual = rms(hidden, sd[p + "input_layernorm.weight"]), hidden
        else:
            hidden, residual = rms(hidden, sd[p + "input_layernorm.weight"], residual)
        qkv = hidden @ fused(i, ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"]).T
        q, k, v = qkv.split([q_size, kv_size, kv_size], -1)
        q = rope(rms(q.reshape(b, g, H, HD), sd[p + "self_attn.q_norm.weight"]), pos_blk)
        k = rope(rms(k.reshape(b, g, H_KV, HD), sd[p + "self_attn.k_norm.weight"]), pos_blk)
        keys = torch.cat([pool_k[i], k], 1).repeat_interleave(H // H_KV, 2)
        values = torch.cat([pool_v[i], v.reshape(b, g, H_KV, HD)], 1).repeat_interleave(H // H_KV, 2)
        scores = torch.einsum("bqhd,bkhd->bhqk", q, keys) * HD**-0.5
        scores = scores.masked_fill(~visible[:, None, None, :], float("-inf"))
        attn = torch.einsum("bhqk,bkhd->bqhd", torch.softmax(scores.float(), -1), values).reshape(b, g, q_size)
        hidden, residual = rms(attn @ sd[p + "self_attn.o_proj.weight"].T, sd[p + "post_attention_layernorm.weight"],
                               residual)
        gate, up = (hidden @ fused(i, ["mlp.gate_proj", "mlp.up_proj"]).T).split([FF, FF], -1)
        hidden = (torch.nn.functional.silu(gate) * up) @ sd[p + "mlp.down_proj.weight"].T
    hidden, _ = rms(hidden, sd["norm.weight"], residual)

    base = hidden @ lm_head.T                                     # compute_base_logits
    w1, w2 = sd["markov_head.markov_w1.weight"], sd["markov_head.markov_w2.weight"]
    prev, tokens, logits = bonus, [], []
    for step in range(g):                                         # run_markov_block, greedy sampler
        step_logits = base[:, step] + w1[prev] @ w2.T
        prev = step_logits.argmax(-1)
        logits.append(step_logits)
        tokens.append(prev)
    tokens = torch.stack(tokens, 1)
    prev_tokens = torch.cat([bonus[:, None], tokens[:, :-1]], 1)  # DSparkConfidenceHead.predict, sts temperature 1
    features = torch.cat([hidden, w1[prev_tokens]], -1)
    raw = features @ sd["confidence_head.proj.weight"].T + sd["confidence_head.proj.bias"]
    return tokens, torch.stack(logits, 1), torch.sigmoid(raw[..., 0])


@pytest.mark.torch
def test_draft_block_matches_sglang_reference_at_its_capture_points(tiny_target, tmp_path):
    """The converted drafter fed the project's layer outputs ``IDS`` equals SGLang's forward fed what its hook
    captures at ``IDS + 1`` (a layer's input); reading the config's ids as capture points instead is wrong."""
    torch = pytest.importorskip("torch")
    cfg = sglang_config()
    state = random_state(sglang_shapes(), seed=3, scale=0.3)
    save_file(state, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    drafter, _ = sglang_dspark.load_sglang(str(tmp_path))

    b, s = 2, 9
    prompts = np.random.default_rng(4).integers(0, V - 1, (b, s)).astype(np.int32)
    every_layer = tiny_target.prefill(tiny_target.init_cache(b, 16), prompts, hidden_layers=range(L_T)).hidden
    layer_outputs = np.asarray(every_layer, np.float32)           # [L_T, B, S, D]: output of layer l

    def capture_before(layer):  # what SGLang's hook captures "before layer i": the output of layer i - 1
        return layer_outputs[layer - 1]

    prefix_len, bonus = np.array([9, 5]), np.array([7, 60])
    context = drafter.append_context(drafter.init_context(b, 16), layer_outputs[list(IDS)], prefix_len)
    shared = SharedWeights.from_target(tiny_target)
    out = drafter.draft(context, bonus, shared)

    sd = {k: torch.from_numpy(v) for k, v in state.items()}
    embedding = torch.from_numpy(np.array(shared.embedding, np.float32))
    lm_head = torch.from_numpy(np.asarray(shared.lm_head, np.float32).T.copy())

    def reference(capture_ids):
        captured = torch.from_numpy(np.concatenate([capture_before(i) for i in capture_ids], -1))
        return _sglang_block(torch, sd, cfg, embedding, lm_head, captured, torch.from_numpy(prefix_len),
                             torch.from_numpy(bonus))

    tokens, logits, confidence = reference([i + 1 for i in IDS])  # set_dflash_layers_to_capture: ids + 1
    np.testing.assert_allclose(out.logits, logits.numpy(), atol=2e-5, rtol=1e-5)
    np.testing.assert_array_equal(out.tokens, tokens.numpy())
    np.testing.assert_allclose(out.confidence, confidence.numpy(), atol=1e-6)

    _, shifted, _ = reference(list(IDS))                          # the off-by-one reading
    assert np.abs(np.asarray(out.logits) - shifted.numpy()).max() > 1e-2
