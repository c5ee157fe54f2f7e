"""The Python API's ``mla_watch.footprint``: the names of :mod:`mla_watch.routing.footprint`, importable here too."""

from mla_watch.routing.footprint import *  # noqa: F403
from mla_watch.routing.footprint import __all__ as __all__
