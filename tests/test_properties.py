"""Property tests of the public surface: malformed input of every kind (prompts, scalars, step-function tokens and
counts, damaged checkpoint files, foreign directories for the converters) gets a clear error, never a raw internal
one or a wrong result; valid input drawn the same way gives the greedy reference's result.

A clear error is a ValueError or TypeError whose message names the argument (for files: a ValueError,
FileNotFoundError or FileExistsError naming the path); the command lines exit non-zero with a message and write
nothing. One tiny target and drafter serve the whole module, and the inputs that compile vary in value, not shape,
so each program compiles once.
"""

import contextlib
import io
import json
import math
import shutil
import tempfile
import warnings
from pathlib import Path
from typing import NamedTuple

import numpy as np
import pytest
from conftest import tiny_config

import ready_jax as rj
from convert import deepspec, hf_target, upgrade
from ready_jax import checkpoint, hf_format, modes

pytestmark = pytest.mark.slow

hypothesis = pytest.importorskip("hypothesis")
st = hypothesis.strategies
hnp = pytest.importorskip("hypothesis.extra.numpy")

CLEAR = (ValueError, TypeError, FileNotFoundError, FileExistsError)
VOCAB = tiny_config().vocab_size
BATCH, BLOCK, CAPACITY = 2, 3, 16  # the shapes every compiled step runs at: batch, verified block, cache size
PROMPT = np.array([[3, 4], [5, 6]])
HOST = hypothesis.settings(max_examples=25, deadline=None)      # rejected before anything compiles
COMPILED = hypothesis.settings(max_examples=5, deadline=None)   # each example runs compiled programs


@pytest.fixture(scope="module")
def models(tiny_target):
    drafter = rj.Drafter.init(tiny_target.config, rj.DrafterConfig(block_size=3, num_layers=1, markov_rank=8,
                                                                   reader=rj.ReaderConfig(rank=4)), seed=1)
    return tiny_target, drafter


@pytest.fixture(scope="module")
def saved(models, tmp_path_factory):
    """Pristine checkpoints: {"target": dir, "drafter": dir}."""
    root = tmp_path_factory.mktemp("saved")
    for kind, model in zip(("target", "drafter"), models, strict=True):
        model.save(root / kind)
    return {"target": root / "target", "drafter": root / "drafter"}


def _raises_naming(call, *names: str) -> None:
    """``call()`` must raise a clear error whose message holds one of ``names``."""
    with pytest.raises(CLEAR) as info:
        call()
    assert any(name in str(info.value) for name in names), f"{type(info.value).__name__}: {info.value}"


# ---- strategies ---------------------------------------------------------------------------------------------
ids = st.integers(0, VOCAB - 1)
outside_vocab = st.one_of(st.integers(VOCAB, 2**62), st.integers(-(2**62), -1))
not_arrays = st.one_of(st.none(), st.text(max_size=4), st.floats(), st.booleans(),
                       st.dictionaries(st.text(max_size=2), st.integers(), max_size=2))
json_values = st.recursive(
    st.one_of(st.none(), st.booleans(), st.integers(-3, 64), st.floats(), st.text(max_size=6)),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3),
    max_leaves=6)


@st.composite
def out_of_vocab_arrays(draw, shape):
    """An int64 (or uint64) array of valid ids but for one out of the vocabulary, beyond int32 as often as not."""
    array = draw(hnp.arrays(np.int64, shape, elements=ids))
    bad = draw(outside_vocab)
    array.flat[draw(st.integers(0, array.size - 1))] = bad
    if bad >= 2**32 and draw(st.booleans()):
        return array.astype(np.uint64) + np.uint64(2**63)  # ids a uint32 cast would wrap into the vocabulary
    return array


def bad_token_arrays(batch: int, rank: int = 2):
    """Token inputs that no step taking [B, T] (rank 2) or [B] (rank 1) accepts, whatever its batch size B."""
    good_shape = (batch, 3) if rank == 2 else (batch,)
    other_ranks = [r for r in (0, 1, 2, 3) if r != rank]
    return st.one_of(
        hnp.arrays(st.sampled_from([np.float32, np.float64, np.bool_]), good_shape),
        st.sampled_from(other_ranks).flatmap(
            lambda r: hnp.arrays(np.int64, hnp.array_shapes(min_dims=r, max_dims=r, min_side=1, max_side=3),
                                 elements=ids)),
        st.just(np.zeros((batch, 0) if rank == 2 else (0,), np.int64)),
        out_of_vocab_arrays(good_shape),
        st.just([[1, 2], [3, [4]]]),
        not_arrays)


def wrong_batches(batch: int, rank: int = 2):
    """Valid token ids, but not ``batch`` rows of them."""
    return st.integers(0, 3).filter(lambda b: b != batch).map(lambda b: np.ones((b, 3)[:rank], np.int64))


def bad_prompts():
    """What ``generate`` must refuse as prompts."""
    rows = st.lists(ids, min_size=1, max_size=4).map(np.array)
    return st.one_of(
        hnp.arrays(st.sampled_from([np.float32, np.float64, np.bool_, np.complex64]),
                   hnp.array_shapes(min_dims=2, max_dims=2, max_side=3)),
        st.sampled_from([0, 1, 3]).flatmap(
            lambda r: hnp.arrays(np.int64, hnp.array_shapes(min_dims=r, max_dims=r, min_side=1, max_side=3),
                                 elements=ids)),
        st.sampled_from([(0, 3), (2, 0)]).map(lambda shape: np.zeros(shape, np.int64)),
        st.tuples(st.lists(rows, max_size=2), st.lists(rows, max_size=2)).map(
            lambda parts: [*parts[0], np.array([], np.int64), *parts[1]]),
        st.integers(1, 3).flatmap(lambda b: out_of_vocab_arrays((b, 3))),
        st.lists(rows, min_size=1, max_size=2).map(lambda r: [*r, [1, [2, 3]]]),
        st.lists(ids, min_size=1, max_size=3),
        not_arrays)


def bad_counts(batch: int, most: int):
    """Counts a step taking one per row, each in 0..most, must refuse (None means "all" to prefill)."""
    in_range = st.integers(0, most)
    return st.one_of(
        st.lists(in_range, min_size=0, max_size=4).filter(lambda c: len(c) != batch),
        in_range,
        st.lists(st.one_of(st.integers(most + 1, 2**62), st.integers(-(2**62), -1)), min_size=batch,
                 max_size=batch),
        st.lists(st.floats(0, most), min_size=batch, max_size=batch).map(np.array),
        st.just(np.full((batch,), 2**63, np.uint64)),
        st.lists(st.text(max_size=2), min_size=batch, max_size=batch),
        st.lists(st.booleans(), min_size=batch, max_size=batch).map(np.array))


def _not_one_of(allowed):
    return st.one_of(st.text(max_size=8).filter(lambda s: s not in allowed), st.none(), st.integers(),
                     st.lists(st.sampled_from(allowed), max_size=2))


not_ints = st.one_of(st.floats(), st.text(max_size=3), st.none(), st.booleans(), st.lists(st.integers(), max_size=2))
BAD_GENERATE_ARGS = {
    "max_new_tokens": st.one_of(not_ints, st.integers(max_value=0), st.integers(min_value=2**31)),
    "seed": st.one_of(not_ints, st.integers(min_value=2**63), st.integers(max_value=-(2**63) - 1)),
    "temperature": st.one_of(st.text(max_size=3), st.none(), st.booleans(), st.complex_numbers(),
                             st.floats(max_value=0, exclude_max=True), st.sampled_from([math.nan, math.inf])),
    "capacity": st.one_of(not_ints.filter(lambda v: v is not None), st.integers(max_value=5),
                          st.integers(min_value=2**31)),
    "rollback": _not_one_of(modes.ROLLBACKS),
    "impl": _not_one_of(modes.IMPLS),
    "prompt_bucket": st.one_of(not_ints, st.integers(max_value=0), st.integers(min_value=2**31)),
    "check_finite": st.one_of(st.text(max_size=3), st.integers(), st.none(), st.floats()),
    "eos_token_ids": st.one_of(st.text(max_size=3), st.integers(), st.floats(), st.lists(
        st.one_of(st.floats(), st.text(max_size=2), st.none(), outside_vocab), min_size=1, max_size=3)),
    "drafter": st.one_of(st.text(max_size=3), st.integers(), st.floats(), st.lists(st.integers(), max_size=2)),
}


# ---- generate -----------------------------------------------------------------------------------------------
@HOST
@hypothesis.given(prompts=bad_prompts())
def test_generate_refuses_malformed_prompts(models, prompts):
    target, drafter = models
    _raises_naming(lambda: rj.generate(target, prompts, 2, drafter=drafter), "prompt")


@HOST
@hypothesis.given(data=st.data(), name=st.sampled_from(sorted(BAD_GENERATE_ARGS)))
def test_generate_names_every_bad_scalar(models, data, name):
    target, _ = models
    value = data.draw(BAD_GENERATE_ARGS[name], label=name)
    _raises_naming(lambda: rj.generate(target, np.array([[3, 4]]), **{"max_new_tokens": 4, name: value}), name)


@COMPILED
@hypothesis.given(rows=st.lists(st.lists(ids, min_size=1, max_size=BLOCK), min_size=BATCH, max_size=BATCH))
def test_valid_prompts_give_the_greedy_tokens_with_and_without_a_drafter(models, rows):
    """Ragged prompts padded to one width (one program each); the first token is the prefill's argmax."""
    target, drafter = models
    prompts = [np.array(r) for r in rows]
    greedy = rj.generate(target, prompts, 4, prompt_bucket=BLOCK).tokens
    assert np.array_equal(rj.generate(target, prompts, 4, drafter=drafter, prompt_bucket=BLOCK).tokens, greedy)
    lengths = np.array([len(r) for r in rows])
    padded = np.array([r + [0] * (BLOCK - len(r)) for r in rows])
    logits = np.asarray(target.prefill(target.init_cache(BATCH, CAPACITY), padded, num_new=lengths).logits)
    assert np.array_equal(greedy[:, 0], np.argmax(logits[np.arange(BATCH), lengths - 1], axis=-1))


# ---- the Target step functions ------------------------------------------------------------------------------
class Steps(NamedTuple):
    """A prefilled cache and a verify candidate of a 3-token block (named briefly in failure reports)."""

    cache: rj.TargetCache
    candidate: rj.Candidate

    def __repr__(self) -> str:
        return "Steps(cache, candidate)"


@pytest.fixture(scope="module")
def steps(models):
    target, _ = models
    cache = target.prefill(target.init_cache(BATCH, CAPACITY), PROMPT).cache
    candidate = target.verify(target.prefill(target.init_cache(BATCH, CAPACITY), PROMPT).cache,
                              np.array([[7, 8, 9]] * BATCH))
    return Steps(cache, candidate.cache)


def _donated_cache(target):
    """A cache a later step consumed: its buffers are deleted."""
    cache = target.prefill(target.init_cache(BATCH, CAPACITY), PROMPT).cache
    target.decode(cache, np.array([1, 2]))
    return cache


@HOST
@hypothesis.given(tokens=bad_token_arrays(BATCH), other_batch=wrong_batches(BATCH))
def test_steps_refuse_malformed_tokens(models, steps, tokens, other_batch):
    target, _ = models
    cache, _ = steps
    _raises_naming(lambda: target.forward(tokens), "input_ids", "token ids")
    for bad in (tokens, other_batch):
        _raises_naming(lambda: target.prefill(cache, bad), "tokens", "token ids")  # noqa: B023
        _raises_naming(lambda: target.verify(cache, bad), "block", "token ids")  # noqa: B023


@HOST
@hypothesis.given(tokens=st.one_of(bad_token_arrays(BATCH, rank=1), wrong_batches(BATCH, rank=1)).filter(
    lambda t: not (isinstance(t, np.ndarray) and t.shape == (BATCH, 1))))
def test_decode_refuses_malformed_tokens(models, steps, tokens):
    target, _ = models
    _raises_naming(lambda: target.decode(steps.cache, tokens), "tokens", "token ids")


@HOST
@hypothesis.given(counts=bad_counts(BATCH, 3), accepted=st.one_of(bad_counts(BATCH, 3), st.none()))
def test_counts_out_of_range_or_of_the_wrong_kind_are_refused(models, steps, counts, accepted):
    target, _ = models
    cache, candidate = steps
    _raises_naming(lambda: target.prefill(cache, np.ones((BATCH, 3), np.int32), num_new=counts), "num_new")
    _raises_naming(lambda: rj.Target.commit(candidate, accepted), "n_accepted")


@HOST
@hypothesis.given(data=st.data())
def test_steps_refuse_what_is_not_a_live_cache_or_a_layer_list(models, steps, data):
    target, _ = models
    cache, candidate = steps
    which = data.draw(st.sampled_from(["a candidate", "a donated cache", "no cache"]))
    not_a_cache = {"a candidate": lambda: candidate, "a donated cache": lambda: _donated_cache(target),
                   "no cache": lambda: data.draw(not_arrays)}[which]()
    _raises_naming(lambda: target.prefill(not_a_cache, np.ones((BATCH, 2), np.int32)), "cache")
    _raises_naming(lambda: rj.Target.commit(data.draw(st.one_of(not_arrays, st.just(cache))), [1, 1]), "commit")
    layers = data.draw(st.one_of(st.text(min_size=1, max_size=3), st.integers(), st.lists(st.floats(), min_size=1),
                                 st.lists(outside_vocab, min_size=1, max_size=2), st.just([1, 1])))
    _raises_naming(lambda: target.prefill(cache, np.ones((BATCH, 2), np.int32), hidden_layers=layers),
                   "hidden_layers")
    flag = data.draw(st.one_of(st.text(max_size=3), st.integers(), st.none()))
    _raises_naming(lambda: target.decode(cache, np.array([1, 2]), check_finite=flag), "check_finite")


@COMPILED
@hypothesis.given(prompt=hnp.arrays(np.int64, PROMPT.shape, elements=ids),
                  block=hnp.arrays(np.int64, (BATCH, BLOCK), elements=ids),
                  kept=st.lists(st.integers(0, BLOCK), min_size=BATCH, max_size=BATCH),
                  following=hnp.arrays(np.int64, (BATCH,), elements=ids),
                  rollback=st.sampled_from(modes.ROLLBACKS))
def test_commit_of_n_block_tokens_equals_prefilling_them(models, prompt, block, kept, following, rollback):
    target, _ = models

    def prefilled_prompt():
        return target.prefill(target.init_cache(BATCH, CAPACITY), prompt).cache

    committed = rj.Target.commit(target.verify(prefilled_prompt(), block, rollback=rollback).cache, kept)
    prefilled = target.prefill(prefilled_prompt(), block, num_new=kept).cache
    np.testing.assert_array_equal(committed.lengths, PROMPT.shape[1] + np.array(kept))
    np.testing.assert_array_equal(prefilled.lengths, committed.lengths)
    np.testing.assert_allclose(target.decode(committed, following).logits, target.decode(prefilled, following).logits,
                               rtol=1e-4, atol=1e-4)


# ---- checkpoints --------------------------------------------------------------------------------------------
LOADERS = {"target": rj.Target.load, "drafter": rj.Drafter.load}


@contextlib.contextmanager
def _copy_of(directory: Path):
    with tempfile.TemporaryDirectory() as tmp:
        copy = Path(tmp) / directory.name
        shutil.copytree(directory, copy)
        yield copy


def _same_model(a, b) -> bool:
    flat_a, flat_b = checkpoint.flat_state(a.params), checkpoint.flat_state(b.params)
    return a.config == b.config and flat_a.keys() == flat_b.keys() and all(
        np.array_equal(np.asarray(flat_a[k]), np.asarray(flat_b[k])) for k in flat_a)


def _load_or_refuse(kind: str, directory: Path):
    """The loaded model, or None after a clear error that names the directory."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # a format-version-1 record loads with a warning
            return LOADERS[kind](directory)
    except CLEAR as e:
        assert str(directory) in str(e), f"{type(e).__name__}: {e}"
        return None


@HOST
@hypothesis.given(kind=st.sampled_from(sorted(LOADERS)), name=st.sampled_from(["config.json", "model.safetensors"]),
                  data=st.data())
def test_a_flipped_byte_is_refused_or_changes_nothing(saved, kind, name, data):
    with _copy_of(saved[kind]) as directory:
        raw = bytearray((directory / name).read_bytes())
        raw[data.draw(st.integers(0, len(raw) - 1), label="position")] ^= data.draw(st.integers(1, 255), label="mask")
        (directory / name).write_bytes(bytes(raw))
        loaded = _load_or_refuse(kind, directory)
    if name == "model.safetensors":
        assert loaded is None
    else:  # JSON whitespace or an exponent's case can flip without changing the record
        assert loaded is None or _same_model(loaded, LOADERS[kind](saved[kind]))


@HOST
@hypothesis.given(kind=st.sampled_from(sorted(LOADERS)), name=st.sampled_from(["config.json", "model.safetensors"]),
                  data=st.data())
def test_a_truncated_file_is_refused(saved, kind, name, data):
    with _copy_of(saved[kind]) as directory:
        raw = (directory / name).read_bytes()
        (directory / name).write_bytes(raw[:data.draw(st.integers(0, len(raw) - 1), label="length")])
        assert _load_or_refuse(kind, directory) is None


def _paths(tree, prefix=()):
    """Every key path of a JSON tree (dicts and lists), the root's children first."""
    items = tree.items() if isinstance(tree, dict) else enumerate(tree) if isinstance(tree, list) else ()
    for key, value in items:
        yield (*prefix, key)
        yield from _paths(value, (*prefix, key))


_DELETE = object()


def _edit(meta: dict, path: tuple, value) -> None:
    """Set the value at key ``path`` of ``meta`` (``_DELETE``: remove a dict's key, put None in a list)."""
    parent = meta
    for key in path[:-1]:
        parent = parent[key]
    if value is _DELETE and isinstance(parent, dict):
        del parent[path[-1]]
    else:
        parent[path[-1]] = None if value is _DELETE else value


def _edited(meta: dict, data) -> dict:
    """``meta`` with the value at one drawn key path replaced by a drawn JSON value, or deleted."""
    edited = json.loads(json.dumps(meta))
    path = data.draw(st.sampled_from(list(_paths(edited))), label="path")
    _edit(edited, path, data.draw(st.one_of(json_values, st.just(_DELETE)), label="value"))
    return edited


@HOST
@hypothesis.given(kind=st.sampled_from(sorted(LOADERS)), rehash=st.booleans(), data=st.data())
def test_an_edited_config_is_refused_or_read_as_written(saved, kind, rehash, data):
    """Without its hash recomputed an edit must be refused unless it leaves the model as it was (an equal value,
    or format_version 1, whose config was never hashed); with it (a deliberate edit), the model loads with exactly
    the edited config, or the load says why not."""
    meta = _edited(json.loads((saved[kind] / "config.json").read_text()), data)
    if rehash:
        meta["sha256"] = checkpoint.record_sha256(meta)
    with _copy_of(saved[kind]) as directory:
        (directory / "config.json").write_text(json.dumps(meta))
        loaded = _load_or_refuse(kind, directory)
    if loaded is None:
        return
    pristine = LOADERS[kind](saved[kind])
    if not rehash:
        assert _same_model(loaded, pristine)
    else:
        assert loaded.config == type(pristine.config).from_dict(meta[kind])


@HOST
@hypothesis.given(kind=st.sampled_from(sorted(LOADERS)),
                  files=st.dictionaries(st.from_regex(r"[a-z]{1,6}(\.[a-z]{1,4})?", fullmatch=True),
                                        st.binary(max_size=32), min_size=1, max_size=3))
def test_save_never_replaces_a_foreign_directory(models, kind, files):
    model = dict(zip(("target", "drafter"), models, strict=True))[kind]
    with tempfile.TemporaryDirectory() as tmp:
        directory = Path(tmp) / "foreign"
        directory.mkdir()
        for name, content in files.items():
            (directory / name).write_bytes(content)
        with pytest.raises(FileExistsError, match="choose another directory or pass overwrite=True"):
            model.save(directory)
        assert {p.name: p.read_bytes() for p in directory.iterdir()} == files


# ---- the converters' command lines --------------------------------------------------------------------------
SOURCES = ("missing", "empty", "file", "junk", "json", "edited HF config", "truncated target", "truncated drafter",
           "flipped target", "flipped drafter")


def _make_source(kind: str, root: Path, saved: dict, data) -> Path:
    """A source directory the converters must refuse (``kind`` of SOURCES)."""
    src = root / "src"
    if kind == "file":
        src.write_bytes(data.draw(st.binary(max_size=16)))
    elif kind in ("empty", "junk", "json", "edited HF config"):
        src.mkdir()
        if kind == "junk":
            for name in data.draw(st.lists(st.sampled_from(["config.json", "model.safetensors", "x.bin"]),
                                           min_size=1, max_size=3, unique=True)):
                (src / name).write_bytes(data.draw(st.binary(max_size=64)))
        elif kind == "json":
            (src / "config.json").write_text(json.dumps(data.draw(json_values)))
        else:
            (src / "config.json").write_text(json.dumps(_edited(hf_format.hf_config(tiny_config(), "qwen3_5_text"),
                                                                data)))
    elif kind != "missing":
        damage, model = kind.split()
        shutil.copytree(saved[model], src)
        name = "model.safetensors" if damage == "flipped" else data.draw(
            st.sampled_from(["config.json", "model.safetensors"]))
        raw = bytearray((src / name).read_bytes())
        if damage == "flipped":  # the weights' hash catches any flipped byte
            raw[data.draw(st.integers(0, len(raw) - 1))] ^= data.draw(st.integers(1, 255))
        else:
            raw = raw[:data.draw(st.integers(0, len(raw) - 1))]
        (src / name).write_bytes(bytes(raw))
    return src


def _snapshot(root: Path) -> dict:
    return {str(p.relative_to(root)): p.read_bytes() if p.is_file() else None for p in sorted(root.rglob("*"))}


def _fails_with_a_message(run_main) -> str:
    """``run_main()`` (a converter's ``main``) must return or exit non-zero; the message it printed."""
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        try:
            code = run_main()
        except SystemExit as e:
            code = e.code
    assert code not in (0, None)
    assert err.getvalue().strip()
    return err.getvalue()


CONVERTERS = {
    "hf_target": lambda src, dst, target: hf_target.main([src, dst]),
    "hf_target --export-hf": lambda src, dst, target: hf_target.main([src, dst, "--export-hf"]),
    "deepspec": lambda src, dst, target: deepspec.main([src, dst]),
    "deepspec --export": lambda src, dst, target: deepspec.main(["--export", src, dst, "--target", target]),
}


@HOST
@hypothesis.given(source=st.sampled_from(SOURCES), converter=st.sampled_from(sorted(CONVERTERS)),
                  destination=st.sampled_from(["new", "nested new", "non-empty", "file"]), data=st.data())
def test_converters_refuse_bad_sources_and_destinations_and_write_nothing(saved, source, converter, destination,
                                                                          data):
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        src = _make_source(source, root, saved, data)
        dst = root / "out" / "dst" if destination == "nested new" else root / "dst"
        if destination == "non-empty":
            dst.mkdir()
            (dst / "keep.txt").write_text("mine")
        elif destination == "file":
            dst.write_text("mine")
        before = _snapshot(root)
        message = _fails_with_a_message(lambda: CONVERTERS[converter](str(src), str(dst), str(saved["target"])))
        assert "Traceback" not in message
        assert _snapshot(root) == before


@HOST
@hypothesis.given(source=st.sampled_from(SOURCES), data=st.data())
def test_upgrade_refuses_what_is_not_a_sound_checkpoint_and_leaves_it_alone(saved, source, data):
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        src = _make_source(source, root, saved, data)
        before = _snapshot(root)
        _fails_with_a_message(lambda: upgrade.main([str(src)]))
        assert _snapshot(root) == before
