"""Read a registry image, read-only, through the OCI distribution API (docs/containers.md,
"Registry images").

:func:`read_image` resolves a reference (:mod:`ncclguard.fingerprint.imageref`) to the
manifest of the nodes' platform (an index or manifest list: the first entry of that
architecture, as enroot v4.1.2 picks it), reads its config and its layers
(:mod:`.layers`; a layer already summarised is not downloaded again) and returns the image
record, the same fingerprint as a squashfs image's.

Access as enroot's: anonymous, HTTP basic, and the distribution spec's bearer-token flow
(``WWW-Authenticate: Bearer realm=..,service=..,scope=..``; the realm asked with the
credentials of its own host, the token taken from ``token``, else ``access_token``). The
credentials are enroot's ``.credentials`` file (netrc: ``machine HOST login USER password
PASS``), never run through a shell. Every request has the image's deadline; every body
its bound; every manifest and blob is checked against its digest. A registry that cannot
be reached, refuses, or answers with something else is a :class:`RegistryError` whose
``state`` names which, never a hang.

Over 500 lines: the credentials, the HTTP client with its auth flows and deadline, and
the reading of one image share one Client and its bounds; each part alone is the
distribution API only half.
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import http.client
import json
import os
import platform as platform_mod
import re
import socket
import ssl
import stat
import threading
import time
import urllib.parse
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from inventoryd.controller.images.fingerprint import SCHEMA, read_tree
from inventoryd.controller.images.layers import LAYER_TYPES, LayeredImage, read_layer, summary_ok
from inventoryd.controller.images.tree import ImageError, ImageTransient
from ncclguard.fingerprint.imageref import Reference

OCI_INDEX = "application/vnd.oci.image.index.v1+json"
OCI_MANIFEST = "application/vnd.oci.image.manifest.v1+json"
DOCKER_LIST = "application/vnd.docker.distribution.manifest.list.v2+json"
DOCKER_MANIFEST = "application/vnd.docker.distribution.manifest.v2+json"
INDEXES = (OCI_INDEX, DOCKER_LIST)
MANIFESTS = (OCI_MANIFEST, DOCKER_MANIFEST)
MAX_MANIFEST = 4 << 20  # bytes of one manifest or index (the distribution spec's own bound)
MAX_CONFIG = 8 << 20  # bytes of an image config
MAX_TOKEN = 1 << 20
MAX_LAYERS = 256
MAX_IMAGE_KEPT_BYTES = 64 << 20  # bytes of paths the summaries of one image keep, in all
MAX_IMAGE_KEPT = 500_000  # entries the summaries of one image keep, in all
MAX_REDIRECTS = 5
USER_AGENT = "ncclguard-collector"

#: the states a resolution can end in (``registry_tags.state``)
STATES = ("ok", "unreachable", "refused", "not-found", "invalid", "timeout")

_DIGEST = re.compile(r"sha256:[0-9a-f]{64}")
_ARCH = {"x86_64": "amd64", "aarch64": "arm64", "ppc64le": "ppc64le"}  # enroot's debarch


def default_platform() -> str:
    """``linux/ARCH`` of this machine, named as image indexes name it (enroot's mapping)."""
    m = platform_mod.machine()
    return f"linux/{_ARCH.get(m, m)}"


class RegistryError(Exception):
    """A reference that could not be resolved or read: ``state`` (one of :data:`STATES`)
    and the cause; the message names the reference."""

    def __init__(self, ref: str, state: str, cause: str) -> None:
        super().__init__(f"{ref}: {cause}")
        self.ref, self.state, self.cause = ref, state, cause


# --------------------------------------------------------------------- credentials


@dataclass
class Credentials:
    """enroot's ``.credentials`` (netrc): host -> (login, password)."""

    hosts: dict[str, tuple[str, str]] = field(default_factory=dict)
    source: str = ""

    def get(self, host: str) -> tuple[str, str] | None:
        """The line of ``host`` (its port aside), else the ``default`` line (curl's)."""
        return self.hosts.get(_bare(host)) or self.hosts.get(DEFAULT)


def _bare(host: str) -> str:
    """``host`` without its port."""
    return host.rsplit(":", 1)[0] if _has_port(host) else host


def _has_port(host: str) -> bool:
    return bool(re.fullmatch(r".+:[0-9]+", host)) and not host.startswith("[")


MAX_CREDENTIALS = 1 << 20


#: the host ``default`` (curl's, enroot's reader's) gives credentials for
DEFAULT = ""


def _tokens(text: str) -> list[str]:
    """netrc's tokens as curl and Python's ``netrc`` read them: white space between them,
    ``"..."`` quoted with backslash escapes, a ``#`` starting a token comments out the rest
    of the line, a ``macdef`` body runs to the next empty line."""
    out: list[str] = []
    i, n = 0, len(text)
    while i < n:
        c = text[i]
        if c.isspace():
            i += 1
        elif c == "#":
            i = text.find("\n", i)
            i = n if i < 0 else i
        elif c == '"':
            tok, i = [], i + 1
            while i < n and text[i] != '"':
                if text[i] == "\\" and i + 1 < n:
                    i += 1
                tok.append(text[i])
                i += 1
            if i >= n:
                raise ValueError("a quoted token without its closing quote")
            out.append("".join(tok))
            i += 1
        else:
            j = i
            while j < n and not text[j].isspace():
                j += 1
            out.append(text[i:j])
            if text[i:j] == "macdef":  # its name, then its body up to an empty line
                end = text.find("\n\n", j)
                name = text[j:end if end >= 0 else n].split(None, 1)
                out.append(name[0] if name else "")
                j = n if end < 0 else end + 2
            i = j
    return out


def _netrc(text: str) -> dict[str, tuple[str, str]]:
    """host -> (login, password) of netrc text (``machine``, ``login``, ``password``,
    ``account``, ``default`` under the host :data:`DEFAULT`, ``macdef`` skipped;
    comments and quoted tokens as :func:`_tokens`); the first entry of a host wins, as
    curl's."""
    tokens = _tokens(text)
    out: dict[str, tuple[str, str]] = {}
    i, host, login, password = 0, None, "", ""

    def done() -> None:
        if host is not None and host not in out:
            out[host] = (login, password)
    while i < len(tokens):
        t = tokens[i]
        if t in ("machine", "default"):
            done()
            if t == "machine" and i + 1 >= len(tokens):
                raise ValueError("machine without a host")
            host = tokens[i + 1] if t == "machine" else DEFAULT
            login, password = "", ""
            i += 2 if t == "machine" else 1
        elif t in ("login", "password", "account"):
            if i + 1 >= len(tokens):
                raise ValueError(f"{t} without a value")
            if t == "login":
                login = tokens[i + 1]
            elif t == "password":
                password = tokens[i + 1]
            i += 2
        elif t == "macdef":
            done()
            host = None
            i += 2
        else:
            raise ValueError(f"unexpected token {t[:40]!r}")
    done()
    return out


def load_credentials(path: str, env: Mapping[str, str] | None = None) -> Credentials:
    """The credentials file at ``path`` ("": none). A password written ``$NAME`` or
    ``${NAME}`` is taken from ``env`` (the collector's environment), as enroot's shell
    would; anything else that starts with ``$`` (a command) is refused, never run. The
    file must be owned by root or by this user and writable by no one else: it says
    where the collector sends secrets. Raises ValueError naming the file and the cause."""
    if not path:
        return Credentials()
    env = os.environ if env is None else env
    try:  # one open, no symlink followed: what is checked is what is read
        # O_NONBLOCK: a FIFO there must not block the worker for good (it is refused
        # below as not a regular file); a regular file reads as ever
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
    except OSError as e:
        raise ValueError(f"{path}: {e.strerror or e} (a symlink is not followed)") from None
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(f.fileno())
        if not stat.S_ISREG(st.st_mode):
            raise ValueError(f"{path}: not a regular file")
        if st.st_uid not in (0, os.geteuid()) or st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
            raise ValueError(f"{path}: must be owned by root or uid {os.geteuid()} and "
                             "writable by no one else (it holds the registries' secrets)")
        data = f.read(MAX_CREDENTIALS + 1)
    if len(data) > MAX_CREDENTIALS:
        raise ValueError(f"{path}: more than {MAX_CREDENTIALS} bytes")
    try:
        hosts = _netrc(data.decode())
    except (ValueError, UnicodeDecodeError) as e:
        raise ValueError(f"{path}: not a netrc file: {e}") from None
    out = Credentials(source=path)
    for host, (login, password) in hosts.items():
        if password.startswith("$"):
            m = re.fullmatch(r"\$(?:\{([A-Za-z_][A-Za-z0-9_]*)\}|([A-Za-z_][A-Za-z0-9_]*))",
                             password)
            if m is None:
                raise ValueError(f"{path}: machine {host}: a password starting with '$' "
                                 "other than $NAME or ${NAME} is a command, which is not run")
            password = env.get(m.group(1) or m.group(2), "")
        out.hosts[host] = (login or "", password)
    return out


# --------------------------------------------------------------------- HTTP


@dataclass
class Proxies:
    """The HTTP proxies as curl (enroot's client) takes them: ``proxy`` (``[registry]
    proxy``, curl's ``--proxy``) for every scheme, else ``https_proxy``/``HTTPS_PROXY``
    and ``http_proxy``/``HTTP_PROXY`` of the environment; ``no_proxy``/``NO_PROXY``: hosts
    (a domain's suffix, ``.`` or not; a port optional) and ``*`` reached directly. An
    ``http://[user:password@]host:port`` proxy only."""

    https: str = ""
    http: str = ""
    no_proxy: tuple[str, ...] = ()

    @classmethod
    def from_env(cls, proxy: str = "", env: Mapping[str, str] | None = None) -> Proxies:
        env = os.environ if env is None else env

        def var(name: str) -> str:
            return env.get(name.lower()) or env.get(name.upper()) or ""
        no = tuple(h.strip().lower() for h in var("no_proxy").split(",") if h.strip())
        return cls(proxy or var("https_proxy"), proxy or var("http_proxy"), no)

    def url_for(self, scheme: str, netloc: str) -> tuple[str, dict[str, str]] | None:
        """(proxy host:port, its Proxy-Authorization header) for a request to
        ``netloc``, or None: directly. Raises ValueError for a proxy it cannot use."""
        url = self.https if scheme == "https" else self.http
        if not url or self._bypass(netloc):
            return None
        p = urllib.parse.urlsplit(url if "://" in url else f"http://{url}")
        if p.scheme != "http" or not p.hostname:
            raise ValueError(f"proxy {url[:200]!r}: only an http:// proxy is taken")
        where = f"{p.hostname}:{p.port or 1080}"
        auth = {}
        if p.username is not None:
            login = (urllib.parse.unquote(p.username), urllib.parse.unquote(p.password or ""))
            auth["Proxy-Authorization"] = _basic(login)
        return where, auth

    def _bypass(self, netloc: str) -> bool:
        host = _bare(netloc).strip("[]").lower()
        for entry in self.no_proxy:
            if entry == "*":
                return True
            name = _bare(entry).lstrip(".")
            if (name == host or host.endswith("." + name)) and (
                    not _has_port(entry) or entry == netloc.lower()):
                return True
        return False


@dataclass
class Response:
    status: int
    headers: http.client.HTTPMessage
    conn: http.client.HTTPConnection
    resp: http.client.HTTPResponse
    url: str

    def header(self, name: str) -> str:
        return str(self.headers.get(name) or "")

    def close(self) -> None:
        self.resp.close()
        self.conn.close()


class _Body:
    """A response body as a file-like read, its socket timeout the time left."""

    def __init__(self, r: Response, deadline: float, label: str) -> None:
        self.r, self.deadline, self.label = r, deadline, label

    def read(self, n: int = -1) -> bytes:
        left = self.deadline - time.monotonic()
        if left <= 0:
            raise ImageTransient(self.label, "time limit reached")
        sock = self.r.conn.sock
        if sock is not None:
            sock.settimeout(max(left, 0.05))
        try:
            # read1: one recv at most; read(n) would wait for n bytes whatever the deadline
            chunk = self.r.resp.read1(n if n and n > 0 else 1 << 20)
            if not chunk and time.monotonic() >= self.deadline:  # the watchdog shut it
                raise ImageTransient(self.label, "time limit reached")
            return chunk
        except TimeoutError:
            raise ImageTransient(self.label, "time limit reached (the registry stopped "
                                             "sending)") from None
        except (OSError, http.client.HTTPException, ValueError) as e:
            if time.monotonic() >= self.deadline:  # the watchdog shut it
                raise ImageTransient(self.label, "time limit reached") from None
            raise ImageTransient(self.label, f"the connection failed: {type(e).__name__}: "
                                             f"{e}") from None


class Client:
    """One registry, one deadline: requests with auth as enroot does (module docstring)."""

    def __init__(self, ref: Reference, *, deadline: float, credentials: Credentials,
                 insecure: tuple[str, ...] = (), ca_file: str = "",
                 token_realms: Mapping[str, tuple[str, ...]] | None = None,
                 proxy: Proxies | None = None) -> None:
        self.ref, self.deadline, self.creds = ref, deadline, credentials
        self.proxy = proxy or Proxies()
        #: the realm hosts that get this registry's credentials (besides its own host)
        own = _bare(ref.registry)
        realms = token_realms or {}
        self.realms = {own, *realms.get(ref.registry, ()), *realms.get(own, ())}
        self.scheme = "http" if ref.registry in insecure else "https"
        self.insecure = insecure
        self.ca_file = ca_file
        self._ssl: ssl.SSLContext | None = None  # made at the first https request (50 ms)
        self.auth: str | None = None  # the Authorization header that worked
        self.requests = 0
        # the deadline in wall-clock time, whatever a server sends and how slowly (a
        # header or a chunk-size line a byte a minute): a timer shuts the open sockets
        self._open_conns: list[http.client.HTTPConnection] = []
        self._watchdog = threading.Timer(max(deadline - time.monotonic(), 0.0), self._expire)
        self._watchdog.daemon = True
        self._watchdog.start()

    def ssl(self) -> ssl.SSLContext:
        """The TLS context (the system's CAs, and ``ca_file``'s): loading the system's
        CAs takes 50 ms, which a plain-HTTP registry never needs."""
        if self._ssl is None:
            try:
                self._ssl = ssl.create_default_context(cafile=self.ca_file or None)
            except (OSError, ValueError) as e:  # ssl.SSLError is an OSError
                raise self._fail("unreachable", f"registry.ca_file {self.ca_file!r}: "
                                                f"{getattr(e, 'strerror', None) or e}") from None
        return self._ssl

    def _expire(self) -> None:
        for conn in list(self._open_conns):
            sock = conn.sock
            if sock is not None:
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)

    def close(self) -> None:
        """Stop the watchdog and close what is still open."""
        self._watchdog.cancel()
        for conn in self._open_conns:
            conn.close()
        self._open_conns.clear()

    def _fail(self, state: str, cause: str) -> RegistryError:
        return RegistryError(self.ref.key, state, cause)

    def _left(self) -> float:
        left = self.deadline - time.monotonic()
        if left <= 0:
            raise self._fail("timeout", "time limit reached")
        return left

    def _open(self, method: str, url: str, headers: dict[str, str]) -> Response:
        """One request (redirects followed, at most MAX_REDIRECTS; the Authorization
        header is not sent to another host)."""
        origin = urllib.parse.urlsplit(url).netloc
        for _ in range(MAX_REDIRECTS + 1):
            parts = urllib.parse.urlsplit(url)
            if parts.scheme not in ("http", "https"):
                raise self._fail("invalid", f"a redirect to a {parts.scheme!r} URL")
            if parts.scheme == "http" and parts.netloc not in self.insecure:
                raise self._fail("invalid", f"plain HTTP to {parts.netloc}, which is not in "
                                            "registry.insecure")
            timeout = min(self._left(), 60.0)
            conn: http.client.HTTPConnection | None = None
            path = parts.path + (f"?{parts.query}" if parts.query else "")
            hdrs = {"User-Agent": USER_AGENT, **headers}
            if parts.netloc != origin:
                hdrs.pop("Authorization", None)
            self.requests += 1
            name = parts.netloc  # in messages: the registry, and the proxy it is asked by
            try:
                proxy = self.proxy.url_for(parts.scheme, parts.netloc)
                target = path or "/"
                if proxy is not None:  # as curl: CONNECT for https, absolute-form for http
                    where, auth = proxy
                    name = f"{parts.netloc} (through the proxy {where})"
                    if parts.scheme == "https":
                        conn = http.client.HTTPSConnection(where, timeout=timeout,
                                                           context=self.ssl())
                        conn.set_tunnel(parts.netloc, headers=auth)
                    else:
                        conn = http.client.HTTPConnection(where, timeout=timeout)
                        target = f"http://{parts.netloc}{target}"
                        hdrs.update(auth)
                elif parts.scheme == "https":
                    conn = http.client.HTTPSConnection(parts.netloc, timeout=timeout,
                                                       context=self.ssl())
                else:
                    conn = http.client.HTTPConnection(parts.netloc, timeout=timeout)
                self._open_conns.append(conn)
                conn.request(method, target, headers=hdrs)
                resp = conn.getresponse()
            except TimeoutError:
                _close(conn)
                raise self._fail("timeout", f"{name}: no answer within the time "
                                            "limit") from None
            except ssl.SSLError as e:
                _close(conn)
                raise self._fail("unreachable", f"{name}: TLS: {e.reason or e}") from None
            except (OSError, http.client.HTTPException, ValueError) as e:  # InvalidURL too
                _close(conn)
                if time.monotonic() >= self.deadline:  # the watchdog shut it
                    raise self._fail("timeout", f"{name}: time limit reached") from None
                raise self._fail("unreachable", f"{name}: {type(e).__name__}: "
                                                f"{getattr(e, 'strerror', None) or e}") from None
            r = Response(resp.status, resp.headers, conn, resp, url)
            if resp.status in (301, 302, 303, 307, 308) and r.header("Location"):
                url = urllib.parse.urljoin(url, r.header("Location"))
                r.close()
                continue
            return r
        raise self._fail("invalid", f"more than {MAX_REDIRECTS} redirects")

    def _body(self, r: Response, limit: int, what: str) -> bytes:
        length = r.header("Content-Length")
        if length.isdigit() and int(length) > limit:
            r.close()
            raise self._fail("invalid", f"{what}: {length} bytes, more than {limit}")
        body = _Body(r, self.deadline, self.ref.key)
        parts: list[bytes] = []
        total = 0
        try:
            while chunk := body.read(1 << 16):
                total += len(chunk)
                if total > limit:
                    raise self._fail("invalid", f"{what}: more than {limit} bytes")
                parts.append(chunk)
        except ImageError as e:
            raise self._fail("timeout" if "time limit" in e.cause else "unreachable",
                             f"{what}: {e.cause}") from None
        finally:
            r.close()
        return b"".join(parts)

    def _token(self, challenge: dict[str, str]) -> str:
        realm = challenge.get("realm", "")
        parts = urllib.parse.urlsplit(realm)
        if parts.scheme not in ("http", "https") or not parts.netloc:
            raise self._fail("refused", f"a bearer challenge with no usable realm ({realm!r})")
        # the scope is the reference's pull, never the server's: a registry must not have
        # the collector ask for push or delete, or for another repository
        query = {"scope": f"repository:{self.ref.repository}:pull"}
        if "service" in challenge:
            query = {"service": challenge["service"], **query}
        url = realm + ("&" if parts.query else "?") + urllib.parse.urlencode(query)
        headers = {}
        # credentials only for an image whose own registry has a line (enroot's rule), and
        # only to a realm on the registry's own host or one the admin named for it
        # (registry.token_realms): the realm is what the registry says, and a hostile one
        # would have the collector log in to another registry's token service
        named = parts.netloc in self.realms or (parts.hostname or "") in self.realms
        creds = (self.creds.get(parts.netloc)
                 if named and self.creds.get(self.ref.registry) else None)
        if creds is not None:
            headers["Authorization"] = _basic(creds)
        r = self._open("GET", url, headers)
        if r.status != 200:
            r.close()
            who = f"as {creds[0]}" if creds else (
                "anonymously (no credentials for "
                f"{_bare(parts.netloc)})" if named else "anonymously (not a realm "
                f"registry.token_realms names for {self.ref.registry})")
            raise self._fail("refused", f"the token service {parts.netloc} answered "
                                        f"{r.status} {r.resp.reason} {who}")
        try:
            data = bounded_json(self._body(r, MAX_TOKEN, "token"))
            token = data.get("token") or data.get("access_token")
        except (ValueError, AttributeError):
            token = None
        if not isinstance(token, str) or not token or not token.isprintable():
            raise self._fail("refused", f"the token service {parts.netloc} gave no token")
        return token

    def get(self, path: str, accept: tuple[str, ...] = ()) -> Response:
        """GET ``/v2/<repository>/<path>`` with auth: a 401 is answered once, by the
        challenge's scheme (bearer: a token for it; basic: the registry's credentials)."""
        url = f"{self.scheme}://{self.ref.registry}/v2/{self.ref.repository}/{path}"
        headers = {"Accept": ", ".join(accept)} if accept else {}
        if self.auth:
            headers["Authorization"] = self.auth
        r = self._open("GET", url, headers)
        if r.status != 401:
            return r
        scheme, params = _challenge(r.header("WWW-Authenticate"))
        r.close()
        if scheme == "bearer":
            self.auth = f"Bearer {self._token(params)}"
        elif scheme == "basic":
            creds = self.creds.get(self.ref.registry)
            if creds is None:
                raise self._fail("refused", f"{self.ref.registry} asks for a login, and the "
                                            "credentials file has no entry for it")
            self.auth = _basic(creds)
        else:
            raise self._fail("refused", f"{self.ref.registry} answered 401 with no challenge "
                                        "this client takes (bearer, basic)")
        headers["Authorization"] = self.auth
        r = self._open("GET", url, headers)
        if r.status == 401:
            r.close()
            raise self._fail("refused", f"{self.ref.registry} refused the credentials (401)")
        return r

    def _checked(self, r: Response, what: str) -> Response:
        if r.status == 200:
            return r
        r.close()
        if r.status == 404:
            raise self._fail("not-found", f"{what}: not found (404)")
        if r.status in (401, 403):
            raise self._fail("refused", f"{what}: {r.status} {r.resp.reason}")
        raise self._fail("unreachable", f"{what}: {r.status} {r.resp.reason}")

    def manifest(self, reference: str) -> tuple[str, str, dict[str, Any]]:
        """(digest, media type, manifest) of ``reference`` (a tag or a digest); a digest
        asked for is checked, and so is the registry's Docker-Content-Digest."""
        what = f"manifest {reference}"
        r = self._checked(self.get(f"manifests/{reference}", (*INDEXES, *MANIFESTS)), what)
        header = r.header("Docker-Content-Digest")
        media = r.header("Content-Type").split(";", 1)[0].strip()
        body = self._body(r, MAX_MANIFEST, what)
        digest = "sha256:" + hashlib.sha256(body).hexdigest()
        if _DIGEST.fullmatch(reference) and digest != reference:
            raise self._fail("invalid", f"{what}: its content does not match the digest")
        if header and header != digest:
            raise self._fail("invalid", f"{what}: its content does not match the "
                                        f"Docker-Content-Digest {header[:80]}")
        try:
            doc = bounded_json(body)
        except ValueError as e:
            raise self._fail("invalid", f"{what}: {e}") from None
        if not isinstance(doc, dict):
            raise self._fail("invalid", f"{what}: not a JSON object")
        media = str(doc.get("mediaType") or media)
        if media not in (*INDEXES, *MANIFESTS):
            raise self._fail("invalid", f"{what}: media type {media[:100]!r} is not an image "
                                        "manifest or index (Docker schema 1 is not read, "
                                        "as enroot does not)")
        return digest, media, doc

    def blob(self, digest: str, limit: int, what: str) -> bytes:
        r = self._checked(self.get(f"blobs/{digest}"), what)
        body = self._body(r, limit, what)
        if "sha256:" + hashlib.sha256(body).hexdigest() != digest:
            raise self._fail("invalid", f"{what}: its content does not match its digest")
        return body

    def blob_stream(self, digest: str, what: str) -> tuple[_Body, Response]:
        r = self._checked(self.get(f"blobs/{digest}"), what)
        return _Body(r, self.deadline, f"{self.ref.key} {what}"), r


MAX_JSON_DEPTH = 32  # arrays and objects inside each other (a config: 4 or 5)
MAX_JSON_VALUES = 100_000  # arrays, objects and commas (a config: a few thousand)
#: a string, or an unterminated one to the end: always a match, so the scan is linear
_JSON_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"?', re.DOTALL)
_JSON_BRACKETS = re.compile(rb"[\[\]{}]")


def bounded_json(body: bytes) -> Any:
    """``json.loads`` of a document checked first, in linear time and without building
    it, for at most :data:`MAX_JSON_VALUES` containers and separators and
    :data:`MAX_JSON_DEPTH` levels: the bytes' bound alone let an 8 MiB config of empty
    lists cost 200 MB while parsed. Raises ValueError naming the cause."""
    bare = _JSON_STRING.sub(b'""', body)  # what is inside strings is not structure
    values = bare.count(b"[") + bare.count(b"{") + bare.count(b",")
    if values > MAX_JSON_VALUES:
        raise ValueError(f"more than {MAX_JSON_VALUES} JSON values")
    depth = 0
    for m in _JSON_BRACKETS.finditer(bare):
        depth += 1 if m.group() in b"[{" else -1
        if depth > MAX_JSON_DEPTH:
            raise ValueError(f"JSON nested deeper than {MAX_JSON_DEPTH} levels")
    try:
        return json.loads(body)
    except (ValueError, RecursionError) as e:
        raise ValueError(f"not JSON: {str(e)[:200]}") from None


def _close(conn: http.client.HTTPConnection | None) -> None:
    if conn is not None:
        conn.close()


def _basic(creds: tuple[str, str]) -> str:
    return "Basic " + base64.b64encode(f"{creds[0]}:{creds[1]}".encode()).decode()


MAX_CHALLENGE = 4096  # bytes of a WWW-Authenticate header (a real one is a few hundred)
# a parameter's name starts where no name letter is before it: unanchored, a run of
# letters with no "=" was tried from each of its letters (quadratic, holding the GIL:
# one 65 KB header froze the whole collector for 27 s, issue 41's hostile review)
_PARAM = re.compile(r'(?<![A-Za-z_])([A-Za-z_]+)=(?:"([^"]*)"|([^,\s]*))')


def _challenge(header: str) -> tuple[str, dict[str, str]]:
    """(scheme, params) of a ``WWW-Authenticate`` header (RFC 7235 quoted pairs). A
    header over :data:`MAX_CHALLENGE` bytes is no challenge (no scheme, no params)."""
    if len(header) > MAX_CHALLENGE:
        return "", {}
    scheme, _, rest = header.strip().partition(" ")
    params = {m.group(1).lower(): m.group(2) if m.group(2) is not None else m.group(3)
              for m in _PARAM.finditer(rest)}
    return scheme.lower(), params


# --------------------------------------------------------------------- the image


@dataclass
class Resolved:
    """What a reference resolved to: the platform's manifest digest (the image's
    identity), the index's when there was one."""

    digest: str
    index_digest: str | None
    manifest: dict[str, Any]
    platform: str


def resolve(client: Client, platform: str) -> Resolved:
    """The manifest of ``platform`` (``os/arch``) that the client's reference names."""
    digest, media, doc = client.manifest(client.ref.reference)
    index_digest = None
    if media in INDEXES:
        index_digest = digest
        os_name, _, arch = platform.partition("/")
        entries = doc.get("manifests")
        if not isinstance(entries, list):
            raise client._fail("invalid", "an index with no manifests list")
        chosen = None
        for m in entries:
            p = m.get("platform") if isinstance(m, dict) else None
            if isinstance(p, dict) and p.get("architecture") == arch and p.get(
                    "os", os_name) == os_name and _DIGEST.fullmatch(str(m.get("digest"))):
                chosen = str(m["digest"])
                break
        if chosen is None:
            plats = [m.get("platform") for m in entries if isinstance(m, dict)]
            have = sorted({f"{p.get('os')}/{p.get('architecture')}" for p in plats
                           if isinstance(p, dict)})[:16]
            raise client._fail("not-found", f"no {platform} image in the index (it has "
                                            f"{', '.join(have) or 'none'}; registry.platform)")
        digest, media, doc = client.manifest(chosen)
        if media not in MANIFESTS:
            raise client._fail("invalid", "an index entry that is not an image manifest")
    return Resolved(digest, index_digest, doc, platform)


def _descriptor(d: Any, what: str, client: Client) -> tuple[str, int, str]:
    if not isinstance(d, dict) or not _DIGEST.fullmatch(str(d.get("digest"))) \
            or type(d.get("size")) is not int or d["size"] < 0:
        raise client._fail("invalid", f"the manifest's {what} is not a sha256 descriptor "
                                      "with a size")
    return str(d["digest"]), int(d["size"]), str(d.get("mediaType") or "")


def config_env(config: dict[str, Any]) -> dict[str, str]:
    """The ``NCCL_*`` and ``LD_LIBRARY_PATH`` of an image config's ``Env``: what enroot
    writes as the container's ``/etc/environment`` (a later entry wins, as it does in
    the container)."""
    inner = config.get("config") if isinstance(config, dict) else None
    env = inner.get("Env") if isinstance(inner, dict) else None
    out: dict[str, str] = {}
    for item in env if isinstance(env, list) else []:
        if not isinstance(item, str):
            continue
        name, eq, value = item.partition("=")
        if eq and (name.startswith("NCCL_") or name == "LD_LIBRARY_PATH"):
            out[name] = value[:4096]
    return out


@dataclass
class RegistryLimits:
    timeout_s: float = 900.0
    max_layer_bytes: int = 16 << 30
    max_unpacked_bytes: int = 64 << 30
    max_read_bytes: int = 3 << 30
    tmp_dir: str = ""


def read_image(
    client: Client, platform: str, limits: RegistryLimits,
    cached: Callable[[str], dict[str, Any] | None],
    store: Callable[[dict[str, Any]], None] = lambda s: None,
    resolved: Resolved | None = None,
    stop: Callable[[], bool] | None = None,
) -> dict[str, Any]:
    """The image record of the client's reference (module docstring). ``cached(digest)``
    gives a layer's stored summary (or None: it is downloaded and read); ``store`` takes
    each new summary as soon as it is read. The layers are downloaded, and their union
    built and read, under the client's deadline and ``stop`` (the collector's SIGTERM),
    as a squashfs image is: ``time limit reached``, ImageStopped. Raises RegistryError (the
    registry) or ImageError (the image's content), each naming the cause."""
    t0 = time.monotonic()
    res = resolved or resolve(client, platform)
    m = res.manifest
    cfg_digest, cfg_size, _ = _descriptor(m.get("config"), "config", client)
    if cfg_size > MAX_CONFIG:
        raise client._fail("invalid", f"an image config of {cfg_size} bytes")
    try:
        config = bounded_json(client.blob(cfg_digest, MAX_CONFIG, "config"))
    except ValueError as e:
        raise client._fail("invalid", f"the image config: {e}") from None
    layers = m.get("layers")
    if not isinstance(layers, list) or len(layers) > MAX_LAYERS:
        raise client._fail("invalid", f"the manifest has no layers list of at most "
                                      f"{MAX_LAYERS}")
    summaries: list[dict[str, Any]] = []
    layer_info: list[dict[str, Any]] = []
    kept = entries = 0
    for i, d in enumerate(layers):
        digest, size, media = _descriptor(d, f"layer {i}", client)
        if media not in LAYER_TYPES:
            raise ImageError(client.ref.key, f"layer {i} ({digest}): media type "
                                             f"{media[:100]!r} is not a layer this reader takes")
        s = cached(digest)
        hit = s is not None and summary_ok(s)
        if not hit:
            body, r = client.blob_stream(digest, f"layer {digest}")
            try:
                s = read_layer(body, digest=digest, size=size, media_type=media,
                               deadline=client.deadline, max_bytes=limits.max_layer_bytes,
                               max_unpacked=limits.max_unpacked_bytes,
                               max_read_bytes=limits.max_read_bytes,
                               tmpdir=limits.tmp_dir or None,
                               label=f"{client.ref.key} layer {i} ({digest})", stop=stop)
            finally:
                r.close()
        assert s is not None
        # the image's bounds before its layer is stored (or kept for the union)
        kept += int(s.get("kept_bytes") or 0)
        entries += len(s["ops"])
        if kept > MAX_IMAGE_KEPT_BYTES:
            raise ImageError(client.ref.key, f"its layers keep more than {MAX_IMAGE_KEPT_BYTES} "
                                             "bytes of paths the fingerprint reads")
        if entries > MAX_IMAGE_KEPT:
            raise ImageError(client.ref.key, f"its layers keep more than {MAX_IMAGE_KEPT} "
                                             "entries the fingerprint reads")
        if not hit:
            store(s)
        summaries.append(s)
        layer_info.append({"digest": digest, "size": size, "media_type": media,
                           "cached": hit})
    image = LayeredImage(client.ref.key, summaries, deadline=client.deadline, stop=stop)
    facts = read_tree(image, tmpdir=limits.tmp_dir or None, config_env=config_env(config))
    return {
        "schema": SCHEMA,
        "image": {"ref": client.ref.key, "digest": res.digest,
                  "index_digest": res.index_digest, "platform": res.platform,
                  "config_digest": cfg_digest, "layers": layer_info,
                  "size": sum(x["size"] for x in layer_info), "entries": image.listed},
        **facts,
        "scan_seconds": round(time.monotonic() - t0, 3),
    }
