"""Every public entry point checks its arguments' types before any work and names the wrong one: a model passed
where another goes, a float or bool count, a string or float prompt, a path that is no path, and a scripted
drafter's block beyond the learned drafter's bound (which compiled for minutes)."""

import time

import jax
import numpy as np
import pytest

import ready_jax as rj
from ready_jax.drafter_config import MAX_BLOCK_SIZE

PROMPT = np.array([[3, 4]])


@pytest.fixture(scope="module")
def drafter(tiny_target):
    return rj.Drafter.init(tiny_target.config, rj.DrafterConfig(block_size=3, num_layers=1, markov_rank=8), seed=1)


@pytest.fixture(scope="module")
def context(drafter):
    return drafter.init_context(1, 8)


# ---- generate -------------------------------------------------------------------------------------------------
def test_a_drafter_passed_as_the_target_is_named(drafter):
    """It failed with ``AttributeError: 'DrafterConfig' object has no attribute 'eos_token_ids'``."""
    with pytest.raises(TypeError, match=r"target must be a ready_jax.Target, got Drafter \(pass the drafter as "
                                        r"drafter=\)"):
        rj.generate(drafter, PROMPT, 2)


def test_a_scripted_drafter_passed_as_the_target_is_named():
    with pytest.raises(TypeError, match="target must be a ready_jax.Target, got ScriptedDrafter"):
        rj.generate(rj.ScriptedDrafter(np.zeros((1, 4), np.int32)), PROMPT, 2)


def test_a_target_passed_as_the_drafter_is_named(tiny_target):
    with pytest.raises(TypeError, match=r"drafter must be a ready_jax.Drafter, an MTPDrafter, a ScriptedDrafter or "
                                        r"None, got Target \(the target is the first argument\)"):
        rj.generate(tiny_target, PROMPT, 2, drafter=tiny_target)


@pytest.mark.parametrize("value, shown", [(2.0, "float 2.0"), (True, "bool True"), ("2", "str '2'"),
                                          (None, "NoneType None")])
def test_max_new_tokens_must_be_an_integer(tiny_target, value, shown):
    with pytest.raises(TypeError, match=f"max_new_tokens must be an integer, got {shown}"):
        rj.generate(tiny_target, PROMPT, value)


def test_a_bad_count_is_named_before_a_bad_prompt(tiny_target):
    with pytest.raises(TypeError, match="max_new_tokens"):
        rj.generate(tiny_target, "no prompt", 2.5)


@pytest.mark.parametrize("prompt", ["3 4", b"34", None, 3, 3.5])
def test_a_prompt_that_is_no_array_is_a_type_error(tiny_target, prompt):
    with pytest.raises(TypeError, match=r"prompt_ids must be a \[B, T\] array of token ids or a list of 1-D ones, "
                                        f"got {type(prompt).__name__}"):
        rj.generate(tiny_target, prompt, 2)


def test_a_single_prompt_as_a_flat_list_says_how_to_wrap_it(tiny_target):
    with pytest.raises(TypeError, match=r"prompt 0 must be a 1-D array of token ids \(a single prompt is a list of "
                                        r"one: \[ids\]\), got int 3"):
        rj.generate(tiny_target, [3, 4], 2)


def test_a_string_in_a_list_of_prompts_is_a_type_error(tiny_target):
    with pytest.raises(TypeError, match="prompt 1 must be a 1-D array of token ids, got str"):
        rj.generate(tiny_target, [np.array([3, 4]), "5 6"], 2)


@pytest.mark.parametrize("prompt, dtype", [(np.array([[3.0, 4.0]]), "float64"), (np.array([[True, False]]), "bool"),
                                           ([[3.0, 4.0]], "float64"), ([np.array(["3", "4"])], "<U1")])
def test_a_prompt_of_other_than_integers_is_refused(tiny_target, prompt, dtype):
    with pytest.raises(ValueError, match=f"prompt 0 has dtype {dtype}; token ids must be integers"):
        rj.generate(tiny_target, prompt, 2)


@pytest.mark.parametrize("kwargs, error, message", [
    ({"seed": 1.5}, TypeError, "seed must be an integer, got float 1.5"),
    ({"seed": True}, TypeError, "seed must be an integer, got bool True"),
    ({"capacity": "8"}, TypeError, "capacity must be an integer, got str '8'"),
    ({"capacity": True}, TypeError, "capacity must be an integer, got bool True"),
    ({"prompt_bucket": 2.0}, TypeError, "prompt_bucket must be an integer, got float 2.0"),
    ({"new_tokens_bucket": 4.0}, TypeError, "new_tokens_bucket must be an integer, got float 4.0"),
    ({"temperature": True}, TypeError, "temperature must be a real number, got bool True"),
    ({"batch_invariant": 1}, TypeError, "batch_invariant must be True or False, got int 1"),
    ({"impl": None}, ValueError, r"impl must be one of \('xla', 'pallas'\), got None"),
])
def test_generate_names_each_bad_option(tiny_target, kwargs, error, message):
    with pytest.raises(error, match=message):
        rj.generate(tiny_target, PROMPT, 2, **kwargs)


# ---- ScriptedDrafter ------------------------------------------------------------------------------------------
def test_a_huge_scripted_block_is_refused_at_once():
    """``block_size=10**6`` was accepted; a 2-token generate with it then compiled for over 5 minutes."""
    start = time.perf_counter()
    with pytest.raises(ValueError, match=f"ScriptedDrafter.block_size must be in 1..{MAX_BLOCK_SIZE}, got 1000000"):
        rj.ScriptedDrafter(np.zeros((1, 4), np.int32), block_size=10**6)
    assert time.perf_counter() - start < 1.0


def test_the_scripted_block_bound_is_the_learned_drafters():
    assert rj.ScriptedDrafter(np.zeros((1, 4), np.int32), block_size=MAX_BLOCK_SIZE).block_size == MAX_BLOCK_SIZE
    with pytest.raises(ValueError, match=f"must be in 1..{MAX_BLOCK_SIZE}, got {MAX_BLOCK_SIZE + 1}"):
        rj.ScriptedDrafter(np.zeros((1, 4), np.int32), block_size=MAX_BLOCK_SIZE + 1)
    with pytest.raises(ValueError, match=f"block_size {MAX_BLOCK_SIZE + 1} must be in 1..{MAX_BLOCK_SIZE}"):
        rj.DrafterConfig(block_size=MAX_BLOCK_SIZE + 1)


@pytest.mark.parametrize("fields, error, message", [
    ({"block_size": True}, TypeError, "ScriptedDrafter.block_size must be an integer, got bool True"),
    ({"block_size": 3.0}, TypeError, "ScriptedDrafter.block_size must be an integer, got float 3.0"),
    ({"block_size": 0}, ValueError, r"ScriptedDrafter.block_size must be in 1\.\."),
    ({"reference": "3 4"}, TypeError, r"ScriptedDrafter.reference must be a \[B, N\] array of token ids, got str"),
    ({"reference": None}, TypeError, "ScriptedDrafter.reference must be a .* got NoneType"),
    ({"reference": np.array([3, 4])}, ValueError, r"must be \[B, N\] with B, N >= 1, got shape \(2,\)"),
    ({"reference": np.zeros((1, 2, 2), np.int32)}, ValueError, r"got shape \(1, 2, 2\)"),
    ({"reference": np.array([[3.0, 4.0]])}, ValueError, "must hold integer token ids, got float64"),
    ({"reference": np.array([[True]])}, ValueError, "must hold integer token ids, got bool"),
    ({"error_rate": "0.1"}, TypeError, "ScriptedDrafter.error_rate must be a real number, got str"),
    ({"seed": 0.5}, TypeError, "ScriptedDrafter.seed must be an integer, got float"),
])
def test_a_scripted_drafter_checks_its_fields_when_made(fields, error, message):
    with pytest.raises(error, match=message):
        rj.ScriptedDrafter(**{"reference": np.array([[3, 4]]), "block_size": 2, **fields})


def test_a_scripted_drafter_takes_lists_and_jax_arrays():
    assert rj.ScriptedDrafter([[3, 4]], 2).block_size == 2
    assert rj.ScriptedDrafter(jax.numpy.zeros((2, 3), jax.numpy.int32), np.int64(4), 0, np.int32(1)).seed == 1


def test_a_scripted_reference_must_have_a_row_per_prompt(tiny_target):
    with pytest.raises(ValueError, match=r"ScriptedDrafter.reference must be \[B=1, N\] \(a row per prompt\)"):
        rj.generate(tiny_target, PROMPT, 2, drafter=rj.ScriptedDrafter(np.zeros((2, 4), np.int32)))


# ---- Target and Drafter constructors and checkpoints ----------------------------------------------------------
def test_a_model_passed_where_its_config_goes_is_told_to_pass_the_config(tiny_target, drafter):
    with pytest.raises(TypeError, match=r"config must be a TargetConfig, got Target \(pass its .config\)"):
        rj.Target.init(tiny_target)
    with pytest.raises(TypeError, match=r"target_config must be a TargetConfig, got Target \(pass its .config\)"):
        rj.Drafter.init(tiny_target)
    with pytest.raises(TypeError, match=r"config must be a DrafterConfig, got Drafter \(pass its .config\)"):
        rj.Drafter.init(tiny_target.config, drafter)
    with pytest.raises(TypeError, match="config must be a DrafterConfig, got TargetConfig$"):
        rj.Drafter.from_state(tiny_target.config, {})


@pytest.mark.parametrize("make", [rj.Target.init, rj.Drafter.init])
def test_init_checks_seed_and_dtype(tiny_target, make):
    with pytest.raises(TypeError, match="seed must be an integer, got str '0'"):
        make(tiny_target.config, seed="0")
    with pytest.raises(TypeError, match="seed must be an integer, got bool"):
        make(tiny_target.config, seed=False)
    for dtype in ("int8", "junk", np.int32):
        with pytest.raises(ValueError, match="dtype must be a floating-point dtype"):
            make(tiny_target.config, dtype=dtype)


def test_the_wrapper_classes_take_only_their_models(tiny_target, drafter):
    with pytest.raises(TypeError, match=r"model must be a TargetModel, got Target \(Target.init, from_hf and load "
                                        r"build a Target\)"):
        rj.Target(tiny_target)
    with pytest.raises(TypeError, match="model must be a DrafterModel, got Drafter"):
        rj.Drafter(drafter)
    with pytest.raises(TypeError, match="layout must be a ready_jax.Layout or None, got str"):
        rj.Target(tiny_target.model, layout="data")


@pytest.mark.parametrize("model", ["target", "drafter"])
def test_save_and_load_name_a_path_that_is_no_path(tiny_target, drafter, tmp_path, model):
    chosen = tiny_target if model == "target" else drafter
    with pytest.raises(TypeError, match=r"path must be a path \(str or os.PathLike\), got int 3"):
        chosen.save(3)
    with pytest.raises(TypeError, match="overwrite must be True or False, got str 'yes'"):
        chosen.save(tmp_path, overwrite="yes")
    assert not any(tmp_path.iterdir())
    with pytest.raises(TypeError, match="path must be a path .*got NoneType"):
        type(chosen).load(None)
    with pytest.raises(TypeError, match="layout must be a ready_jax.Layout or None"):
        type(chosen).load(tmp_path, layout=jax.sharding.Mesh(np.array(jax.devices()[:1]), ("data",)))


def test_from_hf_names_a_path_that_is_no_path():
    with pytest.raises(TypeError, match="path must be a path .*got list"):
        rj.Target.from_hf(["dir"])


def test_shard_functions_check_which_model_they_got(tiny_target, drafter):
    layout = rj.Layout(jax.sharding.Mesh(np.array(jax.devices()[:1]), ("data",)))
    with pytest.raises(TypeError, match="target must be a ready_jax.Target, got Drafter"):
        rj.shard_target(drafter, layout)
    with pytest.raises(TypeError, match="drafter must be a ready_jax.Drafter, got Target"):
        rj.shard_drafter(tiny_target, layout)
    with pytest.raises(TypeError, match="layout must be a ready_jax.Layout or a jax Mesh, got tuple"):
        rj.shard_drafter(drafter, ("data",))


# ---- the drafter's step API -----------------------------------------------------------------------------------
def test_the_drafter_steps_name_a_wrong_cache_or_weights(tiny_target, drafter, context):
    shared = rj.SharedWeights.from_target(tiny_target)
    anchor = np.array([3])
    with pytest.raises(TypeError, match="context must be a ContextCache, got TargetCache"):
        drafter.draft(tiny_target.init_cache(1, 8), anchor, shared)
    with pytest.raises(TypeError, match=r"shared must be SharedWeights, got Target \(SharedWeights.from_target"):
        drafter.draft(context, anchor, tiny_target)
    with pytest.raises(TypeError, match="context must be a ContextCache, got NoneType"):
        drafter.append_context(None, np.zeros((1, 1, 2, 4), np.float32))
    with pytest.raises(TypeError, match="source must be a TargetCache or a verify Candidate, got ContextCache"):
        drafter.prepare_reader(context)
    with pytest.raises(TypeError, match="target must be a ready_jax.Target, got Drafter"):
        rj.SharedWeights.from_target(drafter)


def test_the_drafter_steps_name_bad_tokens_and_numbers(tiny_target, drafter, context):
    shared = rj.SharedWeights.from_target(tiny_target)
    with pytest.raises(ValueError, match="anchor must be integers, got float64"):
        drafter.draft(context, np.array([3.0]), shared)
    with pytest.raises(ValueError, match=r"anchor must be \[B=1\] \(one token per row\), got shape \(2,\)"):
        drafter.draft(context, np.array([3, 4]), shared)
    with pytest.raises(TypeError, match="temperature must be a real number, got str '0.5'"):
        drafter.draft(context, np.array([3]), shared, temperature="0.5")
    with pytest.raises(ValueError, match="impl must be one of"):
        drafter.draft(context, np.array([3]), shared, impl="cuda")
    with pytest.raises(TypeError, match="batch_size must be an integer, got float 1.5"):
        drafter.init_context(1.5, 8)
    with pytest.raises(ValueError, match=r"capacity must be in 1\.\."):
        drafter.init_context(1, 0)
    hidden = np.zeros((len(drafter.config.target_layer_ids), 1, 2, tiny_target.config.hidden_size), np.float32)
    with pytest.raises(ValueError, match=r"hidden must be \[n_ids, B=1, T, D\]"):
        drafter.append_context(context, hidden[0])
    with pytest.raises(ValueError, match=r"num_new must lie in 0\.\.2"):
        drafter.append_context(context, hidden, [3])
    with pytest.raises(ValueError, match="num_new must be integers, got float64"):
        drafter.append_context(context, hidden, np.array([1.0]))
