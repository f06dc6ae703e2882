"""robots/worker.py, the inference worker the control loop and the DDS node share: one call at a time, every
failure an Inference (never an exception), the watchdog's abandon, and stop(). Synchronised with events,
never with timing."""
import threading
import time

import numpy as np
import pytest

from edgespec.robots.checks import check_chunk, not_finite_as_engine_input
from edgespec.robots.worker import InferenceWorker

TIMEOUT = 10.0


class Gate:
    """A policy that blocks in each call until released; returns `out(obs)`."""

    def __init__(self, out=lambda obs: np.ones((3, 2)) * obs["x"]):
        self.out, self.entered, self.release = out, threading.Event(), threading.Event()
        self.last_info = {"acceptance": 0.5, "note": "not a number"}

    def __call__(self, obs):
        self.entered.set()
        assert self.release.wait(TIMEOUT)
        return self.out(obs)


def make(policy, **kw):
    done, landed = [], threading.Semaphore(0)  # landed.acquire(timeout=...): one call landed

    def on_done(inf):
        done.append(inf)
        landed.release()
    w = InferenceWorker(policy, on_done, **kw)
    w.start()
    return w, done, landed


def test_a_call_lands_checked_with_its_job_and_info_and_the_worker_is_busy_until_then():
    policy = Gate()
    w, done, landed = make(policy, check=lambda a: check_chunk(a, dims=2))
    try:
        assert w.busy_since is None and w.submit("job-1", {"x": 2.0}, now=5.0)
        assert w.busy_since == 5.0 and not w.submit("job-2", {"x": 3.0})  # one at a time
        policy.release.set()
        assert landed.acquire(timeout=TIMEOUT)
        (inf,) = done
        assert inf.job == "job-1" and inf.outcome == "ok" and not inf.error and inf.end >= inf.start
        assert inf.chunk.tolist() == [[2.0, 2.0]] * 3 and inf.info == {"acceptance": 0.5}
        assert w.busy_since is None
    finally:
        w.stop()
        w.join(TIMEOUT)


@pytest.mark.parametrize("out,outcome,text", [
    (lambda obs: 1 / 0, "raised", "policy raised ZeroDivisionError"),
    (lambda obs: np.full((3, 2), np.nan), "bad chunk", "policy returned a bad chunk: NaN or inf in its chunk"),
    (lambda obs: np.ones((3, 4)), "bad chunk", "chunk has 4 action dims, robot takes 2"),
    (lambda obs: "garbage", "bad chunk", "not a numeric array"),
    (lambda obs: np.ones(3), "bad chunk", "(H >= 1 steps, D dims), got shape (3,)"),
])
def test_a_failing_call_is_an_inference_with_an_error(out, outcome, text):
    policy = Gate(out)
    policy.release.set()
    w, done, landed = make(policy, check=lambda a: check_chunk(a, dims=2))
    try:
        w.submit(None, {"x": 1.0})
        assert landed.acquire(timeout=TIMEOUT)
        assert done[0].outcome == outcome and text in done[0].error and done[0].chunk is None
        assert w.busy_since is None  # a failed call frees the worker too
    finally:
        w.stop()
        w.join(TIMEOUT)


def test_an_abandoned_call_comes_back_late_and_the_next_job_waits_for_it():
    policy = Gate()
    clock = iter(range(1000))
    w, done, landed = make(policy, clock=lambda: float(next(clock)))
    try:
        w.submit("hung", {"x": 1.0}, now=0.0)
        assert policy.entered.wait(TIMEOUT)
        assert w.overdue(1.0, 2.0) is None and w.overdue(3.0, 2.0) == 3.0  # the watchdog's question
        w.abandon()
        assert w.busy_since is None and w.submit("next", {"x": 2.0}, now=3.0)
        policy.release.set()
        assert landed.acquire(timeout=TIMEOUT) and landed.acquire(timeout=TIMEOUT)
        assert [(i.job, i.outcome) for i in done] == [("hung", "late"), ("next", "ok")]
    finally:
        w.stop()
        w.join(TIMEOUT)


def test_stop_returns_the_call_in_flight_and_nothing_lands_after_it():
    policy = Gate()
    w, done, landed = make(policy)
    w.submit("job", {"x": 1.0})
    assert policy.entered.wait(TIMEOUT)
    job, start = w.stop()
    assert job == "job" and not w.submit("after", {"x": 1.0})
    policy.release.set()
    w.join(TIMEOUT)
    assert not done and w.stop() is None


def test_thread_setup_runs_in_the_worker_thread_before_its_first_call():
    seen = []

    class Setup:
        def __enter__(self):
            time.sleep(0.2)  # a slow set-up: start() still returns only after it
            seen.append(("enter", threading.current_thread().name))

        def __exit__(self, *exc):
            seen.append(("exit", threading.current_thread().name))

    w, done, landed = make(lambda obs: seen.append("call") or np.ones((1, 1)), thread_setup=Setup, name="w-test")
    assert seen == [("enter", "w-test")]  # start() returned after the set-up ran
    w.submit(None, {})
    assert landed.acquire(timeout=TIMEOUT)
    w.stop()
    w.join(TIMEOUT)
    assert seen == [("enter", "w-test"), "call", ("exit", "w-test")]


def test_not_finite_as_engine_input_sees_float32_overflow():
    assert not_finite_as_engine_input([0.0, 1e39, -1e39, np.nan, 3e38]).tolist() == [1, 2, 3]
    assert not_finite_as_engine_input(np.zeros(3)).size == 0
