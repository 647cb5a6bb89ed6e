"""Helpers for the security tests: a throwaway CA and a server certificate (the ``cryptography``
package), a child process started on a given loopback address with extra environment and
stopped by PID, and a scan of log files for secrets."""
from __future__ import annotations

import datetime
import ipaddress
import os
import re
import subprocess
import sys
import time

import httpx

from server_utils import child_env, stop


def make_tls(folder: str, hosts: tuple[str, ...] = ("127.0.0.1", "127.0.0.2")) -> dict[str, str]:
    """A CA and a certificate for ``hosts`` (IP SANs) signed by it: paths of ca, cert and key."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID
    now = datetime.datetime.now(datetime.timezone.utc)

    def cert(subject, issuer, public_key, signer, ca: bool, sans=None):
        b = (x509.CertificateBuilder().subject_name(subject).issuer_name(issuer)
             .public_key(public_key).serial_number(x509.random_serial_number())
             .not_valid_before(now - datetime.timedelta(minutes=5))
             .not_valid_after(now + datetime.timedelta(days=1))
             .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True))
        if sans:
            b = b.add_extension(x509.SubjectAlternativeName(sans), critical=False)
        return b.sign(signer, hashes.SHA256())

    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "minivllm test CA")])
    ca = cert(ca_name, ca_name, ca_key.public_key(), ca_key, True)
    key = ec.generate_private_key(ec.SECP256R1())
    sans = [x509.IPAddress(ipaddress.ip_address(h)) for h in hosts] + [x509.DNSName("localhost")]
    leaf = cert(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, hosts[0])]), ca_name,
                key.public_key(), ca_key, False, sans)
    paths = {n: os.path.join(folder, f"{n}.pem") for n in ("ca", "cert", "key")}
    pem = serialization.Encoding.PEM
    open(paths["ca"], "wb").write(ca.public_bytes(pem))
    open(paths["cert"], "wb").write(leaf.public_bytes(pem))
    open(paths["key"], "wb").write(key.private_bytes(pem, serialization.PrivateFormat.PKCS8,
                                                     serialization.NoEncryption()))
    return paths


def start(module_args: list[str], log_path: str, url: str, ready: str = "/health",
          env: dict | None = None, verify=True, timeout: float = 180.0) -> subprocess.Popen:
    """``python -m MODULE_ARGS`` (its output in ``log_path``), ready when ``url + ready`` is 200."""
    proc = subprocess.Popen([sys.executable, "-m", *module_args], stdout=open(log_path, "w"),
                            stderr=subprocess.STDOUT, env=child_env(**(env or {})))
    deadline = time.monotonic() + timeout
    try:
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"{module_args[0]} exited ({proc.returncode}):\n"
                                   f"{open(log_path).read()[-3000:]}")
            try:
                if httpx.get(url + ready, timeout=2, verify=verify).status_code == 200:
                    return proc
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"{url} not ready after {timeout} s:\n"
                                   f"{open(log_path).read()[-3000:]}")
            time.sleep(0.3)
    except BaseException:
        stop(proc)
        raise


def assert_no_secrets(paths: list[str], secrets: list[str], allowed: dict | None = None) -> None:
    """No secret in any file of ``paths``; ``allowed``: {path: (secret, times)}, shown on
    purpose."""
    assert paths and all(s for s in secrets)
    for path in paths:
        text = open(path, errors="replace").read()
        for s in secrets:
            want = (allowed or {}).get(path, (None, 0))
            n = text.count(s)
            assert n == (want[1] if want[0] == s else 0), f"{path}: a secret appears {n} times"


def metric(url: str, name: str, verify=True) -> float:
    """One sample of ``GET /metrics`` (``server_utils.metric``, over HTTPS too)."""
    text = httpx.get(url + "/metrics", timeout=10, verify=verify).text
    m = re.search(rf"^{re.escape(name)}\{{[^}}]*\}} (\S+)$", text, re.M)
    assert m is not None, f"{name} missing from /metrics"
    return float(m.group(1))
