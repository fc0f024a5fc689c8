"""MoE MTP heads: tiny Qwen3-Next and Qwen3.5-MoE checkpoints made by transformers, whose MTP layer carries the sparse
MoE, with the head's logits from a reference built of transformers' own modules the way vLLM and SGLang build it
(tests/data/mtp_qwen3_next/README.md, tests/data/mtp_qwen3_5_moe/README.md). Here: our logits equal the reference's,
whichever expert layout the head is stored in (one tensor per expert or fused), the target's own layout being read
apart from the head's; greedy speculative output with the head equals AR; and the controls that make the comparison
able to fail (experts swapped, gate and up halves swapped, the layer read as a dense MLP)."""

import json
import os
import shutil

import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

import ready_jax as rj
from ready_jax import mtp as mtp_lib
from ready_jax.drafter import SharedWeights
from ready_jax.target_steps import final_norm

DATA = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data")
FAMILIES = ("qwen3_next", "qwen3_5_moe")
HEAD_EXPERTS = "mtp.layers.0.mlp.experts"


def _fixture_dir(family: str) -> str:
    return os.path.join(DATA, f"mtp_{family}")


@pytest.fixture(scope="module", params=FAMILIES)
def fixture(request):
    path = _fixture_dir(request.param)
    expected = dict(np.load(os.path.join(path, "expected.npz")))
    return request.param, rj.Target.from_hf(path), rj.MTPDrafter.from_hf(path), expected


def _slot_logits(target, mtp, ids, hidden) -> np.ndarray:
    """The MTP head's logits of slots 0..T-2 (token i + 1 with hidden state i), as one pass from an empty cache."""
    shared = SharedWeights.from_target(target)
    cache = mtp_lib.init_cache(mtp.config, ids.shape[0], ids.shape[1] + 8)
    out, _ = mtp_lib.extend(mtp.graphdef, mtp.params, shared, cache, jnp.asarray(ids[:, 1:]), jnp.asarray(hidden),
                            jnp.zeros((ids.shape[0],), jnp.int32))
    return np.asarray(shared.logits(out), np.float32)


def _normed_hidden(target, ids) -> np.ndarray:
    last = target.config.num_hidden_layers - 1
    hidden = target.prefill(target.init_cache(*ids.shape), ids, hidden_layers=(last,)).hidden[0]
    return np.asarray(final_norm(target.graphdef, target.params, hidden))


def test_the_head_is_the_sparse_moe(fixture):
    """The family's rule gives the head's layer the MoE (vLLM's rule, layer 0 of the head), as the checkpoint holds."""
    _, _, mtp, _ = fixture
    assert mtp.config.layer_config.is_moe_layer(0)
    assert "layers.0.mlp.expert_gate" in mtp.flat_params and "layers.0.mlp.gate_proj.kernel" not in mtp.flat_params


def test_the_heads_logits_equal_the_reference(fixture):
    _, target, mtp, expected = fixture
    ids = expected["input_ids"]
    normed = _normed_hidden(target, ids)
    np.testing.assert_allclose(normed, expected["target_hidden"], atol=2e-4)          # HF's hidden_states[-1]
    logits = _slot_logits(target, mtp, ids, expected["target_hidden"][:, :-1])
    assert np.abs(logits - expected["mtp_logits"]).max() < 1e-5
    np.testing.assert_array_equal(logits.argmax(-1), expected["mtp_logits"].argmax(-1))
    end_to_end = _slot_logits(target, mtp, ids, normed[:, :-1])
    assert np.abs(end_to_end - expected["mtp_logits"]).max() < 1e-3


def _per_expert(tensors: dict, prefix: str) -> None:
    """Fused ``{prefix}.gate_up_proj`` [E, 2I, D] / ``down_proj`` [E, D, I] -> one nn.Linear weight per expert."""
    gate_up, down = tensors.pop(f"{prefix}.gate_up_proj"), tensors.pop(f"{prefix}.down_proj")
    inter = gate_up.shape[1] // 2
    for e in range(gate_up.shape[0]):
        tensors[f"{prefix}.{e}.gate_proj.weight"] = np.ascontiguousarray(gate_up[e, :inter])
        tensors[f"{prefix}.{e}.up_proj.weight"] = np.ascontiguousarray(gate_up[e, inter:])
        tensors[f"{prefix}.{e}.down_proj.weight"] = np.ascontiguousarray(down[e])


def _fused(tensors: dict, prefix: str) -> None:
    """The inverse of :func:`_per_expert`."""
    count = len({k for k in tensors if k.startswith(prefix + ".") and k.endswith(".down_proj.weight")})
    take = lambda e, n: tensors.pop(f"{prefix}.{e}.{n}_proj.weight")  # noqa: E731
    tensors[f"{prefix}.gate_up_proj"] = np.stack([np.concatenate([take(e, "gate"), take(e, "up")])
                                                  for e in range(count)])
    tensors[f"{prefix}.down_proj"] = np.stack([take(e, "down") for e in range(count)])


def _other_layout(tensors: dict, prefix: str) -> None:
    (_fused if f"{prefix}.gate_up_proj" not in tensors else _per_expert)(tensors, prefix)


def _copy(tmp_path, family: str, edit_tensors=None, edit_config=None) -> str:
    path = str(tmp_path / family)
    shutil.copytree(_fixture_dir(family), path)
    if edit_tensors:
        tensors = load_file(os.path.join(path, "model.safetensors"))
        edit_tensors(tensors)
        save_file(tensors, os.path.join(path, "model.safetensors"))
    if edit_config:
        with open(os.path.join(path, "config.json")) as f:
            config = json.load(f)
        edit_config(config)
        with open(os.path.join(path, "config.json"), "w") as f:
            json.dump(config, f)
    return path


@pytest.mark.parametrize("family", FAMILIES)
def test_both_expert_layouts_give_the_same_head_and_the_targets_layout_is_its_own(tmp_path, family):
    """The head stored with the other expert layout (per-expert <-> fused) gives the same parameters bit for bit; the
    target, still in its own layout beside it, loads as before (each is read by its own keys)."""
    original = rj.MTPDrafter.from_hf(_fixture_dir(family))
    path = _copy(tmp_path, family, edit_tensors=lambda t: _other_layout(t, HEAD_EXPERTS))
    held = load_file(os.path.join(path, "model.safetensors"))
    fused_head = f"{HEAD_EXPERTS}.gate_up_proj" in held
    assert fused_head == (family == "qwen3_next")                   # the fixture's own layout was the other one
    assert any(k.endswith(".mlp.experts.gate_up_proj") for k in held if k.startswith("model.")) != fused_head
    other = rj.MTPDrafter.from_hf(path)
    for key, value in original.flat_params.items():
        np.testing.assert_array_equal(np.asarray(other.flat_params[key]), np.asarray(value), err_msg=key)
    target, reference = rj.Target.from_hf(path), rj.Target.from_hf(_fixture_dir(family))
    ids = np.load(os.path.join(_fixture_dir(family), "expected.npz"))["input_ids"]
    np.testing.assert_array_equal(np.asarray(target.forward(ids)), np.asarray(reference.forward(ids)))


def _swap_experts(tensors: dict) -> None:
    """Experts 0 and 1 of the head trade places (their router rows stay): a table that misnumbered experts."""
    if f"{HEAD_EXPERTS}.gate_up_proj" in tensors:
        for name in ("gate_up_proj", "down_proj"):
            tensors[f"{HEAD_EXPERTS}.{name}"] = tensors[f"{HEAD_EXPERTS}.{name}"][[1, 0, 2, 3]].copy()
        return
    for name in ("gate", "up", "down"):
        a, b = (f"{HEAD_EXPERTS}.{e}.{name}_proj.weight" for e in (0, 1))
        tensors[a], tensors[b] = tensors[b], tensors[a]


def _swap_gate_and_up(tensors: dict) -> None:
    """The head's gate and up projections exchanged in every expert: a fused split read the wrong way round."""
    if f"{HEAD_EXPERTS}.gate_up_proj" in tensors:
        gate, up = np.split(tensors[f"{HEAD_EXPERTS}.gate_up_proj"], 2, axis=1)
        tensors[f"{HEAD_EXPERTS}.gate_up_proj"] = np.ascontiguousarray(np.concatenate([up, gate], axis=1))
        return
    for e in range(4):
        a, b = (f"{HEAD_EXPERTS}.{e}.{name}_proj.weight" for name in ("gate", "up"))
        tensors[a], tensors[b] = tensors[b], tensors[a]


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("edit", [_swap_experts, _swap_gate_and_up], ids=["experts swapped", "gate and up swapped"])
def test_each_expert_convention_read_the_other_way_changes_the_logits(tmp_path, family, edit):
    """The controls that make the comparison able to fail: the routed experts are reached and told apart."""
    expected = dict(np.load(os.path.join(_fixture_dir(family), "expected.npz")))
    path = _copy(tmp_path, family, edit_tensors=edit)
    target, mtp = rj.Target.from_hf(path), rj.MTPDrafter.from_hf(path)
    logits = _slot_logits(target, mtp, expected["input_ids"], expected["target_hidden"][:, :-1])
    assert np.abs(logits - expected["mtp_logits"]).max() > 1e-2


def test_a_head_read_as_a_dense_mlp_is_refused_with_the_keys_named(tmp_path):
    """Qwen3-Next's rule decides the head's MLP: declare layer 0 dense (mlp_only_layers) and the table asks for a
    dense MLP the checkpoint does not hold, naming both sides."""
    path = _copy(tmp_path, "qwen3_next", edit_config=lambda c: c.update(mlp_only_layers=[0, 1]))
    with pytest.raises(ValueError, match=r"(?s)missing mtp\.layers\.0\.mlp\.gate_proj\.weight.*"
                                         r"unexpected mtp\.layers\.0\.mlp\.experts\.0\.down_proj\.weight"):
        rj.MTPDrafter.from_hf(path)


def test_a_qwen3_next_config_without_the_mtp_field_reads_the_head_its_tensors_hold(tmp_path):
    """Released Qwen3-Next configs declare no MTP layer count (the serving engines default to one) yet ship
    ``mtp.*``: the head is read from what the tensors hold."""
    path = _copy(tmp_path, "qwen3_next", edit_config=lambda c: c.pop("mtp_num_hidden_layers"))
    head = rj.MTPDrafter.from_hf(path)
    for key, value in rj.MTPDrafter.from_hf(_fixture_dir("qwen3_next")).flat_params.items():
        np.testing.assert_array_equal(np.asarray(head.flat_params[key]), np.asarray(value), err_msg=key)


def test_greedy_output_with_the_checkpoints_moe_head_equals_ar(fixture):
    _, target, mtp, expected = fixture
    prompts = [expected["input_ids"][0], expected["input_ids"][1, :4]]
    ar = rj.generate(target, prompts, 16)
    spec = rj.generate(target, prompts, 16, drafter=mtp.with_steps(2))
    np.testing.assert_array_equal(spec.tokens, ar.tokens)
