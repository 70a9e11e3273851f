"""The batch path's shortcuts (``POST /v1/heartbeats``) answer what the general code they stand in for answers."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from dsec.control.ingest import PREFIX, SUFFIX, match, worker_id_ok

IDS = st.one_of(
    st.text(alphabet="ab-_.:/9Z", max_size=70),
    st.text(max_size=70),
    st.sampled_from(["", "a" * 64, "a" * 65, "w-0123456789ab", "w/1", "../x", "w-1/heartbeat", "ü"]),
)


@settings(max_examples=2000, deadline=None)
@given(worker_id=IDS)
def test_an_items_worker_id_is_checked_as_its_heartbeat_path_would_be(worker_id: str) -> None:
    assert worker_id_ok(worker_id) is (match(f"{PREFIX}{worker_id}{SUFFIX}") is not None)
