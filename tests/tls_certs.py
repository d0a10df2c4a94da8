"""Throwaway certificates for TLS tests, made with the openssl command line.

    pki = make_pki(tmp_path)
    pki.ca, pki.server_cert, pki.server_key, pki.client_cert, pki.client_key   # Paths (PEM)
    pki.rogue_ca, pki.rogue_client_cert, pki.rogue_client_key                  # another CA's

The server certificate is for `localhost` and `127.0.0.1` (subjectAltName); keys are P-256
(fast to make); everything is valid for one day. Without openssl on PATH it raises: the TLS
tests fail on such a machine, in every module, rather than skip.
"""

from __future__ import annotations

import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

_EC = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]


@dataclass(frozen=True)
class Pki:
    ca: Path
    server_cert: Path
    server_key: Path
    client_cert: Path
    client_key: Path
    rogue_ca: Path
    rogue_client_cert: Path
    rogue_client_key: Path


def _openssl(*args: str, cwd: Path) -> None:
    if shutil.which("openssl") is None:  # fail, never skip: a TLS test that does not run proves nothing
        raise RuntimeError("the TLS tests make their certificates with the openssl command, which is not on PATH "
                           "(Debian: apt-get install openssl)")
    done = subprocess.run(["openssl", *args], cwd=cwd, capture_output=True, text=True, timeout=60)
    if done.returncode != 0:
        raise RuntimeError(f"openssl {' '.join(args)} failed:\n{done.stderr}")


def _ca(directory: Path, name: str) -> tuple[Path, Path]:
    _openssl("req", "-x509", *_EC, "-keyout", f"{name}.key", "-out", f"{name}.pem", "-days", "1",
             "-subj", f"/CN={name}", "-addext", "basicConstraints=critical,CA:TRUE",
             "-addext", "keyUsage=critical,keyCertSign,cRLSign", cwd=directory)
    return directory / f"{name}.pem", directory / f"{name}.key"


def _leaf(directory: Path, name: str, ca: tuple[Path, Path], extensions: str) -> tuple[Path, Path]:
    (directory / f"{name}.ext").write_text(extensions)
    _openssl("req", "-new", *_EC, "-keyout", f"{name}.key", "-out", f"{name}.csr", "-subj", f"/CN={name}",
             cwd=directory)
    _openssl("x509", "-req", "-in", f"{name}.csr", "-CA", str(ca[0]), "-CAkey", str(ca[1]),
             "-CAcreateserial", "-out", f"{name}.pem", "-days", "1", "-extfile", f"{name}.ext", cwd=directory)
    return directory / f"{name}.pem", directory / f"{name}.key"


def make_pki(directory: Path) -> Pki:
    directory.mkdir(parents=True, exist_ok=True)
    ca = _ca(directory, "test-ca")
    server = _leaf(directory, "localhost", ca,
                   "subjectAltName=DNS:localhost,IP:127.0.0.1\nextendedKeyUsage=serverAuth\n"
                   "basicConstraints=CA:FALSE\n")
    client = _leaf(directory, "client", ca, "extendedKeyUsage=clientAuth\nbasicConstraints=CA:FALSE\n")
    rogue_ca = _ca(directory, "rogue-ca")
    rogue_client = _leaf(directory, "rogue-client", rogue_ca,
                         "extendedKeyUsage=clientAuth\nbasicConstraints=CA:FALSE\n")
    return Pki(ca=ca[0], server_cert=server[0], server_key=server[1], client_cert=client[0],
               client_key=client[1], rogue_ca=rogue_ca[0], rogue_client_cert=rogue_client[0],
               rogue_client_key=rogue_client[1])
