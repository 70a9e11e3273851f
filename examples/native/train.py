# Run: DSEC_SANDBOX_ID=pool-0 DSEC_TOKEN=dsp_... .venv/bin/python examples/native/train.py
from dsec.integrations import native

native.init("http://127.0.0.1:8080", "my-trainer")
native.report_episode_end(12.5, 200)
native.shutdown()
