"""The status page at ``/``: its API on a real sidecar, and the page itself in headless Chromium.

The browser test follows on-call: a router collapses on the code line, the webhook receives the
alert, and the link in the alert is opened in a real browser (Debian's ``chromium``, headless).
The page must select the line and highlight the router the link names, show the heat map, the
alert and the policies with the values the sidecar serves, and keep polling. A second one: an
expert hotspot pages on MaxVio while entropy stays in band; its link opens the page on MaxVio with
the row marked by its alert, the bundled model's indexers (short contexts) read "no signal", and
clicks on the metric selector switch what the rows show. A third: the alerts of one incident (one
notification group) are one row that opens into them. The screenshots and the DOM are kept in
``test-artifacts/`` (``MLA_WATCH_ARTIFACTS`` to put them elsewhere).
"""

from __future__ import annotations

import base64
import contextlib
import fcntl
import json
import os
import re
import select
import shutil
import subprocess
import tempfile
import time
from html.parser import HTMLParser
from pathlib import Path

import httpx
import pytest
import torch

from harness import processes
from harness.helpers import engine_record, prefill_history, write_rules
from harness.receivers import running_receiver
from harness.support import REPO, free_port, long_texts, running_sidecar, serve_app, wait_until
from mla_watch.alerting.examples import entropy_low_rules
from mla_watch.retune.jobs import RetuneSettings
from mla_watch.server.app import ServerConfig, Sidecar

GATE = "model.layers.1.mlp.gate"
HOT_GATE = "model.layers.2.mlp.gate"
RUNBOOK = "https://runbooks.example/routing#routingentropylow"
RULES = entropy_low_rules(
    business_line="*",
    labels={"team": "ml-platform"},
    annotations={
        "summary": "Routing entropy {value:.2f} bits on {router} (layer {layer}, {business_line})",
        "runbook_url": RUNBOOK,
        "dashboard": "{status_url}",
    },
)
# A hotspot: one expert takes every token. MaxVio (load of the busiest expert / mean - 1) reads about 9.7
# on a 64-expert top-6 router, while its entropy stays above the entropy rule's 5.0 bits.
HOTSPOT_RULES = (
    RULES
    + """  - alert: ExpertHotspot
    metric: max_violation
    select: {"kind": "expert", "business_line": "*"}
    above: 6.0
    resolve_below: 5.0
    for: 0s
    min_tokens: 64
    severity: warning
    annotations: {"summary": "MaxVio {value:.2f} on {router} ({business_line})", "dashboard": "{status_url}"}
"""
)


# ---------------------------------------------------------------- the API behind the page


def test_the_page_and_its_files_are_served(sidecar) -> None:
    url, _ = sidecar
    page = httpx.get(url + "/", timeout=10)
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert '<script src="static/status.js"></script>' in page.text
    for name, kind in (("status.js", "text/javascript"), ("status.css", "text/css")):
        response = httpx.get(f"{url}/static/{name}", timeout=10)
        assert response.status_code == 200 and response.headers["content-type"].startswith(kind)
    missing = httpx.get(url + "/static/app.py", timeout=10)
    assert missing.status_code == 404
    assert 'no such file: "app.py"' in missing.json()["error"]["message"]


def test_status_json_holds_history_alerts_policies_and_retune(tmp_path: Path, monkeypatch) -> None:
    rules = tmp_path / "rules"
    rules.mkdir()
    (rules / "routing.yaml").write_text(RULES)
    monkeypatch.setenv("MLA_WATCH_ONCALL_URL", "http://127.0.0.1:9/hook")  # nothing listens: not needed here
    with running_sidecar(rules=rules, history_interval_seconds=0.2, alert_interval=0.2) as (url, _):
        response = httpx.post(
            url + "/v1/completions",
            timeout=60,
            headers={"X-Business-Line": "code_assistant", "X-Task": "code"},
            json={"prompt": "def parse(", "max_tokens": 8, "temperature": 0.9},
        )
        assert response.status_code == 200
        live = httpx.get(url + "/v1/routing", params={"business_line": "code_assistant"}).json()["routers"]
        bits = round(next(r for r in live if r["name"] == GATE)["entropy_bits"], 4)

        def sampled_since_the_request() -> bool:  # the history is sampled every 0.2 s
            return any(
                s["router"] == GATE and s["business_line"] == "code_assistant" and s["values"][-1] == bits
                for s in httpx.get(url + "/v1/status").json()["history"]["series"]
            )

        assert wait_until(sampled_since_the_request, 30)
        status = httpx.get(url + "/v1/status", timeout=10).json()
        assert status["model"] == "bundled" and status["ready"] is True and status["rules"] == 1
        history = status["history"]
        assert history["interval_seconds"] == 0.2 and history["span_seconds"] == 3600
        gate = next(s for s in history["series"] if s["router"] == GATE and s["business_line"] == "code_assistant")
        assert len(gate["values"]) == len(history["times"])
        assert gate["values"][-1] == bits and gate["too_small"][-1] is True  # 8 tokens: below the trusted minimum
        assert gate["band"]["fire_below"] == 5.0 and gate["band"]["resolve_above"] == 5.2
        code = next(line for line in status["policies"]["lines"] if line["business_line"] == "code_assistant")
        task = next(t for t in code["tasks"] if t["task"] == "code")
        changes = response.json()["mla_watch"]["adjustments"]
        clamped = {change["param"] for change in changes if change["requested"] is not None}
        defaulted = {change["param"] for change in changes if change["requested"] is None}
        assert clamped == {"temperature"} and defaulted  # asked 0.9: clamped; the rest left to the policy
        assert set(task["adjustments"]) == clamped and all(n == 1 for n in task["adjustments"].values())
        assert set(task["defaults"]) == defaulted and all(n == 1 for n in task["defaults"].values())
        assert status["retune"]["live"] == 0 and status["retune"]["jobs"] == []
        assert status["retune"]["promotions"][0]["kind"] == "initial"

        newest = history["times"][-1]

        def newer() -> list[float]:
            return httpx.get(url + "/v1/status", params={"since": newest}, timeout=10).json()["history"]["times"]

        assert wait_until(lambda: len(newer()) > 0, 30)  # the sampler goes on: there is something newer
        later = newer()
        assert later and all(t > newest for t in later) and newest not in later
        bad = httpx.get(url + "/v1/status", params={"since": "yesterday"}, timeout=10)
        assert bad.status_code == 400
        assert bad.json()["error"]["param"] == "since" and '"yesterday" is invalid' in bad.json()["error"]["message"]


# ---------------------------------------------------------------- the page in a real browser


class _Elements(HTMLParser):
    """Every element of a DOM dump as (tag, attributes, text directly inside it)."""

    def __init__(self) -> None:
        super().__init__()
        self.elements: list[dict] = []
        self.html = ""
        self._open: list[dict] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        element = {"tag": tag, **{k: v or "" for k, v in attrs}, "text": ""}
        self.elements.append(element)
        if tag not in ("meta", "link", "br", "img", "input"):
            self._open.append(element)

    def handle_endtag(self, tag: str) -> None:
        while self._open:
            if self._open.pop()["tag"] == tag:
                break

    def handle_data(self, data: str) -> None:
        for element in self._open:
            element["text"] += data

    def find(self, **attrs: str) -> list[dict]:
        def matches(element: dict) -> bool:
            return all(
                (value in element.get("class", "").split()) if key == "class_" else element.get(key) == value
                for key, value in attrs.items()
            )

        return [element for element in self.elements if matches(element)]


def chromium() -> str:
    for name in ("chromium", "chromium-browser", "google-chrome"):
        if shutil.which(name):
            return name
    pytest.fail("no chromium: install Debian's chromium package (.ci/run does) to test the status page")


def open_in_browser(
    url: str, screenshot: Path, budget_ms: int = 12000, window: str = "1400,1400"
) -> tuple[_Elements, str]:
    """Load ``url`` in headless Chromium; return the DOM after ``budget_ms`` of virtual time and the console."""
    with tempfile.TemporaryDirectory(prefix="mla-watch-chromium-") as profile:
        # No background networking: on a closed network Chromium's own connections fail by the dozen.
        run = processes.run(
            [
                chromium(),
                "--headless",
                "--no-sandbox",
                "--disable-gpu",
                "--disable-dev-shm-usage",
                "--disable-quic",
                "--no-first-run",
                "--disable-background-networking",
                "--disable-component-update",
                "--disable-sync",
                "--hide-scrollbars",
                f"--user-data-dir={profile}",
                f"--window-size={window}",
                "--enable-logging=stderr",
                "--v=0",
                f"--virtual-time-budget={budget_ms}",
                f"--screenshot={screenshot}",
                "--dump-dom",
                url,
            ],
            capture_output=True,
            text=True,
            timeout=120,
        )
    assert run.returncode == 0, run.stderr[-2000:]
    dom = _Elements()
    dom.feed(run.stdout)
    dom.html = run.stdout
    console = "\n".join(line for line in run.stderr.splitlines() if "CONSOLE" in line or "Uncaught" in line)
    return dom, console


class Browser:
    """Headless Chromium driven over the DevTools protocol on a pipe (``--remote-debugging-pipe``), in real time.

    For what ``--dump-dom`` cannot do: click on the page, wait for what the click brings, then read the DOM
    and take a screenshot. ``console`` collects the page's console messages and uncaught exceptions.
    """

    def __init__(self, window: tuple[int, int] = (1400, 1400)) -> None:
        self._profile = tempfile.TemporaryDirectory(prefix="mla-watch-chromium-")
        # Chromium reads commands on fd 3 and writes replies on fd 4: the pipes are moved there in the child.
        pipes = (*os.pipe(), *os.pipe())
        to_read, to_write, from_read, from_write = (fcntl.fcntl(fd, fcntl.F_DUPFD, 100) for fd in pipes)
        for fd in pipes:  # moved above 100, out of the way of fds 3 and 4
            os.close(fd)

        def child() -> None:
            os.dup2(to_read, 3)
            os.dup2(from_write, 4)

        self.process = processes.start(
            [
                chromium(),
                "--headless",
                "--no-sandbox",
                "--disable-gpu",
                "--disable-dev-shm-usage",
                "--disable-quic",
                "--no-first-run",
                "--disable-background-networking",
                "--disable-component-update",
                "--disable-sync",
                "--hide-scrollbars",
                f"--user-data-dir={self._profile.name}",
                f"--window-size={window[0]},{window[1]}",
                "--remote-debugging-pipe",
                "about:blank",
            ],
            preexec_fn=child,
            pass_fds=(3, 4),
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        os.close(to_read)
        os.close(from_write)
        self._out, self._in = to_write, from_read
        self._buffer = b""
        self._id = 0
        self.console: list[str] = []
        try:
            page = next(t for t in self.call("Target.getTargets")["targetInfos"] if t["type"] == "page")
            self._session = self.call("Target.attachToTarget", targetId=page["targetId"], flatten=True)["sessionId"]
            self.call("Runtime.enable", page=True)
            self.call("Page.enable", page=True)
            # The viewport (and so the screenshot) is the window's size, as with --window-size and --screenshot.
            self.call(
                "Emulation.setDeviceMetricsOverride",
                page=True,
                width=window[0],
                height=window[1],
                deviceScaleFactor=1,
                mobile=False,
            )
        except BaseException:
            self.close()
            raise

    def call(self, method: str, *, page: bool = False, timeout: float = 60, **params: object) -> dict:
        """One DevTools command (``page``: to the page's session, else to the browser); its result."""
        self._id += 1
        message: dict = {"id": self._id, "method": method, "params": params}
        if page:
            message["sessionId"] = self._session
        os.write(self._out, json.dumps(message).encode() + b"\0")
        deadline = time.monotonic() + timeout
        while True:
            while b"\0" not in self._buffer:
                left = deadline - time.monotonic()
                if left <= 0 or not select.select([self._in], [], [], left)[0]:
                    raise TimeoutError(f"{method}: no answer from Chromium in {timeout} s")
                chunk = os.read(self._in, 1 << 20)
                assert chunk, "Chromium closed its DevTools pipe"
                self._buffer += chunk
            raw, self._buffer = self._buffer.split(b"\0", 1)
            reply = json.loads(raw)
            if reply.get("method") == "Runtime.consoleAPICalled":
                self.console.append(
                    " ".join(str(a.get("value", a.get("description", ""))) for a in reply["params"]["args"])
                )
            elif reply.get("method") == "Runtime.exceptionThrown":
                self.console.append("Uncaught " + json.dumps(reply["params"]["exceptionDetails"])[:1000])
            elif reply.get("id") == self._id:
                assert "error" not in reply, f"{method}: {reply['error']}"
                return reply["result"]

    def open(self, url: str) -> None:
        self.call("Page.navigate", page=True, url=url)

    def evaluate(self, expression: str, timeout: float = 60) -> object:
        """``expression``'s value in the page (a promise is awaited)."""
        result = self.call(
            "Runtime.evaluate",
            page=True,
            timeout=timeout + 5,
            expression=expression,
            awaitPromise=True,
            returnByValue=True,
        )
        assert "exceptionDetails" not in result, result["exceptionDetails"]
        return result["result"].get("value")

    def wait_for(self, predicate: str, timeout: float = 30) -> bool:
        """Whether the JavaScript ``predicate`` became true within ``timeout`` seconds (checked every 50 ms)."""
        return bool(
            self.evaluate(
                f"""new Promise((resolve) => {{
            const until = Date.now() + {timeout * 1000};
            const check = () => {{
              let ok = false;
              try {{ ok = Boolean({predicate}); }} catch (error) {{ ok = false; }}
              if (ok || Date.now() > until) resolve(ok); else setTimeout(check, 50);
            }};
            check();
        }})""",
                timeout,
            )
        )

    def dom(self) -> _Elements:
        dom = _Elements()
        html = str(self.evaluate("document.documentElement.outerHTML"))
        dom.feed(html)
        dom.html = html
        return dom

    def screenshot(self, path: Path) -> None:
        path.write_bytes(base64.b64decode(self.call("Page.captureScreenshot", page=True, format="png")["data"]))

    def close(self) -> None:
        """Ask Chromium to close, give it 30 s, then stop whatever is left of it (renderers, crash handlers)."""
        with contextlib.suppress(TimeoutError, AssertionError, OSError, subprocess.TimeoutExpired):
            self.call("Browser.close", timeout=10)
            self.process.wait(30)
        processes.stop(self.process)
        os.close(self._out)
        os.close(self._in)
        self._profile.cleanup()


def points_at(sidecar: Sidecar, router: str, line: str, entropy: float, count: int = 3) -> bool:
    """Whether the live history's last ``count`` points of ``router`` on ``line`` all hold ``entropy`` (the history
    keeps float32: 4 decimals, give or take the last)."""
    for series in sidecar.history.recent()["series"]:
        if series["router"] == router and series["business_line"] == line:
            tail = series["values"][-count:]
            return len(tail) == count and all(value is not None and abs(value - entropy) <= 1e-4 for value in tail)
    return False


def artifacts_dir() -> Path:
    directory = Path(os.environ.get("MLA_WATCH_ARTIFACTS", REPO / "test-artifacts"))
    directory.mkdir(parents=True, exist_ok=True)
    return directory


def pixel(png: Path, x: int, y: int) -> tuple[int, int, int]:
    from PIL import Image  # matplotlib's dependency

    with Image.open(png) as image:
        return image.convert("RGB").getpixel((x, y))


@pytest.mark.slow
def test_on_call_opens_the_alert_link_and_sees_what_went_wrong(tmp_path: Path, monkeypatch) -> None:
    rules = tmp_path / "rules"
    rules.mkdir()
    (rules / "routing.yaml").write_text(RULES)
    port = free_port()
    artifacts = artifacts_dir()
    with running_receiver() as receiver:
        monkeypatch.setenv("MLA_WATCH_ONCALL_URL", receiver.url + "/hook")
        sidecar = Sidecar(
            ServerConfig(
                device="cpu",
                rules=rules,
                state_dir=tmp_path / "state",
                policy_poll_seconds=None,
                admin_token="status-page-token-0123",
                alert_interval=0.3,
                window_tokens=192,
                history_interval_seconds=0.5,
                capture=True,
                # the page is under test, not the gate's power: a few short prompts decide
                retune=RetuneSettings(min_samples=8, min_held_out_tokens=16),
                public_url=f"http://127.0.0.1:{port}",
            )
        )
        with serve_app(sidecar.app, port=port) as url:
            assert sidecar.wait_ready(120), sidecar.load_error
            client = httpx.Client(base_url=url, timeout=120)
            adjusted = {"code": 0}

            def request(line: str, index: int) -> None:
                headers = {"X-Business-Line": line, **({"X-Task": "code"} if line == "code_assistant" else {})}
                body = {
                    "prompt": f"def parse_invoice_{index}("
                    if line == "code_assistant"
                    else f"<|user|>\nWhere is my parcel number {index}?\n<|assistant|>\n",
                    "max_tokens": 24,
                    "seed": index,
                    "temperature": 0.9,
                }
                response = client.post("/v1/completions", json=body, headers=headers)
                assert response.status_code == 200, response.text
                if line == "code_assistant":
                    adjusted["code"] += sum(
                        a["requested"] is not None  # clamped, not defaults filled in
                        for a in response.json()["mla_watch"]["adjustments"]
                    )

            for index in range(8):
                request("code_assistant", index)
                request("customer_service", index)
            healthy, _ = open_in_browser(url + "/#router=" + GATE, artifacts / "status-page-healthy.png", 3000)
            row = healthy.find(tag="div", class_="row", **{"data-router": GATE, "data-line": "all"})
            assert row and row[0]["data-state"] == "ok", row
            # A link without a metric (as alert links were written before they named one) shows entropy.
            assert [
                b["data-metric"] for b in healthy.find(tag="button", **{"aria-pressed": "true"}) if "data-metric" in b
            ] == ["entropy_bits"]
            assert row[0]["data-metric"] == "entropy_bits"

            with sidecar.model_worker.model_lock, torch.no_grad():  # the collapse: six experts win everywhere
                sidecar.model_worker.model.model.layers[1].mlp.gate.e_score_correction_bias[:6] += 10.0

            def paged() -> list[dict]:
                return [
                    alert
                    for r in list(receiver.requests)
                    for alert in r.json()["alerts"]
                    if alert["status"] == "firing"
                    and alert["labels"]["router"] == GATE
                    and alert["labels"]["business_line"] == "code_assistant"
                ]

            index = 100
            while not paged():
                assert index < 160, "no page for the collapsed router"
                request("code_assistant", index)
                index += 1
            # Traffic stops: the routing windows hold still, and the history catches up with them.
            routing = {
                r["name"]: r
                for r in client.get("/v1/routing", params={"business_line": "code_assistant"}).json()["routers"]
            }

            # a few history points at the collapsed value, so the heat map shows a red stretch
            assert wait_until(lambda: points_at(sidecar, GATE, "code_assistant", routing[GATE]["entropy_bits"]), 10)

            link = paged()[0]["annotations"]["dashboard"]
            assert link == (
                f"http://127.0.0.1:{port}/#router={GATE}&layer=1&business_line=code_assistant"
                "&metric=entropy_bits&alertname=RoutingEntropyLow"
            )
            screenshot = artifacts / "status-page.png"
            dom, console = open_in_browser(link, screenshot)
            (artifacts / "status-page.html").write_text(dom.html)

            # On-call restores the routers the server started with, then rolls the promotion back.
            admin = {"Authorization": "Bearer status-page-token-0123"}
            job = client.post(
                "/admin/retune",
                headers=admin,
                json={
                    "routers": [GATE],
                    "business_line": "code_assistant",
                    "strategy": ["restore"],
                    "rule": "RoutingEntropyLow",
                },
            ).json()
            assert wait_until(lambda: client.get(f"/v1/retune/jobs/{job['id']}").json()["status"] == "promoted", 60)
            promoted = client.get(f"/v1/retune/jobs/{job['id']}").json()
            assert client.post("/admin/retune/rollback", headers=admin).status_code == 200
            retuned, console_after = open_in_browser(
                link, artifacts / "status-page-retune.png", 3000, window="1400,2800"
            )  # the whole page
            client.close()

    assert "Uncaught" not in console and "Error" not in console, console
    (body,) = dom.find(tag="body")
    assert int(body["data-updates"]) >= 2, "the page stopped polling"  # live: it keeps fetching v1/status
    assert dom.find(tag="span", id="updated")[0]["data-state"] == "live"

    # The link selected the business line and highlighted the router.
    assert [b["data-line"] for b in dom.find(tag="button", **{"aria-pressed": "true"}) if "data-line" in b] == [
        "code_assistant"
    ]
    rows = dom.find(tag="div", class_="row")
    assert [r["data-line"] for r in rows] == ["code_assistant"] * len(rows)
    assert {r["data-router"] for r in rows} == set(routing)  # every router of the model, one row each
    (focused,) = [r for r in rows if "focus" in r["class"].split()]
    assert focused["data-router"] == GATE and focused["data-layer"] == "1"
    # The heat map shows the value the sidecar serves, and where it lies against the band.
    assert float(focused["data-value"]) == pytest.approx(routing[GATE]["entropy_bits"], abs=1e-3)
    assert focused["data-state"] == "fire" and float(focused["data-value"]) < 5.0
    for r in rows:
        if r["data-kind"] == "expert" and r["data-router"] != GATE:
            assert r["data-state"] == "ok" and float(r["data-value"]) == pytest.approx(
                routing[r["data-router"]]["entropy_bits"], abs=1e-3
            )
    (canvas,) = dom.find(tag="canvas", id="heatmap-canvas")
    assert int(canvas["data-rows"]) == len(rows) and int(canvas["data-columns"]) >= 4
    # In the screenshot: the newest cell of the collapsed router is red, its neighbour's is green.
    left, top, width, _ = (int(v) for v in canvas["data-box"].split(","))
    newest_x = left + width - 2
    for position, r in enumerate(rows):
        red, green, blue = pixel(screenshot, newest_x, top + position * 18 + 9)
        if r["data-router"] == GATE:
            assert red > 110 and red > 2 * green and red > 2 * blue, (red, green, blue)
        elif r["data-kind"] == "expert":
            assert green > red and green > blue, (r["data-router"], red, green, blue)
    # "Now, per business line": the collapse shows on the code line only (customer service had no
    # traffic since).
    cells = {c["data-line"]: c for c in dom.find(tag="td", class_="cell", **{"data-router": GATE})}
    assert cells["code_assistant"]["data-state"] == "fire" and cells["customer_service"]["data-state"] == "ok"

    # The alert, with its labels and its runbook link.
    (alert,) = dom.find(
        tag="tr", **{"data-alertname": "RoutingEntropyLow", "data-router": GATE, "data-line": "code_assistant"}
    )
    assert alert["data-state"] == "firing"
    assert "team=ml-platform" in alert["text"] and "critical" in alert["text"]
    assert [a["href"] for a in dom.find(tag="a", class_="runbook")] == [RUNBOOK]
    assert dom.find(tag="a", class_="show")[0]["href"] == "#" + link.split("#", 1)[1]

    # The policies in force, with the adjustments the code requests really got.
    (code_task,) = dom.find(tag="tr", **{"data-line": "code_assistant", "data-task": "code"})
    assert int(code_task["data-adjustments"]) == adjusted["code"] > 0 and code_task["data-rejections"] == "0"
    assert "temperature: ≥ 0.1, ≤ 0.3" in code_task["text"]
    (sql_task,) = dom.find(tag="tr", **{"data-line": "code_assistant", "data-task": "sql"})
    assert "reject" in sql_task["text"]
    # Re-tuning: the routers the server started with are live; nothing was promoted.
    (retune,) = dom.find(tag="div", id="retune-body")
    assert "live router version 0" in retune["text"] and "No re-tuning job yet." in retune["text"]

    # After the re-tune: the job with its gates, and the promote / rollback history, newest first.
    assert "Uncaught" not in console_after, console_after
    (job_row,) = retuned.find(tag="tr", **{"data-job": job["id"]})
    assert job_row["data-status"] == "promoted" and "restore" in job_row["text"]
    # A restore of the known-good routers: judged by their own health; the broken model's perplexity is shown,
    # not binding (a handful of held-out prompts could not decide it anyway).
    assert f"✓ band {GATE}: " in job_row["text"] and "✓ reference_health: " in job_row["text"]
    assert "perplexity: " in job_row["text"] and "(not binding)" in job_row["text"]
    gates = promoted["result"]["attempts"][0]["gates"]  # before the job -> the candidate, as the page shows it
    assert f"{gates['before']['entropy_bits'][GATE]} → {gates['after']['entropy_bits'][GATE]}" in job_row["text"]
    history = [(r["data-kind"], r["data-version"]) for r in retuned.find(tag="tr") if "data-kind" in r]
    assert history == [("rollback", "0"), ("promote", "1"), ("initial", "0")]
    (retune_after,) = retuned.find(tag="div", id="retune-body")
    assert "live router version 0 · last known-good version 1" in retune_after["text"]


def test_the_range_selector_draws_a_week_from_the_durable_history(tmp_path: Path) -> None:
    state = tmp_path / "state"
    prefill_history(state, time.time(), days=7.0, interval=300.0)  # a week: entropy 5.0 + day / 10 on "code"
    with running_sidecar(upstream="http://127.0.0.1:9", state_dir=state) as (url, _):
        dom, console = open_in_browser(
            url + "/?window=604800#business_line=code", artifacts_dir() / "status-page-week.png", 4000
        )
    assert "Uncaught" not in console, console
    ranges = {b["data-seconds"]: b for b in dom.find(tag="button", class_="range")}
    assert sorted(ranges, key=float) == ["86400", "604800", "2592000"]  # 24 h, 7 d, 30 d past the live hour
    assert ranges["604800"]["aria-pressed"] == "true" and ranges["604800"]["text"] == "7 d"
    (canvas,) = dom.find(tag="canvas", id="heatmap-canvas")
    assert canvas["data-source"] == "history" and canvas["data-span"] == "604800"
    # 7 days at the page's step of 840 s: about 720 columns, one per 15-minute point (the coarsest tier).
    assert 600 <= int(canvas["data-columns"]) <= 721
    (row,) = dom.find(tag="div", class_="row")
    assert row["data-router"] == GATE and row["data-line"] == "code"
    assert float(row["data-value"]) == pytest.approx(5.6, abs=1e-3)  # the newest column: the 7th day


@pytest.mark.slow
def test_a_maxvio_alert_opens_on_maxvio_with_its_row_marked_and_the_selector_switches_metric(
    tmp_path: Path, monkeypatch
) -> None:
    rules = tmp_path / "rules"
    rules.mkdir()
    (rules / "routing.yaml").write_text(HOTSPOT_RULES)
    port = free_port()
    artifacts = artifacts_dir()
    line = "code_assistant"
    with running_receiver() as receiver:
        monkeypatch.setenv("MLA_WATCH_ONCALL_URL", receiver.url + "/hook")
        sidecar = Sidecar(
            ServerConfig(
                device="cpu",
                rules=rules,
                state_dir=tmp_path / "state",
                policy_poll_seconds=None,
                admin_token=None,
                alert_interval=0.3,
                window_tokens=192,
                history_interval_seconds=0.5,
                public_url=f"http://127.0.0.1:{port}",
            )
        )
        with serve_app(sidecar.app, port=port) as url:
            assert sidecar.wait_ready(120), sidecar.load_error
            client = httpx.Client(base_url=url, timeout=120)

            def request(index: int) -> None:
                response = client.post(
                    "/v1/completions",
                    headers={"X-Business-Line": line, "X-Task": "code"},
                    json={"prompt": f"def parse_invoice_{index}(", "max_tokens": 24, "seed": index, "temperature": 0.9},
                )
                assert response.status_code == 200, response.text

            for index in range(8):
                request(index)
            with sidecar.model_worker.model_lock, torch.no_grad():  # the hotspot: expert 0 of layer 2 takes every token
                sidecar.model_worker.model.model.layers[2].mlp.gate.e_score_correction_bias[0] += 10.0

            def paged() -> list[dict]:
                return [
                    alert
                    for r in list(receiver.requests)
                    for alert in r.json()["alerts"]
                    if alert["status"] == "firing"
                    and alert["labels"]["alertname"] == "ExpertHotspot"
                    and alert["labels"]["router"] == HOT_GATE
                    and alert["labels"]["business_line"] == line
                ]

            index = 100
            while not paged():
                assert index < 160, "no page for the hotspot"
                request(index)
                index += 1
            records = client.get("/v1/routing", params={"business_line": line}).json()["routers"]
            routing = {r["name"]: r for r in records}
            alerts = client.get("/v1/alerts").json()["alerts"]
            # a few history points at the hot value
            assert wait_until(lambda: points_at(sidecar, HOT_GATE, line, routing[HOT_GATE]["entropy_bits"]), 10)
            link = paged()[0]["annotations"]["dashboard"]
            browser = Browser()
            try:
                browser.open(link)
                drawn = (
                    "document.querySelector('#heatmap-canvas').dataset.source === '{}' && "
                    "document.querySelector('.row') && document.querySelector('.row').dataset.metric === '{}'"
                )
                assert browser.wait_for(drawn.format("history", "max_violation")), browser.dom().html[-3000:]
                opened = browser.dom()
                assert opened.find(tag="body")[0]["data-updates"] == "1"  # drawn from the first poll, not a later one
                screenshot = artifacts / "status-page-maxvio.png"
                browser.screenshot(screenshot)
                (artifacts / "status-page-maxvio.html").write_text(opened.html)
                # On-call clicks "entropy": the row stays red (its MaxVio alert fires) though entropy is in band.
                browser.evaluate("document.querySelector('#metrics button[data-metric=entropy_bits]').click()")
                assert browser.wait_for(drawn.format("live", "entropy_bits"))
                entropy, anchor = browser.dom(), browser.evaluate("location.hash")
                browser.evaluate("document.querySelector('#metrics button[data-metric=dead_slots]').click()")
                assert browser.wait_for(drawn.format("history", "dead_slots"))
                dead = browser.dom()
                console = "\n".join(browser.console)
            finally:
                browser.close()
            client.close()

    assert "Uncaught" not in console, console
    # The alert names its rule's metric, and its link the metric and the alert.
    (hot,) = [
        a
        for a in alerts
        if a["labels"]["alertname"] == "ExpertHotspot"
        and a["labels"]["router"] == HOT_GATE
        and a["labels"]["business_line"] == line
    ]
    assert hot["metric"] == "max_violation" and hot["state"] == "firing"
    assert link == (
        f"http://127.0.0.1:{port}/#router={HOT_GATE}&layer=2&business_line={line}"
        "&metric=max_violation&alertname=ExpertHotspot"
    )
    # Entropy stays above the entropy rule's 5.0 bits: that rule is quiet on the hot router. Only MaxVio says
    # what is wrong.
    assert routing[HOT_GATE]["entropy_bits"] > 5.0 and routing[HOT_GATE]["max_violation"] > 6.0
    assert not [a for a in alerts if a["labels"]["alertname"] == "RoutingEntropyLow"], alerts

    # The link selected the line and MaxVio, highlighted the row and marked it with its alert.
    pressed = opened.find(tag="button", **{"aria-pressed": "true"})
    assert [b["data-line"] for b in pressed if "data-line" in b] == [line]
    assert [b["data-metric"] for b in pressed if "data-metric" in b] == ["max_violation"]
    (maxvio_button,) = opened.find(tag="button", **{"data-metric": "max_violation"})
    assert "alerting" in maxvio_button["class"].split()
    rows = opened.find(tag="div", class_="row")
    assert {r["data-router"] for r in rows} == set(routing) and {r["data-metric"] for r in rows} == {"max_violation"}
    (focused,) = [r for r in rows if "focus" in r["class"].split()]
    assert focused["data-router"] == HOT_GATE and "alerted" in focused["class"].split()
    assert focused["data-state"] == "fire" and focused["data-alerts"] == "ExpertHotspot"
    assert float(focused["data-value"]) == pytest.approx(routing[HOT_GATE]["max_violation"])
    assert f"{routing[HOT_GATE]['max_violation']:.2f}" in focused["text"] and "ExpertHotspot" in focused["text"]
    (alert_row,) = opened.find(tag="tr", **{"data-alertname": "ExpertHotspot", "data-router": HOT_GATE})
    assert "focus" in alert_row["class"].split() and alert_row["data-metric"] == "max_violation"
    assert "MaxVio" in alert_row["text"]
    # The bundled model's DSA indexers see contexts shorter than index_topk: they read "no signal", greyed.
    indexers = [r for r in rows if r["data-kind"] == "indexer"]
    assert len(indexers) == 4
    for r in indexers:
        reason = routing[r["data-router"]]["no_signal"]
        assert reason and "index_topk" in reason, reason
        assert r["data-state"] == "nosignal" and r["data-no-signal"] == reason and f"no signal: {reason}" in r["text"]
    for r in rows:
        if r["data-kind"] == "expert" and r["data-router"] != HOT_GATE:
            assert r["data-state"] == "ok" and float(r["data-value"]) == pytest.approx(
                routing[r["data-router"]]["max_violation"]
            )
    (canvas,) = opened.find(tag="canvas", id="heatmap-canvas")
    assert canvas["data-source"] == "history" and canvas["data-metric"] == "max_violation"
    assert int(canvas["data-columns"]) >= 4
    (note,) = opened.find(tag="span", id="metric-note")
    assert note["data-history"] == "yes" and "MaxVio" in note["text"] and "durable history" in note["text"]
    # In the screenshot: the alert's red mark at the right end of the hot row, none on the healthy experts'.
    left, top, width, _ = (int(v) for v in canvas["data-box"].split(","))
    for position, r in enumerate(rows):
        red, green, blue = pixel(screenshot, left + width - 2, top + position * 18 + 9)
        if r["data-router"] == HOT_GATE:
            assert red > 150 and red > 2 * green and red > 2 * blue, (red, green, blue)
        elif r["data-kind"] == "expert":
            assert not (red > 150 and red > 2 * green), (r["data-router"], red, green, blue)

    # "entropy": the value is entropy, above the entropy rule's threshold, and the row is still red: an alert
    # fires on it.
    assert "metric=" not in anchor and f"router={HOT_GATE}" in anchor  # the choice is kept in the anchor
    (row,) = entropy.find(tag="div", class_="row", **{"data-router": HOT_GATE})
    assert row["data-metric"] == "entropy_bits" and row["data-state"] == "fire"
    assert 5.0 < float(row["data-value"]) == pytest.approx(routing[HOT_GATE]["entropy_bits"])
    assert [b["data-metric"] for b in entropy.find(tag="button", **{"aria-pressed": "true"}) if "data-metric" in b] == [
        "entropy_bits"
    ]
    # "dead slots": every row shows its dead experts, from v1/routing; the history from the durable one.
    for r in dead.find(tag="div", class_="row"):
        assert r["data-metric"] == "dead_slots"
        assert float(r["data-value"]) == routing[r["data-router"]]["dead_slots"]
    (canvas,) = dead.find(tag="canvas", id="heatmap-canvas")
    assert canvas["data-source"] == "history" and canvas["data-metric"] == "dead_slots"


def test_without_a_durable_history_the_page_says_a_metric_has_none_and_short_windows_read_no_signal() -> None:
    with running_sidecar(history_retention_days=0, history_interval_seconds=0.5) as (url, _):
        for index in range(3):
            response = httpx.post(
                url + "/v1/completions",
                timeout=60,
                headers={"X-Business-Line": "doc_summary"},
                json={"prompt": f"SELECT {index} FROM", "max_tokens": 8, "seed": index},
            )
            assert response.status_code == 200, response.text
        routing = {
            r["name"]: r
            for r in httpx.get(url + "/v1/routing", params={"business_line": "doc_summary"}, timeout=10).json()[
                "routers"
            ]
        }

        def doc_summary_sampled() -> list[dict]:  # the history samples every 0.5 s: the line's first sample
            series = httpx.get(url + "/v1/status", timeout=10).json()["history"]["series"]
            return series if any(s["business_line"] == "doc_summary" for s in series) else []

        assert wait_until(lambda: bool(doc_summary_sampled()), timeout=60, interval=0.2)
        series = doc_summary_sampled()
        dom, console = open_in_browser(
            url + "/#business_line=doc_summary&metric=max_violation",
            artifacts_dir() / "status-page-no-history.png",
            3000,
        )
    assert "Uncaught" not in console, console
    (note,) = dom.find(tag="span", id="metric-note")
    assert note["data-history"] == "no" and note["text"].startswith(
        "No history of MaxVio here: the live hour holds entropy only"
    )
    (canvas,) = dom.find(tag="canvas", id="heatmap-canvas")
    assert canvas["data-source"] == "none" and canvas["data-metric"] == "max_violation"
    rows = dom.find(tag="div", class_="row")
    assert {r["data-router"] for r in rows} == set(routing)
    for r in rows:  # a few short prompts: every window is under its trusted minimum, or an indexer without choice
        record = routing[r["data-router"]]
        assert record["no_signal"] and r["data-state"] == "nosignal", (r, record)
        assert f"no signal: {record['no_signal']}" in r["text"]
        assert float(r["data-value"]) == pytest.approx(record["max_violation"])
        assert "healthy" not in r["text"]  # no baseline in the records yet
    # The table of every line below says the same as the rows: no signal, with the reason, never a green cell.
    line = {s["router"]: s["no_signal"] for s in series if s["business_line"] == "doc_summary"}
    assert line == {name: record["no_signal"] for name, record in routing.items() if name in line} and line
    cells = [c for c in dom.find(tag="td", class_="cell") if c["data-line"] == "doc_summary"]
    assert {c["data-router"] for c in cells} == set(line)
    for cell in cells:
        reason = routing[cell["data-router"]]["no_signal"]
        assert cell["data-state"] == "nosignal" and f"no signal: {reason}" in cell["title"], cell


# ---------------------------------------------------------------- routing by position


def strips_of(dom: _Elements) -> dict[str, tuple[dict, list[dict]]]:
    """Each drawn position strip by router: the strip and its cells, in order."""
    found = {}
    for strip in dom.find(tag="div", class_="strip"):
        at = dom.elements.index(strip)
        cells = []
        for element in dom.elements[at + 1 :]:
            if element["tag"] == "div" and "strip" in element.get("class", "").split():
                break
            if element["tag"] == "span" and "cell" in element.get("class", "").split():
                cells.append(element)
        found[strip["data-router"]] = (strip, cells)
    return found


@pytest.mark.slow
def test_the_position_strip_draws_each_expert_routers_buckets_as_v1_routing_counts_them(sidecar) -> None:
    url, app = sidecar
    long_line, short_line = "customer_service", "doc_summary"
    with httpx.Client(base_url=url, timeout=60) as client:
        for index in range(3):
            response = client.post(
                "/v1/completions",
                headers={"X-Business-Line": short_line},
                json={"prompt": f"Summarise report {index}:", "max_tokens": 4, "seed": index},
            )
            assert response.status_code == 200, response.text
        for index, text in enumerate(long_texts(app.model_worker.tokenizer, long_line, 24, 470, seed=5)):
            # three clients: a departure by position must hold across clients (one client's texts are content)
            response = client.post(
                "/v1/completions",
                headers={"X-Business-Line": long_line, "X-Client-Id": f"client-{index % 3}"},
                json={"prompt": text, "max_tokens": 1},
            )
            assert response.status_code == 200, response.text

        def both_lines_sampled() -> bool:  # the page offers the lines of its history (sampled every 10 s)
            series = client.get("/v1/status").json()["history"]["series"]
            return {long_line, short_line} <= {s["business_line"] for s in series}

        assert wait_until(both_lines_sampled, 30)
        answers = {
            line: client.get("/v1/routing", params={"business_line": line}).json()["positions"]
            for line in (long_line, short_line)
        }
    browser = Browser()
    try:
        browser.open(f"{url}/#business_line={long_line}")
        assert browser.wait_for(
            f"document.querySelector('#positions-body').dataset.line === '{long_line}' && "
            "document.querySelector('#positions-body .strip')"
        ), browser.dom().html[-3000:]
        long_dom = browser.dom()
        browser.screenshot(artifacts_dir() / "status-page-positions.png")
        # The strip follows the line chosen above the heat map.
        browser.evaluate(f"document.querySelector('#lines button[data-line={short_line}]').click()")
        assert browser.wait_for(
            f"document.querySelector('#positions-body').dataset.line === '{short_line}' && "
            "document.querySelector('#positions-body .strip')"
        )
        short_dom = browser.dom()
        console = "\n".join(browser.console)
    finally:
        browser.close()

    assert "Uncaught" not in console, console
    assert answers[long_line]["buckets"] == ["0-63", "64-127", "128-255", "256-511", "512+"]
    # Past the trained 256 positions the long line's routing departs: the page outlines the bucket the sidecar
    # names as each router's edge, and says so beside the strip.
    assert "256-511" in {router["edge"] for router in answers[long_line]["routers"]}
    for line, dom in ((long_line, long_dom), (short_line, short_dom)):
        strips = strips_of(dom)
        routers = answers[line]["routers"]
        assert set(strips) == {router["name"] for router in routers}  # one strip per expert router
        for router in routers:
            strip, cells = strips[router["name"]]
            assert [c["data-bucket"] for c in cells] == [b["bucket"] for b in router["buckets"]]
            for cell, counted in zip(cells, router["buckets"], strict=True):
                js = counted["js_divergence"]
                assert cell["title"].startswith(
                    f"{counted['bucket']}: {counted['tokens']} tokens · entropy {counted['entropy_bits']:.2f} bits"
                    f" · JS {'–' if js is None else f'{js:.4f}'} bits from in-range routing"
                ), (cell, counted)
                assert int(cell["data-tokens"]) == counted["tokens"]
                if js is None or counted["tokens"] == 0:
                    assert cell["data-state"] == "none"
                else:
                    assert float(cell["data-js"]) == pytest.approx(js)
            outlined = [c["data-bucket"] for c in cells if "edge" in c["class"].split()]
            assert outlined == ([router["edge"]] if router["edge"] else []), (router["name"], outlined)
            assert strip.get("data-edge") == (router["edge"] or None)
            if router["edge"]:
                assert f"leaves in-range routing at {router['edge']}" in strip["text"]
    short_tokens = {r["name"]: [b["tokens"] for b in r["buckets"]] for r in answers[short_line]["routers"]}
    assert all(tokens[0] > 0 and not any(tokens[2:]) for tokens in short_tokens.values())  # short prompts only


def test_without_routing_by_position_the_section_says_so_in_one_line() -> None:
    with running_sidecar(upstream="http://127.0.0.1:9") as (url, _):
        assert "positions" not in httpx.get(url + "/v1/routing", timeout=10).json()
        dom, console = open_in_browser(url + "/", artifacts_dir() / "status-page-no-positions.png", 3000)
    assert "Uncaught" not in console, console
    (body,) = dom.find(tag="div", id="positions-body")
    assert not dom.find(tag="div", class_="strip")
    (note,) = [p for p in dom.find(tag="p") if p["text"].startswith("No routing by position here")]
    assert "--no-routing-by-position" in note["text"] and note["text"] in body["text"]


# ---------------------------------------------------------------- incidents

INCIDENT_RULES = """\
receivers:
  - {name: owners, type: alertmanager_webhook, url: "http://127.0.0.1:9/hook", group_by: [business_line]}
rules:
  - alert: RoutingEntropyLow
    metric: entropy_bits
    select: {kind: expert, business_line: "*"}
    below: 5.0
    min_tokens: 64
    receivers: [owners]
    annotations: {summary: "{value:.2f} bits on {router}"}
"""


def test_an_incident_is_one_row_that_opens_into_its_alerts(tmp_path: Path) -> None:
    gates = [f"model.layers.{layer}.mlp.gate" for layer in (1, 2, 3)]
    with running_sidecar(upstream="http://127.0.0.1:9", rules=write_rules(tmp_path / "rules", INCIDENT_RULES)) as (
        url,
        sidecar,
    ):
        # Three routers of one line and one of another fall below the threshold: two groups of the receiver.
        sidecar.alerts.engine.evaluate(
            [
                *(
                    engine_record(4.0, name=gate, layer=layer, line="code_assistant")
                    for layer, gate in enumerate(gates, 1)
                ),
                engine_record(4.2, name=gates[0], layer=1, line="sql"),
            ]
        )
        views = httpx.get(url + "/v1/alerts", timeout=10).json()["alerts"]
        browser = Browser()
        try:
            browser.open(url + "/?refresh=1")
            assert browser.wait_for("document.querySelector('#alerts-body tr.incident')"), browser.dom().html[-3000:]
            closed = browser.dom()
            browser.evaluate("document.querySelector('#alerts-body tr.incident button.toggle').click()")
            updates = int(browser.evaluate("document.body.dataset.updates"))
            # opened, and still open after the next poll redrew the table
            assert browser.wait_for(
                f"Number(document.body.dataset.updates) > {updates} && "
                "document.querySelector('#alerts-body tr.incident').dataset.open === 'true'"
            )
            opened = browser.dom()
            browser.screenshot(artifacts_dir() / "status-page-incident.png")
            # A link to one of its alerts opens the incident by itself.
            browser.open(
                url + f"/?refresh=1#router={gates[1]}&layer=2&business_line=code_assistant&alertname=RoutingEntropyLow"
            )
            assert browser.wait_for("document.querySelector('#alerts-body tr.incident')")
            linked = browser.dom()
            console = "\n".join(browser.console)
        finally:
            browser.close()

    assert "Uncaught" not in console, console
    keys = {view["incident"]["key"] for view in views}
    assert keys == {'{}:{business_line="code_assistant"}', '{}:{business_line="sql"}'}
    assert {view["incident"]["receiver"] for view in views} == {"owners"}
    (incident,) = closed.find(tag="tr", class_="incident")
    assert incident["data-count"] == "3" and incident["data-open"] == "false" and incident["data-state"] == "firing"
    assert "3 alerts" in incident["text"] and "RoutingEntropyLow ×3" in incident["text"]
    assert "3 routers" in incident["text"] and "one notification to owners" in incident["text"]
    members = closed.find(tag="tr", class_="member")
    assert sorted(m["data-router"] for m in members) == gates and all("hidden" in m for m in members)
    (alone,) = [row for row in closed.find(tag="tr", **{"data-line": "sql"})]
    assert "member" not in alone.get("class", "").split() and "hidden" not in alone  # an incident of one alert
    assert opened.find(tag="tr", class_="incident")[0]["data-open"] == "true"
    assert all("hidden" not in m for m in opened.find(tag="tr", class_="member"))
    assert linked.find(tag="tr", class_="incident")[0]["data-open"] == "true"
    (focused,) = [m for m in linked.find(tag="tr", class_="member") if "focus" in m["class"].split()]
    assert focused["data-router"] == gates[1] and "hidden" not in focused


# ---------------------------------------------------------------- the first look

FIRST_LOOK_RULES = """\
receivers:
  - {name: owners, type: alertmanager_webhook, url: "http://127.0.0.1:9/hook"}
rules:
  - alert: RoutingEntropyLow
    metric: entropy_bits
    select: {kind: expert, business_line: "*"}
    below: 5.0
    min_tokens: 64
    for: 1m
    receivers: [owners]
    annotations: {summary: "{value:.2f} bits on {router}"}
"""


class _ReadingOnItsWay:
    """A cause judge whose reading has not come: the alert stays pending, undecided, for 120 s past ``for``."""

    wait_seconds = 120.0

    def request(self, business_line, since) -> None:
        pass

    def latest(self, business_line):
        return None

    def judge(self, rule, record, since):
        return None


def test_the_page_says_it_loads_the_prompt_limit_and_its_refusals_when_a_reading_is_due_and_keeps_router_names(
    tmp_path: Path,
) -> None:
    from harness.support import SHIPPED_POLICIES

    policies = tmp_path / "policies"
    shutil.copytree(SHIPPED_POLICIES, policies)
    path = policies / "code_assistant.yaml"
    path.write_text(
        path.read_text().replace(
            "defaults:\n  on_violation: clamp\n", "defaults:\n  on_violation: clamp\n  max_prompt_tokens: 384\n", 1
        )
    )
    with running_sidecar(
        upstream="http://127.0.0.1:9", policies=policies, rules=write_rules(tmp_path / "rules", FIRST_LOOK_RULES)
    ) as (url, sidecar):
        page = httpx.get(url + "/", timeout=10).text
        # Two prompts over the limit, as the generation path counts them (tests/test_hardening.py sends them).
        sidecar.metrics.policy_rejections.labels("code_assistant", "code", "max_prompt_tokens").inc(2)
        sidecar.clients.add("code_assistant", "app-1", 600)  # whose tokens the line's window holds
        sidecar.clients.add("code_assistant", "app-2", 400)
        sidecar.alerts.judge_causes_with(_ReadingOnItsWay())  # where the sidecar hands its references
        sidecar.alerts.engine.evaluate([engine_record(4.0, line="code_assistant")])
        (alert,) = httpx.get(url + "/v1/alerts", timeout=10).json()["alerts"]
        assert alert["state"] == "pending" and alert["cause_due_at"] == pytest.approx(
            alert["active_since"] + 60 + 120, abs=0.01
        )
        browser = Browser()
        try:
            browser.open(url + "/?refresh=1")
            assert browser.wait_for(
                "document.querySelector('#policies-body tr[data-task=\"code\"]') && "
                "document.querySelector('#alerts-body tr[data-state=\"pending\"]')"
            )
            loading_left = browser.evaluate("document.querySelectorAll('.loading').length")
            # A row whose alerts have long names: the badge gives way, the router's name stays whole.
            fits = browser.evaluate("""(() => {
              const alerts = ['RoutingEntropyLowForTheWholeFleet', 'LongContextDriftOfTheLine', 'ExpertHotspot']
                .map((name) => ({ state: 'firing', labels: { alertname: name } }));
              const row = renderRow({ router: 'model.layers.12.mlp.gate', layer: 12, kind: 'expert', value: 4.1,
                                      state: 'fire', record: null, alerts });
              $('heatmap-rows').replaceChildren(row);
              const name = row.querySelector('.name'), badge = row.querySelector('.alert');
              return { whole: name.scrollWidth <= name.clientWidth, apart:
                       name.getBoundingClientRect().right <= badge.getBoundingClientRect().left,
                       badge: badge.textContent, title: badge.title };
            })()""")
            dom = browser.dom()
            browser.screenshot(artifacts_dir() / "status-page-first-look.png")
            console = "\n".join(browser.console)
        finally:
            browser.close()
    assert "Uncaught" not in console, console
    (clients,) = dom.find(tag="div", id="clients-note")
    assert clients["text"] == "clients: app-1 60% · app-2 40%", clients
    assert clients["title"] == (
        "app-1: 60% of the window, 60% over the long run\napp-2: 40% of the window, 40% over the long run"
    )
    for body in ("heatmap-rows", "positions-body", "alerts-body", "policies-body", "retune-body"):
        assert f'<div id="{body}"><p class="empty loading">loading&hellip;</p></div>' in page, body
    assert loading_left == 0
    (row,) = [r for r in dom.find(tag="tr", **{"data-task": "code"}) if r["data-line"] == "code_assistant"]
    assert "max_prompt_tokens: ≤ 384 (longer prompts refused)" in row["text"] and row["data-rejections"] == "2"
    (refused,) = [cell for cell in dom.find(tag="td", class_="refused") if "max_prompt_tokens" in cell["text"]]
    assert refused["text"].strip() == "max_prompt_tokens 2"
    (cause,) = [span for span in dom.find(tag="span", class_="cause") if span["text"].startswith("reading")]
    assert re.fullmatch(r"reading… due by \d\d:\d\d:\d\d", cause["text"].strip()), cause
    assert fits["whole"] and fits["apart"] and fits["badge"] == "⚠ 3 alerts", fits
    assert fits["title"] == "RoutingEntropyLowForTheWholeFleet, LongContextDriftOfTheLine, ExpertHotspot"
