"""Gated DeltaNet's Mosaic GPU kernel, one module per op: ``recurrent`` (:func:`gated_delta_recurrent`, decode /
verify; the family has no chunked kernel, and ``backend`` runs Triton's for it).
"""

from .recurrent import GDNRecurrentConfig, gated_delta_recurrent

__all__ = ["GDNRecurrentConfig", "gated_delta_recurrent"]
