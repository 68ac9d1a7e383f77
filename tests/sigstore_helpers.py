"""A private Sigstore instance, made with the ``cryptography`` library, for offline tests.

A Sigstore signature ("keyless") is a bundle: a short-lived certificate a Fulcio CA issued
for the signer's OIDC identity, the signature made with that certificate's key, and the
entry a Rekor log recorded for it. A verifier trusts none of it by itself; it checks it
all against a trust root (``trusted_root.json``, or a client trust config holding one) that
names the CA's certificate, the CT log's key and the Rekor log's key. The public instance
needs the network to sign (OIDC, Fulcio, Rekor); this one is in memory:

- ``ca``: a Fulcio-like root CA. It issues a 10-minute leaf for an ephemeral P-256 key,
  with the identity as its critical SAN (an email, or a URI for a workload), the OIDC
  issuer in Fulcio's two extensions, code-signing EKU, and one embedded precertificate SCT;
- ``ct``: the CT log key that signs that SCT (RFC 6962, over the leaf's TBS without it);
- ``rekor``: a Rekor-like log key. The log is an RFC 6962 Merkle tree of canonicalized
  ``dsse`` 0.0.1 entry bodies; each signing appends one and returns its integrated time,
  its inclusion promise (the SET, signed over the entry), an inclusion proof and a signed
  checkpoint of the tree it is in.

``sign_model`` signs a model directory as ``model_signing``'s Sigstore signer would (the
same in-toto statement over the same manifest, in a DSSE envelope, in a v0.3 bundle
written to the signature file), with this instance standing in for Fulcio and Rekor.
Keys are generated per instance: a second instance is a CA nobody else trusts.
"""

from __future__ import annotations

import base64
import datetime
import hashlib
import json
import struct
from pathlib import Path
from typing import Any

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID, ObjectIdentifier

__all__ = ["PrivateSigstore"]

# Fulcio's extensions for the OIDC issuer: the original one holds the raw string, the
# newer one a DER UTF8String (https://github.com/sigstore/fulcio/blob/main/docs/oid-info.md).
_OIDC_ISSUER = ObjectIdentifier("1.3.6.1.4.1.57264.1.1")
_OIDC_ISSUER_V2 = ObjectIdentifier("1.3.6.1.4.1.57264.1.8")
_SCT_LIST = ObjectIdentifier("1.3.6.1.4.1.11129.2.4.2")
_IN_TOTO = "application/vnd.in-toto+json"
_P256 = "PKIX_ECDSA_P256_SHA_256"
_LEAF_LIFETIME = datetime.timedelta(minutes=10)  # Fulcio's
# Entries other signers made before ours: the inclusion proof then has hashes to check.
_EARLIER_ENTRIES = 5


class PrivateSigstore:
    """One Sigstore instance: its CA, CT log and Rekor log keys, and the log's entries."""

    def __init__(self, name: str = "private-sigstore") -> None:
        """A new instance: its own keys, and a log holding a few other signers' entries."""
        self.name = name
        self.created = _whole_second(datetime.datetime.now(datetime.UTC))
        self.ca_key, self.ct_key, self.rekor_key = _p256(), _p256(), _p256()
        self.ca = _root_certificate(self.ca_key, name, self.created)
        self.log = [f"earlier entry {i}".encode() for i in range(_EARLIER_ENTRIES)]

    # -- the trust root an operator would install --------------------------------------

    def trusted_root(self) -> dict[str, Any]:
        """The ``trusted_root.json`` naming this instance's CA and log keys."""
        start = {"start": _rfc3339(self.created - datetime.timedelta(days=1))}
        return {
            "mediaType": "application/vnd.dev.sigstore.trustedroot+json;version=0.1",
            "tlogs": [self._log_instance(f"https://rekor.{self.name}.invalid", self.rekor_key)],
            "certificateAuthorities": [
                {
                    "subject": {"organization": self.name, "commonName": self.name},
                    "uri": f"https://fulcio.{self.name}.invalid",
                    "certChain": {"certificates": [{"rawBytes": _b64(_der(self.ca))}]},
                    "validFor": start,
                }
            ],
            "ctlogs": [self._log_instance(f"https://ctfe.{self.name}.invalid", self.ct_key)],
            "timestampAuthorities": [],
        }

    def client_trust_config(self) -> dict[str, Any]:
        """The client trust config (``model_signing --trust_config``) around the trust root;
        its services are on ``.invalid`` hosts, so nothing could reach them."""

        def service(url: str) -> dict[str, Any]:
            return {"url": url, "majorApiVersion": 1, "operator": self.name}

        return {
            "mediaType": "application/vnd.dev.sigstore.clienttrustconfig.v0.1+json",
            "trustedRoot": self.trusted_root(),
            "signingConfig": {
                "mediaType": "application/vnd.dev.sigstore.signingconfig.v0.2+json",
                "caUrls": [service(f"https://fulcio.{self.name}.invalid")],
                "oidcUrls": [service(f"https://oauth2.{self.name}.invalid")],
                "rekorTlogUrls": [service(f"https://rekor.{self.name}.invalid")],
                "rekorTlogConfig": {"selector": "ANY"},
            },
        }

    def write_trust_config(self, path: Path, *, bare_root: bool = False) -> Path:
        """The client trust config (or, ``bare_root``, the trusted root alone) at ``path``,
        mode 0644 as an operator would install it."""
        document = self.trusted_root() if bare_root else self.client_trust_config()
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(document, indent=1))
        path.chmod(0o644)
        return path

    def _log_instance(self, url: str, key: ec.EllipticCurvePrivateKey) -> dict[str, Any]:
        spki = _spki(key)
        return {
            "baseUrl": url,
            "hashAlgorithm": "SHA2_256",
            "publicKey": {
                "rawBytes": _b64(spki),
                "keyDetails": _P256,
                "validFor": {"start": _rfc3339(self.created - datetime.timedelta(days=1))},
            },
            "logId": {"keyId": _b64(hashlib.sha256(spki).digest())},
        }

    # -- signing ------------------------------------------------------------------------

    def sign_model(
        self, model: Path, *, identity: str, oidc_issuer: str, signature: str = "model.sig"
    ) -> Path:
        """Sign the directory ``model`` for ``identity`` (as ``oidc_issuer`` vouched for
        it), the bundle written to ``signature`` inside it and left out of what it signs."""
        directory = model.resolve()
        path = directory / signature
        statement = _model_signing_statement(directory, path)
        signing_key = _p256()
        now = _whole_second(datetime.datetime.now(datetime.UTC))
        certificate = self.issue(signing_key.public_key(), identity, oidc_issuer, now)
        envelope = _dsse_envelope(signing_key, statement)
        entry = self._record(certificate, envelope, integrated=now)
        bundle = {
            "mediaType": "application/vnd.dev.sigstore.bundle.v0.3+json",
            "verificationMaterial": {
                "certificate": {"rawBytes": _b64(_der(certificate))},
                "tlogEntries": [entry],
                "timestampVerificationData": {"rfc3161Timestamps": []},
            },
            "dsseEnvelope": envelope,
        }
        path.write_text(json.dumps(bundle))
        return path

    def issue(
        self,
        public_key: ec.EllipticCurvePublicKey,
        identity: str,
        oidc_issuer: str,
        now: datetime.datetime,
    ) -> x509.Certificate:
        """A Fulcio-like leaf for ``public_key``: ``identity`` as its SAN, ``oidc_issuer``
        in Fulcio's extensions, valid 10 minutes from ``now``, with an embedded SCT."""
        san: x509.GeneralName = (
            x509.UniformResourceIdentifier(identity)
            if "://" in identity
            else x509.RFC822Name(identity)
        )
        builder = (
            x509.CertificateBuilder()
            .issuer_name(self.ca.subject)
            .subject_name(x509.Name([]))  # Fulcio's leaves name their subject in the SAN only
            .public_key(public_key)
            .serial_number(x509.random_serial_number())
            .not_valid_before(now)
            .not_valid_after(now + _LEAF_LIFETIME)
            .add_extension(_signing_key_usage(), critical=True)
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.CODE_SIGNING]), False)
            .add_extension(x509.SubjectKeyIdentifier.from_public_key(public_key), False)
            .add_extension(
                x509.AuthorityKeyIdentifier.from_issuer_public_key(self.ca_key.public_key()),
                critical=False,
            )
            .add_extension(x509.SubjectAlternativeName([san]), critical=True)
            .add_extension(x509.UnrecognizedExtension(_OIDC_ISSUER, oidc_issuer.encode()), False)
            .add_extension(
                x509.UnrecognizedExtension(_OIDC_ISSUER_V2, _der_utf8(oidc_issuer)), False
            )
        )
        # The CT log signs the precertificate: the leaf's TBS before the SCT is added.
        precertificate = builder.sign(self.ca_key, hashes.SHA256())
        sct_list = self._sct_list(precertificate.tbs_certificate_bytes, now)
        leaf = builder.add_extension(
            x509.UnrecognizedExtension(_SCT_LIST, _der_octets(sct_list)), critical=False
        ).sign(self.ca_key, hashes.SHA256())
        assert leaf.tbs_precertificate_bytes == precertificate.tbs_certificate_bytes
        return leaf

    def _sct_list(self, tbs: bytes, now: datetime.datetime) -> bytes:
        """A SignedCertificateTimestampList holding this CT log's SCT for ``tbs`` (RFC 6962
        3.2 and 3.3): version 1, the log's key id, the time, no extensions, the signature."""
        milliseconds = int(now.timestamp()) * 1000
        issuer_key_id = hashlib.sha256(_spki(self.ca_key)).digest()
        signed_entry = issuer_key_id + _u24(len(tbs)) + tbs
        signed = struct.pack("!BBQH", 0, 0, milliseconds, 1) + signed_entry + struct.pack("!H", 0)
        signature = self.ct_key.sign(signed, ec.ECDSA(hashes.SHA256()))
        sct = (
            bytes([0])
            + hashlib.sha256(_spki(self.ct_key)).digest()
            + struct.pack("!QH", milliseconds, 0)
            + bytes([4, 3])  # SHA-256, ECDSA
            + struct.pack("!H", len(signature))
            + signature
        )
        return struct.pack("!HH", len(sct) + 2, len(sct)) + sct

    def _record(
        self, certificate: x509.Certificate, envelope: dict[str, Any], integrated: datetime.datetime
    ) -> dict[str, Any]:
        """Append the envelope's ``dsse`` entry to the log; the bundle's tlog entry for it."""
        payload = base64.b64decode(envelope["payload"])
        pem = certificate.public_bytes(serialization.Encoding.PEM)
        body = _canonical(
            {
                "apiVersion": "0.0.1",
                "kind": "dsse",
                "spec": {
                    "envelopeHash": {
                        "algorithm": "sha256",
                        "value": hashlib.sha256(_canonical(envelope)).hexdigest(),
                    },
                    "payloadHash": {
                        "algorithm": "sha256",
                        "value": hashlib.sha256(payload).hexdigest(),
                    },
                    "signatures": [
                        {"signature": envelope["signatures"][0]["sig"], "verifier": _b64(pem)}
                    ],
                },
            }
        )
        self.log.append(body)
        index, size = len(self.log) - 1, len(self.log)
        log_id = hashlib.sha256(_spki(self.rekor_key)).digest()
        integrated_time = int(integrated.timestamp())
        # The SET: the log's promise to include this entry, signed over what it says.
        promise = _canonical(
            {
                "body": _b64(body),
                "integratedTime": integrated_time,
                "logID": log_id.hex(),
                "logIndex": index,
            }
        )
        root = _tree_hash(self.log)
        return {
            "logIndex": str(index),
            "logId": {"keyId": _b64(log_id)},
            "kindVersion": {"kind": "dsse", "version": "0.0.1"},
            "integratedTime": str(integrated_time),
            "inclusionPromise": {"signedEntryTimestamp": _b64(self._rekor_sign(promise))},
            "inclusionProof": {
                "logIndex": str(index),
                "rootHash": _b64(root),
                "treeSize": str(size),
                "hashes": [_b64(h) for h in _audit_path(index, self.log)],
                "checkpoint": {"envelope": self._checkpoint(size, root, log_id)},
            },
            "canonicalizedBody": _b64(body),
        }

    def _checkpoint(self, size: int, root: bytes, log_id: bytes) -> str:
        """The log's signed note for a tree of ``size`` entries with ``root``: origin, size
        and root, then a line of the log's signature (key hint: the log id's first bytes)."""
        note = f"rekor.{self.name}.invalid - {self.name}\n{size}\n{_b64(root)}\n"
        signature = self._rekor_sign(note.encode())
        return f"{note}\n\u2014 rekor.{self.name}.invalid {_b64(log_id[:4] + signature)}\n"

    def _rekor_sign(self, data: bytes) -> bytes:
        return self.rekor_key.sign(data, ec.ECDSA(hashes.SHA256()))


# -- what model_signing signs ------------------------------------------------------------


def _model_signing_statement(model: Path, signature: Path) -> bytes:
    """The in-toto statement model_signing's Sigstore signer puts in the DSSE envelope for
    ``model`` (its manifest, with ``signature`` left out), serialized as it serializes it."""
    from google.protobuf import json_format
    from model_signing import hashing
    from model_signing._signing.signing import Payload  # the statement it signs

    # model-signing's Config() takes no arguments but is not annotated.
    config = hashing.Config().set_ignored_paths(paths=[signature])  # type: ignore[no-untyped-call]
    payload = Payload(config.hash(model))
    return json_format.MessageToJson(payload.statement.pb).encode()


def _dsse_envelope(key: ec.EllipticCurvePrivateKey, statement: bytes) -> dict[str, Any]:
    """A DSSE envelope of ``statement`` signed by ``key`` over its PAE encoding."""
    pae = b"DSSEv1 %d %s %d %s" % (len(_IN_TOTO), _IN_TOTO.encode(), len(statement), statement)
    signature = key.sign(pae, ec.ECDSA(hashes.SHA256()))
    return {
        "payload": _b64(statement),
        "payloadType": _IN_TOTO,
        "signatures": [{"sig": _b64(signature), "keyid": ""}],
    }


# -- the Merkle tree (RFC 6962 2.1) --------------------------------------------------------


def _leaf_hash(entry: bytes) -> bytes:
    return hashlib.sha256(b"\x00" + entry).digest()


def _node_hash(left: bytes, right: bytes) -> bytes:
    return hashlib.sha256(b"\x01" + left + right).digest()


def _split(size: int) -> int:
    """The largest power of two smaller than ``size``: where RFC 6962 splits a tree."""
    return 1 << ((size - 1).bit_length() - 1)


def _tree_hash(entries: list[bytes]) -> bytes:
    if len(entries) == 1:
        return _leaf_hash(entries[0])
    k = _split(len(entries))
    return _node_hash(_tree_hash(entries[:k]), _tree_hash(entries[k:]))


def _audit_path(index: int, entries: list[bytes]) -> list[bytes]:
    """The hashes that prove ``entries[index]`` is in the tree, from the leaf up."""
    if len(entries) == 1:
        return []
    k = _split(len(entries))
    if index < k:
        return [*_audit_path(index, entries[:k]), _tree_hash(entries[k:])]
    return [*_audit_path(index - k, entries[k:]), _tree_hash(entries[:k])]


# -- certificates and encodings ----------------------------------------------------------


def _p256() -> ec.EllipticCurvePrivateKey:
    return ec.generate_private_key(ec.SECP256R1())


def _root_certificate(
    key: ec.EllipticCurvePrivateKey, name: str, now: datetime.datetime
) -> x509.Certificate:
    subject = x509.Name(
        [
            x509.NameAttribute(NameOID.ORGANIZATION_NAME, name),
            x509.NameAttribute(NameOID.COMMON_NAME, name),
        ]
    )
    ca_usage = x509.KeyUsage(
        digital_signature=False,
        content_commitment=False,
        key_encipherment=False,
        data_encipherment=False,
        key_agreement=False,
        key_cert_sign=True,
        crl_sign=True,
        encipher_only=False,
        decipher_only=False,
    )
    return (
        x509.CertificateBuilder()
        .issuer_name(subject)
        .subject_name(subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(days=1))
        .not_valid_after(now + datetime.timedelta(days=3650))
        .add_extension(x509.BasicConstraints(ca=True, path_length=1), critical=True)
        .add_extension(ca_usage, critical=True)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), False)
        .sign(key, hashes.SHA256())
    )


def _signing_key_usage() -> x509.KeyUsage:
    return x509.KeyUsage(
        digital_signature=True,
        content_commitment=False,
        key_encipherment=False,
        data_encipherment=False,
        key_agreement=False,
        key_cert_sign=False,
        crl_sign=False,
        encipher_only=False,
        decipher_only=False,
    )


def _spki(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.public_key().public_bytes(
        serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo
    )


def _der(certificate: x509.Certificate) -> bytes:
    return certificate.public_bytes(serialization.Encoding.DER)


def _der_length(length: int) -> bytes:
    if length < 0x80:
        return bytes([length])
    octets = length.to_bytes((length.bit_length() + 7) // 8, "big")
    return bytes([0x80 | len(octets)]) + octets


def _der_octets(value: bytes) -> bytes:
    return b"\x04" + _der_length(len(value)) + value


def _der_utf8(text: str) -> bytes:
    value = text.encode()
    return b"\x0c" + _der_length(len(value)) + value


def _u24(value: int) -> bytes:
    return value.to_bytes(3, "big")


def _canonical(document: dict[str, Any]) -> bytes:
    # RFC 8785 (what Rekor and sigstore sign) for documents of ASCII strings and integers:
    # sorted keys, no whitespace.
    return json.dumps(document, sort_keys=True, separators=(",", ":")).encode()


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def _rfc3339(moment: datetime.datetime) -> str:
    return moment.strftime("%Y-%m-%dT%H:%M:%SZ")


def _whole_second(moment: datetime.datetime) -> datetime.datetime:
    # SCT times are milliseconds and sigstore converts them back through a float: a whole
    # second survives that exactly.
    return moment.replace(microsecond=0)
