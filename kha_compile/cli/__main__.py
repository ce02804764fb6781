"""``python -m kha_compile.cli``: the ``kha-compile`` command."""

from __future__ import annotations

import sys

from . import main

sys.exit(main())
