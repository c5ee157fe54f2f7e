"""A fleet of sidecars repaired as one: the shared store (PostgreSQL), the member each sidecar runs, the check a
replica makes of a version it takes. See :mod:`mla_watch.fleet.member`."""
