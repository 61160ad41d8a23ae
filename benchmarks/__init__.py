"""Benchmarks of lightning_seqpar (not part of the installed package): ``python -m benchmarks --help``. The runners (train.py,
longest.py, attention.py, hf.py) run as scripts with this folder on ``sys.path``; driver.py runs them as the suites of suites.py."""
