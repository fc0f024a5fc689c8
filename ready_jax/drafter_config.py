"""Frozen configurations of the drafters: :class:`DrafterConfig` (DSpark), :class:`ReaderConfig` (ReaDy) and
:class:`MTPConfig` (the target's own MTP head).

All are plain data checked in ``__post_init__``; the first two have ``resolve(target_config)``, which fills what
comes from the target and raises one ValueError naming every setting that does not fit it.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from .config import FULL_ATTENTION, INT32_MAX, LINEAR_ATTENTION, TargetConfig, field_type_problems
from .modes import READER_KINDS, READER_QUERIES, READER_READOUTS, ReaderKind, ReaderQuery, ReaderReadout

STATE: ReaderKind = "state"
KV: ReaderKind = "kv"
_SIZE_FIELDS = ("hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim", "intermediate_size",
                "vocab_size", "num_target_layers")
# The target verifies a round's block_size + 1 tokens in one pass and the drafter drafts them in one; DeepSpec's
# drafters use 7-16. A block far larger gives no speed-up and only makes every round's programs huge (10**9 ran
# for minutes without an error).
MAX_BLOCK_SIZE = 256




READER_DESIGNS = {  # the state readers beside the paper's basis reader: label and ReaderConfig fields
    "content": ("content query", dict(query="content", readout="learned")),
    "tied": ("tied query", dict(query="tied", readout="learned")),
    "tied_read": ("tied read-out", dict(query="tied", readout="tied")),
    "tied_read_ungated": ("tied read-out, no gate", dict(query="tied", readout="tied_ungated")),
}


@dataclasses.dataclass(frozen=True)
class ReaderConfig:
    """Where the reader reads from, its rank, and which draft layers it sits in.

    ``source_layers`` count the target's decoder layers from 0 (``cache.layers[l % p]`` holds layer
    ``l``'s entry at group ``l // p``); they must be Gated DeltaNet layers for ``kind="state"`` and
    full-attention layers for ``kind="kv"``. None picks the layers of the right kind nearest
    ``L/2 - 2`` and ``L - 2`` (30 and 62 for a 64-layer Qwen3.5 target; 31 and 63 for ``"kv"``).
    ``inject_layers`` are draft-layer indices (negative counts from the end; default: last only).
    ``num_heads`` / ``key_dim`` / ``value_dim`` are the target geometry the parameters are shaped
    for (``H_v, d_k, d_v`` of the GDN layers, or ``H_kv, head_dim, head_dim``); ``resolve`` fills them,
    and ``num_key_heads`` (``H_k``: value heads sharing a key head read one key space) for the state reader.

    ``query`` (state reader only): ``"basis"``, the paper's read in a fixed rank-``rank`` key basis
    ``U_m``; ``"content"``, a full ``d_k`` query per (source layer, key head) from a factorised projection
    ``h -> query_rank -> L_src * H_k * d_k`` (None: the largest ``query_rank`` whose reader has no more
    parameters than the basis reader of the same rank, :func:`parameter_matched_query_rank`); ``"tied"``, the
    source layer's own query projection (frozen, copied from the target) on the draft hidden through a
    zero-initialised low-rank adapter of rank ``query_rank`` (None: ``rank``). Either way the value side stays
    compressed to ``rank`` by ``V_m``.

    ``output_rank`` (content and tied queries only): None, ``W_o`` is one ``[M rank, d]`` matrix; an integer
    ``r_o`` factorises it as ``M rank -> r_o -> d`` (the second factor starts at zero), so the value side can stay
    whole (``rank = d_v``) while every draft position still passes through ``r_o`` numbers, chosen jointly over
    the pairs after the read rather than per pair before it.

    ``readout`` (tied query only): ``"learned"``, the read goes through the reader's norm and ``W_o`` as above;
    ``"tied"``, each source layer's read, value side whole (no ``V_m``), goes through that layer's own output
    path (per value head its RMSNorm weight and the gate ``silu(z)`` of the draft hidden's ``in_proj_z``, then
    ``out_proj``; copied from the target, frozen), and the layers' outputs are summed, as the target's residual
    stream sums them; ``"tied_ungated"`` leaves the gate out. A zero-initialised learned map ``[d, d]`` adds that
    sum to the draft hidden (``output_rank`` r_o: factorised ``d -> r_o -> d``). Here ``rank`` sizes the query's
    adapter only (``query_rank`` None: ``rank``); nothing compresses the state.
    """

    source_layers: tuple[int, ...] | None = None
    rank: int = 8
    inject_layers: tuple[int, ...] = (-1,)
    kind: ReaderKind = STATE
    num_heads: int | None = None
    key_dim: int | None = None
    value_dim: int | None = None
    query: ReaderQuery = "basis"
    query_rank: int | None = None
    num_key_heads: int | None = None
    output_rank: int | None = None
    readout: ReaderReadout = "learned"

    def __post_init__(self):
        problems = field_type_problems(self)
        if problems:
            raise TypeError("invalid ReaderConfig: " + "; ".join(problems))
        for name in ("source_layers", "inject_layers"):
            value = getattr(self, name)
            if value is not None:
                object.__setattr__(self, name, tuple(int(i) for i in value))
        problems = []
        if self.kind not in READER_KINDS:
            problems.append(f"kind {self.kind!r} is not one of {READER_KINDS}")
        if self.rank < 1:
            problems.append(f"rank {self.rank} must be >= 1")
        if self.query not in READER_QUERIES:
            problems.append(f"query {self.query!r} is not one of {READER_QUERIES}")
        elif self.query != "basis" and self.kind != STATE:
            problems.append(f"query {self.query!r} reads Gated DeltaNet states: it needs kind 'state'")
        if self.query_rank is not None and (self.query_rank < 1 or self.query == "basis"):
            problems.append(f"query_rank {self.query_rank} must be >= 1 and belongs to a 'content' or 'tied' query")
        if self.output_rank is not None and (self.output_rank < 1 or self.query == "basis"):
            problems.append(f"output_rank {self.output_rank} must be >= 1 and belongs to a 'content' or 'tied' "
                            "query")
        if self.readout not in READER_READOUTS:
            problems.append(f"readout {self.readout!r} is not one of {READER_READOUTS}")
        elif self.readout != "learned" and self.query != "tied":
            problems.append(f"readout {self.readout!r} reads through the source layers from their tied query's "
                            f"input: it needs query 'tied', not {self.query!r}")
        if self.num_key_heads is not None and (self.num_key_heads < 1 or (
                self.num_heads is not None and self.num_heads % self.num_key_heads)):
            problems.append(f"num_key_heads {self.num_key_heads} must be >= 1 and divide num_heads {self.num_heads}")
        if self.source_layers is not None and (not self.source_layers
                                               or len(set(self.source_layers)) != len(self.source_layers)):
            problems.append(f"source_layers {self.source_layers} must be non-empty without repeats")
        if not self.inject_layers or len(set(self.inject_layers)) != len(self.inject_layers):
            problems.append(f"inject_layers {self.inject_layers} must be non-empty without repeats")
        for name in ("num_heads", "key_dim", "value_dim"):
            value = getattr(self, name)
            if value is not None and value < 1:
                problems.append(f"{name} {value} must be >= 1")
        head_dims = [d for d in (self.key_dim, self.value_dim) if d is not None]
        if head_dims and self.rank > min(head_dims):
            problems.append(f"rank {self.rank} is larger than the head dim {min(head_dims)} it compresses "
                            "(rank = head dim already means no compression)")
        if problems:
            raise ValueError("invalid ReaderConfig: " + "; ".join(problems))

    @property
    def num_pairs(self) -> int:
        """M: (source layer, head) pairs; pair m = source index * num_heads + head."""
        return len(self.source_layers) * self.num_heads

    @property
    def num_query_heads(self) -> int:
        """Queries a content or tied read forms per position: one per (source layer, key head)."""
        return len(self.source_layers) * self.num_key_heads

    def resolve(self, target: TargetConfig, num_draft_layers: int) -> ReaderConfig:
        """Fill defaults and the target geometry; raise ValueError naming every bad setting."""
        wanted = LINEAR_ATTENTION if self.kind == STATE else FULL_ATTENTION
        sources = self.source_layers or default_source_layers(target, self.kind)
        problems = []
        for layer in sources:
            if not 0 <= layer < target.num_hidden_layers:
                problems.append(f"source layer {layer} is outside the target's layers "
                                f"0..{target.num_hidden_layers - 1}")
            elif target.layer_types[layer] != wanted:
                problems.append(f"source layer {layer} is a {target.layer_types[layer]} layer; a "
                                f"{self.kind!r} reader reads {wanted} layers")
        inject = []
        for i in self.inject_layers:
            if not -num_draft_layers <= i < num_draft_layers:
                problems.append(f"inject layer {i} is outside the {num_draft_layers} draft layers")
            inject.append(i % num_draft_layers)
        if len(set(inject)) != len(inject):
            problems.append(f"inject_layers {self.inject_layers} name the same draft layer twice")
        if self.kind == STATE:
            geometry = (target.linear_num_value_heads, target.linear_key_head_dim,
                        target.linear_value_head_dim)
            key_heads = target.linear_num_key_heads
        else:
            geometry = (target.num_key_value_heads, target.head_dim, target.head_dim)
            key_heads = None
        given = (self.num_heads, self.key_dim, self.value_dim)
        if any(g is not None and g != t for g, t in zip(given, geometry, strict=True)):
            problems.append(f"reader geometry (heads, key dim, value dim) {given} does not match the "
                            f"target's {geometry}")
        if self.num_key_heads is not None and self.num_key_heads != key_heads:
            problems.append(f"reader key heads {self.num_key_heads} do not match the target's {key_heads}")
        if self.query == "tied" and self.query_rank is not None and self.query_rank > target.hidden_size:
            problems.append(f"query_rank {self.query_rank} of the tied query's adapter exceeds the hidden size "
                            f"{target.hidden_size}")
        if problems:
            raise ValueError("ReaderConfig does not fit the target: " + "; ".join(problems))
        resolved = dataclasses.replace(self, source_layers=tuple(sources), inject_layers=tuple(sorted(inject)),
                                       num_heads=geometry[0], key_dim=geometry[1], value_dim=geometry[2],
                                       num_key_heads=key_heads)
        if self.query != "basis" and self.query_rank is None:
            rank = (resolved.rank if self.query == "tied"
                    else parameter_matched_query_rank(resolved, target.hidden_size))
            resolved = dataclasses.replace(resolved, query_rank=rank)
        return resolved

    @property
    def resolved(self) -> bool:
        query_fields = () if self.query == "basis" else (self.query_rank, self.num_key_heads)
        return None not in (self.source_layers, self.num_heads, self.key_dim, self.value_dim, *query_fields) and all(
            i >= 0 for i in self.inject_layers)

    def parameter_count(self, hidden_size: int) -> dict[str, int]:
        """Trained parameters of one reader sub-block by part, for a drafter of ``hidden_size`` (a resolved
        config). The tied query's copy of the target's projection is frozen and not counted."""
        d, m, r = hidden_size, self.num_pairs, self.rank
        if self.readout != "learned":
            out_map = {"out_map": d * d} if self.output_rank is None else {
                "out_down": d * self.output_rank, "out_up": self.output_rank * d}
            return {"adapter": 2 * d * self.query_rank, **out_map}
        whole = self.query != "basis" and r == self.value_dim  # no value basis: see reader._ValueSideParams
        parts = {"value_basis": 0 if whole else m * self.value_dim * r, "norm": m * r}
        if self.output_rank is None:
            parts.update(o_proj=m * r * d)
        else:
            parts.update(o_down=m * r * self.output_rank, o_up=self.output_rank * d)
        if self.query == "basis":
            parts.update(key_basis=m * self.key_dim * r, q_proj=d * m * r)
        elif self.query == "content":
            parts.update(q_down=d * self.query_rank, q_up=self.query_rank * self.num_query_heads * self.key_dim)
        else:
            parts.update(adapter=2 * d * self.query_rank)
        return parts

    def round_cost(self, hidden_size: int) -> dict[str, int]:
        """What one sub-block of a resolved state reader reads and computes (multiply-adds), for a drafter of
        ``hidden_size``: once per round, the gather (``M d_k d_v`` state numbers read, whatever the prefix) and
        the numbers it keeps for the reads; per draft position, the query, the read and ``W_o``."""
        d, m, r, dk, dv = hidden_size, self.num_pairs, self.rank, self.key_dim, self.value_dim
        if self.readout != "learned":
            # Whole states kept; per position the tied query, the read, the gate, out_proj and the learned map.
            gate = d * m * dv if self.readout == "tied" else 0
            query = 2 * d * self.query_rank + d * self.num_query_heads * dk
            output = gate + m * dv * d + (d * d if self.output_rank is None else 2 * d * self.output_rank)
            return {"parameters": sum(self.parameter_count(d).values()),
                    "frozen_parameters": d * self.num_query_heads * dk + gate + m * dv * d,
                    "state_numbers_read": m * dk * dv, "prepared_numbers": m * dk * dv, "gather_macs": 0,
                    "macs_per_position": query + m * dk * dv + output}
        if self.query == "basis":
            kept, gather, query, read = m * r * r, m * dk * dv * r + m * dk * r * r, d * m * r, m * r * r
        else:  # a value side kept whole (r = d_v) is gathered as it is: no multiply-adds
            kept, read = m * dk * r, m * dk * r
            gather = 0 if r == dv else m * dk * dv * r
            query = (d * self.query_rank + self.query_rank * self.num_query_heads * dk if self.query == "content"
                     else 2 * d * self.query_rank + d * self.num_query_heads * dk)
        output = m * r * d if self.output_rank is None else (m * r + d) * self.output_rank
        return {"parameters": sum(self.parameter_count(d).values()),
                "frozen_parameters": d * self.num_query_heads * dk if self.query == "tied" else 0,
                "state_numbers_read": m * dk * dv, "prepared_numbers": kept, "gather_macs": gather,
                "macs_per_position": query + read + output}

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ReaderConfig:
        return cls(**d)


def parameter_matched_query_rank(reader: ReaderConfig, hidden_size: int) -> int:
    """The largest ``query_rank`` (at least 1) for which a content reader has no more trained parameters than a
    basis reader of the same rank: its query projection (``d x r_q + r_q x L_src H_k d_k``) gets what the basis
    reader spends beyond the content reader's other parts (``W_q`` and ``U``, plus ``V`` when the content reader
    keeps its value side whole and holds none, or a factorised ``W_o``'s saving)."""
    basis = dataclasses.replace(reader, query="basis", query_rank=None, output_rank=None)
    content = dataclasses.replace(reader, query="content", query_rank=1)
    rest = sum(count for part, count in content.parameter_count(hidden_size).items() if part not in ("q_down", "q_up"))
    per_query_rank = hidden_size + reader.num_query_heads * reader.key_dim
    return max(1, (sum(basis.parameter_count(hidden_size).values()) - rest) // per_query_rank)


def default_source_layers(target: TargetConfig, kind: ReaderKind = STATE) -> tuple[int, ...]:
    """The layers of the reader's kind nearest ``L/2 - 2`` and ``L - 2`` (ties: the earlier layer)."""
    wanted = LINEAR_ATTENTION if kind == STATE else FULL_ATTENTION
    candidates = [i for i, t in enumerate(target.layer_types) if t == wanted]
    if not candidates:
        raise ValueError(f"the target has no {wanted} layers for a {kind!r} reader to read")
    depth = target.num_hidden_layers
    picks = [min(candidates, key=lambda i, aim=aim: (abs(i - aim), i)) for aim in (depth / 2 - 2, depth - 2)]
    return tuple(sorted(set(picks)))


@dataclasses.dataclass(frozen=True)
class DrafterConfig:
    """Hyper-parameters of a DSpark / ReaDy drafter.

    ``target_layer_ids`` count the target's decoder layers from 0: id ``l`` is the residual-stream
    output of decoder layer ``l`` (after its MLP residual, before the final norm), i.e. HF
    ``output_hidden_states[l + 1]`` and ``ready_jax.target`` ``hidden_layers=(l,)``. This is exactly
    DeepSpec's convention (``extract_context_feature`` takes ``hidden_states[l + 1]``), so DeepSpec
    configs carry over unchanged. DeepSpec's ``-1`` (the embedding output, ``hidden_states[0]``) is not
    supported: the target's step functions do not return it. The ids must be strictly increasing.
    None picks DeepSpec's default spread: ``num_layers`` ids from 1 to ``L - 3`` (1, 9, 17, 25, 33
    for a 36-layer target).

    Size fields left None are taken from the target in :meth:`resolve` (``hidden_size`` and
    ``vocab_size`` *must* equal the target's: the embedding and LM head are the target's). A resolved
    config is self-contained: a saved drafter loads without its target. ``mask_token_id`` defaults
    to ``vocab_size - 1``; DeepSpec uses a reserved token of the tokenizer (151669 for Qwen3).
    ``markov_rank = 0`` drops the Markov head; ``confidence_with_markov`` feeds ``W1[x_{k-1}]`` to the
    confidence head as well (DeepSpec's ``confidence_head_with_markov``).

    ``context_window = w`` lets block queries see only the last ``w`` committed context tokens (the
    block itself stays fully visible), the sliding-window context of memory-bounded deployments;
    None (DeepSpec's default) sees the whole committed context. The cache still holds every slot,
    so results equal a ring buffer of ``w`` slots.
    """

    block_size: int = 7
    num_layers: int = 5
    target_layer_ids: tuple[int, ...] | None = None
    mask_token_id: int | None = None
    markov_rank: int = 256
    confidence_head: bool = True
    confidence_with_markov: bool = True
    context_window: int | None = None
    reader: ReaderConfig | None = None
    hidden_size: int | None = None
    num_attention_heads: int | None = None
    num_key_value_heads: int | None = None
    head_dim: int | None = None
    intermediate_size: int | None = None
    rms_norm_eps: float | None = None
    rope_theta: float | None = None
    vocab_size: int | None = None
    num_target_layers: int | None = None

    def __post_init__(self):
        problems = field_type_problems(self)
        if problems:
            raise TypeError("invalid DrafterConfig: " + "; ".join(problems))
        if self.target_layer_ids is not None:
            object.__setattr__(self, "target_layer_ids", tuple(int(i) for i in self.target_layer_ids))
        if isinstance(self.reader, dict):
            object.__setattr__(self, "reader", ReaderConfig.from_dict(self.reader))
        problems = []
        if not 1 <= self.block_size <= MAX_BLOCK_SIZE:
            problems.append(f"block_size {self.block_size} must be in 1..{MAX_BLOCK_SIZE}")
        if self.num_layers < 1:
            problems.append(f"num_layers {self.num_layers} must be >= 1")
        if self.markov_rank < 0:
            problems.append(f"markov_rank {self.markov_rank} must be >= 0")
        for name in ("rms_norm_eps", "rope_theta"):
            value = getattr(self, name)
            if value is not None and not (math.isfinite(value) and value > 0):
                problems.append(f"{name} {value} must be a finite number > 0")
        if self.context_window is not None and not 1 <= self.context_window <= INT32_MAX:
            problems.append(f"context_window {self.context_window} must be in 1..{INT32_MAX} (or None: the whole "
                            "context)")
        if self.confidence_head and self.confidence_with_markov and self.markov_rank == 0:
            problems.append("confidence_with_markov needs a Markov head (markov_rank > 0)")
        problems += [f"{name} {getattr(self, name)} must be in 1..{INT32_MAX}" for name in _SIZE_FIELDS
                     if getattr(self, name) is not None and not 1 <= getattr(self, name) <= INT32_MAX]
        ids = self.target_layer_ids
        if ids is not None:
            if not ids or any(b <= a for a, b in zip(ids, ids[1:], strict=False)):
                problems.append(f"target_layer_ids {ids} must be non-empty and strictly increasing")
            if -1 in ids:
                problems.append("target_layer_ids -1 (DeepSpec's embedding-output feature) is not supported: "
                                "the target returns decoder-layer outputs only")
            top = self.num_target_layers
            bad = [i for i in ids if i < -1 or (top is not None and i >= top)]
            if bad:
                problems.append(f"target_layer_ids {bad} are outside the target's decoder layers"
                                + (f" 0..{top - 1}" if top is not None else ""))
        if self.num_attention_heads and self.num_key_value_heads and \
                self.num_attention_heads % self.num_key_value_heads:
            problems.append(f"num_attention_heads {self.num_attention_heads} is not a multiple of "
                            f"num_key_value_heads {self.num_key_value_heads}")
        if self.head_dim is not None and self.head_dim % 2:
            problems.append(f"head_dim {self.head_dim} must be even (RoPE)")
        if self.mask_token_id is not None and self.vocab_size is not None and \
                not 0 <= self.mask_token_id < self.vocab_size:
            problems.append(f"mask_token_id {self.mask_token_id} is outside the vocabulary "
                            f"0..{self.vocab_size - 1}")
        if problems:
            raise ValueError("invalid DrafterConfig: " + "; ".join(problems))

    def resolve(self, target: TargetConfig) -> DrafterConfig:
        """Fill unset sizes from ``target`` and check the drafter fits it; raise one ValueError otherwise.

        Idempotent: resolving a resolved config checks it against the target.
        """
        from_target = dict(hidden_size=target.hidden_size, num_attention_heads=target.num_attention_heads,
                           num_key_value_heads=target.num_key_value_heads, head_dim=target.head_dim,
                           intermediate_size=target.intermediate_size, rms_norm_eps=target.rms_norm_eps,
                           rope_theta=target.rope_theta, vocab_size=target.vocab_size,
                           num_target_layers=target.num_hidden_layers)
        problems = []
        shared = {"hidden_size": "the drafter shares the target's embedding and LM head",
                  "vocab_size": "the drafter shares the target's embedding and LM head",
                  "num_target_layers": "target_layer_ids index the target's layers"}
        for name, why in shared.items():
            mine = getattr(self, name)
            if mine is not None and mine != from_target[name]:
                problems.append(f"drafter {name} {mine} does not match the target's {from_target[name]} "
                                f"({why})")
        if self.intermediate_size is None and not target.intermediate_size:
            problems.append("the target has no dense MLP width to default the drafter's to (every layer is a sparse "
                            "MoE): give intermediate_size")
        reader = None
        if self.reader is not None:
            try:
                reader = self.reader.resolve(target, self.num_layers)
            except ValueError as e:
                problems.append(str(e))
        if problems:
            raise ValueError("DrafterConfig does not fit the target: " + "; ".join(problems))
        filled = {k: v if getattr(self, k) is None else getattr(self, k) for k, v in from_target.items()}
        ids = self.target_layer_ids or default_target_layer_ids(target.num_hidden_layers, self.num_layers)
        mask = self.mask_token_id if self.mask_token_id is not None else target.vocab_size - 1
        return dataclasses.replace(self, **filled, target_layer_ids=ids, mask_token_id=mask, reader=reader)

    @property
    def resolved(self) -> bool:
        fields = [getattr(self, f) for f in (*_SIZE_FIELDS, "rms_norm_eps", "rope_theta", "target_layer_ids",
                                             "mask_token_id")]
        return None not in fields and (self.reader is None or self.reader.resolved)

    @property
    def gamma(self) -> int:
        """Drafts per block: one per block position (DeepSpec's convention)."""
        return self.block_size

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> DrafterConfig:
        return cls(**d)


def default_target_layer_ids(num_target_layers: int, count: int) -> tuple[int, ...]:
    """DeepSpec / DFlash's spread: ``count`` layers evenly from 1 to ``L - 3`` (rounded, deduplicated)."""
    if count == 1:
        return (num_target_layers // 2,)
    start = min(1, num_target_layers - 1)
    end = max(start, num_target_layers - 3)
    return tuple(sorted({round(start + i * (end - start) / (count - 1)) for i in range(count)}))


@dataclasses.dataclass(frozen=True)
class MTPConfig:
    """The target checkpoint's own multi-token-prediction head as a drafter (``ready_jax.mtp``).

    Its geometry is the target's (``target``): hidden size, attention heads, RoPE and MLP or MoE are those of the
    target's gated attention layers. ``num_steps`` is k, the tokens it drafts one after another per round
    (vLLM's ``num_speculative_tokens``); the target then verifies ``k + 1`` tokens. Checkpoints ship one MTP
    layer (``mtp_num_hidden_layers = 1``), which every step reuses.
    """

    target: TargetConfig
    num_steps: int = 3

    def __post_init__(self):
        if not isinstance(self.target, TargetConfig):
            raise TypeError(f"MTPConfig.target must be a TargetConfig, got {type(self.target).__name__}")
        if (isinstance(self.num_steps, bool) or not isinstance(self.num_steps, int)
                or not 1 <= self.num_steps <= MAX_BLOCK_SIZE):
            raise ValueError(f"MTPConfig.num_steps must be an int in 1..{MAX_BLOCK_SIZE}, got {self.num_steps!r}")

    @property
    def block_size(self) -> int:
        """Drafts per round, as the loop counts them (DSpark's ``block_size``)."""
        return self.num_steps

    @property
    def layer_config(self) -> TargetConfig:
        """The MTP decoder layer as a one-layer target: gated full attention, and the MLP the target's rule gives a
        layer 0 (the sparse MoE of Qwen3-Next and Qwen3.5-MoE, the dense MLP of Qwen3.5)."""
        return dataclasses.replace(self.target, num_hidden_layers=1, layer_types=(FULL_ATTENTION,),
                                   mlp_only_layers=tuple(i for i in self.target.mlp_only_layers if i == 0))

    def to_dict(self) -> dict[str, Any]:
        return {"target": self.target.to_dict(), "num_steps": self.num_steps}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> MTPConfig:
        unknown = sorted(set(d) - {"target", "num_steps"})
        if unknown:
            raise ValueError(f"unrecognised MTP config field(s) {unknown}")
        return cls(TargetConfig.from_dict(d["target"]), d.get("num_steps", 3))
