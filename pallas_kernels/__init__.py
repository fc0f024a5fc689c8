"""Pallas (Triton) kernels of the fused ops; the jnp references are in ``ready_jax.ops``, the impl switch in
``ready_jax.dispatch``."""
