"""The routing history: every router x line x statistic over time, in tiers (``store.py``, ``tiers.py``).

A core store, read by the trend rules (as their ``TrendSource``), ``GET /v1/history`` and the status page, whose live
hour is the store's finest tier; without a file, the store is that hour alone, in memory. It does not import the server.
"""

from mla_watch.history.store import HISTORY_FILE, HISTORY_METRICS, LIVE_METRICS, HistoryStore, HistoryStoreError

__all__ = ["HISTORY_FILE", "HISTORY_METRICS", "LIVE_METRICS", "HistoryStore", "HistoryStoreError"]
