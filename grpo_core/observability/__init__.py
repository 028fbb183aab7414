"""What a run reports about itself: health alerts, trackers and the
completion log, the per-step observer, held-out evaluation, and
``grpo report`` over a run's files.
"""
