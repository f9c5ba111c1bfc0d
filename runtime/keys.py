"""Identities: Ed25519 key pairs and their files, signatures, and the CURVE keys links use.

The only module that imports PyNaCl (libsodium). One Ed25519 key pair is one party's identity (the
coordinator, or one device): it signs (the coordinator signs every bundle's manifest, `ir.bundle`)
and, converted to Curve25519 with libsodium's standard map, it is the CURVE key pair of every
ZeroMQ socket that party opens (`runtime.transport.zeromq`). So one public key per party is all a
cluster file lists, and one secret file is all a device keeps.

Files (`confidant keys DIR NAME...` writes them; `KeyDir` reads a folder of them):

    NAME.pub   one line: "ed25519:<64 hex digits> NAME"          (share it)
    NAME.key   JSON {"format": "confidant-key", "name", "public", "secret"}, mode 0600 (keep it)

A secret file readable by group or others is refused, as ssh does, since anyone who reads it can
speak for that party.
"""
from __future__ import annotations

import json
import os
import re
import stat
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Mapping

import nacl.bindings
import nacl.exceptions
import nacl.signing

from ir.versioned import check_header
from runtime.transport.security import CurveKeys

KEY_FORMAT = "confidant-key"
SIGNATURE_FORMAT = "confidant-signature"
PUBLIC_PREFIX = "ed25519:"
COORDINATOR_KEY = "coordinator"  # the coordinator's key pair in a key folder: coordinator.key / .pub
_PUBLIC = re.compile(r"ed25519:([0-9a-f]{64})")
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")


class KeyFileError(ValueError):
    """A key or signature that cannot be used; the message names the file and the fix."""


def check_key_name(name: str) -> str:
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise KeyFileError(f"key name {name!r} must be 1-64 letters, digits, '.', '_' or '-', starting with a "
                           f"letter or digit (it names the files NAME.key and NAME.pub)")
    return name


@dataclass(frozen=True)
class PublicKey:
    """An Ed25519 public key (32 raw bytes): verifies signatures, and gives the CURVE public key."""

    raw: bytes

    def __post_init__(self) -> None:
        if not isinstance(self.raw, bytes) or len(self.raw) != 32:
            raise KeyFileError("an Ed25519 public key is 32 bytes")

    @classmethod
    def parse(cls, text: str, where: str = "public key") -> PublicKey:
        """'ed25519:<64 hex>' (as in a .pub file's first word or a cluster file's `key:`)."""
        match = _PUBLIC.fullmatch(text.strip()) if isinstance(text, str) else None
        if match is None:
            raise KeyFileError(f"{where}: {str(text)[:80]!r} is not a public key ('ed25519:' and 64 lowercase hex "
                               f"digits, as `confidant keys` writes in NAME.pub)")
        try:
            key = cls(bytes.fromhex(match.group(1)))
            key.curve  # a point not on the curve has no Curve25519 form: refuse it here, not in a handshake
        except (ValueError, nacl.exceptions.CryptoError):
            raise KeyFileError(f"{where}: {text.strip()[:20]}... is not a valid Ed25519 point") from None
        return key

    @property
    def text(self) -> str:
        return PUBLIC_PREFIX + self.raw.hex()

    @property
    def fingerprint(self) -> str:
        """A short form for messages (not for trust decisions)."""
        return self.raw.hex()[:12]

    @property
    def curve(self) -> bytes:
        return nacl.bindings.crypto_sign_ed25519_pk_to_curve25519(self.raw)

    def verify(self, data: bytes, signature: bytes) -> bool:
        try:
            nacl.signing.VerifyKey(self.raw).verify(bytes(data), bytes(signature))
            return True
        except (nacl.exceptions.BadSignatureError, ValueError, TypeError):
            return False

    def __str__(self) -> str:
        return self.text


@dataclass(frozen=True)
class KeyPair:
    """A party's identity: its name, public key and 32-byte Ed25519 seed (never shown by repr)."""

    name: str
    public: PublicKey
    seed: bytes = field(repr=False)

    @classmethod
    def generate(cls, name: str) -> KeyPair:
        signing = nacl.signing.SigningKey.generate()
        return cls(check_key_name(name), PublicKey(bytes(signing.verify_key)), bytes(signing))

    @classmethod
    def from_seed(cls, name: str, seed: bytes) -> KeyPair:
        signing = nacl.signing.SigningKey(seed)
        return cls(name, PublicKey(bytes(signing.verify_key)), bytes(seed))

    def sign(self, data: bytes) -> bytes:
        return nacl.signing.SigningKey(self.seed).sign(bytes(data)).signature

    def curve_keys(self) -> CurveKeys:
        """This identity's CURVE key pair, for the sockets it opens."""
        secret = nacl.bindings.crypto_sign_ed25519_sk_to_curve25519(self.seed + self.public.raw)
        return CurveKeys(self.public.curve, secret)


# --- files ---------------------------------------------------------------------------------------

def write_keypair(directory: str | Path, pair: KeyPair, overwrite: bool = False) -> tuple[Path, Path]:
    """NAME.key (mode 0600) and NAME.pub in `directory`; an existing key is kept unless `overwrite`."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    secret, public = directory / f"{pair.name}.key", directory / f"{pair.name}.pub"
    if secret.exists() and not overwrite:
        raise KeyFileError(f"{secret} exists; remove it first to replace that identity (every party that trusts "
                           f"its public key would then need the new {public.name})")
    doc = {"format": KEY_FORMAT, "name": pair.name, "public": pair.public.text, "secret": pair.seed.hex()}
    tmp = directory / f".{pair.name}.key.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as out:
        out.write(json.dumps(doc) + "\n")
    os.replace(tmp, secret)
    public.write_text(f"{pair.public.text} {pair.name}\n")
    return secret, public


def read_keypair(path: str | Path) -> KeyPair:
    path = Path(path)
    if not path.is_file():
        raise KeyFileError(f"{path}: no such key file (create one with `confidant keys {path.parent} "
                           f"{path.stem}`)")
    if os.name == "posix" and path.stat().st_mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise KeyFileError(f"{path}: permissions {stat.S_IMODE(path.stat().st_mode):04o} are too open; a secret key "
                           f"must be readable by its owner only (chmod 600 {path})")
    try:
        doc = json.loads(path.read_text())
        check_header(doc, format=KEY_FORMAT, versions=None, where="it", error=ValueError)
        pair = KeyPair.from_seed(check_key_name(doc["name"]), bytes.fromhex(doc["secret"]))
    except (ValueError, KeyError, TypeError, nacl.exceptions.CryptoError) as exc:
        raise KeyFileError(f"{path}: not a secret key file ({exc})") from None
    if pair.public != PublicKey.parse(doc["public"], str(path)):
        raise KeyFileError(f"{path}: its public key does not belong to its secret; the file is damaged")
    return pair


def read_public(path: str | Path) -> PublicKey:
    path = Path(path)
    if not path.is_file():
        raise KeyFileError(f"{path}: no such public key file")
    words = path.read_text().split()
    return PublicKey.parse(words[0] if words else "", str(path))


@dataclass(frozen=True)
class KeyDir:
    """A folder of key files as one party sees it: its own pair, and every public key by name
    (its own included). `own` is the name of the pair whose secret this party holds."""

    directory: Path
    own: KeyPair
    public: Mapping[str, PublicKey]

    @classmethod
    def load(cls, directory: str | Path, own: str) -> KeyDir:
        directory = Path(directory)
        if not directory.is_dir():
            raise KeyFileError(f"--keys {directory}: no such folder (create it with `confidant keys {directory} "
                               f"{COORDINATOR_KEY} DEVICE...`)")
        pair = read_keypair(directory / f"{check_key_name(own)}.key")
        public = {p.stem: read_public(p) for p in sorted(directory.glob("*.pub"))}
        public[pair.name] = pair.public
        return cls(directory, pair, public)

    def key_of(self, name: str) -> PublicKey:
        if name not in self.public:
            raise KeyFileError(f"{self.directory} has no public key for {name!r} ({name}.pub); it holds "
                               f"{sorted(self.public)}")
        return self.public[name]


# --- signatures on bundles -------------------------------------------------------------------------

def signature_file(pair: KeyPair, data: bytes) -> bytes:
    """The signature file of `data` (a bundle's manifest.json): JSON naming the signing key."""
    doc = {"format": SIGNATURE_FORMAT, "key": pair.public.text, "signature": pair.sign(data).hex()}
    return (json.dumps(doc) + "\n").encode("ascii")


def signer(pair: KeyPair) -> Callable[[bytes], bytes]:
    """What `ir.bundle` and `planner.emit` take to sign a manifest: bytes -> signature file bytes."""
    return lambda data: signature_file(pair, data)


def check_signature(trusted: PublicKey, data: bytes, signature: bytes | None) -> None:
    """Raise ValueError, saying why, unless `signature` is a signature file of `data` by `trusted`."""
    if signature is None:
        raise ValueError(f"it is not signed; it must be signed by the coordinator key {trusted.fingerprint}... "
                         f"(write the plan with that coordinator's keys: `confidant plan --keys DIR`)")
    try:
        doc = json.loads(bytes(signature).decode("ascii"))
        check_header(doc, format=SIGNATURE_FORMAT, versions=None, where="it", error=ValueError)
        key = PublicKey.parse(doc["key"], "signature key")
        raw = bytes.fromhex(doc["signature"])
    except (UnicodeDecodeError, ValueError, KeyError, TypeError) as exc:
        raise ValueError(f"its signature file is malformed ({exc})") from None
    if key != trusted:
        raise ValueError(f"it is signed by key {key.fingerprint}..., not by the trusted coordinator key "
                         f"{trusted.fingerprint}...")
    if not trusted.verify(data, raw):
        raise ValueError(f"its signature does not verify with the coordinator key {trusted.fingerprint}...: the "
                         f"manifest was changed after signing")


def verifier(trusted: PublicKey) -> Callable[[bytes, bytes | None], None]:
    """What `ir.bundle.verify_bundle_files` takes to check a manifest's signature."""
    return lambda data, signature: check_signature(trusted, data, signature)


@dataclass(frozen=True)
class ClusterKeys:
    """What a coordinator needs to secure a pipeline: its own pair (its CURVE identity, and the
    key bundles are signed with) and each worker's public key by worker address."""

    coordinator: KeyPair
    workers: Mapping[str, PublicKey]

    def with_workers(self, more: Mapping[str, PublicKey]) -> ClusterKeys:
        return ClusterKeys(self.coordinator, {**self.workers, **more})
