"""Episode accounting of the gymnasium instrumentation, checked against gymnasium's own statistics."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

gym = pytest.importorskip("gymnasium")

from dsec.probe.config import ProbeConfig  # noqa: E402
from dsec.probe.gym_hooks import GymInstrumentation  # noqa: E402
from dsec.probe.runtime import Probe  # noqa: E402


@pytest.fixture
def probe() -> Iterator[Probe]:
    # Nothing listens on port 9: the reporter retries in the background, the hooks work regardless.
    cfg = ProbeConfig.from_env({"DSEC_ENDPOINT": "http://127.0.0.1:9", "DSEC_SANDBOX_ID": "p"})
    assert cfg is not None
    p = Probe(cfg)
    inst = GymInstrumentation(p)
    inst.install(gym)
    p.gym = inst
    yield p
    p.close()
    p.uninstall()


def test_single_env_episodes_and_steps(probe: Probe) -> None:
    env = gym.make("CartPole-v1")
    reference = gym.wrappers.RecordEpisodeStatistics(env)
    reference.reset(seed=1)
    rng = np.random.default_rng(1)
    returns, steps = [], 0
    while len(returns) < 10:
        _, _, term, trunc, info = reference.step(int(rng.integers(2)))
        steps += 1
        if term or trunc:
            returns.append(float(info["episode"]["r"]))
            reference.reset()
    t = probe.telemetry
    assert t.episodes_total == 10
    assert t.env_steps_total == steps
    out = t.collect()
    assert out["episode_return_mean"] == pytest.approx(sum(returns) / 10)
    assert out["terminated_total"] + out["truncated_total"] == 10
    assert "episode_length_cv" in out
    assert probe.reporter is not None, "creating an environment is training activity: the probe registers"


def test_vector_env_next_step_autoreset_is_not_double_counted(probe: Probe) -> None:
    envs = gym.make_vec("CartPole-v1", num_envs=4, vectorization_mode="sync")
    reference = gym.wrappers.vector.RecordEpisodeStatistics(envs)
    reference.reset(seed=3)
    rng = np.random.default_rng(3)
    ref_returns: list[float] = []
    for _ in range(400):
        _, _, _, _, info = reference.step(rng.integers(2, size=4))
        if "episode" in info:
            ref_returns += [float(r) for r, done in zip(info["episode"]["r"], info["_episode"], strict=True) if done]
    t = probe.telemetry
    assert t.episodes_total == len(ref_returns) > 10
    out = t.collect()
    assert out["episode_return_mean"] == pytest.approx(float(np.mean(ref_returns)))
    # Every episode's return equals its length in CartPole; steps skip the autoreset steps.
    assert out["episode_length_mean"] == pytest.approx(out["episode_return_mean"])


def test_vector_env_steps_are_counted_and_stay_counted_after_the_env_is_gone(probe: Probe) -> None:
    import gc

    t = probe.telemetry
    envs = gym.make_vec("CartPole-v1", num_envs=3, vectorization_mode="sync")
    envs.reset(seed=0)
    # Fixed actions and no episode end in 5 steps (CartPole needs more): every sub-environment steps each time.
    for _ in range(5):
        envs.step(np.zeros(3, dtype=np.int64))
    assert t.env_steps_total == 15
    assert t.collect()["env_steps_total"] == 15
    envs.close()
    del envs
    gc.collect()
    assert t.env_steps_total == 15  # the monitor's own counter was folded in, not lost
    assert not t._env_counters  # (and not kept: envs made and dropped in a loop hold no memory)
    more = gym.make_vec("CartPole-v1", num_envs=2, vectorization_mode="sync")
    more.reset(seed=1)
    more.step(np.zeros(2, dtype=np.int64))
    assert t.env_steps_total == 17
    more.close()


class _Crashy(gym.Wrapper):  # type: ignore[misc]
    """Ends every episode after 3 steps with info['collision'] = True."""

    def __init__(self, env: Any) -> None:
        super().__init__(env)
        self.n = 0

    def step(self, action: Any) -> Any:
        obs, r, _, _, info = self.env.step(action)
        self.n += 1
        if self.n % 3 == 0:
            return obs, r, True, False, {**info, "collision": True}
        return obs, r, False, False, info


def test_interrupted_episodes_raise_a_stuck_alert(probe: Probe) -> None:
    gym.register(id="DsecCrashy-v0", entry_point=lambda: _Crashy(gym.make("CartPole-v1").unwrapped))
    try:
        env = gym.make("DsecCrashy-v0")
        env.reset(seed=0)
        for _ in range(9):
            env.step(0)
    finally:
        gym.registry.pop("DsecCrashy-v0")
    assert probe.telemetry.interrupted_total == 3
    assert probe.telemetry.consecutive_interrupted == 3
    rep = probe.reporter
    assert rep is not None
    alerts = [e for e in rep._events if e["type"] == "anomaly"]
    assert alerts and alerts[0]["data"] == {"kind": "episode_stuck", "reason": "collision", "count": 3}


def test_an_actor_env_waits_while_sampling_is_paused_and_steps_on_when_resumed() -> None:
    import threading

    cfg = ProbeConfig.from_env({"DSEC_ENDPOINT": "http://127.0.0.1:9", "DSEC_SANDBOX_ID": "p", "DSEC_ROLE": "actor"})
    assert cfg is not None
    p = Probe(cfg)
    inst = GymInstrumentation(p)
    inst.install(gym)
    p.gym = inst
    try:
        envs = gym.make_vec("CartPole-v1", num_envs=2, vectorization_mode="sync")
        env = gym.make("CartPole-v1")
        envs.reset(seed=0)
        env.reset(seed=0)
        p.actuators.handle({"version": 1, "async_sampling": False})
        done = threading.Event()

        def sample() -> None:
            envs.step(np.zeros(2, dtype=np.int64))
            env.step(0)
            done.set()

        t = threading.Thread(target=sample, daemon=True)
        t.start()
        assert not done.wait(0.5)  # paused: the step waits
        assert p.telemetry.env_steps_total == 0
        p.actuators.handle({"version": 2, "async_sampling": True})
        assert done.wait(5.0)
        t.join(5.0)
        assert p.telemetry.env_steps_total == 3
        envs.close()
        env.close()
    finally:
        p.close()
        p.uninstall()
