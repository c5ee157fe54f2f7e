"""Reference prompts: per business line, a fixed, versioned set of texts whose healthy routing is known.

Every routing statistic mixes two causes, the router and the tokens it was given. A set of prompts the
sidecar controls - sent through the model by the sidecar itself, never by a client - routes the same way
for as long as the model does not change, whatever clients send: it tells a change of the traffic from a
change of the model, as a synthetic check or a golden set does for a service.

A directory of YAML files (``serve --reference-prompts DIR``; the shipped sets by default), one per business
line, and ``default.yaml``, the mixed set of the lines that have none of their own::

    business_line: code_assistant     # the file name's stem
    version: 1                         # bump it when the prompts change: baselines are kept per version
    description: code and SQL completion
    prompts:
      - "def parse_invoice(text: str) -> dict:"
      - ...

Validated at start-up like policies (every problem of every file at once, naming the file, the key, the
value and what was expected); a reload that fails keeps the sets in force.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Any

from mla_watch.common.directory_store import ConfigError, config_files
from mla_watch.common.values import is_integer
from mla_watch.common.yamlcheck import Checker, read_yaml
from mla_watch.routing.windows import ALL_LINES, NAME_RE, NAME_RULE

__all__ = ["DEFAULT_SET", "MAX_PROMPTS", "MAX_PROMPT_CHARS", "MIN_PROMPTS", "ReferenceError", "ReferenceSet",
           "ReferenceSets", "load_reference_dir"]

DEFAULT_SET = "default"  # the mixed set of every line without a set of its own
MIN_PROMPTS = 4  # fewer reads too few tokens for a router's statistics to mean much
MAX_PROMPTS = 256  # a reading costs one prefill per prompt: bounded, for the engine's sake
MAX_PROMPT_CHARS = 8192
_KEYS = ("business_line", "version", "description", "prompts")


class ReferenceError(ConfigError):
    """The reference prompts cannot be used; ``errors`` names each file, key, value and expectation."""

    what = "reference prompts"


@dataclass(frozen=True)
class ReferenceSet:
    """The reference prompts of one business line (or :data:`DEFAULT_SET`)."""

    name: str  # the business line, or "default"
    version: int
    prompts: tuple[str, ...]
    description: str = ""
    source: str = ""

    @property
    def digest(self) -> str:
        """What a healthy baseline of this set is kept under: a new version or new prompts learn anew."""
        text = json.dumps([self.name, self.version, list(self.prompts)], ensure_ascii=False)
        return hashlib.sha256(text.encode()).hexdigest()[:16]

    def as_dict(self) -> dict[str, Any]:
        return {"name": self.name, "version": self.version, "prompts": len(self.prompts), "digest": self.digest,
                "description": self.description, "source": self.source}


@dataclass(frozen=True)
class ReferenceSets:
    """Every set in force, by name."""

    sets: Mapping[str, ReferenceSet]

    def for_line(self, business_line: str | None) -> list[ReferenceSet]:
        """The sets whose routing describes ``business_line``: its own, else the default one; every set for all
        lines summed (``None`` or ``"all"``)."""
        if business_line in (None, ALL_LINES):
            return list(self.sets.values())
        chosen = self.sets.get(business_line) or self.sets.get(DEFAULT_SET)
        return [chosen] if chosen is not None else []

    def as_dict(self) -> dict[str, Any]:
        return {name: reference.as_dict() for name, reference in self.sets.items()}


def _load_file(path: Path) -> ReferenceSet:
    label = str(path)
    data = read_yaml(path, label, ReferenceError)
    chk = Checker(label)
    if not isinstance(data, dict):
        raise ReferenceError([f"{label}: (top level): expected a mapping with keys {', '.join(_KEYS)}"])
    for key in data:
        if key not in _KEYS:
            chk.unknown_key("(top level)", key, _KEYS)
    name = data.get("business_line")
    if name != path.stem:
        chk.bad("business_line", name, f"the file name stem {path.stem!r} (one file per business line)")
    if not NAME_RE.fullmatch(path.stem) or path.stem == ALL_LINES:
        chk.bad("business_line", path.stem, f"a business line's name ({NAME_RULE}; not {ALL_LINES!r})")
    version = data.get("version")
    if not is_integer(version) or version < 1:
        chk.bad("version", version, "an integer >= 1 (bump it when the prompts change)")
    description = data.get("description") or ""
    if not isinstance(description, str):
        chk.bad("description", description, "a string")
        description = ""
    prompts = data.get("prompts")
    kept: list[str] = []
    if not isinstance(prompts, list) or not MIN_PROMPTS <= len(prompts) <= MAX_PROMPTS:
        chk.bad("prompts", f"<{type(prompts).__name__} of {len(prompts)}>" if isinstance(prompts, list) else prompts,
                f"a list of {MIN_PROMPTS} to {MAX_PROMPTS} texts")
    else:
        for index, prompt in enumerate(prompts):
            if not isinstance(prompt, str) or not prompt.strip() or len(prompt) > MAX_PROMPT_CHARS:
                shown = f"<text of {len(prompt)} characters>" if isinstance(prompt, str) else prompt
                chk.bad(f"prompts[{index}]", shown, f"a non-empty text of at most {MAX_PROMPT_CHARS} characters")
            else:
                kept.append(prompt)
        if len(set(kept)) != len(kept):
            chk.bad("prompts", f"<{len(kept) - len(set(kept))} repeated>", "distinct texts")
    if chk.errors:
        raise ReferenceError(chk.errors)
    return ReferenceSet(path.stem, int(version), tuple(kept), description.strip(), label)  # type: ignore[arg-type]


def load_reference_dir(directory: Path) -> ReferenceSets:
    """Every ``*.yaml`` set of ``directory``; :class:`ReferenceError` naming every problem of every file."""
    directory = Path(directory)
    if not directory.is_dir():
        raise ReferenceError([f"{directory}: the reference prompt directory does not exist or is not a directory: "
                              "expected a directory of *.yaml reference prompt files"])
    try:
        files = config_files(directory)
    except OSError as error:
        raise ReferenceError([f"{directory}: cannot list the directory ({error.strerror or error}): expected a "
                              "readable directory of *.yaml reference prompt files"]) from None
    if not files:
        raise ReferenceError([f"{directory}: no reference prompt files (*.yaml): expected at least "
                              f"{DEFAULT_SET}.yaml, the mixed set"])
    errors: list[str] = []
    sets: dict[str, ReferenceSet] = {}
    for file in files:
        try:
            reference = _load_file(file)
        except ReferenceError as error:
            errors.extend(error.errors)
            continue
        if reference.name in sets:
            errors.append(f"{file}: business_line = {reference.name!r} has another file ({sets[reference.name].source})"
                          ": expected one file per business line")
        sets[reference.name] = reference
    if errors:
        raise ReferenceError(errors)
    return ReferenceSets(MappingProxyType(dict(sorted(sets.items()))))
