"""TLS for tests: certificates made with openssl, and the sockets a process holds."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path


def make_certificates(directory: Path, client_cn: str) -> dict[str, str]:
    """A CA, a server certificate for 127.0.0.1/localhost and a client certificate
    with CN ``client_cn``, made with openssl in ``directory``."""

    def run(*args: str) -> None:
        subprocess.run(["openssl", *args], check=True, capture_output=True, timeout=60)

    files = {name: str(directory / name) for name in ("ca.pem", "ca.key")}
    run("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
        "-subj", "/CN=hopsched-amqp-test-ca", "-keyout", files["ca.key"],
        "-out", files["ca.pem"])  # fmt: skip
    for name, cn, extension in (
        ("server", "localhost", "subjectAltName=IP:127.0.0.1,DNS:localhost\n"),
        ("client", client_cn, "extendedKeyUsage=clientAuth\n"),
    ):
        key, csr, pem = (str(directory / f"{name}.{kind}") for kind in ("key", "csr", "pem"))
        ext = directory / f"{name}.ext"
        ext.write_text(extension)
        run("req", "-newkey", "rsa:2048", "-nodes", "-subj", f"/CN={cn}",
            "-keyout", key, "-out", csr)  # fmt: skip
        run("x509", "-req", "-in", csr, "-CA", files["ca.pem"], "-CAkey", files["ca.key"],
            "-CAcreateserial", "-days", "1", "-extfile", str(ext), "-out", pem)  # fmt: skip
        files[f"{name}.pem"], files[f"{name}.key"] = pem, key
    return files


def sockets_to(port: int) -> list[str]:
    """The inodes of this process's IPv4 TCP sockets whose peer is ``port``
    (``/proc/net/tcp``, Linux): the client ends of connections to a local server."""
    ours = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            link = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:  # closed since listed
            continue
        if link.startswith("socket:["):
            ours.add(link[len("socket:[") : -1])
    found = []
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        fields = line.split()
        peer_port, inode = int(fields[2].rsplit(":", 1)[1], 16), fields[9]
        if peer_port == port and inode in ours:
            found.append(inode)
    return found
