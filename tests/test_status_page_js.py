"""The status page's pure functions (``static/status.js``), run under Node.js on tiny inputs.

The browser test shows the page working end to end; these pin down the parts it cannot see
exactly: how an incremental reply is merged into what the page holds, and how a value is
placed against its band.
"""

from __future__ import annotations

import json
import shutil
import subprocess

import pytest

from mla_watch.server.status import static_file

BAND = {"fire_below": 5.0, "resolve_above": 5.2, "fire_above": 6.5, "resolve_below": 6.3}


def run_js(expression: str, **inputs: object) -> object:
    """Evaluate ``expression`` with status.js's exports in scope as ``page`` and ``inputs`` as globals."""
    node = shutil.which("node")
    if node is None:
        pytest.fail("no node: the machine's Node.js runs the status page's script in these tests")
    script = static_file("status.js")[0].decode()
    program = (f"const module = {{ exports: {{}} }};\n{script}\nconst page = module.exports;\n"
               + "".join(f"const {name} = {json.dumps(value)};\n" for name, value in inputs.items())
               + f"process.stdout.write(JSON.stringify({expression}));\n")
    run = subprocess.run([node, "-e", program], capture_output=True, text=True, timeout=60, check=False)
    assert run.returncode == 0, run.stderr
    return json.loads(run.stdout)


def series(router: str, line: str, values: list, band: dict | None = None) -> dict:
    return {"router": router, "layer": 1, "kind": "expert", "business_line": line, "floor_bits": 2.585,
            "ceiling_bits": 6.0, "band": band or BAND, "values": values, "too_small": [False] * len(values)}


def test_a_value_is_placed_against_its_band() -> None:
    values = [None, 4.2, 5.0, 5.1, 5.2, 6.0, 6.4, 6.6]
    states = run_js("values.map((v) => page.stateOf(v, band))", values=values, band=BAND)
    assert states == ["none", "fire", "warn", "warn", "ok", "ok", "warn", "high"]
    no_rules = {key: None for key in BAND}
    assert run_js("[page.stateOf(3.0, band), page.stateOf(null, band)]", band=no_rules) == ["ok", "none"]


def test_colours_darken_towards_the_edge_of_the_band() -> None:
    colours = run_js("[2.6, 4.9, 5.3, 5.99].map((v) => page.colourOf(v, s))", s=series("g", "code", []))
    rgb = [tuple(int(c) for c in colour[4:-1].split(",")) for colour in colours]  # "rgb(r,g,b)"
    deep_red, shallow_red, low_green, high_green = rgb
    assert deep_red[0] < shallow_red[0] and all(c[0] > c[1] for c in (deep_red, shallow_red))
    assert low_green[1] < high_green[1] and all(c[1] > c[0] for c in (low_green, high_green))


def test_an_incremental_reply_is_appended_aligned_and_old_points_dropped() -> None:
    old = {"times": [100, 110, 120], "span_seconds": 30, "interval_seconds": 10,
           "series": [series("a", "code", [5.9, 5.8, None]), series("b", "code", [5.7, None, None])]}
    fresh = {"times": [130, 140], "span_seconds": 30, "interval_seconds": 10,
             "series": [series("a", "code", [4.1, 4.0], band={**BAND, "fire_below": 4.5}),
                        series("c", "sql", [5.5, None])]}
    merged = run_js("page.mergeHistory(old, fresh)", old=old, fresh=fresh)
    assert merged["times"] == [110, 120, 130, 140]  # 100 is older than 140 - 30
    by_router = {s["router"]: s for s in merged["series"]}
    assert by_router["a"]["values"] == [5.8, None, 4.1, 4.0]
    assert by_router["a"]["band"]["fire_below"] == 4.5  # the newest band (rules may have been reloaded)
    assert by_router["c"]["values"] == [None, None, 5.5, None]  # new: padded to the shown times
    assert "b" not in by_router  # its only value left the span
    assert all(len(s["too_small"]) == len(s["values"]) == 4 for s in merged["series"])
    first = run_js("page.mergeHistory(null, fresh)", fresh=fresh)
    assert first == fresh  # the first reply is taken as it is


def test_only_http_links_from_annotations_become_links() -> None:
    urls = ["https://runbooks.example/a#b", " http://wiki/x ", "javascript:alert(1)", "JAVASCRIPT:x",
            "data:text/html,<b>", "/relative", None, 42]
    assert run_js("urls.map(page.safeHref)", urls=urls) == ["https://runbooks.example/a#b", "http://wiki/x",
                                                            None, None, None, None, None, None]


def test_a_history_range_asks_for_at_most_720_columns_never_finer_than_the_samples() -> None:
    urls = run_js("[page.historyUrl(86400, 1800000000.5, 10), page.historyUrl(2592000, 1800000000, 10),"
                  " page.historyUrl(86400, 1800000000, 300)]")
    assert urls == ["v1/history?since=1799913600&until=1800000000&step=120",
                    "v1/history?since=1797408000&until=1800000000&step=3600",
                    "v1/history?since=1799913600&until=1800000000&step=300"]
