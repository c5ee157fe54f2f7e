"""What the ``[model]`` extra adds, and the one line that says so when a feature needs it and it is missing.

``pip install mla-watch`` is the sidecar that stands beside an engine (proxy, counting, policies, rules, alerting,
history, status page): it never runs a tensor, so it needs neither torch nor transformers. The embedded model
(``serve`` without ``--upstream``), the probe and :func:`mla_watch.attach`, local re-tuning, the demo and the
SGLang recorder's ``.pt`` dumps come with ``pip install 'mla-watch[model]'``. Re-tuning an engine's routers needs
neither: it holds router tensors as numpy arrays (:mod:`mla_watch.common.tensor_files`).
"""

from __future__ import annotations

import importlib.util

__all__ = ["MODEL_EXTRA", "MODEL_INSTALL", "model_extra_missing", "needs_model_extra"]

MODEL_EXTRA = ("torch", "transformers")
MODEL_INSTALL = "pip install 'mla-watch[model]'"


def model_extra_missing() -> str | None:
    """The first package of the ``[model]`` extra this environment lacks (found without importing it), or ``None``."""
    for name in MODEL_EXTRA:
        try:
            if importlib.util.find_spec(name) is None:
                return name
        except (ImportError, ValueError):  # a finder that refuses it: as good as missing
            return name
    return None


def needs_model_extra(what: str) -> str | None:
    """``WHAT needs torch (the [model] extra): pip install 'mla-watch[model]'`` when it is missing, else ``None``."""
    missing = model_extra_missing()
    if missing is None:
        return None
    return f"{what} needs {missing} (the [model] extra): {MODEL_INSTALL}"
