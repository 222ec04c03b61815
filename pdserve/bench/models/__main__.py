"""``python -m pdserve.bench.models``: the same as ``pdserve bench models``."""

import sys

from pdserve.bench.models.driver import main

sys.exit(main())
