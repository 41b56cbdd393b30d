"""The benchmark runner: ``python -m experiments.run sweep=<name>`` runs points, each in its own process,
and writes one typed row per point (``experiments.schema``). Reading rows (claims, figures, the report)
is the ``analysis`` package's job.

Importing this package is cheap (no torch); the runner's modules import what they need.
"""
