"""How a probed Ray actor ends, so a framework's normal shutdown is not recorded as a lost worker.

Ray ends actor processes in these ways (measured with Ray 2.60, tests/integration/test_probe_ray_actors.py and
test_probe_rllib.py):

- ``actor.__ray_terminate__`` / ``ray.actor.exit_actor()`` (Ray Train's graceful worker-group shutdown, which RLlib's
  ``LearnerGroup.shutdown`` uses): the worker's main loop returns and ``atexit`` runs — the probe deregisters with
  reason ``exit`` as in any process. Nothing to do here.
- ``ray.kill(actor)`` (RLlib's ``EnvRunnerGroup.stop``; Ray Train after its 5 s of patience — which it counts from the
  *first* actor gone, so the second learner of a pair may be killed while it is still exiting): the raylet kills the
  process at once; no Python code runs in it. So the probe in the process that calls ``ray.kill`` first asks the
  actor's own probe to deregister (reason ``ray_kill``) through ``actor.__ray_call__``, waits for that at most
  ``WAIT_S``, then kills. An actor busy with a long task cannot answer in time: the kill goes ahead after the wait and
  the worker is ``lost`` — ``ray.kill`` is delayed by at most that much.
- ``ray.shutdown()`` (explicit, or the one Ray registers with ``atexit``) while actors live: the raylet sends each
  worker ``SIGTERM`` and ``SIGKILL`` about a millisecond later — too soon for any handler to reach the control plane.
  So the driver's probe remembers the actors this process created (weakly: an actor whose handles are gone has been
  ended by Ray already) and, before Ray shuts down, asks every live one to deregister (reason ``ray_shutdown``), all
  at once, waiting at most ``WAIT_S``. Actors created by other actors are not asked (their creators die first).
- ``SIGTERM`` from outside (an operator, a node being drained): Ray's worker installs its own handler when its main
  loop starts, replacing the probe's. The handler Ray installs is wrapped: the probe deregisters (reason ``sigterm``,
  bounded like the probe's own handler), then Ray's handler runs unchanged. The driver's handler (set by
  ``ray.init``) is wrapped the same way.
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import logging
import os
import weakref
from collections.abc import Callable, Iterable
from types import FrameType
from typing import Any

from dsec.probe.lifecycle import SIGTERM

log = logging.getLogger(__name__)

#: ``deregistered`` reasons of actors that Ray ended.
RAY_KILL, RAY_SHUTDOWN = "ray_kill", "ray_shutdown"
#: How long ``ray.kill`` / ``ray.shutdown`` wait for the actors' probes to deregister before going ahead.
WAIT_S = 3.0

Ending = Callable[[str], None]

# Handles of the actors this process created; an actor whose handles are all gone was ended by Ray already.
_actors: weakref.WeakSet[Any] = weakref.WeakSet()


def install(ray: Any, end: Ending) -> None:
    """Patch Ray's actor creation, ``ray.kill``, ``ray.shutdown`` and its SIGTERM-handler setter (once per process);
    ``end(reason)`` ends this process's probe. Never raises into Ray's import."""
    if getattr(ray.kill, "_dsec_wrapped", False):
        return
    try:
        actor_class = ray.actor.ActorClass
        actor_class._remote = _tracking(actor_class._remote)
        ray.kill = _marked(_asking_first(ray, ray.kill, lambda actor: [actor], RAY_KILL))
        ray.shutdown = _asking_first(ray, ray.shutdown, lambda _: live_actors(), RAY_SHUTDOWN)
        utils = ray._private.utils
        utils.set_sigterm_handler = _ending_first_setter(utils.set_sigterm_handler, end)
    except AttributeError:  # another Ray layout: its actors keep Ray's behaviour (a kill is `lost`)
        log.debug("dsec: Ray's actor/kill/shutdown paths not found; not patched", exc_info=True)
        return
    # Registered after Ray registered its own atexit shutdown (at its import), so it runs before it.
    atexit.register(_before_ray_exits, ray)


def live_actors() -> list[Any]:
    return list(_actors)


def _tracking(remote: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(remote)
    def tracked(*args: Any, **kwargs: Any) -> Any:
        handle = remote(*args, **kwargs)
        with contextlib.suppress(TypeError):  # not a handle (a Ray client stub): not tracked
            _actors.add(handle)
        return handle

    return tracked


def _marked(fn: Callable[..., Any]) -> Callable[..., Any]:
    fn._dsec_wrapped = True  # type: ignore[attr-defined]
    return fn


def _asking_first(
    ray: Any, fn: Callable[..., Any], actors_of: Callable[[Any], Iterable[Any]], reason: str
) -> Callable[..., Any]:
    """``fn`` (ray.kill / ray.shutdown), preceded by asking the actors it is about to end to deregister."""

    @functools.wraps(fn)
    def asking_first(*args: Any, **kwargs: Any) -> Any:
        if ray.is_initialized():
            ask_to_deregister(ray, actors_of(args[0] if args else kwargs.get("actor")), reason)
        return fn(*args, **kwargs)

    return asking_first


def _before_ray_exits(ray: Any) -> None:
    if ray.is_initialized():
        ask_to_deregister(ray, live_actors(), RAY_SHUTDOWN)


def ask_to_deregister(ray: Any, actors: Iterable[Any], reason: str, wait_s: float = WAIT_S) -> None:
    """Run ``end_in_actor`` in each actor, all at once, and wait for them at most ``wait_s``. A call queues behind the
    actor's running task; an actor already gone answers at once with an error (consumed here, so Ray does not log it
    as unhandled). Never raises: the kill or shutdown goes ahead as before."""
    refs = []
    for actor in actors:
        call = getattr(actor, "__ray_call__", None)
        if call is None:  # not an actor handle (ray.kill raises for it), or a Ray without __ray_call__
            continue
        try:
            refs.append(call.remote(end_in_actor, reason))
        except Exception:
            log.debug("dsec: could not ask an actor to deregister", exc_info=True)
    if not refs:
        return
    try:
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=wait_s)
    except Exception:
        log.debug("dsec: waiting for actors to deregister failed", exc_info=True)
        return
    for ref in ready:
        with contextlib.suppress(Exception):
            ray.get(ref)


def end_in_actor(_instance: Any, reason: str) -> None:
    """Runs inside the actor's process (``__ray_call__`` passes the actor instance first): end its probe."""
    from dsec.probe import bootstrap

    bootstrap.end_now(reason)


def _ending_first_setter(setter: Callable[[Any], None], end: Ending) -> Callable[[Any], None]:
    @functools.wraps(setter)
    def set_sigterm_handler(handler: Any) -> None:
        setter(ending_first(handler, end) if callable(handler) else handler)

    return set_sigterm_handler


def ending_first(handler: Callable[[int, FrameType | None], Any], end: Ending) -> Callable[..., Any]:
    """``handler``, preceded by ending the probe (reason ``sigterm``) in the process that installed it; a forked
    child inherits it but only chains (it never deregisters its parent's worker)."""
    pid = os.getpid()

    @functools.wraps(handler)
    def handle(signum: int, frame: FrameType | None) -> Any:
        if os.getpid() == pid:
            end(SIGTERM)
        return handler(signum, frame)

    return handle
