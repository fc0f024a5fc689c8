"""Training: the machinery the target and drafter trainers share, and what each of them trains.

- Machinery: :mod:`.optimiser` (AdamW behind clipping, warmup then cosine), :mod:`.train_state` (the state and
  its jitted step), :mod:`.checkpoints` (orbax run checkpoints verified by sha256 sidecars), :mod:`.loop` (the
  resumable train loop), :mod:`.artifacts` (provenance of the shipped files).
- The target: :mod:`.target_recipe` (the small config, the loss, the evaluations) and :mod:`.target_init`
  (initialisations of its Gated DeltaNet layers).
- The drafter: :mod:`.distillation` (self-distilled sequences), :mod:`.drafter_loss` (anchors, teacher pass,
  DeepSpec's loss), :mod:`.drafter_variants` (DSpark and ReaDy drafters from one another) and
  :mod:`.drafter_trainer` (the run); :mod:`.mtp_training` trains an MTP head on the same data.

Import the submodules by name (``from ready_jax.training import loop``): this file loads none of them.
"""
