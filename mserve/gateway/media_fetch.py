"""Remote media (``http(s)://`` URLs in image, video, audio and file parts), fetched without letting a
request reach inside the network (SSRF).

At every hop (the URL, then each redirect, followed by hand up to ``max_redirects``): the scheme must be
http or https, the host must pass ``--allowed-media-domains`` when one is set, the name is resolved ONCE
(through ``resolver``) and every answer must be a public address (gateway/media_rules.py); the socket is
then opened to exactly the address that was checked (no second lookup, so no DNS rebinding), and https
wraps it with TLS for the host name (SNI, certificate checked against the name).

The body is read in pieces and abandoned as soon as it passes ``max_bytes`` (a Content-Length over it
is refused before reading). Connect, per-read and total time are bounded (a watchdog closes the socket
at the total deadline, so a server that trickles cannot hold a fetch). At most ``max_concurrent``
fetches run at once; one more waits up to ``concurrency_wait_s`` for a slot, then is answered 429.
The Content-Type and the first bytes must fit the part's kind. Fetched bytes are cached (media_cache.py).

Blocking code: the gateway calls it from a worker thread, never on its event loop.
"""

from __future__ import annotations

import http.client
import socket
import ssl
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any
from urllib.parse import urljoin, urlsplit

from mserve.gateway.media_cache import MediaCache
from mserve.gateway.media_rules import (KINDS, MediaRefused, check_address, check_content, check_host_allowed,
                                       parse_domain_rules)
from mserve.gateway.settings import GatewaySettings

__all__ = ["FetchPolicy", "MediaFetcher", "fetcher_from_settings", "system_resolver"]

_REDIRECTS = (301, 302, 303, 307, 308)
_PIECE = 64 * 1024
_HEAD = 32  # bytes the magic check needs


@dataclass(frozen=True)
class FetchPolicy:
    """The limits; their defaults live in GatewaySettings (media_* fields): fetcher_from_settings."""

    allowed_domains: tuple[str, ...]  # parse_domain_rules; () = every public host
    max_bytes: int
    connect_timeout_s: float
    read_timeout_s: float
    total_timeout_s: float
    max_redirects: int
    max_concurrent: int
    concurrency_wait_s: float
    cache_bytes: int
    allow_loopback_for_tests: bool  # TEST ONLY: lets 127.0.0.1 through, nothing else


Resolver = Callable[[str, int], Sequence[str]]
Connector = Callable[[str, int, float], socket.socket]


def system_resolver(host: str, port: int) -> list[str]:
    """Every address the system resolver gives for ``host`` (TCP), in its order."""
    infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    return list(dict.fromkeys(info[4][0] for info in infos))


def _open_socket(ip: str, port: int, timeout_s: float) -> socket.socket:
    return socket.create_connection((ip, port), timeout=timeout_s)


class _Pinned(http.client.HTTPConnection):
    """An HTTP connection to the one address that was checked; the Host header still names the host."""

    def __init__(self, host: str, port: int, ip: str, dial: Callable[[], socket.socket],
                 tls: ssl.SSLContext | None) -> None:
        super().__init__(host, port)
        self._ip, self._dial, self._tls = ip, dial, tls
        self.live: socket.socket | None = None  # kept: http.client drops self.sock once a response owns it

    def connect(self) -> None:
        sock = self._dial()
        self.sock = self._tls.wrap_socket(sock, server_hostname=self.host) if self._tls is not None else sock
        self.live = self.sock


class MediaFetcher:
    """``fetch(url, kind)`` -> the bytes, or MediaRefused naming the host, the rule and the limit."""

    def __init__(self, policy: FetchPolicy, *, resolver: Resolver = system_resolver,
                 connector: Connector = _open_socket, tls: ssl.SSLContext | None = None) -> None:
        self.policy = policy
        self.resolver, self.connector = resolver, connector
        self._tls = tls  # made at the first https URL: loading the system's CA certificates takes a while
        self.cache = MediaCache(policy.cache_bytes)
        self._slots = threading.BoundedSemaphore(policy.max_concurrent)

    def fetch(self, url: str, kind: str) -> bytes:
        if kind not in KINDS:
            raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
        hit = self._fresh(url, kind)  # a fresh cached copy needs no slot
        if hit is not None:
            return hit
        host = urlsplit(url).hostname or "?"
        if not self._slots.acquire(timeout=self.policy.concurrency_wait_s):
            raise MediaRefused(f"media from {host!r} not fetched: {self.policy.max_concurrent} fetches already "
                               f"running (limit media_max_concurrent_fetches={self.policy.max_concurrent}, waited "
                               f"{self.policy.concurrency_wait_s:g}s)", status=429,
                               retry_after_s=self.policy.concurrency_wait_s)
        try:
            deadline = time.monotonic() + self.policy.total_timeout_s
            for _hop in range(self.policy.max_redirects + 1):
                data, url = self._hop(url, kind, deadline)
                if data is not None:
                    return data
            raise MediaRefused(f"media from {host!r} redirected more than {self.policy.max_redirects} times "
                               f"(limit media_max_redirects={self.policy.max_redirects})")
        finally:
            self._slots.release()

    def tls(self) -> ssl.SSLContext:
        if self._tls is None:
            self._tls = ssl.create_default_context()  # certificates and host names checked
        return self._tls

    # -- one hop -------------------------------------------------------------------------------------------
    def _check_url(self, url: str) -> tuple[str, str, int]:
        """(scheme, host, port) of a URL whose scheme and host this server may fetch from."""
        try:
            parts = urlsplit(url)
            host, port = parts.hostname, parts.port
        except ValueError as exc:
            raise MediaRefused(f"media URL {url[:100]!r} is malformed: {exc}") from None
        if parts.scheme not in ("http", "https"):
            raise MediaRefused(f"media URL scheme {parts.scheme!r} (host {host!r}) is not fetched: only http and https")
        if not host:
            raise MediaRefused(f"media URL {url[:100]!r} names no host")
        if parts.username is not None or parts.password is not None:
            raise MediaRefused(f"media URL for host {host!r} carries credentials (user:password@): refused")
        check_host_allowed(host, self.policy.allowed_domains)
        return parts.scheme, host, port or (443 if parts.scheme == "https" else 80)

    def _resolve(self, host: str, port: int) -> str:
        """The one address to dial, resolved once and checked (every answer public)."""
        try:
            answers = list(self.resolver(host, port))
        except (OSError, UnicodeError) as exc:
            raise MediaRefused(f"media host {host!r} does not resolve: {exc}") from None
        return check_address(host, answers, self.policy.allow_loopback_for_tests)

    def _fresh(self, url: str, kind: str) -> bytes | None:
        """The cached bytes of ``url`` while they are fresh (the URL's rules checked first), else None."""
        _, host, _ = self._check_url(url)
        cached = self.cache.get(url)
        if cached is None or not self.cache.is_fresh(cached):
            return None
        self.cache.hits += 1
        check_content(host, kind, None, cached.data[:_HEAD])
        return cached.data

    def _hop(self, url: str, kind: str, deadline: float) -> tuple[bytes | None, str]:
        """(bytes, url) when this hop answered with the media, (None, next url) for a redirect."""
        hit = self._fresh(url, kind)
        if hit is not None:
            return hit, url
        scheme, host, port = self._check_url(url)
        cached = self.cache.get(url)
        ip = self._resolve(host, port)  # before any socket exists
        policy = self.policy
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise self._timeout(host, "total")

        def dial() -> socket.socket:
            return self.connector(ip, port, min(policy.connect_timeout_s, remaining))

        conn = _Pinned(host, port, ip, dial, self.tls() if scheme == "https" else None)
        resp: http.client.HTTPResponse | None = None
        cut = threading.Event()
        watchdog = threading.Timer(remaining, self._cut, (conn, cut))
        watchdog.daemon = True
        watchdog.start()
        try:
            try:
                conn.connect()
            except TimeoutError:
                raise self._timeout(host, "connect") from None
            conn.sock.settimeout(policy.read_timeout_s)
            path = urlsplit(url)._replace(scheme="", netloc="", fragment="").geturl() or "/"
            headers = {"Accept": "*/*", "Accept-Encoding": "identity", "User-Agent": "mserve-gateway"}
            headers.update(cached.validators() if cached is not None else {})
            conn.request("GET", path, headers=headers)
            resp = conn.getresponse()
            if resp.status in _REDIRECTS:
                location = resp.getheader("Location")
                if not location:
                    raise MediaRefused(f"media from {host!r} answered {resp.status} with no Location")
                return None, urljoin(url, location)
            if resp.status == 304 and cached is not None:
                self.cache.refresh(url, cached, resp.getheader("Cache-Control"))
                self.cache.revalidated += 1
                check_content(host, kind, None, cached.data[:_HEAD])
                return cached.data, url
            if resp.status != 200:
                raise MediaRefused(f"media from {host!r} answered HTTP {resp.status} {resp.reason}: only 200 is fetched")
            data = self._body(resp, host)
            if cut.is_set():  # the watchdog's shutdown reads as the end of a close-delimited body
                raise self._timeout(host, "total")
            check_content(host, kind, resp.getheader("Content-Type"), data[:_HEAD])
            self.cache.put(url, data, resp.getheader("Cache-Control"), resp.getheader("ETag"),
                           resp.getheader("Last-Modified"))
            return data, url
        except MediaRefused:
            raise
        except (TimeoutError, socket.timeout):
            raise self._timeout(host, "total" if cut.is_set() else "read") from None
        except ssl.SSLError as exc:
            raise MediaRefused(f"media host {host!r}: TLS failed ({exc.reason or exc})") from None
        except (OSError, http.client.HTTPException, ValueError) as exc:
            if cut.is_set():
                raise self._timeout(host, "total") from None
            raise MediaRefused(f"media from {host!r} could not be fetched: {type(exc).__name__}: {exc}") from None
        finally:
            watchdog.cancel()
            if resp is not None:
                resp.close()
            conn.close()

    def _body(self, resp: http.client.HTTPResponse, host: str) -> bytes:
        cap = self.policy.max_bytes
        declared = resp.getheader("Content-Length")
        if declared is not None and declared.strip().isdigit() and int(declared) > cap:
            raise MediaRefused(f"media from {host!r} is {int(declared)} bytes, over the limit "
                               f"media_max_bytes={cap}")
        body = bytearray()
        while True:
            piece = resp.read1(_PIECE)
            if not piece:
                return bytes(body)
            body += piece
            if len(body) > cap:  # stop reading: the rest never leaves the server's socket buffers
                raise MediaRefused(f"media from {host!r} is over the limit media_max_bytes={cap} (stopped "
                                   f"reading at {len(body)} bytes)")

    def _timeout(self, host: str, which: str) -> MediaRefused:
        limit = {"connect": ("media_connect_timeout_s", self.policy.connect_timeout_s),
                 "read": ("media_read_timeout_s", self.policy.read_timeout_s),
                 "total": ("media_total_timeout_s", self.policy.total_timeout_s)}[which]
        return MediaRefused(f"media from {host!r} timed out ({which}: limit {limit[0]}={limit[1]:g}s)")

    @staticmethod
    def _cut(conn: _Pinned, cut: threading.Event) -> None:
        """The total deadline passed: end whatever read is blocked on the socket."""
        cut.set()
        sock = conn.live
        if sock is not None:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass


def fetcher_from_settings(settings: GatewaySettings, **hooks: Any) -> MediaFetcher:
    """The fetcher for http(s) media URLs, its limits from the settings (media_* fields); ``hooks``:
    MediaFetcher's resolver / connector / tls (tests)."""
    try:
        domains = parse_domain_rules(settings.allowed_media_domains)
    except ValueError as exc:
        raise SystemExit(f"error: {exc}") from None
    return MediaFetcher(FetchPolicy(
        allowed_domains=domains, max_bytes=settings.media_max_bytes,
        connect_timeout_s=settings.media_connect_timeout_s, read_timeout_s=settings.media_read_timeout_s,
        total_timeout_s=settings.media_total_timeout_s, max_redirects=settings.media_max_redirects,
        max_concurrent=settings.media_max_concurrent_fetches, concurrency_wait_s=settings.media_concurrency_wait_s,
        cache_bytes=settings.media_cache_bytes, allow_loopback_for_tests=settings.allow_loopback_media_for_tests),
        **hooks)
