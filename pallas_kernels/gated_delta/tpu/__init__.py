"""Gated DeltaNet's Mosaic TPU kernels, one module per op: ``recurrent`` (:func:`gated_delta_recurrent`, decode /
verify) and ``chunked`` (:func:`gated_delta_chunked`, prefill, training); ``common`` holds the layout and block
fitting both use.

References: ``pallas_kernels.gated_delta.reference``; each kernel takes its reference's arguments and returns its
results. q, k ``[B, T, H_k, d_k]`` not yet normalised, v ``[B, T, H_v, d_v]``, g, beta ``[B, T, H_v]``,
initial_state ``[B, H_v, d_k, d_v]`` fp32 or None (zeros) -> o ``[B, T, H_v, d_v]`` in v's dtype and fp32 states.
Value head h reads key head ``h // (H_v / H_k)``. Whatever the input dtype, q and k are normalised and every
product is taken in fp32 on chip (bf16 blocks are upcast after loading; f32 dots run at ``Precision.HIGHEST``).

Layout. Mosaic tiles the last two dims of a block by (8, 128) unless they are the array's whole dims, and a head is
one slice of the H axis, which sits second to last in the token-major inputs. The wrappers therefore move heads in
front of tokens (q, k, v, o ``[B, H, T, d]``, g and beta ``[B, H_v, 2, T]``), so that a program's blocks are
``[tokens, d]``; the states are head-major already and are never moved. The transposes touch only the per-token
inputs and outputs: at decode and verify they are small next to the states (T (2 H_k d_k + 2 H_v d_v + 2 H_v)
elements against the H_v d_k d_v fp32 state numbers read and written); at prefill they are one more XLA pass over q,
k, v and o, beside a kernel whose fp32 chunk matmuls outweigh its HBM traffic. Where a kernel takes one token at a
time (the recurrent one: v, o, g, beta) the token gets a leading dim of its own (``[T, 1, d]``, a free reshape), so
taking token t never slices inside a vreg. d_k and d_v are zero-padded to multiples of 128 (zero key components and
zero value columns change nothing), so every state tile is lane-dense; real checkpoints use 128 and pay nothing,
other widths copy their states once more. Under ``jax.vmap`` the mapped axis joins the batch axis of the same grid
(see ``common.batch_folded``).

* :func:`gated_delta_recurrent`, grid ``(B, H_v, d_v / block_v)``, all "parallel". Columns of the state evolve
  independently (the recurrence mixes d_k rows, never d_v columns), so a program owns a ``[d_k, block_v]`` fp32
  state block in VMEM scratch for all T tokens (T <= MAX_RECURRENT_TOKENS, unrolled). Per token:
  ``S *= exp(g)``, ``u = beta (v - sum_k S k)``, ``S += k u^T``, ``o = sum_k S q``: elementwise products and
  sublane reductions over d_k on the VPU in full fp32 (no MXU passes), with k and q turned into ``[d_k, 1]``
  columns once.
  Writes o per token; with ``output_all_states`` the state after every token ``[B, T, H_v, d_k, d_v]``
  (``include_initial_state`` puts the entering state first, ``[B, T + 1, ...]``: a verify pass's candidates);
  otherwise the final state, into initial_state's buffer (``input_output_aliases``), so a caller that donates
  it updates it in place.
* :func:`gated_delta_chunked`, grid ``(B, H_v, d_v / block_v, N)``, the chunk axis N "arbitrary" and innermost. The
  state ``[d_k, block_v]`` lives in VMEM scratch across the chunks: loaded (or zeroed) at the first chunk under
  ``pl.when``, written once at the last, into initial_state's buffer. Per chunk of C tokens, on chip: the
  decay matrix (log-decays summed directly over (j, i] by one triangular matmul, as the reference sums them),
  the scores, the strictly lower ``A = beta (k k^T) * decay``, ``(I + A)^-1`` by block doubling, the UT
  transform ``u = X beta v``, ``w = X beta exp(gc) k``, then ``u -= w S``, ``o = (q exp(gc)) S + attn u`` and
  ``S = exp(g_C) S + (k exp(gc_C - gc))^T u``. One launch; nothing but o and the final state reaches HBM. T is
  padded with g = beta = 0 (the state is unchanged) to whole chunks of ``min(chunk_size, T rounded up to 8)``.
  Only the forward pass is a kernel: the gradient is the reference's pullback, recomputed from the inputs.

VMEM. A kernel's footprint is its pipelined blocks, double-buffered, plus its scratch (``tpu_common.VmemFootprint``).
With p(r, c) the bytes of an ``[r, c]`` block rounded up to whole tiles (8 rows of 32-bit or 16 of 16-bit, by 128
lanes), D_k, D_v the padded widths, bv = block_v, h = 1 with an initial state (else 0):

* recurrent: ``2 [2 p(T, D_k) + 2 T p(1, bv) + 2 T p(1, 1) + (h + S) p(D_k, bv)] + p(D_k, bv)``, S the number of
  states written (1, T or T + 1);
* chunked: ``2 [2 p(C, D_k) + 2 p(C, bv) + 2 p(C, 1) + p(1, C) + (h + 1) p(D_k, bv)] + p(D_k, bv)``.

Every launch checks it against its config's TPU generation (``tpu_common.vmem_budget_bytes``) and raises a
ValueError naming the numbers when it does not fit; with ``config=None`` the widest block_v dividing D_v that
fits the default generation is chosen. The chunk matrices ([C, C] fp32) are values, not blocks: Mosaic keeps
them in vregs and its internal scratch. Design: docs/kernels.md.
"""

from .chunked import GDNChunkedConfig, chunked_config, chunked_footprint, gated_delta_chunked
from .recurrent import (
    MAX_RECURRENT_TOKENS,
    GDNRecurrentConfig,
    gated_delta_recurrent,
    recurrent_config,
    recurrent_footprint,
)

__all__ = ["MAX_RECURRENT_TOKENS", "GDNChunkedConfig", "GDNRecurrentConfig", "chunked_config", "chunked_footprint",
           "gated_delta_chunked", "gated_delta_recurrent", "recurrent_config", "recurrent_footprint"]
