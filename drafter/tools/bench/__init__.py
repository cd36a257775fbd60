"""Benchmarks: grid.py is `drafter bench`; the others run as `python -m drafter.tools.bench.<name>`."""
