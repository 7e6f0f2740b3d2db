"""A throw-away PKI for the secured test broker, made locally with the ``openssl`` and ``keytool`` CLIs.

``make_pki(dir)`` writes, once (files that exist are kept; anything derived from a CA that had to be
made again is made again too):

* ``ca.pem`` / ``ca.key``: the CA that signs the broker's and the client's certificates;
* ``broker.pem`` / ``broker.key`` / ``broker.p12``: the broker's certificate (SAN ``IP:127.0.0.1``,
  ``DNS:localhost``), its key, and the PKCS12 keystore the broker loads (password ``brokerpass``);
* ``truststore.p12`` (PKCS12) and ``truststore.jks`` (JKS): the CA as a trusted entry, password ``trustpass``;
* ``client.pem`` / ``client.key`` (unencrypted) / ``client.p12`` (password ``keypass``): a client certificate;
* ``other-ca.pem`` / ``other-ca.key`` / ``other-truststore.p12``: an unrelated CA, for "untrusted" tests.

RSA 2048, SHA-256, ten years. Standard library only, like ``kafka_broker.py``.
"""

from __future__ import annotations

import os
import secrets
import subprocess
import sys
from pathlib import Path

DAYS = 3650
BROKER_KEYSTORE_PASSWORD = "brokerpass"
TRUSTSTORE_PASSWORD = "trustpass"
CLIENT_KEYSTORE_PASSWORD = "keypass"

_OPENSSL_CNF = """\
[req]
distinguished_name = dn
prompt = no
[dn]
CN = unused
[ca]
basicConstraints = critical, CA:TRUE
keyUsage = critical, keyCertSign, cRLSign
subjectKeyIdentifier = hash
[server]
basicConstraints = critical, CA:FALSE
keyUsage = critical, digitalSignature, keyEncipherment
extendedKeyUsage = serverAuth, clientAuth
subjectAltName = IP:127.0.0.1, DNS:localhost
subjectKeyIdentifier = hash
authorityKeyIdentifier = keyid
[client]
basicConstraints = critical, CA:FALSE
keyUsage = critical, digitalSignature, keyEncipherment
extendedKeyUsage = clientAuth
subjectKeyIdentifier = hash
authorityKeyIdentifier = keyid
"""


class PkiError(RuntimeError):
    """openssl or keytool failed."""


def _run(*cmd: str) -> None:
    result = subprocess.run(cmd, capture_output=True, text=True, stdin=subprocess.DEVNULL, check=False)
    if result.returncode != 0:
        raise PkiError(f"{' '.join(cmd)} failed ({result.returncode}):\n{result.stdout}{result.stderr}")


def _tmp(path: Path) -> Path:
    """A sibling to write to first, so an interrupted run never leaves a half-made file that looks done."""
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.unlink(missing_ok=True)
    return tmp


def _ca(cnf: Path, cert: Path, key: Path, cn: str) -> None:
    key_tmp, cert_tmp = _tmp(key), _tmp(cert)
    _run("openssl", "req", "-x509", "-new", "-newkey", "rsa:2048", "-nodes", "-sha256", "-days", str(DAYS),
         "-config", str(cnf), "-extensions", "ca", "-subj", f"/CN={cn}",
         "-keyout", str(key_tmp), "-out", str(cert_tmp))
    os.replace(key_tmp, key)
    os.replace(cert_tmp, cert)


def _signed(cnf: Path, ca_cert: Path, ca_key: Path, cert: Path, key: Path, cn: str, extensions: str) -> None:
    key_tmp, cert_tmp, csr = _tmp(key), _tmp(cert), _tmp(cert.with_suffix(".csr"))
    _run("openssl", "req", "-new", "-newkey", "rsa:2048", "-nodes", "-config", str(cnf), "-subj", f"/CN={cn}",
         "-keyout", str(key_tmp), "-out", str(csr))
    _run("openssl", "x509", "-req", "-in", str(csr), "-CA", str(ca_cert), "-CAkey", str(ca_key),
         "-set_serial", f"0x{secrets.token_hex(16)}", "-sha256", "-days", str(DAYS),
         "-extfile", str(cnf), "-extensions", extensions, "-out", str(cert_tmp))
    csr.unlink()
    os.replace(key_tmp, key)
    os.replace(cert_tmp, cert)


def _pkcs12(cert: Path, key: Path, ca_cert: Path, out: Path, alias: str, password: str) -> None:
    tmp = _tmp(out)
    _run("openssl", "pkcs12", "-export", "-in", str(cert), "-inkey", str(key), "-certfile", str(ca_cert),
         "-name", alias, "-passout", f"pass:{password}", "-out", str(tmp))
    os.replace(tmp, out)


def _truststore(ca_cert: Path, out: Path, store_type: str) -> None:
    # keytool, not openssl: Java only trusts PKCS12 certificate entries that carry its trusted-key-usage
    # attribute, which OpenSSL 3.0's `pkcs12 -export -nokeys` does not write.
    tmp = _tmp(out)
    _run("keytool", "-importcert", "-noprompt", "-alias", "ca", "-file", str(ca_cert), "-keystore", str(tmp),
         "-storetype", store_type, "-storepass", TRUSTSTORE_PASSWORD)
    os.replace(tmp, out)


def make_pki(directory: Path | str) -> dict[str, Path]:
    """Makes the PKI in directory unless it is there already; returns the paths by role."""
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    p = {
        "ca": d / "ca.pem",
        "ca_key": d / "ca.key",
        "broker_cert": d / "broker.pem",
        "broker_key": d / "broker.key",
        "broker_keystore": d / "broker.p12",
        "truststore_p12": d / "truststore.p12",
        "truststore_jks": d / "truststore.jks",
        "client_cert": d / "client.pem",
        "client_key": d / "client.key",
        "client_p12": d / "client.p12",
        "other_ca": d / "other-ca.pem",
        "other_ca_key": d / "other-ca.key",
        "other_truststore_p12": d / "other-truststore.p12",
    }
    cnf = d / "openssl.cnf"
    cnf.write_text(_OPENSSL_CNF)

    def missing(*keys: str) -> bool:
        return not all(p[k].exists() for k in keys)

    remake = missing("ca", "ca_key")
    if remake:
        _ca(cnf, p["ca"], p["ca_key"], "lastagent test CA")
    if remake or missing("broker_cert", "broker_key"):
        _signed(cnf, p["ca"], p["ca_key"], p["broker_cert"], p["broker_key"], "localhost", "server")
        p["broker_keystore"].unlink(missing_ok=True)
    if missing("broker_keystore"):
        _pkcs12(p["broker_cert"], p["broker_key"], p["ca"], p["broker_keystore"], "broker", BROKER_KEYSTORE_PASSWORD)
    for key, store_type in (("truststore_p12", "PKCS12"), ("truststore_jks", "JKS")):
        if remake or missing(key):
            p[key].unlink(missing_ok=True)
            _truststore(p["ca"], p[key], store_type)
    if remake or missing("client_cert", "client_key"):
        _signed(cnf, p["ca"], p["ca_key"], p["client_cert"], p["client_key"], "lastagent-client", "client")
        p["client_p12"].unlink(missing_ok=True)
    if missing("client_p12"):
        _pkcs12(p["client_cert"], p["client_key"], p["ca"], p["client_p12"], "client", CLIENT_KEYSTORE_PASSWORD)
    if missing("other_ca", "other_ca_key"):
        _ca(cnf, p["other_ca"], p["other_ca_key"], "unrelated CA")
        p["other_truststore_p12"].unlink(missing_ok=True)
    if missing("other_truststore_p12"):
        _truststore(p["other_ca"], p["other_truststore_p12"], "PKCS12")
    return p


if __name__ == "__main__":
    for role, path in make_pki(Path(sys.argv[1] if len(sys.argv) > 1 else "pki")).items():
        print(f"{role:22} {path}")
