"""Evaluation utilities for kvpolicy."""
