"""The loop itself: :func:`run.run_training` builds a run from the config, the
trainer turns scored batches into optimizer steps and weight syncs, and the
observer reports each step."""
