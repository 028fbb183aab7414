"""The training loop: the data, the producer of scored batches, log-probs and
the loss, the trainer, the training backends (one process/DDP, FSDP,
DeepSpeed ZeRO), checkpoints and resume, and :func:`run.run_training`, the
table of contents of a run.
"""
