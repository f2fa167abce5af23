"""Ed25519 signature verification (RFC 8032), in pure Python with the standard library only.

Why it exists: this module is the root of trust of the offline bootstrap. On an air-gapped
machine the installer must check an offline bundle's signature before it installs anything
from it, and the only copy of the ``cryptography`` package on such a machine is a wheel inside
that very bundle, so the check cannot use it. Everything here is plain Python ints, ``hashlib``
and ``base64``.

What it does: :func:`verify` checks one 64-byte signature over a message against a raw 32-byte
public key, following RFC 8032 section 5.1.7 with strict decoding:

* the key must be exactly 32 bytes and the signature exactly 64 bytes (R || S);
* the key A and the point R must decode (section 5.1.3): y < p, (y^2 - 1) / (d y^2 + 1) must
  have a square root, and x = 0 with the sign bit set is refused;
* S must be canonical, S < L, so (R, S + L) is never a second valid signature;
* the equation is the cofactorless one, [S]B == R + [k]A with k = SHA-512(R || A || M) mod L,
  compared as points (computed as [S]B + [k](-A) == R).

Cofactorless, not cofactored: OpenSSL (what ``cryptography`` uses) computes [S]B - [k]A,
encodes it and compares the bytes with R, which is the cofactorless check. Every honestly made
signature passes either check; they differ only on crafted signatures that involve points of
small order, where the cofactorless check is the stricter one and this module gives OpenSSL's
verdict (the tests check both on keys with a component of order 4). The decoding is stricter
than OpenSSL's: OpenSSL 4.0 accepts a public key encoded with y >= p or as x = 0 with the sign
bit set, which this module refuses; no honestly made key is encoded that way.

:func:`public_key_from_pem` turns an Ed25519 SubjectPublicKeyInfo PEM ("-----BEGIN PUBLIC
KEY-----") into the raw 32-byte key that :func:`verify` takes.

What it does not do: sign, generate keys, or handle private keys in any form; Ed25519ctx and
Ed25519ph are not supported. It is not constant-time, which is fine for verification: every
input is public. It does not refuse public keys of small order (RFC 8032 does not either); the
key it is given is the trusted one, pinned in the installer, not one chosen by an attacker.
"""

from __future__ import annotations

import base64
import binascii
import hashlib

__all__ = ["BadSignature", "public_key_from_pem", "verify"]

# The field prime, the curve constant d of -x^2 + y^2 = 1 + d x^2 y^2, and the order of the
# base point (RFC 8032 section 5.1).
P = 2**255 - 19
D = (-121665 * pow(121666, P - 2, P)) % P
L = 2**252 + 27742317777372353535851937790883648493
_SQRT_M1 = pow(2, (P - 1) // 4, P)  # a square root of -1 mod p

# The DER of an Ed25519 SubjectPublicKeyInfo is these 12 bytes followed by the 32-byte key:
# SEQUENCE(42) { SEQUENCE(5) { OID 1.3.101.112 }, BIT STRING(33) { 0 unused bits, key } }.
SPKI_PREFIX = bytes.fromhex("302a300506032b6570032100")
_PEM_BEGIN = "-----BEGIN PUBLIC KEY-----"
_PEM_END = "-----END PUBLIC KEY-----"

# A point in extended homogeneous coordinates (X, Y, Z, T): x = X/Z, y = Y/Z, x*y = T/Z.
_Point = tuple[int, int, int, int]
_IDENTITY: _Point = (0, 1, 1, 0)


class BadSignature(Exception):
    """The signature does not verify; the message says why."""


def _recover_x(y: int, sign: int) -> int | None:
    """The x with -x^2 + y^2 = 1 + d x^2 y^2 and x mod 2 == sign, or None if there is none."""
    if y >= P:
        return None
    u = (y * y - 1) % P
    v = (D * y * y + 1) % P
    # x = sqrt(u / v), computed as u v^3 (u v^7)^((p-5)/8) (RFC 8032 section 5.1.3, step 2).
    x = (u * pow(v, 3, P) * pow(u * pow(v, 7, P), (P - 5) // 8, P)) % P
    vxx = (v * x * x) % P
    if vxx == (-u) % P:
        x = (x * _SQRT_M1) % P
    elif vxx != u:
        return None  # u / v is not a square: no point has this y
    if x == 0 and sign == 1:
        return None  # -0 is not a valid encoding
    if x % 2 != sign:
        x = P - x
    return x


def _decode_point(data: bytes) -> _Point | None:
    """Decode a 32-byte point encoding strictly (RFC 8032 section 5.1.3); None if invalid."""
    n = int.from_bytes(data, "little")
    y = n & ((1 << 255) - 1)
    x = _recover_x(y, n >> 255)
    if x is None:
        return None
    return (x, y, 1, (x * y) % P)


def _add(p1: _Point, p2: _Point) -> _Point:
    """p1 + p2 (RFC 8032 section 5.1.4); the formula is complete, so it also doubles."""
    x1, y1, z1, t1 = p1
    x2, y2, z2, t2 = p2
    a = (y1 - x1) * (y2 - x2) % P
    b = (y1 + x1) * (y2 + x2) % P
    c = 2 * D * t1 * t2 % P
    d = 2 * z1 * z2 % P
    e, f, g, h = b - a, d - c, d + c, b + a
    return (e * f % P, g * h % P, f * g % P, e * h % P)


def _double(p1: _Point) -> _Point:
    """2 * p1 (RFC 8032 section 5.1.4, the dedicated doubling formula)."""
    x1, y1, z1, _ = p1
    a = x1 * x1 % P
    b = y1 * y1 % P
    c = 2 * z1 * z1 % P
    h = a + b
    e = h - (x1 + y1) * (x1 + y1)
    g = a - b
    f = c + g
    return (e * f % P, g * h % P, f * g % P, e * h % P)


def _negate(p1: _Point) -> _Point:
    """-p1: (x, y) -> (-x, y)."""
    x1, y1, z1, t1 = p1
    return (-x1 % P, y1, z1, -t1 % P)


def _double_scalar_mult(m: int, p1: _Point, n: int, p2: _Point) -> _Point:
    """[m]p1 + [n]p2, by one double-and-add over the bits of both scalars (Straus/Shamir).

    Sharing the doublings between the two scalars makes a verification about twice as fast
    as two separate scalar multiplications.
    """
    both = _add(p1, p2)
    result = _IDENTITY
    for i in reversed(range(max(m.bit_length(), n.bit_length()))):
        result = _double(result)
        m_bit, n_bit = (m >> i) & 1, (n >> i) & 1
        if m_bit and n_bit:
            result = _add(result, both)
        elif m_bit:
            result = _add(result, p1)
        elif n_bit:
            result = _add(result, p2)
    return result


def _points_equal(p1: _Point, p2: _Point) -> bool:
    """Whether two points in projective coordinates are the same point (x1/z1 == x2/z2, ...)."""
    x1, y1, z1, _ = p1
    x2, y2, z2, _ = p2
    return (x1 * z2 - x2 * z1) % P == 0 and (y1 * z2 - y2 * z1) % P == 0


# The base point B (RFC 8032 section 5.1): y = 4/5 mod p and x is the even square root.
_B_X = 15112221349535400772501151409588531511454012693041857206046113283949847762202
_B_Y = 46316835694926478169428394003475163141307993866256225615783033603165251855960
BASE: _Point = (_B_X, _B_Y, 1, _B_X * _B_Y % P)


def verify(public_key: bytes, signature: bytes, message: bytes) -> None:
    """Check an Ed25519 signature (RFC 8032 section 5.1.7); return None or raise BadSignature.

    ``public_key`` is the raw 32-byte key (see :func:`public_key_from_pem` for a PEM one),
    ``signature`` the 64 bytes R || S, ``message`` the signed bytes themselves.
    """
    if len(public_key) != 32:
        raise BadSignature(f"the public key must be 32 bytes, not {len(public_key)}")
    if len(signature) != 64:
        raise BadSignature(f"the signature must be 64 bytes, not {len(signature)}")
    a = _decode_point(public_key)
    if a is None:
        raise BadSignature("the public key does not decode to a curve point")
    r_bytes, s_bytes = signature[:32], signature[32:]
    r = _decode_point(r_bytes)
    if r is None:
        raise BadSignature("the signature's R does not decode to a curve point")
    s = int.from_bytes(s_bytes, "little")
    if s >= L:
        raise BadSignature("the signature's S is not canonical (S >= L)")
    k = int.from_bytes(hashlib.sha512(r_bytes + public_key + message).digest(), "little") % L
    # [S]B == R + [k]A, computed as OpenSSL does: [S]B + [k](-A) == R.
    if not _points_equal(_double_scalar_mult(s, BASE, k, _negate(a)), r):
        raise BadSignature("the signature does not match the message and key ([S]B != R + [k]A)")


def public_key_from_pem(pem: bytes) -> bytes:
    """The raw 32-byte key of an Ed25519 SubjectPublicKeyInfo PEM; ValueError for anything else.

    Text before the BEGIN line and after the END line is ignored, as OpenSSL does.
    """
    try:
        text = pem.decode("ascii")
    except UnicodeDecodeError:
        raise ValueError("not a PEM public key: the data is not ASCII text") from None
    start = text.find(_PEM_BEGIN)
    end = text.find(_PEM_END, start + len(_PEM_BEGIN)) if start >= 0 else -1
    if start < 0 or end < 0:
        raise ValueError(
            f"not a PEM public key: expected a {_PEM_BEGIN!r} ... {_PEM_END!r} block"
            " (SubjectPublicKeyInfo)"
        )
    body = "".join(text[start + len(_PEM_BEGIN) : end].split())
    try:
        der = base64.b64decode(body, validate=True)
    except binascii.Error as exc:
        raise ValueError(f"not a PEM public key: the base64 body is invalid ({exc})") from None
    if len(der) != len(SPKI_PREFIX) + 32 or not der.startswith(SPKI_PREFIX):
        raise ValueError(
            "not an Ed25519 public key: expected 44 bytes of SubjectPublicKeyInfo DER starting"
            f" with {SPKI_PREFIX.hex()}, got {len(der)} bytes starting with {der[:12].hex()}"
        )
    return der[len(SPKI_PREFIX) :]
