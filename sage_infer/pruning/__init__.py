"""Structured pruning: remove FFN channels and attention heads by importance on calibration text."""
