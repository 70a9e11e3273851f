"""What a member of a healing group knows from the control plane's watch, across the epoch it is setting up.

A replacement can join an epoch before a survivor has finished building it (a warm standby joins within
milliseconds): the view saying so then arrives while the survivor's own epoch is still the previous one. The
survivor must still propose the replacement's admission once the epoch is set up, without waiting for the group to
change again (the watch only answers on a change, or when its poll times out)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from dsec.heal.membership import Plan
from dsec.probe.elastic import ElasticGroup

pytest.importorskip("torch")


class _Client:
    """The part of HealClient that setting up an epoch of one member reads (no control plane is asked)."""

    def __init__(self, run: str) -> None:
        self.me = SimpleNamespace(run=run, rank=0)

    def close(self) -> None:
        pass


def _group(run: str) -> ElasticGroup:
    return ElasticGroup(_Client(run), 0, 1, timeout_s=10.0)  # type: ignore[arg-type]


def _plan(g: ElasticGroup, epoch: int, reason: str, joiners: tuple[int, ...] = ()) -> Plan:
    return Plan(epoch=epoch, members=(0,), store=g.address, completed=0, source=0, joiners=joiners, reason=reason)


def _view(epoch: int, joiners: list[int]) -> dict[str, Any]:
    return {"version": 10 + epoch, "epoch": epoch, "phase": "stable", "members": [0], "joiners": joiners}


def test_a_replacement_seen_before_its_epoch_was_set_up_is_known_after() -> None:
    g = _group("early-view")
    try:
        g._adopt(_plan(g, 1, "start"), None)
        g.on_view(_view(2, [1]))  # the group formed epoch 2 and a replacement waits in it; this member is in 1
        assert not g.join_known
        g._adopt(_plan(g, 2, "failure"), None)
        assert g.join_known
    finally:
        g.close(leave=False)


def test_a_view_of_an_older_epoch_or_without_joiners_says_nothing_waits() -> None:
    g = _group("old-view")
    try:
        g._adopt(_plan(g, 1, "start"), None)
        g.on_view(_view(1, [1]))
        assert g.join_known
        g._adopt(_plan(g, 2, "admission", joiners=()), None)  # the admission epoch: the view is of epoch 1
        assert not g.join_known
        g.on_view(_view(2, []))
        assert not g.join_known
        g.on_view(_view(2, [1]))
        assert g.join_known
    finally:
        g.close(leave=False)


def test_the_watch_goes_on_after_a_view_it_could_not_apply() -> None:
    from dsec.probe import epoch_setup

    class Watching:
        def __init__(self) -> None:
            self.calls = 0

        def watch(self, since: int, timeout: float = 20.0) -> dict[str, Any]:
            self.calls += 1
            return _view(self.calls, [1]) | {"version": since + 1}

    client, applied = Watching(), []

    def on_view(view: dict[str, Any]) -> None:
        if view["epoch"] == 1:
            raise RuntimeError("a view this member could not apply")
        applied.append(view["epoch"])

    epoch_setup.watch(client, lambda: client.calls >= 3, on_view)  # type: ignore[arg-type]
    assert applied == [2, 3]  # the first view's error did not end the watch


def test_journal_tails_keep_the_last_lines_other_than_per_op_issues(tmp_path: Any) -> None:
    from dsec.probe import epoch_setup

    (tmp_path / "ops-2.log").write_text("1.0 view v1 e1 r0\n1.1 issue 0 grad e1 pos 0 r0\n1.2 arm 9 pos 1 r0\n")
    (tmp_path / "ops-1.log").write_text("1.0 issue 0 grad e1 pos 0 r1\n")
    (tmp_path / "other.txt").write_text("not a journal\n")
    assert epoch_setup.journal_tails(tmp_path, 1) == [("ops-1.log", []), ("ops-2.log", ["1.2 arm 9 pos 1 r0"])]
    assert epoch_setup.journal_tails(tmp_path / "absent", 5) == []


def test_journal_tails_keep_the_period_lines_and_collapse_repeats(tmp_path: Any) -> None:
    """A survivor that finds no admission point journals that at every collective: the tail must still show when its
    period was lost (earlier in the file) and what came before the repeats."""
    from dsec.probe import epoch_setup

    lines = ["1.0 period 1 -> 33 at 32: all_reduce:float64:sum (last ['grad']) r0", "1.1 period 33 confirmed at 97 r0"]
    lines += [
        "1.2 view v1 e2 stable joiners [1] here e2 join_known True r0",
        "1.3 period lost at 400: grad (pattern) r0",
    ]
    lines += [f"2.{i} no admission point: period None count {7000 + i} r0" for i in range(50)]
    (tmp_path / "ops-1.log").write_text("\n".join(lines) + "\n")
    ((_, kept),) = epoch_setup.journal_tails(tmp_path, 4)
    assert kept == [
        lines[0],
        lines[1],
        lines[3],
        "2.0 no admission point: period None count 7000 r0",
        "(48 more like it)",
        "2.49 no admission point: period None count 7049 r0",
    ]
    ((_, kept),) = epoch_setup.journal_tails(tmp_path, 6)  # a period line inside the tail is not repeated
    assert kept[:4] == lines[:4] and len(kept) == 7


def test_a_journaling_member_says_when_its_period_changes(tmp_path: Any) -> None:
    import io

    g = _group("journal-period")
    try:
        g._journal = io.StringIO()  # type: ignore[assignment]
        loop = ["grad"] * 32 + ["all_reduce:float64:sum"]
        for sig in loop * 4 + ["broadcast:float32"]:
            g._add_journaled(sig)
        said = [ln.split(" ", 1)[1] for ln in g._journal.getvalue().splitlines()]  # type: ignore[attr-defined]
        assert said == [
            "period None -> 1 at 0: grad (last ['grad']) r0",
            "period 1 -> 33 at 32: all_reduce:float64:sum (last ['grad', 'grad', 'grad', 'all_reduce:float64:sum']) r0",
            "period 33 confirmed at 96 r0",
            "period lost at 132: broadcast:float32 (pattern " + str(loop[:16]) + ") r0",
        ]
        assert g.seq.period is None and g.seq.count == 133
    finally:
        g.close(leave=False)


def test_an_epoch_reported_broken_while_it_is_set_up_is_given_up_at_once() -> None:
    """A member of the plan dies before the rendezvous: gloo's setup would wait for it (here up to the 10 s timeout;
    in a full test run a survivor waited minutes). The watch says the epoch is broken: the setup gives up within
    a poll, so the heal loop can ask for the next epoch; the store client it used is not reused."""
    import threading
    import time

    g = ElasticGroup(_Client("broken-during-setup"), 0, 1, timeout_s=2.0)  # type: ignore[arg-type]
    try:
        plan = Plan(epoch=2, members=(0, 1), store=g.address, completed=0, source=0, joiners=(), reason="failure")
        timer = threading.Timer(0.3, lambda: g.on_view({"version": 5, "epoch": 2, "phase": "broken", "joiners": []}))
        timer.start()
        t0 = time.monotonic()
        with pytest.raises(RuntimeError, match="epoch 2 was reported broken while it was being set up"):
            g._adopt(plan, None)
        assert time.monotonic() - t0 < 1.5  # not the 2 s of gloo's timeout
        assert g.address not in g._rendezvous._stores and g.plan is None
        # A view of an older epoch, or of this one stable, does not stop a setup.
        g.on_view({"version": 6, "epoch": 1, "phase": "broken", "joiners": []})
        assert not g._reported_broken(2) and g._reported_broken(1)
        g.on_view({"version": 7, "epoch": 3, "phase": "stable", "joiners": []})
        assert g._reported_broken(2)
        g._adopt(_plan(g, 3, "failure"), None)  # a one-member epoch on a fresh store client: set up
        assert g.plan is not None and g.plan.epoch == 3
    finally:
        g.close(leave=False)
        for t in threading.enumerate():  # the abandoned setup ends at gloo's timeout
            if t.name == "dsec-heal-setup-e2":
                t.join(10.0)
                assert not t.is_alive()


def test_ddp_is_released_from_a_healing_sync_only_after_the_group_recorded_it(
    one_rank_group: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The gradient sync's bucket futures (what DDP's backward waits for) complete after the op is in the group's
    sequence of collectives. Released earlier (from the op's finish(), as before), the training thread could issue,
    complete and record its next collective first — a lone survivor's ops complete at once — and the sequence lost
    its period: a replacement found no admission point (the demo's intermittent healing failure)."""
    import torch

    from dsec.probe import heal_sync
    from dsec.probe.actuators import Actuators
    from dsec.probe.telemetry import Telemetry
    from dsec.probe.torch_targets import unannotated

    events: list[tuple[str, Any]] = []  # (what, the future released or the sequence's count after recording)

    class Logged(torch.futures.Future):  # type: ignore[type-arg]
        def __class_getitem__(cls, item: Any) -> Any:  # (annotations subscript the future type)
            return cls

        def set_result(self, result: Any) -> None:
            events.append(("released", self))
            super().set_result(result)

    g = _group("release-after-record")
    try:
        g._adopt(_plan(g, 1, "start"), None)
        add = g.seq.add

        def recorded(sig: str) -> None:
            add(sig)
            events.append(("recorded", g.seq.count))

        g.seq.add = recorded  # type: ignore[method-assign]
        torch.manual_seed(0)
        model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(8, 2))
        params = list(model.parameters())
        sync = heal_sync.HealingSync(Actuators(default_bits=32), Telemetry(), elastic=g, params=params)
        bucket_futures: list[Any] = []

        def hook(state: object, bucket: Any) -> Any:
            fut = sync.hook(state, bucket)
            bucket_futures.append(fut)
            return fut

        model.register_comm_hook(None, unannotated(hook))
        monkeypatch.setattr(torch.futures, "Future", Logged)  # the hook's bucket futures (and the group's own)
        for _ in range(3):
            model(torch.randn(4, 8)).sum().backward()
        assert g.seq.count == 3 and len(bucket_futures) == 3
        order = [
            e if e[0] == "recorded" else ("released", bucket_futures.index(e[1]))
            for e in events
            if e[0] == "recorded" or any(e[1] is f for f in bucket_futures)
        ]
        # Each step's sync is recorded (count 1, 2, 3) before its bucket future (0, 1, 2) releases DDP.
        assert order == [("recorded", 1), ("released", 0), ("recorded", 2), ("released", 1), ("recorded", 3),
                         ("released", 2)]  # fmt: skip
    finally:
        g.close(leave=False)
