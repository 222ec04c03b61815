"""``python -m pdserve.bench.peers``: the same as ``pdserve bench peers``."""

import sys

from pdserve.bench.peers.driver import main

sys.exit(main())
