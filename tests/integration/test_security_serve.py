"""`dsec serve` as its own process: what it leaves on disk for other local users (docs/security.md, finding 2) and
HTTPS with a self-signed certificate made here. Everything listens on and talks to 127.0.0.1 only."""

from __future__ import annotations

import datetime
import ipaddress
import os
import ssl
import stat
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest

from dsec.client import Client, Unreachable
from dsec.control.server import free_port

REPO = Path(__file__).resolve().parents[2]
SECRET = "runtime-secret-0123456789-abcdef"


@contextmanager
def dsec_serve(home: Path, *args: str, scheme: str = "http", verify: ssl.SSLContext | bool = True) -> Iterator[str]:
    """``dsec serve`` in a child process with a 022 umask (the usual one: files are world-readable unless made
    otherwise); yields its URL once it answers, and stops it."""
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("DSEC_")}
    env["DSEC_HOME"] = str(home)
    cmd = [sys.executable, "-m", "dsec.cli", "serve", "--port", str(port), "--log-level", "warning", *args]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, umask=0o022)
    url = f"{scheme}://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                if httpx.get(f"{url}/healthz", verify=verify, timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if proc.poll() is not None:
                pytest.fail(f"dsec serve exited {proc.returncode}: {proc.stderr.read().decode()[-2000:]}")  # type: ignore[union-attr]
            if time.monotonic() > deadline:
                pytest.fail("dsec serve did not answer within 60 s")
            time.sleep(0.1)
        yield url
    finally:
        proc.terminate()
        proc.wait(timeout=30)
        assert proc.stderr is not None
        proc.stderr.close()


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_nothing_dsec_serve_writes_is_readable_by_other_users(tmp_path: Path) -> None:
    home = tmp_path / "home"  # does not exist yet: dsec serve creates it
    args = ("--cluster", str(REPO / "examples/cluster.yaml"), "--webhook-allow-private")
    with dsec_serve(home, *args) as url, Client(url, token=(home / "admin.token").read_text().strip()) as admin:
        rt = admin.register_runtime(name="rt", type="dify", callback_url="http://127.0.0.1:9/h", secret=SECRET,
                                    pool="pool-0")  # fmt: skip
        admin.runtime_report(rt["id"], token=rt["runtime_token"], concurrent_agents=1, avg_llm_latency_ms=1.0,
                             function_calling=False)  # fmt: skip
        reg = admin.register("pool-0", token=admin.create_token("pool-0"))
        admin.heartbeat(reg["worker_id"], 1, events=[{"type": "log"}], token=reg["worker_token"])
        admin.put_policies("policies: []\n")
        files = sorted(p for p in home.rglob("*") if p.is_file())
        names = {p.name for p in files}
        assert {"admin.token", "dsec.db", "dsec.db-wal", "dsec.db-shm"} <= names, names
        wider = {p.name: oct(mode(p)) for p in files if mode(p) & 0o077}
        assert wider == {}, f"readable by other users: {wider}"
        assert mode(home) == 0o700
        # Runtime secrets and applied policies live in the (0600) database, not in files of their own.
        assert "runtimes.json" not in names and "policies.yaml" not in names
        holding = {p.name for p in files if SECRET.encode() in p.read_bytes()}
        assert holding <= {"dsec.db", "dsec.db-wal"}, holding


def test_an_old_runtimes_file_moves_into_the_store(tmp_path: Path) -> None:
    home = tmp_path / "home"
    home.mkdir(mode=0o755)
    legacy = home / "runtimes.json"
    legacy.write_text(
        '[{"id": "rt-0123456789ab", "name": "old", "type": "dify", "callback_url": "https://agents.example.com/h", '
        f'"secret": "{SECRET}", "token_hash": "{"0" * 64}", "pool": null, "registered_at": 1.0, "report": {{}}, '
        '"reported_at": null}]'
    )
    with dsec_serve(home) as url, Client(url, token=(home / "admin.token").read_text().strip()) as admin:
        (rt,) = admin.request("GET", "/v1/runtimes")["items"]
        assert rt["id"] == "rt-0123456789ab" and "secret" not in rt
    assert not legacy.exists()


def _self_signed(tmp_path: Path) -> tuple[Path, Path]:
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "dsec test")])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), False)
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(key, hashes.SHA256())
    )
    cert_path, key_path = tmp_path / "cert.pem", tmp_path / "key.pem"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(
        key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    )
    return cert_path, key_path


def test_dsec_serve_speaks_tls_with_the_given_certificate(tmp_path: Path) -> None:
    cert, key = _self_signed(tmp_path)
    trust = ssl.create_default_context(cafile=str(cert))
    home = tmp_path / "home"
    with dsec_serve(home, "--tls-cert", str(cert), "--tls-key", str(key), scheme="https", verify=trust) as url:
        token = (home / "admin.token").read_text().strip()
        with Client(url, token=token, verify=trust) as admin:
            admin.put_pool("pool-a")
            reg = admin.register("pool-a", token=admin.create_token("pool-a"))
            assert admin.heartbeat(reg["worker_id"], 1, token=reg["worker_token"])["duplicate"] is False
        with Client(url, token=token) as untrusting, pytest.raises(Unreachable):
            untrusting.pools()  # the certificate is not one the default CAs vouch for
        with Client(url.replace("https", "http"), token=token) as plain, pytest.raises(Unreachable):
            plain.pools()


def test_tls_needs_both_files(tmp_path: Path) -> None:
    from typer.testing import CliRunner

    from dsec.cli import app

    cert, _key = _self_signed(tmp_path)
    result = CliRunner().invoke(app, ["serve", "--home", str(tmp_path / "h"), "--tls-cert", str(cert)])
    assert result.exit_code == 2 and "--tls-cert and --tls-key go together" in result.output


@pytest.mark.parametrize(("variable", "value"), [("DSEC_MEMORY_PRESSURE", "high"), ("DSEC_COST_DEVICE_HOUR", "cheap")])
def test_a_bad_setting_in_the_environment_is_an_error_naming_it_not_a_traceback(
    tmp_path: Path, variable: str, value: str
) -> None:
    from typer.testing import CliRunner

    from dsec.cli import app

    result = CliRunner().invoke(app, ["serve", "--home", str(tmp_path / "h")], env={variable: value})
    assert result.exit_code == 2 and f"{variable}={value!r} is invalid" in result.output, result.output
    assert "Traceback" not in result.output
