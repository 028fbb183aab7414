"""The policy update: scored groups into padded tensors, per-token log-probs,
every ``loss_type``, and the optimizer and learning-rate schedule."""
