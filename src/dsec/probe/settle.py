"""Let torch.distributed's gloo worker threads go idle before the interpreter shuts down.

A gloo worker thread frees each finished collective itself, and freeing a tensor that has a Python object
needs the GIL (torch >= 2.10). If that happens after interpreter shutdown has begun, the thread dies inside a
C++ destructor and the process aborts with "terminate called without an active exception" (SIGABRT) — even
after barrier() and destroy_process_group(). It takes a worker thread delayed past the end of training, i.e.
a busy machine (measured on the PPO example: ~5 aborts in ~150 runs; 14/16 when the delay is forced, 0/16
with this wait). The probe runs this at exit in processes that used torch.distributed.
"""

from __future__ import annotations

import os
import threading
import time


def let_threads_settle(min_s: float = 0.05, max_s: float = 1.0) -> None:
    """Sleep ``min_s`` without the GIL, then wait (up to ``max_s``) while another thread is runnable (Linux)."""
    time.sleep(min_s)
    task_dir = "/proc/self/task"
    if not os.path.isdir(task_dir):
        return
    me = str(threading.get_native_id())
    deadline = time.monotonic() + max_s - min_s
    while time.monotonic() < deadline:
        busy = False
        for tid in os.listdir(task_dir):
            if tid == me:
                continue
            try:
                with open(f"{task_dir}/{tid}/stat") as f:
                    state = f.read().rpartition(")")[2].split()[0]
            except (OSError, IndexError):
                continue
            busy = busy or state in ("R", "D")
        if not busy:
            return
        time.sleep(0.01)
