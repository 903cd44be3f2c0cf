"""``python -m attn.bench``: the same as ``python -m attn bench``."""

import sys

from attn.bench import main

sys.exit(main())
