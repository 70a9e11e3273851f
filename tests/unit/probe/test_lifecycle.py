"""The SIGTERM handler chains without changing what the signal does (run in child interpreters: signals and pytest
do not mix)."""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap

PRELUDE = """
import os, signal, sys, threading, time
from dsec.probe.lifecycle import SigtermChain
calls = []
def note(what):
    print(what, flush=True)
"""


def _run(body: str, timeout: float = 30) -> subprocess.CompletedProcess[str]:
    code = PRELUDE + textwrap.dedent(body)
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout, check=False)


def test_default_action_kept_after_the_close() -> None:
    out = _run(
        """
        chain = SigtermChain(lambda r: note("close " + r), lambda r: note("fallback"), lambda r: note("noted"))
        assert chain.install()
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(5)
        note("survived")
        """
    )
    assert out.returncode == -signal.SIGTERM
    assert out.stdout.split("\n")[:1] == ["close sigterm"] and "survived" not in out.stdout


def test_a_hanging_close_falls_back_to_a_bare_deregistration_in_bounded_time() -> None:
    out = _run(
        """
        chain = SigtermChain(lambda r: time.sleep(60), lambda r: note("fallback " + r), note, wait_s=0.3)
        chain.install()
        t0 = time.monotonic()
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(5)
        """
    )
    assert out.returncode == -signal.SIGTERM
    assert out.stdout.strip() == "fallback sigterm"


def test_an_earlier_python_handler_decides() -> None:
    out = _run(
        """
        def theirs(signum, frame):
            note("theirs")
        signal.signal(signal.SIGTERM, theirs)
        chain = SigtermChain(lambda r: note("close"), lambda r: note("fallback"), lambda r: note("noted " + r))
        chain.install()
        os.kill(os.getpid(), signal.SIGTERM)
        note("goes on")
        chain.uninstall()
        assert signal.getsignal(signal.SIGTERM) is theirs
        """
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["noted", "sigterm", "theirs", "goes", "on"]


def test_an_ignored_sigterm_stays_ignored() -> None:
    out = _run(
        """
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        chain = SigtermChain(lambda r: note("close"), lambda r: note("fallback"), note)
        assert not chain.install()
        os.kill(os.getpid(), signal.SIGTERM)
        note("still here")
        """
    )
    assert out.returncode == 0 and out.stdout.strip() == "still here"


def test_a_forked_child_only_chains() -> None:
    out = _run(
        """
        chain = SigtermChain(lambda r: note(f"close in {os.getpid()}"), lambda r: note("fallback"), note)
        chain.install()
        pid = os.fork()
        if pid == 0:
            time.sleep(30)
            os._exit(0)
        time.sleep(0.2)
        os.kill(pid, signal.SIGTERM)
        _, status = os.waitpid(pid, 0)
        note(f"child {os.WTERMSIG(status) if os.WIFSIGNALED(status) else 'exited'}")
        """
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == f"child {int(signal.SIGTERM)}"


def test_a_second_sigterm_during_the_close_changes_nothing() -> None:
    out = _run(
        """
        def close(reason):
            os.kill(os.getpid(), signal.SIGTERM)  # arrives while the first one is handled
            time.sleep(0.2)
            note("closed")
        chain = SigtermChain(close, lambda r: note("fallback"), note)
        chain.install()
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(5)
        """
    )
    assert out.returncode == -signal.SIGTERM
    assert out.stdout.strip() == "closed"
