"""A throwaway certificate authority for a secured local broker (`sao broker --secure`).

Kafka reads PEM files directly (`ssl.keystore.type=PEM`, KIP-651), librdkafka and Python's `ssl`
read them too, so no Java keystore and no `keytool` are involved. The CA signs one server
certificate that every node of the cluster presents, valid for the names clients dial (its subject
alternative names) and for mutual TLS between the nodes' controllers (its subject names the
brokers' own principal, `User:CN=sao-broker`).

For anything but local use, bring certificates from your own CA (`--tls-dir` with the same file
names): these are made on the spot, and whoever holds the folder can impersonate the broker.
"""

from __future__ import annotations

import datetime
import ipaddress
from collections.abc import Sequence
from pathlib import Path

from schemas.files import atomic_file

CA_FILE = "ca.pem"
"""The CA certificate every client trusts (`ssl.ca.location`)."""
SERVER_FILE = "broker.pem"
"""The brokers' private key (PKCS#8, unencrypted, mode 0600) followed by its certificate chain."""
BROKER_SUBJECT = "sao-broker"
"""Common name of the server certificate; the brokers authenticate to each other's controllers as
`User:CN=sao-broker` with it."""
DEFAULT_HOSTS = ("localhost", "127.0.0.1")


def make_tls(folder: Path, hosts: Sequence[str] = DEFAULT_HOSTS, days: int = 365) -> Path:
    """A new CA and a server certificate for `hosts` in `folder` (kept if both files exist);
    returns `folder`. The key file is never readable by others."""
    if (folder / CA_FILE).exists() and (folder / SERVER_FILE).exists():
        return folder
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    folder.mkdir(parents=True, exist_ok=True)
    now = datetime.datetime.now(datetime.timezone.utc)
    ca_key, key = ec.generate_private_key(ec.SECP256R1()), ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "sao-stream local CA")])

    def signed(builder: x509.CertificateBuilder) -> x509.Certificate:
        return (builder.issuer_name(ca_name).serial_number(x509.random_serial_number())
                .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=days))
                .sign(ca_key, hashes.SHA256()))

    ca = signed(x509.CertificateBuilder().subject_name(ca_name).public_key(ca_key.public_key())
                .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
                .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                             content_commitment=False, key_encipherment=False, data_encipherment=False,
                                             key_agreement=False, encipher_only=False, decipher_only=False), critical=True))
    names = [x509.IPAddress(ipaddress.ip_address(h)) if _is_ip(h) else x509.DNSName(h) for h in hosts]
    server = signed(x509.CertificateBuilder()
                    .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, BROKER_SUBJECT)]))
                    .public_key(key.public_key())
                    .add_extension(x509.SubjectAlternativeName(names), critical=False)
                    .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
                    # server for clients, client for the other nodes' controllers (mutual TLS)
                    .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH,
                                                          ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False))
    pem = serialization.Encoding.PEM
    atomic_file(folder / SERVER_FILE, key.private_bytes(pem, serialization.PrivateFormat.PKCS8,
                                                        serialization.NoEncryption())
                + server.public_bytes(pem) + ca.public_bytes(pem), mode=0o600)
    atomic_file(folder / CA_FILE, ca.public_bytes(pem))
    return folder


def _is_ip(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
        return True
    except ValueError:
        return False

