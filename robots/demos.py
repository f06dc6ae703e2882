"""Data from the three-target reacher for the exporter's training scripts, and closed-loop evaluation of an
exported policy. The simulator runs here; export/ trains from the .npz files written here and never imports
the robots package.

    # the VLA pair's demonstrations -> .cache/vla/expert-train-6000.npz, .cache/vla/expert-val-100.npz
    python -m edgespec.robots.demos expert --work .cache/vla --episodes 6000 --val-episodes 100
    # the draft head's data: the exported target's own greedy chunks, in blocks of 500 episodes
    python -m edgespec.robots.demos on-policy --policy engines/vla-reacher --work .cache/vla --episodes 4000
    # closed-loop success of an exported policy (plain greedy decoding)
    python -m edgespec.robots.demos eval --policy engines/vla-reacher --episodes 50

Seeds: expert training episodes 0+, expert validation episodes 500000+, on-policy episodes 700000+, closed-loop
evaluation 900000+ (bench/bench_vla.py uses 900000+ and 910000+ too): no two uses share an episode.
Every file is written once and reused when it exists, so an interrupted command resumes.

expert file (one row per control step; episodes in seed order):
  image (N, S, S, 3) uint8, state (N, 6) float32, instruction (N,) str, chunk (N, H, 2) float32 (the clean
  expert chunk from the state reached), goal (N, 2) float32 (the named target), episode (N,) int64 (seed);
  scalars horizon, noise_std, noisy_every.
on-policy block (one row per control step): prefix (N, P, E) float16 (the encoder's output), ids (N, H*D)
  int64 (the target's plain greedy action ids), episode (N,) int64 (seed), state (N, 6) float32.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import sys
import time
from multiprocessing import get_context
from pathlib import Path

import numpy as np

from .reacher import ThreeTargetReacher

EXPERT_TRAIN_SEED0 = 0
EXPERT_VAL_SEED0 = 500_000
ON_POLICY_SEED0 = 700_000  # apart from the target's training seeds and the evaluation seeds below
EVAL_SEED0 = 900_000
BLOCK = 500  # on-policy episodes per cached file
NOISE_SEED_OFFSET = 10_000  # an episode's action noise comes from default_rng(seed + this)


# ---------------------------------------------------------------------------------------------------
# the scripted expert's demonstrations (the VLA pair's training data)
# ---------------------------------------------------------------------------------------------------
def expert_episodes(seeds, horizon: int = 8, noise_std: float = 0.01, noisy_every: int = 2) -> dict:
    """The scripted expert acting in one episode per seed. Episodes whose seed is a multiple of noisy_every
    execute the expert's first action plus Gaussian noise (noise_std metres; DART-style, so the data covers
    recoveries); the label is always the clean expert chunk from the state actually reached."""
    env = ThreeTargetReacher()
    imgs, states, instr, chunks, goals, episode = [], [], [], [], [], []
    try:
        for seed in seeds:
            obs = env.reset(seed=int(seed))
            rng = np.random.default_rng(int(seed) + NOISE_SEED_OFFSET)
            noisy = seed % noisy_every == 0
            done = False
            while not done:
                chunk = env.expert(horizon)
                imgs.append(obs["image"]); states.append(obs["state"]); instr.append(obs["instruction"])
                chunks.append(chunk); goals.append(env.targets[env.color]); episode.append(int(seed))
                a = chunk[0] + (rng.normal(0, noise_std, 2) if noisy else 0.0)
                obs, _, done, _ = env.step(a)
    finally:
        env.close()
    return {"image": np.stack(imgs), "state": np.stack(states).astype(np.float32), "instruction": np.array(instr),
            "chunk": np.stack(chunks).astype(np.float32), "goal": np.stack(goals).astype(np.float32),
            "episode": np.asarray(episode, np.int64)}


def _expert_part(args) -> dict:
    seeds, horizon, noise_std, noisy_every = args
    return expert_episodes(seeds, horizon, noise_std, noisy_every)


def expert_file(work: Path, split: str, episodes: int) -> Path:
    return Path(work) / f"expert-{split}-{episodes}.npz"


def write_expert(path: Path, seeds: np.ndarray, horizon: int = 8, noise_std: float = 0.01, noisy_every: int = 2,
                 workers: int = 2) -> Path:
    """expert_episodes over `seeds` in worker processes -> `path` (kept as it is when it exists)."""
    path = Path(path)
    if path.exists():
        return path
    parts = [p for p in np.array_split(np.asarray(seeds), workers * 4) if len(p)]
    t0 = time.time()
    with get_context("spawn").Pool(workers) as pool:
        outs = []
        for i, out in enumerate(pool.imap(_expert_part, [(p, horizon, noise_std, noisy_every) for p in parts])):
            outs.append(out)
            print(f"[{path.name}] {i + 1}/{len(parts)} parts, {time.time() - t0:.0f}s", flush=True)
    data = {k: np.concatenate([o[k] for o in outs]) for k in outs[0]}
    path.parent.mkdir(parents=True, exist_ok=True)
    np.savez(path, **data, horizon=horizon, noise_std=noise_std, noisy_every=noisy_every)
    return path


# ---------------------------------------------------------------------------------------------------
# the exported target's own greedy chunks on its own state distribution (the draft head's training data)
# ---------------------------------------------------------------------------------------------------
def on_policy_episodes(policy_dir, seeds, noise_std: float = 0.01) -> dict:
    """The exported policy (ONNX Runtime, plain greedy decoding: the ids speculative decoding must reproduce)
    acting in one episode per seed; even seeds execute its first action plus Gaussian noise."""
    from edgespec.policy import load_policy
    pol = load_policy(policy_dir)
    env = ThreeTargetReacher()
    prefixes, ids, episode, states = [], [], [], []
    try:
        for seed in seeds:
            obs, done = env.reset(seed=int(seed)), False
            rng = np.random.default_rng(int(seed) + NOISE_SEED_OFFSET)
            noisy = seed % 2 == 0
            while not done:
                pre = pol.encode(obs["image"], obs["state"], obs["instruction"])  # (1, P, E)
                chunk_ids, _ = pol.decode_ids(pre, use_draft=False)
                prefixes.append(pre[0].astype(np.float16))
                ids.append(chunk_ids)
                episode.append(int(seed))
                states.append(obs["state"].astype(np.float32))
                a = pol.tok.decode_chunk(np.asarray(chunk_ids), pol.horizon, pol.dims)[0]
                if noisy:
                    a = a + rng.normal(0, noise_std, a.shape)
                obs, _, done, _ = env.step(a)
    finally:
        env.close()
    return {"prefix": np.stack(prefixes), "ids": np.asarray(ids, np.int64), "episode": np.asarray(episode),
            "state": np.stack(states)}


def _on_policy_part(args) -> dict:
    return on_policy_episodes(*args)


def policy_key(policy_dir: Path) -> str:
    """12 hex digits naming the exported encoder + target, the two things the data depends on: cached
    blocks from another policy (a retrained target) are never reused."""
    from edgespec.contract import file_sha256
    policy_dir = Path(policy_dir)
    meta = json.loads((policy_dir / "policy.json").read_text())
    target = json.loads((policy_dir / "target" / "engine.json").read_text())
    enc = meta.get("encoder_sha256") or file_sha256(policy_dir / meta.get("encoder_file", "encoder.onnx"))
    tgt = file_sha256(policy_dir / "target" / target["model_file"])
    return hashlib.sha256(f"{enc}:{tgt}".encode()).hexdigest()[:12]


def write_on_policy(policy_dir: Path, work: Path, episodes: int, workers: int = 2, noise_std: float = 0.01,
                    block: int = BLOCK) -> list[Path]:
    """Episodes in blocks of `block` (seeds ON_POLICY_SEED0 + ...), each a file in `work` named by the
    policy's key; a block already there is kept, so a larger --episodes reuses them. -> the block files."""
    if episodes <= 0 or episodes % block:
        raise ValueError(f"--episodes must be a positive multiple of {block}, got {episodes}")
    work, key, t0, paths = Path(work), policy_key(policy_dir), time.time(), []
    for b in range(episodes // block):
        seed0 = ON_POLICY_SEED0 + b * block
        path = work / f"draft-head-data-{key}-{seed0}-{block}.npz"
        if not path.exists():
            seeds = np.arange(seed0, seed0 + block)
            with get_context("spawn").Pool(workers) as pool:
                outs = list(pool.imap(_on_policy_part, [(str(policy_dir), p, noise_std)
                                                        for p in np.array_split(seeds, workers * 2) if len(p)]))
            work.mkdir(parents=True, exist_ok=True)
            np.savez(path, **{k: np.concatenate([o[k] for o in outs]) for k in outs[0]})
        paths.append(path)
        print(f"[on-policy] {b + 1}/{episodes // block} blocks of {block} episodes, {time.time() - t0:.0f}s",
              flush=True)
    return paths


# ---------------------------------------------------------------------------------------------------
# closed-loop evaluation
# ---------------------------------------------------------------------------------------------------
def closed_loop(act, seeds, execute: int = 4) -> dict:
    """act(obs) -> (H, D) fingertip targets, replanned every `execute` steps, one episode per seed ->
    success rate (fingertip within SUCCESS_RADIUS of the named target at the end) and mean return."""
    env = ThreeTargetReacher()
    succ, rets = [], []
    try:
        for seed in seeds:
            obs, done, ret, info = env.reset(seed=int(seed)), False, 0.0, {}
            while not done:
                for a in act(obs)[:execute]:
                    obs, r, done, info = env.step(a)
                    ret += r
                    if done:
                        break
            succ.append(info["success"]); rets.append(ret)
    finally:
        env.close()
    return {"success": float(np.mean(succ)), "mean_return": float(np.mean(rets)), "episodes": len(succ)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("expert", help="the scripted expert's demonstrations (train_vla.py's data)")
    p.add_argument("--work", type=Path, default=Path(".cache/vla"))
    p.add_argument("--episodes", type=int, default=6000)
    p.add_argument("--val-episodes", type=int, default=100)
    p.add_argument("--horizon", type=int, default=8, help="steps per expert chunk (the policy's H)")
    p.add_argument("--noise-std", type=float, default=0.01, help="metres, on the executed action of noisy episodes")
    p.add_argument("--workers", type=int, default=2)
    p = sub.add_parser("on-policy", help="an exported target's greedy chunks (train_draft_head.py's data)")
    p.add_argument("--policy", type=Path, default=Path("engines/vla-reacher"))
    p.add_argument("--work", type=Path, default=Path(".cache/vla"))
    p.add_argument("--episodes", type=int, default=4000)
    p.add_argument("--workers", type=int, default=2)
    p = sub.add_parser("eval", help="closed-loop success of an exported policy, plain greedy decoding")
    p.add_argument("--policy", type=Path, default=Path("engines/vla-reacher"))
    p.add_argument("--episodes", type=int, default=50)
    p.add_argument("--execute", type=int, default=4, help="steps executed per chunk before replanning")
    args = ap.parse_args(argv)
    if args.cmd == "expert":
        for split, seed0, n in (("train", EXPERT_TRAIN_SEED0, args.episodes),
                                ("val", EXPERT_VAL_SEED0, args.val_episodes)):
            path = write_expert(expert_file(args.work, split, n), np.arange(seed0, seed0 + n), args.horizon,
                                args.noise_std, workers=args.workers)
            print(f"wrote {path}", flush=True)
        print(f"next: python -m edgespec.export.training.train_vla --train {expert_file(args.work, 'train', args.episodes)} "
              f"--val {expert_file(args.work, 'val', args.val_episodes)} --out models/vla-reacher")
    elif args.cmd == "on-policy":
        paths = write_on_policy(args.policy, args.work, args.episodes, args.workers)
        print(f"next: python -m edgespec.export.training.train_draft_head --policy {args.policy} --out models/vla-reacher "
              f"--data {' '.join(str(p) for p in paths)}")
    else:
        from edgespec.policy import load_policy
        pol = load_policy(args.policy)
        res = closed_loop(pol, range(EVAL_SEED0, EVAL_SEED0 + args.episodes), args.execute)  # Policy.__call__
        print(json.dumps({**res, "policy": str(args.policy), "seed0": EVAL_SEED0, "execute": args.execute,
                          "command": "python -m edgespec.robots.demos " + " ".join(
                              argv if argv is not None else sys.argv[1:])}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
