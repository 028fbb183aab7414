"""Judging a config before anything loads: every rule of the config itself,
of the plugins chosen (their settings, their declared capabilities), of the
model options, trackers and alerts. It sits above the layers whose rules it
asks and below scoring and training, which read what it decides; the
training backends add their own rules (:mod:`grpo_core.training.config_check`).
"""
