"""``mla_watch.cause`` is now :mod:`mla_watch.references` (reference prompts, how they are read, their readings and
the cause of each routing alert). This name keeps working for one release: ``mla_watch.cause.X`` is the very
module ``mla_watch.references.X``, and importing it warns."""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
import warnings
from collections.abc import Sequence
from types import ModuleType

__all__: list[str] = []

NEW = "mla_watch.references"

warnings.warn(f"{__name__} is now {NEW}: import it from there", DeprecationWarning, stacklevel=2)


class _Alias(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """``mla_watch.cause.X`` answered with the module ``mla_watch.references.X`` itself: one module object, so its
    classes are the same classes whichever name imported them."""

    def find_spec(
        self, fullname: str, path: Sequence[str] | None = None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if not fullname.startswith(__name__ + "."):
            return None
        return importlib.util.spec_from_loader(fullname, self)

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        return importlib.import_module(NEW + spec.name[len(__name__) :])

    def exec_module(self, module: ModuleType) -> None:
        """The module ran already, under its new name."""


if not any(isinstance(finder, _Alias) for finder in sys.meta_path):
    sys.meta_path.insert(0, _Alias())
