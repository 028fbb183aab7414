"""Checkpoints that are complete or absent, read back without running code
from them."""
