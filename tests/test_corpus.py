"""Tests for the deterministic synthetic training corpus (mla_watch.models.corpus)."""

from __future__ import annotations

import hashlib
import json
import random
import re
import sys
from functools import cache

import pytest

from harness import processes
from mla_watch.models import corpus

VARIETY_COUNT = 2000
FORMAT_COUNT = 300

_TURN = re.compile(r"<\|(system|user|assistant)\|>\n([^\n<]+)\n")
_DOC = re.compile(r"Document:\n(?P<doc>[^\n]+)\n\nSummary:\n(?P<summary>[^\n]+)\n")
_SQL_START = re.compile(r"^(SELECT|WITH|INSERT INTO|UPDATE)\b")


@cache
def _samples(domain: str, count: int, seed: int = 11) -> tuple[str, ...]:
    return tuple(corpus.generate(domain, count, seed))


def _turns(text: str) -> list[tuple[str, str]]:
    """Parse a chat sample into (role, text) turns; asserts the whole sample is consumed."""
    turns, pos = [], 0
    while pos < len(text):
        match = _TURN.match(text, pos)
        assert match is not None, f"unparseable chat at {pos}: {text[pos : pos + 80]!r}"
        turns.append((match.group(1), match.group(2)))
        pos = match.end()
    return turns


def _sql_statements(text: str) -> list[str]:
    return [block for block in text.strip().split("\n\n") if block]


# --------------------------------------------------------------------------------------------------
# API contract
# --------------------------------------------------------------------------------------------------


def test_domains_constant() -> None:
    assert corpus.DOMAINS == ("customer_service", "code", "sql", "doc_summary")


@pytest.mark.parametrize("domain", corpus.DOMAINS)
def test_generate_is_deterministic_and_seed_dependent(domain: str) -> None:
    first = corpus.generate(domain, 20, 3)
    assert first == corpus.generate(domain, 20, 3)
    assert corpus.generate(domain, 5, 3) == first[:5]
    other = corpus.generate(domain, 20, 4)
    assert other != first
    assert len(set(first) & set(other)) <= 1


def test_determinism_across_processes() -> None:
    # Load corpus.py by path so the child process does not import the (heavy) package.
    code = (
        "import hashlib, importlib.util, json, sys;"
        f"spec = importlib.util.spec_from_file_location('corpus_copy', {corpus.__file__!r});"
        "mod = importlib.util.module_from_spec(spec); sys.modules['corpus_copy'] = mod;"
        "spec.loader.exec_module(mod);"
        "data = [mod.generate_mixed(8, 5), mod.prompts('sql', 3, 5)];"
        "print(hashlib.sha256(json.dumps(data).encode()).hexdigest())"
    )
    digests = {
        processes.run(
            [sys.executable, "-c", code],
            capture_output=True,
            text=True,
            check=True,
            timeout=120,
            env={"PYTHONHASHSEED": seed},
        ).stdout
        for seed in ("1", "2")
    }
    expected = [list(pair) for pair in corpus.generate_mixed(8, 5)], corpus.prompts("sql", 3, 5)
    local = hashlib.sha256(json.dumps(list(expected)).encode()).hexdigest()
    assert digests == {local + "\n"}


def test_generate_zero_count() -> None:
    assert corpus.generate("sql", 0, 1) == []
    assert corpus.generate_mixed(0, 1) == []
    assert corpus.prompts("code", 0, 1) == []


@pytest.mark.parametrize("bad", ["chat", "", "SQL", "code "])
def test_unknown_domain_raises(bad: str) -> None:
    for call in (lambda: corpus.generate(bad, 1, 0), lambda: corpus.prompts(bad, 1, 0)):
        with pytest.raises(ValueError) as info:
            call()
        message = str(info.value)
        assert repr(bad) in message
        assert all(domain in message for domain in corpus.DOMAINS)


@pytest.mark.parametrize("bad", [-1, -100])
def test_negative_count_raises(bad: int) -> None:
    calls = (
        lambda: corpus.generate("code", bad, 0),
        lambda: corpus.generate_mixed(bad, 0),
        lambda: corpus.prompts("sql", bad, 0),
    )
    for call in calls:
        with pytest.raises(ValueError, match=rf"count.*{bad}"):
            call()


def test_generate_mixed_round_robin() -> None:
    mixed = corpus.generate_mixed(22, 9)
    assert mixed == corpus.generate_mixed(22, 9)
    assert len(mixed) == 22
    order = [domain for domain, _ in mixed[:4]]
    assert sorted(order) == sorted(corpus.DOMAINS)
    assert [domain for domain, _ in mixed] == [order[i % 4] for i in range(22)]
    for domain in corpus.DOMAINS:
        texts = [text for d, text in mixed if d == domain]
        assert texts == corpus.generate(domain, len(texts), 9)
    orders = {tuple(d for d, _ in corpus.generate_mixed(4, seed)) for seed in range(12)}
    assert len(orders) > 1


# --------------------------------------------------------------------------------------------------
# Formats
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("domain", corpus.DOMAINS)
def test_length_bounds(domain: str) -> None:
    lengths = [len(text) for text in _samples(domain, FORMAT_COUNT)]
    assert min(lengths) >= corpus.MIN_CHARS
    assert max(lengths) <= corpus.MAX_CHARS


def test_customer_service_format() -> None:
    for text in _samples("customer_service", FORMAT_COUNT):
        turns = _turns(text)
        if turns[0][0] == "system":
            turns = turns[1:]
        roles = [role for role, _ in turns]
        assert 2 <= len(roles) <= 6
        assert roles == ["user", "assistant"] * (len(roles) // 2)
    systems = sum(text.startswith("<|system|>\n") for text in _samples("customer_service", FORMAT_COUNT))
    assert 0.15 * FORMAT_COUNT < systems < 0.45 * FORMAT_COUNT


def test_customer_service_agent_references_specifics() -> None:
    specific = re.compile(r"#\d+|[A-Z]+-\d+|\d|@")
    texts = _samples("customer_service", FORMAT_COUNT)
    with_specifics = sum(
        any(role == "assistant" and specific.search(body) for role, body in _turns(text)) for text in texts
    )
    assert with_specifics >= 0.9 * len(texts)


def test_code_compiles_and_looks_like_python() -> None:
    for text in _samples("code", FORMAT_COUNT):
        compile(text, "<sample>", "exec")
        assert re.search(r"^def \w+\(.*\) -> .+:$", text, re.MULTILINE)
        indents = {len(line) - len(line.lstrip(" ")) for line in text.splitlines() if line.strip()}
        assert all(indent % 4 == 0 for indent in indents)
        assert "\t" not in text


def test_code_uses_varied_constructs() -> None:
    joined = "\n".join(_samples("code", FORMAT_COUNT))
    for construct in ("for ", "elif ", "return ", "import ", "class ", '"""', " for row in ", 'f"'):
        assert construct in joined, construct


def test_sql_format() -> None:
    for text in _samples("sql", FORMAT_COUNT):
        statements = _sql_statements(text)
        assert 1 <= len(statements) <= 6
        for statement in statements:
            comment, _, body = statement.partition("\n")
            assert comment.startswith("-- ") and len(comment) > 6
            assert _SQL_START.match(body), body
            assert body.endswith(";")
            assert body.count(";") == 1
            assert body.count("(") == body.count(")")


def test_sql_covers_query_shapes() -> None:
    joined = "\n".join(_samples("sql", FORMAT_COUNT))
    keywords = ("JOIN", "WHERE", "GROUP BY", "ORDER BY", "LIMIT", "WITH ", "INSERT INTO", "UPDATE ", "HAVING")
    for keyword in keywords:
        assert keyword in joined, keyword


def test_doc_summary_format_and_grounding() -> None:
    facts = re.compile(r"\d[\d,.:%]*\d|\b[A-Z][a-z]{2,}\b")
    stopwords = {"The", "On", "In", "At", "After", "Revenue", "CFO"}
    for text in _samples("doc_summary", FORMAT_COUNT):
        match = _DOC.fullmatch(text)
        assert match is not None, text
        document, summary = match.group("doc"), match.group("summary")
        sentences = re.findall(r"[^.!?]+[.!?](?:\s|$)", document)
        assert 4 <= len(sentences) <= 12
        numbers = set(re.findall(r"\d[\d,.]*\d|\d", summary))
        assert numbers <= set(re.findall(r"\d[\d,.]*\d|\d", document)), (numbers, document)
        reused = [item for item in facts.findall(summary) if item not in stopwords and item in document]
        assert reused, summary


# --------------------------------------------------------------------------------------------------
# Variety
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("domain", "min_types"),
    [("customer_service", 800), ("code", 1000), ("sql", 350), ("doc_summary", 450)],
)
def test_variety(domain: str, min_types: int) -> None:
    texts = _samples(domain, VARIETY_COUNT)
    assert len(set(texts)) >= 0.95 * len(texts)
    words = {word for text in texts for word in re.findall(r"[A-Za-z_]+", text)}
    assert len(words) >= min_types
    numbers = {number for text in texts for number in re.findall(r"\d+", text)}
    assert len(numbers) >= 300


# --------------------------------------------------------------------------------------------------
# Prompts
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("domain", corpus.DOMAINS)
def test_prompts_deterministic_and_varied(domain: str) -> None:
    first = corpus.prompts(domain, 30, 2)
    assert first == corpus.prompts(domain, 30, 2)
    assert first != corpus.prompts(domain, 30, 3)
    assert len(set(first)) >= 25


def test_customer_service_prompts() -> None:
    pattern = re.compile(r"<\|user\|>\n[^\n<]+\n<\|assistant\|>\n")
    for prompt in corpus.prompts("customer_service", 50, 1):
        assert pattern.fullmatch(prompt), prompt


def test_code_prompts() -> None:
    shapes = re.compile(r'(?:import [^\n]+\n|from [^\n]+\n)*\n*def \w+\((?:[^\n]*:\n(?:    """)?)?', re.S)
    for prompt in corpus.prompts("code", 50, 1):
        assert 20 <= len(prompt) <= 120, prompt
        assert shapes.fullmatch(prompt), prompt


def test_sql_prompts() -> None:
    pattern = re.compile(r"-- [^\n]+\n(?:SELECT|WITH|INSERT|UPDATE)?")
    for prompt in corpus.prompts("sql", 50, 1):
        assert 20 <= len(prompt) <= 120, prompt
        assert pattern.fullmatch(prompt), prompt


def test_doc_summary_prompts() -> None:
    for prompt in corpus.prompts("doc_summary", 50, 1):
        assert re.fullmatch(r"Document:\n[^\n]+\n\nSummary:\n", prompt), prompt


@pytest.mark.parametrize("domain", corpus.DOMAINS)
def test_prompts_are_cut_from_fresh_samples(domain: str) -> None:
    """A prompter draws one fresh sample and cuts it; replaying its RNG reproduces that sample."""
    samplers = {
        "customer_service": lambda rng: corpus._customer_service(rng, allow_system=False),
        "code": corpus._code,
        "sql": lambda rng: next(s for s in iter(lambda: corpus._sql(rng), "") if s.index("\n") <= 110),
        "doc_summary": corpus._doc_summary,
    }
    for key in range(40):
        prompt = corpus._PROMPTERS[domain](random.Random(f"check:{key}"))
        sample = samplers[domain](random.Random(f"check:{key}"))
        if domain == "code":  # the cut may start at the first top-level ``def``
            assert prompt in sample and sample.find(prompt) in (0, sample.find(prompt.split("(")[0])), prompt
        else:
            assert sample.startswith(prompt), (prompt, sample)
        assert len(prompt) < len(sample)
