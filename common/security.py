"""CURVE keys and peer authentication for the ZeroMQ links: key files, the ZAP gate, handshake watching.

Layout (``mserve keygen DIR --name NAME`` writes one keypair)::

    NAME.key          the public key (share it)
    NAME.key_secret   the public and the secret key (mode 0600; never leaves its process's host)

Every process has its own keypair. A process that accepts connections (the coordinator's worker
ROUTER, every worker's data-plane ROUTER) is a CURVE server: it holds its secret key and an
"authorized keys" folder of the public keys (``*.key``) of the peers it lets in. A process that
connects is a CURVE client: it holds its own keypair and the server's public key. A peer whose key
is not in the folder is refused during the handshake (ZAP, RFC 27) and never gets a message through.

The folder is re-read when a key file in it is added, removed or changed (a key applies to the
next connection; connections already made stay up). Nothing here imports torch or anything above
``mserve.common``.
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
import shutil
import stat
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import zmq
import zmq.auth
from zmq.auth.thread import ThreadAuthenticator
from zmq.utils.monitor import recv_monitor_message

__all__ = ["SecurityError", "CurveKeys", "Gate", "HandshakeWatch", "keygen", "load_public_key", "is_public_key",
           "check_curve_settings", "cluster_keys", "PUBLIC_SUFFIX", "SECRET_SUFFIX"]

log = logging.getLogger(__name__)

PUBLIC_SUFFIX = ".key"
SECRET_SUFFIX = ".key_secret"
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,99}$")
_Z85_KEY = re.compile(r"^[0-9a-zA-Z.\-:+=^!/*?&<>()\[\]{}@%$#]{40}$")
_WARN_EVERY_S = 60.0  # a refused key is logged at most this often (a refused peer retries every 0.1 s)


class SecurityError(ValueError):
    """A key file or a security setting is missing, malformed or inconsistent."""


def is_public_key(value: object) -> bool:
    """A Z85-encoded CURVE public key: 40 characters (32 bytes)."""
    return isinstance(value, str) and bool(_Z85_KEY.match(value))


# --------------------------------------------------------------------------- key files


def keygen(directory: str | os.PathLike[str], name: str, *, force: bool = False) -> tuple[Path, Path]:
    """Write a keypair ``NAME.key`` (public, 0644) and ``NAME.key_secret`` (0600) into ``directory``
    (created 0700 if missing). Refuses to overwrite an existing keypair unless ``force``."""
    if not _NAME.match(name):
        raise SecurityError(f"key name {name!r} must be 1..100 characters of letters, digits, '.', '_', '-'")
    folder = Path(directory)
    folder.mkdir(mode=0o700, parents=True, exist_ok=True)
    public, secret = folder / f"{name}{PUBLIC_SUFFIX}", folder / f"{name}{SECRET_SUFFIX}"
    if not force and (public.exists() or secret.exists()):
        raise SecurityError(f"{public} or {secret} exists already (--force replaces the keypair)")
    for path in (public, secret):
        path.unlink(missing_ok=True)
    old = os.umask(0o077)  # the secret file is never readable by others, not even for a moment
    try:
        zmq.auth.create_certificates(str(folder), name)
    finally:
        os.umask(old)
    os.chmod(secret, 0o600)
    os.chmod(public, 0o644)
    return public, secret


def cluster_keys(directory: str | os.PathLike[str], *, servers: list[str], peers: list[str]) -> Path:
    """Keys for processes on one host (``LocalCluster``): a keypair per name in ``directory`` (an
    existing one is kept) and the ``peers``' public keys copied into ``directory/authorized``, which
    is returned. ``servers`` get keypairs only (the coordinator: no one connects to it as a peer)."""
    folder = Path(directory)
    folder.mkdir(mode=0o700, parents=True, exist_ok=True)
    authorized = folder / "authorized"
    authorized.mkdir(mode=0o700, exist_ok=True)
    for name in (*servers, *peers):
        if not (folder / f"{name}{SECRET_SUFFIX}").exists():
            keygen(folder, name, force=True)
    for name in peers:
        shutil.copyfile(folder / f"{name}{PUBLIC_SUFFIX}", authorized / f"{name}{PUBLIC_SUFFIX}")
    return authorized


def _read(path: str | os.PathLike[str], what: str) -> tuple[bytes, bytes | None]:
    try:
        public, secret = zmq.auth.load_certificate(str(path))
    except (OSError, ValueError) as exc:
        raise SecurityError(f"{what} {path}: cannot read a CURVE key: {exc}") from None
    if not is_public_key(public.decode(errors="replace")):
        raise SecurityError(f"{what} {path}: the public key is not a 40-character Z85 key")
    return public, secret


def load_public_key(path: str | os.PathLike[str], what: str = "public key file") -> bytes:
    """The Z85 public key in a ``.key`` (or ``.key_secret``) file."""
    return _read(path, what)[0]


@dataclass(frozen=True)
class CurveKeys:
    """This process's keypair, plus what its role needs: the authorized keys folder (servers) and the
    server's public key (clients of the coordinator)."""

    public: bytes  # Z85
    secret: bytes  # Z85
    authorized: Path | None = None
    server: bytes | None = None

    @classmethod
    def from_files(cls, secret_key: str, *, authorized_keys: str | None = None,
                   server_key: str | None = None) -> CurveKeys:
        public, secret = _read(secret_key, "secret key file")
        if secret is None:
            raise SecurityError(f"secret key file {secret_key}: it holds no secret key (give the "
                                f"{SECRET_SUFFIX} file, not the {PUBLIC_SUFFIX} one)")
        mode = os.stat(secret_key).st_mode
        if mode & (stat.S_IRWXG | stat.S_IRWXO):
            log.warning("secret key file %s is readable by other users (mode %o): chmod 600 it",
                        secret_key, stat.S_IMODE(mode))
        folder = None
        if authorized_keys is not None:
            folder = Path(authorized_keys)
            if not folder.is_dir():
                raise SecurityError(f"authorized keys folder {authorized_keys} is not a folder")
        server = load_public_key(server_key, "server key file") if server_key is not None else None
        return cls(public, secret, folder, server)

    @property
    def public_text(self) -> str:
        return self.public.decode()

    def client(self, server_key: bytes | str | None = None) -> Callable[[zmq.Socket], None]:
        """What makes a socket a CURVE client of the server with ``server_key`` (default: ``server``),
        for ``make_socket(curve=...)``."""
        key = server_key if server_key is not None else self.server
        if key is None:
            raise SecurityError("a CURVE client needs the server's public key")
        server = key.encode() if isinstance(key, str) else key

        def apply(sock: zmq.Socket) -> None:
            sock.curve_secretkey = self.secret
            sock.curve_publickey = self.public
            sock.curve_serverkey = server
        return apply


def check_curve_settings(what: str, **paths: str | None) -> bool:
    """True when every one of ``paths`` (setting name -> value) is set, False when none is; a
    SecurityError naming the missing ones when only some are (half a CURVE setup is a mistake)."""
    missing = [name for name, value in paths.items() if not value]
    if len(missing) == len(paths):
        return False
    if missing:
        given = sorted(set(paths) - set(missing))
        raise SecurityError(f"{what}: {', '.join(given)} given but not {', '.join(missing)}: CURVE needs all of "
                            f"{', '.join(paths)} (or none, for unauthenticated links on one trusted host)")
    return True


# --------------------------------------------------------------------------- the server side: ZAP


def _stat(path: Path) -> os.stat_result | None:
    try:
        return path.stat()
    except OSError:  # removed meanwhile
        return None


class _AuthorizedKeys:
    """The public keys in one folder, re-read whenever the folder changes; the ZAP callback."""

    def __init__(self, folder: Path, what: str) -> None:
        self.folder, self.what = folder, what
        self._stamp: tuple | None = None
        self._keys: frozenset[bytes] = frozenset()
        self._warned: dict[bytes, float] = {}
        self._reload()
        if not self._keys:
            log.warning("%s: no public keys in %s: every peer will be refused", what, folder)

    def _reload(self) -> None:
        try:
            paths = sorted(self.folder.glob(f"*{PUBLIC_SUFFIX}"))
            # Each key file's size and time, not only the folder's: a scan that met a key file still
            # being written must see it again once it is complete (the folder's time moves only once).
            stamp = (os.stat(self.folder).st_ino,
                     tuple((p.name, st.st_size, st.st_mtime_ns) for p in paths if (st := _stat(p)) is not None))
        except OSError as exc:
            log.error("%s: authorized keys folder %s unreadable (%s): refusing every peer", self.what, self.folder, exc)
            self._stamp, self._keys = None, frozenset()
            return
        if stamp == self._stamp:
            return
        keys = set()
        for path in paths:
            try:
                keys.add(load_public_key(path, "authorized key"))
            except SecurityError as exc:
                log.warning("%s: skipped %s", self.what, exc)
        self._stamp, self._keys = stamp, frozenset(keys)
        log.info("%s: %d authorized public key(s) from %s", self.what, len(keys), self.folder)

    def callback(self, domain: str, key: bytes) -> bool:
        self._reload()
        if key in self._keys:
            return True
        now = time.monotonic()
        if now - self._warned.get(key, -_WARN_EVERY_S) >= _WARN_EVERY_S:
            self._warned[key] = now
            log.warning("%s: refused a peer whose CURVE public key %s is not in %s", self.what,
                        key.decode(errors="replace"), self.folder)
        return False


class _Auth:
    def __init__(self, ctx: zmq.Context) -> None:
        self.auth = ThreadAuthenticator(ctx, log=logging.getLogger(f"{__name__}.zap"))
        self.auth.start()
        self.users = 0


_auths: dict[int, _Auth] = {}  # id(context) -> its one ZAP handler (libzmq allows one per context)
_auths_lock = threading.Lock()


class Gate:
    """The CURVE server side of one or more sockets in ``ctx``: this process's keypair, and a ZAP
    handler that lets in only the peers whose public keys are in ``keys.authorized``.

    Sockets of one context share one ZAP handler; each folder gets its own ZAP domain, so sockets
    with different folders in one context do not mix. Make the Gate before binding (``apply`` goes
    to ``make_socket(curve=...)``) and ``close`` it after closing its sockets."""

    def __init__(self, ctx: zmq.Context, keys: CurveKeys, what: str) -> None:
        if keys.authorized is None:
            raise SecurityError(f"{what}: a CURVE server needs an authorized keys folder")
        self.keys, self.ctx, self.what = keys, ctx, what
        folder = keys.authorized.resolve()
        self.domain = "mserve-" + hashlib.sha256(str(folder).encode()).hexdigest()[:16]
        provider = _AuthorizedKeys(folder, what)
        with _auths_lock:
            entry = _auths.get(id(ctx))
            if entry is None:
                entry = _auths[id(ctx)] = _Auth(ctx)
            entry.users += 1
            entry.auth.configure_curve_callback(domain=self.domain, credentials_provider=provider)
        self._closed = False

    def apply(self, sock: zmq.Socket) -> None:
        sock.curve_secretkey = self.keys.secret
        sock.curve_publickey = self.keys.public
        sock.curve_server = True
        sock.zap_domain = self.domain.encode()

    @property
    def public_text(self) -> str:
        return self.keys.public_text

    def close(self) -> None:
        """Stop the ZAP handler once no Gate of this context needs it (before ``ctx.term()``)."""
        if self._closed:
            return
        self._closed = True
        with _auths_lock:
            entry = _auths.get(id(self.ctx))
            if entry is None:
                return
            entry.users -= 1
            if entry.users > 0:
                return
            del _auths[id(self.ctx)]
        entry.auth.stop()


# --------------------------------------------------------------------------- the client side


_FAILED = zmq.EVENT_HANDSHAKE_FAILED_AUTH | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL


class HandshakeWatch:
    """Why a CURVE client's connection does not come up: reads the socket's handshake events.

    Use it from the thread that polls it (a zmq monitor socket is a socket). ``failure()`` drains the
    events without blocking and returns a sentence for the latest failed handshake, or None."""

    def __init__(self, sock: zmq.Socket) -> None:
        self.socket = sock.get_monitor_socket(_FAILED | zmq.EVENT_HANDSHAKE_SUCCEEDED)
        self._sock = sock

    def failure(self) -> str | None:
        why = None
        while self.socket.poll(0):
            try:
                event = recv_monitor_message(self.socket)
            except zmq.ZMQError:
                break
            kind = event["event"]
            if kind == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                why = None
            elif kind == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
                why = (f"the peer refused this process's CURVE key (ZAP status {event['value']}): its public key "
                       "is not in the peer's authorized keys folder")
            elif kind & _FAILED:
                why = ("the CURVE handshake failed (protocol error): wrong server public key, or the peer does "
                       "not use CURVE")
        return why

    def close(self) -> None:
        try:
            self._sock.disable_monitor()
        except zmq.ZMQError:
            pass
        self.socket.close(linger=0)
