"""The coordinator's HTTP routes as plain functions: dashboard, status JSON, metrics."""

from __future__ import annotations

import base64
import hashlib
import json
import re
from pathlib import Path
from typing import Any

from support.exposition import parse_exposition

from coordinator.serve import http_api

PAGE = Path(http_api.__file__).with_name("dashboard.html")
_IMG = "<img src=x onerror=alert(1)>"


def _status() -> dict[str, Any]:
    return {
        "job": "j",
        "step": 3,
        "workers": [{"id": "w1", "name": _IMG, "state": "working"}],
        "tiles": {"verified": 9},
    }


def _get(path: str, job_name: str = "tiny_gpt") -> Any:
    return http_api.respond(
        path, status=_status, job_name=job_name, ws_url_hint="ws://127.0.0.1:8765/ws"
    )


def test_status_is_json() -> None:
    response = _get("/api/status")
    assert response.status_code == 200
    assert response.headers["Content-Type"] == "application/json"
    assert json.loads(response.body) == _status()


def test_metrics_are_the_prometheus_text_format() -> None:
    response = _get("/metrics")
    assert response.status_code == 200
    assert response.headers["Content-Type"].startswith("text/plain; version=0.0.4")
    parsed = parse_exposition(response.body.decode())
    assert parsed.value("cleave_tiles_verified_total") == 9
    labels = {"id": "w1", "worker": _IMG, "state": "working", "device": "", "key": ""}
    assert parsed.value("cleave_worker_info", **labels) == 1  # plain text: no HTML escaping
    assert int(response.headers["Content-Length"]) == len(response.body)


def test_unknown_paths_are_404() -> None:
    for path in ("/nope", "/api", "/metrics/x", "/../etc/passwd"):
        assert _get(path).status_code == 404, path


def test_dashboard_names_the_job_escaped_and_the_worker_url() -> None:
    response = _get("/", job_name='<script>alert("job")</script>')
    assert response.status_code == 200
    assert response.headers["Content-Type"] == "text/html; charset=utf-8"
    page = response.body.decode()
    assert "&lt;script&gt;alert(&quot;job&quot;)&lt;/script&gt;" in page
    assert '<script>alert("job")' not in page
    assert "ws://127.0.0.1:8765/ws" in page
    assert "__JOB_NAME__" not in page and "__WS_URL__" not in page
    assert _get("/index.html").status_code == 200


def test_dashboard_is_self_contained() -> None:
    page = _get("/").body.decode()
    # Offline: nothing loaded from anywhere but this coordinator.
    assert not re.search(r"""(src|href)\s*=\s*["']?(https?:)?//""", page)
    assert "@import" not in page and "url(" not in page
    assert page.count("<script>") == 1 and page.count("<style>") == 1
    assert "api/status" in page


def test_dashboard_script_never_writes_markup() -> None:
    # Worker names, devices and reasons are strangers' strings: the page may only set
    # them as text. A sink that parses HTML anywhere in the script is a bug waiting.
    script = PAGE.read_text().split("<script>", 1)[1].split("</script>", 1)[0]
    for sink in ("innerHTML", "outerHTML", "insertAdjacentHTML", "document.write", "eval("):
        assert sink not in script, sink
    assert "textContent" in script


def test_content_security_policy_allows_exactly_the_inline_script_and_style() -> None:
    response = _get("/")
    policy = response.headers["Content-Security-Policy"]
    page = response.body.decode()
    for tag in ("script", "style"):
        body = page.split(f"<{tag}>", 1)[1].split(f"</{tag}>", 1)[0]
        digest = base64.b64encode(hashlib.sha256(body.encode()).digest()).decode()
        assert f"{tag}-src 'sha256-{digest}'" in policy
    assert "default-src 'none'" in policy and "unsafe-inline" not in policy
    assert "connect-src 'self'" in policy
    assert response.headers["X-Content-Type-Options"] == "nosniff"
