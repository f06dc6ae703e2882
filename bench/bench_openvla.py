"""The OpenVLA-format reacher policy (export/training/train_openvla.py), closed loop, and its real-size stand-in.

    MUJOCO_GL=osmesa python bench/bench_openvla.py --policy engines/openvla-reacher \
        [--standin engines/openvla-reacher-1b] --out bench/results/openvla-reacher.json

Closed loop (seeds 900000+i, never seen in training; modes interleaved episode by episode): plain, exact with the
hidden-state draft head, exact with the draft decoder, and exact with the feature head (text_head.py, reading the
target's hidden state every round; --feature-gamma) when the folder has one. Per mode: success, decode ms per chunk
(the fastest of --repeats decodes of the same prefix per call, and single-shot), tokens per target call, and, for the
exact modes, whether every action equals plain's (same episodes, so same observations while they agree) and the
speedup over plain from the same run. Real size (--standin, the policy inflated by export/openvla_standin.py): decode
ms plain vs exact on --standin-obs observations from those episodes' starts, interleaved, on --standin-provider
(cpu-native: fp16 weights read from DRAM), ids checked equal to the small policy's.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent / "lib"))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import edgespec  # noqa: E402
from bench_fast_policy import Mode, run_interleaved  # noqa: E402
from host import machine  # noqa: E402
from edgespec.robots.reacher import ThreeTargetReacher  # noqa: E402


def real_size(standin: Path, small, provider: str, n_obs: int, gamma: int, repeats: int,
              feature_stop: float | None) -> dict:
    modes = {"plain": edgespec.load_policy(standin, provider=provider, threads=None),
             "exact (draft head)": edgespec.load_policy(standin, draft="head", gamma=gamma, provider=provider,
                                                        threads=None),
             "exact (draft decoder)": edgespec.load_policy(standin, draft=True, gamma=gamma, provider=provider,
                                                           threads=None)}
    if json.loads((standin / "policy.json").read_text()).get("feature_head_sha256"):
        modes["exact (feature head)"] = edgespec.load_policy(standin, draft="feature-head", gamma=gamma,
                                                             stop_below=feature_stop, provider=provider, threads=None)
    env = ThreeTargetReacher()
    obs = [env.reset(seed=920_000 + i) for i in range(n_obs)]
    env.close()
    ms = {k: [] for k in modes}
    rounds = {k: 0 for k in modes}
    same = True
    for o in obs:
        want = small.decode_ids(small.encode(o["image"], None, o["instruction"]))[0]
        for k, p in modes.items():  # interleaved per observation
            prefix = p.encode(o["image"], None, o["instruction"])
            best = np.inf
            for _ in range(repeats):
                t = time.perf_counter()
                ids, info = p.decode_ids(prefix)
                best = min(best, (time.perf_counter() - t) * 1e3)
            ms[k].append(best)
            rounds[k] += info["target_calls"]
            same &= list(ids) == list(want)
    t = modes["plain"].target.m
    out = {"provider": provider, "observations": n_obs, "gamma": gamma, "feature_head_stop_below": feature_stop,
           "target": {"hidden_size": t.hidden_size, "layers": t.num_layers, "heads": t.num_heads,
                      "kv_heads": t.num_kv_heads, "vocab_size": t.vocab_size},
           "ids_equal_small_policy": bool(same), "modes": {}}
    for k in modes:
        out["modes"][k] = {"decode_ms_mean": float(np.mean(ms[k])), "decode_ms_p50": float(np.median(ms[k])),
                           "target_calls_per_chunk": rounds[k] / n_obs,
                           "speedup_vs_plain": float(np.sum(ms["plain"]) / np.sum(ms[k]))}
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--policy", type=Path, default=Path("engines/openvla-reacher"))
    ap.add_argument("--standin", type=Path, default=None)
    ap.add_argument("--standin-provider", default="cpu-native")
    ap.add_argument("--standin-obs", type=int, default=12)
    ap.add_argument("--standin-repeats", type=int, default=2)
    ap.add_argument("--out", type=Path, default=Path("bench/results/openvla-reacher.json"))
    ap.add_argument("--episodes", type=int, default=100)
    ap.add_argument("--execute", type=int, default=4)
    ap.add_argument("--gamma", type=int, default=15)
    ap.add_argument("--feature-gamma", type=int, default=15,
                    help="γ of the exact mode with the policy's feature head (when its folder has one)")
    ap.add_argument("--standin-feature-stop", type=float, default=None,
                    help="the stand-in's feature-head dynamic stop (default: the head kind's, 0.7). At real size a "
                         "verify of more rows costs more, so unsure chains should end; the small policy's feature "
                         "head runs without a stop (a call costs about the same whatever its rows)")
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args(argv)
    modes = {"plain": Mode("plain", edgespec.load_policy(args.policy), args.repeats),
             "exact (draft head)": Mode("head", edgespec.load_policy(args.policy, draft="head", gamma=args.gamma),
                                        args.repeats),
             "exact (draft decoder)": Mode("decoder", edgespec.load_policy(args.policy, draft=True, gamma=8),
                                           args.repeats)}
    if json.loads((args.policy / "policy.json").read_text()).get("feature_head_sha256"):
        modes["exact (feature head)"] = Mode("feature", edgespec.load_policy(
            args.policy, draft="feature-head", gamma=args.feature_gamma, stop_below=0.0), args.repeats)
    t0 = time.time()
    run_interleaved(modes, args.episodes, args.execute)
    plain = modes["plain"]
    res = {"command": "MUJOCO_GL=osmesa python bench/bench_openvla.py " + " ".join(
        argv if argv is not None else sys.argv[1:]), "machine": machine(), "episodes": args.episodes,
        "execute": args.execute, "policy": str(args.policy),
        "modes": {k: m.report(None if k == "plain" else plain) for k, m in modes.items()},
        "closed_loop_wall_s": round(time.time() - t0, 1)}
    for m in modes.values():
        m.env.close()
    if args.standin is not None:
        t1 = time.time()
        res["real_size"] = real_size(args.standin, modes["plain"].policy, args.standin_provider, args.standin_obs,
                                     args.gamma, args.standin_repeats, args.standin_feature_stop)
        res["real_size"]["wall_s"] = round(time.time() - t1, 1)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(res, indent=2) + "\n")
    for k, r in res["modes"].items():
        print(f"{k:24s} success {r['success_rate']:.2f} decode {r['decode_min_of_repeats_ms_mean']:.2f} ms "
              f"tokens/call {r['tokens_per_target_call']:.2f}" + (
                  f" speedup {r['speedup_decode_min_of_repeats']:.2f}x identical {r['actions_identical_to_plain']}"
                  if "speedup_decode_min_of_repeats" in r else ""))
    if "real_size" in res:
        for k, r in res["real_size"]["modes"].items():
            print(f"real size {k:24s} decode {r['decode_ms_mean']:.1f} ms, {r['target_calls_per_chunk']:.1f} target "
                  f"calls, speedup {r['speedup_vs_plain']:.2f}x")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
