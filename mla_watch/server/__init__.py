"""The sidecar's HTTP server: :mod:`mla_watch.server.app` wires the parts; each route's handler in a module here."""
