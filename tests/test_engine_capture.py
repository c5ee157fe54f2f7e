"""``serve --capture`` beside vLLM: the engine's answers and streams recorded as token ids, per business line.

The proxy asks vLLM for ``return_token_ids`` (tests/vllm_twin.py answers as vLLM 0.32 does), records the
prompt's and each choice's ids in STATE_DIR/capture.sqlite (0600) with the prompt's length - the part a
gate may score: the rest the served model wrote - and strips the ids from what the client gets unless the
client asked for them itself.
"""

from __future__ import annotations

import stat

import httpx
import pytest

from harness.support import wait_until
from mla_watch.engines.replay import ReplayBudget
from mla_watch.retune.capture import TrafficCapture
from tests.test_engine_streams import ask, beside_twin


def captured(sidecar, line: str) -> list:
    return TrafficCapture(sidecar.config.state_dir / "capture.sqlite").samples(line)


@pytest.mark.parametrize("chat", [False, True], ids=["completions", "chat"])
def test_unstreamed_answers_are_captured_as_prompt_and_completion_ids_and_the_client_never_sees_them(
    tmp_path, chat
) -> None:
    with beside_twin(tmp_path, capture=True, replay=ReplayBudget(rate=0)) as (twin, url, sidecar):
        answer = ask(url, "code_assistant", chat=chat, stream=False, n=2, prompt="def add(a, b):")
        assert "prompt_token_ids" not in answer
        assert all("token_ids" not in choice and "prompt_token_ids" not in choice for choice in answer["choices"])
        assert twin.bodies[-1]["return_token_ids"] is True  # asked for by the proxy
        assert wait_until(lambda: len(captured(sidecar, "code_assistant")) == 2, timeout=10)
        prompt = twin.tokens_of(twin.bodies[-1], chat)
        samples = captured(sidecar, "code_assistant")
        assert sorted(list(sample) for sample in samples) == sorted(
            [prompt + twin.generated(prompt, choice, 6) for choice in range(2)]
        )
        assert {sample.scored_tokens for sample in samples} == {len(prompt)}  # the prompt: what the gate scores
        mode = stat.S_IMODE((sidecar.config.state_dir / "capture.sqlite").stat().st_mode)
        assert mode == 0o600


def test_a_client_that_asks_for_token_ids_keeps_them_and_the_answer_is_captured(tmp_path) -> None:
    with beside_twin(tmp_path, capture=True, replay=ReplayBudget(rate=0)) as (_, url, sidecar):
        answer = ask(
            url, "doc_summary", chat=False, stream=False, prompt="Summarize: sales rose.", return_token_ids=True
        )
        assert "token_ids" in answer["choices"][0] and "prompt_token_ids" in answer["choices"][0]
        assert wait_until(lambda: len(captured(sidecar, "doc_summary")) == 1, timeout=10)


@pytest.mark.parametrize("chat", [False, True], ids=["completions", "chat"])
def test_streams_are_captured_when_they_end_even_when_not_replayed(tmp_path, chat) -> None:
    with beside_twin(tmp_path, capture=True, replay=ReplayBudget(rate=0)) as (twin, url, sidecar):
        events = ask(url, "customer_service", chat=chat, stream=True, prompt="Where is my parcel?")
        assert all("token_ids" not in json for json in map(str, events))
        assert wait_until(lambda: len(captured(sidecar, "customer_service")) == 1, timeout=10)
        prompt = twin.tokens_of(twin.bodies[-1], chat)
        (sample,) = captured(sidecar, "customer_service")
        assert list(sample) == prompt + twin.generated(prompt, 0, 6) and sample.scored_tokens == len(prompt)
        assert twin.replays == []  # no replay budget: ids read for the capture only


def test_without_capture_no_token_ids_are_asked_for(tmp_path) -> None:
    with beside_twin(tmp_path, replay=ReplayBudget(rate=0)) as (twin, url, sidecar):
        ask(url, "code_assistant", chat=True, stream=False)
        ask(url, "code_assistant", chat=True, stream=True)
        assert all("return_token_ids" not in body for body in twin.bodies)
        assert not (sidecar.config.state_dir / "capture.sqlite").exists()


def test_beside_the_engine_each_answer_counts_toward_its_clients_share_and_capture_is_fair(tmp_path) -> None:
    with beside_twin(tmp_path, capture=True, capture_max_samples=8, replay=ReplayBudget(rate=0)) as (_, url, sidecar):
        for index in range(10):
            client = "flood-1" if index % 5 else "app-1"  # flood-1 sends 8 of 10
            answer = httpx.post(
                url + "/v1/completions",
                json={"prompt": f"def f{index}(x):", "max_tokens": 6},
                headers={"X-Business-Line": "code_assistant", "X-Client-Id": client},
                timeout=30,
            )
            assert answer.status_code == 200, answer.text
        assert wait_until(lambda: sidecar.engine_routing.answers >= 10, timeout=10)
        shares = httpx.get(url + "/v1/reference", timeout=10).json()["clients"]["code_assistant"]
        by_client = {entry["client"]: entry["share"] for entry in shares["clients"]}
        assert by_client["flood-1"] == pytest.approx(0.8, abs=0.05) and set(by_client) == {"flood-1", "app-1"}
        capture = TrafficCapture(sidecar.config.state_dir / "capture.sqlite")
        assert wait_until(lambda: sum(capture.clients("code_assistant").values()) >= 4, timeout=10)
        assert capture.clients("code_assistant") == {"flood-1": 2, "app-1": 2}  # a quarter of 8 each at most
