"""The durable routing history: every router x line x statistic over time, in tiers (``store.py``, ``tiers.py``).

A core store, read by the trend rules (as their ``TrendSource``), ``GET /v1/history`` and the status page;
it does not import the server.
"""

from mla_watch.history.store import HISTORY_FILE, HISTORY_METRICS, HistoryStore, HistoryStoreError

__all__ = ["HISTORY_FILE", "HISTORY_METRICS", "HistoryStore", "HistoryStoreError"]
