"""``python -m pdserve.bench.perplexity``: the same as ``pdserve bench perplexity``."""

import sys

from pdserve.bench.perplexity.driver import main

sys.exit(main())
