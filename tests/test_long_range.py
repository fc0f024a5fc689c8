"""The long-range recall task (``ready_jax.data``) and the long-range testbed's pieces."""

import numpy as np
import pytest
from tokenizers import Tokenizer

from ready_jax import cli, data


@pytest.fixture(scope="module")
def tokenizer():
    return Tokenizer.from_file(str(cli.repo_path("zoo", "target", "tokenizer.json")))


def _records(ids, task):
    """Every (record start, record) of an id array: OPEN, key, values, CLOSE."""
    ids = np.asarray(ids)
    starts = np.flatnonzero(ids == task.open_id)
    return [(int(s), ids[s:s + task.record_tokens]) for s in starts]


@pytest.mark.parametrize("distance", [8, 40])
def test_prompt_answer_sits_distance_tokens_back(tokenizer, distance):
    task = data.LongRangeTask.for_tokenizer(tokenizer)
    prompts = data.long_range_prompts(tokenizer, distance, 4, seed=3)
    assert len(prompts) == 4
    for p in prompts:
        ids, ref = np.asarray(p["ids"]), np.asarray(p["reference"])
        assert len(ref) == task.value_tokens + 1 and ref[-1] == task.close_id
        assert len(ids) == 32 + distance + 2 and p["distance"] == distance
        query = len(ids) - 2                                     # the query's OPEN
        assert ids[query] == task.open_id
        np.testing.assert_array_equal(ids[query - distance:query - distance + 2], ids[query:])
        np.testing.assert_array_equal(ids[query - distance + 2:query - distance + task.record_tokens], ref)
        # The markers appear nowhere else: the filler holds none.
        assert np.flatnonzero(ids == task.open_id).tolist() == [query - distance, query]
        assert np.flatnonzero(ids == task.close_id).tolist() == [query - distance + task.record_tokens - 1]
        assert not np.isin(ref[:-1], [data.EOS_ID, data.MASK_ID, data.PAD_ID, task.open_id]).any()


def test_prompts_are_deterministic_and_seeds_differ(tokenizer):
    a = data.long_range_prompts(tokenizer, 16, 3, seed=0)
    assert a == data.long_range_prompts(tokenizer, 16, 3, seed=0)
    b = data.long_range_prompts(tokenizer, 16, 3, seed=1)
    assert all(x["reference"] != y["reference"] and x["ids"] != y["ids"] for x, y in zip(a, b, strict=True))


def test_fixed_length_prompts_and_bad_settings(tokenizer):
    for distance in (8, 50):
        prompts = data.long_range_prompts(tokenizer, distance, 2, seed=0, length=64, split="train")
        assert all(len(p["ids"]) == 64 for p in prompts)
    with pytest.raises(ValueError, match="distance 7 is shorter than a record"):
        data.long_range_prompts(tokenizer, 7, 1, seed=0)
    with pytest.raises(ValueError, match="cannot hold a query 70 tokens after"):
        data.long_range_prompts(tokenizer, 70, 1, seed=0, length=64)
    with pytest.raises(ValueError, match="split 'dev'"):
        data.long_range_prompts(tokenizer, 16, 1, seed=0, split="dev")
    with pytest.raises(ValueError, match="value_tokens 0"):
        data.long_range_prompts(tokenizer, 16, 1, seed=0, value_tokens=0)


def test_training_windows_hold_records_and_their_queries(tokenizer):
    task = data.LongRangeTask.for_tokenizer(tokenizer, value_tokens=3)
    windows = np.random.default_rng(0).integers(200, 600, (16, 257)).astype(np.int32)  # no marker ids
    windows[0, 5] = task.open_id                              # a stray marker in the corpus text is removed
    out = data.long_range_windows(task, windows, seed=0, position=32, fraction=1.0, max_distance=100, records=6)
    assert out.shape == windows.shape
    np.testing.assert_array_equal(out, data.long_range_windows(task, windows, 0, 32, 1.0, 100, 6))
    assert not np.array_equal(out, data.long_range_windows(task, windows, 0, 48, 1.0, 100, 6))
    pairs = 0
    for row in out:
        records = _records(row, task)
        assert len(records) % 2 == 0 and len(records) <= 12
        by_key = {}
        for start, record in records:
            assert record[-1] == task.close_id
            by_key.setdefault(tuple(record), []).append(start)
        for starts in by_key.values():                       # each record appears once more, later, as its query
            assert len(starts) == 2 and task.record_tokens <= starts[1] - starts[0] <= 100
            pairs += 1
    assert pairs >= 16 * 3
    untouched = data.long_range_windows(task, windows[1:], seed=0, position=0, fraction=0.0, max_distance=100,
                                        records=6)
    np.testing.assert_array_equal(untouched, windows[1:])
