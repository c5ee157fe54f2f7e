"""The bundled demo model: architecture, corpus, tokenizer, training and loading."""

from mla_watch.models.loading import BUNDLED_DIR, load_model, resolve_device

__all__ = ["BUNDLED_DIR", "load_model", "resolve_device"]
