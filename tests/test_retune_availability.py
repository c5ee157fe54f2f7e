"""Why re-tuning is off: every reason that applies, one sentence each with what to do, under one header."""

from __future__ import annotations

from mla_watch.retune.availability import RetuneConditions, no_job_note, retune_reasons, why_retune_is_off


def test_each_reason_that_applies_is_said_once_with_what_to_do() -> None:
    default = RetuneConditions("engine", engine="vllm", swaps=True, engine_retune="off", capture=False)
    assert why_retune_is_off(default) == (
        "re-tuning is off: it was not asked for (--engine-retune off, the default): serve with --engine-retune propose "
        "(a version to review) or apply; traffic capture is off, so a job an alert starts would have no data: serve "
        "with --capture (or run `mla-watch retune run --dataset FILE` yourself)"
    )
    other = RetuneConditions(
        "engine",
        engine="generic",
        swaps=False,
        engine_retune="apply",
        capture=True,
        checkpoint_problem="no *.safetensors file in /models/x",
    )
    assert retune_reasons(other) == [
        "--engine generic cannot swap routers in place: re-tuning needs --engine vllm or sglang",
        "the engine's router weights cannot be read: no *.safetensors file in /models/x",
    ]
    assert why_retune_is_off(RetuneConditions("none")).startswith("re-tuning is off: no router is re-tuned here: ")


def test_only_the_missing_capture_is_no_job_from_an_alert_and_nothing_missing_is_none() -> None:
    local = RetuneConditions("local", capture=False)
    assert why_retune_is_off(local) == (
        "an alert starts no re-tune job: traffic capture is off, so a job an alert "
        "starts would have no data: serve with --capture (or run `mla-watch retune "
        "run --dataset FILE` yourself)"
    )
    assert no_job_note(local) == f"no re-tune job: {retune_reasons(local)[0]}"
    assert why_retune_is_off(RetuneConditions("local", capture=True)) is None
    ready = RetuneConditions("engine", engine="sglang", swaps=True, engine_retune="propose", capture=True)
    assert why_retune_is_off(ready) is None and retune_reasons(ready) == []


def test_what_is_not_known_is_said_as_what_re_tuning_needs() -> None:
    needs = why_retune_is_off(RetuneConditions("engine"))
    assert needs is not None and needs.startswith("re-tuning needs: serve --engine-retune propose")
    assert len(retune_reasons(RetuneConditions("engine"))) == 3  # the flag, an engine that swaps, capture
