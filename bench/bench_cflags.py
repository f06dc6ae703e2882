"""A/B of the native step's C flags (EDGESPEC_NATIVE_CFLAGS): plain greedy decode on cpu-native, one process per
build, interleaved (default C_FLAGS against -ffp-contract=fast).

    python bench/bench_cflags.py engines/demo-target 4      # engine folder, rounds; prints the JSON last
"""
import json, os, subprocess, sys, time
ENG = sys.argv[1]
CHILD = r'''
import time, json, numpy as np, edgespec, sys
lm = edgespec.load(sys.argv[1], provider="cpu-native")
prompts = ["def f(x):", "import numpy as np\n", "class Tree:", "for i in range(10):"]
lm.generate(prompts[0], max_new_tokens=16)
best = []
for rep in range(3):
    t0 = time.perf_counter(); n = 0
    for p in prompts:
        n += len(lm.generate(p, max_new_tokens=64).token_ids)
    best.append(n / (time.perf_counter() - t0))
print(json.dumps(max(best)))
'''
res = {"contract-off (default)": [], "contract-fast": []}
for rep in range(int(sys.argv[2]) if len(sys.argv) > 2 else 4):
    for name in res:
        env = dict(os.environ)
        env["EDGESPEC_NATIVE_CFLAGS"] = "-ffp-contract=fast" if name == "contract-fast" else ""
        out = subprocess.run([sys.executable, "-c", CHILD, ENG], env=env, capture_output=True, text=True)
        if out.returncode:
            print(out.stderr[-2000:]); sys.exit(1)
        res[name].append(json.loads(out.stdout.strip().splitlines()[-1]))
        print(name, res[name][-1], flush=True)
print(json.dumps(res))
