"""Tests for mla_watch.policy.sampling: processors against transformers, parameter validation, decode loop.

Two kinds of model are used:

* a tiny random ``DeepseekV32ForCausalLM`` (module-scoped fixture, built under ``fork_rng`` so the
  global RNG is left as it was) for equivalence with ``model.generate``, seeding and KV-cache reuse;
* a ``ScriptedModel`` that emits a fixed token script, for exact checks of the text logic (stop
  strings, held-back UTF-8, EOS, finished rows).

Tokenizers: most tests use ``ByteStubTokenizer`` (a stub class with ``eos_token_id`` and
``decode(ids, skip_special_tokens=True)``, each id mapping to a byte string, so incomplete UTF-8 can
be produced on purpose); one test uses a real ``PreTrainedTokenizerFast`` built from a ``tokenizers``
WordLevel model with 64 single-character tokens.
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch
from transformers.generation.logits_process import (
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from mla_watch.policy.sampling import (
    GenerationCancelled,
    GenerationResult,
    LogitsProcessor,
    RepetitionPenalty,
    SamplingParams,
    Temperature,
    TokenEvent,
    TopK,
    TopP,
    apply_processors,
    build_processors,
    choose_next,
    generate,
    generate_stream,
)

VOCAB = 64
EOS = 2

# --------------------------------------------------------------------------------------------------
# Helpers
# --------------------------------------------------------------------------------------------------


def _default_pieces() -> dict[int, bytes]:
    pieces = {0: b"<pad>", 1: b"<s>", 2: b"</s>"}
    chars = "abcdefghijklmnopqrstuvwxyz ABCDEFGHIJKLMNOPQRSTUVWXYZ.,!?"
    for i, c in enumerate(chars):
        pieces[3 + i] = c.encode()
    pieces[60] = b"\xe2\x82"  # first two bytes of "€"
    pieces[61] = b"\xac"  # last byte of "€"
    pieces[62] = "é".encode()
    pieces[63] = b"\n"
    assert len(pieces) == VOCAB
    return pieces


class ByteStubTokenizer:
    """Stub tokenizer: id -> bytes, ids 0..2 are special (pad, bos, eos); invalid UTF-8 -> U+FFFD."""

    def __init__(self, eos_token_id: int | None = EOS) -> None:
        self.eos_token_id = eos_token_id
        self.pieces = _default_pieces()
        self.by_text = {v.decode("utf-8", "replace"): k for k, v in self.pieces.items() if k > 2}

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        data = b"".join(self.pieces[i] for i in ids if not (skip_special_tokens and i in (0, 1, 2)))
        return data.decode("utf-8", errors="replace")

    def encode(self, text: str) -> list[int]:
        return [self.by_text[c] for c in text]


class ScriptedModel(torch.nn.Module):
    """Emits ``scripts[row][k]`` as its k-th generated token (filler token 3 after the script).

    The "cache" is the number of positions seen; forward records every input length.
    """

    def __init__(self, scripts: list[list[int]], max_positions: int = 64, constant: torch.Tensor | None = None) -> None:
        super().__init__()
        self.constant = constant  # if given: these logits at every step instead of the script
        self.anchor = torch.nn.Parameter(torch.zeros(1))
        self.config = SimpleNamespace(max_position_embeddings=max_positions)
        self.scripts = scripts
        self.input_lengths: list[int] = []

    def forward(self, input_ids, attention_mask=None, cache=None, use_cache=True):
        self.input_lengths.append(input_ids.shape[1])
        if cache is None:
            prompt_len, seen = input_ids.shape[1], 0
        else:
            prompt_len, seen = cache
        seen += input_ids.shape[1]
        assert attention_mask.shape == (input_ids.shape[0], seen)
        k = seen - prompt_len
        logits = torch.zeros(input_ids.shape[0], input_ids.shape[1], VOCAB)
        for r in range(input_ids.shape[0]):
            if self.constant is not None:
                logits[r, -1] = self.constant
                continue
            script = self.scripts[r % len(self.scripts)]
            logits[r, -1, script[k] if k < len(script) else 3] = 50.0
        return SimpleNamespace(logits=logits, cache=(prompt_len, seen))


def collect(events) -> tuple[dict[int, list[TokenEvent]], list[TokenEvent]]:
    per_row: dict[int, list[TokenEvent]] = {}
    order = []
    for e in events:
        per_row.setdefault(e.index, []).append(e)
        order.append(e)
    return per_row, order


def token_ids(events: list[TokenEvent]) -> list[int]:
    return [e.token_id for e in events if e.token_id is not None]


def expected_text(tok: ByteStubTokenizer, ids: list[int], stops: tuple[str, ...] = ()) -> str:
    ids = [i for i in ids if i != tok.eos_token_id]
    text = tok.decode(ids, skip_special_tokens=True)
    cuts = [text.find(s) for s in stops if s in text]
    return text[: min(cuts)] if cuts else text


def check_well_formed(per_row: dict[int, list[TokenEvent]], n: int) -> None:
    assert sorted(per_row) == list(range(n))
    for events in per_row.values():
        assert all(e.finish_reason is None and e.token_id is not None for e in events[:-1])
        assert events[-1].token_id is None and events[-1].finish_reason in ("stop", "length")


# --------------------------------------------------------------------------------------------------
# Processors
# --------------------------------------------------------------------------------------------------


def _random_case(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    batch = 2 + seed % 2
    vocab = int(torch.randint(10, 51, (1,), generator=g))
    scores = torch.randn(batch, vocab, generator=g) * 3
    input_ids = torch.randint(0, vocab, (batch, 7), generator=g)
    return input_ids, scores


def _check_same_and_pure(ours: LogitsProcessor, theirs, input_ids: torch.Tensor, scores: torch.Tensor) -> None:
    ids_before, scores_before = input_ids.clone(), scores.clone()
    expected = theirs(input_ids.clone(), scores.clone())
    got = ours(input_ids, scores)
    torch.testing.assert_close(got, expected, rtol=0, atol=0)
    assert got is not scores and got.data_ptr() != scores.data_ptr()
    assert torch.equal(input_ids, ids_before) and torch.equal(scores, scores_before)


@pytest.mark.parametrize("seed", range(5))
def test_processors_match_transformers(seed: int) -> None:
    input_ids, scores = _random_case(seed)
    vocab = scores.shape[-1]
    for penalty in (0.5, 1.3, 2.0):
        _check_same_and_pure(RepetitionPenalty(penalty), RepetitionPenaltyLogitsProcessor(penalty), input_ids, scores)
    for t in (0.3, 0.7, 1.5):
        _check_same_and_pure(Temperature(t), TemperatureLogitsWarper(t), input_ids, scores)
    for k in (1, 3, vocab - 1, vocab + 5):
        _check_same_and_pure(TopK(k), TopKLogitsWarper(k), input_ids, scores)
    for p in (0.1, 0.5, 0.9, 0.999, 1.0):
        _check_same_and_pure(TopP(p), TopPLogitsWarper(p), input_ids, scores)
    for keep in (2, 4):
        _check_same_and_pure(TopK(1, min_tokens_to_keep=keep), TopKLogitsWarper(1, min_tokens_to_keep=keep),
                             input_ids, scores)  # fmt: skip
        _check_same_and_pure(TopP(0.05, min_tokens_to_keep=keep), TopPLogitsWarper(0.05, min_tokens_to_keep=keep),
                             input_ids, scores)  # fmt: skip


def test_repetition_penalty_ignores_out_of_vocab_ids_like_transformers() -> None:
    input_ids, scores = _random_case(11)
    input_ids = input_ids.clone()
    input_ids[0, 0] = scores.shape[-1] + 3
    _check_same_and_pure(RepetitionPenalty(1.7), RepetitionPenaltyLogitsProcessor(1.7), input_ids, scores)


def test_top_k_hand_case() -> None:
    out = TopK(2)(torch.tensor([[0]]), torch.tensor([[1.0, 3.0, 2.0, 0.0]]))
    assert out[0, 1] == 3.0 and out[0, 2] == 2.0
    assert out[0, 0] == -math.inf and out[0, 3] == -math.inf


@pytest.mark.parametrize(("p", "kept"), [(0.55, {0}), (0.7, {0, 1}), (0.9, {0, 1, 2}), (1.0, {0, 1, 2, 3})])
def test_top_p_keeps_smallest_set_reaching_p(p: float, kept: set[int]) -> None:
    scores = torch.tensor([[0.6, 0.25, 0.1, 0.05]]).log()
    out = TopP(p)(torch.tensor([[0]]), scores)
    assert {i for i in range(4) if out[0, i] > -math.inf} == kept
    assert torch.equal(out[0, sorted(kept)], scores[0, sorted(kept)])


def test_repetition_penalty_hand_case() -> None:
    scores = torch.tensor([[2.0, -2.0, 4.0, -1.0]])
    out = RepetitionPenalty(2.0)(torch.tensor([[0, 1, 1]]), scores)
    assert out.tolist() == [[1.0, -4.0, 4.0, -1.0]]


def test_temperature_hand_case() -> None:
    assert Temperature(0.5)(torch.tensor([[0]]), torch.tensor([[1.0, -2.0]])).tolist() == [[2.0, -4.0]]


@pytest.mark.parametrize(
    ("factory", "bad"),
    [(RepetitionPenalty, 0.0), (Temperature, 0.0), (Temperature, -1.0), (TopK, 0), (TopP, 0.0), (TopP, 1.5)],
)
def test_processor_constructors_validate(factory, bad) -> None:
    with pytest.raises(ValueError, match="invalid"):
        factory(bad)


def test_build_processors_order_and_no_ops() -> None:
    assert build_processors(SamplingParams()) == []
    assert build_processors(SamplingParams(temperature=0.0, top_k=0, top_p=1.0, repetition_penalty=1.0)) == []
    procs = build_processors(SamplingParams(temperature=0.7, top_p=0.9, top_k=5, repetition_penalty=1.2))
    assert [type(p) for p in procs] == [RepetitionPenalty, Temperature, TopK, TopP]
    assert (procs[0].penalty, procs[1].temperature, procs[2].top_k, procs[3].top_p) == (1.2, 0.7, 5, 0.9)
    greedy = build_processors(SamplingParams(temperature=0.0, top_k=3, repetition_penalty=1.1))
    assert [type(p) for p in greedy] == [RepetitionPenalty, TopK]


def test_apply_processors_composes_in_order() -> None:
    input_ids, scores = _random_case(3)
    params = SamplingParams(temperature=0.7, top_p=0.8, top_k=6, repetition_penalty=1.3)
    before = scores.clone()
    got = apply_processors(build_processors(params), input_ids, scores)
    expected = scores
    for proc in (
        RepetitionPenaltyLogitsProcessor(1.3),
        TemperatureLogitsWarper(0.7),
        TopKLogitsWarper(6),
        TopPLogitsWarper(0.8),
    ):
        expected = proc(input_ids, expected.clone())
    torch.testing.assert_close(got, expected, rtol=0, atol=0)
    assert torch.equal(scores, before)


def test_choose_next_greedy_and_seeded_sampling() -> None:
    scores = torch.tensor([[0.0, 5.0, 1.0], [3.0, 0.0, 2.9]])
    assert choose_next(scores, SamplingParams(temperature=0.0), None).tolist() == [1, 0]
    params = SamplingParams(temperature=1.0)
    wide = torch.zeros(4, 50)
    a = choose_next(wide, params, torch.Generator().manual_seed(5))
    b = choose_next(wide, params, torch.Generator().manual_seed(5))
    assert a.shape == (4,) and a.dtype == torch.long and torch.equal(a, b)
    expected = torch.multinomial(torch.softmax(wide, -1), 1, generator=torch.Generator().manual_seed(5)).squeeze(-1)
    assert torch.equal(a, expected)
    # a filtered token is never drawn
    masked = TopK(1)(None, torch.tensor([[0.0, 0.1, 0.0]] * 64))
    assert set(choose_next(masked, params, torch.Generator().manual_seed(0)).tolist()) == {1}


# --------------------------------------------------------------------------------------------------
# SamplingParams
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("field", "value", "expectation"),
    [
        ("temperature", -1, ">= 0"),
        ("top_p", 0, "(0, 1]"),
        ("top_p", 1.5, "(0, 1]"),
        ("top_k", -1, ">= 0"),
        ("max_tokens", 0, ">= 1"),
        ("n", 0, ">= 1"),
        ("repetition_penalty", 0, "> 0"),
        ("temperature", math.nan, "finite"),
        ("seed", -3, "[0, 2**64)"),
        ("stop", ("",), "non-empty"),
        ("top_k", 1.5, "integer"),
    ],
)
def test_sampling_params_validation_names_field_value_expectation(field: str, value, expectation: str) -> None:
    with pytest.raises(ValueError) as info:
        SamplingParams(**{field: value})
    message = str(info.value)
    assert field in message and repr(value) in message and expectation in message


def test_sampling_params_defaults_and_normalisation() -> None:
    p = SamplingParams()
    assert (p.temperature, p.top_p, p.top_k, p.repetition_penalty, p.max_tokens, p.n, p.seed, p.stop) == (
        1.0, 1.0, 0, 1.0, 16, 1, None, ()
    )  # fmt: skip
    assert SamplingParams(stop="x").stop == ("x",)
    assert SamplingParams(stop=["a", "b"]).stop == ("a", "b")
    assert SamplingParams(temperature=0).greedy and not p.greedy
    with pytest.raises(AttributeError):
        p.temperature = 2.0  # type: ignore[misc]


def test_sampling_values_from_a_decision_take_the_table_defaults() -> None:
    from mla_watch.policy.params import SAMPLING_PARAMS, SamplingValues

    assert SamplingParams is SamplingValues
    empty = SamplingValues.from_applied({})
    assert empty == SamplingValues()
    assert all(getattr(empty, p.field) == p.default for p in SAMPLING_PARAMS.values() if p.field == p.name)
    values = SamplingValues.from_applied(
        {"temperature": 1, "max_tokens": 8.0, "top_k": None, "stop": ["ignored"]}, seed=3, stop=("\n",)
    )
    assert values == SamplingValues(temperature=1.0, max_tokens=8, seed=3, stop=("\n",))
    assert type(values.temperature) is float and type(values.max_tokens) is int
    with pytest.raises(ValueError, match=r"SamplingParams\.top_p=0\.0 is invalid: expected a number in \(0, 1\]"):
        SamplingValues.from_applied({"top_p": 0})


# --------------------------------------------------------------------------------------------------
# Decode loop on a scripted model (exact text logic)
# --------------------------------------------------------------------------------------------------


def test_stop_string_is_never_partly_emitted() -> None:
    tok = ByteStubTokenizer()
    script = tok.encode("xabab abX") + tok.encode("abcz")  # "ab" prefixes appear before "abc" completes
    model = ScriptedModel([script])
    params = SamplingParams(temperature=0.0, max_tokens=20, stop=("abc", "zz"))
    per_row, _ = collect(generate_stream(model, tok, [5, 6], params))
    check_well_formed(per_row, 1)
    events = per_row[0]
    final = "xabab abX"
    emitted = ""
    for e in events:
        emitted += e.text
        assert final.startswith(emitted)  # nothing beyond the final text was ever released
    assert emitted == final
    assert events[-1].finish_reason == "stop"
    assert token_ids(events) == script[: len("xabab abXabc")]
    # "a" / "ab" are held while they could start "abc", released once they cannot
    assert [e.text for e in events] == ["x", "", "", "ab", "", "ab ", "", "", "abX", "", "", "", ""]


def test_held_back_prefix_is_released_when_not_a_stop() -> None:
    tok = ByteStubTokenizer()
    script = tok.encode("abxab")
    model = ScriptedModel([script])
    params = SamplingParams(temperature=0.0, max_tokens=5, stop=("abc",))
    per_row, _ = collect(generate_stream(model, tok, [5], params))
    texts = [e.text for e in per_row[0]]
    assert texts == ["", "", "abx", "", "", "ab"]  # last "ab" only flushed on the final "length" event
    assert per_row[0][-1].finish_reason == "length"


def test_incomplete_utf8_is_held_back() -> None:
    tok = ByteStubTokenizer()
    script = [3, 60, 61, 62, 60]  # "a", half of "€", rest of "€", "é", a dangling half at the end
    model = ScriptedModel([script])
    per_row, _ = collect(generate_stream(model, tok, [5], SamplingParams(temperature=0.0, max_tokens=5)))
    texts = [e.text for e in per_row[0]]
    assert texts[:4] == ["a", "", "€", "é"]
    assert all("\ufffd" not in t for t in texts[:-1])
    assert "".join(texts) == tok.decode(script)  # the dangling byte is flushed at the end


def test_eos_and_finished_rows_keep_batch_rectangular() -> None:
    tok = ByteStubTokenizer()
    scripts = [[3, EOS], [4, 5, 6, 7], [EOS]]
    model = ScriptedModel(scripts)
    forwards = []
    events = list(
        generate_stream(model, tok, [5, 6, 7], SamplingParams(temperature=0.0, max_tokens=4, n=3),
                        on_forward=lambda: forwards.append(1))
    )  # fmt: skip
    per_row, _ = collect(events)
    check_well_formed(per_row, 3)
    assert token_ids(per_row[0]) == [3, EOS] and per_row[0][-1].finish_reason == "stop"
    assert token_ids(per_row[1]) == [4, 5, 6, 7] and per_row[1][-1].finish_reason == "length"
    assert token_ids(per_row[2]) == [EOS] and per_row[2][-1].finish_reason == "stop"
    assert "".join(e.text for e in per_row[0]) == "a"  # EOS carries no text
    assert "".join(e.text for e in per_row[2]) == ""
    assert len(forwards) == 4 and model.input_lengths == [3, 1, 1, 1]
    result = generate(ScriptedModel(scripts), tok, [5, 6, 7], SamplingParams(temperature=0.0, max_tokens=4, n=3))
    assert result == GenerationResult(["a", "bcde", ""], ["stop", "length", "stop"], 3, [2, 4, 1])


def test_real_fast_tokenizer_works() -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    chars = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ .,!?-:01"
    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2} | {c: 3 + i for i, c in enumerate(chars)}
    assert len(vocab) == VOCAB
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    backend.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    backend.decoder = decoders.Fuse()
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<pad>", bos_token="<s>", eos_token="</s>")
    script = [*tok.encode("hi there. bye", add_special_tokens=False), EOS]
    result = generate(ScriptedModel([script]), tok, [1], SamplingParams(temperature=0.0, max_tokens=30, stop=(". ",)))
    assert result.texts == ["hi there"] and result.finish_reasons == ["stop"]
    result = generate(ScriptedModel([script]), tok, [1], SamplingParams(temperature=0.0, max_tokens=30))
    assert result.texts == ["hi there. bye"] and result.completion_tokens == [len(script)]


def test_repetition_penalty_sees_generated_tokens() -> None:
    constant = torch.zeros(VOCAB)
    constant[10], constant[11] = 2.0, 1.5
    params = SamplingParams(temperature=0.0, max_tokens=4, repetition_penalty=2.0)
    got = token_ids(list(generate_stream(ScriptedModel([], constant=constant), ByteStubTokenizer(), [5, 6], params)))
    assert got == [10, 11, 10, 10]  # 2.0 -> 1.0 once seen, 1.5 -> 0.75 once seen (not compounded)
    params = SamplingParams(temperature=0.0, max_tokens=3, repetition_penalty=2.0)
    got = token_ids(list(generate_stream(ScriptedModel([], constant=constant), ByteStubTokenizer(), [10], params)))
    assert got == [11, 10, 10]  # the prompt counts too


def test_over_long_request_raises_before_iteration() -> None:
    model = ScriptedModel([[3]], max_positions=16)
    with pytest.raises(ValueError) as info:
        generate_stream(model, ByteStubTokenizer(), list(range(3, 13)), SamplingParams(max_tokens=7))
    assert all(s in str(info.value) for s in ("10", "7", "16", "max_position_embeddings"))
    assert model.input_lengths == []
    generate(model, ByteStubTokenizer(), list(range(3, 13)), SamplingParams(temperature=0.0, max_tokens=6))
    with pytest.raises(ValueError, match="empty"):
        generate_stream(model, ByteStubTokenizer(), [], SamplingParams())


# --------------------------------------------------------------------------------------------------
# Decode loop on a tiny random DeepSeek-V3.2 model
# --------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module", autouse=True)
def _one_torch_thread():
    """The tensors here are tiny: intra-op threads only add contention on a busy CI box (10x slower)."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


@pytest.fixture(scope="module")
def tiny_model():
    from transformers import DeepseekV32Config, DeepseekV32ForCausalLM

    config = DeepseekV32Config(
        vocab_size=64, hidden_size=32, intermediate_size=64, moe_intermediate_size=16, num_hidden_layers=2,
        first_k_dense_replace=1, num_attention_heads=2, num_key_value_heads=2, n_shared_experts=1,
        n_routed_experts=8, num_experts_per_tok=2, n_group=1, topk_group=1, q_lora_rank=16, kv_lora_rank=16,
        qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8, index_topk=4, index_head_dim=16, index_n_heads=2,
        max_position_embeddings=64, pad_token_id=0, bos_token_id=1, eos_token_id=2,
    )  # fmt: skip
    config._attn_implementation = "eager"
    with torch.random.fork_rng():
        torch.manual_seed(0)
        model = DeepseekV32ForCausalLM(config).eval()
    return model


PROMPT = [1, 7, 12, 30, 5, 44, 9]


@pytest.mark.parametrize("penalty", [1.0, 1.5])
def test_greedy_matches_model_generate(tiny_model, penalty: float) -> None:
    n_new = 14
    with torch.no_grad():
        ids = torch.tensor([PROMPT])
        reference = tiny_model.generate(
            ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=n_new, pad_token_id=0,
            repetition_penalty=penalty,
        )[0, len(PROMPT) :].tolist()  # fmt: skip
    # transformers may stop at EOS (2); ours never does with eos_token_id=None
    assert len(reference) == n_new or reference[-1] == EOS
    params = SamplingParams(temperature=0.0, max_tokens=n_new, repetition_penalty=penalty)
    ours = token_ids(list(generate_stream(tiny_model, ByteStubTokenizer(eos_token_id=None), PROMPT, params)))
    assert len(ours) == n_new
    assert ours[: len(reference)] == reference
    assert len(set(ours)) > 1  # a non-trivial sequence


def test_seed_reproducibility_and_global_rng_untouched(tiny_model) -> None:
    tok = ByteStubTokenizer(eos_token_id=None)
    rng_before = torch.get_rng_state()

    def run(seed: int, **kw) -> list[int]:
        return token_ids(list(generate_stream(tiny_model, tok, PROMPT, SamplingParams(max_tokens=8, seed=seed, **kw))))

    a, b, c = run(1), run(1), run(2)
    assert a == b and len(a) == 8
    assert a != c
    assert run(3, top_k=5, top_p=0.9, temperature=0.8, repetition_penalty=1.3) == run(
        3, top_k=5, top_p=0.9, temperature=0.8, repetition_penalty=1.3
    )
    assert torch.equal(torch.get_rng_state(), rng_before)


def test_n_choices_are_reproducible_and_distinct(tiny_model) -> None:
    tok = ByteStubTokenizer(eos_token_id=None)
    params = SamplingParams(n=3, max_tokens=10, seed=7)
    first = collect(generate_stream(tiny_model, tok, PROMPT, params))[0]
    check_well_formed(first, 3)
    rows = [token_ids(first[i]) for i in range(3)]
    assert all(len(r) == 10 for r in rows)
    assert len({tuple(r) for r in rows}) == 3
    result = generate(tiny_model, tok, PROMPT, params)  # same seed: the same three choices again
    assert result.texts == [expected_text(tok, r) for r in rows]
    assert result.finish_reasons == ["length"] * 3 and result.completion_tokens == [10] * 3
    assert result.prompt_tokens == len(PROMPT)


def test_stop_strings_on_model_output(tiny_model) -> None:
    tok = ByteStubTokenizer(eos_token_id=None)
    base = SamplingParams(temperature=0.0, max_tokens=25)
    ids = token_ids(list(generate_stream(tiny_model, tok, PROMPT, base)))
    full = tok.decode(ids, skip_special_tokens=True)
    stop = full[8:10]
    assert stop and "\ufffd" not in stop
    params = SamplingParams(temperature=0.0, max_tokens=25, stop=(stop, "never-there"))
    per_row, _ = collect(generate_stream(tiny_model, tok, PROMPT, params))
    events = per_row[0]
    final = full[: full.find(stop)]
    emitted = ""
    for e in events:
        emitted += e.text
        assert final.startswith(emitted)
    assert emitted == final and stop not in emitted
    assert events[-1].finish_reason == "stop"
    assert token_ids(events) == ids[: len(token_ids(events))] and len(token_ids(events)) < 25


def test_max_tokens_length_and_kv_cache_reuse(tiny_model) -> None:
    tok = ByteStubTokenizer(eos_token_id=None)
    lengths: list[int] = []

    def hook(module, args, kwargs):
        lengths.append(kwargs["input_ids"].shape[1])

    handle = tiny_model.register_forward_pre_hook(hook, with_kwargs=True)
    forwards: list[int] = []
    try:
        result = generate(tiny_model, tok, PROMPT, SamplingParams(temperature=0.0, max_tokens=6, n=2),
                          on_forward=lambda: forwards.append(1))  # fmt: skip
    finally:
        handle.remove()
    assert result.finish_reasons == ["length", "length"] and result.completion_tokens == [6, 6]
    assert len(forwards) == 6
    assert lengths == [len(PROMPT)] + [1] * 5


def test_deltas_concatenate_to_final_text(tiny_model) -> None:
    tok = ByteStubTokenizer(eos_token_id=None)
    params = SamplingParams(n=2, max_tokens=16, seed=11, temperature=1.5)
    per_row, _ = collect(generate_stream(tiny_model, tok, PROMPT, params))
    check_well_formed(per_row, 2)
    for events in per_row.values():
        assert "".join(e.text for e in events) == expected_text(tok, token_ids(events))
        assert not any(e.text.endswith("\ufffd") for e in events[:-1])  # trailing U+FFFD is held back


def test_should_stop_raises_cancelled(tiny_model) -> None:
    tok = ByteStubTokenizer(eos_token_id=None)
    calls = []

    def should_stop() -> bool:
        calls.append(1)
        return len(calls) > 3

    stream = generate_stream(tiny_model, tok, PROMPT, SamplingParams(max_tokens=20, seed=0), should_stop=should_stop)
    seen = []
    with pytest.raises(GenerationCancelled):
        for event in stream:
            seen.append(event)
    assert len(token_ids(seen)) == 3 and all(e.finish_reason is None for e in seen)
    with pytest.raises(GenerationCancelled):
        generate(tiny_model, tok, PROMPT, SamplingParams(max_tokens=5), should_stop=lambda: True)


def test_model_position_limit_guard(tiny_model) -> None:
    with pytest.raises(ValueError, match="max_position_embeddings limit of 64"):
        generate(tiny_model, ByteStubTokenizer(), list(range(3, 63)), SamplingParams(max_tokens=5))


def test_a_vanishing_temperature_decodes_greedily_instead_of_overflowing() -> None:
    # Found by the server fuzz test: 2.2e-309 turned the logits into inf and multinomial failed.
    tiny = SamplingParams(temperature=2.225073858507203e-309)
    assert tiny.greedy
    scores = torch.tensor([[0.5, 3.0, -1.0]])
    processed = apply_processors(build_processors(tiny), torch.tensor([[0]]), scores)
    assert choose_next(processed, tiny, None).tolist() == [1]
    assert not SamplingParams(temperature=0.01).greedy
