"""The VLA policy with its target on a vLLM server (loopback) against the same policy on the device.

    MUJOCO_GL=osmesa python bench/bench_vla_remote.py --out bench/results/vla-remote.json

Starts one vLLM server from the policy's target checkpoint (`edgespec serve-target models/vla-reacher/target`,
in .venv-vllm), then:
- chunks: --observations reacher observations (scenes of seeds 0.., each instruction in turn), each acted
  on by the local policy and the remote one, interleaved, for each draft ("head", none): the act latency
  (p50 / p99 ms), target calls and verify requests per chunk, prompt rows sent per request, and whether every
  chunk's actions are identical to the local policy's;
- the control loop on the reacher (20 Hz, --loop-seconds) three times: remote with its local fallback, the
  server killed during the third policy call; remote with on_failure "raise" after the server is gone (the
  loop holds, then stops); and the local policy. Reported from each run's loop profile: remote fallbacks,
  calls that found the server unavailable, faults, the safe stop, sent/held ticks and the final distance.

The server runs on the same cores as the policy. Each verified position is a prompt of its own (vLLM
returns no prompt log-probabilities for embedding prompts), so a verify of n positions sends n prompts.
"""
from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import shlex
import socket
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _pct(xs, q) -> float:
    return float(np.percentile(xs, q))


def observations(n: int) -> list[tuple]:
    """n (image, state, instruction) from reacher scenes: seed i, instruction i mod 3."""
    from edgespec.robots.reacher import COLORS, ReacherRobot
    out = []
    for i in range(n):
        color = list(COLORS)[i % len(COLORS)]
        with ReacherRobot(seed=i, color=color) as robot:
            obs = robot.get_observation()
        out.append((obs["image"], obs["state"], f"reach the {color} target"))
    return out


def chunks(policy_dir: Path, url: str, obs: list[tuple], draft) -> dict:
    from edgespec.policy import load_policy
    local = load_policy(policy_dir, draft=draft)
    remote = load_policy(policy_dir, draft=draft, remote=url)
    for o in obs[:2]:  # warm both (the server's first calls compile)
        local.act(*o), remote.act(*o)
    c0 = dict(requests=remote.remote.counters.requests, rows=remote.remote.counters.prompt_tokens)
    t_local, t_remote, same, calls, fallbacks = [], [], 0, [], 0
    for o in obs:
        t0 = time.perf_counter()
        a = local.act(*o)
        t1 = time.perf_counter()
        b = remote.act(*o)
        t2 = time.perf_counter()
        t_local.append((t1 - t0) * 1e3)
        t_remote.append((t2 - t1) * 1e3)
        same += bool(np.array_equal(a, b))
        calls.append(remote.last_info["target_calls"])
        fallbacks += remote.last_info["fallbacks"]
    c = remote.remote.counters
    requests, rows = c.requests - c0["requests"], c.prompt_tokens - c0["rows"]
    return {"draft": draft or "none", "chunks": len(obs), "identical_chunks": same,
            "local_act_ms": {"p50": _pct(t_local, 50), "p99": _pct(t_local, 99)},
            "remote_act_ms": {"p50": _pct(t_remote, 50), "p99": _pct(t_remote, 99)},
            "target_calls_per_chunk": float(np.mean(calls)), "requests": requests,
            "prompt_rows_per_request": rows / max(requests, 1), "fallbacks": fallbacks,
            "server_s_per_request": c.server_s / max(c.requests, 1)}


def loop_runs(policy_dir: Path, url: str, proc, seconds: float) -> dict:
    from edgespec import serve
    from edgespec.policy import load_policy
    from edgespec.remote import RemoteConfig
    from edgespec.robots.loop import ControlLoop, LoopConfig
    from edgespec.robots.profile import loop_profile
    from edgespec.robots.reacher import ReacherRobot

    falls_back = load_policy(policy_dir, draft="head", remote=RemoteConfig(url, backoff_s=0.05))
    holds = load_policy(policy_dir, draft="head", remote=RemoteConfig(url, on_failure="raise"))

    class KillsTheServer:  # the policy; the server is killed (SIGKILL, all its processes) in its third call
        def __init__(self, policy):
            self.policy, self.calls, self.killed_s = policy, 0, None

        @property
        def last_info(self):
            return self.policy.last_info

        def __call__(self, o):
            self.calls += 1
            if self.calls == 3:
                self.killed_s = time.perf_counter()
                serve.stop(proc)
            return self.policy(o)

    class Watched(ReacherRobot):  # the reacher, noting the fingertip's distance to the target at each observation
        def __init__(self, **kw):
            super().__init__(**kw)
            self.seen: list[float] = []

        def get_observation(self):
            obs = super().get_observation()
            self.seen.append(self.env.distance())
            return obs

    def run(policy, name):
        with Watched(seed=1, color="red") as robot:
            start = robot.env.distance()
            rep = ControlLoop(robot, policy, LoopConfig(hz=20, hold_s=0.5)).run(seconds)
            final = robot.env.distance()
        p = loop_profile(rep)
        ticks = list(rep.tick_start_s)
        return {"run": name, "ticks": p["ticks"], "sent": p["sent"], "held_ticks": p["held_ticks"],
                "stopped_ticks": p["stopped_ticks"], "inferences": p["inferences"], "remote": p["remote"],
                "faults": p["faults"], "safe_stop_reason": p["safe_stop_reason"], "safe_stop_s": rep.safe_stop_s,
                "start_distance": start, "final_distance": final, "inference_ms": p["inference_ms"],
                "inference_start_s": list(rep.inference_start_s), "tick_s": ticks,
                "tick_distance_m": robot.seen[-len(ticks):] if ticks else [], "tick_action": list(rep.tick_action)}
    out = [run(KillsTheServer(falls_back), "remote, local fallback; server killed in the 3rd policy call"),
           run(holds, "remote, on_failure raise; server down (the loop holds, then stops)"),
           run(load_policy(policy_dir, draft="head"), "local policy (reference)")]
    return {"runs": out}


def plot(report: dict, path: Path) -> None:
    """Left: act latency, local against remote, per draft. Right: the fingertip's distance to the target at
    every tick of the three loop runs, the server's kill and the safe stop marked, held and stopped ticks
    as marks on their curve."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(13, 4.8), dpi=100)
    FigureCanvasAgg(fig)
    left, right = fig.subplots(1, 2, gridspec_kw={"width_ratios": [1, 2]})
    rows = report["chunks"]
    x = np.arange(len(rows))
    for off, side, color in ((-0.2, "local", "tab:blue"), (0.2, "remote", "tab:orange")):
        p50 = [r[f"{side}_act_ms"]["p50"] for r in rows]
        p99 = [r[f"{side}_act_ms"]["p99"] for r in rows]
        left.bar(x + off, p50, 0.4, color=color, label=f"{side} p50")
        left.scatter(x + off, p99, marker="_", s=300, color="k", zorder=3)
    left.set_xticks(x, [f"draft: {r['draft']}\n{r['identical_chunks']}/{r['chunks']} identical" for r in rows])
    left.set_ylabel("act (ms): bar p50, line p99")
    left.legend(fontsize=8)
    colors = ["tab:orange", "tab:red", "tab:blue"]
    for run, color in zip(report["loop"]["runs"], colors):
        t, d, acts = np.array(run["tick_s"]), np.array(run["tick_distance_m"]), np.array(run["tick_action"])
        if not t.size:
            continue
        right.plot(t, d, color=color, lw=1.5, label=run["run"])
        for mode, marker in (("held", "o"), ("stopped", "x")):
            sel = acts == mode
            if sel.any():
                right.scatter(t[sel], d[sel], marker=marker, s=14, color=color, zorder=3)
        if run["safe_stop_s"] is not None:
            right.axvline(run["safe_stop_s"], color=color, ls="--", lw=1)
    killed = report["loop"]["runs"][0]["inference_start_s"]
    if len(killed) >= 3:
        right.axvline(killed[2], color="k", ls=":", lw=1, label="server killed (3rd policy call)")
    right.set_xlabel("loop time (s): o held tick, x stopped tick, dashed: safe stop")
    right.set_ylabel("fingertip to target (m)")
    right.legend(fontsize=8)
    fig.suptitle("VLA policy, target on a vLLM server (loopback, 2-core CPU) against the same policy on the device",
                 fontsize=10)
    fig.tight_layout()
    fig.savefig(path, format="png")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "vla-remote.json")
    ap.add_argument("--observations", type=int, default=24)
    ap.add_argument("--loop-seconds", type=float, default=3.0)
    args = ap.parse_args(argv)
    os.environ.setdefault("MUJOCO_GL", "osmesa")
    from edgespec import serve
    from edgespec.export.bundled import ensure_policy_engines
    policy_dir = ensure_policy_engines(ROOT / "models", ROOT / "engines")
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    log = args.out.with_suffix(".server.log")
    model = ROOT / "models" / "vla-reacher" / "target"
    _, plain_cmd = serve.command(model, port=port)
    print(f"starting vLLM: {plain_cmd}", file=sys.stderr, flush=True)
    proc = serve.start(model, port, log=log)
    try:
        ready_s = serve.wait_ready(url, proc)
        obs = observations(args.observations)
        rows = []
        for draft in ("head", None):
            rows.append(chunks(policy_dir, url, obs, draft))
            print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
        loops = loop_runs(policy_dir, url, proc, args.loop_seconds)
    finally:
        serve.stop(proc)
    report = {"bench": "vla-remote", "command": "MUJOCO_GL=osmesa python bench/bench_vla_remote.py " +
              shlex.join(sys.argv[1:] if argv is None else argv),
              "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
              "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version()},
              "server": {"model": "models/vla-reacher/target", "vllm_serve": plain_cmd.replace(f"--port {port}", "--port PORT").replace(f"{ROOT}/", ""),
                         "ready_s": ready_s},
              "chunks": rows, "loop": loops}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    plot(report, args.out.with_suffix(".png"))
    log.unlink(missing_ok=True)
    print(f"wrote {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
