"""VLA policy evaluation on the three-target MuJoCo reacher: plain vs speculative (exact, relaxed r).

    MUJOCO_GL=osmesa python bench/bench_vla.py --out bench/results/vla.json

For each of --episodes episodes (seeds 900000+i, never seen in training) every mode runs the same episode
in its own environment, modes interleaved episode by episode so machine noise hits them alike. The policy
replans every --execute steps (a chunk is H=8 steps). Per mode: success rate, mean return, accepted
tokens per round, action-decode latency p50/p99 (encoder excluded; act() total also reported), speedup of
decode over plain from the same run. Exact mode also checks its actions are identical to plain decoding on
every step of every episode; relaxed modes report the largest accepted bin distance and, on every call,
the deviation from the plain chunk for the same observation (computed untimed). Each call's decode is also
repeated (--repeats, default 3, same ids) and the fastest kept: speedup_decode_min_of_repeats filters this
shared machine's noise; the single-shot mean / p50 / p99 are reported beside it.
Drafts: "exact" and "relaxed" use the policy's numpy draft head (draft="head"); "exact (draft decoder)" the
1-layer draft decoder engine; "exact (last chunk)" the draft head with the last chunk first (last_chunk=True, the
exact head's settings; the policy object persists across episodes, as on a robot). Short sweeps on other episodes (seeds 910000+) first pick the draft length γ
and the dynamic-stop threshold per draft kind. Per-call costs (encoder, target at S tokens, draft decoder,
draft head) are measured on one observation and recorded, since they decide what speculation can gain.
Writes JSON and a PNG of each mode's speedup over plain (labelled with success and tokens per target call).
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent / "lib"))  # the benches' shared helpers (bench/lib)
import edgespec  # noqa: E402
from host import machine  # noqa: E402
from edgespec.export.bundled import ensure_policy_engines  # noqa: E402
from edgespec.robots.reacher import ThreeTargetReacher  # noqa: E402


def pct(xs, q) -> float:
    return float(np.percentile(np.asarray(xs), q)) if len(xs) else float("nan")


class Mode:
    def __init__(self, name, policy, reference=None, repeats: int = 3):
        self.name, self.policy, self.reference, self.repeats = name, policy, reference, repeats
        self.env = ThreeTargetReacher()
        self.success, self.returns, self.decode_ms, self.act_ms = [], [], [], []
        self.decode_min_ms: list[float] = []  # per call: the fastest of `repeats` decodes of the same prefix
        self.accepted = self.drafted = self.rounds = self.target_calls = self.tokens = 0
        self.max_dev_bins, self.max_dev_units = 0, np.zeros(policy.dims)
        self.actions: list[np.ndarray] = []

    def episode(self, seed: int, execute: int) -> None:
        obs, done, ret, info = self.env.reset(seed=seed), False, 0.0, {}
        p = self.policy
        while not done:
            last = p.last_chunk  # what act() drafts from with last_chunk=True; the repeats below use it too
            chunk = p.act(obs["image"], obs["state"], obs["instruction"])
            li = p.last_info
            self.decode_ms.append(li["decode_ms"])
            if self.repeats > 1:  # the same decode again (same ids): filters this shared machine's noise
                prefix = p.encode(obs["image"], obs["state"], obs["instruction"])
                best = li["decode_ms"]
                for _ in range(self.repeats - 1):
                    t = time.perf_counter()
                    p.decode_ids(prefix, last=last)
                    best = min(best, (time.perf_counter() - t) * 1e3)
                self.decode_min_ms.append(best)
            self.act_ms.append(li["act_ms"])
            self.accepted += li["accepted"]
            self.drafted += li["drafted"]
            self.rounds += li["rounds"]
            self.target_calls += li["target_calls"]
            self.tokens += chunk.size
            self.max_dev_bins = max(self.max_dev_bins, li["max_dev_bins"])
            self.actions.append(chunk)
            if self.reference is not None:  # untimed: what plain decoding gives for this observation
                ref = self.reference.act(obs["image"], obs["state"], obs["instruction"])
                self.max_dev_units = np.maximum(self.max_dev_units, np.abs(chunk - ref).max(0))
            for a in chunk[:execute]:
                obs, r, done, info = self.env.step(a)
                ret += r
                if done:
                    break
        self.success.append(bool(info["success"]))
        self.returns.append(ret)

    def report(self, plain: "Mode | None") -> dict:
        out = {"episodes": len(self.success), "success_rate": float(np.mean(self.success)),
               "mean_return": float(np.mean(self.returns)), "calls": len(self.decode_ms),
               "decode_ms_p50": pct(self.decode_ms, 50), "decode_ms_p99": pct(self.decode_ms, 99),
               "decode_ms_mean": float(np.mean(self.decode_ms)),
               "act_ms_p50": pct(self.act_ms, 50), "act_ms_p99": pct(self.act_ms, 99)}
        if self.rounds:
            out.update(rounds=self.rounds, accepted=self.accepted, drafted=self.drafted,
                       accepted_per_round=self.accepted / self.rounds,
                       tokens_per_round=self.tokens / self.target_calls,  # per target call
                       acceptance_rate=self.accepted / max(self.drafted, 1))
        if plain is not None:
            out["speedup_decode_p50"] = plain.report(None)["decode_ms_p50"] / out["decode_ms_p50"]
            out["speedup_decode_mean"] = float(np.mean(plain.decode_ms) / np.mean(self.decode_ms))
            out["speedup_act_p50"] = pct(plain.act_ms, 50) / out["act_ms_p50"]
            if self.decode_min_ms and plain.decode_min_ms:
                out["speedup_decode_min_of_repeats"] = float(np.sum(plain.decode_min_ms) / np.sum(self.decode_min_ms))
        if self.decode_min_ms:
            out["decode_min_of_repeats_ms_mean"] = float(np.mean(self.decode_min_ms))
        pol = self.policy
        if pol.draft is not None or pol.head is not None:
            out["draft"] = "head" if pol.head is not None else "decoder"
            out.update(gamma=pol.cfg.gamma, stop_below=pol.cfg.stop_below, last_chunk=pol.cfg.last_chunk)
        if pol.cfg.acceptance == "relaxed" and (pol.draft is not None or pol.head is not None):
            out["radius_bins"] = self.policy.cfg.radius
            out["max_accepted_dev_bins"] = int(self.max_dev_bins)
            out["worst_case_dev_per_token"] = self.policy.worst_case_deviation().tolist()  # action units
            out["max_dev_vs_plain_chunk"] = self.max_dev_units.tolist()  # action units, over every call
        return out

    def close(self):
        self.env.close()


def sweep(engines: Path, grid: list[dict], episodes: int, execute: int, seed0: int,
          repeats: int = 3) -> tuple[dict, dict]:
    """Run plain and every load_policy(**kw) of `grid` on the same episodes -> (table, best kw by mean
    decode speedup)."""
    plain = Mode("plain", edgespec.load_policy(engines), repeats=repeats)
    name = lambda kw: " ".join(f"{k}={v}" for k, v in kw.items() if k not in ("draft", "mode", "radius"))  # noqa: E731
    modes = [Mode(name(kw), edgespec.load_policy(engines, **kw), repeats=repeats) for kw in grid]
    for ep in range(episodes):
        for m in [plain] + modes:
            m.episode(seed0 + ep, execute)
    table = {m.name: {"decode_ms_mean": float(np.mean(m.decode_ms)),
                      "speedup_decode_mean": float(np.mean(plain.decode_ms) / np.mean(m.decode_ms)),
                      "speedup_decode_min_of_repeats": float(np.sum(plain.decode_min_ms) / np.sum(m.decode_min_ms)),
                      "tokens_per_round": m.tokens / max(m.target_calls, 1)} for m in modes}
    for m in [plain] + modes:
        m.close()
    best = max(zip(grid, modes), key=lambda gm: table[gm[1].name]["speedup_decode_min_of_repeats"])[0]
    return table, best


def call_costs(engines: Path, repeats: int = 300) -> dict:
    """Per-call latency (ms, median of `repeats`) of every piece a chunk is made of, on one real observation:
    what decides whether speculative decoding can pay on this machine."""
    env = ThreeTargetReacher()
    obs = env.reset(seed=123_456)
    env.close()
    pol = edgespec.load_policy(engines, draft=True)
    prefix = pol.encode(obs["image"], obs["state"], obs["instruction"])
    p, tgt, dd = prefix.shape[1], pol.target, pol.draft.dec

    def med(f) -> float:
        f()
        ts = []
        for _ in range(repeats):
            t = time.perf_counter()
            f()
            ts.append(time.perf_counter() - t)
        return round(float(np.median(ts)) * 1e3, 4)

    def prefill(dec, extra=0):
        dec.cache.rewind_to(0)
        x = prefix if not extra else np.concatenate([prefix, np.repeat(prefix[:, -1:], extra, 1)], 1)
        dec(None, embeds=x)

    out = {"encoder": med(lambda: pol.encode(obs["image"], obs["state"], obs["instruction"])),
           "target_prefill": med(lambda: prefill(tgt)), "draft_decoder_prefill": med(lambda: prefill(dd)),
           "target_prefill_plus_8": med(lambda: prefill(tgt, 8))}
    prefill(tgt)
    prefill(dd)
    tgt.cache.commit(p)
    dd.cache.commit(p)
    for s in (1, 2, 4, 8, 16):
        ids = np.full((1, s), 100, np.int64)
        out[f"target_S{s}"] = med(lambda: tgt(ids))
        out[f"draft_decoder_S{s}"] = med(lambda: dd(ids))
    if (engines / "draft_head.npz").is_file():
        head = edgespec.load_policy(engines, draft="head").head
        out["draft_head_start"] = med(lambda: head.start(prefix))
        out["draft_head_next"] = med(lambda: head.next([100, 120, 104, 124]))
    return out


def plot(results: dict, path: Path) -> None:
    """One bar per mode: the decode speedup over plain (fastest of the repeats per call), labelled with success and
    tokens per target call; exact modes dark, relaxed ones light."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    names = list(results["modes"])
    sp = [results["modes"][k].get("speedup_decode_min_of_repeats", 1.0) for k in names]
    fig, ax = plt.subplots(figsize=(7.5, 0.45 * len(names) + 1.4))
    ax.barh(range(len(names)), sp, color=["tab:gray" if k == "plain" else "lightsteelblue" if k.startswith("relaxed")
                                           else "tab:blue" for k in names])
    for i, k in enumerate(names):
        r = results["modes"][k]
        ax.text(sp[i], i, f"  {sp[i]:.2f}x, success {r['success_rate']:.2f}, "
                f"{r.get('tokens_per_round', 1.0):.2f} tokens / target call", va="center", fontsize=8)
    ax.set_yticks(range(len(names)), names, fontsize=9)
    ax.invert_yaxis()
    ax.set_xlim(0, max(sp) * 1.8)
    ax.axvline(1.0, ls=":", c="gray", lw=1)
    ax.set_xlabel("action-decode speedup over plain (same run; fastest of 3 decodes per call)")
    ax.set_title(f"three-target reacher, {results['episodes']} episodes per mode", fontsize=10)
    ax.grid(axis="x", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="bench/results/vla.json")
    ap.add_argument("--episodes", type=int, default=100)
    ap.add_argument("--execute", type=int, default=4, help="chunk steps executed before replanning")
    ap.add_argument("--radii", default="2,5,9")
    ap.add_argument("--gamma", default="auto", help="the most draft tokens per round for every draft, or 'auto': "
                    "pick γ and --stop-below per draft kind from a short sweep")
    ap.add_argument("--stop-below", type=float, default=0.0, help="dynamic draft length with a fixed --gamma")
    ap.add_argument("--sweep-episodes", type=int, default=10)
    ap.add_argument("--repeats", type=int, default=3, help="decodes per call; the fastest is kept as well")
    ap.add_argument("--models", default="models")
    ap.add_argument("--engines", default="engines")
    args = ap.parse_args(argv)
    engines = ensure_policy_engines(args.models, args.engines)
    seed0 = 900_000
    t0 = time.time()
    radii = [int(r) for r in args.radii.split(",")]
    costs = call_costs(engines)
    print("per-call ms:", costs)
    # draft length (and dynamic stop) per draft kind, from a short sweep on other episodes
    grids = {
        "exact head": [dict(draft="head", gamma=g, stop_below=sb) for g in (8, 15) for sb in (0.0, 0.5, 0.7, 0.8)],
        "exact decoder": [dict(draft=True, gamma=g, stop_below=sb) for g in (2, 4, 8) for sb in (0.0, 0.5)],
        "relaxed head": [dict(draft="head", mode="relaxed", radius=radii[len(radii) // 2], gamma=g, stop_below=sb)
                         for g in (8, 15) for sb in (0.5, 0.7, 0.8)]}
    sweeps, best = {}, {}
    for key, grid in grids.items():
        if args.gamma != "auto":
            best[key] = {**grid[0], "gamma": int(args.gamma), "stop_below": args.stop_below}
            continue
        sweeps[key], best[key] = sweep(engines, grid, args.sweep_episodes, args.execute, seed0 + 10_000,
                                       args.repeats)
        print(f"sweep ({key}):", {k: round(v["speedup_decode_min_of_repeats"], 2) for k, v in sweeps[key].items()},
              "->", best[key])
    ref = edgespec.load_policy(engines)
    rp = args.repeats
    modes = [Mode("plain", edgespec.load_policy(engines), repeats=rp),
             Mode("exact", edgespec.load_policy(engines, **best["exact head"]), repeats=rp),
             Mode("exact (draft decoder)", edgespec.load_policy(engines, **best["exact decoder"]), repeats=rp),
             Mode("exact (last chunk)", edgespec.load_policy(engines, last_chunk=True, **best["exact head"]),
                  repeats=rp)]
    relaxed = {k: v for k, v in best["relaxed head"].items() if k != "radius"}
    modes += [Mode(f"relaxed r={r}", edgespec.load_policy(engines, radius=r, **relaxed), reference=ref, repeats=rp)
              for r in radii]
    try:
        from tqdm import tqdm
        it = tqdm(range(args.episodes), desc="episodes")
    except ImportError:
        it = range(args.episodes)
    for ep in it:
        for m in modes:
            m.episode(seed0 + ep, args.execute)
    plain = modes[0]
    identical = {m.name: len(plain.actions) == len(m.actions) and all(
        np.array_equal(a, b) for a, b in zip(plain.actions, m.actions)) for m in modes[1:4]}
    results = {"command": "MUJOCO_GL=osmesa python bench/bench_vla.py " + " ".join(argv or sys.argv[1:]),
               "machine": machine(), "episodes": args.episodes, "execute": args.execute,
               "action_units": json.loads((engines / "policy.json").read_text()).get("action_units", ""),
               "call_costs_ms": costs, "settings": {k: {kk: vv for kk, vv in v.items() if kk != "radius"}
                                                    for k, v in best.items()},
               "sweeps": sweeps, "exact_actions_identical_to_plain": identical,
               "policy": json.loads((engines / "policy.json").read_text())["task"],
               "modes": {m.name: m.report(None if m is plain else plain) for m in modes},
               "wall_s": round(time.time() - t0, 1)}
    for m in modes + [Mode("ref-close", ref)]:
        m.close()
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2) + "\n")
    plot(results, out.with_suffix(".png"))
    for name, r in results["modes"].items():
        print(f"{name:14s} success {r['success_rate']:.2f} return {r['mean_return']:7.2f} "
              f"decode p50 {r['decode_ms_p50']:.2f} ms p99 {r['decode_ms_p99']:.2f} ms "
              f"speedup {r.get('speedup_decode_mean', 1.0):.2f}x (p50 {r.get('speedup_decode_p50', 1.0):.2f}x, "
              f"min of repeats {r.get('speedup_decode_min_of_repeats', 1.0):.2f}x) "
              f"tokens/round {r.get('tokens_per_round', 1.0):.2f}")
    print(f"exact actions identical to plain: {identical}; wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
