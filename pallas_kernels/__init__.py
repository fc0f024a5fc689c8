"""The fused ops, one folder each, below everything else (they import only jax):

* ``gated_delta/``: Gated DeltaNet's decode / verify (``gated_delta_recurrent``) and prefill / training
  (``gated_delta_chunked``) forms;
* ``state_reader/``: the ReaDy reader's once-per-round gather (``state_gather``) and per-position read
  (``state_reader``, and ``content_reader`` for queries in the full key space).

Each folder holds ``reference.py`` (pure jnp, the oracle and the XLA path), one module per kernel family
(``triton.py`` for GPUs, ``tpu.py`` or a ``tpu/`` package for TPUs) and an ``__init__`` whose functions take the
reference's arguments plus ``impl`` ("xla" | "pallas", or the ``backend.KernelChoice`` a step resolved once) and
run one of them. ``backend`` picks the family for the machine.
"""
