"""An in-process HTTP server on 127.0.0.1 for the media fetcher's tests: it serves bytes, redirects,
streams past any cap, trickles, answers 304 to a matching ETag, and counts what it was asked and sent."""

from __future__ import annotations

import ssl
import threading
from collections import Counter
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, urlsplit

BIG_TOTAL = 64 * 1024 * 1024  # what /big would send if nobody stopped reading


class MediaServer:
    """``routes``: path -> (content type, body, extra headers); ``tls``: serve https. Special paths: /redirect?to=URL,
    /loop/N (redirects to /loop/N+1), /big (streams BIG_TOTAL bytes of PNG-headed data, no length),
    /trickle (a PNG header, then one byte every 50 ms until the client leaves), /stall (headers, then silence)."""

    def __init__(self, routes: dict[str, tuple[str, bytes, dict[str, str]]] | None = None,
                 tls: ssl.SSLContext | None = None) -> None:
        self.routes = dict(routes or {})
        self.requests: Counter[str] = Counter()
        self.not_modified = 0
        self.big_sent = 0
        self.big_done = threading.Event()
        self.stop = threading.Event()
        server = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.0"  # close-delimited bodies: /big and /trickle need no length

            def log_message(self, *args) -> None:
                pass

            def do_GET(self) -> None:
                path = urlsplit(self.path).path
                server.requests[path] += 1
                try:
                    server.answer(self, path)
                except (BrokenPipeError, ConnectionResetError):
                    pass  # the fetcher stopped reading: what these tests want

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        if tls is not None:  # https: the handshake runs on accept
            self.httpd.socket = tls.wrap_socket(self.httpd.socket, server_side=True)
        self.port = self.httpd.server_address[1]
        self.base = f"{'https' if tls else 'http'}://127.0.0.1:{self.port}"
        self._thread = threading.Thread(target=self.httpd.serve_forever, args=(0.05,), daemon=True)

    def __enter__(self) -> MediaServer:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        self.httpd.shutdown()
        self.httpd.server_close()

    def answer(self, h: BaseHTTPRequestHandler, path: str) -> None:
        if path == "/redirect":
            return self._redirect(h, parse_qs(urlsplit(h.path).query)["to"][0])
        if path.startswith("/loop/"):
            return self._redirect(h, f"/loop/{int(path.rsplit('/', 1)[1]) + 1}")
        if path == "/big":
            return self._big(h)
        if path in ("/trickle", "/stall"):
            h.send_response(200)
            h.send_header("Content-Type", "image/png")
            h.end_headers()
            h.wfile.write(b"\x89PNG\r\n\x1a\n")
            h.wfile.flush()
            while not self.stop.wait(0.05 if path == "/trickle" else 1.0):
                if path == "/trickle":
                    h.wfile.write(b"\x00")
                    h.wfile.flush()
            return
        if path not in self.routes:
            h.send_error(404)
            return
        ctype, body, headers = self.routes[path]
        etag = headers.get("ETag")
        if etag is not None and h.headers.get("If-None-Match") == etag:
            self.not_modified += 1
            h.send_response(304)
            for name, value in headers.items():
                h.send_header(name, value)
            h.end_headers()
            return
        h.send_response(200)
        h.send_header("Content-Type", ctype)
        h.send_header("Content-Length", str(len(body)))
        for name, value in headers.items():
            h.send_header(name, value)
        h.end_headers()
        h.wfile.write(body)

    @staticmethod
    def _redirect(h: BaseHTTPRequestHandler, to: str) -> None:
        h.send_response(302)
        h.send_header("Location", to)
        h.end_headers()

    def _big(self, h: BaseHTTPRequestHandler) -> None:
        h.send_response(200)
        h.send_header("Content-Type", "image/png")
        h.end_headers()
        piece = b"\x89PNG\r\n\x1a\n" + bytes(64 * 1024 - 8)
        try:
            while self.big_sent < BIG_TOTAL:
                h.wfile.write(piece)
                self.big_sent += len(piece)
        finally:
            self.big_done.set()

