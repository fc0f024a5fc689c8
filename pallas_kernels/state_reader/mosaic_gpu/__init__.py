"""The ReaDy reader's Mosaic GPU kernel, one module per op: ``gather`` (:func:`state_gather`, once per round; the
family has no read kernels, and ``backend`` runs Triton's for them).
"""

from .gather import GatherConfig, state_gather

__all__ = ["GatherConfig", "state_gather"]
