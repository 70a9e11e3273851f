"""With the sync header every Nth step (DSEC_HEADER_EVERY), the steps between still record this rank's sync cost:
estimated from the last header's lag and wait. Without it a beat with no header step had no cost, the judge fell back
to raw latency (which includes waiting for a straggler) and blamed the straggler's punctual peers."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
dist = pytest.importorskip("torch.distributed")

from dsec.probe.actuators import Actuators  # noqa: E402
from dsec.probe.ddp import SyncCoordinator  # noqa: E402
from dsec.probe.telemetry import Telemetry  # noqa: E402
from dsec.probe.torch_targets import unannotated  # noqa: E402


def test_every_synchronized_step_records_a_cost_and_only_header_steps_read_stamps(one_rank_group: None) -> None:
    torch.manual_seed(0)
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(16, 4))
    telemetry = Telemetry()
    coord = SyncCoordinator(Actuators(default_bits=32), telemetry, header_every=4)
    model.register_comm_hook(None, unannotated(coord.hook))
    seen: list[int] = []
    original = coord._record_arrivals

    def stamps_read(*args: object) -> None:
        seen.append(coord.syncs)
        original(*args)  # type: ignore[arg-type]

    coord._record_arrivals = stamps_read  # type: ignore[method-assign]
    for _ in range(9):
        model(torch.randn(8, 16)).sum().backward()
    assert coord.syncs == 9
    assert seen == [0, 4, 8]  # the header rode steps 1, 5 and 9 (syncs counted before each is completed)
    assert len(telemetry._sync_cost) == 9  # one cost per synchronized step, header or not
    assert "sync_cost_ms_p50" in telemetry.collect()
