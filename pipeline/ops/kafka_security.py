"""A secured local Kafka: TLS certificates, SCRAM users for each voicebus role, the broker's
security properties and the client settings each role exports.

`voicebus kafka start --secure` serves clients on one SASL_SSL listener (SCRAM-SHA-512 over TLS,
the shape of a managed cluster); the KRaft controller listener is mutual TLS (the node's own
certificate); the StandardAuthorizer refuses whatever no ACL allows. Everything is generated once
per state directory, under ``<data dir>/security``: a CA, the broker's certificate (signed by the
CA, valid for 127.0.0.1 and localhost), one random password per role (files readable by their
owner only). Users exist from the first start: `kafka-storage format --add-scram` writes them into
the cluster's bootstrap metadata, which is also what lets the broker authenticate to itself.

Clients are told where the secrets are, never the secrets: `client_settings_env` gives the
``VOICEBUS_KAFKA_*`` variables of a role with ``VOICEBUS_KAFKA_SASL_PASSWORD_FILE``.
"""

from __future__ import annotations

import datetime
import ipaddress
import os
import secrets
from dataclasses import dataclass
from pathlib import Path

ROLES = ("admin", "agent", "gate", "worker", "edge")
MECHANISM = "SCRAM-SHA-512"
BROKER_CN = "voicebus-broker"
CERT_DAYS = 825


class SecurityMaterialError(RuntimeError):
    """The generated certificates or passwords could not be written or read."""


@dataclass(frozen=True)
class SecurityMaterial:
    """The files of one secured local broker (or cluster): CA, node certificate, role passwords."""

    directory: Path

    @property
    def ca_file(self) -> Path:
        return self.directory / "ca.pem"

    @property
    def node_pem(self) -> Path:
        """The node's private key (PKCS#8) and certificate chain, one PEM file (Kafka's PEM keystore)."""
        return self.directory / "node.pem"

    def password_file(self, role: str) -> Path:
        if role not in ROLES:
            raise ValueError(f"unknown role {role!r}: one of {', '.join(ROLES)}")
        return self.directory / f"{role}.password"

    def password(self, role: str) -> str:
        return self.password_file(role).read_text().strip()

    @property
    def complete(self) -> bool:
        return self.ca_file.exists() and self.node_pem.exists() and all(self.password_file(r).exists() for r in ROLES)

    def ensure(self) -> "SecurityMaterial":
        """Generate what is missing (idempotent: an existing CA, certificate or password is kept,
        so a restarted broker and its clients keep agreeing)."""
        self.directory.mkdir(parents=True, exist_ok=True)
        os.chmod(self.directory, 0o700)
        if not (self.ca_file.exists() and self.node_pem.exists()):
            ca_pem, node_pem = _certificates()
            _write_private(self.node_pem, node_pem)
            self.ca_file.write_bytes(ca_pem)
        for role in ROLES:
            path = self.password_file(role)
            if not path.exists():
                _write_private(path, secrets.token_urlsafe(24).encode() + b"\n")
        return self


def _write_private(path: Path, data: bytes) -> None:
    """Write a secret readable by its owner only (created with that mode: never world-readable)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as out:
        out.write(data)


def _certificates() -> tuple[bytes, bytes]:
    """A new CA and a node certificate it signs: (CA certificate PEM, node key + chain PEM)."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    now = datetime.datetime.now(datetime.timezone.utc)
    valid = (now - datetime.timedelta(minutes=5), now + datetime.timedelta(days=CERT_DAYS))
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "voicebus local CA")])
    ca = (x509.CertificateBuilder().subject_name(ca_name).issuer_name(ca_name).public_key(ca_key.public_key())
          .serial_number(x509.random_serial_number()).not_valid_before(valid[0]).not_valid_after(valid[1])
          .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
          .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                       content_commitment=False, key_encipherment=False, data_encipherment=False,
                                       key_agreement=False, encipher_only=False, decipher_only=False), critical=True)
          .sign(ca_key, hashes.SHA256()))
    node_key = ec.generate_private_key(ec.SECP256R1())
    node = (x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, BROKER_CN)]))
            .issuer_name(ca_name).public_key(node_key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(valid[0]).not_valid_after(valid[1])
            .add_extension(x509.SubjectAlternativeName([
                x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), critical=False)
            # the node is a TLS server to clients and a TLS client of the controller listener
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]),
                           critical=False)
            .sign(ca_key, hashes.SHA256()))
    pem = serialization.Encoding.PEM
    key_pem = node_key.private_bytes(pem, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    return ca.public_bytes(pem), key_pem + node.public_bytes(pem) + ca.public_bytes(pem)


def broker_properties(material: SecurityMaterial, listener_name: str = "SASL_SSL") -> dict[str, str]:
    """The server.properties entries of a secured node (its listeners are set by the caller:
    clients on ``SASL_SSL``, the controller quorum on ``CONTROLLER`` over mutual TLS)."""
    admin_password = material.password("admin")
    jaas = (f'org.apache.kafka.common.security.scram.ScramLoginModule required username="admin" '
            f'password="{admin_password}";')
    return {
        "listener.security.protocol.map": f"{listener_name}:SASL_SSL,CONTROLLER:SSL",
        "inter.broker.listener.name": listener_name,
        "sasl.enabled.mechanisms": MECHANISM,
        "sasl.mechanism.inter.broker.protocol": MECHANISM,
        f"listener.name.{listener_name.lower()}.{MECHANISM.lower()}.sasl.jaas.config": jaas,
        "ssl.keystore.type": "PEM",
        "ssl.keystore.location": str(material.node_pem),
        "ssl.truststore.type": "PEM",
        "ssl.truststore.location": str(material.ca_file),
        "listener.name.controller.ssl.client.auth": "required",
        "authorizer.class.name": "org.apache.kafka.metadata.authorizer.StandardAuthorizer",
        # admin administers; the node (its certificate) runs the quorum and replication
        "super.users": f"User:admin;User:CN={BROKER_CN}",
        "allow.everyone.if.no.acl.found": "false",
    }


def scram_format_args(material: SecurityMaterial) -> list[str]:
    """``kafka-storage format`` arguments that create every role's SCRAM user."""
    args: list[str] = []
    for role in ROLES:
        args += ["--add-scram", f"{MECHANISM}=[name={role},password={material.password(role)}]"]
    return args


def client_settings_env(material: SecurityMaterial, role: str, bootstrap: str) -> dict[str, str]:
    """The ``VOICEBUS_*`` variables a process of `role` exports to use the secured broker: the
    password as a file, never its value."""
    return {
        "VOICEBUS_BOOTSTRAP": bootstrap,
        "VOICEBUS_KAFKA_SECURITY_PROTOCOL": "SASL_SSL",
        "VOICEBUS_KAFKA_SASL_MECHANISM": MECHANISM,
        "VOICEBUS_KAFKA_SASL_USERNAME": role,
        "VOICEBUS_KAFKA_SASL_PASSWORD_FILE": str(material.password_file(role)),
        "VOICEBUS_KAFKA_SSL_CAFILE": str(material.ca_file),
    }
