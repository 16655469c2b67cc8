"""MUNGE credentials through libmunge: who signed a record, from where, and when.

Every Slurm cluster runs munged. A credential that this host's munged encodes carries,
under the cluster key that only root holds, the payload, the uid and gid of the process
that asked, the origin address of the encoding munged (``--origin``, by default its
host's address) and the encode time. Any munged with the same key decodes it; see
docs/collector.md for what that proves and what it does not.

libmunge (``libmunge.so.2``, Debian's ``libmunge2``, installed with munge) is called
through ``ctypes``: one socket round trip per credential, no process per record. Only
the library that the system's linker finds by its soname is loaded.

Facts relied on (munge 0.5.15, checked against its source and a real munged): a decode
that fails as expired, rewound or replayed still returns the payload and its metadata
(``src/munged/dec.c``, ``dec_process_msg``); the error numbers are ``munge.h``'s
``munge_err_t``.

Standard library only.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import socket
import struct
from dataclasses import dataclass
from typing import Any

__all__ = [
    "Credential",
    "MungeError",
    "MungeUnavailable",
    "decode",
    "encode",
]

# munge.h: munge_opt_t
_OPT_ZIP_TYPE = 2
_OPT_TTL = 4
_OPT_ADDR4 = 5
_OPT_ENCODE_TIME = 6
_OPT_DECODE_TIME = 7
_OPT_SOCKET = 8
_ZIP_ZLIB = 3  # munge_zip_t

# munge.h: munge_err_t -> a short name (used in logs, metrics and tests)
ERRORS: dict[int, str] = {
    1: "snafu", 2: "bad-arg", 3: "bad-length", 4: "overflow", 5: "no-memory",
    6: "socket", 7: "timeout", 8: "bad-cred", 9: "bad-version", 10: "bad-cipher",
    11: "bad-mac", 12: "bad-zip", 13: "bad-realm", 14: "cred-invalid",
    15: "expired", 16: "rewound", 17: "replayed", 18: "unauthorized",
}  # fmt: skip
EXPIRED, REWOUND, REPLAYED = 15, 16, 17
#: munged not there, stopped, out of memory or confused: try again later, never "bad"
_UNAVAILABLE = (1, 5, 6, 7)
#: decoded, authentic, with payload and metadata, but not valid now
_DECODED_ANYWAY = (EXPIRED, REWOUND, REPLAYED)


class MungeError(Exception):
    """A credential could not be encoded or decoded. ``code`` is munge's error number
    (``ERRORS`` names it), ``name`` its short name."""

    def __init__(self, code: int, message: str) -> None:
        self.code = code
        self.name = ERRORS.get(code, f"error-{code}")
        super().__init__(message)


class MungeUnavailable(MungeError):
    """libmunge is not installed, or munged cannot be reached."""


@dataclass(frozen=True)
class Credential:
    """A decoded credential. ``status`` is 0 (valid now) or the error munged reported for
    an authentic credential that is not valid now: ``EXPIRED``, ``REWOUND`` (encoded in
    the future) or ``REPLAYED`` (this munged decoded it before)."""

    payload: bytes
    uid: int
    gid: int
    origin: str  # the encoding munged's IPv4 origin address
    encoded_at: int  # the encoding munged's clock, epoch seconds
    decoded_at: int
    ttl: int
    status: int = 0

    @property
    def status_name(self) -> str:
        return "ok" if self.status == 0 else ERRORS.get(self.status, f"error-{self.status}")


class _Lib:
    """libmunge and the few libc calls it needs, loaded once per process."""

    def __init__(self) -> None:
        name = ctypes.util.find_library("munge") or "libmunge.so.2"
        try:
            lib = ctypes.CDLL(name)
        except OSError as e:
            raise MungeUnavailable(
                1, f"libmunge not found ({e}); install munge (Debian: libmunge2)"
            ) from None
        lib.munge_ctx_create.restype = ctypes.c_void_p
        lib.munge_ctx_destroy.argtypes = [ctypes.c_void_p]
        lib.munge_ctx_strerror.restype = ctypes.c_char_p
        lib.munge_ctx_strerror.argtypes = [ctypes.c_void_p]
        lib.munge_encode.restype = ctypes.c_int
        lib.munge_encode.argtypes = [
            ctypes.POINTER(ctypes.c_char_p), ctypes.c_void_p, ctypes.c_char_p, ctypes.c_int,
        ]
        lib.munge_decode.restype = ctypes.c_int
        lib.munge_decode.argtypes = [
            ctypes.c_char_p, ctypes.c_void_p, ctypes.POINTER(ctypes.c_void_p),
            ctypes.POINTER(ctypes.c_int), ctypes.POINTER(ctypes.c_uint32),
            ctypes.POINTER(ctypes.c_uint32),
        ]
        lib.munge_ctx_set.restype = ctypes.c_int  # variadic: arguments typed per call
        lib.munge_ctx_get.restype = ctypes.c_int
        libc = ctypes.CDLL(None)
        libc.free.argtypes = [ctypes.c_void_p]
        self.lib, self.free = lib, libc.free

    def context(self, socket_path: str | None) -> Any:
        ctx = self.lib.munge_ctx_create()
        if not ctx:
            raise MungeError(5, "munge_ctx_create failed (out of memory)")
        if socket_path:
            rc = self.lib.munge_ctx_set(
                ctypes.c_void_p(ctx), ctypes.c_int(_OPT_SOCKET),
                ctypes.c_char_p(socket_path.encode()),
            )
            if rc:
                self.lib.munge_ctx_destroy(ctx)
                raise MungeError(rc, f"cannot use munge socket {socket_path}")
        return ctx

    def error(self, ctx: Any, rc: int, doing: str, socket_path: str | None) -> MungeError:
        detail = self.lib.munge_ctx_strerror(ctx)
        text = detail.decode(errors="replace") if detail else f"munge error {rc}"
        where = f" (socket {socket_path})" if socket_path else ""
        cls = MungeUnavailable if rc in _UNAVAILABLE else MungeError
        return cls(rc, f"{doing}{where}: {text}")


_LIB: _Lib | None = None


def _lib() -> _Lib:
    global _LIB
    if _LIB is None:
        _LIB = _Lib()
    return _LIB


def encode(
    payload: bytes, *, socket_path: str | None = None, ttl: int | None = None,
    compress: bool = True,
) -> bytes:
    """A credential for ``payload`` from the local munged (``socket_path``, default
    libmunge's). ``ttl`` in seconds (munged caps it at its ``--max-ttl``, 3600 by default);
    ``compress``: zlib inside the credential."""
    m = _lib()
    ctx = m.context(socket_path)
    try:
        vctx = ctypes.c_void_p(ctx)
        if ttl is not None:
            if not 0 < ttl < 2**31:
                raise MungeError(2, f"ttl {ttl}: expected 1 to {2**31 - 1} seconds")
            rc = m.lib.munge_ctx_set(vctx, ctypes.c_int(_OPT_TTL), ctypes.c_int(int(ttl)))
            if rc:
                raise m.error(ctx, rc, f"munge ttl {ttl}", socket_path)
        if compress:
            rc = m.lib.munge_ctx_set(vctx, ctypes.c_int(_OPT_ZIP_TYPE), ctypes.c_int(_ZIP_ZLIB))
            if rc:
                raise m.error(ctx, rc, "munge zlib", socket_path)
        out = ctypes.c_char_p()
        rc = m.lib.munge_encode(ctypes.byref(out), ctx, payload, len(payload))
        if rc:
            raise m.error(ctx, rc, "munge encode", socket_path)
        try:
            return ctypes.string_at(out)
        finally:
            m.free(out)
    finally:
        m.lib.munge_ctx_destroy(ctx)


def decode(cred: bytes, *, socket_path: str | None = None) -> Credential:
    """Decode ``cred`` on the local munged. Raises :class:`MungeError` for a credential
    that is not authentic (bad format, MAC, key); returns one with ``status`` set for an
    authentic one that is expired, rewound or replayed (the caller decides)."""
    m = _lib()
    if not cred or b"\0" in cred:
        raise MungeError(8, "not a credential (empty, or holds a NUL byte)")
    ctx = m.context(socket_path)
    try:
        buf = ctypes.c_void_p()
        length = ctypes.c_int()
        uid, gid = ctypes.c_uint32(), ctypes.c_uint32()
        rc = m.lib.munge_decode(cred, ctx, ctypes.byref(buf), ctypes.byref(length),
                                ctypes.byref(uid), ctypes.byref(gid))
        try:
            if rc and rc not in _DECODED_ANYWAY:
                raise m.error(ctx, rc, "munge decode", socket_path)
            payload = ctypes.string_at(buf, length.value) if buf.value else b""
        finally:
            if buf.value:
                m.free(buf)
        vctx = ctypes.c_void_p(ctx)
        addr = ctypes.create_string_buffer(4)
        encoded, decoded = ctypes.c_int64(), ctypes.c_int64()  # time_t: 64-bit Linux
        ttl = ctypes.c_int()
        m.lib.munge_ctx_get(vctx, ctypes.c_int(_OPT_ADDR4), addr)
        m.lib.munge_ctx_get(vctx, ctypes.c_int(_OPT_ENCODE_TIME), ctypes.byref(encoded))
        m.lib.munge_ctx_get(vctx, ctypes.c_int(_OPT_DECODE_TIME), ctypes.byref(decoded))
        m.lib.munge_ctx_get(vctx, ctypes.c_int(_OPT_TTL), ctypes.byref(ttl))
        return Credential(
            payload=payload, uid=uid.value, gid=gid.value,
            origin=socket.inet_ntoa(struct.pack("4s", addr.raw)),
            encoded_at=encoded.value, decoded_at=decoded.value, ttl=ttl.value, status=rc,
        )
    finally:
        m.lib.munge_ctx_destroy(ctx)
