"""edgespec vs ONNX Runtime GenAI, Hugging Face transformers, optimum and llama.cpp: each mode at its best setting, one run.

    bash bench/setup_peers.sh && python bench/bench_peers.py --out bench/results/peers.json

Same checkpoints, same prompts (20 held-out code + 4 prose), greedy, 128 new tokens. A run has these phases,
one process schedule, and nothing from any other run:

  1. sweep: every configuration of every mode (edgespec γ 2..6 and auto, its draft+lookup γ (and auto) × lookup ×
     lookup γ (the most proposals of a round drafted by lookup), its n-gram γ × max_ngram; GenAI's k, adaptive
     k (min_adaptive_k..K), n-gram size, chained lookup, an fp32 and an int8 draft model, and both its default
     threading and edgespec's threads; HF's draft lengths and prompt-lookup settings; llama.cpp's plain, draft and
     lookup modes at each GGUF precision (--llamacpp-precisions: f16, q8_0, q4_0), over threads, draft length,
     p_min and draft threads, and n-gram size and lookup draft length) decodes a subset of the
     prompts once (--sweep-prompts), configurations interleaved across systems;
  1b. runoff: each mode's --runoff (3) fastest configurations decode the subset twice more, in two passes of
     opposite order; the selection takes each one's median of its three speeds, so that one lucky or unlucky
     sweep slot (the machine's speed drifts by up to 2x over minutes) does not choose;
  2. final: the fastest configuration of each mode whose tokens matched edgespec plain on the subset decodes
     all prompts, --repeats times, the modes interleaved within every repeat;
  3. head to head: the comparisons the targets name (edgespec's fastest row against GenAI's fastest, plain
     against plain, and edgespec draft against edgespec plain, the speedup the paper's formula predicts) again,
     the two sides back to back on each of --paired-chunks prompt chunks, order alternating, --paired-rounds
     times: a ratio per trial, so the machine's drift over minutes falls on both sides of each ratio (the
     final's medians are minutes apart).

The defaults (405 sweep configurations on 6 prompts, llama.cpp's included, a runoff of each mode's 3 fastest
twice, then 23 rows × 3 repeats on 24 prompts × 128 tokens, then 36 head-to-head trials) took 32.5 minutes on a
2-core Xeon VM in run 3e9f9d0a5de9; the script prints its estimate first (73 minutes there, an overestimate)
and a progress bar after. --llamacpp-precisions none leaves llama.cpp's 156 configurations and 9 rows out.

Draft models: edgespec's demo draft is its int8 weight-only engine (MatMulNBits, blocks of 32, accuracy level
4). GenAI's draft is swept at fp32 and int8 (--genai-draft-precisions), each built by GenAI's own model builder
with that recipe where the builder takes it (bench/peers/genai_runner.py QUANT_OPTIONS); both targets are fp32.
A draft's precision cannot change the output (the target verifies every token), so each side may use its
fastest draft. The configuration column names the draft precision and, for GenAI, fixed or adaptive k.

llama.cpp (bench/peers/llamacpp_runner.py: llama-server, prompts sent as edgespec's token ids, llama.cpp's own
timings): one mode per weight precision, "llama.cpp plain f16", "llama.cpp draft q8_0", "llama.cpp lookup q4_0"
and so on, since the comparisons the issue names are precision against precision (fp16 weights against f16,
int8 against q8_0, int4 against q4_0); the draft GGUF is the target's precision unless
--llamacpp-draft-precisions names others. Its rows stop at EOS like every other row.

Every system runs in its own process (so peak RSS is its own): edgespec through this script's
`--edgespec-runner` mode, the peers through bench/peers/*_runner.py in their virtual environments. Greedy
rows compare their tokens with edgespec plain; a sampled edgespec row (T = 0.8) reports speed and
acceptance. A peer that fails to install or run is recorded with its error, never dropped. The report names
the run (id, start and end times, full command); `check_same_run` refuses to write a table holding a row
from any other run. Writes JSON, a markdown summary (.md) and a PNG beside --out; raw outputs (token ids)
go to .cache/peers/<run id>/raw.json.

Smoke test (2 prompts, 16 tokens, small sweeps; 4-8 minutes, mostly process start-up):

    python bench/bench_peers.py --out .cache/peers-smoke/peers.json --code-prompts 1 --prose-prompts 1 \\
        --sweep-prompts 2 --max-new-tokens 16 --repeats 1 --gammas 2,4 --max-ngrams 3 \\
        --genai-ngram-sizes 3 --genai-chained off --hf-lookup-ngrams 2 --lookup-gammas 4 --lookups 2 \
        --genai-draft-ks 4 --genai-adaptive-ks 4 --genai-min-adaptive-k 2 --lookup-lengths 0,8 \
        --paired-rounds 1 --paired-chunks 2 --llamacpp-precisions q4_0 --llamacpp-threads 2 \
        --llamacpp-draft-ks 4 --llamacpp-draft-p-mins 0 --llamacpp-ngram-sizes 3 --llamacpp-lookup-lengths 8
"""
from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import resource
import shlex
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE / "lib"))  # the benches' shared helpers (bench/lib)

SAMPLED = "edgespec draft sampled T=0.8"  # the one row outside the greedy comparison
DRAFT = "edgespec draft"  # the row whose speedup over plain the paper's formula predicts
PLAIN_NATIVE = "edgespec plain native"  # plain decoding on provider cpu-native (edgespec/backends/native.py)


@dataclass(frozen=True)
class Config:
    label: str  # how the report names it: "γ=5", "k=4, threads: GenAI default"
    argv: tuple  # the runner's arguments for it


@dataclass(frozen=True)
class Mode:
    """One row of the final table: a system's decoding mode, tried in each of its configurations."""
    name: str  # "ORT GenAI ngram"
    system: str  # "edgespec", "ORT GenAI", "HF transformers", "optimum", "llama.cpp": best against best is per system
    runner: str  # "edgespec", "genai", "hf", "optimum", "llamacpp"
    configs: tuple


def _ints(s: str) -> list[int]:
    return [int(x) for x in s.split(",") if x.strip()]


def _gammas(s: str) -> list[str]:
    """A γ list: integers and 'auto' (edgespec's cost model), in the order given."""
    out = [x.strip() for x in s.split(",") if x.strip()]
    bad = [x for x in out if x != "auto" and not x.isdigit()]
    if bad:
        raise ValueError(f"γ values must be integers or 'auto', got {bad}")
    return out


def plan(args) -> list[Mode]:
    """Every mode and every configuration the sweep tries, from the command's sweep settings."""
    from edgespec.export.bundled import DEMO_ENGINES
    from edgespec.generate import DRAFT_THREADS
    es_threads = int(os.environ.get("EDGESPEC_THREADS", 0)) or os.cpu_count() or 1  # edgespec's target
    es_draft = f"{DEMO_ENGINES['demo-draft'][1]} draft"  # edgespec's demo draft engine: "int8 draft"
    # the target's provider, a sweep dimension of every speculative edgespec mode ("" for cpu: the labels of
    # earlier runs stay as they were); the draft runs on cpu beside either (engine.draft_provider)
    provs = [(f", {p}" if p != "cpu" else "", ("--provider", p)) for p in args.edgespec_providers.split(",") if p]
    g, kmax = _ints(args.gammas), max(_ints(args.gammas))
    gg = [str(x) for x in g] + ["auto"]
    chained = {"off": False, "on": True}
    genai_threads = {"threads: GenAI default": ("--threads", "0"),
                     f"threads {es_threads}": ("--threads", str(es_threads))}
    genai_draft = {"GenAI's default threads": ("--threads", "0", "--draft-threads", "0"),
                   f"edgespec's threads: target {es_threads}, draft {DRAFT_THREADS}":
                       ("--threads", str(es_threads), "--draft-threads", str(DRAFT_THREADS))}
    k_opts = [(f"k={k}", ("--gamma", str(k))) for k in g] + \
             [(f"adaptive k 1..{kmax}", ("--gamma", str(kmax), "--min-adaptive-k", "1"))]
    # GenAI's draft: fixed k, adaptive k (min_adaptive_k..K), each with every draft precision (built separately
    # from the fp32 target; the target verifies every token, so the precision changes speed, never the output)
    draft_k = [(f"k={k}", ("--gamma", str(k))) for k in _ints(args.genai_draft_ks)] + \
              [(f"adaptive k {m}..{k}", ("--gamma", str(k), "--min-adaptive-k", str(m)))
               for m in _ints(args.genai_min_adaptive_k) for k in _ints(args.genai_adaptive_ks) if m < k]
    draft_prec = [(f"{p} draft", ("--draft-precision", p)) for p in args.genai_draft_precisions.split(",") if p]
    modes = [
        Mode("edgespec plain", "edgespec", "edgespec", (Config("threads: edgespec default", ("--mode", "plain")),)),
        Mode(PLAIN_NATIVE, "edgespec", "edgespec",
             (Config("provider cpu-native: float16 weights, float32 math", ("--mode", "plain", "--provider",
                                                                            "cpu-native")),)),
        Mode("edgespec draft", "edgespec", "edgespec",
             tuple(Config(f"γ={x}, {es_draft}{pl}", ("--mode", "draft", "--gamma", x) + pa)
                   for pl, pa in provs for x in gg)),
        Mode("edgespec draft+lookup", "edgespec", "edgespec",
             tuple(Config(f"γ={x}, lookup={n}" + (f", lookup γ={L}" if L else "") + f", {es_draft}{pl}",
                          ("--mode", "draft", "--gamma", x, "--lookup", str(n))
                          + (("--lookup-gamma", str(L)) if L else ()) + pa)
                   for pl, pa in provs for L in _ints(args.lookup_lengths) for n in _ints(args.lookups)
                   for x in _gammas(args.lookup_gammas))),
        Mode("edgespec ngram", "edgespec", "edgespec",
             tuple(Config(f"γ={x}, max_ngram={n}{pl}", ("--mode", "ngram", "--gamma", x, "--max-ngram", str(n)) + pa)
                   for pl, pa in provs for n in _ints(args.max_ngrams) for x in gg)),
        Mode("ORT GenAI plain", "ORT GenAI", "genai",
             tuple(Config(lab, ("--mode", "plain") + a) for lab, a in genai_threads.items())),
    ]
    for tlab, targs in genai_draft.items():
        modes.append(Mode(f"ORT GenAI draft ({tlab.split(':')[0]})", "ORT GenAI", "genai",
                          tuple(Config(f"{klab}, {plab}, {tlab}", ("--mode", "draft") + ka + pa + targs)
                                for plab, pa in draft_prec for klab, ka in draft_k)))
    ngram = [(f", ngram_size={n}" + (", chained" if chained[c] else ""),
              ("--ngram-size", str(n)) + (("--ngram-chained",) if chained[c] else ()))
             for c in args.genai_chained.split(",") for n in _ints(args.genai_ngram_sizes)]
    modes += [
        Mode("ORT GenAI ngram", "ORT GenAI", "genai",
             tuple(Config(f"{klab}{nlab}, {tlab}", ("--mode", "ngram") + na + ka + ta)
                   for tlab, ta in genai_threads.items() for nlab, na in ngram for klab, ka in k_opts)),
        Mode("HF plain", "HF transformers", "hf", (Config("torch threads 2", ("--mode", "plain")),)),
        Mode("HF assisted", "HF transformers", "hf",
             tuple(Config(f"γ={x} (constant)", ("--mode", "assisted", "--gamma", str(x))) for x in g)
             + (Config("transformers default (20, confidence 0.4)", ("--mode", "assisted")),)),
        Mode("HF prompt lookup", "HF transformers", "hf",
             tuple(Config(f"num_tokens={x}, max_ngram={n}",
                          ("--mode", "prompt_lookup", "--gamma", str(x), "--ngram-size", str(n)))
                   for n in _ints(args.hf_lookup_ngrams) for x in sorted(set(g) | {10}))),
        Mode("optimum ORTModelForCausalLM plain", "optimum", "optimum", (Config("intra-op threads 2", ()),)),
    ]
    modes += llamacpp_modes(args)
    only = set(args.modes.split(",")) if args.modes else None
    return [m for m in modes if only is None or m.name in only or m.name == "edgespec plain"]


LLAMACPP_SWEEP = dict(llamacpp_precisions="f16,q8_0,q4_0", llamacpp_threads="1,2", llamacpp_draft_threads="0,1",
                      llamacpp_draft_ks="2,3,4,6,8", llamacpp_draft_p_mins="0,0.75", llamacpp_draft_precisions="same",
                      llamacpp_lookup_types="ngram-simple,ngram-cache", llamacpp_ngram_sizes="2,3,4",
                      llamacpp_lookup_lengths="4,8,16", llamacpp_repack="on")  # main()'s defaults


def llamacpp_modes(args) -> list[Mode]:
    """llama.cpp's modes, one per weight precision (--llamacpp-precisions; "" or "none": no llama.cpp rows):
    plain over threads; draft over draft length (--spec-draft-n-max) × p_min × draft precision × threads (with
    draft threads: 0 = the target's, llama.cpp's default, plus each smaller count); lookup over its --spec-type
    (ngram-simple: n-gram size × draft length; ngram-cache, llama-lookup's cache, has neither) × threads; each of
    them with and/or without llama.cpp's weight repacking (--llamacpp-repack on,off: repacked weights take other
    kernels (AMX where built in, interleaved AVX layouts), and which is faster at one row is the machine's to say)."""
    get = lambda k: getattr(args, k, LLAMACPP_SWEEP[k])  # noqa: E731 (a Namespace from before llama.cpp: defaults)
    precs = [p for p in get("llamacpp_precisions").split(",") if p and p != "none"]
    threads = _ints(get("llamacpp_threads"))
    pairs = [(t, 0) for t in threads] + [(t, d) for t in threads for d in _ints(get("llamacpp_draft_threads"))
                                         if 0 < d < t]
    tlab = lambda t, d: f"threads {t}" + (f", draft threads {d}" if d else "")  # noqa: E731
    targ = lambda t, d: ("--threads", str(t)) + (("--draft-threads", str(d)) if d else ())  # noqa: E731
    p_mins = [x.strip() for x in get("llamacpp_draft_p_mins").split(",") if x.strip()]
    out = []
    for p in precs:
        dprecs = list(dict.fromkeys(p if d == "same" else d for d in get("llamacpp_draft_precisions").split(",") if d))
        lookups = []
        for typ in [x for x in get("llamacpp_lookup_types").split(",") if x]:
            if typ == "ngram-cache":
                lookups.append(("ngram-cache (llama-lookup's n-gram cache, 8 draft tokens)", ("--lookup-type", typ)))
            else:
                lookups += [(f"{typ} n={n}, draft {m}", ("--lookup-type", typ, "--ngram-size", str(n),
                                                         "--lookup-max", str(m)))
                            for n in _ints(get("llamacpp_ngram_sizes")) for m in _ints(get("llamacpp_lookup_lengths"))]
        out += [
            Mode(f"llama.cpp plain {p}", "llama.cpp", "llamacpp",
                 tuple(Config(f"{p}, threads {t}", ("--mode", "plain", "--precision", p, "--threads", str(t)))
                       for t in threads)),
            Mode(f"llama.cpp draft {p}", "llama.cpp", "llamacpp",
                 tuple(Config(f"draft max {k}, p_min {pm}, {dp} draft, {tlab(t, d)}",
                              ("--mode", "draft", "--precision", p, "--draft-precision", dp, "--draft-max", str(k),
                               "--draft-p-min", pm) + targ(t, d))
                       for dp in dprecs for t, d in pairs for pm in p_mins for k in _ints(get("llamacpp_draft_ks")))),
            Mode(f"llama.cpp lookup {p}", "llama.cpp", "llamacpp",
                 tuple(Config(f"{lab}, threads {t}", ("--mode", "lookup", "--precision", p) + la + targ(t, 0))
                       for t in threads for lab, la in lookups)),
        ]
    repacks = [x.strip() for x in get("llamacpp_repack").split(",") if x.strip()]
    if not repacks or set(repacks) - {"on", "off"}:
        raise SystemExit(f"--llamacpp-repack: expected on and/or off (comma-separated), got {get('llamacpp_repack')!r}")
    out = [Mode(m.name, m.system, m.runner,
                tuple(Config(c.label + ("" if r == "on" else ", no repack"), c.argv + (() if r == "on" else
                                                                                   ("--no-repack",)))
                      for r in repacks for c in m.configs)) for m in out]
    return [m for m in out if m.configs]


# ---- the edgespec side ---------------------------------------------------------------------------------------
def _prompts(n_code: int, n_prose: int) -> list[str]:
    import edgespec
    from prompts import PROSE, code_prompts
    tok = edgespec.tokenizer.TextTokenizer(ROOT / "models" / "demo-target" / "tokenizer.json")
    return code_prompts(tok, n_code) + PROSE[:n_prose]


def edgespec_runner(args) -> None:
    """Subprocess: decode the prompts with edgespec in one mode; print one JSON object."""
    import edgespec
    from edgespec.export.bundled import ensure_demo_engines
    from edgespec.backends import draft_provider
    from edgespec.generate import draft_threads_for
    from edgespec.speculation import DEFAULT_GAMMA_MAX
    if getattr(args, "target_engine", None):  # explicit engine folders (bench_realsize.py's stand-ins)
        target, draft = args.target_engine, args.draft_engine
    else:
        target, draft = ensure_demo_engines(ROOT / "models", args.engines)
    prompts = json.loads(args.prompts.read_text())
    d = {"plain": None, "draft": draft, "ngram": "ngram"}[args.mode]
    gamma = "auto" if args.gamma in (None, "auto") else int(args.gamma)
    ngram = {"max_ngram": args.max_ngram} if args.mode == "ngram" and args.max_ngram else {}
    if args.lookup and args.mode != "draft":
        raise SystemExit("--lookup goes with --mode draft (prompt lookup tried before the draft model)")
    if args.lookup_gamma and not args.lookup:
        raise SystemExit("--lookup-gamma goes with --lookup (the most proposals a round drafted by lookup makes)")
    if args.mode == "draft" and d is None:
        raise SystemExit("--mode draft needs a draft engine (--draft-engine, or the demo's)")
    lookup = {"lookup": args.lookup} if args.lookup else {}
    if args.lookup_gamma:
        lookup["lookup_gamma"] = args.lookup_gamma
    threads = getattr(args, "threads", None)
    try:
        # a fixed γ past the default longest draft raises gamma_max with it (γ 10 is otherwise refused)
        longer = {"gamma_max": gamma} if isinstance(gamma, int) and gamma > DEFAULT_GAMMA_MAX else {}
        gen = edgespec.load(target, draft=d, gamma=gamma if d else "auto", provider=args.provider, **ngram, **lookup,
                            **longer, **({"threads": threads} if threads else {}))
    except TypeError as e:  # an edgespec without load(lookup=): the mode fails with the reason, the run goes on
        if not lookup or "lookup" not in str(e):
            raise
        print(json.dumps({"system": f"edgespec {edgespec.__version__}", "mode": "draft+lookup",
                          "error": f"edgespec.load() does not take lookup= here: {e}"}))
        return
    kw = dict(max_new_tokens=args.max_new_tokens)
    if args.temperature:
        kw.update(temperature=args.temperature, seed=0, acceptance="rejection")
    gen.generate(prompts[0], max_new_tokens=16)  # warm-up (and the auto-γ cost measurement)
    results = []
    for rep in range(args.repeats):
        for i, p in enumerate(prompts):
            if args.temperature:
                kw["seed"] = rep * 1000 + i
            out = gen.generate(p, **kw)
            st = out.stats
            results.append({"prompt_index": i, "repeat": rep, "token_ids": out.token_ids, "new_tokens": st.new_tokens,
                            "decode_s": st.time_s["decode"], "ttft_s": st.time_s["prefill"],
                            "tokens_per_s": st.tokens_per_second, "drafted": st.drafted, "accepted": st.accepted,
                            "rounds": st.rounds, "rejections": st.rejections, "host_fraction": st.host_fraction,
                            "draft_calls": getattr(st, "draft_calls", None)})  # lookup rounds call no draft
    if args.mode == "draft" and not args.lookup and gen.cost is None and not getattr(args, "no_cost_model", False):
        gen.measure_costs()  # after the timed runs (fixed γ does not need it): for predicted vs measured
    cost = gen.cost.to_dict() if gen.cost else None
    config = {"gamma": gamma, "max_ngram": args.max_ngram if args.mode == "ngram" else None,
              "lookup": args.lookup, "lookup_gamma": args.lookup_gamma,
              "threads": threads or int(os.environ.get("EDGESPEC_THREADS", 0)) or os.cpu_count(),
              "draft_threads": (draft_threads_for(draft_provider(args.provider or "cpu", draft), None, threads)
                                or "the target's") if args.mode == "draft" else None, "provider": args.provider}
    mode = "draft+lookup" if args.lookup else args.mode
    print(json.dumps({"system": f"edgespec {edgespec.__version__}", "mode": mode, "config": config,
                      "results": results, "cost_model": cost,
                      "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}))


# ---- running and summarising one configuration ---------------------------------------------------------------
def run_system(name: str, cmd: list[str], timeout: int) -> dict:
    """Run one runner process; its JSON, or {"error": ...}. Stamps wall-clock start and end (epoch s)."""
    t0 = time.time()
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=ROOT)
    except FileNotFoundError as e:
        return {"error": f"could not start: {e} (run bash bench/setup_peers.sh)", "started": t0, "ended": time.time()}
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout} s", "started": t0, "ended": time.time()}
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith("{")]
    if not lines:
        return {"error": f"exit {p.returncode}, no JSON; stderr tail: {p.stderr[-1500:]}", "started": t0,
                "ended": time.time()}
    out = json.loads(lines[-1])
    out.update(started=t0, ended=time.time(), wall_s=round(time.time() - t0, 1))
    return out


def summarize(out: dict, ref: dict | None, n_prompts: int) -> dict:
    if "error" in out:
        return {"status": "failed", "error": out["error"]}
    res = out["results"]
    reps = sorted({r["repeat"] for r in res})
    tps = [sum(r["new_tokens"] for r in res if r["repeat"] == k) / sum(r["decode_s"] for r in res if r["repeat"] == k)
           for k in reps]
    s = {"status": "ok", "system": out.get("system"), "tokens_per_s": {"median": float(np.median(tps)),
         "min": float(min(tps)), "max": float(max(tps))}, "repeats": len(reps),
         "ttft_ms_median": float(np.median([r["ttft_s"] for r in res]) * 1e3),
         "peak_rss_mib": out.get("peak_rss_bytes", 0) / 2 ** 20}
    drafted = sum(r.get("drafted", 0) for r in res if r["repeat"] == 0)
    spec = out.get("speculative_stats") or {}
    if drafted:
        acc = sum(r["accepted"] for r in res if r["repeat"] == 0)
        rounds = sum(r["rounds"] for r in res if r["repeat"] == 0)
        s.update(acceptance_rate=acc / drafted, mean_accepted_per_round=acc / rounds)
    elif spec:
        prop = spec.get("draft_tokens_evaluated") or spec.get("draft_tokens_proposed")
        acc = spec.get("draft_tokens_accepted")
        if prop and acc is not None:
            s["acceptance_rate"] = acc / prop
        if spec.get("rounds") and acc is not None:
            s["mean_accepted_per_round"] = acc / spec["rounds"]
    if ref is not None and "error" not in ref:
        ours = {r["prompt_index"]: r["token_ids"] for r in ref["results"] if r["repeat"] == 0}
        theirs = {r["prompt_index"]: r["token_ids"] for r in res if r["repeat"] == 0}
        same = sum(ours.get(i) == theirs.get(i) for i in range(n_prompts))
        tok = [np.mean([a == b for a, b in zip(ours[i], theirs[i])]) if ours[i] and theirs[i] else 0.0
               for i in range(n_prompts) if i in ours and i in theirs]
        s.update(identical_prompts=f"{same}/{n_prompts}", token_agreement_with_edgespec=float(np.mean(tok)))
    return s


def merge_repeats(outs: list[dict]) -> dict:
    """One process per repeat -> one runner-shaped output (results re-numbered by repeat; the first's stats)."""
    bad = [(k, o) for k, o in enumerate(outs) if "error" in o]
    if bad:
        k, o = bad[0]
        return {"error": f"repeat {k}: {o['error']}", "started": outs[0]["started"], "ended": outs[-1]["ended"]}
    merged = dict(outs[0])
    merged["results"] = [dict(r, repeat=k) for k, o in enumerate(outs) for r in o["results"]]
    merged["peak_rss_bytes"] = max(o.get("peak_rss_bytes", 0) for o in outs)
    merged.update(started=min(o["started"] for o in outs), ended=max(o["ended"] for o in outs))
    return merged


# ---- selection, the same-run rule, ratios -------------------------------------------------------------------
def _identical(t: dict) -> bool:
    """Tokens matched edgespec plain on every sweep prompt, in the sweep and in every runoff pass."""
    got = t.get("identical_prompts")
    return (got is None or got.split("/")[0] == got.split("/")[1]) and all(t.get("runoff_identical", []))


def sweep_score(t: dict) -> float:
    """A configuration's speed for selection: the median of its sweep speed and its runoff passes' speeds."""
    runs = [t["tokens_per_s"]["median"]] + [v for v in t.get("runoff_tokens_per_s", []) if v]
    return float(np.median(runs))


def runoff_candidates(tried: list[dict], k: int) -> list[str]:
    """The configurations of one mode that run again in the runoff: its k fastest in the sweep among those whose
    tokens matched edgespec plain (among all that ran if none matched); none when fewer than 2."""
    ok = [t for t in tried if t["status"] == "ok"]
    pool = [t for t in ok if _identical(t)] or ok
    top = sorted(pool, key=lambda t: -t["tokens_per_s"]["median"])[:k]
    return [t["config"] for t in top] if len(top) > 1 else []


def select_best(tried: list[dict]) -> dict | None:
    """The fastest configuration of one mode: among those that ran and whose tokens matched edgespec plain on
    every sweep prompt (if none matched, the fastest that ran, flagged), by sweep_score; when a runoff ran,
    only its configurations take part. None when nothing ran."""
    ok = [t for t in tried if t["status"] == "ok"]
    if not ok:
        return None
    same = [t for t in ok if _identical(t)]
    pool = same or ok
    pool = [t for t in pool if "runoff_tokens_per_s" in t] or pool
    best = max(pool, key=sweep_score)
    return best if same else dict(best, selection_note="no configuration matched edgespec plain; fastest shown")


class MixedRunsError(ValueError):
    pass


def check_same_run(report: dict) -> None:
    """Every row and every sweep entry must carry this run's id and lie inside its start..end window."""
    run = report["run"]
    bad = []
    entries = [(f"row {n!r}", s) for n, s in report["systems"].items()]
    entries += [(f"sweep {n!r} {t.get('config', '?')!r}", t)
                for n, ts in report.get("sweep", {}).get("modes", {}).items() for t in ts]
    entries += [(f"head to head {h['a']!r} vs {h['b']!r} trial {i}", t)
                for h in report.get("head_to_head", []) for i, t in enumerate(h["trials"])]
    for where, e in entries:
        if e.get("run_id") != run["id"]:
            bad.append(f"{where} is from run {e.get('run_id')!r}")
        elif not run["started_epoch"] <= e.get("started", -1) <= e.get("ended", -1) <= run["ended_epoch"]:
            bad.append(f"{where} was measured outside this run's window")
    if bad:
        raise MixedRunsError(f"refusing to write a table that merges runs: this run is {run['id']!r} "
                             f"({run['started']} .. {run['ended']}), but " + "; ".join(bad[:5])
                             + (f" (+{len(bad) - 5} more)" if len(bad) > 5 else "")
                             + ". Every row must come from one invocation of bench/bench_peers.py.")


def _brief(err: str) -> str:
    """An error on one line for the table: a runner's traceback shortened to its last line."""
    head, _, tail = err.partition("stderr tail:")
    lines = [ln.strip() for ln in tail.splitlines() if ln.strip()]
    return (head + (lines[-1] if lines else "")).replace("|", "/").replace("\n", " ")


def _tps(s: dict) -> float | None:
    return s["tokens_per_s"]["median"] if s.get("status") == "ok" else None


def best_vs_best(systems: dict, system_of: dict) -> list[dict]:
    """edgespec's fastest greedy row against each peer system's fastest row, both named with their configs."""
    rows = {n: s for n, s in systems.items() if n != SAMPLED and _tps(s)}
    by_sys: dict = {}
    for n, s in rows.items():
        sys_ = system_of[n]
        if sys_ not in by_sys or _tps(s) > _tps(rows[by_sys[sys_]]):
            by_sys[sys_] = n
    if "edgespec" not in by_sys:
        return []
    ours = by_sys["edgespec"]
    out = []
    for sys_, theirs in by_sys.items():
        if sys_ == "edgespec":
            continue
        a, b = rows[ours], rows[theirs]
        r = _tps(a) / _tps(b)
        out.append({"edgespec": ours, "edgespec_config": a.get("config"), "edgespec_tokens_per_s": _tps(a),
                    "peer_system": sys_, "peer": theirs, "peer_config": b.get("config"),
                    "peer_tokens_per_s": _tps(b), "ratio": r,
                    "text": f"{ours} {a.get('config', '')} ({_tps(a):.0f} tok/s) vs {theirs} {b.get('config', '')} "
                            f"({_tps(b):.0f} tok/s): {r:.2f}×"})
    return out


def mode_ratios(systems: dict) -> dict:
    """Within each system (speculative / plain) and like for like across systems, best configs throughout."""
    t = {n: _tps(s) for n, s in systems.items() if _tps(s)}
    genai_draft = max((n for n in t if n.startswith("ORT GenAI draft")), key=t.get, default=None)
    pairs = [(n, plain_for(systems, n)) for n in ("edgespec draft", "edgespec draft+lookup", "edgespec ngram")] + [
             ("edgespec draft+lookup", "edgespec draft"),
             ("ORT GenAI ngram", "ORT GenAI plain"), ("HF assisted", "HF plain"), ("HF prompt lookup", "HF plain"),
             ("edgespec plain", "ORT GenAI plain"), (PLAIN_NATIVE, "ORT GenAI plain"), (PLAIN_NATIVE, "edgespec plain"),
             ("edgespec ngram", "ORT GenAI ngram"),
             ("edgespec draft", "HF assisted"), ("edgespec ngram", "HF prompt lookup")]
    pairs += [(n, "ORT GenAI plain") for n in t if n.startswith("ORT GenAI draft")]
    # llama.cpp: each speculative mode over plain at its precision, and edgespec's against its f16 rows (edgespec
    # plain native: float16 weights, like f16)
    pairs += [(n, "llama.cpp plain " + n.split()[-1]) for n in t
              if n.startswith(("llama.cpp draft ", "llama.cpp lookup "))]
    pairs += [("edgespec plain", "llama.cpp plain f16"), (PLAIN_NATIVE, "llama.cpp plain f16"),
              ("edgespec draft", "llama.cpp draft f16"), ("edgespec draft+lookup", "llama.cpp draft f16"),
              ("edgespec ngram", "llama.cpp lookup f16")]
    if genai_draft:
        pairs += [("edgespec draft", genai_draft), ("edgespec draft+lookup", genai_draft)]
    return {f"{a} / {b}": t[a] / t[b] for a, b in pairs if a in t and b in t}


def _rel(s: str) -> str:
    """A command with the repository's absolute path taken out: relative to the repository root."""
    return s.replace(str(ROOT) + os.sep, "")


def _builds(out: dict) -> dict | None:
    """A GenAI row's model builds, {role: the exact builder command (repository-relative)}; None for others."""
    b = (out.get("config") or {}).get("builds") if "error" not in out else None
    return {role: _rel(r["builder_command"]) for role, r in b.items()} if b else None


CONFIGURATIONS = (
    "edgespec draft: its demo draft engine (int8 weight-only: MatMulNBits, blocks of 32, accuracy level 4), γ and "
    "auto-γ; edgespec draft+lookup: the same draft with prompt-lookup proposals tried first (edgespec.load(lookup=N), "
    "N the shortest n-gram match), γ (integers and auto) × N × lookup γ (load(lookup_gamma=G): a round drafted by "
    "lookup proposes up to G tokens, past the model's γ; 0: γ). ORT GenAI draft: fixed k and adaptive k "
    "(min_adaptive_k..K, set_speculative_options), each with an fp32 and an int8 draft built by GenAI's model "
    "builder with edgespec's recipe where the builder takes it (-p int8 --extra_options block_size=32 accuracy_level=4 is_symmetric=false; "
    "the target stays fp32 like edgespec's, and the target verifies every token, so the draft's precision changes "
    "speed, never the output); the exact builder commands of each selected GenAI row are in its `builds`. "
    "llama.cpp (llama-server, edgespec's prompt token ids, llama.cpp's own timings; one row per GGUF precision: "
    "f16 from convert_hf_to_gguf.py, q8_0 and q4_0 from llama-quantize): plain over threads; draft "
    "(--spec-type draft-simple) over --spec-draft-n-max × --spec-draft-p-min × threads and draft threads (0: the "
    "target's); lookup over --spec-type ngram-simple's n-gram size × draft length and ngram-cache (llama-lookup's "
    "cache), × threads; the exact conversion commands of each selected llama.cpp row are in its `builds`. "
    "Nothing is dropped as dominated: every configuration listed in the sweep ran.")


# ---- head to head: the comparisons the targets name, paired in time ------------------------------------------
def plain_for(systems: dict, name: str) -> str:
    """The edgespec plain row on the same target provider as row `name` (its speedup over plain is the one the
    paper's formula predicts from that row's costs)."""
    return PLAIN_NATIVE if "cpu-native" in str(systems.get(name, {}).get("config", "")) else "edgespec plain"


def head_to_head_pairs(systems: dict, system_of: dict) -> list[tuple[str, str]]:
    """(edgespec's fastest greedy row, ORT GenAI's fastest row), (edgespec plain, ORT GenAI plain) and (edgespec
    draft, edgespec plain), where both rows ran: the comparisons the issue's targets are about (the last is the
    measured speedup that predicted vs measured divides)."""
    pairs = [(b["edgespec"], b["peer"]) for b in best_vs_best(systems, system_of) if b["peer_system"] == "ORT GenAI"]
    for a, b in (("edgespec plain", "ORT GenAI plain"), (PLAIN_NATIVE, "ORT GenAI plain"),
                 (DRAFT, plain_for(systems, DRAFT))):
        if _tps(systems.get(a, {})) and _tps(systems.get(b, {})):
            pairs.append((a, b))
    return list(dict.fromkeys(pairs))


def chunk_indices(n: int, k: int) -> list[list[int]]:
    """n prompts in k chunks, interleaved (i % k): each chunk mixes code and prose prompts."""
    if not 1 <= k <= n:
        raise ValueError(f"need 1 <= chunks <= prompts ({n}), got {k}")
    return [list(range(i, n, k)) for i in range(k)]


def chunk_tps(out: dict) -> float | None:
    """A runner's tokens/s over all it decoded (total new tokens / total decode time); None when it failed."""
    if "error" in out or not out.get("results"):
        return None
    res = out["results"]
    return sum(r["new_tokens"] for r in res) / sum(r["decode_s"] for r in res)


def paired_summary(a: str, b: str, trials: list[dict]) -> dict:
    """trials: {"a_tokens_per_s", "b_tokens_per_s", ...} per (round, chunk) -> the ratio a / b per trial and its
    median, quartiles and range (trials where either side failed are counted, never used)."""
    ok = [t for t in trials if t["a_tokens_per_s"] and t["b_tokens_per_s"]]
    r = np.array([t["a_tokens_per_s"] / t["b_tokens_per_s"] for t in ok])
    out = {"a": a, "b": b, "trials": trials, "failed_trials": len(trials) - len(ok)}
    if len(r):
        q1, med, q3 = np.percentile(r, [25, 50, 75])
        out.update(ratio_median=float(med), ratio_q1=float(q1), ratio_q3=float(q3), ratio_min=float(r.min()),
                   ratio_max=float(r.max()), trials_a_faster=int((r > 1).sum()), trials_ok=len(r),
                   a_tokens_per_s_median=float(np.median([t["a_tokens_per_s"] for t in ok])),
                   b_tokens_per_s_median=float(np.median([t["b_tokens_per_s"] for t in ok])))
    return out


# ---- the run -------------------------------------------------------------------------------------------------
class Progress:
    """A one-line progress bar on stderr, by estimated seconds of work (tokens / a rough speed + start-up)."""
    SPEED = {"edgespec": 350.0, "genai": 350.0, "hf": 90.0, "optimum": 140.0, "llamacpp": 400.0}  # rough tok/s, ETA
    START_S = {"edgespec": 4.0, "genai": 2.5, "hf": 12.0, "optimum": 10.0, "llamacpp": 2.0}  # start, load, warm-up

    def __init__(self, total: float):
        self.total, self.done, self.t0 = total, 0.0, time.time()

    @classmethod
    def cost(cls, runner: str, tokens: int) -> float:
        return cls.START_S[runner] + tokens / cls.SPEED[runner]

    def show(self, what: str) -> None:
        el = time.time() - self.t0
        frac = min(self.done / self.total, 1.0) if self.total else 1.0
        eta = el / frac - el if frac > 0.02 else self.total - self.done
        bar = "#" * int(30 * frac) + "." * (30 - int(30 * frac))
        print(f"\r[{bar}] {100 * frac:3.0f}% {_mmss(el)} elapsed, ~{_mmss(eta)} left | {what[:70]:<70}",
              end="", file=sys.stderr, flush=True)


def _mmss(s: float) -> str:
    return f"{int(s) // 60}:{int(s) % 60:02d}"


def _iso(t: float) -> str:
    return dt.datetime.fromtimestamp(t, dt.timezone.utc).isoformat(timespec="seconds")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=Path("bench/results/peers.json"))
    ap.add_argument("--engines", type=Path, default=ROOT / "engines")
    ap.add_argument("--code-prompts", type=int, default=20)
    ap.add_argument("--prose-prompts", type=int, default=4)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3, help="final phase: passes over all prompts, modes interleaved")
    ap.add_argument("--sweep-prompts", type=int, default=6, help="sweep phase: prompts (spread over the set)")
    ap.add_argument("--gammas", default="2,3,4,5,6", help="draft lengths swept: edgespec γ (+auto), GenAI k "
                                                          "(+adaptive), HF γ and prompt-lookup tokens (+10)")
    ap.add_argument("--max-ngrams", default="2,3,4", help="edgespec n-gram: longest n-gram matched")
    ap.add_argument("--genai-ngram-sizes", default="2,3,4", help="GenAI speculative.ngram_size")
    ap.add_argument("--genai-chained", default="off,on", help="GenAI speculative.ngram_chained_lookup")
    ap.add_argument("--hf-lookup-ngrams", default="2,3", help="HF prompt lookup: max_matching_ngram_size")
    ap.add_argument("--lookup-gammas", default="4,5,6,8,auto", help="edgespec draft+lookup: γ (integers, auto)")
    ap.add_argument("--lookups", default="2,3", help="edgespec draft+lookup: load(lookup=N), the shortest n-gram "
                                                     "match for a prompt-lookup proposal (tried before the draft)")
    ap.add_argument("--lookup-lengths", default="0,12,16",
                    help="edgespec draft+lookup: load(lookup_gamma=G), the most proposals a round drafted by lookup "
                         "makes (0: γ)")
    ap.add_argument("--genai-draft-ks", default="2,3,4,5,6,8", help="GenAI draft: fixed k (max_draft_tokens)")
    ap.add_argument("--genai-adaptive-ks", default="4,6,8", help="GenAI draft: K of adaptive k (min..K)")
    ap.add_argument("--genai-min-adaptive-k", default="1,2", help="GenAI draft: min_adaptive_k of adaptive k")
    ap.add_argument("--genai-draft-precisions", default="fp32,int8",
                    help="GenAI draft: the draft model's build (fp32, int8, int4; the target stays fp32)")
    ap.add_argument("--llamacpp-precisions", default=LLAMACPP_SWEEP["llamacpp_precisions"],
                    help="llama.cpp: GGUF weight precisions, one row per mode each (f16, q8_0, q4_0; none: no "
                         "llama.cpp rows)")
    ap.add_argument("--llamacpp-threads", default=LLAMACPP_SWEEP["llamacpp_threads"],
                    help="llama.cpp: threads swept (-t and -tb)")
    ap.add_argument("--llamacpp-draft-threads", default=LLAMACPP_SWEEP["llamacpp_draft_threads"],
                    help="llama.cpp draft: draft threads (0: the target's, llama.cpp's default; others only below "
                         "the target's)")
    ap.add_argument("--llamacpp-draft-ks", default=LLAMACPP_SWEEP["llamacpp_draft_ks"],
                    help="llama.cpp draft: --spec-draft-n-max swept")
    ap.add_argument("--llamacpp-draft-p-mins", default=LLAMACPP_SWEEP["llamacpp_draft_p_mins"],
                    help="llama.cpp draft: --spec-draft-p-min swept (drafting stops below this draft probability)")
    ap.add_argument("--llamacpp-draft-precisions", default=LLAMACPP_SWEEP["llamacpp_draft_precisions"],
                    help="llama.cpp draft: the draft GGUF's precisions (same: the target's)")
    ap.add_argument("--llamacpp-lookup-types", default=LLAMACPP_SWEEP["llamacpp_lookup_types"],
                    help="llama.cpp lookup: --spec-type values (ngram-simple, ngram-map-k, ngram-map-k4v, ngram-mod, "
                         "ngram-cache)")
    ap.add_argument("--llamacpp-ngram-sizes", default=LLAMACPP_SWEEP["llamacpp_ngram_sizes"],
                    help="llama.cpp lookup: the n-gram looked up (size-n)")
    ap.add_argument("--llamacpp-lookup-lengths", default=LLAMACPP_SWEEP["llamacpp_lookup_lengths"],
                    help="llama.cpp lookup: the draft length after a match (size-m)")
    ap.add_argument("--llamacpp-repack", default=LLAMACPP_SWEEP["llamacpp_repack"],
                    help="llama.cpp: on, off or on,off: its weight repacking (llama-server --no-repack when off)")
    ap.add_argument("--edgespec-providers", default="cpu,cpu-native",
                    help="edgespec speculative modes: the target's providers swept (plain runs on each as its own mode)")
    ap.add_argument("--runoff", type=int, default=3, help="after the sweep, each mode's N fastest configurations "
                    "run twice more on the sweep prompts (opposite orders); selection takes the median of the three "
                    "speeds (0 or 1: the sweep alone)")
    ap.add_argument("--paired-rounds", type=int, default=3,
                    help="head to head: rounds over the prompt chunks of each target comparison (0: skip)")
    ap.add_argument("--paired-chunks", type=int, default=4, help="head to head: prompt chunks (interleaved)")
    ap.add_argument("--modes", default=None, help="comma-separated modes to run (edgespec plain always runs); "
                                                  "the rest are absent from the table, never taken from elsewhere")
    ap.add_argument("--timeout", type=int, default=900, help="per runner process, seconds")
    ap.add_argument("--edgespec-runner", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--mode", default="plain", help=argparse.SUPPRESS)
    ap.add_argument("--gamma", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--max-ngram", type=int, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--lookup", type=int, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--lookup-gamma", type=int, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--provider", default="cpu", help=argparse.SUPPRESS)
    ap.add_argument("--target-engine", type=Path, default=None, help=argparse.SUPPRESS)  # runner: instead of the demo's
    ap.add_argument("--draft-engine", type=Path, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--threads", type=int, default=None, help=argparse.SUPPRESS)  # runner: the target's threads
    ap.add_argument("--no-cost-model", action="store_true", help=argparse.SUPPRESS)  # runner: no measure_costs after
    ap.add_argument("--prompts", type=Path, help=argparse.SUPPRESS)
    ap.add_argument("--temperature", type=float, default=0.0, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.runoff < 0:
        ap.error(f"--runoff must be >= 0 (0 or 1: selection by the sweep alone), got {args.runoff}")
    if args.paired_rounds < 0:
        ap.error(f"--paired-rounds must be >= 0 (0: no head to head), got {args.paired_rounds}")
    if args.edgespec_runner:
        edgespec_runner(args)
        return 0
    argv = sys.argv[1:] if argv is None else argv
    run = {"id": uuid.uuid4().hex[:12], "started_epoch": time.time(),
           "command": "python bench/bench_peers.py " + shlex.join(argv)}
    run["started"] = _iso(run["started_epoch"])
    work = ROOT / ".cache" / "peers"
    rdir = work / run["id"]
    rdir.mkdir(parents=True, exist_ok=True)
    prompts = _prompts(args.code_prompts, args.prose_prompts)
    n = len(prompts)
    sweep_idx = sorted({round(i * (n - 1) / max(args.sweep_prompts - 1, 1)) for i in range(min(args.sweep_prompts, n))})
    pfile, sfile = rdir / "prompts.json", rdir / "sweep-prompts.json"
    pfile.write_text(json.dumps(prompts))
    sfile.write_text(json.dumps([prompts[i] for i in sweep_idx]))

    tgt, dft = str(ROOT / "models" / "demo-target"), str(ROOT / "models" / "demo-draft")
    tokens = ["--max-new-tokens", str(args.max_new_tokens)]
    base = {"edgespec": [sys.executable, str(Path(__file__).resolve()), "--edgespec-runner", "--engines",
                         str(args.engines)] + tokens,
            "genai": [str(ROOT / ".venv-genai" / "bin" / "python"), str(HERE / "peers" / "genai_runner.py"),
                      "--target", tgt, "--draft", dft, "--work", str(work / "genai")] + tokens,
            "hf": [str(ROOT / ".venv-hf" / "bin" / "python"), str(HERE / "peers" / "hf_runner.py"),
                   "--target", tgt, "--draft", dft] + tokens,
            "optimum": [str(ROOT / ".venv-optimum" / "bin" / "python"), str(HERE / "peers" / "optimum_runner.py"),
                        "--target", tgt, "--work", str(work / "optimum")] + tokens,
            "llamacpp": [str(ROOT / ".venv-llamacpp" / "bin" / "python"), str(HERE / "peers" / "llamacpp_runner.py"),
                         "--target", tgt, "--draft", dft, "--work", str(work / "llamacpp")] + tokens}

    def cmd(mode: Mode, cfg: Config, prompts_file: Path, extra=()) -> list[str]:
        return base[mode.runner] + ["--prompts", str(prompts_file), "--repeats", "1"] + list(cfg.argv) + list(extra)

    modes = plan(args)
    by_name = {m.name: m for m in modes}
    swept = [m for m in modes if len(m.configs) > 1 or m.name == "edgespec plain"]
    ns, nt = len(sweep_idx) * args.max_new_tokens, n * args.max_new_tokens
    chunks = chunk_indices(n, args.paired_chunks) if args.paired_rounds else []
    total = sum(Progress.cost(m.runner, ns) * (len(m.configs) + (2 * min(args.runoff, len(m.configs))
                                                                 if args.runoff > 1 and len(m.configs) > 1 else 0))
                for m in swept) + \
        args.repeats * (sum(Progress.cost(m.runner, nt) for m in modes) + Progress.cost("edgespec", nt)) + \
        args.paired_rounds * sum(2 * Progress.cost("genai", len(c) * args.max_new_tokens) +
                                 4 * Progress.cost("edgespec", len(c) * args.max_new_tokens) for c in chunks)
    n_sweep = sum(len(m.configs) for m in swept)
    print(f"run {run['id']}: sweep {n_sweep} configurations on {len(sweep_idx)} prompts, then {len(modes) + 1} "
          f"modes × {args.repeats} repeats on {n} prompts; estimated {_mmss(total)} (min:s)", file=sys.stderr)
    bar = Progress(total)
    raw: dict = {"sweep": {}, "final": {}}

    # 1. sweep: configurations interleaved across modes (the i-th of every mode, then the (i+1)-th, ...)
    order = [(m, c) for i in range(max(len(m.configs) for m in swept)) for m in swept if i < len(m.configs)
             for c in [m.configs[i]]]
    sweep: dict = {m.name: [] for m in swept}
    ref = None
    for m, c in order:
        bar.show(f"sweep {m.name}: {c.label}")
        out = run_system(f"{m.name} {c.label}", cmd(m, c, sfile), args.timeout)
        raw["sweep"][f"{m.name} | {c.label}"] = out
        if m.name == "edgespec plain":
            ref = out
        s = summarize(out, ref if m.name != "edgespec plain" else None, len(sweep_idx))
        sweep[m.name].append(dict(s, config=c.label, argv=list(c.argv), run_id=run["id"], started=out["started"],
                                  ended=out["ended"]))
        bar.done += Progress.cost(m.runner, ns)
    # 1b. runoff: each mode's --runoff fastest configurations again on the sweep prompts, two passes in opposite
    # orders (configurations interleaved across modes), so that one lucky or unlucky sweep slot does not choose
    ref = ref or {"error": "edgespec plain did not run"}
    entry = {(m.name, t["config"]): t for m in swept for t in sweep[m.name]}
    picked = {m.name: set(runoff_candidates(sweep[m.name], args.runoff)) for m in swept if m.name != "edgespec plain"}
    finalists = [[(m, c) for c in m.configs if c.label in picked[m.name]] for m in swept if m.name in picked]
    order = [f[i] for i in range(max(map(len, finalists), default=0)) for f in finalists if i < len(f)]
    for p, passes in enumerate((order, order[::-1]) if args.runoff else ()):
        for m, c in passes:
            bar.show(f"runoff {p + 1}/2 {m.name}: {c.label}")
            out = run_system(f"{m.name} {c.label}", cmd(m, c, sfile), args.timeout)
            raw.setdefault("runoff", {}).setdefault(f"{m.name} | {c.label}", []).append(out)
            got, t = summarize(out, ref, len(sweep_idx)), entry[m.name, c.label]
            t.setdefault("runoff_tokens_per_s", []).append(got["tokens_per_s"]["median"] if got["status"] == "ok"
                                                          else None)
            t.setdefault("runoff_identical", []).append(got["status"] == "ok" and _identical(got))
            t["ended"] = out["ended"]
            bar.done += Progress.cost(m.runner, ns)
    best: dict = {}
    for m in modes:
        b = select_best(sweep[m.name]) if m.name in sweep else {"config": m.configs[0].label}
        best[m.name] = next((c for c in m.configs if b and c.label == b["config"]), None)

    # 2. final: the best of each mode on all prompts, one process per (mode, repeat), modes rotated per repeat
    final = [m for m in modes if best[m.name] is not None]
    sampled = Mode(SAMPLED, "edgespec", "edgespec", ())
    sampled_cfg = best.get("edgespec draft")
    outs: dict = {m.name: [] for m in final}
    for rep in range(args.repeats):
        rot = final[rep % len(final):] + final[:rep % len(final)]
        for m in rot + ([sampled] if sampled_cfg else []):
            c = sampled_cfg if m is sampled else best[m.name]
            bar.show(f"final {rep + 1}/{args.repeats} {m.name}: {c.label}")
            extra = ["--temperature", "0.8"] if m is sampled else []
            outs.setdefault(m.name, []).append(run_system(m.name, cmd(m, c, pfile, extra), args.timeout))
            bar.done += Progress.cost(m.runner, nt)
    bar.show("roofline")
    print(file=sys.stderr)
    merged = {name: merge_repeats(o) for name, o in outs.items()}
    raw["final"] = merged
    ref = merged.get("edgespec plain")
    systems = {}
    for name in [m.name for m in modes] + [SAMPLED]:
        if name in merged:
            out = merged[name]
            s = summarize(out, ref if name != SAMPLED else None, n)
            systems[name] = dict(s, config=(sampled_cfg if name == SAMPLED else best[name]).label, run_id=run["id"],
                                 started=out["started"], ended=out["ended"],
                                 selected_from=len(by_name[name].configs) if name in by_name else 1)
            if _builds(out):
                systems[name]["builds"] = _builds(out)
        elif name in by_name:  # a mode none of whose configurations ran: failed, with the sweep's first error
            err = next((t["error"] for t in sweep.get(name, []) if t["status"] != "ok"), "no configuration ran")
            systems[name] = {"status": "failed", "error": f"every configuration failed in the sweep; first: {err}",
                             "run_id": run["id"], "started": run["started_epoch"], "ended": time.time()}
    system_of = {m.name: m.system for m in modes} | {SAMPLED: "edgespec"}

    # 3. head to head: each target comparison again, the two sides back to back on the same chunk of prompts (order
    # alternating), so that the machine's drift over minutes falls on both sides of every ratio
    head_to_head = []
    cfiles = []
    for ci, idx in enumerate(chunks):
        cfiles.append(rdir / f"chunk-{ci}.json")
        cfiles[-1].write_text(json.dumps([prompts[i] for i in idx]))
    for a, b in head_to_head_pairs(systems, system_of) if args.paired_rounds else []:
        trials = []
        for rnd in range(args.paired_rounds):
            for ci, cfile in enumerate(cfiles):
                got = {}
                for name in ((a, b) if (rnd + ci) % 2 == 0 else (b, a)):
                    m = by_name[name]
                    bar.show(f"head to head {rnd + 1}/{args.paired_rounds} chunk {ci + 1}: {name}")
                    got[name] = run_system(name, cmd(m, best[name], cfile), args.timeout)
                    bar.done += Progress.cost(m.runner, len(chunks[ci]) * args.max_new_tokens)
                trials.append({"round": rnd, "chunk": ci, "first": a if (rnd + ci) % 2 == 0 else b,
                               "a_tokens_per_s": chunk_tps(got[a]), "b_tokens_per_s": chunk_tps(got[b]),
                               "errors": [_brief(o["error"]) for o in got.values() if "error" in o],
                               "run_id": run["id"], "started": min(o["started"] for o in got.values()),
                               "ended": max(o["ended"] for o in got.values())})
                raw.setdefault("head_to_head", {}).setdefault(f"{a} | {b}", []).append(got)
        head_to_head.append(dict(paired_summary(a, b, trials), a_config=best[a].label, b_config=best[b].label))
    print(file=sys.stderr)

    roofline = roofline_of(args.engines, systems)
    pred = predicted_vs_measured(merged.get(DRAFT), systems, head_to_head)
    (rdir / "raw.json").write_text(json.dumps(raw))
    run["ended_epoch"] = time.time()
    run["ended"] = _iso(run["ended_epoch"])
    run["duration_min"] = round((run["ended_epoch"] - run["started_epoch"]) / 60, 1)
    from host import machine
    report = {"run": run, "prompts": {"code": args.code_prompts, "prose": n - args.code_prompts, "count": n},
              "max_new_tokens": args.max_new_tokens, "decoding": "greedy (except the sampled row)",
              "method": {"sweep_prompt_indices": sweep_idx, "sweep_repeats": 1, "final_repeats": args.repeats,
                         "selection": "fastest configuration whose tokens were identical to edgespec plain on every "
                                      "sweep prompt" + ("; among each mode's runoff configurations, by the median of "
                                                        "the sweep's and the two runoff passes' tok/s on the sweep "
                                                        "prompts" if args.runoff > 1 else ", by its sweep tok/s"),
                         "runoff": args.runoff,
                         "schedule": "sweep: configurations interleaved across modes; final: one process per "
                                     "(mode, repeat), modes rotated each repeat; head to head: each target "
                                     "comparison's two sides back to back on each prompt chunk, order alternating",
                         "head_to_head": {"rounds": args.paired_rounds, "chunks": chunks},
                         "configurations": CONFIGURATIONS},
              "sweep": {"modes": sweep},
              "systems": systems, "system_of": system_of,
              "best_vs_best": best_vs_best(systems, system_of), "head_to_head": head_to_head,
              "ratios": mode_ratios(systems),
              "roofline": roofline, "edgespec_predicted_vs_measured": pred, "machine": machine(),
              "raw": str((rdir / "raw.json").relative_to(ROOT))}  # repository-relative: no machine path
    write_report(report, args.out)
    print(markdown(report))
    return 0


def write_report(report: dict, out: Path) -> None:
    """JSON, markdown and PNG beside `out`, after `check_same_run` (it raises instead of writing a merge)."""
    check_same_run(report)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    out.with_suffix(".md").write_text(markdown(report))
    plot(report, out.with_suffix(".png"))


def roofline_of(engines: Path, systems: dict) -> dict:
    """Tokens per second if a plain step only read its weights and KV cache at the measured read bandwidth:
    the fp32 graph's bytes, and for plain decoding on cpu-native the native weights' (float16) bytes."""
    bw = memory_bandwidth_gbs()
    weights = (engines / "demo-target" / "model.onnx").stat().st_size
    m = json.loads((engines / "demo-target" / "engine.json").read_text())
    ctx = 160  # ~ mean context of these runs (prompt ~96 + half of 128 new tokens)
    kv = 2 * m["num_layers"] * m["num_kv_heads"] * m["head_dim"] * 4 * ctx
    roof = bw["read_gbs"] * 1e9 / (weights + kv)
    native = (m.get("extra", {}).get("native") or {}).get("weight_bytes_per_token")
    out = {"read_bandwidth_gbs": bw["read_gbs"], "copy_bandwidth_gbs": bw["copy_gbs"],
           "bytes_per_token": weights + kv, "weights_bytes": weights, "kv_bytes_at_mean_context": kv,
           "roofline_tokens_per_s": roof,
           "plain_share_of_roofline": {n: _tps(systems[n]) / roof for n in ("edgespec plain", "ORT GenAI plain",
                                                                            "HF plain")
                                       if n in systems and _tps(systems[n])}}
    if native and _tps(systems.get(PLAIN_NATIVE, {})):
        out["native_bytes_per_token"] = native + kv
        out["native_roofline_tokens_per_s"] = bw["read_gbs"] * 1e9 / (native + kv)
        out["plain_share_of_roofline"][PLAIN_NATIVE] = _tps(systems[PLAIN_NATIVE]) / out["native_roofline_tokens_per_s"]
    return out


def predicted_vs_measured(ed: dict | None, systems: dict, head_to_head: list | None = None) -> dict | None:
    """The speedup predicted from edgespec draft's measured α, mean γ and costs, against the measured one: the
    final rows' ratio (medians minutes apart) and, when the head to head ran edgespec draft against plain on
    its provider, its median ratio (the two back to back). predicted_speedup uses every cost the cost model
    measured at load (a round's host time and the draft's per-round catch-up call too);
    predicted_speedup_paper the paper's draft and verify calls alone."""
    if not ed or "error" in ed or not ed.get("cost_model"):
        return None
    from edgespec.costmodel import expected_tokens
    cm = ed["cost_model"]
    r0 = [r for r in ed["results"] if r["repeat"] == 0]
    acc, rej, dr, rounds = (sum(r[k] for r in r0) for k in ("accepted", "rejections", "drafted", "rounds"))
    alpha = acc / (acc + rej) if acc + rej else 0.0
    g = round(dr / rounds) if rounds else 0
    t1, tv, td = cm["t_verify_ms"][0], cm["t_verify_ms"][g], cm["t_draft_ms"]
    # the paper's formula: a round costs γ draft calls and one verify of γ + 1 tokens, plain one verify of 1
    paper = expected_tokens(alpha, g) / (g * td / t1 + tv / t1) if g else 1.0
    # and with every cost the cost model measured at load: the host's part of a round and the draft's
    # per-round catch-up call as well (costmodel.py: time(γ) and time(0))
    tr, tdr = cm.get("t_round_ms", 0.0), cm.get("t_draft_round_ms", 0.0)
    p = expected_tokens(alpha, g) * (tr + t1) / (tr + tdr + g * td + tv) if g else 1.0
    plain = plain_for(systems, DRAFT)
    a, b = _tps(systems.get(DRAFT, {})), _tps(systems.get(plain, {}))
    paired = next((h.get("ratio_median") for h in head_to_head or [] if (h["a"], h["b"]) == (DRAFT, plain)), None)
    return {"alpha": alpha, "mean_gamma": g, "predicted_speedup": p, "predicted_speedup_paper": paper,
            "measured_speedup": a / b if a and b else None, "measured_speedup_head_to_head": paired, "plain": plain,
            "cost_model_ms": {k: cm.get(k) for k in ("t_verify_ms", "t_draft_ms", "t_round_ms", "t_draft_round_ms")}}


def memory_bandwidth_gbs(mib: int = 512, reps: int = 5) -> dict:
    """Read bandwidth (a sum over a 512 MiB array, what streaming weights needs) and copy bandwidth
    (read + write) of this machine, measured with numpy on all cores it will use."""
    from concurrent.futures import ThreadPoolExecutor
    a = np.ones(mib * 2 ** 20 // 4, dtype=np.float32)
    b = np.empty_like(a)
    n = os.cpu_count() or 1
    parts = np.array_split(a, n)
    rd, cp = [], []
    with ThreadPoolExecutor(n) as pool:  # numpy releases the GIL in reductions: one slice per core
        for _ in range(reps):
            t = time.perf_counter()
            list(pool.map(lambda x: x.sum(dtype=np.float32), parts))
            rd.append(time.perf_counter() - t)
    for _ in range(reps):
        t = time.perf_counter()
        np.copyto(b, a)
        cp.append(time.perf_counter() - t)
    return {"read_gbs": a.nbytes / min(rd) / 1e9, "copy_gbs": 2 * a.nbytes / min(cp) / 1e9}


# ---- the summary -------------------------------------------------------------------------------------------
def markdown(r: dict) -> str:
    rows = []
    run = r.get("run")
    if run:
        rows += [f"Run `{run['id']}`: {run['started']} .. {run['ended']} ({run['duration_min']} min), every row "
                 f"below from this run.", ""]
    if r.get("best_vs_best"):
        rows += ["**Best against best** (each system's fastest mode at its fastest configuration):", ""]
        rows += [f"- {b['text']}" for b in r["best_vs_best"]] + [""]
    if r.get("head_to_head"):
        hh = r["method"].get("head_to_head", {})
        rows += [f"**Head to head** (the two sides back to back on the same prompts, order alternating; "
                 f"{hh.get('rounds', '?')} rounds × {len(hh.get('chunks', [])) or '?'} prompt chunks; ratio per "
                 f"trial, median (quartiles, range)):", ""]
        for h in r["head_to_head"]:
            if "ratio_median" not in h:
                rows.append(f"- {h['a']} vs {h['b']}: no trial where both ran ({h['failed_trials']} failed)")
                continue
            rows.append(f"- {h['a']} {h['a_config']} vs {h['b']} {h['b_config']}: **{h['ratio_median']:.2f}×** "
                        f"({h['ratio_q1']:.2f}–{h['ratio_q3']:.2f}, "
                        f"range {h['ratio_min']:.2f}–{h['ratio_max']:.2f}; "
                        f"faster in {h['trials_a_faster']} of {h['trials_ok']} trials; "
                        f"{h['a_tokens_per_s_median']:.0f} against {h['b_tokens_per_s_median']:.0f} tok/s)"
                        + (f", {h['failed_trials']} trials failed" if h["failed_trials"] else ""))
        rows.append("")
    rows += ["| system | tok/s median (min–max) | TTFT ms | acceptance | accepted/round | identical prompts | "
             "peak RSS MiB | configuration (selected in the sweep) |", "|---|---|---|---|---|---|---|---|"]
    for name, s in r["systems"].items():
        if s["status"] != "ok":
            rows.append(f"| {name} | failed: {_brief(s['error'])[:160]} | | | | | | |")
            continue
        t = s["tokens_per_s"]
        acc = f"{s['acceptance_rate']:.3f}" if "acceptance_rate" in s else "–"
        apr = f"{s['mean_accepted_per_round']:.2f}" if "mean_accepted_per_round" in s else "–"
        cfg = s.get("config", "") + (f" (best of {s['selected_from']})" if s.get("selected_from", 1) > 1 else "")
        rows.append(f"| {name} | {t['median']:.1f} ({t['min']:.1f}–{t['max']:.1f}) | {s['ttft_ms_median']:.1f} | "
                    f"{acc} | {apr} | {s.get('identical_prompts', '–')} | {s['peak_rss_mib']:.0f} | {cfg} |")
    builds = [(n, s["builds"]) for n, s in r["systems"].items() if s.get("builds") and not n.startswith("llama.cpp")]
    if builds:
        rows += ["", "GenAI model builds of the rows above (exact builder commands):", ""]
        rows += [f"- {n}: " + "; ".join(f"{role} `{cmd}`" for role, cmd in b.items()) for n, b in builds]
    ggufs = [(n, s["builds"]) for n, s in r["systems"].items() if s.get("builds") and n.startswith("llama.cpp")]
    if ggufs:
        rows += ["", "llama.cpp GGUF conversions of the rows above (exact commands; <CONVERT_WRAPPER> is "
                     "bench/peers/llamacpp_runner.py's CONVERT_WRAPPER around convert_hf_to_gguf.py):", ""]
        rows += [f"- {n}: " + "; ".join(f"{role} `{cmd}`" for role, cmd in b.items()) for n, b in ggufs]
    rows += ["", "| ratio (best configuration of each) | value |", "|---|---|"] + \
        [f"| {k} | {v:.2f}x |" for k, v in r["ratios"].items()]
    rf = r["roofline"]
    rows += ["", f"Roofline: read bandwidth {rf['read_bandwidth_gbs']:.1f} GB/s (numpy sum; copy "
                 f"{rf['copy_bandwidth_gbs']:.1f} GB/s) ÷ {rf['bytes_per_token'] / 1e6:.1f} MB "
                 f"per token = {rf['roofline_tokens_per_s']:.0f} tok/s"
                 + (f" ({rf['native_bytes_per_token'] / 1e6:.1f} MB and {rf['native_roofline_tokens_per_s']:.0f} tok/s "
                    f"for {PLAIN_NATIVE}'s float16 weights)" if rf.get("native_bytes_per_token") else "")
                 + "; plain decoders' share: "
                 + ", ".join(f"{k} {100 * v:.0f}%" for k, v in rf["plain_share_of_roofline"].items())]
    if r.get("edgespec_predicted_vs_measured"):
        p = r["edgespec_predicted_vs_measured"]
        paired = p.get("measured_speedup_head_to_head")
        paper = p.get("predicted_speedup_paper")
        rows.append(f"edgespec draft: α = {p['alpha']:.3f}, mean γ {p['mean_gamma']}, predicted speedup over "
                    f"{p.get('plain', 'edgespec plain')} {p['predicted_speedup']:.2f}x from every measured cost"
                    + (f" ({paper:.2f}x from draft and verify calls alone, the paper's formula)"
                       if paper and abs(paper - p['predicted_speedup']) > 5e-3 else "")
                    + f", measured {p['measured_speedup'] or float('nan'):.2f}x (final medians)"
                    + (f", {paired:.2f}x head to head ({100 * paired / p['predicted_speedup']:.0f}% of predicted)"
                       if paired else ""))
    sweep = r.get("sweep", {}).get("modes")
    if sweep:
        m = r["method"]
        rows += ["", f"Every configuration tried (sweep: prompts {m['sweep_prompt_indices']} of {r['prompts']['count']}"
                     f", once each" + (f", then each mode's {m['runoff']} fastest twice more (runoff)"
                                       if m.get("runoff", 0) > 1 else "") + f"; {m['selection']}).", ""]
        if m.get("configurations"):
            rows += [m["configurations"], ""]
        rows += ["| mode | configuration | tok/s | acceptance | identical prompts | |", "|---|---|---|---|---|---|"]
        for name, tried in sweep.items():
            chosen = r["systems"].get(name, {}).get("config")
            for t in tried:
                mark = "**selected**" if t["config"] == chosen else ""
                if t["status"] != "ok":
                    rows.append(f"| {name} | {t['config']} | failed: {_brief(t['error'])[:160]} | | | |")
                    continue
                acc = f"{t['acceptance_rate']:.3f}" if "acceptance_rate" in t else "–"
                ro = t.get("runoff_tokens_per_s")
                speed = f"{t['tokens_per_s']['median']:.1f}" + (
                    " (runoff " + ", ".join("failed" if v is None else f"{v:.1f}" for v in ro)
                    + f"; median {sweep_score(t):.1f})" if ro else "")
                same = t.get("identical_prompts", "–") + ("" if all(t.get("runoff_identical", [])) else
                                                          ", differed in the runoff")
                rows.append(f"| {name} | {t['config']} | {speed} | {acc} | {same} | {mark} |")
    rows.append(f"\nCommand: `{run['command'] if run else r['command']}`"
                + (f" ({r['note']})" if r.get("note") else ""))
    return "\n".join(rows) + "\n"


def plot(r: dict, path: Path) -> None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    ok = {n: s for n, s in r["systems"].items() if s["status"] == "ok"}
    fig, ax = plt.subplots(figsize=(10, 5.5))
    names = list(ok)
    med = [ok[n]["tokens_per_s"]["median"] for n in names]
    err = [[m - ok[n]["tokens_per_s"]["min"] for n, m in zip(names, med)],
           [ok[n]["tokens_per_s"]["max"] - m for n, m in zip(names, med)]]
    colors = ["tab:green" if n.startswith("edgespec") else "tab:blue" if "GenAI" in n else
              "tab:purple" if n.startswith("llama.cpp") else "tab:orange" for n in names]
    ax.barh([f"{n}\n{ok[n].get('config', '')}" for n in names], med, xerr=err, color=colors)
    ax.axvline(r["roofline"]["roofline_tokens_per_s"], color="grey", ls="--", lw=1, label="plain-decode roofline")
    ax.invert_yaxis()
    ax.tick_params(axis="y", labelsize=7)
    ax.set_xlabel("tokens/s (median over repeats; bars: min–max); each mode at its best swept configuration")
    bvb = "; ".join(f"vs {b['peer_system']} {b['ratio']:.2f}×" for b in r.get("best_vs_best", []))
    ax.set_title(f"Bundled pair, {r.get('machine', {}).get('cores', '?')}-core CPU, one run"
                 + (f"\nedgespec best vs each peer's best: {bvb}" if bvb else ""), fontsize=10)
    ax.legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    raise SystemExit(main())
