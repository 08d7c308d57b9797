"""The coordinator's HTTP side, served on the WebSocket port: dashboard, status JSON, metrics.

``respond`` is a plain function of the request path and a status source, so every route is
tested without sockets; the server calls it from websockets' ``process_request`` hook.

Routes: ``/`` the dashboard (one self-contained page that polls ``/api/status``),
``/api/status`` the status as JSON, ``/metrics`` the same numbers for Prometheus.
"""

from __future__ import annotations

import base64
import hashlib
import html
import json
import re
from collections.abc import Callable
from functools import lru_cache
from http import HTTPStatus
from importlib import resources
from typing import Any

from websockets.datastructures import Headers
from websockets.http11 import Response

from coordinator.serve.metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE
from coordinator.serve.metrics import render_metrics

STATUS_PATH = "/api/status"
METRICS_PATH = "/metrics"
DASHBOARD_PATH = "/"


def respond(
    path: str, *, status: Callable[[], dict[str, Any]], job_name: str, ws_url_hint: str
) -> Response:
    """The response for an HTTP GET of ``path`` (query strings already stripped)."""
    if path == STATUS_PATH:
        return json_response(status())
    if path == METRICS_PATH:
        return _response(
            HTTPStatus.OK,
            METRICS_CONTENT_TYPE,
            render_metrics(status()).encode(),
            [("Cache-Control", "no-store")],
        )
    if path in (DASHBOARD_PATH, "/index.html"):
        return dashboard_response(job_name, ws_url_hint)
    return text_response(HTTPStatus.NOT_FOUND, "not found\n")


def dashboard_response(job_name: str, ws_url_hint: str) -> Response:
    page, policy = _dashboard_template()
    # The job name is the operator's, the hint ours; escaped all the same.
    body = page.replace("__JOB_NAME__", html.escape(job_name)).replace(
        "__WS_URL__", html.escape(ws_url_hint)
    )
    return _response(
        HTTPStatus.OK,
        "text/html; charset=utf-8",
        body.encode(),
        [
            ("Content-Security-Policy", policy),
            ("X-Content-Type-Options", "nosniff"),
            ("Referrer-Policy", "no-referrer"),
            ("Cache-Control", "no-store"),
        ],
    )


@lru_cache(maxsize=1)
def _dashboard_template() -> tuple[str, str]:
    """The page and a Content-Security-Policy that allows exactly its own inline script
    and style (by hash) and requests to this origin: should a worker's name ever slip
    into the page as markup, the browser still runs nothing it brought."""
    page = resources.files("coordinator.serve").joinpath("dashboard.html").read_text("utf-8")
    return page, content_security_policy(page)


def content_security_policy(page: str) -> str:
    scripts = " ".join(_hash_sources(page, "script"))
    styles = " ".join(_hash_sources(page, "style"))
    return (
        "default-src 'none'; "
        f"script-src {scripts}; "
        f"style-src {styles}; "
        "connect-src 'self'; img-src 'self' data:; "
        "base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
    )


def _hash_sources(page: str, tag: str) -> list[str]:
    bodies = re.findall(rf"<{tag}>(.*?)</{tag}>", page, flags=re.DOTALL)
    return [
        "'sha256-" + base64.b64encode(hashlib.sha256(body.encode()).digest()).decode() + "'"
        for body in bodies
    ]


def json_response(body: dict[str, Any]) -> Response:
    return _response(
        HTTPStatus.OK,
        "application/json",
        json.dumps(body, indent=1).encode(),
        [("Cache-Control", "no-store")],
    )


def text_response(status: HTTPStatus, text: str) -> Response:
    return _response(status, "text/plain; charset=utf-8", text.encode())


def _response(
    status: HTTPStatus,
    content_type: str,
    data: bytes,
    extra_headers: list[tuple[str, str]] | None = None,
) -> Response:
    headers = Headers(
        [("Content-Type", content_type), ("Content-Length", str(len(data)))] + (extra_headers or [])
    )
    return Response(status.value, status.phrase, headers, data)
