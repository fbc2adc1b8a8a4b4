"""Certificates for a throw-away control plane, made per run with the `openssl` command,
and the kubeconfig that uses them."""

from __future__ import annotations

import base64
import subprocess
from collections.abc import Sequence
from pathlib import Path

import yaml


def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True)


def make_pki(pki: Path, api_ips: Sequence[str] = ()) -> None:
    """A throw-away CA, the API server's serving cert (for loopback, the `kubernetes`
    Service and `api_ips`), an admin client cert (group system:masters) and the
    service-account signing key pair."""
    pki.mkdir(parents=True, exist_ok=True)
    ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
    _openssl(
        "req",
        "-x509",
        *ec,
        "-keyout",
        "ca.key",
        "-out",
        "ca.crt",
        "-days",
        "3650",
        "-subj",
        "/CN=rlhf-test-ca",
        "-addext",
        "basicConstraints=critical,CA:TRUE",
        "-addext",
        "keyUsage=critical,keyCertSign,cRLSign",
        cwd=pki,
    )
    leaf_certificate(
        pki,
        "apiserver",
        "/CN=kube-apiserver",
        "serverAuth",
        [
            "IP:127.0.0.1",
            "IP:10.0.0.1",
            *[f"IP:{ip}" for ip in api_ips],
            "DNS:localhost",
            "DNS:kubernetes",
            "DNS:kubernetes.default",
            "DNS:kubernetes.default.svc",
            "DNS:kubernetes.default.svc.cluster.local",
        ],
    )
    leaf_certificate(pki, "admin", "/O=system:masters/CN=rlhf-test-admin", "clientAuth", [])
    _openssl(
        "genpkey",
        "-algorithm",
        "RSA",
        "-pkeyopt",
        "rsa_keygen_bits:2048",
        "-out",
        "sa.key",
        cwd=pki,
    )
    _openssl("pkey", "-in", "sa.key", "-pubout", "-out", "sa.pub", cwd=pki)


def leaf_certificate(pki: Path, name: str, subject: str, usage: str, sans: list[str]) -> None:
    """`name`.key and `name`.crt in `pki`, signed by its CA, for `usage` (serverAuth or
    clientAuth) and the subject alternative names `sans`."""
    ext = [
        "basicConstraints=critical,CA:FALSE",
        "keyUsage=critical,digitalSignature,keyEncipherment",
        f"extendedKeyUsage={usage}",
    ]
    if sans:
        ext.append("subjectAltName=" + ",".join(sans))
    (pki / f"{name}.ext").write_text("\n".join(ext) + "\n")
    _openssl(
        "req",
        "-new",
        "-newkey",
        "ec",
        "-pkeyopt",
        "ec_paramgen_curve:prime256v1",
        "-nodes",
        "-keyout",
        f"{name}.key",
        "-out",
        f"{name}.csr",
        "-subj",
        subject,
        cwd=pki,
    )
    _openssl(
        "x509",
        "-req",
        "-in",
        f"{name}.csr",
        "-CA",
        "ca.crt",
        "-CAkey",
        "ca.key",
        "-CAcreateserial",
        "-days",
        "3650",
        "-extfile",
        f"{name}.ext",
        "-out",
        f"{name}.crt",
        cwd=pki,
    )


def kubeconfig_yaml(server: str, pki: Path) -> str:
    def b64(name: str) -> str:
        return base64.b64encode((pki / name).read_bytes()).decode()

    return yaml.safe_dump(
        {
            "apiVersion": "v1",
            "kind": "Config",
            "clusters": [
                {
                    "name": "rlhf-test",
                    "cluster": {"server": server, "certificate-authority-data": b64("ca.crt")},
                }
            ],
            "users": [
                {
                    "name": "admin",
                    "user": {
                        "client-certificate-data": b64("admin.crt"),
                        "client-key-data": b64("admin.key"),
                    },
                }
            ],
            "contexts": [
                {"name": "rlhf-test", "context": {"cluster": "rlhf-test", "user": "admin"}}
            ],
            "current-context": "rlhf-test",
        }
    )
