"""The row-invariant matmul's Mosaic TPU kernel: ``row_matmul`` (:func:`row_matmul`, its DMA blocks
:class:`RowMatmulConfig`). Reference: ``pallas_kernels.row_matmul.reference.row_matmul``, whose arguments it takes
and whose tiling it keeps."""

from .row_matmul import RowMatmulConfig, row_matmul

__all__ = ["RowMatmulConfig", "row_matmul"]
