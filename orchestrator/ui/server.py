"""`toolchord ui`: the session timeline page, served by the standard library's HTTP server.

Read-only: it reads the event log, the turn records and the workers' call timings. Like Flower it
shows every call (ids, tools, keys, workers; never arguments or output), so off loopback it is
refused without basic authentication.
"""

from __future__ import annotations

import base64
import hmac
import json
import logging
import threading
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from importlib import resources
from typing import Any
from urllib.parse import unquote

from pydantic import BaseModel

from toolchord.orchestrator.event_stores import EventLog
from toolchord.orchestrator.ui.session_view import recent_sessions, session_view

log = logging.getLogger("toolchord.ui")

AUTH_ENV = "TOOLCHORD_UI_BASIC_AUTH"
_STATIC = {
    "/": ("index.html", "text/html; charset=utf-8"),
    "/static/app.js": ("app.js", "text/javascript; charset=utf-8"),
    "/static/style.css": ("style.css", "text/css; charset=utf-8"),
}


def _static(name: str) -> bytes:
    return resources.files("toolchord.orchestrator.ui").joinpath("static", name).read_bytes()


class TimelineServer:
    """The page and its JSON API on `address:port` (port 0 picks a free one)."""

    def __init__(self, event_log: EventLog, redis_client: Any | None, address: str = "127.0.0.1", port: int = 5556,
                 basic_auth: str | None = None) -> None:
        self.event_log = event_log
        self.redis = redis_client
        self._expected = "Basic " + base64.b64encode(basic_auth.encode()).decode() if basic_auth else None
        self.httpd = ThreadingHTTPServer((address, port), self._handler())
        self.httpd.daemon_threads = True
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        host, port = self.httpd.server_address[:2]
        return f"http://{host!s}:{port}/"

    def authorized(self, header: str | None) -> bool:
        return self._expected is None or hmac.compare_digest((header or "").encode(), self._expected.encode())

    def answer(self, path: str) -> tuple[HTTPStatus, bytes, str]:
        """Status, body and content type for a GET of `path`."""
        if path in _STATIC:
            name, kind = _STATIC[path]
            return HTTPStatus.OK, _static(name), kind
        if path == "/api/sessions":
            return self._json([s.model_dump() for s in recent_sessions(self.event_log)])
        if path.startswith("/api/sessions/"):
            session_id = unquote(path.removeprefix("/api/sessions/"))
            try:
                view = session_view(self.event_log, session_id, self.redis)
            except ValueError:
                return HTTPStatus.BAD_REQUEST, b'{"error": "invalid session id"}', "application/json"
            return self._json(view)
        return HTTPStatus.NOT_FOUND, b"not found", "text/plain"

    @staticmethod
    def _json(value: BaseModel | list[Any]) -> tuple[HTTPStatus, bytes, str]:
        body = value.model_dump_json() if isinstance(value, BaseModel) else json.dumps(value)
        return HTTPStatus.OK, body.encode(), "application/json"

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        server = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                if not server.authorized(self.headers.get("Authorization")):
                    self.send_response(HTTPStatus.UNAUTHORIZED)
                    self.send_header("WWW-Authenticate", 'Basic realm="toolchord"')
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    return
                try:
                    status, body, kind = server.answer(self.path.split("?", 1)[0])
                except Exception:
                    log.exception("toolchord ui: %s failed", self.path)
                    status, body, kind = HTTPStatus.INTERNAL_SERVER_ERROR, b"internal error", "text/plain"
                self.send_response(status)
                self.send_header("Content-Type", kind)
                self.send_header("Content-Length", str(len(body)))
                self.send_header("Cache-Control", "no-store")
                self.send_header("X-Content-Type-Options", "nosniff")
                self.send_header("Content-Security-Policy", "default-src 'self'")
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, format: str, *args: Any) -> None:
                log.debug("toolchord ui: " + format, *args)

        return Handler

    def start(self) -> None:
        """Serve from a background thread (tests, embedding)."""
        self._thread = threading.Thread(target=self.httpd.serve_forever, name="toolchord-ui", daemon=True)
        self._thread.start()

    def serve_forever(self) -> None:
        self.httpd.serve_forever()

    def stop(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


__all__ = ["AUTH_ENV", "TimelineServer"]
