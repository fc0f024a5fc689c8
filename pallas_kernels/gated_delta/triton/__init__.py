"""Gated DeltaNet's Pallas (Triton) kernels, one module per op: ``recurrent`` (:func:`gated_delta_recurrent`,
decode / verify) and ``chunked`` (:func:`gated_delta_chunked`, prefill, training).

References: ``pallas_kernels.gated_delta.reference``; each kernel takes its reference's arguments and returns its
results. q, k ``[B, T, H_k, d_k]`` not yet normalised, v ``[B, T, H_v, d_v]``, g, beta ``[B, T, H_v]``,
initial_state ``[B, H_v, d_k, d_v]`` fp32 or None (zeros) -> o ``[B, T, H_v, d_v]`` in v's dtype and fp32 states.

* :func:`gated_delta_recurrent`: the recurrence over a few tokens in one launch; the final state ``[B, H_v, d_k, d_v]``,
  or with ``output_all_states`` the state after every token ``[B, T, H_v, d_k, d_v]``; ``include_initial_state``
  (with output_all_states) puts the state before the first token first: ``[B, T + 1, ...]``, a verify pass's
  candidates. The state and all arithmetic are fp32 with no Triton dots (exact fp32, any d_k); the final state
  is written into initial_state's buffer, so a caller that donates it updates it in place.
* :func:`gated_delta_chunked`: two launches, ``gdn_chunked_prepare`` (per chunk, all chunks in parallel: decays,
  intra-chunk scores and the UT transform) and ``gdn_chunked_scan`` (per value-column block: the state carried
  over the chunks, written once into initial_state's buffer). fp32 throughout, every dot ``precision=HIGHEST``
  with M, N, K >= 16 (smaller contractions multiply and sum); chunks are powers of 2 >= 16 and T is padded with
  g = beta = 0, which leaves the state unchanged. Only the forward pass is fused: the gradient is the
  reference's pullback, recomputed from the inputs.

On the GPU, outputs and intermediates of 2**31 elements or more are refused (Triton's int32 offsets). Design:
docs/kernels.md.
"""

from .chunked import GDNChunkedConfig, gated_delta_chunked
from .recurrent import GDNRecurrentConfig, gated_delta_recurrent

__all__ = ["GDNChunkedConfig", "GDNRecurrentConfig", "gated_delta_chunked", "gated_delta_recurrent"]
