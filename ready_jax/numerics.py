"""Batch invariance: when a token's logits depend on neither how many rows share its step, the other rows, the
padding nor the cache's capacity.

Greedy speculative decoding gives autoregressive decoding's tokens only if a verify block (T rows per
sequence) rounds every token exactly as a decode step (one row) does, and neither may depend on how large the
KV buffers are (a speculative program's are a block larger); in bf16 a logit margin of one rounding step is
common, so one differing last bit changes a token. What breaks that on XLA's CPU backend (docs/numerics.md): a
matmul's per-row result depends on its row count below 8 rows; a sum over the whole KV buffer depends on the
buffer's size; XLA's fusion recomputes a chain of Gated DeltaNet states inside one kernel, contracting
multiply-adds differently by context; and excess precision keeps a bf16 intermediate in fp32 in one program and
not in another. The target's ``batch_invariant`` steps avoid the first three by construction
(every matmul on fixed row tiles, ``ready_jax.rows``: XLA dots of one shape whatever the row count, over column
blocks of each weight in a decode step or verify block, or with ``impl="pallas"`` one ``row_matmul`` kernel over all
the step's rows; attention over fixed chunks of key slots; the recurrence's
``looped`` form) and compile with the options below for the last, which also keep the CPU's YNNPACK from fusing a
matmul with its neighbours. A row's tokens then depend on its own prompt alone, not on the batch, the other rows or
the prompt bucket (checked on XLA's CPU backend for dense and MoE targets, and for a dense one in the Pallas
kernels' interpreters).

On a GPU or TPU the default is off, and ``generate`` says once that greedy output may differ from the
autoregressive one. With it on and ``impl="pallas"`` the matmuls are row-invariant by the kernel's construction
there too; attention, the norms and an MoE's experts stay XLA's, which nothing here can check on a device
(docs/numerics.md).
"""

from __future__ import annotations

import warnings

import jax

from .checks import check_flag

# XLA's YNNPACK fusions on a CPU fuse a matmul with its producers and consumers, and round by the fused graph.
# Excess precision lets XLA skip a bf16 rounding between fused ops in one program and not in another.
CPU_COMPILER_OPTIONS: dict[str, str | bool] = {"xla_cpu_experimental_ynn_fusion_type": "",
                                               "xla_allow_excess_precision": False}


def resolve(batch_invariant: bool | None) -> bool:
    """``batch_invariant`` as given, or where None the default of this machine's backend: on for a CPU (where it
    is checked), off on an accelerator (where it is not, and costs verify speed)."""
    if batch_invariant is None:
        return jax.default_backend() == "cpu"
    return check_flag(batch_invariant, "batch_invariant")


def compiler_options(batch_invariant: bool) -> dict[str, str | bool]:
    """The XLA options a batch-invariant program compiles with on this backend (none elsewhere)."""
    return dict(CPU_COMPILER_OPTIONS) if batch_invariant and jax.default_backend() == "cpu" else {}


def warn_unless_invariant(batch_invariant: bool, greedy: bool, speculative: bool) -> None:
    """One line when greedy speculative output is not guaranteed to equal the autoregressive output."""
    if greedy and speculative and not batch_invariant:
        warnings.warn(f"greedy speculative output may differ from autoregressive output where two logits tie "
                      f"within rounding: verify runs batched on {jax.default_backend()} (batch_invariant=False; "
                      f"docs/numerics.md)", stacklevel=3)
