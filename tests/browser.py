"""A real headless Chromium (Debian's `chromium`) driven over the DevTools protocol, stdlib only.

`Browser` starts Chromium listening for DevTools on 127.0.0.1, opens one page, and records every console
error, uncaught exception and error log entry it reports. The WebSocket client below is the protocol's
minimum (RFC 6455: masked text frames out; text, continuation, ping and close in), enough for CDP.
Chromium runs with background networking off and every host name but 127.0.0.1 unresolvable, so the
browser itself sends nothing beyond this machine (the network rule of tests/).
"""

from __future__ import annotations

import base64
import json
import os
import shutil
import socket
import struct
import time
import urllib.request
from pathlib import Path
from typing import Any

from mserve.common.sockets import free_port
from tests.logged_process import LoggedProcess

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
_FLAGS = ("--headless=new", "--no-sandbox", "--disable-gpu", "--no-first-run", "--no-default-browser-check",
          "--disable-background-networking", "--disable-component-update", "--disable-sync", "--disable-extensions",
          "--disable-default-apps", "--no-pings", "--disable-domain-reliability", "--metrics-recording-only",
          "--disable-features=Translate,OptimizationHints,MediaRouter,AutofillServerCommunication",
          "--host-resolver-rules=MAP * ~NOTFOUND, EXCLUDE 127.0.0.1", "--remote-debugging-address=127.0.0.1")


class WebSocket:
    def __init__(self, url: str, timeout_s: float = 30.0) -> None:
        assert url.startswith("ws://127.0.0.1:"), url
        hostport, _, path = url[len("ws://"):].partition("/")
        host, port = hostport.split(":")
        self.sock = socket.create_connection((host, int(port)), timeout=timeout_s)
        key = base64.b64encode(os.urandom(16)).decode()
        self.sock.sendall((f"GET /{path} HTTP/1.1\r\nHost: {hostport}\r\nUpgrade: websocket\r\n"
                           f"Connection: Upgrade\r\nSec-WebSocket-Key: {key}\r\nSec-WebSocket-Version: 13\r\n\r\n").encode())
        head = b""
        while b"\r\n\r\n" not in head:
            chunk = self.sock.recv(1)
            if not chunk:
                raise ConnectionError("DevTools closed the connection during the handshake")
            head += chunk
        if b" 101 " not in head.split(b"\r\n")[0]:
            raise ConnectionError(f"DevTools refused the WebSocket: {head!r}")

    def _exact(self, n: int) -> bytes:
        buf = bytearray()
        while len(buf) < n:
            chunk = self.sock.recv(n - len(buf))
            if not chunk:
                raise ConnectionError("DevTools closed the connection")
            buf += chunk
        return bytes(buf)

    def _send(self, opcode: int, payload: bytes) -> None:
        n = len(payload)
        head = bytes([0x80 | opcode])
        head += bytes([0x80 | n]) if n < 126 else (bytes([0x80 | 126]) + struct.pack(">H", n) if n < 65536
                                                    else bytes([0x80 | 127]) + struct.pack(">Q", n))
        mask = os.urandom(4)
        self.sock.sendall(head + mask + bytes(b ^ mask[i % 4] for i, b in enumerate(payload)))

    def send(self, text: str) -> None:
        self._send(0x1, text.encode())

    def recv(self) -> str:
        message = bytearray()
        while True:
            b0, b1 = self._exact(2)
            n = b1 & 0x7F
            if n == 126:
                n = struct.unpack(">H", self._exact(2))[0]
            elif n == 127:
                n = struct.unpack(">Q", self._exact(8))[0]
            payload = self._exact(n)  # a server's frames are not masked
            opcode = b0 & 0x0F
            if opcode == 0x9:
                self._send(0xA, payload)
                continue
            if opcode == 0x8:
                raise ConnectionError("DevTools closed the WebSocket")
            message += payload
            if b0 & 0x80:
                return message.decode()

    def close(self) -> None:
        self.sock.close()


class Browser(LoggedProcess):
    """One headless Chromium with one page; `errors` collects what the page logged as an error."""

    def __init__(self, profile: Path, width: int = 1400, height: int = 1100) -> None:
        assert CHROMIUM, "Debian's chromium is not installed (apt-get install chromium)"
        port = free_port()
        super().__init__([CHROMIUM, *_FLAGS, f"--remote-debugging-port={port}",
                          f"--user-data-dir={profile / 'profile'}", f"--window-size={width},{height}", "about:blank"],
                         profile / "chromium.log")
        self.errors: list[str] = []
        self._id = 0
        try:
            self.ws = WebSocket(self._page_socket(port))
            for domain in ("Page", "Runtime", "Log"):
                self.call(f"{domain}.enable")
        except BaseException:
            self.close()
            raise

    def _page_socket(self, port: int, timeout_s: float = 30.0) -> str:
        deadline = time.monotonic() + timeout_s
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"chromium exited with {self.proc.returncode}: {self.log_path.read_text()[-2000:]}")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/json/list", timeout=2) as reply:
                    pages = [t for t in json.load(reply) if t.get("type") == "page"]
                if pages:
                    return pages[0]["webSocketDebuggerUrl"]
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"chromium's DevTools did not answer within {timeout_s}s")
            time.sleep(0.1)

    def _event(self, msg: dict[str, Any]) -> None:
        method, p = msg.get("method"), msg.get("params") or {}
        if method == "Runtime.exceptionThrown":
            d = p.get("exceptionDetails") or {}
            self.errors.append(f"exception: {(d.get('exception') or {}).get('description') or d.get('text')}")
        elif method == "Runtime.consoleAPICalled" and p.get("type") in ("error", "assert"):
            self.errors.append("console.error: " + " ".join(str(a.get("value", a.get("description")))
                                                            for a in p.get("args", [])))
        elif method == "Log.entryAdded" and (p.get("entry") or {}).get("level") == "error":
            e = p["entry"]
            self.errors.append(f"log: {e.get('text')} ({e.get('url', '')})")

    def call(self, method: str, **params: Any) -> dict[str, Any]:
        self._id += 1
        self.ws.send(json.dumps({"id": self._id, "method": method, "params": params}))
        while True:
            msg = json.loads(self.ws.recv())
            if msg.get("id") == self._id:
                if "error" in msg:
                    raise RuntimeError(f"{method}: {msg['error']}")
                return msg.get("result") or {}
            self._event(msg)

    def evaluate(self, expression: str) -> Any:
        result = self.call("Runtime.evaluate", expression=expression, returnByValue=True)
        if "exceptionDetails" in result:
            raise RuntimeError(f"{expression!r} threw: {result['exceptionDetails']}")
        return result["result"].get("value")

    def navigate(self, url: str) -> None:
        assert url.startswith("http://127.0.0.1:"), url
        self.call("Page.navigate", url=url)
        while True:  # until the page has loaded (its scripts ran); events on the way are recorded
            msg = json.loads(self.ws.recv())
            self._event(msg)
            if msg.get("method") == "Page.loadEventFired":
                return

    def screenshot(self, path: Path) -> Path:
        path.write_bytes(base64.b64decode(self.call("Page.captureScreenshot", format="png",
                                                    captureBeyondViewport=True)["data"]))
        return path

    def close(self) -> None:
        if getattr(self, "ws", None) is not None:
            self.ws.close()
        super().close()
