"""The coordinator's HTTP side, served on the WebSocket port: status JSON and a landing page.

``respond`` is a plain function of the request path and a status source, so every route is
tested without sockets; the server calls it from websockets' ``process_request`` hook.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from http import HTTPStatus
from typing import Any

from websockets.datastructures import Headers
from websockets.http11 import Response

STATUS_PATH = "/api/status"


def respond(
    path: str, *, status: Callable[[], dict[str, Any]], job_name: str, ws_url_hint: str
) -> Response:
    """The response for an HTTP GET of ``path`` (query strings already stripped)."""
    if path == STATUS_PATH:
        return json_response(status())
    if path == "/":
        return text_response(
            HTTPStatus.OK,
            f"Cleave coordinator for job {job_name}.\n"
            f"Status: {STATUS_PATH}\nWorkers connect to {ws_url_hint}\n",
        )
    return text_response(HTTPStatus.NOT_FOUND, "not found\n")


def json_response(body: dict[str, Any]) -> Response:
    data = json.dumps(body, indent=1).encode()
    headers = Headers(
        [
            ("Content-Type", "application/json"),
            ("Content-Length", str(len(data))),
            ("Cache-Control", "no-store"),
        ]
    )
    return Response(HTTPStatus.OK.value, HTTPStatus.OK.phrase, headers, data)


def text_response(status: HTTPStatus, text: str) -> Response:
    data = text.encode()
    headers = Headers(
        [("Content-Type", "text/plain; charset=utf-8"), ("Content-Length", str(len(data)))]
    )
    return Response(status.value, status.phrase, headers, data)
