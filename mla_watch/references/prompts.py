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
    max_tokens: 65536                  # the set's token budget (optional; this default, at most 1048576)
    prompts:
      - "def parse_invoice(text: str) -> dict:"
      - ...

A *long set* (``long: true``) describes no one line: it reaches the positions the other sets do not (past a
model's trained length, past a DSA indexer's ``index_topk``), judges the position-localized and indexer alerts
of every line, and is read less often (:mod:`mla_watch.references.prober`). Its prompts are given, or generated
(``generate: {documents: N, seed: S}``): N documents of the shipped corpus (:mod:`mla_watch.models.corpus`),
as long as the reader reads - the model's context embedded, ``--reference-max-tokens`` beside an engine.
Generated rather than shipped as text because their length follows the reader, from a 512-token model to a
128k one, and the generator is deterministic: the same documents, to the character, in every process.

Validated at start-up like policies (every problem of every file at once, naming the file, the key, the
value and what was expected); a reload that fails keeps the sets in force.
"""

from __future__ import annotations

import hashlib
import json
import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from types import MappingProxyType
from typing import Any

from mla_watch.common.setting_errors import SettingsError
from mla_watch.common.values import is_integer
from mla_watch.common.yaml_directory import read_yaml_directory
from mla_watch.common.yamlcheck import Checker, read_yaml_document
from mla_watch.routing.windows import ALL_LINES, NAME_RE, NAME_RULE

__all__ = [
    "DEFAULT_SET",
    "DEFAULT_SET_TOKENS",
    "MAX_DOCUMENTS",
    "MAX_FILE_BYTES",
    "MAX_PROMPTS",
    "MAX_SET_TOKENS",
    "MIN_PROMPTS",
    "Generated",
    "ReferenceSet",
    "ReferenceSetError",
    "ReferenceSets",
    "load_reference_dir",
]

DEFAULT_SET = "default"  # the mixed set of every line without a set of its own
MIN_PROMPTS = 4  # fewer reads too few tokens for a router's statistics to mean much
MAX_PROMPTS = 256  # a reading costs one prefill per prompt: bounded, for the engine's sake
# A set's token budget: the tokens one reading of it reads, all its prompts together. The default is what the
# former limits let a set read (256 prompts of at most 256 tokens each); a file may raise it to the maximum.
DEFAULT_SET_TOKENS = 65_536
MAX_SET_TOKENS = 1_048_576
MAX_DOCUMENTS = 64  # a generated set's documents
MAX_FILE_BYTES = 16 * 1024 * 1024  # a reference file: 256 prompts of 8192 characters of 4-byte UTF-8, and more
_KEYS = ("business_line", "version", "description", "long", "max_tokens", "prompts", "generate")
_GENERATE_KEYS = ("documents", "seed")


class ReferenceSetError(SettingsError):
    """The reference prompts cannot be used; ``errors`` names each file, key, value and expectation."""

    what = "reference prompts"


def __getattr__(name: str) -> Any:
    # ``ReferenceError``, this error's name before it was renamed, stays importable for one release; served from
    # here rather than bound in the module, where it would shadow the builtin ``ReferenceError``.
    if name == "ReferenceError":
        warnings.warn(
            "mla_watch.references.prompts.ReferenceError is now ReferenceSetError", DeprecationWarning, stacklevel=2
        )
        return ReferenceSetError
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


@dataclass(frozen=True)
class Generated:
    """The prompts of a generated set: ``documents`` texts of the shipped corpus, seeded by ``seed``."""

    documents: int
    seed: int = 0

    def texts(self, characters: int) -> list[str]:
        """Each document, at least ``characters`` long (then cut there): deterministic in the seed and the
        document, and each a prefix of its longer self."""
        from mla_watch.models.corpus import generate_mixed

        out = []
        for document in range(self.documents):
            seed = self.seed * MAX_DOCUMENTS + document
            count = max(4, characters // 400 + 4)
            while True:
                text = "\n\n".join(sample for _, sample in generate_mixed(count, seed))
                if len(text) >= characters:
                    out.append(text[:characters])
                    break
                count *= 2
        return out

    def as_dict(self) -> dict[str, int]:
        return {"documents": self.documents, "seed": self.seed}


@dataclass(frozen=True)
class ReferenceSet:
    """The reference prompts of one business line (or :data:`DEFAULT_SET`), or a long set."""

    name: str  # the business line, or "default"; a long set's own name
    version: int
    prompts: tuple[str, ...]  # empty for a generated set
    description: str = ""
    source: str = ""
    long: bool = False  # reaches far: judges every line's position-localized and indexer alerts
    max_tokens: int = DEFAULT_SET_TOKENS  # the token budget of one reading
    generate: Generated | None = None

    @cached_property
    def digest(self) -> str:
        """What a healthy baseline of this set is kept under: a new version or new prompts learn anew."""
        if self.generate is None:  # the form of every set before long sets: their baselines stay valid
            parts: list[Any] = [self.name, self.version, list(self.prompts)]
        else:  # the generator's texts themselves: a corpus that changed is new prompts
            parts = [self.name, self.version, self.generate.as_dict(), self.generate.texts(4096)]
        text = json.dumps(parts, ensure_ascii=False)
        return hashlib.sha256(text.encode()).hexdigest()[:16]

    def texts(self, characters: int) -> list[str]:
        """The prompts' texts; a generated set's documents ``characters`` long."""
        return list(self.prompts) if self.generate is None else self.generate.texts(characters)

    @property
    def count(self) -> int:
        return len(self.prompts) if self.generate is None else self.generate.documents

    def as_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "version": self.version,
            "prompts": self.count,
            "digest": self.digest,
            "description": self.description,
            "source": self.source,
            "long": self.long,
            "max_tokens": self.max_tokens,
            "generate": None if self.generate is None else self.generate.as_dict(),
        }


@dataclass(frozen=True)
class ReferenceSets:
    """Every set in force, by name."""

    sets: Mapping[str, ReferenceSet]

    def for_line(self, business_line: str | None) -> list[ReferenceSet]:
        """The sets whose routing describes ``business_line``: its own, else the default one; every set for all
        lines summed (``None`` or ``"all"``). Long sets describe no line (:meth:`long_sets`)."""
        lines = {name: reference for name, reference in self.sets.items() if not reference.long}
        if business_line in (None, ALL_LINES):
            return list(lines.values())
        chosen = lines.get(business_line) or lines.get(DEFAULT_SET)
        return [chosen] if chosen is not None else []

    def long_sets(self) -> list[ReferenceSet]:
        """The sets that reach far, for every line's position-localized and indexer alerts."""
        return [reference for reference in self.sets.values() if reference.long]

    def as_dict(self) -> dict[str, Any]:
        return {name: reference.as_dict() for name, reference in self.sets.items()}


def _load_file(path: Path) -> ReferenceSet:
    label = str(path)
    try:
        size = path.stat().st_size
    except OSError as error:
        raise ReferenceSetError(
            [f"{label}: cannot read the file ({error.strerror or error}): expected a readable YAML file"]
        ) from None
    if size > MAX_FILE_BYTES:
        raise ReferenceSetError([f"{label}: file size = {size} bytes: expected at most {MAX_FILE_BYTES} bytes"])
    document = read_yaml_document(path, label, ReferenceSetError)
    chk = Checker(label, lines=document.lines)
    data = document.data
    if not isinstance(data, dict):
        raise ReferenceSetError([f"{label}: (top level): expected a mapping with keys {', '.join(_KEYS)}"])
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
    long = data.get("long", False)
    if not isinstance(long, bool):
        chk.bad("long", long, "true (a long set, for every line's position-localized and indexer alerts) or false")
        long = False
    if long and path.stem == DEFAULT_SET:
        chk.bad("long", long, f"false in {DEFAULT_SET}.yaml, the mixed set of the lines without a set of their own")
    max_tokens = data.get("max_tokens", DEFAULT_SET_TOKENS)
    if not is_integer(max_tokens) or not 16 <= max_tokens <= MAX_SET_TOKENS:
        chk.bad(
            "max_tokens",
            max_tokens,
            f"an integer from 16 to {MAX_SET_TOKENS} (the tokens one reading of the set reads, its prompts together)",
        )
        max_tokens = DEFAULT_SET_TOKENS
    kept, generated = _prompts(chk, data, long)
    if chk.errors:
        raise ReferenceSetError(chk.errors)
    return ReferenceSet(
        path.stem,
        int(version),  # type: ignore[arg-type]
        tuple(kept),
        description.strip(),
        label,
        long,
        int(max_tokens),
        generated,
    )


def _prompts(chk: Checker, data: dict[str, Any], long: bool) -> tuple[list[str], Generated | None]:
    """The file's prompts, or how they are generated (a long set's only)."""
    prompts, generate = data.get("prompts"), data.get("generate")
    if generate is not None:
        if prompts is not None:
            chk.bad("generate", "<with prompts>", "either prompts or generate, not both")
        if not long:
            chk.bad(
                "generate",
                "<in a set without long: true>",
                "generated documents in a long set only (long: true): they are as long as the reader reads",
            )
        spec = chk.mapping("generate", generate, _GENERATE_KEYS, "documents and seed")
        if spec is None:
            return [], None
        documents, seed = spec.get("documents"), spec.get("seed", 0)
        if not is_integer(documents) or not 1 <= documents <= MAX_DOCUMENTS:
            chk.bad("generate.documents", documents, f"an integer from 1 to {MAX_DOCUMENTS}")
        if not is_integer(seed) or not 0 <= seed < 2**31:
            chk.bad("generate.seed", seed, "an integer from 0 to 2147483647")
        if chk.errors:
            return [], None
        return [], Generated(int(documents), int(seed))  # type: ignore[arg-type]
    kept: list[str] = []
    if not isinstance(prompts, list) or not MIN_PROMPTS <= len(prompts) <= MAX_PROMPTS:
        chk.bad(
            "prompts",
            f"<{type(prompts).__name__} of {len(prompts)}>" if isinstance(prompts, list) else prompts,
            f"a list of {MIN_PROMPTS} to {MAX_PROMPTS} texts (or, in a long set, generate)",
        )
        return kept, None
    for index, prompt in enumerate(prompts):
        if not isinstance(prompt, str) or not prompt.strip():
            shown = f"<text of {len(prompt)} characters>" if isinstance(prompt, str) else prompt
            chk.bad(f"prompts[{index}]", shown, "a non-empty text")
        else:
            kept.append(prompt)
    if len(set(kept)) != len(kept):
        chk.bad("prompts", f"<{len(kept) - len(set(kept))} repeated>", "distinct texts")
    return kept, None


def load_reference_dir(directory: Path) -> ReferenceSets:
    """Every ``*.yaml`` set of ``directory``; :class:`ReferenceSetError` naming every problem of every file."""
    read = read_yaml_directory(
        directory, _load_file, ReferenceSetError, kind="reference prompt", at_least=f"{DEFAULT_SET}.yaml, the mixed set"
    )
    errors = read.errors
    sets: dict[str, ReferenceSet] = {}
    for file, reference in read.loaded:
        if reference.name in sets:
            errors.append(
                f"{file}: business_line = {reference.name!r} has another file ({sets[reference.name].source})"
                ": expected one file per business line"
            )
        sets[reference.name] = reference
    if errors:
        raise ReferenceSetError(errors)
    return ReferenceSets(MappingProxyType(dict(sorted(sets.items()))))
