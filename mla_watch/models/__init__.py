"""The bundled demo model: architecture, corpus, tokenizer, training and loading.

Loading imports torch and transformers; the corpus generator does not (beside an engine it makes the long
reference prompts), so the names of :mod:`mla_watch.models.loading` are imported when first asked for.
"""

from __future__ import annotations

from typing import Any

__all__ = ["BUNDLED_DIR", "load_model", "resolve_device"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from mla_watch.models import loading

        return getattr(loading, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
