"""Demo scene for the webhook protocol: an agent runtime (the reference receiver, in this process on loopback)
registers with a pool token, reports, and receives a signed policy push."""

from __future__ import annotations

import secrets
import threading
import time
from typing import TYPE_CHECKING, Any
from wsgiref.simple_server import WSGIRequestHandler, make_server

from dsec.integrations.webhook import WebhookReceiver

if TYPE_CHECKING:
    from dsec.demo import DemoRun


class _Quiet(WSGIRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:  # the live table owns the terminal
        pass


def start_runtime(run: DemoRun) -> bool:
    secret = secrets.token_urlsafe(24)
    receiver = WebhookReceiver(secret)
    applied: list[dict[str, Any]] = []
    receiver.on("gradient_accumulation")(applied.append)
    server = make_server("127.0.0.1", 0, receiver.wsgi, handler_class=_Quiet)
    thread = threading.Thread(target=server.serve_forever, name="demo-runtime", daemon=True)
    thread.start()
    rt = run.client.register_runtime(
        name="demo-runtime", type="dify-agent-runtime", pool="pool-0", secret=secret,
        callback_url=f"http://127.0.0.1:{server.server_port}/hooks/dsec",
    )  # fmt: skip
    run.client.runtime_report(rt["id"], token=rt["runtime_token"], concurrent_agents=3, avg_llm_latency_ms=420.0,
                              function_calling=True)  # fmt: skip
    d = run.client.push_policy(rt["id"], "gradient_accumulation", steps=4, target_gpu="gpu-00")
    run.state["runtime"] = {"server": server, "thread": thread, "rt": rt, "delivery": d["id"], "applied": applied}
    return True


def runtime_served(run: DemoRun) -> bool:
    state = run.state.get("runtime")
    if not state:
        return False
    deadline = time.time() + 10
    log: dict[str, Any] = {}
    while time.time() < deadline:
        log = next(d for d in run.client.deliveries(state["rt"]["id"]) if d["id"] == state["delivery"])
        if log["status"] != "pending":
            break
        time.sleep(0.1)
    state["server"].shutdown()
    state["server"].server_close()
    state["thread"].join(timeout=5)
    run.notes.append(
        f"webhooks: runtime {state['rt']['id']} registered and reported; policy gradient_accumulation pushed signed, "
        f"{log.get('status')} after {len(log.get('attempts', []))} attempt(s), applied {len(state['applied'])}x"
    )
    return log.get("status") == "delivered" and len(state["applied"]) == 1


NATIVE_PROGRAM = """
import sys
from dsec.integrations import native
native.init(sys.argv[1], "demo-native")
for episode in range(20):
    native.report_episode_end(10.0 + episode, 200)
native.shutdown()
"""


def run_native(run: DemoRun) -> bool:
    """A program using libdsec_inject.so through its ctypes binding reports episodes from C's reporter thread."""
    import os
    import subprocess
    import sys

    from dsec.integrations import native

    try:
        native.library_path()
    except native.NativeLibraryNotFound as exc:
        run.state["native"] = {"skipped": str(exc)}
        return True
    env = {**os.environ, "DSEC_SANDBOX_ID": "pool-0", "DSEC_TOKEN": run.state["pool_token"],
           "DSEC_HEARTBEAT_INTERVAL": "0.2"}  # fmt: skip
    done = subprocess.run([sys.executable, "-c", NATIVE_PROGRAM, run.state["endpoint"]], env=env, timeout=60,
                          capture_output=True, check=False)  # fmt: skip
    run.state["native"] = {"code": done.returncode, "stderr": done.stderr.decode()[-300:]}
    return True


def native_reported(run: DemoRun) -> bool:
    state = run.state.get("native", {})
    if "skipped" in state:
        run.notes.append(f"libdsec_inject.so: not built here ({state['skipped']}); `make native` needs a C compiler")
        return True
    workers = [w for w in run.client.workers(pool="pool-0") if w["group"] == "demo-native"]
    episodes = sum(w["metrics"].get("episodes_total", 0) for w in workers)
    run.notes.append(
        f"libdsec_inject.so: a program calling dsec_init / dsec_report_episode_end / dsec_shutdown (ctypes) "
        f"registered, reported {episodes:.0f} episodes from the C reporter thread and deregistered"
    )
    return state.get("code") == 0 and episodes == 20 and all(w["state"] == "deregistered" for w in workers)
