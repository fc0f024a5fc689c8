"""The row-invariant matmul's Mosaic GPU kernel (Hopper, jax >= 0.12): ``row_matmul`` (:func:`row_matmul`, its launch
parameters :class:`RowMatmulConfig`). Reference: ``pallas_kernels.row_matmul.reference.row_matmul``, whose arguments
it takes."""

from .row_matmul import RowMatmulConfig, row_matmul, takes

__all__ = ["RowMatmulConfig", "row_matmul", "takes"]
