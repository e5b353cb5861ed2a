"""A planted slowdown for the sparkbook lab's slow image: every ``EngineCore`` step, once done, sleeps SLOW_FACTOR
times its own duration, so each step takes (1 + SLOW_FACTOR)x as long, on any machine and at any batch size (a fixed
sleep would be ~10x the lab's 1-node step of ~4 ms and ~1.5x its 2-node one of ~27 ms). Measured on the lab's 1-node
CPU serve at concurrency 1: factor 1.5 gave 0.30-0.32x the parent's output tok/s, so the default is 1.0.

vLLM calls ``register`` in each process it starts (entry point group ``vllm.general_plugins``); the engine core
calls it at the top of ``EngineCore.__init__``, before it binds ``self.step_fn``, so the wrapped methods are the
ones its busy loop runs. Sleeping outside the model leaves the greedy tokens as they were: only time changes.
SPARKBOOK_SLOW_FACTOR overrides the factor.
"""
from __future__ import annotations

import functools
import logging
import os
import time

SLOW_FACTOR = 1.0
MARK = "_sparkbook_slow_step"
STEPS = ("step", "step_with_batch_queue")
log = logging.getLogger("vllm.plugins.sparkbook_slow_step")  # under "vllm": vLLM's own handler prints it


def factor() -> float:
    raw = os.environ.get("SPARKBOOK_SLOW_FACTOR", "")
    return float(raw) if raw.strip() else SLOW_FACTOR


def slowed(step, k: float, sleep=time.sleep, clock=time.perf_counter):
    """``step`` (an unbound method) followed by a sleep of ``k`` times its duration."""
    @functools.wraps(step)
    def wrapper(self, *args, **kwargs):
        t0 = clock()
        out = step(self, *args, **kwargs)
        sleep(k * (clock() - t0))
        return out

    setattr(wrapper, MARK, k)
    return wrapper


def plant(cls, k: float, **kw) -> list[str]:
    """Wrap the step methods of ``cls`` once (a second call changes nothing); return the names wrapped now."""
    done = []
    for name in STEPS:
        step = cls.__dict__.get(name)
        if step is None or hasattr(step, MARK):
            continue
        setattr(cls, name, slowed(step, k, **kw))
        done.append(name)
    return done


def register() -> None:
    from vllm.v1.engine.core import EngineCore

    k = factor()
    done = plant(EngineCore, k)
    if done:
        log.warning("PLANTED SLOWDOWN (sparkbook lab slow image): EngineCore.%s sleeps %.2fx its own duration "
                    "after each step (pid %d)", "/".join(done), k, os.getpid())
