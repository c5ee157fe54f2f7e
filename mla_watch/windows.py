"""The Python API's ``mla_watch.windows``: the names of :mod:`mla_watch.routing.windows`, importable here too."""

from mla_watch.routing.windows import *  # noqa: F403
from mla_watch.routing.windows import __all__ as __all__
