"""The re-tuning HTTP API: read endpoints, admin authorisation, and errors that name the bad input."""

from __future__ import annotations

import httpx
import pytest

from harness.support import running_sidecar

TOKEN = "api-test-token-0123"
AUTH = {"Authorization": f"Bearer {TOKEN}"}


@pytest.fixture(scope="module")
def sidecar(make_sidecar, tmp_path_factory):
    return make_sidecar(admin_token=TOKEN, state_dir=tmp_path_factory.mktemp("state"))


def error(response: httpx.Response) -> dict:
    return response.json()["error"]


def test_read_endpoints_show_jobs_and_versions(sidecar) -> None:
    url, _ = sidecar
    assert httpx.get(url + "/v1/retune/jobs").json() == {"jobs": []}
    versions = httpx.get(url + "/v1/retune/versions").json()
    assert versions["live"] == 0 and versions["last_good"] == 0
    initial = versions["versions"][0]
    assert initial["source"] == "initial" and len(initial["tensors"]) == 6  # weight and bias of 3 routers
    # The bundled model's routers passed the start-up health check by the shipped rules: version 0 is a good reference.
    assert initial["health"]["passed"] and initial["health"]["reason"] == "no rule breached"
    assert initial["health"]["tokens"] >= 1000 and "RoutingEntropyLow" in initial["health"]["rules"]
    bad = httpx.get(url + "/v1/retune/jobs?limit=0")
    assert bad.status_code == 400
    assert error(bad)["message"] == 'limit="0" is invalid: expected an integer in [1, 1000]'
    missing = httpx.get(url + "/v1/retune/jobs/nope")
    assert missing.status_code == 404 and error(missing)["message"] == "no re-tune job with id 'nope'"


def test_admin_calls_need_the_token(sidecar) -> None:
    url, _ = sidecar
    assert httpx.post(url + "/admin/retune", json={}).status_code == 401
    assert httpx.post(url + "/admin/retune/rollback", headers={"Authorization": "Bearer wrong"}).status_code == 401


@pytest.mark.parametrize(
    ("body", "param", "message"),
    [
        ({"route": ["x"]}, "route", 'unknown field(s) ["route"]: expected some of'),
        (
            {"routers": ["model.layers.1.mlp.gate"], "strategy": "magic"},
            "strategy",
            "strategy=\"magic\" is invalid: expected one of ['bias', 'restore', 'router_finetune'] or a list",
        ),
        (
            {"routers": ["model.layers.9.mlp.gate"]},
            "routers",
            'routers=["model.layers.9.mlp.gate"] is invalid: expected a list of expert routers among',
        ),
        ({"routers": "model.layers.1.mlp.gate"}, "routers", 'routers="model.layers.1.mlp.gate" is invalid: expected'),
        ({}, "routers", "no watched router is out of band (entropy_bits >= 5.2) for business line all"),
        (
            {"routers": ["model.layers.1.mlp.gate"], "dataset": "/nonexistent.jsonl"},
            "dataset",
            'dataset="/nonexistent.jsonl" is invalid: expected a .jsonl file name inside the dataset directory',
        ),
        ({"routers": ["model.layers.1.mlp.gate"], "rule": "Nope"}, "rule", 'rule="Nope" is not a loaded rule'),
        ({"routers": ["model.layers.1.mlp.gate"], "force": "yes"}, "force", 'force="yes" is invalid: expected true'),
        ({"routers": ["model.layers.1.mlp.gate"], "options": {"bias": 3}}, "options", 'options={"bias": 3} is invalid'),
    ],
)
def test_bad_retune_requests_name_what_is_wrong(sidecar, body, param, message) -> None:
    url, _ = sidecar
    response = httpx.post(url + "/admin/retune", json=body, headers=AUTH)
    assert response.status_code == 400, response.text
    assert message in error(response)["message"]
    assert error(response)["code"] in ("invalid_value", "unknown_field")
    if param is not None:
        assert error(response)["param"] == param


def test_promote_and_rollback_errors(sidecar) -> None:
    url, _ = sidecar
    missing = httpx.post(url + "/admin/retune/promote", json={"version": 99}, headers=AUTH)
    assert missing.status_code == 400 and "router version 99" in error(missing)["message"]
    bad = httpx.post(url + "/admin/retune/promote", json={"version": "one"}, headers=AUTH)
    assert bad.status_code == 400
    assert error(bad)["message"] == 'version="one" is invalid: expected a router version number'
    nothing = httpx.post(url + "/admin/retune/rollback", headers=AUTH)
    assert nothing.status_code == 409 and "nothing to roll back to (promotion stack [0])" in error(nothing)["message"]


def test_mark_good_vouches_for_a_version_on_the_stack_and_names_a_bad_one(sidecar) -> None:
    url, _ = sidecar
    assert httpx.post(url + "/admin/retune/mark-good", json={"version": 0}).status_code == 401
    marked = httpx.post(url + "/admin/retune/mark-good", json={"version": 0}, headers=AUTH)
    assert marked.status_code == 200 and marked.json() == {"ok": True, "marked_good": 0, "last_good": 0}
    missing = httpx.post(url + "/admin/retune/mark-good", json={"version": 99}, headers=AUTH)
    assert missing.status_code == 400
    assert error(missing)["message"] == "router version 99 does not exist: expected one of the versions 0 to 0"
    bad = httpx.post(url + "/admin/retune/mark-good", json={"version": True}, headers=AUTH)
    assert bad.status_code == 400 and error(bad)["param"] == "version"


def test_a_proxying_sidecar_has_no_model_to_retune(tmp_path) -> None:
    with running_sidecar(upstream="http://127.0.0.1:9", state_dir=tmp_path) as (url, _):
        response = httpx.get(url + "/v1/retune/jobs")
        assert (
            response.status_code == 503
            and "re-tuning is off: no router is re-tuned here: serve a model" in error(response)["message"]
        )
