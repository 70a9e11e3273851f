"""Setting up an epoch of the elastic group (probe/elastic.py): the rendezvous stores, the epoch's gloo process group,
and the interrupted collective's result handed from the plan's source to the members one behind."""

from __future__ import annotations

import logging
import os
import re
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any, TextIO

from dsec.heal.membership import Plan
from dsec.heal.sequence import Sequence
from dsec.probe.epoch import Diverged
from dsec.probe.heal_client import FencedOut, HealClient, HealUnavailable

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)

TAG_RESULT = 7_002


class Rendezvous:
    """This member's idle TCPStore server (every member hosts one; a plan names its source's) and clients of the
    others' servers, one per address, kept: a later epoch with the same source reuses the client. The prefix of an
    epoch's store names the run and the epoch, so a stale member can never meet a new epoch."""

    def __init__(self, dist: Any, host: str, timeout: timedelta) -> None:
        self._dist = dist
        self.timeout = timeout
        self._server = dist.TCPStore(host, 0, None, True, timeout=timeout, wait_for_workers=False)
        self.address = f"{host}:{self._server.port}"
        self._stores: dict[str, Any] = {}

    def _store(self, address: str) -> Any:
        store = self._stores.get(address)
        if store is None:
            host, _, port = address.rpartition(":")
            store = self._dist.TCPStore(host, int(port), None, False, timeout=self.timeout)
            self._stores[address] = store
        return store

    def forget(self, address: str) -> None:
        """Stop reusing the client of ``address``'s store: an abandoned setup may still be blocked in it (a TCPStore
        client serializes its operations)."""
        self._stores.pop(address, None)

    def group(self, run: str, plan: Plan, rank: int) -> Any:
        """The gloo process group of ``plan``'s epoch, as logical rank ``rank`` (blocks until every member built it)."""
        prefix = f"dsec/{run}/e{plan.epoch}"
        store = self._dist.PrefixStore(prefix, self._store(plan.store))
        return self._dist.ProcessGroupGloo(store, plan.members.index(rank), len(plan.members), self.timeout)


def send_result(pg: Any, plan: Plan, result: list[torch.Tensor]) -> None:
    """The source: the last completed collective's result to every member one behind."""
    for r in plan.behind:
        for t in result:
            pg.send([t.contiguous()], plan.members.index(r), TAG_RESULT).wait()


def receive_result(pg: Any, src: int, template: list[torch.Tensor]) -> list[torch.Tensor]:
    """A member one behind: the interrupted collective's result from process-group rank ``src``."""
    received = [t.clone() for t in template]
    for t in received:
        pg.recv([t], src, TAG_RESULT).wait()
    return received


def open_journal() -> TextIO | None:
    """DSEC_HEAL_JOURNAL (a directory): a file for one line per op of this process, else None."""
    journal = os.environ.get("DSEC_HEAL_JOURNAL")
    if not journal:
        return None
    os.makedirs(journal, exist_ok=True)
    return open(os.path.join(journal, f"ops-{os.getpid()}.log"), "a", buffering=1)


def journal_tails(directory: Path, lines: int) -> list[tuple[str, list[str]]]:
    """Each journal file under ``directory`` (by name) with its lines about the period of the script's sequence
    (found, confirmed, lost: the last few) and then its last ``lines`` lines other than per-op ``issue`` lines —
    the views, admission votes, arming — with a run of lines that differ only in their numbers (a member saying
    "no admission point" at every collective) shown as its first and last line and a count: what says why a
    replacement was not admitted has to fit in a failed test's output."""
    out = []
    for path in sorted(directory.glob("*.log")):
        kept = [ln for ln in path.read_text(errors="replace").splitlines() if " issue " not in ln]
        periods = [ln for ln in kept if " period " in ln and "no admission point" not in ln][-PERIOD_LINES:]
        tail = _collapse(kept)[-lines:]
        out.append((path.name, [ln for ln in periods if ln not in tail] + tail))
    return out


PERIOD_LINES = 3  # the period lines journal_tails keeps ahead of the tail


def _collapse(lines: list[str]) -> list[str]:
    """Runs of lines equal but for their numbers -> the run's first line, "(N more)", its last line."""
    out: list[str] = []
    run: list[str] = []

    def close() -> None:
        out.append(run[0])
        if len(run) > 2:
            out.append(f"({len(run) - 2} more like it)")
        if len(run) > 1:
            out.append(run[-1])

    for ln in lines:
        if run and _shape(ln) != _shape(run[0]):
            close()
            run = []
        run.append(ln)
    if run:
        close()
    return out


def _shape(line: str) -> str:
    return re.sub(r"[0-9.]+", "#", line)


def sequence_counters(plan: Plan, seq: Sequence, seniority: dict[int, int]) -> dict[str, Any]:
    """What the source adds to the replica state it sends a replacement: where the group is in the script's sequence
    of collectives, and each member's seniority (whose settings the group keeps)."""
    return {
        "completed": plan.completed,
        "position": seq.position,
        "pattern": seq.pattern(),
        "seniority": {str(r): e for r, e in seniority.items()},
    }


def inherited(counters: dict[str, Any]) -> tuple[Sequence, dict[int, int]]:
    """A replacement: the group's sequence of collectives and its members' seniority, from the source's counters."""
    seq = Sequence.inherit(list(counters["pattern"]), base=int(counters["position"]))
    return seq, {int(k): int(v) for k, v in counters["seniority"].items()}


def watch(client: HealClient, closed: Callable[[], bool], on_view: Callable[[dict[str, Any]], None]) -> None:
    """The watch thread: long-poll the control plane for the group's changes until closed, fenced or unreachable."""
    since = 0
    while not closed():
        try:
            view = client.watch(since, timeout=10.0)
        except (HealUnavailable, FencedOut):
            return
        except Exception:
            log.debug("dsec: heal watch failed", exc_info=True)
            time.sleep(0.2)
            continue
        since = int(view.get("version", since))
        try:
            on_view(view)
        except Exception:
            # A watch thread that died would leave this member deaf to replacements (never admitted) and to
            # broken epochs: log and keep watching.
            log.exception("dsec: a heal watch view could not be applied")


def heal_failure(exc: Exception, event: Callable[[str, dict[str, Any]], None]) -> Exception:
    """The error a collective's future fails with when healing could not carry it (reported as a heal event)."""
    if isinstance(exc, FencedOut):
        event("fenced", {"why": str(exc)})
        return RuntimeError(f"dsec: this process was fenced out of its group: {exc}")
    if isinstance(exc, HealUnavailable):
        event("unavailable", {"why": str(exc)})
        return RuntimeError(f"dsec: cannot heal, the control plane is unreachable: {exc}")
    if isinstance(exc, Diverged):
        event("diverged", {"why": str(exc)})
        return exc
    log.exception("dsec: healing failed")
    return RuntimeError(f"dsec: healing failed: {type(exc).__name__}: {exc}")
