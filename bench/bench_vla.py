"""VLA policy evaluation on the three-target MuJoCo reacher: plain vs speculative (exact, relaxed r).

    MUJOCO_GL=osmesa python bench/bench_vla.py --out bench/results/vla.json

For each of --episodes episodes (seeds 900000+i, never seen in training) every mode runs the same episode
in its own environment, modes interleaved episode by episode so machine noise hits them alike. The policy
replans every --execute steps (a chunk is H=8 steps). Per mode: success rate, mean return, accepted
tokens per round, action-decode latency p50/p99 (encoder excluded; act() total also reported), speedup of
decode over plain from the same run. Exact mode also checks its actions are identical to plain decoding on
every step of every episode; relaxed modes report the largest accepted bin distance and, on every call,
the deviation from the plain chunk for the same observation (computed untimed).
γ sweeps over a few episodes pick the draft length first (one for exact, one for relaxed at the middle r). Writes JSON and a PNG of success vs speedup.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import edgespec  # noqa: E402
from bench_speculative import machine  # noqa: E402
from edgespec.cli import ensure_policy_engines  # noqa: E402
from edgespec.robots.reacher import ThreeTargetReacher  # noqa: E402


def pct(xs, q) -> float:
    return float(np.percentile(np.asarray(xs), q)) if len(xs) else float("nan")


class Mode:
    def __init__(self, name, policy, reference=None):
        self.name, self.policy, self.reference = name, policy, reference
        self.env = ThreeTargetReacher()
        self.success, self.returns, self.decode_ms, self.act_ms = [], [], [], []
        self.accepted = self.drafted = self.rounds = 0
        self.max_dev_bins, self.max_dev_units = 0, np.zeros(policy.dims)
        self.actions: list[np.ndarray] = []

    def episode(self, seed: int, execute: int) -> None:
        obs, done, ret, info = self.env.reset(seed=seed), False, 0.0, {}
        p = self.policy
        while not done:
            chunk = p.act(obs["image"], obs["state"], obs["instruction"])
            li = p.last_info
            self.decode_ms.append(li["decode_ms"])
            self.act_ms.append(li["act_ms"])
            self.accepted += li["accepted"]
            self.drafted += li["drafted"]
            self.rounds += li["rounds"]
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
                       tokens_per_round=(self.accepted + self.rounds) / self.rounds,
                       acceptance_rate=self.accepted / max(self.drafted, 1))
        if plain is not None:
            out["speedup_decode_p50"] = plain.report(None)["decode_ms_p50"] / out["decode_ms_p50"]
            out["speedup_decode_mean"] = float(np.mean(plain.decode_ms) / np.mean(self.decode_ms))
            out["speedup_act_p50"] = pct(plain.act_ms, 50) / out["act_ms_p50"]
        if self.policy.cfg.mode == "relaxed" and self.policy.draft is not None:
            out["radius_bins"] = self.policy.cfg.radius
            out["max_accepted_dev_bins"] = int(self.max_dev_bins)
            out["worst_case_dev_per_token"] = self.policy.worst_case_deviation().tolist()  # action units
            out["max_dev_vs_plain_chunk"] = self.max_dev_units.tolist()  # action units, over every call
        return out

    def close(self):
        self.env.close()


def gamma_sweep(engines: Path, gammas, episodes: int, execute: int, seed0: int, **kw) -> dict:
    plain = Mode("plain", edgespec.load_policy(engines))
    modes = [Mode(f"g{g}", edgespec.load_policy(engines, draft=True, gamma=g, **kw)) for g in gammas]
    for ep in range(episodes):
        for m in [plain] + modes:
            m.episode(seed0 + ep, execute)
    out = {m.name: {"decode_ms_mean": float(np.mean(m.decode_ms)),
                    "speedup_decode_mean": float(np.mean(plain.decode_ms) / np.mean(m.decode_ms)),
                    "tokens_per_round": (m.accepted + m.rounds) / max(m.rounds, 1)} for m in modes}
    for m in [plain] + modes:
        m.close()
    return out


def plot(results: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(6, 4.2))
    for name, r in results["modes"].items():
        sp = r.get("speedup_decode_mean", 1.0)
        ax.scatter(sp, 100 * r["success_rate"], s=60)
        ax.annotate(name, (sp, 100 * r["success_rate"]), textcoords="offset points", xytext=(6, 4), fontsize=9)
    ax.axhline(100 * results["modes"]["plain"]["success_rate"] - 5, ls=":", c="gray", lw=1)
    ax.axvline(1.5, ls=":", c="gray", lw=1)
    ax.set_xlabel("action-decode speedup over plain (mean latency, same run)")
    ax.set_ylabel("success rate (%)")
    ax.set_title(f"three-target reacher, {results['episodes']} episodes per mode")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="bench/results/vla.json")
    ap.add_argument("--episodes", type=int, default=100)
    ap.add_argument("--execute", type=int, default=4, help="chunk steps executed before replanning")
    ap.add_argument("--radii", default="2,5,9")
    ap.add_argument("--gamma", default="auto", help="draft length, or 'auto' = best of a short sweep")
    ap.add_argument("--sweep-episodes", type=int, default=10)
    ap.add_argument("--models", default="models")
    ap.add_argument("--engines", default="engines")
    args = ap.parse_args(argv)
    engines = ensure_policy_engines(args.models, args.engines)
    seed0 = 900_000
    t0 = time.time()
    sweep = None
    radii = [int(r) for r in args.radii.split(",")]
    if args.gamma == "auto":  # one sweep for exact decoding, one for relaxed at the middle radius
        sweep, best = {}, {}
        for key, kw in (("exact", {}), ("relaxed", {"mode": "relaxed", "radius": radii[len(radii) // 2]})):
            sweep[key] = gamma_sweep(engines, (2, 3, 4, 6, 8, 15), args.sweep_episodes, args.execute,
                                     seed0 + 10_000, **kw)
            best[key] = int(max(sweep[key], key=lambda k: sweep[key][k]["speedup_decode_mean"])[1:])
            print(f"gamma sweep ({key}):", {k: round(v["speedup_decode_mean"], 2) for k, v in sweep[key].items()},
                  "->", best[key])
        gamma, gamma_relaxed = best["exact"], best["relaxed"]
    else:
        gamma = gamma_relaxed = int(args.gamma)
    ref = edgespec.load_policy(engines)
    modes = [Mode("plain", edgespec.load_policy(engines)),
             Mode("exact", edgespec.load_policy(engines, draft=True, gamma=gamma))]
    modes += [Mode(f"relaxed r={r}", edgespec.load_policy(engines, draft=True, gamma=gamma_relaxed, mode="relaxed",
                                                         radius=r), reference=ref) for r in radii]
    try:
        from tqdm import tqdm
        it = tqdm(range(args.episodes), desc="episodes")
    except ImportError:
        it = range(args.episodes)
    for ep in it:
        for m in modes:
            m.episode(seed0 + ep, args.execute)
    plain = modes[0]
    identical = len(plain.actions) == len(modes[1].actions) and all(
        np.array_equal(a, b) for a, b in zip(plain.actions, modes[1].actions))
    results = {"command": "MUJOCO_GL=osmesa python bench/bench_vla.py " + " ".join(argv or sys.argv[1:]),
               "machine": machine(), "episodes": args.episodes, "execute": args.execute, "gamma": gamma,
               "gamma_relaxed": gamma_relaxed,
               "action_units": json.loads((engines / "policy.json").read_text()).get("action_units", ""),
               "gamma_sweep": sweep, "exact_actions_identical_to_plain": bool(identical),
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
              f"speedup {r.get('speedup_decode_mean', 1.0):.2f}x tokens/round {r.get('tokens_per_round', 1.0):.2f}")
    print(f"exact actions identical to plain: {identical}; wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
