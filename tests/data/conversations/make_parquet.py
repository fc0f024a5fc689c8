"""Writes the two parquet files beside this script (run it again after changing them): ``conversations.parquet``
(ShareGPT rows, a ``source`` column beside) and ``bad_rows.parquet`` (a good row, then rows of the wrong shape)."""

from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

HERE = Path(__file__).parent
TURN = pa.struct([("from", pa.string()), ("value", pa.string())])
TURNS = pa.list_(TURN)


def turns(*pairs):
    return [{"from": role, "value": text} for role, text in pairs]


good = pa.table({
    "source": ["parquet-1", "parquet-2", "parquet-3"],
    "conversations": pa.array([
        turns(("human", "How many legs does a spider have?"), ("gpt", "A spider has eight legs.")),
        turns(("system", "Reply with code only."), ("human", "Reverse a list xs in Python."), ("gpt", "xs[::-1]")),
        turns(("human", "Is zero even?")),
    ], TURNS),
})
bad = pa.table({
    "conversations": pa.array([
        turns(("human", "a good parquet row"), ("gpt", "it is")),
        None,                                          # no conversation at all
        [],                                            # an empty one
        turns(("human", None)),                        # a turn without its text
        turns(("narrator", "once upon a time")),       # an unknown role
    ], TURNS),
})
pq.write_table(good, HERE / "conversations.parquet")
pq.write_table(bad, HERE / "bad_rows.parquet")
