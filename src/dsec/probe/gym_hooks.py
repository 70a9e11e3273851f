"""Instrumentation of gymnasium, installed right after ``import gymnasium`` finishes.

Environments created through ``gymnasium.make`` are wrapped in ``EpisodeMonitor``; vector environments
created through ``gymnasium.make_vec`` in ``VectorEpisodeMonitor`` (their sub-environments are then not
wrapped again, so nothing is counted twice). Environments constructed directly, without ``make``, are
not seen. The monitors count steps, episode returns and lengths, terminated vs truncated, and
"interrupted" episodes — an episode whose final ``info`` has a true value under one of the configured
keys (default ``collision``, ``crash``, ``interrupted``). While the control plane has paused
asynchronous sampling in an ``actor`` process, ``step`` waits (heartbeats continue on their thread).
"""

from __future__ import annotations

import contextlib
import functools
import threading
from collections.abc import Callable, Iterator, Sequence
from types import ModuleType
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from dsec.probe.runtime import Probe

_inside_make_vec = threading.local()


def _as_list(values: Any) -> list[Any]:
    if type(values) is list:
        return values
    tolist = getattr(values, "tolist", None)
    out = tolist() if tolist is not None else values
    return out if type(out) is list else list(out)


def _interrupted(info: Any, keys: Sequence[str], index: int | None = None) -> str | None:
    """The first configured key marking this episode as interrupted (the reason), or None."""
    if not isinstance(info, dict):
        return None
    for key in keys:
        value = info.get(key)
        if value is None:
            continue
        if index is not None:
            try:
                mask = info.get(f"_{key}")
                if mask is not None and not bool(mask[index]):
                    continue
                value = value[index]
            except (TypeError, IndexError, KeyError):
                continue
        try:
            if bool(value):
                return key
        except (TypeError, ValueError):
            continue
    return None


class GymInstrumentation:
    def __init__(self, probe: Probe) -> None:
        self.probe = probe
        self._restore: list[tuple[Any, str, Any]] = []

    def install(self, gym: ModuleType) -> None:
        probe = self.probe
        keys = tuple(probe.config.interrupt_info_keys)
        EpisodeMonitor = _episode_monitor(gym.Wrapper, probe, keys)
        VectorEpisodeMonitor = _vector_episode_monitor(gym.vector.VectorWrapper, probe, keys)
        self.EpisodeMonitor = EpisodeMonitor
        self.VectorEpisodeMonitor = VectorEpisodeMonitor
        self._patch(gym, "make", self._wrap_make(gym.make, EpisodeMonitor))
        self._patch(gym, "make_vec", self._wrap_make_vec(gym.make_vec, VectorEpisodeMonitor))

    def _patch(self, owner: Any, name: str, replacement: Callable[..., Any]) -> None:
        self._restore.append((owner, name, getattr(owner, name)))
        setattr(owner, name, replacement)

    def uninstall(self) -> None:
        for owner, name, original in reversed(self._restore):
            setattr(owner, name, original)
        self._restore.clear()

    def _wrap_make(self, fn: Callable[..., Any], monitor: type) -> Callable[..., Any]:
        probe = self.probe

        @functools.wraps(fn)
        def make(*args: Any, **kwargs: Any) -> Any:
            env = fn(*args, **kwargs)
            if getattr(_inside_make_vec, "active", False):
                return env
            probe.activity("gym")
            return monitor(env)

        return make

    def _wrap_make_vec(self, fn: Callable[..., Any], monitor: type) -> Callable[..., Any]:
        probe = self.probe

        @functools.wraps(fn)
        def make_vec(*args: Any, **kwargs: Any) -> Any:
            with _flag():
                env = fn(*args, **kwargs)
            probe.activity("gym")
            return monitor(env)

        return make_vec


@contextlib.contextmanager
def _flag() -> Iterator[None]:
    _inside_make_vec.active = True
    try:
        yield
    finally:
        _inside_make_vec.active = False


def _episode_monitor(wrapper_base: type, probe: Probe, keys: tuple[str, ...]) -> type:
    """gymnasium.Wrapper subclass counting one environment's steps and episodes for ``probe``."""

    actuators = probe.actuators

    class EpisodeMonitor(wrapper_base):
        """Counts steps and episodes of one environment for the DSec probe."""

        def __init__(self, env: Any) -> None:
            super().__init__(env)
            self._ret = 0.0
            self._len = 0

        def reset(self, **kwargs: Any) -> Any:
            self._ret, self._len = 0.0, 0
            return self.env.reset(**kwargs)

        def step(self, action: Any) -> Any:
            if actuators.sampling_paused:
                probe.wait_for_sampling()
            obs, reward, terminated, truncated, info = self.env.step(action)
            self._ret += float(reward)
            self._len += 1
            probe.telemetry.record_env_steps(1)
            if terminated or truncated:
                reason = probe.interrupt_reason(_interrupted(info, keys))
                probe.telemetry.record_episode(
                    self._ret, self._len, bool(terminated), bool(truncated), reason is not None
                )
                probe.after_episode(reason)
                self._ret, self._len = 0.0, 0
            return obs, reward, terminated, truncated, info

    return EpisodeMonitor


def _vector_episode_monitor(vector_base: type, probe: Probe, keys: tuple[str, ...]) -> type:
    """gymnasium.vector.VectorWrapper subclass counting a vector environment's steps and episodes for ``probe``."""

    from numpy import ndarray  # (gymnasium's own dependency)

    actuators = probe.actuators

    class VectorEpisodeMonitor(vector_base):
        """Counts steps and episodes of a vector environment, honouring its autoreset mode."""

        def __init__(self, env: Any) -> None:
            super().__init__(env)
            n = env.num_envs
            self._ret = [0.0] * n
            self._len = [0] * n
            self._resetting = [False] * n
            self._any_resetting = False  # any(self._resetting), kept so the common step does not compute it
            self._counter = probe.telemetry.env_step_counter(self)
            mode = getattr(env, "metadata", {}).get("autoreset_mode")
            # NEXT_STEP (gymnasium's default): the step after an episode ends only resets that
            # sub-environment (reward 0, action ignored): it is not a step of the next episode.
            name = str(getattr(mode, "value", mode)).lower().replace("_", "")
            self._next_step = mode is None or name == "nextstep"

        def reset(self, **kwargs: Any) -> Any:
            n = self.env.num_envs
            self._ret, self._len, self._resetting = [0.0] * n, [0] * n, [False] * n
            self._any_resetting = False
            return self.env.reset(**kwargs)

        def step(self, actions: Any) -> Any:
            if actuators.sampling_paused:  # (the check first: a call per env step costs microseconds)
                probe.wait_for_sampling()
            obs, rewards, terminated, truncated, info = self.env.step(actions)
            # Plain lists once per step: indexing numpy scalars per sub-environment cost microseconds each (and
            # numpy's own reductions more than these conversions, measured). gymnasium's vector envs return arrays.
            if type(rewards) is ndarray and type(terminated) is ndarray and type(truncated) is ndarray:
                rew, term, trunc = rewards.tolist(), terminated.tolist(), truncated.tolist()
            else:
                rew, term, trunc = _as_list(rewards), _as_list(terminated), _as_list(truncated)
            if not (self._any_resetting or any(term) or any(trunc)):
                ret, length = self._ret, self._len
                for i, r in enumerate(rew):
                    ret[i] += r
                    length[i] += 1
                self._counter.steps += len(rew)
                return obs, rewards, terminated, truncated, info
            stepped = 0
            for i in range(len(self._ret)):
                if self._resetting[i]:
                    self._resetting[i] = False
                    continue
                stepped += 1
                self._ret[i] += float(rew[i])
                self._len[i] += 1
                if term[i] or trunc[i]:
                    reason = probe.interrupt_reason(_interrupted(info, keys, i))
                    probe.telemetry.record_episode(
                        self._ret[i],
                        self._len[i],
                        bool(term[i]),
                        bool(trunc[i]),
                        reason is not None,
                    )
                    self._ret[i], self._len[i] = 0.0, 0
                    self._resetting[i] = self._next_step
                    probe.after_episode(reason)
            self._any_resetting = any(self._resetting)
            self._counter.steps += stepped
            return obs, rewards, terminated, truncated, info

    return VectorEpisodeMonitor
