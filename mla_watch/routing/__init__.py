"""The routing core (numpy and scipy, no torch): what a router is, its statistics, rolling windows per router and
business line, healthy baselines, ingestion of counts shipped from other processes, position buckets and batch
footprints.

The statistics of :mod:`mla_watch.routing.stats` are re-exported here (``mla_watch.routing.compute_stats``).
"""

from mla_watch.routing.stats import *  # noqa: F403
from mla_watch.routing.stats import __all__ as __all__
