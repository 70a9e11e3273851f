"""The process group a healing member trains on: one gloo group per epoch, replaced in place when a member dies
or a replacement joins, without restarting the survivors.

Every collective of a healing member — the gradient sync of its DDP comm hook and the script's own collectives on
the default group — is an :class:`Op` submitted here, one at a time, in program order (the same order on every
member: that is what makes them pair up). The fast path issues the op on the current epoch's group and completes
its future when gloo does. When the op fails (a peer's connection reset) or the control plane says the epoch is
broken (a supervisor saw a rank exit; a member whose op failed reported it), the op is handed to this member's
*heal thread*, which:

1. joins the next epoch at the control plane with its *completed* count (control/healing.py waits for every live
   member, then answers with a :class:`~dsec.heal.membership.Plan`);
2. builds the new epoch's gloo group from the store of the plan's *source* (every member hosts an idle TCPStore
   server for this; the prefix names the run and the epoch, so a stale member can never meet a new epoch);
3. resolves the interrupted op: a member one collective behind receives that collective's result from the source
   (it was completed there; running it again would pair with nobody), a member at the group's count runs its op
   again in the new epoch from its kept inputs;
4. on admission, sends the model/optimizer state to the replacements (replica_state.py).

Gloo cannot abort a pending collective: an op stuck in a dead epoch's group is abandoned (its future is completed
by us, not by gloo) and the old group is kept referenced — destroying it would wait for the stuck op — until its
collective timeout frees its thread. Detection: a peer's death resets its TCP connections, so the members that were
waiting on it fail at once; the others learn it from the control plane's watch (long-poll) within milliseconds.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from typing import TYPE_CHECKING, Any

from dsec.heal.membership import Plan
from dsec.heal.sequence import Sequence
from dsec.probe import epoch_setup as setup
from dsec.probe.epoch import Diverged, Epoch, Op, Pending, State, signature
from dsec.probe.heal_client import FencedOut, HealClient, HealUnavailable
from dsec.probe.replica_state import ReplicaState, TransferError
from dsec.probe.replica_state import recv as recv_state
from dsec.probe.replica_state import send as send_state

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)

#: How often an epoch's setup looks at the watch's newest view (a broken epoch is given up within this).
SETUP_POLL_S = 0.05


class ElasticGroup:
    def __init__(
        self,
        client: HealClient,
        rank: int,
        world: int,
        *,
        replacement: bool = False,
        host: str = "127.0.0.1",
        timeout_s: float = 30.0,
        on_event: Callable[[str, dict[str, Any]], None] | None = None,
        capture_state: Callable[[], ReplicaState] | None = None,
        receive_state: Callable[[ReplicaState, Plan], None] | None = None,
    ) -> None:
        import torch.distributed as dist

        self.client = client
        self.rank, self.world = rank, world
        self.replacement = replacement
        self.timeout = timedelta(seconds=timeout_s)
        self._on_event = on_event
        self._capture_state = capture_state
        self._receive_state = receive_state
        self._rendezvous = setup.Rendezvous(dist, host, self.timeout)
        self.address = self._rendezvous.address
        self.plan: Plan | None = None  # the current epoch's (set up here)
        self._seen_plan: Plan | None = None  # the newest one received (maybe not set up: its setup failed)
        self.ep: Epoch | None = None
        self.completed = 0  # collectives of the group completed (DSec's own included)
        self.seq = Sequence()  # the script's collectives, for admission points
        self.shadow_period: int | None = None  # a replacement's gradients count once it has run this many
        self.seniority: dict[int, int] = {}  # logical rank -> epoch it joined (oldest wins ties)
        self._last: tuple[int, list[torch.Tensor]] | None = None  # (index, result) of the last completed op
        self._lock = threading.Lock()
        self._inflight: Pending | None = None
        self._broken_epoch: int | None = None  # the epoch the control plane or a failed op says is broken
        self._broken_by_watch = False  # ... and the control plane said so (no need to report it)
        self._view: dict[str, Any] = {}  # the newest view the watch delivered (join_known reads it)
        self.admit_at: int | None = None  # agreed admission point (the group's script-collective index)
        self.version = 0
        self._queue: list[Pending] = []
        self._wake = threading.Condition(self._lock)
        self._closed = False
        self.graveyard: list[Any] = []  # abandoned process groups (never destroyed: a stuck op would block it)
        self.heals: list[dict[str, Any]] = []  # timings of each reconfiguration (for reports and tests)
        self._journal = setup.open_journal()  # DSEC_HEAL_JOURNAL: one line per op (debugging a group's order)
        self._heal_thread = threading.Thread(target=self._heal_loop, name="dsec-heal", daemon=True)
        self._watch_thread = threading.Thread(target=self._watch_loop, name="dsec-heal-watch", daemon=True)

    # -- lifecycle ------------------------------------------------------------------------------------------
    def start(self) -> None:
        """Original members: join the first epoch (blocks until every rank has joined). A replacement joins at its
        first collective instead (admission)."""
        if not self.replacement:
            t0 = time.monotonic()
            plan = self._seen_plan = self.client.join(self.address, 0, 0)
            self._adopt(plan, None)
            self._event("formed", {"epoch": plan.epoch, "members": list(plan.members), "s": time.monotonic() - t0})
            self._watch_thread.start()
        self._heal_thread.start()

    def close(self, leave: bool = True) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._wake.notify_all()
        if leave and self.ep is not None:
            try:
                self.client.leave()
            except Exception:
                log.debug("dsec: leaving the healing group failed", exc_info=True)
        self.client.close()
        for t in (self._heal_thread, self._watch_thread):
            if t.is_alive():
                t.join(5.0)

    @property
    def journaling(self) -> bool:
        """Whether DSEC_HEAL_JOURNAL is set: the per-op call sites format their lines only then (hot path)."""
        return self._journal is not None

    def journal(self, line: str) -> None:
        """One line in the op journal (DSEC_HEAL_JOURNAL), when there is one."""
        if self._journal is not None:
            self._journal.write(f"{time.time():.4f} {line} r{self.rank}\n")

    def _event(self, what: str, data: dict[str, Any]) -> None:
        if self._on_event is not None:
            try:
                self._on_event(what, data)
            except Exception:
                log.exception("dsec: heal event sink failed")

    # -- submitting ops (training thread) -----------------------------------------------------------------------
    def submit(self, op: Op) -> Any:
        """Run ``op`` in the group; returns a torch Future completed with ``op.finish()``."""
        import torch

        p = Pending(op, torch.futures.Future())
        with self._lock:
            if self._closed:
                p.fut.set_exception(RuntimeError("dsec: the healing group is closed"))
                return p.fut
            admit = self.admit_at is not None and op.sig is not None and self.seq.position >= self.admit_at
            if self.ep is None or admit or self._broken_epoch is not None:
                p.admit = admit and self.ep is not None and self._broken_epoch is None
                p.known = self._broken_by_watch
                p.state = State.HANDED
                self._queue.append(p)
                self._wake.notify_all()
                return p.fut
            work = self._issue_locked(p)
        self._watch_work(p, work)
        return p.fut

    def run(self, op: Op) -> Any:
        """Submit and wait (the script's synchronous collectives)."""
        return self.submit(op).wait()

    def _issue_locked(self, p: Pending) -> Any:
        """Issue ``p`` on the current epoch's group (caller holds the lock); returns its Work, or None when it
        failed at once (then it is handed to the heal thread). Attach :meth:`_watch_work` after releasing the lock:
        a work that is already complete runs its callback inline."""
        ep = self.ep
        assert ep is not None
        if self._journal is not None:
            self.journal(f"issue {self.completed} {p.op.sig} e{ep.epoch} pos {self.seq.position}")
        p.epoch, p.state = ep.epoch, State.PENDING
        self._inflight = p
        try:
            return p.op.issue(self._epoch_view())
        except Exception as exc:  # a closed pair raises at issue time
            self._hand_locked(p, f"{type(exc).__name__}: {exc}")
            return None

    def _watch_work(self, p: Pending, work: Any) -> None:
        if work is not None:
            work.get_future().then(lambda f: self._on_done(p, f))

    def _epoch_view(self) -> Epoch:
        ep = self.ep
        assert ep is not None
        shadow = self.shadow_period is not None and self.seq.count < self.shadow_period
        return Epoch(ep.epoch, ep.pg, ep.members, ep.rank, ep.world, ep.source, shadow)

    def _on_done(self, p: Pending, f: Any) -> None:
        try:
            f.value()
            error = None
        except Exception as exc:
            error = f"{type(exc).__name__}: {str(exc)[:300]}"
        with self._lock:
            if p.state is not State.PENDING or p.epoch != (self.ep.epoch if self.ep else -1):
                return  # already handed to the heal thread (aborted): this late answer is void
            if error is not None:
                self._hand_locked(p, error)
                return
            p.state = State.DONE
            self._inflight = None
        self._complete(p)

    def _hand_locked(self, p: Pending, why: str) -> None:
        p.state, p.error = State.HANDED, why
        if self._inflight is p:
            self._inflight = None
        if self._broken_epoch is None and self.ep is not None:
            self._broken_epoch = self.ep.epoch
        self._queue.append(p)
        self._wake.notify_all()

    def _complete(self, p: Pending) -> None:
        try:
            value = p.op.finish()
        except Exception as exc:
            p.fut.set_exception(exc)
            return
        with self._lock:
            self._last = (self.completed, p.op.result())
            self.completed += 1
            if p.op.sig is not None:
                if self._journal is None:
                    self.seq.add(p.op.sig)
                else:
                    self._add_journaled(p.op.sig)
        p.fut.set_result(value)

    def _add_journaled(self, sig: str) -> None:
        """``seq.add`` with a journal line for every change of the period and of its confirmation: a group that
        finds no admission point must say when and at which collective its sequence stopped repeating."""
        seq = self.seq
        was, period = seq.confirmed(), seq.period
        seq.add(sig)
        n = seq.count - 1
        if was and not seq.confirmed():
            self.journal(f"period lost at {n}: {sig} (pattern {seq.prefix[:16]})")
        elif seq.period != period:
            tail = seq.prefix[max(0, n - 3) : n + 1] if n < len(seq.prefix) else [sig]
            self.journal(f"period {period} -> {seq.period} at {n}: {sig} (last {tail})")
        elif seq.confirmed() and not was:
            self.journal(f"period {seq.period} confirmed at {n}")

    # -- watch thread -----------------------------------------------------------------------------------------
    def _watch_loop(self) -> None:
        setup.watch(self.client, lambda: self._closed, self.on_view)

    def on_view(self, view: dict[str, Any]) -> None:
        with self._lock:
            self._view = view
            ep = self.ep
            if ep is None:
                return
            self.journal(f"view v{view.get('version')} e{view.get('epoch')} {view.get('phase')} joiners "
                         f"{view.get('joiners')} here e{ep.epoch} join_known {self.join_known}")  # fmt: skip
            broken = view.get("phase") == "broken" or int(view.get("epoch", 0)) > ep.epoch
            if broken and self._broken_epoch is None:
                self._broken_epoch = ep.epoch
                self._broken_by_watch = True
                p = self._inflight
                if p is not None and p.state is State.PENDING:
                    p.known = True
                    self._hand_locked(p, "the control plane reports the epoch broken")

    @property
    def join_known(self) -> bool:
        """Whether the newest view of the group shows a replacement waiting to join this member's current epoch.
        Read against the epoch set up *now*: a view that arrived while that epoch was still being built (a
        replacement joins it within milliseconds) counts once it is set up, without waiting for the group's next
        change or the watch's poll (up to 10 s)."""
        ep = self.ep
        return ep is not None and bool(self._view.get("joiners")) and self._view.get("epoch") == ep.epoch

    # -- heal thread ----------------------------------------------------------------------------------------------
    def _heal_loop(self) -> None:
        while True:
            with self._lock:
                while not self._queue and not self._closed:
                    self._wake.wait()
                if self._closed and not self._queue:
                    return
                p = self._queue.pop(0)
            try:
                self._heal(p)
            except Exception as exc:
                p.fut.set_exception(setup.heal_failure(exc, self._event))

    def _heal(self, p: Pending) -> None:
        t0 = time.monotonic()
        failed_epoch = self._broken_epoch
        if failed_epoch is not None and not p.known and not self.replacement_pending():
            try:
                self.client.fail(failed_epoch, p.error or "collective interrupted")
            except HealUnavailable:
                raise
            except Exception:
                log.debug("dsec: reporting the failure failed", exc_info=True)
        while True:
            self.journal(f"heal: asking for the next plan after e{self._seen_plan.epoch if self._seen_plan else 0}")
            plan = self._next_plan(p)
            if plan is not None:
                self.journal(f"heal: plan e{plan.epoch} members {list(plan.members)} source {plan.source} behind "
                             f"{list(plan.behind)} joiners {list(plan.joiners)} reason {plan.reason}")  # fmt: skip
            if plan is None:  # an admission that found nobody to admit: go on in the same epoch
                with self._lock:
                    self.admit_at = None
                    work = self._issue_locked(p)
                self._watch_work(p, work)
                return
            try:
                received = self._adopt(plan, p)
                break
            except Diverged:
                raise
            except (RuntimeError, TransferError) as exc:
                self.journal(f"heal: setting up e{plan.epoch} failed: {str(exc)[:200]}")
                log.warning("dsec: epoch %d could not be set up (%s); reporting it broken", plan.epoch, exc)
                self.client.fail(plan.epoch, f"setting up epoch {plan.epoch} failed: {exc}")
        heal = {
            "epoch": plan.epoch,
            "reason": plan.reason,
            "members": list(plan.members),
            "joiners": list(plan.joiners),
            "dead": list(plan.dead),
            "source": plan.source,
            "behind": self.rank in plan.behind,
            "heal_s": round(time.monotonic() - t0, 4),
            "since_submit_s": round(time.monotonic() - p.submitted, 4),
        }
        self.heals.append(heal)
        self._event("healed", heal)
        if received is not None:
            p.op.accept(received)
            with self._lock:
                self._inflight = None
            self._complete(p)
            return
        with self._lock:
            work = self._issue_locked(p)
        self._watch_work(p, work)

    def replacement_pending(self) -> bool:
        return self.replacement and self.plan is None

    def _next_plan(self, p: Pending) -> Plan | None:
        seen = self._seen_plan
        if seen is None:  # a replacement at its first collective
            plan = self.client.join(self.address, 0, 0, replacement=True)
        elif p.admit and seen is self.plan:
            out = self.client.admit(seen.epoch, self.completed)
            if out["status"] == "void":
                return None
            if out["status"] == "formed":
                plan = out["plan"]
            else:  # broken meanwhile: join the next epoch instead
                plan = self.client.join(
                    self.address, self.completed, seen.epoch, view=seen.members, pending=signature(p.op)
                )
        else:
            # The newest epoch this member was told of, even one it failed to set up: the control plane counts it
            # as a member there.
            plan = self.client.join(
                self.address, self.completed, seen.epoch, view=seen.members, pending=signature(p.op)
            )
        self._seen_plan = plan
        return plan

    def _adopt(self, plan: Plan, p: Pending | None) -> list[torch.Tensor] | None:
        """Build the plan's process group and do its transfers. Returns the interrupted op's result when this
        member was one behind (it received it from the source)."""
        members = plan.members
        if self.rank not in members:
            raise FencedOut(f"rank {self.rank} is not a member of epoch {plan.epoch}")
        if plan.diverged:
            raise Diverged(
                f"the ranks of epoch {plan.epoch - 1} were blocked at different collectives"
                f" ({signature(p.op) if p is not None else '?'} here):"
                " their scripts took different paths, no process group can pair them again"
            )
        self.journal(f"heal: rendezvous e{plan.epoch}")
        pg = self._setup_group(plan)
        self.journal(f"heal: rendezvous e{plan.epoch} done; transfers")
        received: list[torch.Tensor] | None = None
        src = members.index(plan.source)
        if self.rank == plan.source:
            if plan.behind:
                assert self._last is not None and self._last[0] == plan.completed - 1
                setup.send_result(pg, plan, self._last[1])
            if plan.joiners and self._capture_state is not None:
                state = self._capture_state()
                state.meta["counters"].update(setup.sequence_counters(plan, self.seq, self.seniority))
                send_state(state, pg, [members.index(r) for r in plan.joiners])
        elif self.rank in plan.behind and p is not None:
            received = setup.receive_result(pg, src, p.op.result())
        elif self.rank in plan.joiners:
            state = recv_state(pg, src)
            self.seq, self.seniority = setup.inherited(state.meta["counters"])
            self.shadow_period = self.seq.period
            if self._receive_state is not None:
                self._receive_state(state, plan)
        self.journal(f"heal: transfers of e{plan.epoch} done")
        with self._lock:
            old = self.ep.pg if self.ep is not None else None
            if old is not None:
                self.graveyard.append(old)
            self.plan = plan
            self.ep = Epoch(plan.epoch, pg, members, self.rank, self.world, plan.source)
            self.completed = plan.completed if received is None else plan.completed - 1
            if self.rank in plan.joiners or plan.reason == "start":
                self.seniority.setdefault(self.rank, plan.epoch)
            for r in members:
                self.seniority.setdefault(r, plan.epoch)
            self._broken_epoch = None
            self._broken_by_watch = False
            self.admit_at = None
            self.version += 1
        if self.rank in plan.joiners and not self._watch_thread.is_alive():
            self._watch_thread.start()
        return received

    def _setup_group(self, plan: Plan) -> Any:
        """The process group of ``plan``'s epoch, built on a helper thread while this one watches for the epoch being
        reported broken. A member that dies right after the plan formed never completes the rendezvous, and a survivor
        waited in gloo's setup for minutes, past its own timeout (test_heal's death while a replacement waits, its
        journal: "rendezvous e2" and nothing after it), while the watch had said within milliseconds that the epoch was
        broken. Now the setup is abandoned then (its thread is left to gloo's timeout, and the store client it may hold
        is not reused) and the heal loop asks for the next epoch."""
        out: dict[str, Any] = {}
        done = threading.Event()

        def build() -> None:
            try:
                out["pg"] = self._rendezvous.group(self.client.me.run, plan, self.rank)
            except BaseException as exc:  # handed to the heal thread below
                out["error"] = exc
            finally:
                done.set()

        threading.Thread(target=build, name=f"dsec-heal-setup-e{plan.epoch}", daemon=True).start()
        while not done.wait(SETUP_POLL_S):
            if self._reported_broken(plan.epoch):
                self._rendezvous.forget(plan.store)
                raise RuntimeError(f"epoch {plan.epoch} was reported broken while it was being set up")
        if "error" in out:
            raise out["error"]
        return out["pg"]

    def _reported_broken(self, epoch: int) -> bool:
        """Whether the newest view says ``epoch`` is broken, or that the group has moved past it."""
        with self._lock:
            view = self._view
        seen = int(view.get("epoch", 0) or 0)
        return seen > epoch or (seen == epoch and view.get("phase") == "broken")

    # -- header support (sync_header.py / heal mode of the comm hook) -------------------------------------------
    def next_admission(self) -> int | None:
        """The group index of the script collective this member proposes to admit a waiting replacement before (the
        next period start after the collective it is about to run), or None."""
        if not self.join_known:
            return None
        k = self.seq.next_admission(self.seq.count + 1)
        if k is None:
            self.journal(f"no admission point: period {self.seq.period} count {self.seq.count}")
        return None if k is None else self.seq.base + k

    def arm_admission(self, at: int) -> None:
        """Every member knew of a waiting replacement and proposed the same point: admit before script collective
        ``at`` (the group's index)."""
        with self._lock:
            if at > self.seq.position:
                self.admit_at = at
            self.journal(f"arm {at} pos {self.seq.position} admit_at {self.admit_at}")

    def reference_rank(self, candidates: list[int]) -> int:
        """The oldest member among ``candidates`` (ties: the lowest rank): whose settings the group keeps."""
        return min(candidates, key=lambda r: (self.seniority.get(r, 1 << 30), r))
