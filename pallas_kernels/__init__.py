"""The fused ops, one folder each, below everything else (they import only jax):

* ``gated_delta/``: Gated DeltaNet's decode / verify (``gated_delta_recurrent``) and prefill / training
  (``gated_delta_chunked``) forms;
* ``state_reader/``: the ReaDy reader's once-per-round gather (``state_gather``) and per-position read
  (``state_reader``, and ``content_reader`` for queries in the full key space);
* ``row_matmul/``: a matmul whose every row rounds alike whatever the number of rows in the call (``row_matmul``).

Each folder holds ``reference.py`` (pure jnp, the oracle and the XLA path), one package per kernel family
(``triton/`` for GPUs, ``tpu/`` for TPUs, ``mosaic_gpu/`` for the decode-critical ops on Mosaic GPU) with one module
per op, and an ``__init__`` whose functions take the reference's arguments plus ``impl`` ("xla" | "pallas", or the
``backend.KernelChoice`` a step resolved once) and run one of them. ``backend`` picks the family for the machine;
the helpers a family shares across op folders are ``triton_common``, ``tpu_common`` and ``mosaic_gpu_common``.
"""
