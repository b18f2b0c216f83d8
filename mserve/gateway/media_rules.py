"""The rules a remote media URL must pass, as pure functions: which addresses may be dialled, which hosts
the operator allows, and whether the bytes are what the part says they are (content type, magic bytes).

No sockets here; gateway/media_fetch.py applies these at every hop. Every refusal is a MediaRefused
naming the host, the rule and the limit, which the gateway answers as a 400.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Sequence

__all__ = ["MediaRefused", "KINDS", "LOOPBACK_FOR_TESTS", "blocked_reason", "check_address", "parse_domain_rules",
           "check_host_allowed", "check_content"]

KINDS = ("image", "video", "audio", "file")
# The one address the test-only setting (--allow-loopback-media-for-tests) lets through. Nothing else.
LOOPBACK_FOR_TESTS = ipaddress.ip_address("127.0.0.1")

Address = ipaddress.IPv4Address | ipaddress.IPv6Address


class MediaRefused(Exception):
    """A media URL refused by a rule; ``status`` is the HTTP status the gateway answers with."""

    def __init__(self, message: str, status: int = 400, retry_after_s: float | None = None) -> None:
        super().__init__(message)
        self.message, self.status, self.retry_after_s = message, status, retry_after_s


def _class_of(addr: Address) -> str | None:
    """Why ``addr`` (no embedded address considered) is not a public unicast address, or None."""
    if addr.is_unspecified:
        return "unspecified"
    if addr.is_loopback:
        return "loopback"
    if addr.is_link_local:
        return "link-local"
    if addr.is_multicast:
        return "multicast"
    if isinstance(addr, ipaddress.IPv4Address) and addr in _CGNAT:
        return "shared (CGNAT)"
    if addr.is_private:
        return "private"
    if addr.is_reserved:
        return "reserved"
    if isinstance(addr, ipaddress.IPv6Address) and addr.is_site_local:
        return "site-local"
    if not addr.is_global:
        return "not global"
    return None


_CGNAT = ipaddress.ip_network("100.64.0.0/10")
_NAT64 = ipaddress.ip_network("64:ff9b::/96")


def _embedded(addr: ipaddress.IPv6Address) -> list[tuple[str, ipaddress.IPv4Address]]:
    """IPv4 addresses an IPv6 address carries (mapped, compatible, NAT64, 6to4, Teredo)."""
    found = []
    if addr.ipv4_mapped is not None:
        found.append(("IPv4-mapped", addr.ipv4_mapped))
    elif int(addr) >> 32 == 0 and int(addr) > 1:  # ::a.b.c.d (deprecated "compatible"); :: and ::1 are their own
        found.append(("IPv4-compatible", ipaddress.IPv4Address(int(addr) & 0xFFFFFFFF)))
    elif addr in _NAT64:
        found.append(("NAT64", ipaddress.IPv4Address(int(addr) & 0xFFFFFFFF)))
    if addr.sixtofour is not None:
        found.append(("6to4", addr.sixtofour))
    if addr.teredo is not None:
        server, client = addr.teredo
        found += [("Teredo server", server), ("Teredo client", client)]
    return found


def blocked_reason(ip: str, allow_loopback_for_tests: bool = False) -> str | None:
    """Why ``ip`` may not be dialled (a class name, e.g. "private"), or None when it may."""
    try:
        addr = ipaddress.ip_address(ip.split("%", 1)[0])  # a zone id (fe80::1%eth0) changes nothing
    except ValueError:
        return "not an IP address"
    if allow_loopback_for_tests and addr == LOOPBACK_FOR_TESTS:
        return None
    if isinstance(addr, ipaddress.IPv6Address):
        for how, inner in _embedded(addr):
            if allow_loopback_for_tests and how == "IPv4-mapped" and inner == LOOPBACK_FOR_TESTS:
                return None
            reason = _class_of(inner)
            if reason is not None:
                return f"{reason} ({how} {inner})"
        if addr.ipv4_mapped is not None:  # the socket dials the IPv4 address itself, which passed
            return None
    return _class_of(addr)


def check_address(host: str, answers: Sequence[str], allow_loopback_for_tests: bool = False) -> str:
    """The address to dial for ``host``: the first of its resolver answers, each of which must be public
    (one bad answer refuses the name: a name that can point inward is not fetched)."""
    if not answers:
        raise MediaRefused(f"media host {host!r} did not resolve to any address")
    for ip in answers:
        reason = blocked_reason(ip, allow_loopback_for_tests)
        if reason is not None:
            raise MediaRefused(f"media host {host!r} resolves to {ip}, a {reason} address: only public addresses "
                               "are fetched (rule: no private, loopback, link-local, multicast or reserved targets)")
    return answers[0]


# ---- the operator's allow-list (--allowed-media-domains) ---------------------------------------------------


def parse_domain_rules(spec: str | None) -> tuple[str, ...]:
    """``"a.com,.cdn.example.com"`` -> rules; a rule starting with "." matches the names below it (not the
    name itself), any other rule matches exactly one host. Empty or None: every public host is allowed."""
    if not spec:
        return ()
    rules = []
    for item in spec.split(","):
        rule = item.strip().lower().rstrip(".")
        if not rule:
            continue
        if "*" in rule or "/" in rule or "@" in rule:
            raise ValueError(f"--allowed-media-domains: {item.strip()!r} is not a host or a '.suffix' rule "
                             "(write 'example.com' for one host, '.example.com' for the names under it)")
        if rule == "." or rule.startswith(".."):
            raise ValueError(f"--allowed-media-domains: {item.strip()!r} is an empty suffix")
        rules.append(rule)
    return tuple(rules)


def check_host_allowed(host: str, rules: Sequence[str]) -> None:
    if not rules:
        return
    name = host.lower().rstrip(".")
    for rule in rules:
        if name == rule if not rule.startswith(".") else name.endswith(rule):
            return
    raise MediaRefused(f"media host {host!r} is not in --allowed-media-domains ({', '.join(rules)}); a rule "
                       "'.example.com' allows the names under example.com, 'example.com' that host only")


# ---- what the bytes are ------------------------------------------------------------------------------------

# Content types each kind accepts besides its own "<kind>/*"; servers often send these for any binary.
_GENERIC_TYPES = ("application/octet-stream", "binary/octet-stream", "")
_KIND_TYPES = {"image": ("image/",), "video": ("video/", "application/x-matroska"),
               "audio": ("audio/", "application/ogg"), "file": ("application/pdf",)}


def _magic_kinds(head: bytes) -> tuple[str, str] | None:
    """(kind, format) the first bytes announce, or None."""
    if head.startswith(b"\x89PNG\r\n\x1a\n"):
        return "image", "PNG"
    if head.startswith(b"\xff\xd8\xff"):
        return "image", "JPEG"
    if head[:6] in (b"GIF87a", b"GIF89a"):
        return "image", "GIF"
    if head[:4] == b"RIFF" and head[8:12] == b"WEBP":
        return "image", "WEBP"
    if head.startswith(b"BM"):
        return "image", "BMP"
    if head[:4] in (b"II*\x00", b"MM\x00*"):
        return "image", "TIFF"
    if head[4:8] == b"ftyp":
        brand = head[8:12]
        if brand in (b"avif", b"avis", b"heic", b"heix", b"mif1", b"msf1"):
            return "image", brand.decode(errors="replace").upper()
        if brand in (b"M4A ", b"M4B "):
            return "audio", "M4A"
        return "video", "MP4"
    if head.startswith(b"\x1a\x45\xdf\xa3"):
        return "video", "Matroska/WebM"
    if head[:4] == b"RIFF" and head[8:12] == b"AVI ":
        return "video", "AVI"
    if head[:4] == b"RIFF" and head[8:12] == b"WAVE":
        return "audio", "WAV"
    if head.startswith(b"ID3") or (len(head) > 1 and head[0] == 0xFF and head[1] & 0xE0 == 0xE0):
        return "audio", "MPEG"
    if head.startswith(b"fLaC"):
        return "audio", "FLAC"
    if head.startswith(b"OggS"):
        return "audio", "Ogg"
    if head.startswith(b"%PDF-"):
        return "file", "PDF"
    return None


def check_content(host: str, kind: str, content_type: str | None, head: bytes) -> str:
    """The format name when the Content-Type and the first bytes both fit ``kind``, else MediaRefused."""
    ctype = (content_type or "").split(";", 1)[0].strip().lower()
    if ctype not in _GENERIC_TYPES and not ctype.startswith(_KIND_TYPES[kind]):
        raise MediaRefused(f"media from {host!r} has Content-Type {ctype!r}, not a {kind} "
                           f"(rule: {' or '.join(_KIND_TYPES[kind])} or application/octet-stream)")
    found = _magic_kinds(head)
    # Ogg is audio by default but may carry a video stream (Theora): a video part may be one.
    if found is None or (found[0] != kind and not (kind == "video" and found[1] == "Ogg")):
        what = f"{found[1]} ({found[0]})" if found else "an unknown format"
        raise MediaRefused(f"media from {host!r} is {what} by its first bytes, not a {kind} "
                           f"(rule: the bytes must start with a {kind} format's signature)")
    return found[1]
