"""``python -m attn``: the command line (see ``attn.cli``)."""

import sys

from attn.cli import main

sys.exit(main())
