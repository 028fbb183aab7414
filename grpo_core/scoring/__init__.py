"""Scoring rollout groups with reward functions, in process or in
subprocess workers, and checking what they return.
"""
