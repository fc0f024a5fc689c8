"""Writes tests/data/mtp_qwen3_next and tests/data/mtp_qwen3_5_moe: a tiny random MoE target with an MTP head whose
layer carries the sparse MoE, and that head's logits from a reference built of transformers' own modules.

    python tests/data/make_mtp_moe_fixtures.py [qwen3_next] [qwen3_5_moe]

The target is transformers' own ``Qwen3NextForCausalLM`` / ``Qwen3_5MoeForCausalLM`` (float32, random, every norm
moved off its identity). transformers has no MTP module, so the head is assembled from its modules the way the
serving engines assemble it (vLLM's ``qwen3_next_mtp.py`` and ``qwen3_5_mtp.py``, SGLang's Qwen3-Next / Qwen3.5 MTP):
``pre_fc_norm_embedding`` and ``pre_fc_norm_hidden`` (the family's zero-centred RMSNorm), ``fc`` (2D -> D, no bias)
over ``cat(embedding, hidden)``, one decoder layer of the family built at a full-attention index (so it is a gated
attention layer with the sparse MoE), ``norm``, and the target's LM head. Slot i reads token i + 1 and the target's
``hidden_states[-1]`` (after its final norm) at position i, at position i.

``model.safetensors`` gets the head's tensors under the names checkpoints of the family use: Qwen3-Next one tensor
per expert (``mtp.layers.0.mlp.experts.{e}.gate_proj.weight``), Qwen3.5-MoE fused (``mtp.layers.0.mlp.experts.
gate_up_proj`` [E, 2I, D], ``down_proj`` [E, D, I]); the target's experts in the same layout as the head's.
``expected.npz``: ``input_ids`` [2, 10], ``target_hidden`` [2, 10, D], ``mtp_logits`` [2, 9, V], float32.
"""

import json
import os
import sys

import numpy as np
import torch
import transformers
from safetensors.torch import load_file, save_file

HERE = os.path.dirname(os.path.abspath(__file__))
VOCAB, HIDDEN, LENGTH = 101, 32, 10
HEAD_SEED = {"qwen3_next": 4, "qwen3_5_moe": 6}  # seeds whose routing keeps clear of near-ties
ATTENTION_LAYER = 3  # the target's gated attention layer; the head's decoder layer is built at this index
COMMON = dict(vocab_size=VOCAB, hidden_size=HIDDEN, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
              head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8,
              linear_value_head_dim=8, rms_norm_eps=1e-6, tie_word_embeddings=False, initializer_range=0.2,
              layer_types=["linear_attention"] * 3 + ["full_attention"], num_experts=4, num_experts_per_tok=2,
              moe_intermediate_size=12, shared_expert_intermediate_size=20, eos_token_id=None,
              rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25})


def family(name: str):
    """(config, causal LM class, decoder layer class, RMSNorm class, experts stored fused?)."""
    if name == "qwen3_next":
        from transformers.models.qwen3_next import modeling_qwen3_next as m
        # Layer 1 dense (mlp_only_layers) so the target mixes both MLP kinds; the MoE rule for the head's layer
        # (vLLM's: index 0 of the head, not in mlp_only_layers, (0 + 1) % decoder_sparse_step == 0) gives the MoE,
        # as transformers' rule does at index 3, the one the reference is built at.
        config = transformers.Qwen3NextConfig(**COMMON, intermediate_size=40, mlp_only_layers=[1],
                                              decoder_sparse_step=1, norm_topk_prob=True)
        return config, transformers.Qwen3NextForCausalLM, m.Qwen3NextDecoderLayer, m.Qwen3NextRMSNorm, False
    if name == "qwen3_5_moe":
        from transformers.models.qwen3_5_moe import modeling_qwen3_5_moe as m
        config = transformers.Qwen3_5MoeTextConfig(**COMMON)
        return config, transformers.Qwen3_5MoeForCausalLM, m.Qwen3_5MoeDecoderLayer, m.Qwen3_5MoeRMSNorm, True
    raise SystemExit(f"unknown family {name!r}: qwen3_next or qwen3_5_moe")


def per_expert(prefix: str, gate_up: torch.Tensor, down: torch.Tensor) -> dict[str, torch.Tensor]:
    """transformers' fused experts (gate_up [E, 2I, D], down [E, D, I]) as one nn.Linear weight per expert."""
    inter = gate_up.shape[1] // 2
    out = {}
    for e in range(gate_up.shape[0]):
        out[f"{prefix}.{e}.gate_proj.weight"] = gate_up[e, :inter].contiguous()
        out[f"{prefix}.{e}.up_proj.weight"] = gate_up[e, inter:].contiguous()
        out[f"{prefix}.{e}.down_proj.weight"] = down[e].contiguous()
    return out


def fused(tensors: dict[str, torch.Tensor], prefix: str, num_experts: int) -> dict[str, torch.Tensor]:
    """Per-expert keys under ``prefix`` -> ``{prefix}.gate_up_proj`` [E, 2I, D] and ``{prefix}.down_proj``."""
    take = lambda e, n: tensors.pop(f"{prefix}.{e}.{n}_proj.weight")  # noqa: E731
    gate_up = torch.stack([torch.cat([take(e, "gate"), take(e, "up")]) for e in range(num_experts)])
    down = torch.stack([take(e, "down") for e in range(num_experts)])
    return {f"{prefix}.gate_up_proj": gate_up, f"{prefix}.down_proj": down}


def build(name: str) -> None:
    out_dir = os.path.join(HERE, f"mtp_{name}")
    os.makedirs(out_dir, exist_ok=True)
    config, causal_lm, decoder_layer, rms_norm, store_fused = family(name)
    torch.manual_seed(0)
    target = causal_lm(config).eval()
    target.set_attn_implementation("eager")
    target.set_experts_implementation("eager")  # the per-expert loop; grouped_mm needs aligned strides
    with torch.no_grad():  # transformers starts every norm at its identity; move them so that each one shows
        for key, p in target.named_parameters():
            if key.endswith("norm.weight"):
                p.add_(0.3 * torch.randn_like(p))
    target.save_pretrained(out_dir, safe_serialization=True)
    with open(os.path.join(out_dir, "config.json")) as f:
        saved = json.load(f)
    saved["mtp_num_hidden_layers"] = 1  # what the family's releases declare (transformers does not write it)
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(saved, f, indent=2, sort_keys=True)
        f.write("\n")

    # The head, from transformers' modules, its weights random and its norms off zero.
    layer = decoder_layer(config, layer_idx=ATTENTION_LAYER).eval()
    assert type(layer.mlp).__name__.endswith("SparseMoeBlock"), type(layer.mlp)
    norms = {n: rms_norm(HIDDEN, eps=config.rms_norm_eps) for n in ("pre_fc_norm_embedding", "pre_fc_norm_hidden",
                                                                     "norm")}
    fc = torch.nn.Linear(2 * HIDDEN, HIDDEN, bias=False)
    gen = torch.Generator().manual_seed(HEAD_SEED[name])
    with torch.no_grad():
        for module in (layer, fc, *norms.values()):
            for key, p in module.named_parameters():
                if key.endswith("norm.weight") or key == "weight" and p.ndim == 1:
                    p.copy_(0.3 * torch.randn(p.shape, generator=gen))       # the (1 + w) norms, off zero
                else:                                                          # fan-in is the last axis
                    p.copy_(torch.randn(p.shape, generator=gen) * p.shape[-1] ** -0.5)

    ids = torch.randint(0, VOCAB, (2, LENGTH), generator=torch.Generator().manual_seed(1))
    routing = []
    layer.mlp.gate.register_forward_hook(lambda module, args, out: routing.append(torch.softmax(out[0], -1)))
    with torch.no_grad():
        hidden = target(ids, output_hidden_states=True).hidden_states[-1]             # after the final norm
        x = fc(torch.cat([norms["pre_fc_norm_embedding"](target.model.embed_tokens(ids[:, 1:])),
                          norms["pre_fc_norm_hidden"](hidden[:, :-1])], dim=-1))
        slots = LENGTH - 1
        positions = torch.arange(slots)[None].expand(2, -1)
        causal = torch.full((slots, slots), float("-inf")).triu(1)[None, None].expand(2, 1, slots, slots)
        x = layer(x, position_embeddings=target.model.rotary_emb(x, positions), attention_mask=causal,
                  position_ids=positions)
        x = x[0] if isinstance(x, tuple) else x
        logits = target.lm_head(norms["norm"](x))
    # Top-k routing must not sit on a near-tie, or float noise far below the test's tolerance flips an expert.
    top = routing[0].sort(-1, descending=True).values
    margin = (top[:, config.num_experts_per_tok - 1] - top[:, config.num_experts_per_tok]).min().item()
    assert margin > 5e-3, f"near-tie in the head's routing ({margin:.2e}); pick another seed"
    print(f"{name}: smallest top-{config.num_experts_per_tok} routing margin of the head {margin:.3f}")

    head = {f"mtp.{n}.weight": norms[n].weight for n in norms}
    head["mtp.fc.weight"] = fc.weight
    state = {f"mtp.layers.0.{k}": v for k, v in layer.state_dict().items()}
    gate_up, down = state.pop("mtp.layers.0.mlp.experts.gate_up_proj"), state.pop("mtp.layers.0.mlp.experts.down_proj")
    state.update(per_expert("mtp.layers.0.mlp.experts", gate_up, down))
    head.update(state)
    tensors = load_file(os.path.join(out_dir, "model.safetensors"))
    tensors.update(head)
    if store_fused:  # the released layout of the family: fused experts, target and head alike
        for prefix in sorted({k.rsplit(".", 3)[0] for k in tensors if ".mlp.experts." in k}):
            tensors.update(fused(tensors, prefix, config.num_experts))
    save_file({k: v.detach().contiguous() for k, v in tensors.items()}, os.path.join(out_dir, "model.safetensors"),
              metadata={"format": "pt"})
    np.savez(os.path.join(out_dir, "expected.npz"), input_ids=ids.numpy().astype(np.int32),
             target_hidden=hidden.numpy().astype(np.float32), mtp_logits=logits.numpy().astype(np.float32))
    print("wrote", out_dir, len(tensors), "tensors,", sum(k.startswith("mtp.") for k in tensors), "of the head")


if __name__ == "__main__":
    for name in sys.argv[1:] or ["qwen3_next", "qwen3_5_moe"]:
        build(name)
