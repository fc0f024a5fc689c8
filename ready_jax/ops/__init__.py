"""Pure-jnp references: Gated DeltaNet's three forms and the ReaDy reader's array math (jax and numpy only)."""
