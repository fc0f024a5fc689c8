"""The ReaDy reader's Pallas (Triton) kernels: ``state_gather`` (DESIGN.md 3.1), ``state_reader`` (3.2), the
full-key-space read ``content_reader`` and its raw values ``content_read``.

Modules: ``gather`` (:func:`state_gather`), ``read`` (:func:`state_reader`, and the ``reader_out`` launch both
reads end with, :func:`read.norm_and_out`), ``content`` (:func:`content_reader`, :func:`content_read`).

References: ``pallas_kernels.state_reader.reference``; each kernel takes its reference's arguments and returns
its result.

* :func:`state_gather` (reference ``gather_prepare``): for every sequence b and (source layer l, value head h)
  pair ``m = l * H_v + h``, the committed state ``S = per_position[l, b, n_committed[b], h]`` (``d_k x d_v``)
  compressed to ``C[b, m] = U_m^T S V_m`` -> C ``[B, M, r, r]`` fp32. per_position is one
  ``[L_src, B, T+1, H_v, d_k, d_v]`` array or a list of ``[L_i, B, T+1, ...]`` / ``[B, T+1, ...]`` arrays with
  static ``layers`` naming (array, index) per source layer, so the target cache's per-layer-position buffers are
  read in place; states may be fp32 or bf16. Only the committed position of each state is read (n is clamped to
  0..T in the kernel), each once; only ``r x r`` numbers per pair are written; accumulation is fp32. With
  key_basis None (a content read's values) the key side stays whole: ``P[b, m] = S V_m`` -> ``[B, M, d_k, r]``
  fp32, ``d_k x r`` numbers written per pair, each d_k chunk of rows as soon as it is done. With both bases None
  (a tied read-out's) the states whole: ``S[b, m]`` -> ``[B, M, d_k, d_v]`` fp32, copied in the same d_k chunks;
  a key basis without a value basis raises ValueError. r, d_v and the d_k chunk must be powers of 2 (every real
  GDN geometry is); other shapes raise ValueError.
* :func:`state_reader` (reference ``read``): ``h + W_o(rmsnorm(concat_m C_m^T a_m))`` with ``a = h W_q`` viewed
  ``[M, r]`` per draft position. h ``[B, G, d]``, compressed C ``[B, M, r, r]``, w_q ``[d, M r]``, w_o
  ``[M r, d]``, norm_weight ``[M r]``, eps a static float -> ``[B, G, d]`` in ``result_type(h, w_o)``. Two
  launches (the RMSNorm needs a row's whole ``M r`` vector before W_o): ``reader_query`` (``a = h W_q``,
  ``y = C^T a``, partial sums of squares) and ``reader_out`` (norm, ``W_o``, residual). Rounding happens where
  the reference rounds (a in ``result_type(h, W_q)``, y and the normalised vector in h's dtype), all
  accumulation is fp32, so fp32 inputs agree to fp32 rounding and bf16 inputs to about one bf16 ulp; no Triton
  dot contracts over a rank < 16. r must be a power of 2 (other ranks raise ValueError).
* :func:`content_reader` (reference ``read_by_content``): ``h + W_o(rmsnorm(concat_m P_m^T q_m))`` with queries
  in the full key space. h ``[B, G, d]``, queries ``[B, G, Q, d_k]`` (one per source layer and key head, shared
  by the ``M / Q`` consecutive pairs of its value heads), values P ``[B, M, d_k, r]`` fp32 (the gather's, without
  a key basis), w_o ``[M r, d]``, norm_weight ``[M r]``, eps a static float -> ``[B, G, d]`` in
  ``result_type(h, w_o)``. The queries themselves (a factorised projection of h, or the target's own frozen
  query path) are XLA matmuls before the kernel: what differs between the designs stays outside it. Two
  launches: ``reader_content`` (per pair, ``q / |q|`` in fp32 with the reference's epsilon, ``y = P^T q`` by
  multiply-and-sum for r < 16 and one dot per d_k chunk for r >= 16, y rounded to h's dtype, partial sums of
  squares) and the basis read's ``reader_out``. r and d_k must be powers of 2 (other shapes raise ValueError).
* :func:`content_read` (reference ``content_read``): the first half of ``content_reader``, ``y_m = P_m^T q_m``
  with no norm or W_o after it. queries ``[B, G, Q, d_k]``, values ``[B, M, d_k, r]`` (r = d_v for the states
  whole) -> ``[B, G, M, r]`` fp32: one launch, ``content_read``, of ``reader_content``'s kernel writing y in fp32
  and no sums of squares.

Design: docs/kernels.md.
"""

from .content import ContentReaderConfig, content_read, content_reader
from .gather import GatherConfig, state_gather
from .read import ReaderKernelConfig, state_reader

__all__ = ["ContentReaderConfig", "GatherConfig", "ReaderKernelConfig", "content_read", "content_reader",
           "state_gather", "state_reader"]
