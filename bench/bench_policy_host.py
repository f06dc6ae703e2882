"""The host's part of a VLA chunk: `Policy.decode_ids` with every engine call stubbed out, so only the Python
around the calls (the decode loop, the rounds, the drafts' bookkeeping) is timed, without the engines' noise.

    python bench/bench_policy_host.py [--chunks 2000]                     # this checkout's runtime
    PYTHONPATH=OTHER_CHECKOUT python bench/bench_policy_host.py            # another one's, for an A/B

The engine's outputs stay those of the last real call (every decoded id is still an action id), so a chunk runs
the same rounds each time. Prints, per draft kind, the fastest and the median chunk in ms.
"""
from __future__ import annotations

import argparse
import json
import time

import numpy as np


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--engines", default="engines/vla-reacher")
    ap.add_argument("--chunks", type=int, default=2000)
    args = ap.parse_args()
    import edgespec
    from edgespec.policy import load_policy

    class NoRun:  # the session with run_with_iobinding a no-op
        def __init__(self, session):
            self.session = session

        def run_with_iobinding(self, binding) -> None:
            pass

        def __getattr__(self, name):
            return getattr(self.session, name)

    out = {"runtime": edgespec.__file__}
    for draft in (False, "head", True):
        pol = load_policy(args.engines, draft=draft, provider="cpu")
        rng = np.random.default_rng(0)
        img = rng.integers(0, 255, (pol.image_size, pol.image_size, 3), dtype=np.uint8)
        prefix = pol.encode(img, np.zeros(pol.state_dim), "reach the red target")
        for _ in range(5):  # real calls first: the bound outputs hold real ids
            pol.decode_ids(prefix)
        for dec in [pol.target] + ([pol.draft.dec] if pol.draft is not None else []):
            dec.engine.session = NoRun(dec.engine.session)
        for _ in range(50):
            pol.decode_ids(prefix)
        ts = []
        for _ in range(args.chunks):
            t = time.perf_counter()
            pol.decode_ids(prefix)
            ts.append(time.perf_counter() - t)
        name = {False: "plain", "head": "head", True: "draft decoder"}[draft]
        out[name] = {"min_ms": round(float(np.min(ts)) * 1e3, 4), "median_ms": round(float(np.median(ts)) * 1e3, 4)}
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
