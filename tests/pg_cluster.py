"""A throwaway PostgreSQL cluster for tests (the ``postgres_url`` session fixture, registered in conftest.py) and for
benchmarks (``throwaway_postgres``: benchmarks/soak.py --postgres).

initdb (from /usr/lib/postgresql/*/bin, or on PATH) creates a cluster in a temporary directory owned by the
``postgres`` user when running as root; it is started on a free port of 127.0.0.1 and removed at the end of the
session. Without initdb or psycopg the fixture skips the test, with the reason. ``reset_postgres(url)`` empties the
database between tests.
"""

from __future__ import annotations

import contextlib
import glob
import os
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from dsec.control.server import free_port


def _pg_bin() -> Path | None:
    found = sorted(
        glob.glob("/usr/lib/postgresql/*/bin/initdb"),
        key=lambda p: int(Path(p).parts[-3]) if Path(p).parts[-3].isdigit() else 0,
    )
    if found:
        return Path(found[-1]).parent
    initdb = shutil.which("initdb")
    return Path(initdb).parent if initdb else None


def _as_postgres(args: list[str]) -> list[str]:
    """initdb and pg_ctl refuse to run as root: run them as the postgres user then."""
    if os.geteuid() != 0:
        return args
    if shutil.which("runuser"):
        return ["runuser", "-u", "postgres", "--", *args]
    import shlex

    return ["su", "postgres", "-s", "/bin/sh", "-c", shlex.join(args)]


def _run(args: list[str], what: str) -> None:
    proc = subprocess.run(args, capture_output=True, text=True, timeout=120, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"{what} failed ({proc.returncode}): {proc.stdout}\n{proc.stderr}")


class Unavailable(Exception):
    """PostgreSQL cannot be started here; the message says what is missing."""


@contextlib.contextmanager
def throwaway_postgres() -> Iterator[str]:
    """A fresh PostgreSQL cluster on a free port of 127.0.0.1 (fsync off: a throwaway), its ``dsec`` database's
    SQLAlchemy URL while the block runs; stopped and removed after. ``Unavailable`` when initdb, psycopg or the
    ``postgres`` user (when root) is missing; RuntimeError when the cluster does not start."""
    bindir = _pg_bin()
    if bindir is None:
        raise Unavailable("PostgreSQL not installed: no initdb under /usr/lib/postgresql/*/bin or on PATH")
    try:
        import psycopg  # noqa: F401
    except ImportError:
        raise Unavailable("psycopg is not installed (pip install 'dsec[postgres]')") from None
    if os.geteuid() == 0:
        try:
            import pwd

            pg_user = pwd.getpwnam("postgres")
        except KeyError:
            raise Unavailable("running as root and there is no 'postgres' user to run initdb as") from None
    root = Path(tempfile.mkdtemp(prefix="dsec-pg-"))
    data, sock, log = root / "data", root / "sock", root / "postgres.log"
    sock.mkdir()
    if os.geteuid() == 0:
        for p in (root, sock):
            os.chown(p, pg_user.pw_uid, pg_user.pw_gid)
    port = free_port()
    pg_ctl = str(bindir / "pg_ctl")
    try:
        _run(
            _as_postgres(
                [str(bindir / "initdb"), "-D", str(data), "-U", "postgres", "-A", "trust", "-E", "UTF8", "--no-sync"]
            ),
            "initdb",
        )
        opts = f"-p {port} -k {sock} -c listen_addresses=127.0.0.1 -c fsync=off -c full_page_writes=off"
        _run(
            _as_postgres([pg_ctl, "-D", str(data), "-o", opts, "-l", str(log), "-w", "-t", "60", "start"]),
            "pg_ctl start",
        )
        _run([str(bindir / "createdb"), "-h", "127.0.0.1", "-p", str(port), "-U", "postgres", "dsec"], "createdb")
    except (RuntimeError, OSError, subprocess.SubprocessError) as exc:
        _stop_postgres(pg_ctl, data, root)
        log_tail = log.read_text()[-2000:] if log.exists() else ""
        raise RuntimeError(f"could not start PostgreSQL: {exc}\n{log_tail}") from exc
    try:
        yield f"postgresql+psycopg://postgres@127.0.0.1:{port}/dsec"
    finally:
        _stop_postgres(pg_ctl, data, root)


@pytest.fixture(scope="session")
def postgres_url() -> Iterator[str]:
    try:
        cluster = throwaway_postgres()
        url = cluster.__enter__()
    except Unavailable as exc:
        pytest.skip(str(exc))
    except RuntimeError as exc:
        pytest.fail(str(exc))
    try:
        yield url
    finally:
        cluster.__exit__(None, None, None)


def _stop_postgres(pg_ctl: str, data: Path, root: Path) -> None:
    if (data / "postmaster.pid").exists():
        subprocess.run(
            _as_postgres([pg_ctl, "-D", str(data), "stop", "-m", "immediate", "-w"]),
            capture_output=True,
            timeout=60,
            check=False,
        )
    shutil.rmtree(root, ignore_errors=True)


def reset_postgres(url: str) -> None:
    """An empty database for the next test: drop and recreate the public schema."""
    import psycopg

    dsn = url.replace("postgresql+psycopg://", "postgresql://")
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("DROP SCHEMA public CASCADE")
        conn.execute("CREATE SCHEMA public")
