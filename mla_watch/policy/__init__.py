"""The sampling guard (no torch but :mod:`mla_watch.policy.sampling`): per-business-line sampling policies, the
files they are read from, the sampling parameters they govern, and our own sampler that applies them.

The policy model of :mod:`mla_watch.policy.model` is re-exported here (``mla_watch.policy.enforce``).
"""

from mla_watch.policy.model import *  # noqa: F403
from mla_watch.policy.model import __all__ as __all__
