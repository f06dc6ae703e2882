"""Fault soak: the 20 Hz control loop with the bundled VLA policy (numpy draft head) on the MuJoCo reacher
for --seconds, with seeded random faults injected all along, checking that the loop fails safe every time
and that the process does not grow.

    MUJOCO_GL=osmesa python bench/bench_soak.py --seconds 600 --out bench/results/soak.json

Faults (one at a time, kinds in a seeded shuffled cycle, on average one every --mean-gap-s):
  nan, overflow    the state reads NaN / 1e39 (finite in float64, inf in the engine's float32) in a random
                   subset of its entries, for 1..14 ticks
  dropped          get_observation() raises (no reading this tick), for 1..14 ticks
  stale            the observation's timestamp freezes for 8..15 ticks (the loop calls it stale past 0.25 s)
  policy_raises    the next policy call raises ValueError (as the Policy does on a bad input)
  hang             the next policy call takes --watchdog-s + 0.3 s (a hung engine)
  send_raises      the next send_action() raises (a driver fault)
  safe_stop_raises the next safe_stop() raises
  stop_request     stop() from another thread (what SIGINT / SIGTERM do in `edgespec robot run`)

The soak runs the loop in runs of --run-s, each a fresh reacher episode (a new seed and target: the
reacher's episode is 40 steps and it keeps stepping past that, but a fresh scene keeps the policy
reaching). An operator thread calls loop.reset() once a latched safe stop has lasted --stopped-s (mid-run; a latch
carries over into the next run until then); a stop() request ends its run, and the soak resets it
--stopped-s later. Checks, all in the JSON:
  - sent_while_stopped: actions the robot received while the loop's safe stop was latched (must be 0);
  - missed: per kind, injected faults the loop did not record (must be 0);
  - unexpected faults: recorded faults that match no injection (reported; load can make real ones);
  - RSS (VmRSS from /proc/self/status, every --rss-every-s): start / end / max and the least-squares
    slope over the samples after the first --warmup-s; flat means a slope below --rss-slope-mb-min MB/min
    (default 0.5: a leak of 1 KB per tick at 20 Hz is 1.2 MB/min).
Exit status 0 when every check passes.
"""
from __future__ import annotations

import argparse
import json
import sys
import threading
import time
from collections import Counter
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent / "lib"))  # the benches' shared helpers (bench/lib)
from host import machine  # noqa: E402
from edgespec.export.bundled import ensure_policy_engines  # noqa: E402
from edgespec.policy import load_policy  # noqa: E402
from edgespec.robots.loop import ControlLoop, LoopConfig  # noqa: E402
from edgespec.robots.reacher import COLORS, SUCCESS_RADIUS, ReacherRobot  # noqa: E402

OBS_KINDS = ("nan", "overflow", "dropped", "stale")
CALL_KINDS = ("policy_raises", "hang", "send_raises", "safe_stop_raises", "stop_request")
KINDS = OBS_KINDS + CALL_KINDS
DROPPED = "injected: no reading from the sensor this tick"


def rss_mb() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024.0  # kB -> MB
    raise RuntimeError("no VmRSS line in /proc/self/status (the soak needs Linux)")


class Injector:
    """Decides, once per observation (the loop thread's tick), whether a fault starts, and tells the robot
    and the policy wrapper what to do. Counts each fault when it takes effect (`injected`). Faults start
    only with enough of the run left for the loop to see them through (`begin_run`)."""

    def __init__(self, seed: int, hz: float, mean_gap_s: float, watchdog_s: float, hold_s: float):
        self.rng = np.random.default_rng(seed)
        self.dt, self.p_start = 1.0 / hz, min(1.0, 1.0 / (hz * mean_gap_s))
        self.watchdog_s, self.hold_s = watchdog_s, hold_s
        self.margin_s = watchdog_s + hold_s + 0.5  # a policy fault needs this long to be caught and latched
        self.lock = threading.Lock()
        self.cycle: list[str] = []
        self.injected: Counter = Counter()
        self.obs_kind, self.obs_left, self.obs_index = "", 0, None  # the observation fault in progress
        self.armed = ""  # a call fault waiting for its call
        self.stop_armed = False  # safe_stop_raises waits for the next stop without holding up other faults
        self.cooldown = 0  # clean ticks left before the next fault (so two episodes never merge)
        self.tick, self.run_ticks = 0, 0
        self.loop: ControlLoop | None = None

    def begin_run(self, seconds: float) -> None:
        with self.lock:
            self.tick, self.run_ticks = -1, int(round(seconds / self.dt))  # the first observation is pre-tick
            self.obs_kind, self.obs_left = "", 0

    def ticks_left(self) -> int:
        return self.run_ticks - self.tick

    def _next_kind(self) -> str:
        if not self.cycle:
            self.cycle = list(self.rng.permutation(KINDS))
        return str(self.cycle.pop())

    def on_observe(self) -> str:
        """-> the observation fault this tick ("" for none). Called by the robot once per tick."""
        with self.lock:
            self.tick += 1
            if self.obs_left:
                self.obs_left -= 1
                if not self.obs_left:
                    self.cooldown = 2
                return self.obs_kind
            if self.cooldown:
                self.cooldown -= 1
                return ""
            if self.armed or self.ticks_left() * self.dt < 1.0 or self.rng.random() >= self.p_start:
                return ""  # one fault at a time, none in a run's last second (the loop must see it through)
            kind = self._next_kind()
            if kind in OBS_KINDS:
                n = int(self.rng.integers(8, 16) if kind == "stale" else self.rng.integers(1, 15))
                if self.ticks_left() < n + 3:  # it would straddle two runs: try again later
                    self.cycle.append(kind)
                    return ""
                self.obs_kind, self.obs_left = kind, n - 1
                self.obs_index = np.sort(self.rng.choice(6, int(self.rng.integers(1, 7)), replace=False))
                self.injected[kind] += 1
                self.cooldown = 2 if n == 1 else 0
                return kind
            if kind == "safe_stop_raises":
                self.stop_armed = True
                return ""
            self.armed = kind
        if kind == "stop_request":  # like a signal: another thread asks, a moment later
            threading.Timer(float(self.rng.uniform(0.05, 0.5)), self._stop_now).start()
        return ""

    def _stop_now(self) -> None:
        with self.lock:
            if self.armed != "stop_request":
                return
            self.armed = ""
            self.injected["stop_request"] += 1
        self.loop.stop("soak: operator stop")

    def take(self, kind: str, need_s: float = 0.0) -> bool:
        """True (and counted) when `kind` is armed and the run has need_s left to see it through."""
        with self.lock:
            if kind == "safe_stop_raises":
                if not self.stop_armed:
                    return False
                self.stop_armed = False
            elif self.armed != kind or self.ticks_left() * self.dt < need_s:
                return False
            else:
                self.armed = ""
                self.cooldown = int(self.margin_s / self.dt)  # quiet until the loop has dealt with it
            self.injected[kind] += 1
            return True


class SoakRobot(ReacherRobot):
    """The reacher with a timestamped observation, faults injected, and a tally of every action it gets
    while the loop's safe stop is latched (there must be none)."""

    def __init__(self, inj: Injector, **kw):
        super().__init__(**kw)
        self.inj = inj
        self.observation_features = {**self.observation_features, "timestamp": ()}
        self.sent_while_stopped = 0
        self.stamp = 0.0

    def get_observation(self) -> dict:
        kind = self.inj.on_observe()
        if kind == "dropped":
            raise TimeoutError(DROPPED)
        obs = super().get_observation()
        if kind != "stale":
            self.stamp = time.perf_counter()  # the robot's clock; a stale reading repeats its stamp
        obs["timestamp"] = self.stamp
        if kind in ("nan", "overflow"):
            state = obs["state"].copy()
            state[self.inj.obs_index] = np.nan if kind == "nan" else 1e39
            obs["state"] = state
        return obs

    def send_action(self, action):
        if self.inj.loop is not None and self.inj.loop.stopped:
            self.sent_while_stopped += 1
        if self.inj.take("send_raises", need_s=self.inj.hold_s + 0.5):
            raise RuntimeError("injected: driver fault, joint 1 over current")
        return super().send_action(action)

    def safe_stop(self) -> None:
        if self.inj.take("safe_stop_raises"):
            raise OSError("injected: CAN bus down")
        super().safe_stop()


class SoakPolicy:
    """The policy with call faults injected: a ValueError, or a call that takes past the watchdog."""

    def __init__(self, policy, inj: Injector):
        self.policy, self.inj = policy, inj

    def __call__(self, obs: dict) -> np.ndarray:
        need = self.inj.margin_s
        if self.inj.take("policy_raises", need_s=need):
            raise ValueError("injected: state must be finite float32 values")
        if self.inj.take("hang", need_s=need):
            chunk = self.policy(obs)  # the engine's answer, but far too late
            time.sleep(self.inj.watchdog_s + 0.3)
            return chunk
        return self.policy(obs)


def fault_kind(msg: str) -> str:
    """A recorded fault message -> the injected kind it stands for ("other" for none)."""
    if "malformed state" in msg:
        got = msg.split(" got ", 1)[-1]
        return "nan" if "nan" in got else "overflow" if "e+39" in got else "other"
    for needle, kind in ((DROPPED, "dropped"), ("stale observation", "stale"),
                         ("policy raised ValueError: injected", "policy_raises"), ("engine hung", "hang"),
                         ("injected: driver fault", "send_raises"), ("robot.safe_stop() raised", "safe_stop_raises")):
        if needle in msg:
            return kind
    return "other"


class Operator(threading.Thread):
    """The operator: resets a latched safe stop once it has lasted stopped_s, mid-run as on a robot (a stop
    request ends the run instead; the soak's main loop resets that one). Counts the stops by kind."""

    def __init__(self, loop: ControlLoop, stopped_s: float):
        super().__init__(daemon=True)
        self.loop, self.stopped_s, self.quit = loop, stopped_s, threading.Event()
        self.stops: Counter = Counter()
        self.resets = 0

    def run(self) -> None:
        since = None
        while not self.quit.wait(0.02):
            if not self.loop.stopped or self.loop.stop_requested:
                since = None
                continue
            if since is None:
                since = time.perf_counter()
                reason = self.loop.safety.reason
                kind = fault_kind(reason)
                self.stops[kind if kind != "other" else reason.split(" for ")[0]] += 1
            elif time.perf_counter() - since >= self.stopped_s:
                self.loop.reset()
                self.resets += 1
                since = None


class RssSampler(threading.Thread):
    def __init__(self, every_s: float):
        super().__init__(daemon=True)
        self.every_s, self.quit = every_s, threading.Event()
        self.samples: list[tuple[float, float]] = []  # (s since start, MB)
        self.t0 = time.perf_counter()

    def run(self) -> None:
        while True:
            self.samples.append((round(time.perf_counter() - self.t0, 2), round(rss_mb(), 2)))
            if self.quit.wait(self.every_s):
                return


def rss_summary(samples, warmup_s: float, slope_limit: float) -> dict:
    t, mb = (np.asarray(x, dtype=float) for x in zip(*samples))
    after = t >= warmup_s
    out = {"samples": [list(s) for s in samples], "start_mb": mb[0], "end_mb": mb[-1], "max_mb": float(mb.max()),
           "warmup_s": warmup_s, "slope_limit_mb_per_min": slope_limit}
    if after.sum() >= 3 and np.ptp(t[after]) > 0:
        slope = float(np.polyfit(t[after] / 60.0, mb[after], 1)[0])  # MB per minute
        out.update(slope_mb_per_min=slope, growth_after_warmup_mb=float(mb[after][-1] - mb[after][0]),
                   flat=slope <= slope_limit)
    else:
        out.update(slope_mb_per_min=None, growth_after_warmup_mb=None, flat=None)  # too short to judge
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seconds", type=float, default=600.0, help="soak duration")
    ap.add_argument("--out", default="bench/results/soak.json")
    ap.add_argument("--seed", type=int, default=0, help="fault schedule and scenes")
    ap.add_argument("--hz", type=float, default=20.0)
    ap.add_argument("--mean-gap-s", type=float, default=1.0, help="mean time between injected faults")
    ap.add_argument("--run-s", type=float, default=6.0, help="length of each run (a fresh reacher episode)")
    ap.add_argument("--stopped-s", type=float, default=1.0, help="how long a latched stop lasts before reset()")
    ap.add_argument("--watchdog-s", type=float, default=1.0)
    ap.add_argument("--hold-s", type=float, default=0.5)
    ap.add_argument("--rss-every-s", type=float, default=5.0)
    ap.add_argument("--warmup-s", type=float, default=60.0, help="RSS samples before this are not in the slope")
    ap.add_argument("--rss-slope-mb-min", type=float, default=0.5, help="RSS is flat below this slope")
    ap.add_argument("--draft", default="head")
    ap.add_argument("--verbose", action="store_true", help="a line per run")
    ap.add_argument("--models", default="models")
    ap.add_argument("--engines", default="engines")
    args = ap.parse_args(argv)
    if not args.seconds > 0 or not args.run_s > args.stopped_s > 0:
        ap.error(f"expected --seconds > 0 and --run-s > --stopped-s > 0, got {args.seconds}, {args.run_s}, "
                 f"{args.stopped_s}")

    engines = ensure_policy_engines(Path(args.models), Path(args.engines))
    policy = load_policy(engines, draft="head" if args.draft == "head" else True)
    inj = Injector(args.seed, args.hz, args.mean_gap_s, args.watchdog_s, args.hold_s)
    cfg = LoopConfig(hz=args.hz, hold_s=args.hold_s, watchdog_s=args.watchdog_s)
    scenes = np.random.default_rng(args.seed + 1)
    tally = Counter()  # ticks, sent, held, stopped ticks, deadline misses, runs, ...
    detected, outcomes, other = Counter(), Counter(), []
    periods = np.zeros(int(args.seconds * args.hz * 1.2) + 100)  # (ticks,) preallocated: no growth
    n_periods, successes = 0, []
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)

    with SoakRobot(inj, seed=0, color="red") as robot:
        policy(robot.get_observation() | {"timestamp": 0.0})  # warm the engines (first-call set-up)
        loop = ControlLoop(robot, SoakPolicy(policy, inj), cfg)
        inj.loop = loop
        rss = RssSampler(args.rss_every_s)
        rss.start()
        operator = Operator(loop, args.stopped_s)
        operator.start()
        t0 = time.perf_counter()
        while (left := args.seconds - (time.perf_counter() - t0)) > 0.2:
            # a fresh scene each run (the reacher keeps stepping past its 40-step episode, but a new target
            # keeps the policy reaching); a latched stop carries over into the run until the operator resets
            robot.seed, robot.color = int(scenes.integers(2**31)), str(scenes.choice(list(COLORS)))
            robot.connect()
            robot.distances.clear()
            seconds = min(args.run_s, left)
            inj.begin_run(seconds)
            rep = loop.run(seconds)
            tally.update(runs=1, ticks=rep.ticks, sent=rep.sent, held=rep.held, stopped_ticks=rep.stopped_ticks,
                         deadline_misses=rep.deadline_misses, safe_stop_failures=rep.safe_stop_failures,
                         queue_dropped_stale=rep.queue_dropped_stale)
            outcomes.update(rep.inference_outcome)
            if args.verbose:
                print(f"run {tally['runs']}: {rep.ticks} ticks {dict(Counter(rep.tick_action))} "
                      f"stop {rep.safe_stop_reason!r} faults {rep.faults}")
            detected["safe_stop_raises"] += rep.safe_stop_failures  # a run of failures is one fault entry
            for f in rep.faults:
                kind = fault_kind(f)
                if kind == "safe_stop_raises":
                    continue
                detected[kind] += 1
                if kind == "other":
                    other.append(f)
            p = np.diff(rep.tick_start_s)
            k = min(len(p), len(periods) - n_periods)
            periods[n_periods:n_periods + k] = p[:k]
            n_periods += k
            if rep.stop_requested:  # the run ended on stop(): the operator restarts after a while
                detected["stop_request"] += 1
                operator.stops["stop_request"] += 1
                time.sleep(min(args.stopped_s, max(0.0, args.seconds - (time.perf_counter() - t0))))
                loop.reset()
                tally.update(resets=1)
            elif rep.stopped_ticks == 0 and robot.distances and rep.ticks >= 40:
                successes.append(robot.distances[-1] <= SUCCESS_RADIUS)
        wall = time.perf_counter() - t0
        operator.quit.set()
        operator.join()
        rss.quit.set()
        rss.join()
    stops = operator.stops
    tally.update(resets=operator.resets)
    sent_while_stopped = robot.sent_while_stopped
    missed = {k: max(0, inj.injected[k] - detected[k]) for k in KINDS}
    jitter = np.abs(periods[:n_periods] - 1.0 / args.hz) * 1e3
    mem = rss_summary(rss.samples, args.warmup_s, args.rss_slope_mb_min)
    ok = sent_while_stopped == 0 and not any(missed.values()) and mem["flat"] is not False
    results = {
        "command": "MUJOCO_GL=osmesa python bench/bench_soak.py " + " ".join(sys.argv[1:] if argv is None else argv),
        "machine": machine(), "config": {k: v for k, v in vars(args).items() if k not in ("out",)},
        "wall_s": round(wall, 1), "expected_ticks": int(wall * args.hz), **dict(tally),
        "jitter_ms": {"p50": float(np.percentile(jitter, 50)), "p99": float(np.percentile(jitter, 99)),
                      "max": float(jitter.max())} if n_periods else None,
        "injected": {k: inj.injected[k] for k in KINDS}, "detected": {k: detected[k] for k in KINDS},
        "missed": missed, "unexpected_faults": other[:50], "unexpected_fault_count": len(other),
        "latched_stops": dict(stops), "inference_outcomes": dict(outcomes),
        "sent_while_stopped": sent_while_stopped,
        "episode_success_rate": float(np.mean(successes)) if successes else None, "episodes_scored": len(successes),
        "rss": mem, "ok": bool(ok),
    }
    out.write_text(json.dumps(results, indent=2, default=float) + "\n")
    r = mem
    print(f"{wall:.0f} s soak: {tally['ticks']} ticks ({results['expected_ticks']} expected) in {tally['runs']} runs, "
          f"{tally['sent']} sent / {tally['held']} held / {tally['stopped_ticks']} stopped, "
          f"{tally['deadline_misses']} deadline misses, jitter p99 "
          f"{results['jitter_ms']['p99'] if results['jitter_ms'] else float('nan'):.2f} ms")
    print("faults injected / detected: " + ", ".join(f"{k} {inj.injected[k]}/{detected[k]}" for k in KINDS)
          + f"; unexpected {len(other)}")
    print(f"latched stops {sum(stops.values())} {dict(stops)}, resets {tally['resets']}, "
          f"actions sent while stopped: {sent_while_stopped}")
    slope = "n/a (too short)" if r["slope_mb_per_min"] is None else f"{r['slope_mb_per_min']:+.3f} MB/min"
    print(f"RSS start {r['start_mb']:.1f} / end {r['end_mb']:.1f} / max {r['max_mb']:.1f} MB, slope after "
          f"{args.warmup_s:g} s {slope} (flat below {args.rss_slope_mb_min} MB/min)")
    print(f"{'OK' if ok else 'FAILED'}; wrote {out}")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
