"""Writes this folder: a tiny random Qwen3.5 checkpoint with an MTP head, and what SpecForge's own MTP forward gives.

    python tests/data/mtp_qwen3_5/make_fixture.py SPECFORGE_MTP_MODULE_DIR

SPECFORGE_MTP_MODULE_DIR holds ``sf_qwen3_5_mtp.py``: the model classes of SpecForge's
``specforge/modeling/draft/mtp/qwen3_5.py`` (README.md names the commit). The target is transformers' own
``Qwen3_5ForCausalLM``; its ``save_pretrained`` drops ``mtp.*``, so the MTP head's tensors are added to
``model.safetensors`` under the names Qwen3.5 checkpoints use. ``expected.npz`` holds the input ids, the target's
``hidden_states[-1]`` (after its final norm) and the MTP logits of slots 0..T-2 (token i + 1 with hidden state i at
position i), all float32.
"""

import os
import sys

import numpy as np
import torch
import transformers
from safetensors.torch import load_file, save_file

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, sys.argv[1])
from sf_qwen3_5_mtp import Qwen3_5MTPModel  # noqa: E402
from transformers.models.qwen3.modeling_qwen3 import ALL_ATTENTION_FUNCTIONS, eager_attention_forward  # noqa: E402
from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5DecoderLayer, Qwen3_5RMSNorm  # noqa: E402


def eager_heads_first(module, query, key, value, attention_mask, scaling, dropout=0.0, **kwargs):
    """transformers' eager attention returning [B, H, T, D], the layout SpecForge's MTP attention expects of its
    attention function (it transposes to [B, T, H, D] itself). transformers >= 4.48's functions already return
    [B, T, H, D], and the second transpose then mixes positions into heads wherever T > 1."""
    out, weights = eager_attention_forward(module, query, key, value, attention_mask, scaling, dropout, **kwargs)
    return out.transpose(1, 2), weights


ALL_ATTENTION_FUNCTIONS["eager_heads_first"] = eager_heads_first

torch.manual_seed(0)
TARGET = dict(vocab_size=101, hidden_size=32, intermediate_size=40, num_hidden_layers=4, num_attention_heads=4,
              num_key_value_heads=2, head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
              linear_key_head_dim=8, linear_value_head_dim=8, rms_norm_eps=1e-6, tie_word_embeddings=False,
              layer_types=["linear_attention"] * 3 + ["full_attention"], initializer_range=0.2,
              rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25},
              mtp_num_hidden_layers=1, eos_token_id=None)
config = transformers.Qwen3_5TextConfig(**TARGET)
target = transformers.Qwen3_5ForCausalLM(config).eval()
with torch.no_grad():  # transformers starts every norm at its identity; move them so that each one shows
    for name, p in target.named_parameters():
        if name.endswith("norm.weight"):
            p.add_(0.3 * torch.randn_like(p))
target.save_pretrained(HERE, safe_serialization=True)

mtp_config = transformers.Qwen3Config(
    vocab_size=101, hidden_size=32, intermediate_size=40, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
    rms_norm_eps=1e-6, attention_bias=False, attention_dropout=0.0)
mtp_config.attn_output_gate = True
mtp_config.rope_theta = 10000.0
mtp_config.partial_rotary_factor = 0.25
mtp_config._attn_implementation = "eager_heads_first"
mtp = Qwen3_5MTPModel(mtp_config).eval()
with torch.no_grad():
    for name, p in mtp.named_parameters():
        if name.endswith("norm.weight") or "norm" in name.split(".")[-2]:
            p.normal_(0.0, 0.3)          # the (1 + w) norms, away from zero so the convention shows
    mtp.lm_head.weight.copy_(target.lm_head.weight)  # the MTP head shares the target's LM head

tensors = load_file(os.path.join(HERE, "model.safetensors"))
tensors.update({f"mtp.{k}": v.contiguous() for k, v in mtp.state_dict().items() if not k.startswith("lm_head")})
save_file(tensors, os.path.join(HERE, "model.safetensors"), metadata={"format": "pt"})

ids = torch.randint(0, 101, (2, 10), generator=torch.Generator().manual_seed(1))
with torch.no_grad():
    hidden = target(ids, output_hidden_states=True).hidden_states[-1]                  # after the final norm
    out = mtp(target.model.embed_tokens(ids[:, 1:]), hidden[:, :-1],
              position_ids=torch.arange(ids.shape[1] - 1)[None].expand(2, -1))
    logits = mtp.lm_head(out)

# A second reference, from transformers' own modules: the MTP layer is a Qwen3.5 gated attention decoder layer (as
# vLLM and SGLang build it), between the same norms and fc. The two must agree.
layer = Qwen3_5DecoderLayer(config, layer_idx=3).eval()
layer.load_state_dict({k[len("layers.0."):]: v for k, v in mtp.state_dict().items() if k.startswith("layers.0.")})
norms = {}
for name in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm"):
    norms[name] = Qwen3_5RMSNorm(32, eps=1e-6)
    norms[name].load_state_dict(getattr(mtp, name).state_dict())
with torch.no_grad():
    x = mtp.fc(torch.cat([norms["pre_fc_norm_embedding"](target.model.embed_tokens(ids[:, 1:])),
                          norms["pre_fc_norm_hidden"](hidden[:, :-1])], dim=-1))
    positions = torch.arange(ids.shape[1] - 1)[None].expand(2, -1)
    causal = torch.full((9, 9), float("-inf")).triu(1)[None, None].expand(2, 1, 9, 9)
    x = layer(x, position_embeddings=target.model.rotary_emb(x, positions), attention_mask=causal,
              position_ids=positions)
    x = x[0] if isinstance(x, tuple) else x
    second = target.lm_head(norms["norm"](x))
agreement = (second - logits).abs().max().item()
assert agreement < 1e-5, agreement
print("SpecForge's forward and transformers' modules agree to", agreement)
np.savez(os.path.join(HERE, "expected.npz"), input_ids=ids.numpy().astype(np.int32),
         target_hidden=hidden.numpy().astype(np.float32), mtp_logits=logits.numpy().astype(np.float32))
print("wrote", HERE, sorted(k for k in tensors if k.startswith("mtp.")))
