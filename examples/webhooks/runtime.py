"""An agent runtime receiving DSec's policies: register with the control plane, report, and apply pushed policies.

    # This runtime listens on 127.0.0.1: the control plane refuses private destinations unless told otherwise, and a
    # pool token registers runtimes only for allow-listed callback hosts (docs/security.md).
    dsec serve --cluster examples/cluster.yaml --webhook-allow-private --webhook-allowed-host 127.0.0.1 &
    DSEC_TOKEN=$(dsec token create --pool pool-0) python examples/webhooks/runtime.py
    # in another shell: push a policy to it (admin token):
    #   curl -X POST -H "Authorization: Bearer $(cat ~/.dsec/admin.token)" -H 'Content-Type: application/json' \\
    #        -d '{"policy": "gradient_accumulation", "steps": 4, "target_gpu": "gpu-00"}' \\
    #        http://127.0.0.1:8080/v1/runtimes/<id>/policies
"""

import os
import secrets
import threading
import time

import uvicorn

from dsec.client import Client
from dsec.integrations.webhook import WebhookReceiver

ENDPOINT = os.environ.get("DSEC_ENDPOINT", "http://127.0.0.1:8080")
SECRET = secrets.token_urlsafe(24)
PORT = 8099

receiver = WebhookReceiver(SECRET)


@receiver.on("gradient_accumulation")
def accumulate(policy: dict) -> None:
    print(f"accumulating gradients over {policy['steps']} steps on {policy.get('target_gpu')}")


with Client(ENDPOINT, token=os.environ["DSEC_TOKEN"]) as dsec:
    rt = dsec.register_runtime(name="example-runtime", type="dify-agent-runtime",
                               callback_url=f"http://127.0.0.1:{PORT}/", secret=SECRET)
    print(f"registered as {rt['id']}")

    def report() -> None:
        with Client(ENDPOINT, token=rt["runtime_token"]) as me:
            while True:
                me.runtime_report(rt["id"], concurrent_agents=3, avg_llm_latency_ms=420.0, function_calling=True)
                time.sleep(10)

    threading.Thread(target=report, daemon=True).start()
    uvicorn.run(receiver.asgi, host="127.0.0.1", port=PORT, interface="asgi3")
