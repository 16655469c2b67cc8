"""A real OCI registry on loopback for the tests of the image client, and images written by
the test itself (no network, no mocks).

- :class:`Registry`: Debian's ``docker-registry`` (CNCF distribution 2.8) started on
  127.0.0.1 on a free port, filesystem storage and its log under the given directory,
  plain HTTP; ``auth=None`` (anonymous), ``"basic"`` (htpasswd, bcrypt) or ``"token"``
  (the Docker token spec: a token service of its own in a thread, RS256 JWTs signed with a
  self-signed certificate the registry trusts). A context manager: the process (and the
  token service) is stopped on exit, test failed or not.
- :func:`layer_tar`: a layer tarball (gzip, zstd or none) of :class:`File`,
  :class:`Dir`, :class:`Symlink`, :class:`Hardlink`, :class:`Whiteout`, :class:`Opaque`
  and :class:`Raw` entries; a file's content may be a path, streamed.
- :func:`push_image`, :func:`push_index`: an OCI image layout written here, pushed by
  ``skopeo copy --preserve-digests`` (so the manifest the registry holds is byte for byte
  the one written here, zstd layers included), or by the registry's HTTP API
  (``via="http"``); :func:`push_raw`, :func:`push_blob`, :func:`push_manifest`: whatever
  bytes a test likes, by the HTTP API.
- :class:`HangingServer`: a loopback TCP server that accepts and never answers, or
  answers 200 and then trickles the body a byte at a time (a client's time bounds).

A test that starts a registry (or pushes with skopeo) fails under
``NCCLGUARD_REQUIRE_PARTS=1`` when ``docker-registry`` or ``skopeo`` is not installed,
and is skipped with the reason otherwise (:func:`helpers.parts.unavailable`).

Over 500 lines: the registry, its token service, the image builders and the pushers are
one harness: each test asks for an image on a registry with some auth, and the parts
share the registry's admin and its directory.
"""

from __future__ import annotations

import base64
import contextlib
import datetime
import functools
import gzip
import hashlib
import io
import json
import os
import secrets
import shutil
import socket
import subprocess
import tarfile
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from email.message import Message
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import IO, Any, Literal

from helpers.parts import extract_nccl, unavailable

REGISTRY_PROGRAM = "docker-registry"
SKOPEO_PROGRAM = "skopeo"

OCI_MANIFEST = "application/vnd.oci.image.manifest.v1+json"
OCI_INDEX = "application/vnd.oci.image.index.v1+json"
OCI_CONFIG = "application/vnd.oci.image.config.v1+json"
LAYER_TAR = "application/vnd.oci.image.layer.v1.tar"
LAYER_GZIP = "application/vnd.oci.image.layer.v1.tar+gzip"
LAYER_ZSTD = "application/vnd.oci.image.layer.v1.tar+zstd"
MEDIA_TYPES = {"none": LAYER_TAR, "gzip": LAYER_GZIP, "zstd": LAYER_ZSTD}
# what a client sends in Accept to be given any of them
MANIFEST_ACCEPT = ", ".join([
    OCI_MANIFEST, OCI_INDEX, "application/vnd.docker.distribution.manifest.v2+json",
    "application/vnd.docker.distribution.manifest.list.v2+json",
])  # fmt: skip

Compression = Literal["gzip", "zstd", "none"]
Auth = Literal["basic", "token"] | None
#: ("linux", "amd64") or ("linux", "arm64", "v8")
Platform = tuple[str, ...]
#: (user or None for anonymous, resource type, name, requested actions) -> granted actions
AccessPolicy = Callable[[str | None, str, str, list[str]], list[str]]

_CHUNK = 1 << 20
# the proxies of the environment never apply to loopback
_NO_PROXY_ENV = ("http_proxy", "https_proxy", "HTTP_PROXY", "HTTPS_PROXY", "all_proxy",
                 "ALL_PROXY", "no_proxy", "NO_PROXY")  # fmt: skip
_OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def sha256_digest(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


def _canonical(obj: Any) -> bytes:
    return json.dumps(obj, sort_keys=True, separators=(",", ":")).encode()


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _program(name: str, package: str) -> str:
    exe = shutil.which(name)
    if exe is None:
        unavailable(f"{name} is not installed (apt-get install {package})")
    return exe


def _clean_env(extra: Mapping[str, str] | None = None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if k not in _NO_PROXY_ENV and not k.startswith("REGISTRY_")}  # fmt: skip
    env.update(extra or {})
    return env


def _tail(path: Path, lines: int = 40) -> str:
    try:
        text = path.read_text(errors="replace")
    except OSError as e:
        return f"(no log: {e})"
    return "\n".join(text.splitlines()[-lines:])


# --- HTTP, the stdlib's --------------------------------------------------------------------


@dataclass
class Response:
    status: int
    headers: Message  # case-insensitive: .get("Docker-Content-Digest")
    body: bytes

    def json(self) -> Any:
        return json.loads(self.body)


def http(method: str, url: str, data: bytes | None = None,
         headers: Mapping[str, str] | None = None, timeout: float = 30.0) -> Response:
    """One request with urllib (no proxy); an HTTP error status is a Response too."""
    req = urllib.request.Request(url, data=data, method=method, headers=dict(headers or {}))
    try:
        with _OPENER.open(req, timeout=timeout) as r:
            return Response(r.status, r.headers, r.read())
    except urllib.error.HTTPError as e:
        with e:
            return Response(e.code, e.headers, e.read())


def basic_header(user: str, password: str) -> str:
    return "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode()


def parse_challenge(value: str) -> tuple[str, dict[str, str]]:
    """``Bearer realm="...",service="...",scope="..."`` -> ("bearer", {realm: ..., ...})."""
    scheme, _, rest = value.strip().partition(" ")
    params: dict[str, str] = {}
    i = 0
    while i < len(rest):
        eq = rest.find("=", i)
        if eq < 0:
            break
        key = rest[i:eq].strip().strip(",").strip().lower()
        i = eq + 1
        if i < len(rest) and rest[i] == '"':
            end = rest.find('"', i + 1)
            end = len(rest) if end < 0 else end
            params[key] = rest[i + 1:end]
            i = end + 1
        else:
            end = rest.find(",", i)
            end = len(rest) if end < 0 else end
            params[key] = rest[i:end].strip()
            i = end
        while i < len(rest) and rest[i] in ", ":
            i += 1
    return scheme.lower(), params


# --- the token service's keys ----------------------------------------------------------------


def _b64url(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def libtrust_key_id(public_key_der: bytes) -> str:
    """The key id distribution 2.8 (docker/libtrust) gives a key: the SHA-256 of its PKIX
    DER, first 240 bits, base32 without padding, in groups of four joined by ':'."""
    s = base64.b32encode(hashlib.sha256(public_key_der).digest()[:30]).decode().rstrip("=")
    return ":".join(s[i:i + 4] for i in range(0, len(s), 4))


@dataclass(frozen=True)
class SigningKey:
    key_pem: bytes
    cert_pem: bytes
    kid: str

    def sign_jwt(self, claims: Mapping[str, Any]) -> str:
        from cryptography.hazmat.primitives import hashes, serialization
        from cryptography.hazmat.primitives.asymmetric import padding, rsa

        key = serialization.load_pem_private_key(self.key_pem, password=None)
        assert isinstance(key, rsa.RSAPrivateKey)
        header = {"alg": "RS256", "typ": "JWT", "kid": self.kid}
        signing_input = (_b64url(_canonical(header)) + "." + _b64url(_canonical(claims)))
        sig = key.sign(signing_input.encode(), padding.PKCS1v15(), hashes.SHA256())
        return signing_input + "." + _b64url(sig)


@functools.cache
def signing_key() -> SigningKey:
    """An RSA key and a self-signed certificate for it (one per test process: made once)."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import rsa
    from cryptography.x509.oid import NameOID

    key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "ncclguard test token issuer")])
    now = datetime.datetime.now(datetime.UTC)
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name)
            .public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(days=1))
            .not_valid_after(now + datetime.timedelta(days=7))
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .sign(key, hashes.SHA256()))  # fmt: skip
    der = key.public_key().public_bytes(serialization.Encoding.DER,
                                        serialization.PublicFormat.SubjectPublicKeyInfo)
    return SigningKey(
        key_pem=key.private_bytes(serialization.Encoding.PEM,
                                  serialization.PrivateFormat.PKCS8,
                                  serialization.NoEncryption()),
        cert_pem=cert.public_bytes(serialization.Encoding.PEM),
        kid=libtrust_key_id(der),
    )  # fmt: skip


def _htpasswd_line(user: str, password: str) -> str:
    import bcrypt

    # cost 4 (bcrypt's least): the registry checks it on every request
    return f"{user}:{bcrypt.hashpw(password.encode(), bcrypt.gensalt(rounds=4)).decode()}"


# --- the token service -------------------------------------------------------------------------


@dataclass
class TokenRequest:
    """One request to the token service, as it came and as it was answered."""

    method: str
    path: str
    query: dict[str, list[str]]
    service: str | None
    scopes: list[str]
    user: str | None  # the user of a good basic auth; None: anonymous or refused
    authorization: str | None  # the Authorization header as sent
    status: int
    granted: list[dict[str, Any]] = field(default_factory=list)


def parse_scope(scope: str) -> tuple[str, str, list[str]]:
    """``repository:host:5000/a/b:pull,push`` -> ("repository", "host:5000/a/b", [...])."""
    rtype, _, rest = scope.partition(":")
    name, _, actions = rest.rpartition(":")
    return rtype, name, [a for a in actions.split(",") if a]


class TokenService:
    """The Docker token spec's service on loopback, in a thread (started by :class:`Registry`
    with ``auth="token"``): ``GET /token?service=..&scope=..`` (and the OAuth2 ``POST``
    with ``grant_type=password``), basic auth checked against ``users``."""

    def __init__(self, *, users: Mapping[str, str], admin: tuple[str, str], service: str,
                 issuer: str, key: SigningKey, anonymous_pull: bool, expires_in: int,
                 access: AccessPolicy | None) -> None:
        self.users = dict(users)
        self.admin = admin
        self.service = service
        self.issuer = issuer
        self.key = key
        self.anonymous_pull = anonymous_pull
        self.expires_in = expires_in
        self.access = access
        self.requests: list[TokenRequest] = []
        self.issued = 0
        self._server: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        assert self._server is not None
        return f"http://127.0.0.1:{self._server.server_address[1]}/token"

    def start(self) -> TokenService:
        svc = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, format: str, *args: Any) -> None:
                pass

            def do_GET(self) -> None:
                u = urllib.parse.urlsplit(self.path)
                svc._handle(self, "GET", u.path, urllib.parse.parse_qs(u.query))

            def do_POST(self) -> None:
                u = urllib.parse.urlsplit(self.path)
                n = int(self.headers.get("Content-Length") or 0)
                form = urllib.parse.parse_qs(self.rfile.read(n).decode(errors="replace"))
                svc._handle(self, "POST", u.path, form)

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever,
                                        kwargs={"poll_interval": 0.05},
                                        name="registry-token-service", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
        if self._thread is not None:
            self._thread.join(timeout=10)
        self._server = self._thread = None

    def _who(self, authorization: str | None, form: dict[str, list[str]]
             ) -> tuple[bool, str | None]:
        """(credentials good or absent, user)."""
        user = password = None
        if authorization and authorization.lower().startswith("basic "):
            try:
                raw = base64.b64decode(authorization[6:].strip(), validate=True).decode()
            except (ValueError, UnicodeDecodeError):
                return False, None
            user, _, password = raw.partition(":")
        elif form.get("grant_type", [""])[0] == "password":
            user = form.get("username", [""])[0]
            password = form.get("password", [""])[0]
        if user is None:
            return True, None
        if (user, password) == self.admin or (user in self.users
                                              and self.users[user] == password):
            return True, user
        return False, None

    def _grant(self, user: str | None, rtype: str, name: str, actions: list[str]) -> list[str]:
        if user == self.admin[0]:
            return actions
        if self.access is not None:
            return [a for a in self.access(user, rtype, name, actions) if a in actions]
        if rtype != "repository":
            return []
        if user is None:
            return ["pull"] if self.anonymous_pull and "pull" in actions else []
        return [a for a in actions if a in ("pull", "push")]

    def _handle(self, h: BaseHTTPRequestHandler, method: str, path: str,
                params: dict[str, list[str]]) -> None:
        authorization = h.headers.get("Authorization")
        scopes = [s for v in params.get("scope", []) for s in v.split(" ") if s]
        service = params.get("service", [None])[0]
        ok, user = self._who(authorization, params)
        rec = TokenRequest(method=method, path=path, query=params, service=service,
                           scopes=scopes, user=user, authorization=authorization, status=0)
        if user != self.admin[0]:  # the harness's own pushes are not recorded
            self.requests.append(rec)
        if path != "/token":
            rec.status = 404
            return self._reply(h, 404, {"errors": [{"code": "NOT_FOUND"}]})
        if not ok:
            rec.status = 401
            return self._reply(h, 401, {"errors": [{"code": "UNAUTHORIZED",
                                                    "message": "bad credentials"}]},
                               {"WWW-Authenticate": 'Basic realm="token"'})
        if service is not None and service != self.service:
            rec.status = 400
            return self._reply(h, 400, {"errors": [{"code": "INVALID_SERVICE"}]})
        for scope in scopes:
            rtype, name, actions = parse_scope(scope)
            granted = self._grant(user, rtype, name, actions)
            if granted:
                rec.granted.append({"type": rtype, "name": name, "actions": granted})
        now = int(time.time())
        claims = {"iss": self.issuer, "sub": user or "", "aud": self.service,
                  "exp": now + self.expires_in, "nbf": now - 10, "iat": now,
                  "jti": secrets.token_hex(16), "access": rec.granted}  # fmt: skip
        token = self.key.sign_jwt(claims)
        self.issued += 1
        rec.status = 200
        issued_at = datetime.datetime.fromtimestamp(now, datetime.UTC).isoformat()
        self._reply(h, 200, {"token": token, "access_token": token,
                             "expires_in": self.expires_in, "issued_at": issued_at})

    @staticmethod
    def _reply(h: BaseHTTPRequestHandler, status: int, obj: Any,
               headers: Mapping[str, str] | None = None) -> None:
        body = json.dumps(obj).encode()
        h.send_response(status)
        h.send_header("Content-Type", "application/json")
        h.send_header("Content-Length", str(len(body)))
        for k, v in (headers or {}).items():
            h.send_header(k, v)
        h.end_headers()
        h.wfile.write(body)


# --- the registry ------------------------------------------------------------------------------


class RegistryError(RuntimeError):
    pass


class Registry:
    """``docker-registry serve`` on 127.0.0.1, a free port, storage and log under
    ``directory``; ``with Registry(tmp_path) as reg: ...`` (or ``start()``/``stop()``).

    ``host`` is "127.0.0.1:PORT", ``url`` "http://127.0.0.1:PORT", ``log_path`` its log.
    ``auth="basic"``: htpasswd with ``users``; ``auth="token"``: a :class:`TokenService`
    (``token_service``, its requests in ``token_requests``) for ``users``, anonymous pull
    only with ``anonymous_pull=True``, or what ``access`` grants. The harness's own user
    (``admin``: (user, password), allowed everything) is how it pushes when auth is on; its
    token requests are not recorded.

    A fixture: ``with Registry(tmp_path / "registry", auth="token", users=...) as reg:
    yield reg``."""

    def __init__(self, directory: Path, *, auth: Auth = None,
                 users: Mapping[str, str] | None = None, anonymous_pull: bool = False,
                 access: AccessPolicy | None = None, service: str = "ncclguard-test-registry",
                 issuer: str = "ncclguard-test-token-service", token_expires_in: int = 300,
                 startup_timeout: float = 15.0) -> None:
        if auth not in (None, "basic", "token"):
            raise ValueError(f"auth={auth!r}: want None, 'basic' or 'token'")
        self.directory = Path(directory)
        self.auth = auth
        self.users = dict(users or {})
        self.anonymous_pull = anonymous_pull
        self.access = access
        self.service = service
        self.issuer = issuer
        self.token_expires_in = token_expires_in
        self.startup_timeout = startup_timeout
        self.admin = (f"harness-admin-{secrets.token_hex(4)}", secrets.token_urlsafe(18))
        self.storage_dir = self.directory / "storage"
        self.config_path = self.directory / "config.yml"
        self.log_path = self.directory / "registry.log"
        self.port = 0
        self.token_service: TokenService | None = None
        self._proc: subprocess.Popen[bytes] | None = None
        self._log: IO[bytes] | None = None
        self._tokens: dict[str, str] = {}

    @property
    def host(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def url(self) -> str:
        return f"http://{self.host}"

    @property
    def token_requests(self) -> list[TokenRequest]:
        return self.token_service.requests if self.token_service is not None else []

    @property
    def push_creds(self) -> tuple[str, str] | None:
        """What the harness pushes with: None without auth, else ``admin``."""
        return None if self.auth is None else self.admin

    # -- lifetime --

    def __enter__(self) -> Registry:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self) -> Registry:
        exe = _program(REGISTRY_PROGRAM, "docker-registry")
        self.directory.mkdir(parents=True, exist_ok=True)
        self.storage_dir.mkdir(exist_ok=True)
        try:
            if self.auth == "token":
                key = signing_key()
                (self.directory / "token-ca.pem").write_bytes(key.cert_pem)
                self.token_service = TokenService(
                    users=self.users, admin=self.admin, service=self.service,
                    issuer=self.issuer, key=key, anonymous_pull=self.anonymous_pull,
                    expires_in=self.token_expires_in, access=self.access).start()
            elif self.auth == "basic":
                lines = [_htpasswd_line(u, p) for u, p in [*self.users.items(), self.admin]]
                (self.directory / "htpasswd").write_text("\n".join(lines) + "\n")
            for attempt in range(3):  # a free port taken before the registry binds it
                self.port = _free_port()
                self._write_config()
                if self._spawn(exe, last=attempt == 2):
                    return self
        except BaseException:
            self.stop()
            raise
        raise AssertionError("unreachable")

    def _write_config(self) -> None:
        config: dict[str, Any] = {
            "version": "0.1",
            "log": {"level": "info", "formatter": "text", "accesslog": {"disabled": False}},
            "storage": {"filesystem": {"rootdirectory": str(self.storage_dir)},
                        "delete": {"enabled": True},
                        "maintenance": {"uploadpurging": {"enabled": False}}},
            "http": {"addr": self.host, "secret": secrets.token_hex(16)},
        }  # fmt: skip
        if self.auth == "basic":
            config["auth"] = {"htpasswd": {"realm": "ncclguard-test",
                                           "path": str(self.directory / "htpasswd")}}
        elif self.auth == "token":
            assert self.token_service is not None
            config["auth"] = {"token": {
                "realm": self.token_service.url, "service": self.service,
                "issuer": self.issuer,
                "rootcertbundle": str(self.directory / "token-ca.pem")}}  # fmt: skip
        # JSON is YAML
        self.config_path.write_text(json.dumps(config, indent=2) + "\n")

    def _spawn(self, exe: str, last: bool) -> bool:
        """Start and wait for ``GET /v2/``; False: the port was taken (try another)."""
        self._log = open(self.log_path, "ab")  # noqa: SIM115 (closed by stop)
        self._proc = subprocess.Popen([exe, "serve", str(self.config_path)],
                                      stdin=subprocess.DEVNULL, stdout=self._log,
                                      stderr=subprocess.STDOUT, env=_clean_env(),
                                      cwd=self.directory)  # fmt: skip
        end = time.monotonic() + self.startup_timeout
        while True:
            code = self._proc.poll()
            if code is not None:
                tail = _tail(self.log_path)
                self._stop_process()
                if "address already in use" in tail and not last:
                    return False
                raise RegistryError(f"docker-registry exited ({code}) "
                                    f"before answering; {self.log_path}:\n{tail}")
            try:
                if http("GET", f"{self.url}/v2/", timeout=1.0).status in (200, 401):
                    return True
            except OSError:
                pass
            if time.monotonic() > end:
                self._stop_process()
                raise RegistryError(f"docker-registry did not answer GET /v2/ on {self.host} "
                                    f"within {self.startup_timeout:g} s; {self.log_path}:\n"
                                    f"{_tail(self.log_path)}")
            time.sleep(0.05)

    def _stop_process(self) -> None:
        p, self._proc = self._proc, None
        if p is not None and p.poll() is None:
            p.terminate()
            try:
                p.wait(timeout=5)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(timeout=10)
        if self._log is not None:
            self._log.close()
            self._log = None

    def stop(self) -> None:
        try:
            self._stop_process()
        finally:
            if self.token_service is not None:
                self.token_service.stop()

    def log_tail(self, lines: int = 40) -> str:
        return _tail(self.log_path, lines)

    # -- requests as the harness (admin) --

    def admin_token(self, scope: str) -> str:
        """A token for ``scope`` ("repository:REPO:pull,push") issued to the harness."""
        assert self.token_service is not None, "auth='token' only"
        if scope not in self._tokens:
            q = urllib.parse.urlencode({"service": self.service, "scope": scope})
            r = http("GET", f"{self.token_service.url}?{q}",
                     headers={"Authorization": basic_header(*self.admin)})
            assert r.status == 200, (r.status, r.body)
            self._tokens[scope] = r.json()["token"]
        return str(self._tokens[scope])

    def request(self, method: str, path: str, data: bytes | None = None,
                headers: Mapping[str, str] | None = None, *, as_admin: bool = True,
                timeout: float = 60.0) -> Response:
        """A request to the registry (``path`` from /v2/..., or a whole URL); with
        ``as_admin`` it answers a 401's challenge (basic or bearer) as the harness."""
        url = path if path.startswith("http") else self.url + path
        hdrs = dict(headers or {})
        if as_admin and self.auth == "basic":
            hdrs["Authorization"] = basic_header(*self.admin)
        r = http(method, url, data, hdrs, timeout)
        if r.status == 401 and as_admin and self.auth == "token":
            scheme, params = parse_challenge(r.headers.get("WWW-Authenticate", ""))
            if scheme == "bearer":
                hdrs["Authorization"] = "Bearer " + self.admin_token(params.get("scope", ""))
                r = http(method, url, data, hdrs, timeout)
        return r


# --- layers ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class File:
    """A regular file: ``content`` bytes, or a path whose content is streamed in."""

    path: str
    content: bytes | Path = b""
    mode: int = 0o644
    uid: int = 0
    gid: int = 0
    mtime: int = 0


@dataclass(frozen=True)
class Dir:
    path: str
    mode: int = 0o755
    uid: int = 0
    gid: int = 0
    mtime: int = 0


@dataclass(frozen=True)
class Symlink:
    path: str
    target: str
    mtime: int = 0


@dataclass(frozen=True)
class Hardlink:
    path: str
    target: str  # the path of the earlier entry in the archive


@dataclass(frozen=True)
class Whiteout:
    """Deletes ``path`` of the layers below: an empty ``DIR/.wh.NAME``."""

    path: str


@dataclass(frozen=True)
class Opaque:
    """Hides what the layers below hold in directory ``path``: ``path/.wh..wh..opq``."""

    path: str


@dataclass(frozen=True)
class Raw:
    """Any tar member as given (a device, a fifo, a hostile name or size)."""

    info: tarfile.TarInfo
    content: bytes | None = None


Entry = File | Dir | Symlink | Hardlink | Whiteout | Opaque | Raw


class Layer(bytes):
    """A layer blob (it is the bytes) that knows its ``diff_id`` (the SHA-256 of the
    uncompressed tar), its ``compression`` and its ``media_type``."""

    diff_id: str
    compression: Compression
    media_type: str

    def __new__(cls, data: bytes, diff_id: str, compression: Compression) -> Layer:
        self = super().__new__(cls, data)
        self.diff_id = diff_id
        self.compression = compression
        self.media_type = MEDIA_TYPES[compression]
        return self

    @property
    def digest(self) -> str:
        return sha256_digest(self)


class _HashingWriter(io.RawIOBase):
    """Hashes what passes through on its way to ``sink``."""

    def __init__(self, sink: IO[bytes]) -> None:
        self.sink = sink
        self.hash = hashlib.sha256()

    def writable(self) -> bool:
        return True

    def write(self, b: Any) -> int:
        data = bytes(b)
        self.hash.update(data)
        self.sink.write(data)
        return len(data)


def _member(name: str, kind: bytes, mode: int, mtime: int, uid: int = 0,
            gid: int = 0) -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.type = kind
    info.mode = mode
    info.mtime = mtime
    info.uid, info.gid = uid, gid
    info.uname = info.gname = "root" if uid == 0 else ""
    return info


def _whiteout_name(path: str, base: str) -> str:
    parent, _, _name = path.rstrip("/").rpartition("/")
    return f"{parent}/{base}" if parent else base


def _write_entries(tar: tarfile.TarFile, entries: Sequence[Entry]) -> None:
    for e in entries:
        if isinstance(e, File):
            info = _member(e.path, tarfile.REGTYPE, e.mode, e.mtime, e.uid, e.gid)
            if isinstance(e.content, Path):
                with open(e.content, "rb") as f:
                    info.size = os.fstat(f.fileno()).st_size
                    tar.addfile(info, f)
            else:
                info.size = len(e.content)
                tar.addfile(info, io.BytesIO(e.content))
        elif isinstance(e, Dir):
            tar.addfile(_member(e.path.rstrip("/") + "/", tarfile.DIRTYPE, e.mode, e.mtime,
                                e.uid, e.gid))  # fmt: skip
        elif isinstance(e, Symlink):
            info = _member(e.path, tarfile.SYMTYPE, 0o777, e.mtime)
            info.linkname = e.target
            tar.addfile(info)
        elif isinstance(e, Hardlink):
            info = _member(e.path, tarfile.LNKTYPE, 0o644, 0)
            info.linkname = e.target
            tar.addfile(info)
        elif isinstance(e, Whiteout):
            name = e.path.rstrip("/").rpartition("/")[2]
            tar.addfile(_member(_whiteout_name(e.path, ".wh." + name), tarfile.REGTYPE,
                                0o644, 0))  # fmt: skip
        elif isinstance(e, Opaque):
            tar.addfile(_member(e.path.rstrip("/") + "/.wh..wh..opq", tarfile.REGTYPE,
                                0o644, 0))  # fmt: skip
        elif isinstance(e, Raw):
            tar.addfile(e.info, io.BytesIO(e.content) if e.content is not None else None)
        else:
            raise TypeError(f"not a layer entry: {e!r}")


def layer_tar(entries: Sequence[Entry], compression: Compression = "gzip", *,
              level: int | None = None) -> Layer:
    """A layer blob of ``entries`` (in that order; names as given, "../x" too), gzip
    (deterministic: no name, mtime 0), zstd or uncompressed; the tar stream is hashed
    (``diff_id``) and compressed as it is written, so a file given as a path is never
    read whole into memory (the compressed blob is)."""
    if compression not in MEDIA_TYPES:
        raise ValueError(f"compression={compression!r}: want gzip, zstd or none")
    out = io.BytesIO()
    compressor: Any
    if compression == "gzip":
        compressor = gzip.GzipFile(filename="", mode="wb", fileobj=out, mtime=0,
                                   compresslevel=6 if level is None else level)
    elif compression == "zstd":
        import zstandard

        compressor = zstandard.ZstdCompressor(level=3 if level is None else level
                                              ).stream_writer(out, closefd=False)
    else:
        compressor = out
    sink = _HashingWriter(compressor)
    with tarfile.open(fileobj=sink, mode="w|", format=tarfile.PAX_FORMAT) as tar:
        _write_entries(tar, entries)
    if compressor is not out:
        compressor.close()  # the gzip trailer, the zstd frame's end (out stays open)
    return Layer(out.getvalue(), "sha256:" + sink.hash.hexdigest(), compression)


def describe_blob(blob: bytes) -> tuple[str, str]:
    """(media type, diff_id) of a layer blob: a :class:`Layer` knows them; other bytes
    are told by their magic (gzip, zstd, else tar) and decompressed, streaming, to hash."""
    if isinstance(blob, Layer):
        return blob.media_type, blob.diff_id
    h = hashlib.sha256()
    reader: Any
    if blob[:2] == b"\x1f\x8b":
        media, reader = LAYER_GZIP, gzip.GzipFile(fileobj=io.BytesIO(blob), mode="rb")
    elif blob[:4] == b"\x28\xb5\x2f\xfd":
        import zstandard

        media = LAYER_ZSTD
        reader = zstandard.ZstdDecompressor().stream_reader(io.BytesIO(blob),
                                                            read_across_frames=True)
    else:
        return LAYER_TAR, sha256_digest(blob)
    with reader:
        while chunk := reader.read(_CHUNK):
            h.update(chunk)
    return media, "sha256:" + h.hexdigest()


# --- images: an OCI layout, pushed ---------------------------------------------------------


def _platform_fields(platform: Platform) -> dict[str, str]:
    out = {"os": platform[0], "architecture": platform[1]}
    if len(platform) > 2:
        out["variant"] = platform[2]
    return out


@dataclass
class Blob:
    media_type: str
    data: bytes
    digest: str = ""

    def __post_init__(self) -> None:
        self.digest = self.digest or sha256_digest(self.data)

    def descriptor(self, **extra: Any) -> dict[str, Any]:
        return {"mediaType": self.media_type, "digest": self.digest,
                "size": len(self.data), **extra}


def image_blobs(layers: Sequence[bytes], env: Sequence[str] = (),
                platform: Platform = ("linux", "amd64"), *,
                media_types: Sequence[str] | None = None,
                diff_ids: Sequence[str] | None = None,
                config: bytes | None = None) -> tuple[Blob, Blob, list[Blob]]:
    """(manifest, config, layers) of one OCI image: the config's ``rootfs.diff_ids`` and
    ``config.Env`` and the platform; ``media_types``/``diff_ids``/``config`` as given where
    given (hostile images)."""
    described = [describe_blob(b) if media_types is None or diff_ids is None else ("", "")
                 for b in layers]  # fmt: skip
    mtypes = list(media_types) if media_types is not None else [m for m, _ in described]
    dids = list(diff_ids) if diff_ids is not None else [d for _, d in described]
    if not len(mtypes) == len(dids) == len(layers):
        raise ValueError("one media type and one diff_id per layer")
    if config is None:
        config = _canonical({
            **_platform_fields(platform),
            "created": "2024-01-01T00:00:00Z",
            "config": {"Env": list(env)},
            "rootfs": {"type": "layers", "diff_ids": dids},
            "history": [{"created": "2024-01-01T00:00:00Z", "created_by": "ncclguard tests"}
                        for _ in layers],
        })  # fmt: skip
    cfg = Blob(OCI_CONFIG, config)
    lbs = [Blob(m, bytes(b)) for m, b in zip(mtypes, layers, strict=True)]
    manifest = Blob(OCI_MANIFEST, _canonical({
        "schemaVersion": 2, "mediaType": OCI_MANIFEST, "config": cfg.descriptor(),
        "layers": [b.descriptor() for b in lbs]}))  # fmt: skip
    return manifest, cfg, lbs


def write_oci_layout(directory: Path, tag: str, blobs: Sequence[Blob], top: Blob) -> Path:
    """An OCI image layout in ``directory``: ``blobs`` and ``top`` under blobs/sha256/,
    index.json naming ``top`` (a manifest or an index) by ``tag``."""
    bdir = directory / "blobs" / "sha256"
    bdir.mkdir(parents=True, exist_ok=True)
    (directory / "oci-layout").write_text('{"imageLayoutVersion":"1.0.0"}')
    for b in [*blobs, top]:
        (bdir / b.digest.split(":", 1)[1]).write_bytes(b.data)
    index = {"schemaVersion": 2, "mediaType": OCI_INDEX,
             "manifests": [top.descriptor(annotations={"org.opencontainers.image.ref.name":
                                                        tag})]}  # fmt: skip
    (directory / "index.json").write_bytes(_canonical(index))
    return directory


def _work_dir(registry: Registry, what: str) -> Path:
    d = registry.directory / "pushes" / f"{what}-{secrets.token_hex(6)}"
    d.mkdir(parents=True)
    return d


def skopeo_copy(registry: Registry, layout: Path, tag: str, repo: str, *,
                all_images: bool = False, creds: tuple[str, str] | None = None,
                work: Path, timeout: float = 300.0) -> None:
    """``skopeo copy --preserve-digests oci:LAYOUT:TAG docker://HOST/REPO:TAG``, its policy,
    registries.conf, auth file and temporary files in ``work``."""
    exe = _program(SKOPEO_PROGRAM, "skopeo")
    tmp = work / "skopeo-tmp"
    tmp.mkdir(exist_ok=True)
    policy = work / "policy.json"
    policy.write_text('{"default":[{"type":"insecureAcceptAnything"}]}')
    (work / "registries.conf").write_text("")
    (work / "registries.d").mkdir(exist_ok=True)
    (work / "auth.json").write_text('{"auths":{}}')
    argv = [exe, "--policy", str(policy), "--registries.d", str(work / "registries.d"),
            "--tmpdir", str(tmp), "copy", "--quiet", "--preserve-digests",
            "--dest-tls-verify=false", "--dest-authfile", str(work / "auth.json")]
    if all_images:
        argv.append("--all")
    creds = creds if creds is not None else registry.push_creds
    if creds is not None:
        argv += ["--dest-creds", f"{creds[0]}:{creds[1]}"]
    argv += [f"oci:{layout}:{tag}", f"docker://{registry.host}/{repo}:{tag}"]
    # c/image keeps a blob-info cache, as root in /var/lib/containers/cache; an euid it is
    # told is not 0 puts it under $XDG_DATA_HOME instead: the work directory, thrown away
    env = _clean_env({"TMPDIR": str(tmp), "HOME": str(work), "XDG_DATA_HOME": str(work),
                      "XDG_CONFIG_HOME": str(work), "XDG_RUNTIME_DIR": str(tmp),
                      "_CONTAINERS_ROOTLESS_UID": str(os.geteuid() or 1),
                      "CONTAINERS_REGISTRIES_CONF": str(work / "registries.conf"),
                      "REGISTRY_AUTH_FILE": str(work / "auth.json")})  # fmt: skip
    r = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, env=env,
                       stdin=subprocess.DEVNULL)  # fmt: skip
    if r.returncode != 0:
        raise RegistryError(f"skopeo copy to {registry.host}/{repo}:{tag} failed "
                            f"({r.returncode}): {r.stderr.strip()}\nregistry log:\n"
                            f"{registry.log_tail(15)}")


def nccl_layer(version: str) -> Layer:
    """A zstd layer holding a real libnccl of ``version`` where pip puts it."""
    return layer_tar([File("/usr/local/lib/python3.10/dist-packages/nvidia/nccl/lib/"
                           "libnccl.so.2", extract_nccl(version))], "zstd", level=1)


def push_image(registry: Registry, repo: str, tag: str, layers: Sequence[bytes],
               env: Sequence[str] = (), platform: Platform = ("linux", "amd64"),
               creds: tuple[str, str] | None = None, *,
               via: Literal["skopeo", "http"] = "skopeo") -> str:
    """Push an OCI image of ``layers`` (bottom first) to ``repo:tag``; returns the manifest
    digest. ``via="skopeo"``: an OCI layout written here, ``skopeo copy
    --preserve-digests`` (zstd and uncompressed layers go as they are); ``via="http"``:
    the registry's HTTP API. ``creds``: skopeo's (default: the harness's, when auth is
    on). The same tag again moves it."""
    manifest, cfg, lbs = image_blobs(layers, env, platform)
    if via == "http":
        for b in [cfg, *lbs]:
            push_blob(registry, repo, b.data)
        got = push_manifest(registry, repo, tag, manifest.data, manifest.media_type)
    else:
        work = _work_dir(registry, "image")
        try:
            write_oci_layout(work / "layout", tag, [cfg, *lbs], manifest)
            skopeo_copy(registry, work / "layout", tag, repo, creds=creds, work=work)
        finally:
            shutil.rmtree(work, ignore_errors=True)
        got = _pushed_digest(registry, repo, tag)
    if got != manifest.digest:
        raise RegistryError(f"{repo}:{tag} is {got}, not the manifest written ("
                            f"{manifest.digest})")
    return manifest.digest


def push_index(registry: Registry, repo: str, tag: str,
               images: Mapping[Platform, Sequence[bytes]], env: Sequence[str] = (),
               creds: tuple[str, str] | None = None, *,
               via: Literal["skopeo", "http"] = "skopeo") -> tuple[str, dict[Platform, str]]:
    """A multi-arch OCI image index at ``repo:tag``, one image per platform
    (``{("linux", "amd64"): [layers], ("linux", "arm64"): [layers]}``); returns
    (index digest, {platform: manifest digest})."""
    blobs: list[Blob] = []
    manifests: list[tuple[Platform, Blob]] = []
    for platform, layers in images.items():
        manifest, cfg, lbs = image_blobs(layers, env, platform)
        blobs += [cfg, *lbs, manifest]
        manifests.append((platform, manifest))
    index = Blob(OCI_INDEX, _canonical({
        "schemaVersion": 2, "mediaType": OCI_INDEX,
        "manifests": [m.descriptor(platform=_platform_fields(p)) for p, m in manifests]}))
    if via == "http":
        for b in blobs:
            if b.media_type == OCI_MANIFEST:
                push_manifest(registry, repo, b.digest, b.data, b.media_type)
            else:
                push_blob(registry, repo, b.data)
        got = push_manifest(registry, repo, tag, index.data, index.media_type)
    else:
        work = _work_dir(registry, "index")
        try:
            write_oci_layout(work / "layout", tag, blobs, index)
            skopeo_copy(registry, work / "layout", tag, repo, all_images=True, creds=creds,
                        work=work)  # fmt: skip
        finally:
            shutil.rmtree(work, ignore_errors=True)
        got = _pushed_digest(registry, repo, tag)
    if got != index.digest:
        raise RegistryError(f"{repo}:{tag} is {got}, not the index written ({index.digest})")
    return index.digest, {p: m.digest for p, m in manifests}


def push_raw(registry: Registry, repo: str, tag: str, layer_blobs: Sequence[bytes],
             media_types: Sequence[str], diff_ids: Sequence[str], *, env: Sequence[str] = (),
             platform: Platform = ("linux", "amd64"), config: bytes | None = None) -> str:
    """An image of exactly these blobs, media types and diff_ids (a corrupt gzip, a zstd
    blob called gzip, diff_ids that are wrong), by the HTTP API; returns the manifest
    digest. (A blob whose bytes do not match its digest cannot be pushed: the registry
    checks.)"""
    manifest, cfg, lbs = image_blobs(layer_blobs, env, platform, media_types=media_types,
                                     diff_ids=diff_ids, config=config)  # fmt: skip
    for b in [cfg, *lbs]:
        push_blob(registry, repo, b.data)
    return push_manifest(registry, repo, tag, manifest.data, manifest.media_type)


def push_blob(registry: Registry, repo: str, data: bytes) -> str:
    """One blob by the HTTP API (monolithic: POST then PUT ?digest=); returns its digest."""
    digest = sha256_digest(data)
    if registry.request("HEAD", f"/v2/{repo}/blobs/{digest}").status == 200:
        return digest
    r = registry.request("POST", f"/v2/{repo}/blobs/uploads/", b"",
                         {"Content-Length": "0"})
    if r.status != 202:
        raise RegistryError(f"POST blobs/uploads/ to {repo}: {r.status} {r.body[:300]!r}")
    loc = urllib.parse.urljoin(registry.url + "/", r.headers["Location"])
    sep = "&" if "?" in loc else "?"
    r = registry.request("PUT", f"{loc}{sep}digest={urllib.parse.quote(digest)}", data,
                         {"Content-Type": "application/octet-stream",
                          "Content-Length": str(len(data))})  # fmt: skip
    if r.status != 201:
        raise RegistryError(f"PUT blob {digest} to {repo}: {r.status} {r.body[:300]!r}")
    return digest


def push_manifest(registry: Registry, repo: str, reference: str, body: bytes,
                  media_type: str = OCI_MANIFEST) -> str:
    """PUT a manifest (or an index) as these bytes; returns the registry's digest of it."""
    r = registry.request("PUT", f"/v2/{repo}/manifests/{reference}", body,
                         {"Content-Type": media_type})
    if r.status != 201:
        raise RegistryError(f"PUT manifest {repo}:{reference}: {r.status} {r.body[:500]!r}")
    return str(r.headers.get("Docker-Content-Digest") or sha256_digest(body))


def _pushed_digest(registry: Registry, repo: str, ref: str) -> str:
    r = registry.request("HEAD", f"/v2/{repo}/manifests/{ref}", headers={
        "Accept": MANIFEST_ACCEPT})  # fmt: skip
    if r.status != 200:
        raise RegistryError(f"HEAD {repo}:{ref} after the push: {r.status}")
    return str(r.headers.get("Docker-Content-Digest"))


# --- a server that hangs ---------------------------------------------------------------------


class HangingServer:
    """A loopback TCP server in threads, for a client's time bounds.

    - ``"accept-and-silence"``: accepts, reads what comes, never answers;
    - ``"slow-body"``: reads the request head, answers ``200`` with ``Content-Length:
      content_length`` (and ``headers``), then sends the body one byte right away and one
      every ``interval`` seconds.

    ``host`` is "127.0.0.1:PORT", ``url`` "http://127.0.0.1:PORT"; ``connections`` counts
    the connections accepted, ``requests`` holds the request heads read."""

    def __init__(self, mode: Literal["accept-and-silence", "slow-body"], *,
                 interval: float = 2.0, content_length: int = 1_000_000,
                 headers: Mapping[str, str] | None = None) -> None:
        if mode not in ("accept-and-silence", "slow-body"):
            raise ValueError(f"mode={mode!r}")
        self.mode = mode
        self.interval = interval
        self.content_length = content_length
        self.headers = dict(headers or {"Content-Type": "application/octet-stream"})
        self.connections = 0
        self.requests: list[bytes] = []
        self.bytes_sent = 0
        self._stop = threading.Event()
        self._sock: socket.socket | None = None
        self._threads: list[threading.Thread] = []
        self._conns: list[socket.socket] = []
        self._lock = threading.Lock()
        self.port = 0

    @property
    def host(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def url(self) -> str:
        return f"http://{self.host}"

    def __enter__(self) -> HangingServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self) -> HangingServer:
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind(("127.0.0.1", 0))
        self._sock.listen(64)
        self._sock.settimeout(0.05)
        self.port = self._sock.getsockname()[1]
        self._spawn(self._accept_loop, "hanging-accept")
        return self

    def _spawn(self, target: Callable[..., None], name: str, *args: Any) -> None:
        t = threading.Thread(target=target, args=args, name=name, daemon=True)
        with self._lock:
            self._threads.append(t)
        t.start()

    def _accept_loop(self) -> None:
        assert self._sock is not None
        while not self._stop.is_set():
            try:
                conn, _ = self._sock.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            with self._lock:
                self.connections += 1
                self._conns.append(conn)
            self._spawn(self._serve, "hanging-conn", conn)

    def _read_head(self, conn: socket.socket) -> bytes | None:
        conn.settimeout(0.05)
        buf = b""
        while not self._stop.is_set() and b"\r\n\r\n" not in buf and len(buf) < 65536:
            try:
                chunk = conn.recv(4096)
            except TimeoutError:
                continue
            except OSError:
                return None
            if not chunk:
                return None
            buf += chunk
        return buf if b"\r\n\r\n" in buf else None

    def _serve(self, conn: socket.socket) -> None:
        try:
            head = self._read_head(conn)
            if head is not None:
                self.requests.append(head)
            if self.mode == "accept-and-silence" or head is None:
                self._stop.wait()
                return
            lines = ["HTTP/1.1 200 OK", f"Content-Length: {self.content_length}",
                     *(f"{k}: {v}" for k, v in self.headers.items())]  # fmt: skip
            conn.sendall(("\r\n".join(lines) + "\r\n\r\n").encode())
            for _ in range(self.content_length):
                conn.sendall(b"x")
                self.bytes_sent += 1
                if self._stop.wait(self.interval):
                    return
        except OSError:
            return
        finally:
            conn.close()

    def stop(self) -> None:
        self._stop.set()
        if self._sock is not None:
            self._sock.close()
        with self._lock:
            threads, conns = list(self._threads), list(self._conns)
        for c in conns:
            with contextlib.suppress(OSError):
                c.shutdown(socket.SHUT_RDWR)
        for t in threads:
            t.join(timeout=5)
