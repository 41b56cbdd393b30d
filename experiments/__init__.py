"""Benchmark harness: hydra sweep runner (``python -m experiments.run sweep=<name>``), plots, report.

Importing this package is cheap (no torch); the runner's modules import what they need.
"""
