"""The Python API's ``mla_watch.policy_files``: the names of :mod:`mla_watch.policy.files`, importable here too."""

from mla_watch.policy.files import *  # noqa: F403
from mla_watch.policy.files import __all__ as __all__
