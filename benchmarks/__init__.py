"""Benchmarks of lightning_seqpar (not part of the installed package): ``python -m benchmarks --help``.

The per-run scripts (train.py, attention.py, longest.py, ...) run as scripts with this folder on
``sys.path``; the driver (driver.py) sequences them into the suites of suites.py.
"""
