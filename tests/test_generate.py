"""The jitted speculative loop: lossless greedy and sampling, ragged batches, functional rollback."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import tiny_config
from flax import nnx

import ready_jax as rj
from ready_jax import compiled_programs, speculative
from ready_jax import generation as generate_lib
from ready_jax.cache import mask_uncommitted
from ready_jax.checkpoint import flat_state, state_from_flat

MAX_NEW = 14
PROMPT_MAX = 12
CAPACITY = PROMPT_MAX + MAX_NEW + 7  # one size for every run, so final caches compare slot for slot


def _prompt_set(seed: int, batch: int, vocab: int = 97) -> list[np.ndarray]:
    """Ragged prompts padded to the same maximum, so one compiled program serves every set."""
    rng = np.random.default_rng(seed)
    lengths = rng.integers(1, PROMPT_MAX + 1, size=batch)
    lengths[0] = PROMPT_MAX
    return [rng.integers(0, vocab, size=int(n)) for n in lengths]


def _with_random_reader_output(drafter: rj.Drafter, seed: int) -> rj.Drafter:
    """A reader whose zero-initialised output projection is made non-zero, so reading changes the drafts."""
    flat = {k: np.asarray(v) for k, v in drafter.flat_params().items()}
    rng = np.random.default_rng(seed)
    for key in flat:
        if "reader" in key and ("o_proj" in key or "w_o" in key):
            flat[key] = rng.normal(0, 0.5, size=flat[key].shape).astype(flat[key].dtype)
    changed = rj.Drafter.from_state(drafter.config, flat)
    assert any("reader" in k for k in flat), "expected reader parameters"
    return changed


@pytest.fixture(scope="module")
def target():
    return rj.Target.init(tiny_config(), seed=0)


def _drafters(target):
    base = dict(num_layers=2, markov_rank=8, num_attention_heads=2, num_key_value_heads=1, head_dim=8,
                intermediate_size=32)
    reader = rj.ReaderConfig(source_layers=(1, 5), rank=4)
    ready = rj.Drafter.init(target.config, rj.DrafterConfig(block_size=7, reader=reader, **base), seed=2)
    return {
        "dspark-block4": rj.Drafter.init(target.config, rj.DrafterConfig(block_size=4, **base), seed=1),
        "ready-block7": _with_random_reader_output(ready, 3),
        "dspark-block1": rj.Drafter.init(target.config, rj.DrafterConfig(block_size=1, **base), seed=4),
    }


@pytest.mark.slow
def test_greedy_speculative_equals_autoregressive(target):
    """Token-for-token equality over 50 distinct prompts: batch 1 and 4, blocks 1, 4 and 7, random DSpark
    and ReaDy drafters, and scripted drafters that are often (or always) right, so long and full-block
    accepts happen; the final committed cache equals plain decoding's too."""
    drafters = _drafters(target)
    runs = list(drafters.items())
    prompts_seen = 0
    saw_full_block = False
    for seed in range(10):
        for batch in (4, 1):
            prompts = _prompt_set(100 * seed + batch, batch)
            ar = rj.generate(target, prompts, MAX_NEW, capacity=CAPACITY)
            reference = np.where(ar.tokens < 0, 0, ar.tokens)
            scripted = [("scripted-exact-b7", rj.ScriptedDrafter(reference, block_size=7, error_rate=0.0)),
                        ("scripted-b4", rj.ScriptedDrafter(reference, block_size=4, error_rate=0.3, seed=seed))]
            # Batch 1 runs the cheapest pair only: every extra (drafter, shape) is another compiled program.
            chosen = runs + scripted if batch == 4 else [runs[2], scripted[0]]
            for name, drafter in chosen:
                spec = rj.generate(target, prompts, MAX_NEW, drafter=drafter, capacity=CAPACITY)
                np.testing.assert_array_equal(spec.tokens, ar.tokens, err_msg=f"{name}, batch {batch}, seed {seed}")
                for x, y in zip(jax.tree.leaves(mask_uncommitted(spec.cache)),
                                jax.tree.leaves(mask_uncommitted(ar.cache)), strict=True):
                    np.testing.assert_allclose(x, y, atol=5e-5, err_msg=name)
                saw_full_block |= bool((spec.accept_lengths == spec.block_size + 1).any())
            prompts_seen += batch
    assert prompts_seen >= 50
    assert saw_full_block


@pytest.mark.slow
def test_replay_rollback_equals_checkpoint(target):
    prompts = _prompt_set(7, 4)
    ar = rj.generate(target, prompts, MAX_NEW)
    drafter = rj.ScriptedDrafter(np.maximum(ar.tokens, 0), block_size=4, error_rate=0.4, seed=1)
    a = rj.generate(target, prompts, MAX_NEW, drafter=drafter, rollback="checkpoint")
    b = rj.generate(target, prompts, MAX_NEW, drafter=drafter, rollback="replay")
    np.testing.assert_array_equal(a.tokens, ar.tokens)
    np.testing.assert_array_equal(b.tokens, ar.tokens)
    np.testing.assert_array_equal(a.accept_lengths, b.accept_lengths)


@pytest.mark.slow
def test_eos_stops_each_sequence(target):
    prompts = _prompt_set(8, 4)
    ar = rj.generate(target, prompts, MAX_NEW)
    eos = int(ar.tokens[1, 5])                       # make sequence 1's 6th token an EOS
    stopped = rj.generate(target, prompts, MAX_NEW, eos_token_ids=(eos,))
    drafter = rj.ScriptedDrafter(np.maximum(ar.tokens, 0), block_size=7)
    spec = rj.generate(target, prompts, MAX_NEW, drafter=drafter, eos_token_ids=(eos,))
    np.testing.assert_array_equal(spec.tokens, stopped.tokens)
    for b in range(4):
        n = int(stopped.num_generated[b])
        hits = np.flatnonzero(ar.tokens[b] == eos)
        assert n == (hits[0] + 1 if hits.size else MAX_NEW)
        np.testing.assert_array_equal(stopped.tokens[b, :n], ar.tokens[b, :n])
        assert (stopped.tokens[b, n:] == generate_lib.PAD).all()


def test_metrics(target):
    prompts = _prompt_set(9, 4)
    ar = rj.generate(target, prompts, MAX_NEW)
    assert ar.tau == 1.0 and ar.block_size == 0
    spec = rj.generate(target, prompts, MAX_NEW, drafter=rj.ScriptedDrafter(np.maximum(ar.tokens, 0), 4, 0.25))
    active = spec.accept_lengths[spec.accept_lengths > 0]
    assert spec.acceptance_histogram.sum() == active.size
    np.testing.assert_allclose(spec.tau, active.mean())
    assert spec.per_position_acceptance.shape == (4,)
    assert np.all(np.diff(spec.per_position_acceptance) <= 0)   # draft k+1 needs draft k
    np.testing.assert_allclose(spec.full_accept_rate, spec.acceptance_histogram[-1] / active.size)
    # Rounds record the tokens they commit, the last one cut short by max_new_tokens: with the
    # prefill's first token they add up to the tokens generated.
    np.testing.assert_array_equal(spec.accept_lengths.sum(axis=0), spec.num_generated - 1)
    assert spec.tokens_per_second > 0 and spec.run_seconds > 0


@pytest.mark.slow
def test_prompt_bucket_shares_one_program_across_lengths(target):
    rng = np.random.default_rng(22)
    batches = [[rng.integers(0, 97, size=n) for n in lengths] for lengths in ((5, 3), (9, 2))]  # widths 5 and 9
    drafter = rj.ScriptedDrafter(np.zeros((2, MAX_NEW), np.int32), block_size=3, error_rate=0.5)
    exact = [rj.generate(target, p, MAX_NEW, drafter=drafter) for p in batches]
    bucketed = [rj.generate(target, p, MAX_NEW, drafter=drafter, prompt_bucket=16) for p in batches]
    for e, b in zip(exact, bucketed, strict=True):
        np.testing.assert_array_equal(b.tokens, e.tokens)
        np.testing.assert_array_equal(b.accept_lengths, e.accept_lengths)
    assert exact[1].compile_seconds > 0 and bucketed[1].compile_seconds == 0.0   # width 9 reused width 5's program
    with pytest.raises(ValueError, match="prompt_bucket"):
        rj.generate(target, batches[0], MAX_NEW, prompt_bucket=0)


def test_new_tokens_buckets_share_programs_and_keep_tokens(target):
    """Lengths in one bucket share a program; the tokens, acceptance and committed lengths equal a program
    compiled for each exact length (new_tokens_bucket=1), speculative and autoregressive."""
    assert [generate_lib.new_tokens_bucket_of(n) for n in (1, 2, 3, 5, 7, 9, 13, 24, 25)] == [1, 2, 3, 6, 8, 12, 16,
                                                                                              24, 32]
    assert generate_lib.new_tokens_bucket_of(10, 4) == 12 and generate_lib.new_tokens_bucket_of(2**31 - 1) == 2**31 - 1
    prompts = _prompt_set(31, 2)
    drafter = rj.ScriptedDrafter(np.zeros((2, 16), np.int32), block_size=3, error_rate=0.5)
    for n in (9, 11):                                                           # both in bucket 12
        for d in (None, drafter):
            exact = rj.generate(target, prompts, n, drafter=d, new_tokens_bucket=1)
            bucketed = rj.generate(target, prompts, n, drafter=d)
            np.testing.assert_array_equal(bucketed.tokens, exact.tokens)
            np.testing.assert_array_equal(bucketed.accept_lengths, exact.accept_lengths)
            np.testing.assert_array_equal(np.asarray(bucketed.cache.lengths), np.asarray(exact.cache.lengths))
            assert bucketed.tokens.shape == (2, n)
            if n == 11:
                assert bucketed.compile_seconds == 0.0                            # 9's program
    with pytest.raises(ValueError, match="new_tokens_bucket"):
        rj.generate(target, prompts, 4, new_tokens_bucket=0)


def test_a_scripted_drafters_rate_and_reference_length_are_inputs(target):
    """A sweep over error rates and reference lengths runs one program: a rate of 0 on the AR tokens accepts
    whole blocks, a rate of 1 none, and a short reference drafts as its last column repeated does."""
    prompts = _prompt_set(32, 2)
    ar = rj.generate(target, prompts, 10)
    reference = np.maximum(ar.tokens, 0)
    runs = {rate: rj.generate(target, prompts, 10, drafter=rj.ScriptedDrafter(reference, 3, error_rate=rate))
            for rate in (0.0, 0.4, 1.0)}
    assert [r.compile_seconds == 0.0 for r in runs.values()] == [False, True, True]
    for run in runs.values():
        np.testing.assert_array_equal(run.tokens, ar.tokens)
    assert runs[0.0].rounds < runs[0.4].rounds < runs[1.0].rounds
    assert runs[1.0].accept_lengths.max() == 1 and runs[0.0].accept_lengths.max() == 4
    short = reference[:, :4]
    slots = generate_lib.new_tokens_bucket_of(10)               # the program's token slots: 12
    padded = np.concatenate([short, np.repeat(short[:, -1:], slots - short.shape[1], axis=1)], axis=1)
    by_length = [rj.generate(target, prompts, 10, drafter=rj.ScriptedDrafter(r, 3, error_rate=0.0, seed=1))
                 for r in (short, padded)]
    np.testing.assert_array_equal(by_length[0].accept_lengths, by_length[1].accept_lengths)
    assert by_length[0].compile_seconds == 0.0 and by_length[1].compile_seconds == 0.0


def test_bad_input(target):
    with pytest.raises(ValueError, match="empty"):
        rj.generate(target, [np.array([1, 2]), np.array([], np.int64)], 4)
    with pytest.raises(ValueError, match="capacity"):
        rj.generate(target, [np.arange(10)], 20, capacity=16)
    with pytest.raises(ValueError, match="vocabulary"):
        rj.generate(target, [np.array([1, 97])], 4)
    with pytest.raises(ValueError, match="temperature"):
        rj.generate(target, [np.array([1, 2])], 4, temperature=-0.5)
    with pytest.raises(ValueError, match="max_new_tokens"):
        rj.generate(target, [np.array([1, 2])], 0)
    with pytest.raises(ValueError, match="integers"):
        rj.generate(target, [np.array([1.0, 2.0])], 4)


# ---- sampling: the speculative samples follow the target's own distribution ---------------------------------
VOCAB = 5
SAMPLES = 8000
TEMPERATURE = 0.5


@pytest.fixture(scope="module")
def small_vocab():
    """A target with a 5-token vocabulary, sharpened so its distributions are far from the drafter's."""
    cfg = tiny_config(vocab_size=VOCAB)
    flat = {k: np.asarray(v) for k, v in flat_state(rj.Target.init(cfg, seed=5).stacked_params()).items()}
    flat["lm_head.kernel"] = flat["lm_head.kernel"] * 25.0
    graphdef, params = nnx.split(nnx.eval_shape(lambda: rj.TargetModel(cfg, rngs=nnx.Rngs(0))))
    target = rj.Target(nnx.merge(graphdef, state_from_flat(params, flat, what="sharpened target")))
    drafter = rj.Drafter.init(cfg, rj.DrafterConfig(block_size=2, num_layers=1, markov_rank=4, mask_token_id=0),
                              seed=6)
    prompt = np.array([1, 3, 2, 4])
    return target, drafter, prompt


def _exact_joint(target, prompt) -> np.ndarray:
    """p(x1, x2, x3) of the target's own sampling after ``prompt``, by enumeration: [V, V, V]."""
    def probs(rows):
        logits = np.asarray(target.forward(jnp.asarray(rows)))[:, -1] / TEMPERATURE
        e = np.exp(logits - logits.max(-1, keepdims=True))
        return e / e.sum(-1, keepdims=True)

    p1 = probs(prompt[None])[0]
    x1 = np.arange(VOCAB)
    p2 = probs(np.stack([np.append(prompt, a) for a in x1]))                              # [V, V]
    p3 = probs(np.stack([np.append(prompt, [a, b]) for a in x1 for b in x1])).reshape(VOCAB, VOCAB, VOCAB)
    return p1[:, None, None] * p2[:, :, None] * p3


def _chi_square(samples: np.ndarray, expected_p: np.ndarray) -> tuple[float, int]:
    """Pearson's statistic over the joint cells (the rarest pooled) and its degrees of freedom."""
    codes = samples[:, 0] * VOCAB * VOCAB + samples[:, 1] * VOCAB + samples[:, 2]
    observed = np.bincount(codes, minlength=VOCAB ** 3).astype(float)
    expected = expected_p.reshape(-1) * len(samples)
    order = np.argsort(expected)
    observed, expected = observed[order], expected[order]
    # Pool the rarest cells until the pool expects at least 5 samples (the chi-square approximation).
    pool = int(np.searchsorted(np.cumsum(expected), 5.0)) + 1
    obs = np.append(observed[pool:], observed[:pool].sum())
    exp = np.append(expected[pool:], expected[:pool].sum())
    return float(((obs - exp) ** 2 / exp).sum()), len(exp) - 1


def _five_sigma(dof: int) -> float:
    return dof + 5 * np.sqrt(2 * dof)


@pytest.mark.slow
def test_speculative_sampling_matches_target_distribution(small_vocab, monkeypatch):
    """8,000 samples of 3 tokens, AR and speculative, against the exact joint distribution. The steps run as the
    rows come (``batch_invariant=False``): the rule under test is the same in both modes, and the invariant mode
    costs a batch of thousands of tiny rows far more on a CPU (docs/numerics.md, "Many tiny rows")."""
    target, drafter, prompt = small_vocab
    exact = _exact_joint(target, prompt)
    prompts = np.tile(prompt, (SAMPLES, 1))
    sample = functools.partial(rj.generate, target, prompts, 3, temperature=TEMPERATURE, batch_invariant=False)
    own = sample(seed=11)
    spec = sample(drafter=drafter, seed=12)
    stat_own, dof_own = _chi_square(own.tokens, exact)
    stat_spec, dof_spec = _chi_square(spec.tokens, exact)
    assert stat_own < _five_sigma(dof_own), (stat_own, dof_own)
    assert stat_spec < _five_sigma(dof_spec), (stat_spec, dof_spec)
    assert 1.0 < spec.tau < 3.0  # some drafts were accepted and some rejected: the test exercises both

    # A lossy rule (keep every draft) must fail the same test.
    def accept_everything(drafts, draft_probs, target_logits, temperature, key):
        n = jnp.full((drafts.shape[0],), drafts.shape[1], jnp.int32)
        p_last = target_logits[:, -1].astype(jnp.float32) / temperature
        return n, jax.random.categorical(key, p_last, axis=-1).astype(jnp.int32)

    monkeypatch.setattr(speculative, "sampling_accept", accept_everything)
    # compile afresh, tracing the patched rule
    monkeypatch.setattr(generate_lib, "PROGRAMS", compiled_programs.ProgramCache())
    jax.clear_caches()
    lossy = sample(drafter=drafter, seed=12)
    stat_lossy, dof_lossy = _chi_square(lossy.tokens, exact)
    assert stat_lossy > _five_sigma(dof_lossy), (stat_lossy, dof_lossy)


# ---- accept / commit index arithmetic (property tests) ------------------------------------------------------
hypothesis = pytest.importorskip("hypothesis")
st = hypothesis.strategies


def _reference_round(drafts, target_tokens, eos_ids, generated, max_new, done):
    """Plain-Python greedy round: (n_accepted, bonus, kept tokens, done after)."""
    n = 0
    while n < len(drafts) and drafts[n] == target_tokens[n]:
        n += 1
    emitted = list(drafts[:n]) + [target_tokens[n]]
    if done:
        return n, target_tokens[n], [], True
    kept = []
    for tok in emitted:
        if generated + len(kept) >= max_new:
            break
        kept.append(tok)
        if tok in eos_ids:
            break
    finished = (len(kept) > 0 and kept[-1] in eos_ids) or generated + len(kept) >= max_new
    return n, target_tokens[n], kept, finished


@pytest.mark.slow
@hypothesis.settings(max_examples=200, deadline=None)
@hypothesis.given(data=st.data(), gamma=st.integers(1, 7), batch=st.integers(1, 4))
def test_accept_and_keep_arithmetic(data, gamma, batch):
    vocab = 4  # small, so matches, full accepts and EOS inside a block are all common
    drafts = np.array(data.draw(st.lists(st.lists(st.integers(0, vocab - 1), min_size=gamma, max_size=gamma),
                                         min_size=batch, max_size=batch)), np.int32)
    target_tokens = np.array(data.draw(st.lists(st.lists(st.integers(0, vocab - 1), min_size=gamma + 1,
                                                         max_size=gamma + 1), min_size=batch, max_size=batch)),
                             np.int32)
    eos_ids = tuple(data.draw(st.lists(st.integers(0, vocab - 1), max_size=1)))
    max_new = data.draw(st.integers(1, 12))
    generated = np.array(data.draw(st.lists(st.integers(1, max_new), min_size=batch, max_size=batch)), np.int32)
    done = np.array(data.draw(st.lists(st.booleans(), min_size=batch, max_size=batch)))
    done |= generated >= max_new

    logits = jax.nn.one_hot(target_tokens, vocab) * 10.0
    n, bonus = speculative.greedy_accept(jnp.asarray(drafts), logits)
    emitted = speculative.emitted_tokens(jnp.asarray(drafts), n, bonus)
    keep, finished = speculative.tokens_to_keep(emitted, n + 1, eos_ids, jnp.asarray(generated), max_new,
                                                jnp.asarray(done))
    width = max_new + gamma + 1
    buffer = speculative.write_tokens(jnp.full((batch, width), -1, jnp.int32), jnp.asarray(generated), emitted)
    for b in range(batch):
        ref_n, ref_bonus, ref_kept, ref_done = _reference_round(list(drafts[b]), list(target_tokens[b]), eos_ids,
                                                                int(generated[b]), max_new, bool(done[b]))
        assert int(n[b]) == ref_n and int(bonus[b]) == ref_bonus
        assert int(keep[b]) == len(ref_kept)
        assert bool(finished[b]) == ref_done
        g = int(generated[b])
        assert np.asarray(buffer[b, g:g + len(ref_kept)]).tolist() == ref_kept


def test_sampling_accept_edge_cases():
    """q == p keeps every draft; a draft the target gives zero probability is always rejected."""
    key = jax.random.key(0)
    logits = jnp.log(jnp.array([[[0.5, 0.5, 0.0], [0.2, 0.8, 0.0], [0.3, 0.3, 0.4]]]))
    q = jax.nn.softmax(logits[:, :2], axis=-1)
    n, _ = speculative.sampling_accept(jnp.array([[1, 1]]), q, logits, 1.0, key)
    assert int(n[0]) == 2
    n, bonus = speculative.sampling_accept(jnp.array([[2, 1]]), jnp.full((1, 2, 3), 1 / 3), logits, 1.0, key)
    assert int(n[0]) == 0 and int(bonus[0]) in (0, 1)


def test_tied_head_transposed_once_gives_the_same_tokens(monkeypatch):
    """On the CPU a tied target's program multiplies by its embedding transposed once before the loop; AR and
    ReaDy tokens equal those of the program that multiplies by the embedding itself, and each other."""
    tied = rj.Target.init(tiny_config(tie_word_embeddings=True), seed=5)
    assert generate_lib.transposes_tied_head(tied)
    assert not generate_lib.transposes_tied_head(rj.Target.init(tiny_config(), seed=5))
    h = jax.random.normal(jax.random.key(0), (2, 3, tied.config.hidden_size))
    embedding = tied.model.embed_tokens.embedding[...]
    np.testing.assert_allclose(tied.model.logits(h, embedding.T), tied.model.logits(h), rtol=1e-5, atol=1e-5)
    assert not np.allclose(tied.model.logits(h, 2 * embedding.T), tied.model.logits(h))   # the head given is used
    reader = rj.ReaderConfig(source_layers=(1, 5), rank=4)
    drafter = _with_random_reader_output(rj.Drafter.init(tied.config, rj.DrafterConfig(
        block_size=4, num_layers=1, markov_rank=8, num_attention_heads=2, num_key_value_heads=1, head_dim=8,
        intermediate_size=32, reader=reader), seed=6), 7)
    prompts = _prompt_set(8, 2)
    programs = {}
    for transposed in (True, False):
        monkeypatch.setattr(generate_lib, "transposes_tied_head", lambda target, t=transposed: t)
        program = generate_lib.prepare(tied, prompts, MAX_NEW, drafter)
        assert program.settings.transposed_head is transposed
        programs[transposed] = {name: rj.generate(tied, prompts, MAX_NEW, drafter=d, capacity=CAPACITY).tokens
                                for name, d in (("ar", None), ("ready", drafter))}
    np.testing.assert_array_equal(programs[True]["ar"], programs[False]["ar"])
    np.testing.assert_array_equal(programs[True]["ready"], programs[False]["ready"])
    np.testing.assert_array_equal(programs[True]["ready"], programs[True]["ar"])


def test_an_output_prints_as_one_labelled_line():
    out = rj.GenerateOutput(tokens=np.zeros((2, 8), np.int32), num_generated=np.array([8, 6]),
                            accept_lengths=np.array([[4, 3], [3, 3], [0, 1]]), block_size=7, compile_seconds=9.871,
                            run_seconds=0.5, cache=None)
    assert str(out) == ("2 sequences, 14 tokens in 3 rounds (tau 2.80, 7 drafts a round), 28.0 tok/s; run 0.50 s, "
                        "compile 9.87 s")
    ar = rj.GenerateOutput(tokens=np.zeros((1, 1), np.int32), num_generated=np.array([1]),
                           accept_lengths=np.zeros((0, 1), np.int32), block_size=0, compile_seconds=0.0,
                           run_seconds=0.25, cache=None)
    assert str(ar) == "1 sequence, 1 token in 0 rounds (tau n/a, autoregressive), 4.0 tok/s; run 0.25 s, compile 0.00 s"
