"""FAST-token reacher policy against the 256-bin one, closed loop on the three-target MuJoCo reacher.

    MUJOCO_GL=osmesa python bench/bench_fast_policy.py --fast engines/vla-reacher-fast --out bench/results/fast-policy.json

A real-size stand-in of the FAST policy (export/vla_standin.py; its ids are the small policy's) alone, on 2 threads:

    MUJOCO_GL=osmesa python bench/bench_fast_policy.py --fast engines/vla-reacher-fast-1b --bins none --threads 2 \
        --providers cpu-native --fast-gammas 2 --head-gammas 3,4 --episodes 20 --repeats 1 --out ...

Modes, interleaved episode by episode (seeds 900000+i, never seen in training) so machine noise hits them alike:
bins plain, bins exact with the draft decoder (--gamma) and with its draft head (its defaults), FAST plain, FAST exact with the draft decoder at each
--fast-gammas (each policy's own 1-layer draft, trained beside its target), and FAST exact with its feature head
(train_feature_head.py; numpy, over the target's hidden state) at each --head-gammas when the folder has one; and
with the last chunk as a draft (last_chunk=True: alone, with the bins' draft head, with the FAST feature head at each
--head-gammas; the policy object persists across episodes, as on a robot); all of them on each of --providers (cpu: ONNX Runtime; cpu-native: the native step), each exact mode against its own
provider's plain. Per mode: success rate, mean return, action tokens per chunk, action-decode
ms (encoder excluded; per call the fastest of --repeats decodes of the same prefix, and the single-shot mean),
accepted tokens per target call, and the speedup of each exact mode over its own plain mode from the same run. Exact
modes must produce actions identical to their plain mode on every step (checked: same episode, same actions, same
observations). Writes JSON and a PNG.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent / "lib"))
import edgespec  # noqa: E402
from host import machine  # noqa: E402
from edgespec.robots.reacher import ThreeTargetReacher  # noqa: E402


class Mode:
    def __init__(self, name: str, policy, repeats: int):
        self.name, self.policy, self.repeats = name, policy, repeats
        self.env = ThreeTargetReacher()
        self.success, self.returns, self.decode_ms, self.decode_min_ms, self.tokens = [], [], [], [], []
        self.rounds = self.accepted = self.drafted = self.last_kept = 0
        self.chunks: list[list[np.ndarray]] = []  # per episode, every chunk
        self.invalid: list[str] = []  # FAST chunks that did not decode (each ends its episode as a failure)

    def episode(self, seed: int, execute: int) -> None:
        obs, done, ret, info, p, chunks = self.env.reset(seed=seed), False, 0.0, {}, self.policy, []
        while not done:
            state = obs["state"] if p.state_dim else None  # an OpenVLA-format policy reads no state
            last = p.last_chunk
            try:
                chunk = p.act(obs["image"], state, obs["instruction"])
            except ValueError as e:  # FAST ids that are not a whole chunk: the robot would hold; the episode fails
                if "FAST" not in str(e):
                    raise
                self.invalid.append(str(e))
                info = {"success": False}
                break
            li = p.last_info
            prefix = p.encode(obs["image"], state, obs["instruction"])
            best, ids = li["decode_ms"], None
            for _ in range(self.repeats - 1):  # the same decode again (same ids): filters the machine's noise
                t = time.perf_counter()
                ids, _ = p.decode_ids(prefix, last=last)  # the last chunk act() saw, not the one it returned
                best = min(best, (time.perf_counter() - t) * 1e3)
            if ids is None:
                ids, _ = p.decode_ids(prefix, last=last)
            self.decode_ms.append(li["decode_ms"])
            self.decode_min_ms.append(best)
            self.tokens.append(len(ids))
            self.rounds += li["target_calls"]
            self.accepted += li["accepted"]
            self.drafted += li["drafted"]
            self.last_kept += li["last_chunk_kept"] or 0
            chunks.append(chunk)
            for a in chunk[:execute]:
                obs, r, done, info = self.env.step(a)
                ret += r
                if done:
                    break
        self.success.append(bool(info["success"]))
        self.returns.append(ret)
        self.chunks.append(chunks)

    def report(self, plain: "Mode | None") -> dict:
        out = {"episodes": len(self.success), "success_rate": float(np.mean(self.success)),
               "mean_return": float(np.mean(self.returns)), "calls": len(self.decode_ms),
               "tokens_per_chunk_mean": float(np.mean(self.tokens)), "tokens_per_chunk_max": int(max(self.tokens)),
               "decode_ms_mean": float(np.mean(self.decode_ms)), "decode_ms_p50": float(np.median(self.decode_ms)),
               "decode_min_of_repeats_ms_mean": float(np.mean(self.decode_min_ms)),
               "tokens_per_target_call": float(np.sum(self.tokens) / self.rounds),
               "acceptance_rate": self.accepted / self.drafted if self.drafted else None,
               "last_chunk_ids_kept_per_chunk": self.last_kept / len(self.tokens),
               "invalid_chunks": len(self.invalid), "invalid_examples": sorted(set(self.invalid))[:3]}
        if plain is not None:
            out["speedup_decode_min_of_repeats"] = float(np.sum(plain.decode_min_ms) / np.sum(self.decode_min_ms))
            out["speedup_decode_mean"] = float(np.mean(plain.decode_ms) / np.mean(self.decode_ms))
            same = len(self.chunks) == len(plain.chunks) and all(
                len(a) == len(b) and all(np.array_equal(x, y) for x, y in zip(a, b))
                for a, b in zip(self.chunks, plain.chunks))
            out["actions_identical_to_plain"] = bool(same)
            out["chunks_compared"] = int(sum(len(a) for a in plain.chunks))
        return out


def run_interleaved(modes: dict, episodes: int, execute: int) -> None:
    """Every mode runs episode i (seed 900000 + i) before any runs episode i + 1, so machine noise hits them alike."""
    t0 = time.time()
    for ep in range(episodes):
        for m in modes.values():
            m.episode(900_000 + ep, execute)
        if ep % 10 == 9:
            print(f"{ep + 1}/{episodes} episodes, {time.time() - t0:.0f}s: " + ", ".join(
                f"{k} {np.mean(m.success):.2f}" for k, m in modes.items()), flush=True)


def plot(res: dict, path: Path) -> None:
    """One bar per mode: decode ms per chunk, labelled with success, tokens per chunk and the speedup over its plain."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    names = list(res["modes"])
    ms = [res["modes"][k]["decode_min_of_repeats_ms_mean"] for k in names]
    fig, ax = plt.subplots(figsize=(8.0, 0.45 * len(names) + 1.4))
    colors = {("bins", False): "tab:blue", ("bins", True): "lightsteelblue", ("FAST", False): "tab:orange",
              ("FAST", True): "navajowhite"}  # the lighter shade: a provider other than cpu
    ax.barh(range(len(names)), ms, color=[colors[k.split()[0], k.endswith("]")] for k in names])
    for i, k in enumerate(names):
        r = res["modes"][k]
        sp = r.get("speedup_decode_min_of_repeats")
        ax.text(ms[i], i, f"  {ms[i]:.2f} ms, {r['tokens_per_chunk_mean']:.1f} tok, success {r['success_rate']:.2f}"
                + (f", {sp:.2f}x its plain" if sp else ""), va="center", fontsize=8)
    ax.set_yticks(range(len(names)), names, fontsize=8)
    ax.invert_yaxis()
    ax.set_xlim(0, max(ms) * 1.9)
    ax.set_xlabel("action decode per chunk, ms (mean of the fastest of 3 per call)")
    what = "FAST vs 256 bins" if res["policies"]["bins"] != "None" else f"FAST ({res['policies']['fast']})"
    ax.set_title(f"three-target reacher: {what}, {res['episodes']} episodes per mode", fontsize=10)
    ax.grid(axis="x", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def suffixed(name: str, provider: str) -> str:
    return name if provider == "cpu" else f"{name} [{provider}]"


def plain_name(mode: str) -> str:
    """An exact mode's name -> its plain mode's: the same family (bins / FAST), the same provider."""
    family = "bins" if mode.startswith("bins") else "FAST"
    provider = mode[mode.index(" [") + 2:-1] if mode.endswith("]") else "cpu"
    return suffixed(f"{family} plain", provider)


def make_modes(args, provider: str) -> dict:
    """Every mode of one provider, named with its provider unless it is ONNX Runtime's cpu."""
    def load(path, **kw):
        return edgespec.load_policy(path, provider=provider, threads=args.threads, **kw)
    pairs = []
    if args.bins is not None:
        pairs += [("bins plain", load(args.bins)), ("bins exact (draft decoder)", load(args.bins, draft=True,
                                                                                      gamma=args.gamma))]
        pairs.append(("bins exact (last chunk)", load(args.bins, last_chunk=True)))
        if (args.bins / "draft_head.npz").is_file():  # the bins' fastest exact mode (its per-dimension numpy head)
            pairs.append(("bins exact (draft head)", load(args.bins, draft="head")))
            pairs.append(("bins exact (draft head, last chunk)", load(args.bins, draft="head", last_chunk=True)))
    pairs.append(("FAST plain", load(args.fast)))
    pairs.append(("FAST exact (last chunk)", load(args.fast, last_chunk=True)))
    for g in (int(x) for x in args.fast_gammas.split(",") if x):
        pairs.append((f"FAST exact (draft decoder, gamma {g})", load(args.fast, draft=True, gamma=g)))
    if (args.fast / "feature_head.npz").is_file():
        for g in (int(x) for x in args.head_gammas.split(",") if x):
            pairs.append((f"FAST exact (feature head, gamma {g})", load(args.fast, draft="head", gamma=g,
                                                                       stop_below=args.head_stop_below)))
            pairs.append((f"FAST exact (feature head, gamma {g}, last chunk)", load(
                args.fast, draft="head", gamma=g, stop_below=args.head_stop_below, last_chunk=True)))
    return {suffixed(k, provider): Mode(suffixed(k, provider), p, args.repeats) for k, p in pairs}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--bins", default="engines/vla-reacher",
                    help="the 256-bin policy (exported); 'none': FAST modes only (a real-size stand-in alone)")
    ap.add_argument("--fast", type=Path, required=True, help="the FAST policy (exported)")
    ap.add_argument("--out", type=Path, default=Path("bench/results/fast-policy.json"))
    ap.add_argument("--episodes", type=int, default=100)
    ap.add_argument("--execute", type=int, default=4, help="chunk steps executed before replanning")
    ap.add_argument("--gamma", type=int, default=4)
    ap.add_argument("--fast-gammas", default="2,4", help="the FAST exact modes' draft lengths (one mode each)")
    ap.add_argument("--head-gammas", default="2,4",
                    help="the FAST exact modes with its feature head (draft='head'; when the folder has one)")
    ap.add_argument("--head-stop-below", type=float, default=0.0,
                    help="the feature head modes' dynamic stop (0: always their gamma)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--providers", default="cpu",
                    help="comma-separated: every mode on each (cpu: ONNX Runtime; cpu-native: the native step), each "
                         "exact mode against its own provider's plain")
    ap.add_argument("--threads", type=int, default=1,
                    help="the policies' threads (1, as policies default to; a real-size stand-in decodes faster on 2)")
    args = ap.parse_args(argv)
    args.bins = None if args.bins == "none" else Path(args.bins)
    if args.bins is not None and not (args.bins / "policy.json").is_file():
        from edgespec.export.bundled import ensure_policy_engines
        ensure_policy_engines()
    modes = {}
    for provider in args.providers.split(","):
        modes.update(make_modes(args, provider))
    t0 = time.time()
    run_interleaved(modes, args.episodes, args.execute)
    plain_of = {k: modes[plain_name(k)] for k in modes if "exact" in k}
    res = {"command": "MUJOCO_GL=osmesa python bench/bench_fast_policy.py " + " ".join(
        argv if argv is not None else sys.argv[1:]), "machine": machine(), "episodes": args.episodes,
        "execute": args.execute, "gamma": args.gamma, "threads": args.threads,
        "policies": {"bins": str(args.bins), "fast": str(args.fast)},
        "fast_tokenizer": {k: v for k, v in json.loads((args.fast / "policy.json").read_text())["fast"].items()
                           if k != "sha256"},
        "modes": {k: m.report(plain_of.get(k)) for k, m in modes.items()}, "wall_s": round(time.time() - t0, 1)}
    for m in modes.values():
        m.env.close()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(res, indent=2) + "\n")
    plot(res, args.out.with_suffix(".png"))
    for k, r in res["modes"].items():
        print(f"{k:36s} success {r['success_rate']:.2f}  tokens/chunk {r['tokens_per_chunk_mean']:.2f}  decode "
              f"{r['decode_min_of_repeats_ms_mean']:.2f} ms" + (f"  speedup {r['speedup_decode_min_of_repeats']:.2f}x "
                                                              f"identical {r['actions_identical_to_plain']}"
                                                              if "speedup_decode_min_of_repeats" in r else ""))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
