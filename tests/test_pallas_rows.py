"""The batch-invariant mode with the Pallas kernels (``ready_jax.rows``): every matmul of a prefill, a decode step and
a verify block is one ``row_matmul`` over all the step's rows, so a row's logits and states are the same bits alone
as in any batch, and a verify block's positions round as decode steps: by the kernel's construction, in the Triton
and TPU kernels' interpreters here."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import ATTN, GDN, tiny_config
from flax import nnx

import ready_jax as rj
from pallas_kernels import backend
from ready_jax import cache as cache_lib
from ready_jax import generation, target_steps
from ready_jax.rows import PLAIN_ROWS, Rows
from ready_jax.step_options import StepOptions

pytestmark = pytest.mark.interpret

PROMPT_LENGTHS = (7, 3, 12)
BLOCK = 4


@pytest.fixture(params=["gpu", pytest.param("tpu", marks=pytest.mark.slow)])
def family(request):
    saved = backend._interpret_family, backend.INTERPRET_CORES
    backend.set_interpret_family(request.param)
    backend.INTERPRET_CORES = 1
    generation.PROGRAMS.clear()
    jax.clear_caches()
    yield request.param
    backend.set_interpret_family(saved[0])
    backend.INTERPRET_CORES = saved[1]
    generation.PROGRAMS.clear()
    jax.clear_caches()


@functools.cache
def _target() -> rj.Target:
    """One group of 3 Gated DeltaNet layers and an attention layer (each kernel call is interpreted: few layers)."""
    config = tiny_config(num_hidden_layers=4, layer_types=(GDN, GDN, GDN, ATTN))
    return rj.Target.init(config, seed=4, dtype=jnp.bfloat16)


@functools.cache
def _two_group_targets() -> tuple[rj.Target, rj.Target]:
    """The same two groups of a Gated DeltaNet and an attention layer, split and stacked (a scan over groups)."""
    config = tiny_config(num_hidden_layers=4, layer_types=(GDN, ATTN, GDN, ATTN))
    split = rj.Target.init(config, seed=6, dtype=jnp.bfloat16, group_layout="split")
    return split, rj.Target(nnx.merge(split.graphdef, split.params), group_layout="stacked")


def _steps(target: rj.Target, prompts: list[np.ndarray], bucket: int, tokens: np.ndarray) -> dict:
    """Per row: the prefill's last logits, the logits of BLOCK decode steps of ``tokens`` [B, BLOCK], and of one
    verify block of the same tokens after the same prefill, and the decoded cache."""
    b = len(prompts)
    padded = np.zeros((b, bucket), np.int32)
    for row, prompt in enumerate(prompts):
        padded[row, :len(prompt)] = prompt
    lengths = np.asarray([len(p) for p in prompts], np.int32)
    step = dict(impl="pallas", batch_invariant=True)
    prefilled = target.prefill(target.init_cache(b, bucket + BLOCK + 1), padded, lengths, **step)
    cache, decoded = jax.tree.map(jnp.copy, prefilled.cache), []
    for t in range(BLOCK):
        out = target.decode(cache, tokens[:, t], **step)
        decoded.append(np.asarray(out.logits[:, 0], np.float32))
        cache = out.cache
    verified = target.verify(jax.tree.map(jnp.copy, prefilled.cache), tokens, rollback="replay", **step)
    last = np.asarray(prefilled.logits, np.float32)[np.arange(b), lengths - 1]     # each prompt's last token
    return {"prefill": last, "decode": np.stack(decoded, axis=1),
            "verify": np.asarray(verified.logits, np.float32),
            "states": [np.asarray(leaf) for leaf in jax.tree.leaves(cache_lib.mask_uncommitted(cache))]}


def test_a_rows_logits_are_its_own_with_the_kernels(family):
    target = _target()
    rng = np.random.default_rng(5)
    prompts = [rng.integers(0, target.config.vocab_size, n) for n in PROMPT_LENGTHS]
    tokens = rng.integers(0, target.config.vocab_size, (len(prompts), BLOCK)).astype(np.int32)
    batch = _steps(target, prompts, 16, tokens)
    np.testing.assert_array_equal(batch["verify"], batch["decode"])    # verify rounds as decode: spec == AR
    for row in (1,):   # a row alone, in a smaller bucket: the same bits as inside the batch of three
        alone = _steps(target, [prompts[row]], 12, tokens[row:row + 1])
        for name in ("prefill", "decode", "verify"):
            np.testing.assert_array_equal(alone[name][0], batch[name][row], err_msg=f"{family} {name} row {row}")


def test_stacked_groups_give_the_split_groups_bits(family):
    """In a scan over stacked groups each kernel reads its group's weight in the stack (``rows.GroupWeight``): the
    same bits as the split groups' own weights, for a prefill, decode steps and a verify block."""
    split, stacked = _two_group_targets()
    rng = np.random.default_rng(7)
    prompts = [rng.integers(0, split.config.vocab_size, n) for n in PROMPT_LENGTHS]
    tokens = rng.integers(0, split.config.vocab_size, (len(prompts), BLOCK)).astype(np.int32)
    expected, actual = _steps(split, prompts, 16, tokens), _steps(stacked, prompts, 16, tokens)
    for name in ("prefill", "decode", "verify"):
        np.testing.assert_array_equal(actual[name], expected[name], err_msg=f"{family} {name}")
    for got, want in zip(actual["states"], expected["states"], strict=True):
        np.testing.assert_array_equal(got, want)


def _sub_jaxprs(eqn) -> list:
    """The jaxprs inside ``eqn``'s parameters (a jit's, a scan's body, a cond's branches)."""
    found = []
    for value in eqn.params.values():
        for item in value if isinstance(value, tuple | list) else (value,):
            inner = getattr(item, "jaxpr", item)
            if hasattr(inner, "eqns"):
                found.append(inner)
    return found


def _kernel_eqns(jaxpr) -> list:
    """The ``pallas_call`` equations of ``jaxpr``, inside its sub-jaxprs too."""
    return [found for eqn in jaxpr.eqns
            for found in ([eqn] if eqn.primitive.name == "pallas_call"
                          else [e for inner in _sub_jaxprs(eqn) for e in _kernel_eqns(inner)])]


def _kernel_name(eqn) -> str:
    info = eqn.params.get("name_and_src_info", eqn.params.get("name"))
    return str(getattr(info, "name", info))


def _kernel_calls(jaxpr) -> list[str]:
    """The names of the Pallas kernels ``jaxpr`` calls, inside its sub-jaxprs too."""
    return [_kernel_name(eqn) for eqn in _kernel_eqns(jaxpr)]


def test_the_kernels_run_every_matmul_of_a_step():
    """The invariant step with ``impl="pallas"`` runs ``row_matmul`` for every projection, MLP and the head (so the
    test above checks the kernels, not XLA's tiles); without the mode, none."""
    target = _target()
    cache = target.init_cache(2, 16)
    tokens = jnp.zeros((2, 3), jnp.int32)

    def row_matmuls(batch_invariant: bool) -> int:
        options = StepOptions.resolve("pallas", batch_invariant)
        step = functools.partial(target_steps.extend, target.graphdef, form="recurrent", options=options)
        return _kernel_calls(jax.make_jaxpr(step)(target.params, cache, tokens).jaxpr).count("row_matmul")

    # per group: 3 Gated DeltaNet layers (4 in-projections and out), attention (q, k, v, o), 4 MLPs (3 each)
    per_group = 3 * (4 + 1) + 4 + 4 * 3
    assert row_matmuls(True) == target.config.num_groups * per_group + 1     # and the LM head
    assert row_matmuls(False) == 0


def _scan_bodies(jaxpr) -> list:
    """The bodies of the scans in ``jaxpr`` and its sub-jaxprs."""
    return [body for eqn in jaxpr.eqns
            for body in ([eqn.params["jaxpr"].jaxpr] if eqn.primitive.name == "scan" else [])
            + [b for inner in _sub_jaxprs(eqn) for b in _scan_bodies(inner)]]


def test_a_scan_over_stacked_groups_hands_the_kernels_whole_stacks():
    """Stacked, the scan over groups slices no linear layer's weight: each ``row_matmul`` in its body takes the
    stack [G, K, N] and the group index, so a compiled kernel reads its group in place (a slice handed to a custom
    call is copied out first)."""
    _, stacked = _two_group_targets()
    options = StepOptions.resolve("pallas", True)
    step = functools.partial(target_steps.extend, stacked.graphdef, form="recurrent", options=options)
    jaxpr = jax.make_jaxpr(step)(stacked.params, stacked.init_cache(2, 16), jnp.zeros((2, 3), jnp.int32)).jaxpr
    (body,) = [body for body in _scan_bodies(jaxpr) if "row_matmul" in _kernel_calls(body)]
    weights = [[v.aval.shape for v in eqn.invars if v.aval.ndim >= 2] for eqn in _kernel_eqns(body)
               if _kernel_name(eqn) == "row_matmul"]
    per_group = 2 * (4 + 1) // 2 + 4 + 2 * 3      # a Gated DeltaNet layer's 5, attention's 4, 2 MLPs' 3 each
    assert len(weights) == per_group
    num_groups = stacked.config.num_groups
    assert all(any(len(shape) == 3 and shape[0] == num_groups for shape in shapes) for shapes in weights), weights


def test_a_steps_options_choose_its_rows():
    """Off: the rows as they come; on with XLA: a prompt on XLA's tiles, a decode step's matmuls on column blocks
    (on a CPU; XLA's tiles elsewhere);
    on with Pallas: the kernels; an MoE's experts on XLA's tiles in a decode step, whole in a prefill; a prompt's
    XLA tiles have no per-matmul construction."""
    assert Rows.of(StepOptions.resolve("pallas", False), prompt=False) == PLAIN_ROWS
    xla = Rows.of(StepOptions.resolve("xla", True), prompt=True)
    assert xla.invariant and xla.prompt and xla.kernels is None
    kernels = Rows.of(StepOptions.resolve("pallas", True), prompt=False)
    assert kernels.kernels is not None and kernels.kernels.impl == "pallas"
    assert kernels.for_experts() == Rows(invariant=True)
    assert Rows.of(StepOptions.resolve("pallas", True), prompt=True).for_experts() == PLAIN_ROWS
    assert Rows.of(StepOptions.resolve("xla", True), prompt=False) == Rows(invariant=True, column_blocks=True)
    assert Rows.of(StepOptions.resolve("xla", True), prompt=False).for_experts() == Rows(invariant=True)
    off_the_cpu = dataclasses.replace(StepOptions.resolve("xla", True), column_blocks=False)  # XLA on a GPU or TPU
    assert Rows.of(off_the_cpu, prompt=False) == Rows(invariant=True)
    assert not StepOptions.resolve("pallas", True).column_blocks and not StepOptions.resolve("xla", False).column_blocks
    with pytest.raises(ValueError, match="needs a per-matmul construction"):
        xla.matmul(jnp.ones((2, 4)), jnp.ones((4, 3)))
