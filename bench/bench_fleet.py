"""A fleet of devices against one vLLM server on loopback: remote speculative decoding against remote plain.

    python bench/bench_fleet.py --out bench/results/fleet.json

Starts one vLLM server (`edgespec serve-target models/demo-target`, in .venv-vllm), then for N devices
(separate processes, started together):
- remote speculative: each device drafts with the bundled draft (γ, prompt lookup) and verifies on the
  server (edgespec.load(URL, draft=..., local=...));
- remote speculative, pipelined: the same with RemoteConfig(pipeline=True) (pipeline.py): a second verify
  for the all-accepted branch goes out while the first is in flight;
- remote plain: each device sends its prompts to the same server as ordinary greedy completion requests
  (streamed, one token per chunk), as a device without a draft would.
All decode the same prompts (device i gets prompts i, i+N, ...), greedy, --max-new-tokens each. Reported per
run: the server's delivered tokens/s over the fleet's wall time (capacity), tokens/s per device, p50/p99
round latency (speculative: one draft + verify round; plain: the gap between streamed tokens), acceptance,
fallbacks, the share of verify prompt tokens the prefix cache held, the pipelined bets sent and won, and
whether each output equals remote plain's. The capacity ratio is the faster speculative mode over plain.

Then the kill run: N = --kill-devices speculative devices decode in a loop; the server is killed
(SIGKILL, all its processes) after --kill-at seconds and restarted at once; the devices fall back to their
local target, reconnect when it is back, and stop --after-restart seconds later. Every output is compared
with the reference (the same prompt decoded by the local target alone): a lost or duplicated token would
show as a difference. A timeline of verify calls (remote / local) per second goes to the JSON and the PNG.

Devices and server share this machine's cores: on a 2-core CPU the devices' drafting competes with the
server, which the numbers include. Writes JSON and a PNG beside --out.
"""
from __future__ import annotations

import argparse
import datetime as dt
import http.client
import json
import multiprocessing as mp
import os
import platform
import shlex
import socket
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench" / "lib"))  # the benches' shared helpers (bench/lib)


def _prompts(n: int) -> list[str]:
    from prompts import PROSE, code_prompts

    from edgespec.tokenizer import TextTokenizer
    tok = TextTokenizer(ROOT / "models" / "demo-target" / "tokenizer.json")
    return (code_prompts(tok, max(n - len(PROSE), 1)) + PROSE)[:n]


def _pct(xs, q) -> float | None:
    return float(np.percentile(xs, q)) if len(xs) else None


# -- one device (a process) -----------------------------------------------------------------------------
def device_speculative(i: int, url: str, prompts: list[str], args: dict, start, stop, out) -> None:
    os.environ["EDGESPEC_THREADS"] = "1"
    import edgespec
    from edgespec.remote import RemoteConfig
    gen = edgespec.load(url, draft=args["draft"], local=args["target"], gamma=args["gamma"], lookup=args["lookup"],
                        threads=1, remote=RemoteConfig(url, deadline_s=args["deadline"], backoff_max_s=2.0,
                                                       pipeline=args.get("pipeline", False)))
    results, rounds, calls = [], [], []
    out.put(("ready", i))
    start.wait()
    t_begin = time.time()
    j = 0
    while True:
        if args["loop"] and stop.is_set():
            break
        p = prompts[j % len(prompts)]
        gen.trace = []
        t0 = time.time()
        pc0 = time.perf_counter()
        o = gen.generate(p, max_new_tokens=args["max_new_tokens"])
        off = t0 - pc0  # perf_counter -> wall clock
        for name, a, b in gen.trace:
            if name == "round":
                rounds.append(b - a)
            elif name.startswith("target.remote") or name.startswith("target.local"):
                calls.append((b + off, "remote" if name.startswith("target.remote") else "local"))
        results.append(dict(prompt=j % len(prompts), ids=o.token_ids, t_end=time.time(), fallbacks=o.stats.fallbacks,
                            drafted=o.stats.drafted, accepted=o.stats.accepted))
        j += 1
        if not args["loop"] and j == len(prompts):
            break
    out.put(dict(device=i, t_begin=t_begin, t_end=time.time(), results=results, rounds=rounds, calls=calls,
                 counters=gen.target.counters.to_dict()))


def device_plain(i: int, url: str, prompts: list[str], args: dict, start, stop, out) -> None:
    from urllib.parse import urlsplit

    from edgespec.tokenizer import TextTokenizer
    tok = TextTokenizer(ROOT / "models" / "demo-target" / "tokenizer.json")
    u = urlsplit(url)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=600)
    results, gaps = [], []
    out.put(("ready", i))
    start.wait()
    t_begin = time.time()
    for j, p in enumerate(prompts):
        body = {"model": "demo-target", "prompt": tok.encode(p), "max_tokens": args["max_new_tokens"],
                "temperature": 0.0, "stream": True, "return_token_ids": True}
        conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
        r = conn.getresponse()
        ids, last = [], time.perf_counter()
        for line in r:  # server-sent events: "data: {...}" per chunk, then "data: [DONE]"
            line = line.strip()
            if not line.startswith(b"data: ") or line == b"data: [DONE]":
                continue
            new = json.loads(line[6:])["choices"][0].get("token_ids") or []
            if new:
                now = time.perf_counter()
                gaps.append(now - last)
                last = now
                ids.extend(new)
        results.append(dict(prompt=j, ids=ids, t_end=time.time()))
    out.put(dict(device=i, t_begin=t_begin, t_end=time.time(), results=results, rounds=gaps[1:] if gaps else [],
                 calls=[], counters={}))


# -- a fleet run ----------------------------------------------------------------------------------------
def run_fleet(mode: str, n: int, url: str, prompts: list[str], args: dict, event=None) -> list[dict]:
    """n device processes of `mode`, started together; event(stop) runs in this process meanwhile."""
    ctx = mp.get_context("spawn")
    start, stop, out = ctx.Event(), ctx.Event(), ctx.Queue()
    fn = device_plain if mode == "plain" else device_speculative
    args = dict(args, pipeline=mode == "pipelined")
    share = (lambda i: prompts) if args["loop"] else (lambda i: prompts[i::n])  # device i's prompts
    procs = [ctx.Process(target=fn, args=(i, url, share(i), args, start, stop, out)) for i in range(n)]
    for p in procs:
        p.start()
    for _ in procs:  # every device has loaded its engines before the clock starts
        msg = out.get(timeout=600)
        assert msg[0] == "ready", msg
    start.set()
    if event is not None:
        event(stop)
    got = [out.get(timeout=3600) for _ in procs]
    for p in procs:
        p.join()
    return sorted(got, key=lambda d: d["device"])


MODES = {"speculative": "speculative", "pipelined": "speculative, pipelined", "plain": "plain"}


def summarize(mode: str, n: int, devs: list[dict]) -> dict:
    t0, t1 = min(d["t_begin"] for d in devs), max(d["t_end"] for d in devs)
    tokens = sum(len(r["ids"]) for d in devs for r in d["results"])
    rounds = [x for d in devs for x in d["rounds"]]
    row = dict(mode=f"remote {MODES[mode]}", devices=n, tokens=tokens, wall_s=t1 - t0,
               capacity_tok_s=tokens / (t1 - t0),
               per_device_tok_s=[sum(len(r["ids"]) for r in d["results"]) / (d["t_end"] - d["t_begin"]) for d in devs],
               round_ms_p50=_pct(rounds, 50) * 1e3 if rounds else None,
               round_ms_p99=_pct(rounds, 99) * 1e3 if rounds else None, rounds=len(rounds))
    if mode != "plain":
        drafted = sum(r["drafted"] for d in devs for r in d["results"])
        accepted = sum(r["accepted"] for d in devs for r in d["results"])
        c = [d["counters"] for d in devs]
        row.update(acceptance=accepted / drafted if drafted else 0.0,
                   fallbacks=sum(x["fallbacks"] for x in c), requests=sum(x["requests"] for x in c),
                   failures={k: sum(x["failures"].get(k, 0) for x in c) for k in {k for x in c for k in x["failures"]}},
                   reconnects=sum(x["reconnects"] for x in c),
                   prefetched=sum(x["prefetched"] for x in c), prefetch_hits=sum(x["prefetch_hits"] for x in c),
                   cached_share=sum(x["cached_tokens"] for x in c) / max(1, sum(x["prompt_tokens"] for x in c)))
    row["per_device_tok_s_mean"] = float(np.mean(row["per_device_tok_s"]))
    return row


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "fleet.json")
    ap.add_argument("--devices", default="1,2,4,8")
    ap.add_argument("--prompts", type=int, default=16, help="prompts per fleet run, shared out among the devices")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--gamma", type=int, default=4)
    ap.add_argument("--lookup", type=int, default=3)
    ap.add_argument("--deadline", type=float, default=2.0, help="a verify's deadline (s) before it falls back")
    ap.add_argument("--kill-devices", type=int, default=4, help="devices in the kill run (0: no kill run)")
    ap.add_argument("--kill-at", type=float, default=20.0, help="seconds into the kill run the server is killed")
    ap.add_argument("--after-restart", type=float, default=20.0, help="seconds the kill run goes on once it is back")
    ap.add_argument("--port", type=int, default=0)
    ap.add_argument("--engines", type=Path, default=ROOT / "engines")
    args = ap.parse_args(argv)
    from edgespec import serve
    target, draft = args.engines / "demo-target", args.engines / "demo-draft"
    for e, name in ((target, "demo-target"), (draft, "demo-draft")):
        if not (e / "engine.json").is_file():
            from edgespec.export.onnx_export import export_engine
            export_engine(ROOT / "models" / name, e)
    ns = [int(x) for x in args.devices.split(",")]
    port = args.port or _free_port()
    url = f"http://127.0.0.1:{port}"
    args.out.parent.mkdir(parents=True, exist_ok=True)
    log = Path(os.environ.get("TMPDIR", "/tmp")) / f"edgespec-fleet-{port}.server.log"  # not committed
    t_start = time.time()
    print(f"starting vLLM on {url} (log: {log})", flush=True)
    model = ROOT / "models" / "demo-target"
    proc = serve.start(model, port, log=log)
    ready_s = serve.wait_ready(url, proc)
    print(f"ready after {ready_s:.0f} s", flush=True)
    prompts = _prompts(args.prompts)
    common = dict(target=str(target), draft=str(draft), gamma=args.gamma, lookup=args.lookup, deadline=args.deadline,
                  max_new_tokens=args.max_new_tokens, loop=False)
    try:
        run_fleet("speculative", 1, url, prompts[:2], common)  # warm-up: vLLM compiles its first shapes
        run_fleet("plain", 1, url, prompts[:2], common)
        rows, same = [], {}
        for n in ns:
            outs = {}
            for mode in ("speculative", "pipelined", "plain"):
                devs = run_fleet(mode, n, url, prompts, common)
                rows.append(summarize(mode, n, devs))
                outs[mode] = {(d["device"], k): r["ids"] for d in devs for k, r in enumerate(d["results"])}
                r = rows[-1]
                print(f"N={n} {r['mode']:<30} capacity {r['capacity_tok_s']:6.1f} tok/s, per device "
                      f"{r['per_device_tok_s_mean']:6.1f}, round p50 {r['round_ms_p50']:.1f} ms p99 "
                      f"{r['round_ms_p99']:.1f} ms" + (f", acceptance {r['acceptance']:.2f}, fallbacks "
                                                        f"{r['fallbacks']}, cached {r['cached_share']:.2f}, "
                                                        f"bets won {r['prefetch_hits']}/{r['prefetched']}"
                                                        if 'acceptance' in r else ""), flush=True)
            same[n] = {m: f"{sum(outs[m][k] == outs['plain'][k] for k in outs['plain'])}/{len(outs['plain'])}"
                       for m in ("speculative", "pipelined")}
        kill = None
        if args.kill_devices:
            proc, kill = kill_run(args, url, port, model, log, proc, prompts, common, target)
    finally:
        serve.stop(proc)
    by = {(r["mode"], r["devices"]): r for r in rows}
    best = {n: max(("remote speculative", "remote speculative, pipelined"), key=lambda m: by[(m, n)]["capacity_tok_s"])
            for n in ns}
    ratios = {n: by[(best[n], n)]["capacity_tok_s"] / by[("remote plain", n)]["capacity_tok_s"] for n in ns}
    report = dict(
        command="python bench/bench_fleet.py " + shlex.join(argv if argv is not None else sys.argv[1:]),
        date=dt.datetime.fromtimestamp(t_start).isoformat(timespec="seconds"), wall_s=time.time() - t_start,
        machine=dict(cpus=os.cpu_count(), platform=platform.platform(), python=platform.python_version()),
        server=dict(model="models/demo-target", ready_s=ready_s,
                    flags=serve.command(model, port=port)[1].replace(f"{ROOT}/", "")),
        settings=dict(prompts=len(prompts), max_new_tokens=args.max_new_tokens, gamma=args.gamma, lookup=args.lookup,
                      deadline_s=args.deadline),
        rows=rows, capacity_ratio_speculative_over_plain={str(n): r for n, r in ratios.items()},
        ratio_modes={str(n): f"{best[n]} / remote plain" for n in ns},
        identical_to_plain={str(n): same[n] for n in ns}, kill_run=kill)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1) + "\n")
    plot(report, args.out.with_suffix(".png"))
    print("capacity ratio (speculative / plain): " + ", ".join(f"N={n}: {r:.2f}x" for n, r in ratios.items()))
    print(f"wrote {args.out} and {args.out.with_suffix('.png')}")
    return 0


def kill_run(args, url, port, model, log, proc, prompts, common, target):
    """The kill run: returns (the restarted server, the run's report)."""
    import edgespec
    from edgespec import serve
    ref_gen = edgespec.load(target, threads=1)
    ref = [ref_gen.generate(p, max_new_tokens=args.max_new_tokens).token_ids for p in prompts]
    marks = {}
    state = {"proc": proc}

    def event(stop):
        t0 = time.time()
        time.sleep(args.kill_at)
        serve.stop(state["proc"])
        marks["killed"] = time.time() - t0
        print(f"kill run: server killed at {marks['killed']:.1f} s; restarting", flush=True)
        state["proc"] = serve.start(model, port, log=log.with_suffix(".restart.log"),  # outlives this thread;
                                    die_with_parent=False)  # the caller stops the returned process
        serve.wait_ready(url, state["proc"])
        marks["restarted"] = time.time() - t0
        print(f"kill run: server back at {marks['restarted']:.1f} s", flush=True)
        time.sleep(args.after_restart)
        stop.set()
        marks["stopped"] = time.time() - t0

    n = args.kill_devices
    devs = run_fleet("speculative", n, url, prompts, dict(common, loop=True), event)
    t0 = min(d["t_begin"] for d in devs)
    gens = [r for d in devs for r in d["results"]]
    wrong = [(d["device"], k) for d in devs for k, r in enumerate(d["results"]) if r["ids"] != ref[r["prompt"]]]
    bins = int(max(d["t_end"] for d in devs) - t0) + 1
    timeline = {w: [0] * bins for w in ("remote", "local")}
    for d in devs:
        for t, where in d["calls"]:
            timeline[where][min(bins - 1, int(t - t0))] += 1
    tokens = [0] * bins
    for r in gens:
        tokens[min(bins - 1, int(r["t_end"] - t0))] += len(r["ids"])
    per_device = [dict(device=d["device"], generations=len(d["results"]),
                       tokens=sum(len(r["ids"]) for r in d["results"]),
                       local_calls=sum(1 for _, w in d["calls"] if w == "local"),
                       remote_calls_after_restart=sum(1 for t, w in d["calls"] if w == "remote"
                                                      and t - t0 > marks["restarted"]),
                       counters=d["counters"]) for d in devs]
    report = dict(devices=n, marks_s=marks, generations=len(gens), tokens=sum(len(r["ids"]) for r in gens),
                  outputs_differing_from_reference=len(wrong),
                  per_device=per_device, timeline_calls_per_s=timeline, timeline_tokens_per_s=tokens)
    print(f"kill run: {len(gens)} generations, {report['tokens']} tokens, {len(wrong)} differing from the "
          f"reference; local calls per device {[p['local_calls'] for p in per_device]}, remote calls after the "
          f"restart {[p['remote_calls_after_restart'] for p in per_device]}", flush=True)
    return state["proc"], report


def plot(report: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    kill = report.get("kill_run")
    fig, axes = plt.subplots(1, 2 if kill else 1, figsize=(12 if kill else 6, 4.2), squeeze=False)
    ax = axes[0][0]
    for mode, style in (("remote speculative", "o-"), ("remote speculative, pipelined", "^-"),
                        ("remote plain", "s--")):
        rs = [r for r in report["rows"] if r["mode"] == mode]
        ax.plot([r["devices"] for r in rs], [r["capacity_tok_s"] for r in rs], style, label=mode)
    ax.set_xlabel("devices")
    ax.set_ylabel("server delivered tokens/s")
    ax.set_title("fleet capacity, one vLLM server (loopback)")
    ax.set_xscale("log", base=2)
    ax.legend()
    ax.grid(alpha=0.3)
    if kill:
        ax = axes[0][1]
        t = np.arange(len(kill["timeline_tokens_per_s"]))
        ax.bar(t, kill["timeline_calls_per_s"]["remote"], color="tab:blue", label="verify calls on the server")
        ax.bar(t, kill["timeline_calls_per_s"]["local"], bottom=kill["timeline_calls_per_s"]["remote"],
               color="tab:orange", label="on the local target (fallback)")
        for k, c in (("killed", "red"), ("restarted", "green")):
            if k in kill["marks_s"]:
                ax.axvline(kill["marks_s"][k], color=c, ls="--", label=f"server {k}")
        ax.set_xlabel("seconds")
        ax.set_ylabel("verify calls per second (all devices)")
        ax.set_title(f"{kill['devices']} devices, server killed and restarted: "
                     f"{kill['outputs_differing_from_reference']} outputs differ")
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


if __name__ == "__main__":
    raise SystemExit(main())
