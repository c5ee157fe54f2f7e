"""Dashboards shipped with mla_watch (``grafana.json``: import it into Grafana, pick the Prometheus data source)."""

from __future__ import annotations

from pathlib import Path

__all__ = ["GRAFANA_DASHBOARD"]

GRAFANA_DASHBOARD = Path(__file__).resolve().parent / "grafana.json"
