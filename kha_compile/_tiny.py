"""Old name of :mod:`kha_compile.tiny`: ``from kha_compile import _tiny`` gives that same module."""

import sys

from . import tiny

sys.modules[__name__] = tiny
