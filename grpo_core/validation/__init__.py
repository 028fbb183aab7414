"""Judging a config before anything loads, in one layer: the config's own
rules, the chosen plugins' settings and declared capabilities, model options,
trackers and alerts, and what each training backend says it cannot run."""
