"""What a run reports about itself: health alerts, trackers and the
completion log, the metrics log, and ``grpo report`` over a run's files."""
