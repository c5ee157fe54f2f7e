"""``python -m mla_watch.cli``: the ``mla-watch`` command."""

import sys

from mla_watch.cli.main import main

sys.exit(main())
