"""Authentication of the rank group's socket: a shared secret, proved by challenge-response.

Every connection starts with one line from the server, before anything else is read:
    {"event":"hello","protocol":1,"auth":"hmac-sha256","nonce":"<64 hex digits>"}   (a secret is set)
    {"event":"hello","protocol":1,"auth":"none"}                                      (no secret: loopback only)
With a secret the client answers {"op":"auth","mac":"<hex HMAC-SHA256(secret, nonce bytes)>"} and the
server replies {"event":"auth","ok":true}, or {"event":"error","code":"UNAUTHENTICATED",...} and closes
the connection. The nonce is 32 fresh random bytes per connection, so a recorded answer is worth
nothing on another connection; the MAC is compared with `hmac.compare_digest` (constant time).

The secret never travels on a command line (`ps` shows those to every user): it comes from a file
(`group_secret_file`, or $V4FLASH_GROUP_SECRET_FILE) or the environment ($V4FLASH_GROUP_SECRET).
A file's content is used as bytes with surrounding whitespace stripped; a file readable by other
users is refused. `RankGroup.launch` generates one per launch and hands it to the workers in a
0600 file inside its 0700 work directory.

What this does not do: encrypt the traffic (prompts and tokens cross in clear text) or prove the
server to the client. Across hosts, run the group on a private network (or a tunnel).

Standard library only: the Triton python-backend stub imports the client side.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import json
import os
import secrets
import socket
import stat

SECRET_ENV = "V4FLASH_GROUP_SECRET"
SECRET_FILE_ENV = "V4FLASH_GROUP_SECRET_FILE"
PROTOCOL = 1
SCHEME = "hmac-sha256"
MAX_LINE = 4096  # a handshake line is far shorter; a longer one is refused without reading on
MIN_SECRET_BYTES = 16


class AuthError(RuntimeError):
    """The peer did not authenticate (wrong or missing secret, malformed or slow handshake)."""


def new_secret() -> bytes:
    """A fresh secret (256 random bits, hex: printable, so it can live in a file or an env var)."""
    return secrets.token_hex(32).encode()


def write_secret(path: str, secret: bytes) -> str:
    """Write `secret` to a new file readable by its owner only (created 0600, never wider)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(secret)
    return path


def read_secret_file(path: str) -> bytes:
    st = os.stat(path)
    if st.st_mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise AuthError(f"secret file {path} is accessible to other users (mode {stat.S_IMODE(st.st_mode):o}); "
                        f"chmod 600 it")
    with open(path, "rb") as f:
        secret = f.read().strip()
    return _checked(secret, f"secret file {path}")


def load_secret(path: str | None = None, environ=None) -> bytes | None:
    """The shared secret: the file `path`, else $V4FLASH_GROUP_SECRET_FILE, else $V4FLASH_GROUP_SECRET,
    else None (no authentication)."""
    env = os.environ if environ is None else environ
    path = path or env.get(SECRET_FILE_ENV)
    if path:
        return read_secret_file(path)
    value = env.get(SECRET_ENV)
    if value:
        return _checked(value.strip().encode(), f"${SECRET_ENV}")
    return None


def _checked(secret: bytes, where: str) -> bytes:
    if len(secret) < MIN_SECRET_BYTES:
        raise AuthError(f"{where}: a secret needs at least {MIN_SECRET_BYTES} bytes, got {len(secret)}")
    return secret


def is_loopback(host: str) -> bool:
    """Whether binding `host` listens on loopback only. A name counts when every address it
    resolves to is loopback; the wildcard ("", 0.0.0.0, ::) is not loopback."""
    if host in ("", "0.0.0.0", "::"):
        return False
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        pass
    try:
        addrs = {ai[4][0] for ai in socket.getaddrinfo(host, None)}
    except OSError:
        return False
    return bool(addrs) and all(ipaddress.ip_address(a.split("%")[0]).is_loopback for a in addrs)


def check_bind(host: str, secret: bytes | None) -> None:
    """Refuse to listen beyond loopback without a secret (anyone reaching the port could submit,
    read streams by id and stop the group)."""
    if secret is None and not is_loopback(host):
        raise AuthError(f"refusing to listen on {host!r} without a shared secret: the rank-group socket "
                        f"accepts requests and shutdown from anyone who reaches it. Set group_secret_file "
                        f"(or ${SECRET_FILE_ENV} / ${SECRET_ENV}) on every node and on the client, or "
                        f"listen on 127.0.0.1")


def mac(secret: bytes, nonce_hex: str) -> str:
    return hmac.new(secret, bytes.fromhex(nonce_hex), hashlib.sha256).hexdigest()


def _line(obj: dict) -> bytes:
    return (json.dumps(obj, separators=(",", ":")) + "\n").encode()


def _read_line(sock: socket.socket) -> dict:
    """One JSON line, read byte-wise so nothing after it is consumed (the caller's reader takes the
    socket over next); at most MAX_LINE bytes."""
    buf = bytearray()
    while len(buf) < MAX_LINE:
        b = sock.recv(1)
        if not b:
            raise AuthError("connection closed during the handshake")
        if b == b"\n":
            try:
                msg = json.loads(buf)
            except ValueError:
                raise AuthError("malformed handshake line") from None
            if not isinstance(msg, dict):
                raise AuthError("malformed handshake line")
            return msg
        buf += b
    raise AuthError(f"handshake line longer than {MAX_LINE} bytes")


def server_handshake(sock: socket.socket, secret: bytes | None, timeout_s: float) -> None:
    """The server's side: raises AuthError (after telling the client why) when the client does not
    prove the secret within `timeout_s`. The socket is left blocking, with no timeout."""
    if secret is None:
        sock.sendall(_line({"event": "hello", "protocol": PROTOCOL, "auth": "none"}))
        return
    nonce = secrets.token_hex(32)
    sock.settimeout(timeout_s)
    try:
        sock.sendall(_line({"event": "hello", "protocol": PROTOCOL, "auth": SCHEME, "nonce": nonce}))
        try:
            msg = _read_line(sock)
        except (socket.timeout, TimeoutError):
            raise AuthError(f"no authentication within {timeout_s:g} s") from None
        got = msg.get("mac") if msg.get("op") == "auth" else None
        if not isinstance(got, str):
            raise AuthError(f"first message is not an authentication (op {msg.get('op')!r})")
        if not hmac.compare_digest(got.encode(), mac(secret, nonce).encode()):
            raise AuthError("wrong secret")
    except AuthError as e:
        try:
            sock.sendall(_line({"event": "error", "code": "UNAUTHENTICATED", "message": f"refused: {e}"}))
        except OSError:
            pass
        raise
    sock.sendall(_line({"event": "auth", "ok": True}))
    sock.settimeout(None)


def client_handshake(sock: socket.socket, secret: bytes | None, timeout_s: float = 30.0) -> dict:
    """The client's side: read the hello, prove the secret when asked. Raises AuthError when the
    server asks for a secret we do not have or refuses ours. Returns the hello."""
    sock.settimeout(timeout_s)
    try:
        hello = _read_line(sock)
        if hello.get("event") != "hello":
            raise AuthError(f"the server did not greet with a hello (got {hello!r}): an older rank group?")
        if hello.get("auth") == SCHEME:
            if secret is None:
                raise AuthError(f"the rank group requires a shared secret: set group_secret_file (or "
                                f"${SECRET_FILE_ENV} / ${SECRET_ENV})")
            try:
                answer = mac(secret, str(hello.get("nonce", "")))
            except ValueError:
                raise AuthError("malformed nonce in the server's hello") from None
            sock.sendall(_line({"op": "auth", "mac": answer}))
            reply = _read_line(sock)
            if reply.get("event") != "auth" or reply.get("ok") is not True:
                raise AuthError(f"the rank group refused our secret: {reply.get('message', reply)}")
        elif hello.get("auth") != "none":
            raise AuthError(f"unknown authentication scheme {hello.get('auth')!r}")
    except (socket.timeout, TimeoutError):
        raise AuthError(f"no handshake from the rank group within {timeout_s:g} s") from None
    sock.settimeout(None)
    return hello
