"""One GPU run that checks and measures every GPU path against the CPU, written to one JSON.

    python tools/device/device_check.py --out bench/results/device.json [--only cpu,cuda,tensorrt,native]
                                        [--no-vla] [--setup .venv-device/setup.json]

(run through tools/device/device_check.sh on a fresh machine: tools/device/device_setup.py installs the packages
and picks the paths that can run; --setup puts its record, with the reason for each path left out, in the report.)

Paths: cpu (ONNX Runtime CPU, fp32 target + int8 draft: the shipped CPU pair), cuda (ORT CUDA EP),
tensorrt (ORT TensorRT EP, explicit profiles + engine cache), native (edgespec.backends.trt: a TensorRT plan through
TensorRT's API, double-buffered cache, CUDA graphs). GPU paths run the fp16 exports in engines/device/.
Per path: (a) parity vs CPU fp32, teacher-forced over held-out code prompts (top-1 agreement, max |logit
diff|, mean KL); (b) greedy speculative output == plain; (c) tokens/s plain and speculative (γ = 4);
(d) host share of decoding (stats.host_fraction); (e) VLA decode ms plain / exact speculative (draft head)
and whether the actions are identical. Each path is wrapped: a failure records its error and the rest runs.
The JSON is rewritten after every step, so a run cut short keeps what it measured. No number is made up:
what was not measured is absent or carries its error.
"""
from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
import time
import traceback
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench" / "lib"))  # prompts.py, as the benches import it

import edgespec  # noqa: E402
from edgespec import contract as C  # noqa: E402
from edgespec import policy_contract as PC  # noqa: E402

PATHS = ("cpu", "cuda", "tensorrt", "native")
PROVIDER = {"cpu": "cpu", "cuda": "cuda", "tensorrt": "tensorrt-ep", "native": "tensorrt-native"}  # load / load_policy
MODELS, ENGINES = ROOT / "models", ROOT / "engines"
DEV = ENGINES / "device"
GAMMA = 4
VLA_GAMMA_MAX = 16  # the draft head's γ = 15: verify calls of S = 16 stay in a graph-captured profile


def err(e: BaseException) -> dict:
    return {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc(limit=4)}


class Report:
    def __init__(self, path: Path):
        self.path, self.data = path, {"command": " ".join([sys.executable] + sys.argv), "started": time.time()}
        path.parent.mkdir(parents=True, exist_ok=True)

    def step(self, keys: tuple, fn):
        """data[k0][k1]... = fn(), or its error; print and save either way."""
        t0 = time.time()
        try:
            val = fn()
        except Exception as e:  # noqa: BLE001 - one failing path must not stop the others
            val = err(e)
            print(f"!! {'/'.join(keys)}: {val['error']}", file=sys.stderr)
        node = self.data
        for k in keys[:-1]:
            node = node.setdefault(k, {})
        if isinstance(val, dict):
            val = {**val, "seconds": round(time.time() - t0, 1)}
        node[keys[-1]] = val
        self.path.write_text(json.dumps(self.data, indent=1, default=str) + "\n")
        print(f"-- {'/'.join(keys)} ({time.time() - t0:.0f}s)", flush=True)
        return val


# -- environment and engines --------------------------------------------------------------------------------

def versions() -> dict:
    out = {"python": platform.python_version(), "numpy": np.__version__, "edgespec": edgespec.__version__}
    try:
        import onnxruntime as ort
        out["onnxruntime"], out["ort_providers"] = ort.__version__, ort.get_available_providers()
    except Exception as e:  # noqa: BLE001
        out["onnxruntime"] = repr(e)
    for mod in ("tensorrt", "torch"):
        try:
            out[mod] = __import__(mod).__version__
        except Exception as e:  # noqa: BLE001
            out[mod] = f"not importable: {e}"
    from edgespec.cuda import device_info, gpu_available
    out["gpu_available"] = gpu_available()
    if out["gpu_available"][0]:
        out["gpu"] = device_info(0)
    try:
        out["nvidia_smi"] = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total",
                                            "--format=csv,noheader"], capture_output=True, text=True,
                                           timeout=20).stdout.strip()
    except Exception as e:  # noqa: BLE001
        out["nvidia_smi"] = repr(e)
    return out


def native_profiles(m: C.Manifest, gamma_max: int = 8):
    """default_profiles, tuned for P = max_context: the native decoder always binds the full cache."""
    from edgespec.export.tensorrt import default_profiles
    return default_profiles(m.max_context, gamma_max, prefill_max=min(512, m.max_context), opt_rows=m.max_context)


def ensure_plan(d: Path, gamma_max: int = 8) -> str:
    """Build d/model.plan unless one from this TensorRT version is there."""
    import tensorrt as trt

    from edgespec.export.tensorrt import build_engine
    m = C.Manifest.read(d)
    info = m.extra.get("tensorrt") or {}
    if (d / info.get("plan", "model.plan")).is_file() and info.get("tensorrt_version") == trt.__version__:
        return "reused"
    t0 = time.time()
    build_engine(d, native_profiles(m, gamma_max), fp16=True)
    return f"built in {time.time() - t0:.0f}s"


def prepare(vla: bool, plans_wanted: bool = True) -> dict:
    """Exports first (CPU work), then plans; each item records its own error, so a machine without
    TensorRT still gets every export and the ORT paths still run."""
    from edgespec.export.bundled import ensure_demo_engines, ensure_policy_engines
    out, plans = {}, []

    def item(name, fn):
        try:
            out[name] = fn()
        except Exception as e:  # noqa: BLE001
            out[name] = err(e)
            print(f"!! prepare/{name}: {out[name]['error']}", file=sys.stderr)

    def export_fp16(name):
        from edgespec.export.onnx_export import export_engine
        d = DEV / f"{name}-fp16"
        if (d / "engine.json").is_file():
            return "reused"
        t0 = time.time()
        export_engine(MODELS / name, d, dtype="fp16", max_context=2048, progress=False,
                      role="draft" if name.endswith("draft") else "target")
        return f"exported in {time.time() - t0:.0f}s"

    def export_vla_fp16():
        from edgespec.export.vla import export_policy
        d = DEV / "vla-reacher-fp16"
        if (d / PC.POLICY_FILE).is_file():
            return "reused"
        export_policy(MODELS / "vla-reacher", d, dtype="fp16", progress=False)
        return "exported"

    item("cpu_pair", lambda: [str(p) for p in ensure_demo_engines(MODELS, ENGINES)])  # fp32 target, int8 draft
    for name in ("demo-target", "demo-draft"):
        item(f"export {name}-fp16", lambda name=name: export_fp16(name))
        plans.append((DEV / f"{name}-fp16", 8))
    if vla:
        item("vla_cpu", lambda: str(ensure_policy_engines(MODELS, ENGINES)))
        item("export vla-reacher-fp16", export_vla_fp16)
        plans += [(DEV / "vla-reacher-fp16" / sub, VLA_GAMMA_MAX) for sub in ("target", "draft")]
    for d, gmax in plans if plans_wanted else []:  # only the native path reads the plans
        if (d / "engine.json").is_file():
            item(f"plan {d.relative_to(DEV)}", lambda d=d, gmax=gmax: ensure_plan(d, gmax))
    return out


def pair_dirs(path: str) -> tuple[Path, Path]:
    if path == "cpu":
        return ENGINES / "demo-target", ENGINES / "demo-draft"
    return DEV / "demo-target-fp16", DEV / "demo-draft-fp16"


# -- engines and generators per path ------------------------------------------------------------------------

def ort_engine(d: Path, path: str):
    from edgespec.backends.ort import OrtEngine
    if path == "tensorrt":
        from edgespec.export.tensorrt import default_profiles, ort_trt_options
        m = C.Manifest.read(d)
        return OrtEngine(d, provider="tensorrt",
                         provider_options=ort_trt_options(m, d, default_profiles(m.max_context)))
    return OrtEngine(d, provider=PROVIDER[path])


def decoder(d: Path, path: str):
    if path == "native":
        from edgespec.backends.trt import TrtDecoder, TrtEngine
        return TrtDecoder(TrtEngine(d))
    from edgespec.backends.ort import OrtDecoder as Decoder
    return Decoder(ort_engine(d, path))


def generators(path: str) -> tuple[object, object, str]:
    """(plain, speculative γ=4) Generators for a path, and how they were built."""
    from edgespec.generate import Generator
    from edgespec.tokenizer import TextTokenizer
    tdir, ddir = pair_dirs(path)
    if path == "native":  # the runtime's own entry point: open_engine -> TrtEngine, engine.decoder() -> TrtDecoder
        return (edgespec.load(tdir, provider="tensorrt-native"),
                edgespec.load(tdir, draft=ddir, provider="tensorrt-native", gamma=GAMMA), "edgespec.load")
    tgt, dft = ort_engine(tdir, path), ort_engine(ddir, path)
    tok = TextTokenizer.from_engine(tgt.dir, tgt.manifest)
    return Generator(tgt, None, None, tok, 0), Generator(tgt, "model", dft, tok, GAMMA), "Generator(OrtEngine)"


# -- measurements -------------------------------------------------------------------------------------------

def prompts_ids(n: int, context: int) -> list[list[int]]:
    from prompts import code_prompts
    from edgespec.tokenizer import TextTokenizer
    m = C.Manifest.read(ENGINES / "demo-target")
    tok = TextTokenizer.from_engine(ENGINES / "demo-target", m)
    return [tok.encode(p) for p in code_prompts(tok, n, context)]


def parity(path: str, seqs: list[list[int]]) -> dict:
    """Teacher-forced: CPU fp32 logits of each whole sequence in one call vs the path's, which prefills the
    first half and feeds the rest one token at a time (decode path, graphs on native)."""
    ref = decoder(ENGINES / "demo-target", "cpu")
    dec = decoder(pair_dirs(path)[0], path)
    agree = total = 0
    max_diff, kl = 0.0, []
    for ids in seqs:
        x = np.asarray(ids, np.int64)[None]
        ref.cache.rewind_to(0)
        want = ref(x)[0]  # (T, V) fp32 CPU
        dec.cache.rewind_to(0)
        h = len(ids) // 2
        got = [dec(x[:, :h])[0]]
        dec.cache.commit(h)
        for t in range(h, len(ids)):
            got.append(dec(x[:, t:t + 1])[0])
            dec.cache.commit(1)
        got = np.concatenate(got)  # (T, V)
        agree += int((got.argmax(-1) == want.argmax(-1)).sum())
        total += len(ids)
        max_diff = max(max_diff, float(np.abs(got - want).max()))
        p = np.exp(want - want.max(-1, keepdims=True))
        p /= p.sum(-1, keepdims=True)
        lq = got - got.max(-1, keepdims=True)
        lq -= np.log(np.exp(lq).sum(-1, keepdims=True))
        lp = np.log(np.clip(p, 1e-30, None))
        kl.append(float((p * (lp - lq)).sum(-1).mean()))
    out = {"tokens": total, "top1_agreement": agree / total, "max_abs_logit_diff": max_diff,
           "mean_kl": float(np.mean(kl)), "reference": "cpu fp32 engines/demo-target"}
    if path == "native":
        out["graph_fallback_reason"] = dec.graph_fallback_reason
    return out


def text_speed(path: str, seqs: list[list[int]], max_new: int) -> dict:
    plain, spec, built = generators(path)
    plain.generate(seqs[0], max_new_tokens=16)  # warm every shape (graph captures happen here)
    spec.generate(seqs[0], max_new_tokens=16)
    res = {"built_with": built, "gamma": GAMMA, "prompts": len(seqs), "max_new_tokens": max_new}
    same = 0
    for name, gen in (("plain", plain), ("speculative", spec)):
        dec_s = eng_s = 0.0
        new = acc = drafted = calls = 0
        outs = []
        for ids in seqs:
            r = gen.generate(ids, max_new_tokens=max_new)
            st = r.stats
            outs.append(r.token_ids)
            dec_s += st.time_s["decode"]
            eng_s += st.engine_s
            new += st.new_tokens  # as Stats.tokens_per_second counts them
            acc, drafted, calls = acc + st.accepted, drafted + st.drafted, calls + st.target_calls
        res[name] = {"tokens_per_s": new / dec_s if dec_s else None, "new_tokens": new, "decode_s": dec_s,
                     "host_fraction": 1 - eng_s / dec_s if dec_s else None}
        if name == "speculative":
            res[name].update(acceptance=acc / drafted if drafted else None, tokens_per_round=(new / calls)
                             if calls else None)  # per target call
            same = sum(a == b for a, b in zip(outs, res["_plain_outs"]))
        else:
            res["_plain_outs"] = outs
    res.pop("_plain_outs")
    res["speculative_identical_to_plain"] = f"{same}/{len(seqs)}"
    res["speedup"] = (res["speculative"]["tokens_per_s"] / res["plain"]["tokens_per_s"]
                      if res["plain"]["tokens_per_s"] else None)
    return res


def vla(path: str, n_obs: int) -> dict:
    d = ENGINES / "vla-reacher" if path == "cpu" else DEV / "vla-reacher-fp16"
    plain = edgespec.load_policy(d, provider=PROVIDER[path])
    spec = edgespec.load_policy(d, draft="head", provider=PROVIDER[path])
    rng = np.random.default_rng(0)
    words = ["reach the red target", "go to the blue target", "touch the green target"]
    obs = [(rng.integers(0, 256, (plain.image_size, plain.image_size, 3), dtype=np.uint8),
            rng.normal(0, 1, plain.state_dim), words[i % 3]) for i in range(n_obs)]
    for pol in (plain, spec):
        pol.act(*obs[0])  # warm
    ms = {"plain": [], "speculative": []}
    same = 0
    for o in obs:
        a = plain.act(*o)
        ms["plain"].append(plain.last_info["decode_ms"])
        b = spec.act(*o)
        ms["speculative"].append(spec.last_info["decode_ms"])
        same += bool(np.array_equal(a, b))
    return {"policy": str(d), "observations": n_obs, "decode_ms_plain_median": float(np.median(ms["plain"])),
            "decode_ms_speculative_median": float(np.median(ms["speculative"])),
            "speedup": float(np.median(ms["plain"]) / np.median(ms["speculative"])),
            "actions_identical": f"{same}/{n_obs}"}


# -- summary ------------------------------------------------------------------------------------------------

def summary(data: dict, paths) -> str:
    def g(d, *ks, fmt="{:.3g}"):
        for k in ks:
            if not isinstance(d, dict) or k not in d:
                return "err" if isinstance(d, dict) and "error" in d else "-"
            d = d[k]
        return fmt.format(d) if isinstance(d, (int, float)) and not isinstance(d, bool) else str(d)
    head = f"{'path':<9}{'top1':>7}{'max|dl|':>9}{'plain t/s':>11}{'spec t/s':>10}{'x':>6}{'same':>7}" \
           f"{'host%':>7}{'vla ms':>8}{'vla spec':>9}{'same':>7}"
    rows = [head, "-" * len(head)]
    for p in paths:
        r = data.get("paths", {}).get(p, {})
        if "unavailable" in r:
            rows.append(f"{p:<9}unavailable: {r['unavailable']}")
            continue
        host = r.get("text", {}).get("speculative", {}).get("host_fraction") if isinstance(r.get("text"), dict) else None
        rows.append(f"{p:<9}{g(r, 'parity', 'top1_agreement'):>7}{g(r, 'parity', 'max_abs_logit_diff'):>9}"
                    f"{g(r, 'text', 'plain', 'tokens_per_s'):>11}{g(r, 'text', 'speculative', 'tokens_per_s'):>10}"
                    f"{g(r, 'text', 'speedup'):>6}{g(r, 'text', 'speculative_identical_to_plain'):>7}"
                    f"{(f'{100 * host:.0f}' if isinstance(host, float) else '-'):>7}"
                    f"{g(r, 'vla', 'decode_ms_plain_median'):>8}{g(r, 'vla', 'decode_ms_speculative_median'):>9}"
                    f"{g(r, 'vla', 'actions_identical'):>7}")
    errors = [f"{p}/{k}: {v['error']}" for p in paths for k, v in data.get("paths", {}).get(p, {}).items()
              if isinstance(v, dict) and "error" in v]
    return "\n".join(rows + ([""] + errors if errors else []))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=ROOT / "bench/results/device.json")
    ap.add_argument("--only", default=",".join(PATHS), help=f"comma-separated subset of {PATHS}")
    ap.add_argument("--prompts", type=int, default=12)
    ap.add_argument("--context", type=int, default=128, help="prompt tokens (parity is over these)")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--vla-obs", type=int, default=20)
    ap.add_argument("--no-vla", action="store_true")
    ap.add_argument("--setup", type=Path, help="device_setup.py's record (VENV/setup.json)")
    args = ap.parse_args(argv)
    paths = [p for p in args.only.split(",") if p]
    bad = [p for p in paths if p not in PATHS]
    if bad:
        ap.error(f"unknown paths {bad}; choose from {PATHS}")
    try:
        import onnxruntime as ort
        if hasattr(ort, "preload_dlls"):
            ort.preload_dlls()  # CUDA / cuDNN from the nvidia-* wheels of onnxruntime-gpu[cuda,cudnn]
    except Exception as e:  # noqa: BLE001
        print(f"onnxruntime preload_dlls: {e}", file=sys.stderr)
    rep = Report(args.out)
    try:  # cuda_check.py's record (device_check.sh runs it first, into the same file): kept
        rep.data["cuda_native"] = json.loads(args.out.read_text())["cuda_native"]
    except (OSError, ValueError, KeyError):
        pass
    if args.setup:
        setup = json.loads(args.setup.read_text())
        rep.data["setup"] = setup
        for p in PATHS:
            why = setup.get("paths", {}).get(p, "runs")
            if p not in paths and why != "runs":
                rep.data.setdefault("paths", {})[p] = {"unavailable": why}
    v = rep.step(("versions",), versions)
    print(json.dumps(v, indent=1, default=str))
    rep.step(("prepare",), lambda: prepare(not args.no_vla, "native" in paths))
    seqs = prompts_ids(args.prompts, args.context)
    for p in paths:
        if p != "cpu":
            rep.step(("paths", p, "parity"), lambda p=p: parity(p, seqs))
        rep.step(("paths", p, "text"), lambda p=p: text_speed(p, seqs, args.max_new_tokens))
        if args.no_vla:
            continue
        rep.step(("paths", p, "vla"), lambda p=p: vla(p, args.vla_obs))
    rep.data["finished"] = time.time()
    rep.path.write_text(json.dumps(rep.data, indent=1, default=str) + "\n")
    print("\n" + summary(rep.data, [p for p in PATHS if p in paths or p in rep.data.get("paths", {})]))
    print(f"\nwrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
