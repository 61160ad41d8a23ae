"""``python -m benchmarks``: the benchmark driver (benchmarks/driver.py)."""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # the per-run scripts import each other by plain name

from driver import main  # noqa: E402

sys.exit(main())
