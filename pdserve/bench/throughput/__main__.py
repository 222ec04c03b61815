"""``python -m pdserve.bench.throughput``: the same as ``pdserve bench throughput``."""

import sys

from pdserve.bench.throughput.driver import main

sys.exit(main())
