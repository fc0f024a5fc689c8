"""The ReaDy reader's Mosaic TPU kernels: ``state_gather`` (DESIGN.md 3.1), ``state_reader`` (3.2), the
full-key-space read ``content_reader`` and its raw values ``content_read``.

References: ``pallas_kernels.state_reader.reference``; each kernel takes its reference's arguments and returns
its result. Notation: B sequences, source layers L_src, H_v value heads, M = L_src H_v pairs (pair
``m = source index * H_v + head``), rank r, G draft positions, d the drafter's hidden size.

* :func:`state_gather` (reference ``gather_prepare``): per_position is one ``[L, B, T+1, H_v, d_k, d_v]`` array
  or a list of ``[L_i, B, T+1, ...]`` / ``[B, T+1, ...]`` arrays, fp32 or bf16, with static ``layers`` naming
  (array, leading index) per source layer, so the target cache's buffers are read in place; n_committed ``[B]``
  (clamped to 0..T); U ``[M, d_k, r]``, V ``[M, d_v, r]`` -> C ``[B, M, r, r]`` fp32, ``C[b, m] = U_m^T S V_m``
  with ``S = per_position[array][index, b, n_committed[b], head]``. With U None (a content read's values):
  ``P[b, m] = S V_m`` -> ``[B, M, d_k, r]`` fp32. With U and V None (a tied read-out's): the states whole,
  ``S`` -> ``[B, M, d_k, d_v]`` fp32; U without V raises ValueError.
* :func:`state_reader` (reference ``read``): h ``[B, G, d]``, C ``[B, M, r, r]``, w_q ``[d, M r]``, w_o
  ``[M r, d]``, norm_weight ``[M r]``, eps a static float -> ``h + W_o(rmsnorm(concat_m C_m^T a_m))`` with
  ``a = h W_q`` viewed ``[M, r]``, ``[B, G, d]`` in ``result_type(h, w_o)``. Rounding happens where the
  reference rounds: a in ``result_type(h, w_q)``, y and the normalised vector in h's dtype, W_o's product in
  ``result_type(h, w_o)``. h and the weights are fp32 or bf16.
* :func:`content_reader` (reference ``read_by_content``): h ``[B, G, d]``, queries ``[B, G, Q, d_k]`` (one per
  source layer and key head, shared by the ``M / Q`` consecutive pairs of its value heads), values P
  ``[B, M, d_k, r]``, w_o ``[M r, d]``, norm_weight ``[M r]``, eps a static float ->
  ``h + W_o(rmsnorm(concat_m P_m^T q_m / |q_m|))``, ``[B, G, d]`` in ``result_type(h, w_o)``; y rounded to h's
  dtype as in ``state_reader``. The queries come in computed (the factorised projection or the target's frozen
  query path, XLA matmuls before the kernel); the kernel starts at their fp32 L2 normalisation.
* :func:`content_read` (reference ``content_read``): ``content_reader``'s read alone, ``y_m = P_m^T q_m / |q_m|``
  with no norm or W_o: queries ``[B, G, Q, d_k]``, values ``[B, M, d_k, r]`` (r = d_v for the states whole) ->
  ``[B, G, M, r]`` fp32.

Both accumulate in fp32: bf16 operands go to the MXU as they are (their products are exact in fp32), fp32
operands at ``Precision.HIGHEST``. Anything else (other dtypes, block configs that do not tile the shapes, a
footprint over the VMEM budget) raises ValueError before launch.

Modules: ``gather`` (:func:`state_gather`), ``read`` (:func:`state_reader`), ``content`` (:func:`content_reader`,
:func:`content_read`), and ``common`` (the MXU product, dtype checks, lane blocks and step size all three use).

``config=None`` picks blocks per shape: the widest block whose bytes per step stay within ``common.STEP_BYTES`` (a
step then moves enough data to hide its fixed cost), shrunk until the footprint fits the generation's budget
(``tpu_common.vmem_budget_bytes``). Explicit blocks are taken as given and checked the same way. Design:
docs/kernels.md.
"""

from .content import (
    ContentReaderConfig,
    ContentReadShapes,
    ContentShapes,
    content_footprint,
    content_read,
    content_read_footprint,
    content_reader,
    resolve_content_config,
    resolve_content_read_config,
)
from .gather import GatherConfig, gather_footprint, resolve_gather_config, state_gather
from .read import ReaderKernelConfig, ReaderShapes, reader_footprint, resolve_reader_config, state_reader

__all__ = [
    "ContentReadShapes", "ContentReaderConfig", "ContentShapes", "GatherConfig", "ReaderKernelConfig", "ReaderShapes",
    "content_footprint", "content_read", "content_read_footprint", "content_reader", "gather_footprint",
    "reader_footprint", "resolve_content_config", "resolve_content_read_config", "resolve_gather_config",
    "resolve_reader_config", "state_gather", "state_reader",
]
