"""The Python API's ``mla_watch.positions``: the names of :mod:`mla_watch.routing.positions`, importable here too."""

from mla_watch.routing.positions import *  # noqa: F403
from mla_watch.routing.positions import __all__ as __all__
