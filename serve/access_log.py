"""One line on stderr per API request, written once its response has gone out:

    jfire: access: 127.0.0.1 "POST /v1/chat/completions" 200 prompt_tokens=12 cached_tokens=0
        completion_tokens=30 finish=stop ttft=0.041s total=0.512s id=chatcmpl-...

(one line). Generation requests carry their token counts, the finish reason of each choice
(`cancelled` when the client left first), the time to the first token and the request id
that their response body carries; other requests (a 400, /v1/models) the method, path,
status and time. /health and /metrics, polled by supervisors and Prometheus, are not logged.
`jfire serve --no-access-log` (and `jfire launch --no-access-log`) turn it off."""

from __future__ import annotations

import sys
import time

UNLOGGED_PATHS = ("/health", "/metrics")


class AccessLog:
    """Plain ASGI middleware (see serve/app.py for why not Starlette's BaseHTTPMiddleware)."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["path"] in UNLOGGED_PATHS:
            return await self.app(scope, receive, send)
        start, status = time.perf_counter(), [0]
        scope.setdefault("state", {})  # where the handler leaves its responder (request.state)

        async def noted(message):
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, noted)
        finally:
            print(line(scope, status[0], time.perf_counter() - start), file=sys.stderr, flush=True)


def line(scope, status: int, seconds: float) -> str:
    client = (scope.get("client") or ("-",))[0]
    parts = [f'jfire: access: {client} "{scope["method"]} {scope["path"]}" {status or "-"}']
    responder = scope["state"].get("responder")
    fields = responder.access_fields() if responder is not None else {}
    fields = {
        **{k: v for k, v in fields.items() if k != "id"},
        "total": f"{seconds:.3f}s",
        **({"id": fields["id"]} if "id" in fields else {}),
    }
    parts += [f"{k}={v}" for k, v in fields.items()]
    return " ".join(parts)
