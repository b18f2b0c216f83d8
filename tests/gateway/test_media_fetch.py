"""The remote media fetcher's rules (gateway/media_fetch.py, media_rules.py, media_cache.py), in-process.

Network rule: the only server is MediaServer on 127.0.0.1 (let through by the test-only setting); every
other name resolves through a resolver the test controls, and the connector refuses (and counts) any
dial to an address other than 127.0.0.1, so a blocked address is shown refused before any connection.
"""

from __future__ import annotations

import socket
import ssl
import subprocess
import threading
import time

import pytest

from mserve.gateway.media_cache import MediaCache, max_age_of
from mserve.gateway.media_fetch import fetcher_from_settings
from mserve.gateway.media_rules import MediaRefused, blocked_reason, check_content, check_host_allowed, parse_domain_rules
from mserve.gateway.openai_api import ApiError, parse_chat_request
from mserve.gateway.settings import GatewaySettings
from tests.gateway.media_server import BIG_TOTAL, MediaServer
from tests.helpers import make_image, wait_for

PNG = make_image(8, 6)
BLOCKED = {  # name -> the address it resolves to, one per class
    "ten.test": "10.1.2.3", "one92.test": "192.168.0.7", "one72.test": "172.16.5.4", "loop2.test": "127.0.0.2",
    "metadata.test": "169.254.169.254", "v6loop.test": "::1", "mapped.test": "::ffff:10.0.0.1",
    "mappedmeta.test": "::ffff:169.254.169.254", "compat.test": "::10.0.0.1", "linklocal6.test": "fe80::1",
    "ula.test": "fd00::1", "mcast.test": "224.0.0.1", "mcast6.test": "ff02::1", "zero.test": "0.0.0.0",
    "zero6.test": "::", "cgnat.test": "100.64.0.9", "reserved.test": "240.0.0.1", "bcast.test": "255.255.255.255",
    "sixtofour.test": "2002:a00:1::1", "teredo.test": "2001:0:4136:e378:8000:63bf:f5ff:fffe",
    "bench.test": "198.18.0.1", "nat64.test": "64:ff9b::a00:1",
}


class Net:
    """The test's resolver and connector: names from a table, dials only to 127.0.0.1 (others counted, refused)."""

    def __init__(self, names: dict[str, list[str]] | None = None) -> None:
        self.names = {name: [ip] for name, ip in BLOCKED.items()} | (names or {})
        self.lookups: list[str] = []
        self.dialled: list[str] = []

    def resolve(self, host: str, port: int) -> list[str]:
        self.lookups.append(host)
        if host in self.names:
            return self.names[host]
        try:
            socket.inet_pton(socket.AF_INET6 if ":" in host else socket.AF_INET, host)
            return [host]  # an IP literal, as getaddrinfo returns it
        except OSError:
            raise socket.gaierror(f"no such test name {host!r}") from None

    def connect(self, ip: str, port: int, timeout_s: float) -> socket.socket:
        self.dialled.append(ip)
        if ip != "127.0.0.1":
            raise AssertionError(f"the fetcher dialled {ip}: only 127.0.0.1 may ever be dialled by a test")
        return socket.create_connection((ip, port), timeout=timeout_s)


def fetcher(net: Net, **settings):
    settings.setdefault("allow_loopback_media_for_tests", True)
    return fetcher_from_settings(GatewaySettings(**settings), resolver=net.resolve, connector=net.connect)


@pytest.fixture
def server():
    routes = {"/a.png": ("image/png", PNG, {}),
              "/fresh.png": ("image/png", PNG, {"Cache-Control": "max-age=600", "ETag": '"v1"'}),
              "/etag.png": ("image/png", PNG, {"Cache-Control": "no-cache", "ETag": '"v2"'}),
              "/nostore.png": ("image/png", PNG, {"Cache-Control": "no-store"}),
              "/page.html": ("text/html", PNG, {}), "/fake.png": ("image/png", b"<html>not an image</html>", {}),
              "/declared-big.png": ("image/png", PNG + bytes(5000), {})}
    with MediaServer(routes) as s:
        yield s


@pytest.mark.parametrize("name", sorted(BLOCKED))
def test_every_blocked_address_class_is_refused_before_any_connection(name):
    net = Net()
    f = fetcher(net)  # the loopback test setting on: it must let none of these through
    with pytest.raises(MediaRefused) as refused:
        f.fetch(f"http://{name}/a.png", "image")
    assert name in refused.value.message and BLOCKED[name] in refused.value.message
    assert net.dialled == [] and net.lookups == [name]


def test_blocked_classes_by_literal_and_the_loopback_setting_lets_only_127_0_0_1():
    for ip in ("169.254.169.254", "10.0.0.1", "[::ffff:10.0.0.1]", "[::1]", "127.0.0.2"):
        net = Net()
        with pytest.raises(MediaRefused, match="address"):
            fetcher(net).fetch(f"http://{ip}/latest/meta-data", "image")
        assert net.dialled == []
    net = Net()
    with pytest.raises(MediaRefused, match="loopback"):
        fetcher(net, allow_loopback_media_for_tests=False).fetch("http://127.0.0.1:9/a.png", "image")
    assert net.dialled == []
    assert blocked_reason("127.0.0.1", True) is None and blocked_reason("::ffff:127.0.0.1", True) is None
    assert blocked_reason("127.0.0.1") == "loopback" and blocked_reason("8.8.8.8") is None
    assert blocked_reason("2001:4860:4860::8888") is None and blocked_reason("::ffff:8.8.8.8") is None


def test_a_name_with_one_private_answer_is_refused_and_the_checked_address_is_the_one_dialled(server):
    net = Net({"mixed.test": ["127.0.0.1", "10.0.0.5"], "media.test": ["127.0.0.1"]})
    f = fetcher(net)
    with pytest.raises(MediaRefused, match="10.0.0.5"):
        f.fetch(f"http://mixed.test:{server.port}/a.png", "image")
    assert net.dialled == []
    assert f.fetch(f"http://media.test:{server.port}/a.png", "image") == PNG
    assert net.lookups.count("media.test") == 1 and net.dialled == ["127.0.0.1"]  # resolved once, no rebinding


def test_redirects_are_checked_at_every_hop(server):
    net = Net()
    f = fetcher(net, media_max_redirects=2)
    for target, rule in (("http://metadata.test/latest/", "169.254.169.254"), ("http://10.0.0.1/", "private"),
                         ("file:///etc/passwd", "scheme 'file'"), ("gopher://x.test/", "scheme 'gopher'")):
        net.dialled.clear()
        with pytest.raises(MediaRefused, match=rule):
            f.fetch(f"{server.base}/redirect?to={target}", "image")
        assert net.dialled == ["127.0.0.1"]  # the first hop only
    assert f.fetch(f"{server.base}/redirect?to=/a.png", "image") == PNG  # a relative hop, checked and followed
    with pytest.raises(MediaRefused, match="more than 2 times.*media_max_redirects=2"):
        f.fetch(f"{server.base}/loop/0", "image")
    assert server.requests["/loop/0"] == 1 and server.requests["/loop/2"] == 1 and server.requests["/loop/3"] == 0


def test_the_allow_list_matches_exact_hosts_and_explicit_suffixes(server):
    rules = parse_domain_rules("cdn.example.test, .img.example.test")
    check_host_allowed("cdn.example.test", rules)
    check_host_allowed("a.img.example.test", rules)
    check_host_allowed("A.B.IMG.example.test.", rules)
    for refused in ("img.example.test", "x.cdn.example.test", "evilimg.example.test", "example.test"):
        with pytest.raises(MediaRefused, match="--allowed-media-domains"):
            check_host_allowed(refused, rules)
    with pytest.raises(ValueError, match="'.example.com' for the names under it"):
        parse_domain_rules("*.example.com")
    net = Net({"a.img.example.test": ["127.0.0.1"], "other.test": ["127.0.0.1"]})
    f = fetcher(net, allowed_media_domains="cdn.example.test,.img.example.test")
    assert f.fetch(f"http://a.img.example.test:{server.port}/a.png", "image") == PNG
    with pytest.raises(MediaRefused, match="'127.0.0.1' is not in --allowed-media-domains"):  # nor the redirect
        f.fetch(f"http://a.img.example.test:{server.port}/redirect?to={server.base}/a.png", "image")
    with pytest.raises(MediaRefused, match="'other.test' is not in"):
        f.fetch(f"http://other.test:{server.port}/a.png", "image")
    assert net.lookups.count("other.test") == 0  # refused before it was even resolved


def test_an_oversized_body_is_cut_off_mid_stream(server):
    net = Net()
    f = fetcher(net, media_max_bytes=256 * 1024)
    with pytest.raises(MediaRefused, match="media_max_bytes=262144"):
        f.fetch(f"{server.base}/big", "image")
    wait_for(server.big_done.is_set, what="the server's stream to end")
    assert server.big_sent < BIG_TOTAL // 4, f"the server sent {server.big_sent} bytes: we read on"
    small = fetcher(net, media_max_bytes=len(PNG) + 100)
    with pytest.raises(MediaRefused, match=rf"is {len(PNG) + 5000} bytes, over the limit media_max_bytes"):
        small.fetch(f"{server.base}/declared-big.png", "image")


def test_a_trickling_server_times_out_while_other_fetches_go_on(server):
    net = Net()
    f = fetcher(net, media_total_timeout_s=1.0, media_read_timeout_s=0.8, media_cache_bytes=0)
    outcome: list[BaseException] = []

    def slow() -> None:
        try:
            f.fetch(f"{server.base}/trickle", "image")
        except BaseException as exc:
            outcome.append(exc)

    t0 = time.monotonic()
    worker = threading.Thread(target=slow)
    worker.start()
    wait_for(lambda: server.requests["/trickle"] == 1, what="the trickle to start")
    for _ in range(5):
        assert f.fetch(f"{server.base}/a.png", "image") == PNG
    assert worker.is_alive(), "the other fetches waited for the trickling one"
    worker.join(timeout=10)
    assert not worker.is_alive() and time.monotonic() - t0 < 5
    assert isinstance(outcome[0], MediaRefused) and "total: limit media_total_timeout_s=1s" in outcome[0].message
    stalled = fetcher(net, media_read_timeout_s=0.3)
    with pytest.raises(MediaRefused, match="read: limit media_read_timeout_s=0.3s"):
        stalled.fetch(f"{server.base}/stall", "image")


def test_over_the_concurrency_cap_a_fetch_waits_a_bounded_time_then_429(server):
    net = Net()
    f = fetcher(net, media_max_concurrent_fetches=1, media_concurrency_wait_s=0.2, media_total_timeout_s=0.6)
    assert f.fetch(f"{server.base}/fresh.png", "image") == PNG
    worker = threading.Thread(target=lambda: pytest.raises(MediaRefused, f.fetch, f"{server.base}/trickle", "image"))
    worker.start()
    wait_for(lambda: server.requests["/trickle"] == 1, what="the trickle to hold the only slot")
    assert f.fetch(f"{server.base}/fresh.png", "image") == PNG  # a fresh cached copy needs no slot
    with pytest.raises(MediaRefused, match="limit media_max_concurrent_fetches=1") as refused:
        f.fetch(f"{server.base}/a.png", "image")
    assert refused.value.status == 429 and server.requests["/a.png"] == 0
    worker.join(timeout=10)
    assert f.fetch(f"{server.base}/a.png", "image") == PNG  # the slot came back


def test_content_type_and_magic_bytes_must_fit_the_kind(server):
    f = fetcher(Net())
    with pytest.raises(MediaRefused, match="Content-Type 'text/html', not a image"):
        f.fetch(f"{server.base}/page.html", "image")
    with pytest.raises(MediaRefused, match="an unknown format by its first bytes, not a image"):
        f.fetch(f"{server.base}/fake.png", "image")
    with pytest.raises(MediaRefused, match="Content-Type 'image/png', not a video"):
        f.fetch(f"{server.base}/a.png", "video")
    assert check_content("h", "video", "application/octet-stream", b"\x00\x00\x00\x18ftypmp42") == "MP4"
    assert check_content("h", "video", "video/webm", b"\x1a\x45\xdf\xa3") == "Matroska/WebM"
    assert check_content("h", "audio", "audio/wav", b"RIFF\x00\x00\x00\x00WAVEfmt ") == "WAV"
    assert check_content("h", "audio", None, b"ID3\x04") == "MPEG"
    assert check_content("h", "audio", "audio/flac", b"fLaC") == "FLAC"
    assert check_content("h", "audio", "audio/ogg", b"OggS") == "Ogg"
    assert check_content("h", "file", "application/pdf", b"%PDF-1.7") == "PDF"
    assert check_content("h", "image", "image/jpeg", b"\xff\xd8\xff\xe0") == "JPEG"
    with pytest.raises(MediaRefused, match="PDF \\(file\\) by its first bytes, not a image"):
        check_content("h", "image", None, b"%PDF-1.7")


def test_the_http_cache_reuses_fresh_bytes_and_revalidates_stale_ones(server):
    f = fetcher(Net())
    for _ in range(3):
        assert f.fetch(f"{server.base}/fresh.png", "image") == PNG
    assert server.requests["/fresh.png"] == 1 and f.cache.hits == 2  # max-age: not asked again
    for _ in range(3):
        assert f.fetch(f"{server.base}/etag.png", "image") == PNG
    assert server.requests["/etag.png"] == 3 and server.not_modified == 2 and f.cache.revalidated == 2
    for _ in range(2):
        f.fetch(f"{server.base}/nostore.png", "image")
    assert server.requests["/nostore.png"] == 2
    assert max_age_of("public, max-age=60") == 60 and max_age_of("no-store") is None and max_age_of(None) == 0


def test_the_cache_is_bounded_in_bytes_and_expires():
    now = [0.0]
    cache = MediaCache(100, clock=lambda: now[0])
    cache.put("a", b"x" * 60, "max-age=10", None, None)
    cache.put("b", b"y" * 60, "max-age=10", None, None)
    assert cache.get("a") is None and cache.get("b") is not None and cache.size_bytes == 60
    cache.put("huge", b"z" * 101, "max-age=10", None, None)
    assert cache.get("huge") is None
    item = cache.get("b")
    assert cache.is_fresh(item)
    now[0] = 11.0
    assert not cache.is_fresh(item)


def test_through_parse_chat_request_a_refusal_is_a_400_naming_the_part(server):
    f = fetcher(Net())

    def parse(url: str):
        part = {"type": "image_url", "image_url": {"url": url}}
        return parse_chat_request({"model": "m", "messages": [{"role": "user", "content": [part]}]}, fetcher=f)

    assert parse(f"{server.base}/a.png").messages[0]["content"][0] == {"type": "image", "image": PNG}
    with pytest.raises(ApiError) as refused:
        parse("http://metadata.test/latest/meta-data")
    err = refused.value
    assert err.status == 400 and err.param == "messages[0].content[0].image_url"
    assert "'metadata.test'" in err.message and "169.254.169.254" in err.message and "link-local" in err.message
    video = {"type": "video", "video": [f"{server.base}/a.png", f"{server.base}/fresh.png"]}
    req = parse_chat_request({"model": "m", "messages": [{"role": "user", "content": [video]}]}, fetcher=f)
    assert req.messages[0]["content"][0]["video"] == [PNG, PNG]


def test_https_checks_the_certificate_against_the_host_name_on_the_pinned_address(tmp_path):
    """TLS to the checked address with SNI = the URL's host: a certificate for media.test passes for
    media.test and fails for another name resolving to the same address (a test CA: a self-signed cert)."""
    key, cert = tmp_path / "key.pem", tmp_path / "cert.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
                    "-days", "1", "-subj", "/CN=media.test", "-addext", "subjectAltName=DNS:media.test",
                    "-keyout", str(key), "-out", str(cert)], check=True, capture_output=True, timeout=30)
    server_tls = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    server_tls.load_cert_chain(cert, key)
    client_tls = ssl.create_default_context(cafile=str(cert))
    net = Net({"media.test": ["127.0.0.1"], "impostor.test": ["127.0.0.1"]})
    f = fetcher_from_settings(GatewaySettings(allow_loopback_media_for_tests=True), resolver=net.resolve,
                              connector=net.connect, tls=client_tls)
    with MediaServer({"/a.png": ("image/png", PNG, {})}, tls=server_tls) as server:
        assert f.fetch(f"https://media.test:{server.port}/a.png", "image") == PNG
        with pytest.raises(MediaRefused, match="'impostor.test': TLS failed"):
            f.fetch(f"https://impostor.test:{server.port}/a.png", "image")
        with pytest.raises(MediaRefused, match="TLS failed"):  # the system CAs do not know the test cert
            fetcher(net).fetch(f"https://media.test:{server.port}/a.png", "image")
    assert net.dialled == ["127.0.0.1"] * 3
