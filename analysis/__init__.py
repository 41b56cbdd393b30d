"""Rows -> claims, figures and the report. Reads ``results/<sweep>/results.csv`` through the row schema
(``experiments.schema``, the only thing it imports from the runner); never runs a point."""
