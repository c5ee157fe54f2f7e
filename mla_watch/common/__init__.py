"""Plumbing every layer shares (no torch): values in error messages, YAML checks, reloading configuration
directories, the state directory and its SQLite files, progress output, and the optional ``[model]`` extra."""
