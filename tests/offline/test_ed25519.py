"""The offline bootstrap's Ed25519 verifier: RFC 8032 vectors, agreement with ``cryptography``
(OpenSSL) on random and crafted signatures, strict decoding, and the PEM key reader."""

from __future__ import annotations

import hashlib
import random

import pytest

from kunlun.offline import ed25519
from kunlun.offline.ed25519 import BadSignature, L, P, public_key_from_pem, verify

try:
    from cryptography.exceptions import InvalidSignature
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ec, rsa
    from cryptography.hazmat.primitives.asymmetric.ed25519 import (
        Ed25519PrivateKey,
        Ed25519PublicKey,
    )

    HAVE_CRYPTOGRAPHY = True
except ImportError:  # the verifier itself needs none of it; only the cross-checks do
    HAVE_CRYPTOGRAPHY = False

needs_cryptography = pytest.mark.skipif(
    not HAVE_CRYPTOGRAPHY, reason="the cross-checks need the cryptography package"
)

# RFC 8032 section 7.1: (name, secret key, public key, message, signature), all hex.
RFC8032 = [
    (
        "TEST 1",
        "9d61b19deffd5a60ba844af492ec2cc44449c5697b326919703bac031cae7f60",
        "d75a980182b10ab7d54bfed3c964073a0ee172f3daa62325af021a68f707511a",
        "",
        "e5564300c360ac729086e2cc806e828a84877f1eb8e5d974d873e06522490155"
        "5fb8821590a33bacc61e39701cf9b46bd25bf5f0595bbe24655141438e7a100b",
    ),
    (
        "TEST 2",
        "4ccd089b28ff96da9db6c346ec114e0f5b8a319f35aba624da8cf6ed4fb8a6fb",
        "3d4017c3e843895a92b70aa74d1b7ebc9c982ccf2ec4968cc0cd55f12af4660c",
        "72",
        "92a009a9f0d4cab8720e820b5f642540a2b27b5416503f8fb3762223ebdb69da"
        "085ac1e43e15996e458f3613d0f11d8c387b2eaeb4302aeeb00d291612bb0c00",
    ),
    (
        "TEST 3",
        "c5aa8df43f9f837bedb7442f31dcb7b166d38535076f094b85ce3a2e0b4458f7",
        "fc51cd8e6218a1a38da47ed00230f0580816ed13ba3303ac5deb911548908025",
        "af82",
        "6291d657deec24024827e69c3abe01a30ce548a284743a445e3680d7db5ac3ac"
        "18ff9b538d16f290ae67f760984dc6594a7c15e9716ed28dc027beceea1ec40a",
    ),
    (
        "TEST 1024",
        "f5e5767cf153319517630f226876b86c8160cc583bc013744c6bf255f5cc0ee5",
        "278117fc144c72340f67d0f2316e8386ceffbf2b2428c9c51fef7c597f1d426e",
        "08b8b2b733424243760fe426a4b54908632110a66c2f6591eabd3345e3e4eb98"
        "fa6e264bf09efe12ee50f8f54e9f77b1e355f6c50544e23fb1433ddf73be84d8"
        "79de7c0046dc4996d9e773f4bc9efe5738829adb26c81b37c93a1b270b20329d"
        "658675fc6ea534e0810a4432826bf58c941efb65d57a338bbd2e26640f89ffbc"
        "1a858efcb8550ee3a5e1998bd177e93a7363c344fe6b199ee5d02e82d522c4fe"
        "ba15452f80288a821a579116ec6dad2b3b310da903401aa62100ab5d1a36553e"
        "06203b33890cc9b832f79ef80560ccb9a39ce767967ed628c6ad573cb116dbef"
        "efd75499da96bd68a8a97b928a8bbc103b6621fcde2beca1231d206be6cd9ec7"
        "aff6f6c94fcd7204ed3455c68c83f4a41da4af2b74ef5c53f1d8ac70bdcb7ed1"
        "85ce81bd84359d44254d95629e9855a94a7c1958d1f8ada5d0532ed8a5aa3fb2"
        "d17ba70eb6248e594e1a2297acbbb39d502f1a8c6eb6f1ce22b3de1a1f40cc24"
        "554119a831a9aad6079cad88425de6bde1a9187ebb6092cf67bf2b13fd65f270"
        "88d78b7e883c8759d2c4f5c65adb7553878ad575f9fad878e80a0c9ba63bcbcc"
        "2732e69485bbc9c90bfbd62481d9089beccf80cfe2df16a2cf65bd92dd597b07"
        "07e0917af48bbb75fed413d238f5555a7a569d80c3414a8d0859dc65a46128ba"
        "b27af87a71314f318c782b23ebfe808b82b0ce26401d2e22f04d83d1255dc51a"
        "ddd3b75a2b1ae0784504df543af8969be3ea7082ff7fc9888c144da2af58429e"
        "c96031dbcad3dad9af0dcbaaaf268cb8fcffead94f3c7ca495e056a9b47acdb7"
        "51fb73e666c6c655ade8297297d07ad1ba5e43f1bca32301651339e22904cc8c"
        "42f58c30c04aafdb038dda0847dd988dcda6f3bfd15c4b4c4525004aa06eeff8"
        "ca61783aacec57fb3d1f92b0fe2fd1a85f6724517b65e614ad6808d6f6ee34df"
        "f7310fdc82aebfd904b01e1dc54b2927094b2db68d6f903b68401adebf5a7e08"
        "d78ff4ef5d63653a65040cf9bfd4aca7984a74d37145986780fc0b16ac451649"
        "de6188a7dbdf191f64b5fc5e2ab47b57f7f7276cd419c17a3ca8e1b939ae49e4"
        "88acba6b965610b5480109c8b17b80e1b7b750dfc7598d5d5011fd2dcc5600a3"
        "2ef5b52a1ecc820e308aa342721aac0943bf6686b64b2579376504ccc493d97e"
        "6aed3fb0f9cd71a43dd497f01f17c0e2cb3797aa2a2f256656168e6c496afc5f"
        "b93246f6b1116398a346f1a641f3b041e989f7914f90cc2c7fff357876e506b5"
        "0d334ba77c225bc307ba537152f3f1610e4eafe595f6d9d90d11faa933a15ef1"
        "369546868a7f3a45a96768d40fd9d03412c091c6315cf4fde7cb68606937380d"
        "b2eaaa707b4c4185c32eddcdd306705e4dc1ffc872eeee475a64dfac86aba41c"
        "0618983f8741c5ef68d3a101e8a3b8cac60c905c15fc910840b94c00a0b9d0",
        "0aab4c900501b3e24d7cdf4663326a3a87df5e4843b2cbdb67cbf6e460fec350"
        "aa5371b1508f9f4528ecea23c436d94b5e8fcd4f681e30a6ac00a9704a188a03",
    ),
]

# TEST 1, used below as a known-good signature to damage.
PK = bytes.fromhex(RFC8032[0][2])
SIG = bytes.fromhex(RFC8032[0][4])
MSG = b""


def _flip(data: bytes, bit: int) -> bytes:
    out = bytearray(data)
    out[bit // 8] ^= 1 << (bit % 8)
    return bytes(out)


def _encode(point: tuple[int, int, int, int]) -> bytes:
    """RFC 8032 section 5.1.2 point encoding (the module only needs decoding)."""
    x, y, z, _ = point
    zinv = pow(z, P - 2, P)
    x, y = x * zinv % P, y * zinv % P
    return (y | (x & 1) << 255).to_bytes(32, "little")


def _mult(n: int, point: tuple[int, int, int, int]) -> tuple[int, int, int, int]:
    return ed25519._double_scalar_mult(n, point, 0, ed25519._IDENTITY)


def _raw(public: Ed25519PublicKey) -> bytes:
    return public.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)


def _openssl_accepts(public_key: bytes, signature: bytes, message: bytes) -> bool:
    try:
        Ed25519PublicKey.from_public_bytes(public_key).verify(signature, message)
    except InvalidSignature:
        return False
    return True


def test_curve_constants() -> None:
    # B is (x, 4/5) with x even, and has order L.
    assert ed25519.BASE[1] == 4 * pow(5, P - 2, P) % P
    assert ed25519._recover_x(ed25519.BASE[1], 0) == ed25519.BASE[0]
    assert ed25519._points_equal(_mult(L, ed25519.BASE), ed25519._IDENTITY)
    assert _encode(ed25519.BASE).hex() == "58" + "66" * 31


def test_double_scalar_mult_is_the_sum_of_two_multiples() -> None:
    rng = random.Random(1)
    b = ed25519.BASE
    for _ in range(5):
        m, n = rng.randrange(L), rng.randrange(L)
        two_b = ed25519._double(b)
        expected = _mult((m + 2 * n) % L, b)
        assert ed25519._points_equal(ed25519._double_scalar_mult(m, b, n, two_b), expected)
        assert ed25519._points_equal(
            ed25519._add(_mult(m, b), ed25519._negate(_mult(m, b))), ed25519._IDENTITY
        )


@pytest.mark.parametrize("vector", RFC8032, ids=[v[0] for v in RFC8032])
def test_rfc8032_vectors_verify(vector: tuple[str, str, str, str, str]) -> None:
    _, _, public, message, signature = vector
    verify(bytes.fromhex(public), bytes.fromhex(signature), bytes.fromhex(message))


@needs_cryptography
@pytest.mark.parametrize("vector", RFC8032, ids=[v[0] for v in RFC8032])
def test_rfc8032_vectors_are_transcribed_exactly(vector: tuple[str, str, str, str, str]) -> None:
    # Ed25519 signing is deterministic: OpenSSL must reproduce the RFC's key and signature.
    name, secret, public, message, signature = vector
    key = Ed25519PrivateKey.from_private_bytes(bytes.fromhex(secret))
    assert _raw(key.public_key()).hex() == public
    assert key.sign(bytes.fromhex(message)).hex() == signature
    if name == "TEST 1024":
        assert len(bytes.fromhex(message)) == 1023


@needs_cryptography
def test_accepts_200_random_signatures_made_by_openssl() -> None:
    rng = random.Random(8032)
    for _ in range(200):
        key = Ed25519PrivateKey.generate()
        message = rng.randbytes(rng.randint(0, 300))
        verify(_raw(key.public_key()), key.sign(message), message)


@pytest.mark.parametrize("bit", [0, 7, 100, 8 * 1023 - 1])
def test_flipped_message_bit_is_refused(bit: int) -> None:
    _, _, public, message, signature = RFC8032[3]  # the 1023-byte message
    key, sig, msg = bytes.fromhex(public), bytes.fromhex(signature), bytes.fromhex(message)
    verify(key, sig, msg)
    with pytest.raises(BadSignature, match="does not match"):
        verify(key, sig, _flip(msg, bit))


@pytest.mark.parametrize("bit", [0, 1, 77, 200, 254, 255])
def test_flipped_bit_in_r_is_refused(bit: int) -> None:
    with pytest.raises(BadSignature):
        verify(PK, _flip(SIG, bit), MSG)


@pytest.mark.parametrize("bit", [0, 1, 77, 200, 251, 252, 255])
def test_flipped_bit_in_s_is_refused(bit: int) -> None:
    with pytest.raises(BadSignature):
        verify(PK, _flip(SIG, 256 + bit), MSG)


@pytest.mark.parametrize("bit", [0, 1, 77, 200, 254, 255])
def test_flipped_bit_in_key_is_refused(bit: int) -> None:
    with pytest.raises(BadSignature):
        verify(_flip(PK, bit), SIG, MSG)


def test_non_canonical_s_is_refused() -> None:
    s = int.from_bytes(SIG[32:], "little")
    for bad_s in (s + L, s + 2 * L, L):
        with pytest.raises(BadSignature, match="not canonical"):
            verify(PK, SIG[:32] + bad_s.to_bytes(32, "little"), MSG)


@pytest.mark.parametrize("length", [0, 31, 33, 64])
def test_key_of_wrong_length_is_refused(length: int) -> None:
    with pytest.raises(BadSignature, match="public key must be 32 bytes"):
        verify((PK * 2)[:length], SIG, MSG)


@pytest.mark.parametrize("length", [0, 32, 63, 65, 128])
def test_signature_of_wrong_length_is_refused(length: int) -> None:
    with pytest.raises(BadSignature, match="signature must be 64 bytes"):
        verify(PK, (SIG * 2)[:length], MSG)


def _no_point_y() -> int:
    """The smallest y for which (y^2 - 1) / (d y^2 + 1) has no square root."""
    y = 2
    while ed25519._recover_x(y, 0) is not None:
        y += 1
    return y


@pytest.mark.parametrize(
    ("why", "encoding"),
    [
        ("y = p", P),
        ("y = p + 1 (the identity, non-canonical)", P + 1),
        ("y = 2^255 - 1", 2**255 - 1),
        ("x = 0 with the sign bit set", 1 | 1 << 255),
        ("no square root", _no_point_y()),
    ],
)
def test_points_that_do_not_decode_are_refused(why: str, encoding: int) -> None:
    bad = encoding.to_bytes(32, "little")
    with pytest.raises(BadSignature, match="public key does not decode"):
        verify(bad, SIG, MSG)
    with pytest.raises(BadSignature, match="R does not decode"):
        verify(PK, bad + SIG[32:], MSG)


@needs_cryptography
def test_cofactorless_check_agrees_with_openssl_on_mixed_order_keys() -> None:
    # A = [a]B + T4, with T4 = (sqrt(-1), 0) of order 4. A signature made with a passes the
    # cofactored check always, the cofactorless one only when 4 divides k. Both must agree.
    rng = random.Random(25519)
    t4 = (ed25519._SQRT_M1, 0, 1, 0)
    a = rng.randrange(1, L)
    public = _encode(ed25519._add(_mult(a, ed25519.BASE), t4))
    verdicts = []
    for i in range(16):
        message = b"mixed order %d" % i
        r = rng.randrange(1, L)
        r_bytes = _encode(_mult(r, ed25519.BASE))
        k = int.from_bytes(hashlib.sha512(r_bytes + public + message).digest(), "little") % L
        signature = r_bytes + ((r + k * a) % L).to_bytes(32, "little")
        try:
            verify(public, signature, message)
            ours = True
        except BadSignature:
            ours = False
        assert ours == _openssl_accepts(public, signature, message), i
        assert ours == (k % 4 == 0), i
        verdicts.append(ours)
    assert False in verdicts and True in verdicts  # both outcomes did occur


@needs_cryptography
def test_pem_round_trip() -> None:
    for _ in range(5):
        public = Ed25519PrivateKey.generate().public_key()
        pem = public.public_bytes(
            serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
        )
        assert pem.startswith(b"-----BEGIN PUBLIC KEY-----")
        assert public_key_from_pem(pem) == _raw(public)
        assert public_key_from_pem(b"a comment\n" + pem.replace(b"\n", b"\r\n")) == _raw(public)


@needs_cryptography
@pytest.mark.parametrize("kind", ["rsa", "ec"])
def test_pem_of_another_key_type_is_refused(kind: str) -> None:
    spki = serialization.PublicFormat.SubjectPublicKeyInfo
    if kind == "rsa":
        key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
        pem = key.public_key().public_bytes(serialization.Encoding.PEM, spki)
    else:
        pem = (
            ec.generate_private_key(ec.SECP256R1())
            .public_key()
            .public_bytes(serialization.Encoding.PEM, spki)
        )
    with pytest.raises(ValueError, match="not an Ed25519 public key"):
        public_key_from_pem(pem)


@pytest.mark.parametrize(
    "pem",
    [
        b"",
        b"not a pem at all",
        "-----BEGIN PUBLIC KEY-----\nü\n-----END PUBLIC KEY-----\n".encode(),
        b"-----BEGIN PUBLIC KEY-----\n!!!!\n-----END PUBLIC KEY-----\n",
        b"-----BEGIN PRIVATE KEY-----\nMC4CAQAwBQYDK2VwBCIEIA==\n-----END PRIVATE KEY-----\n",
        b"-----BEGIN PUBLIC KEY-----\nMCowBQYDK2VwAyEA\n",  # no END line
        b"-----BEGIN PUBLIC KEY-----\nMCowBQYDK2VwAyEA\n-----END PUBLIC KEY-----\n",  # no key
    ],
)
def test_malformed_pem_is_refused(pem: bytes) -> None:
    with pytest.raises(ValueError, match="not a PEM public key|not an Ed25519 public key"):
        public_key_from_pem(pem)
