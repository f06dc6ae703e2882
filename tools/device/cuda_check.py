#!/usr/bin/env python3
"""The GPU check of provider cuda-native: what the GPU machine's image has (CUDA with nvcc, PyTorch, numpy,
safetensors, tokenizers) and this checkout without the bundled target's weights (docs/gpu.md, "a check that
fits"). It makes its models where it runs, in seconds, from the bundled demo draft (2.6M parameters, trained):

    bundled     the demo draft as a target; its draft: the same weights times (1 + 0.2 N(0, 1)), seeded
    <preset>    export/standin.py's real-size shapes (qwen2.5-0.5b, llama-3.2-1b, llama-3.2-3b): the target is the
                demo draft inflated to the preset's target shape (the same function at a real model's bytes), the
                draft the noisy copy inflated to the preset's draft shape, 10-30x smaller

so acceptance is what a 0.2 relative perturbation of the weights leaves (about 0.7 at γ = 4 on the CPU), not a
trained pair's; the bytes and the matrix shapes are a real model's. Native weights are built in memory
(export/native.py's in_memory_engine_folder): no ONNX export, nothing large written but the stand-ins' safetensors.

Per model, in one run: (a) parity of cuda-native against cpu-native (float32 arithmetic, the same float16
weights: CPU fp32) teacher-forced on held-out code prompts: top-1 agreement and max |logit difference|;
(b) greedy speculative output identical to plain on the device; (c) tokens/s of plain decoding on cuda-native
with and without CUDA graphs, speculative (γ = 4) with the draft on cuda-native and on cpu-native, and plain
decoding in PyTorch float16 eager and with CUDA graphs over the same weights (bench/lib/torch_llama.py);
(d) the share of decoding spent outside the kernels (the decoders' CUDA-event kernel time against the wall time),
and a decode and a verify call timed kernel by kernel (CudaNativeDecoder.profile: where a call's time goes);
(e) the memory roofline: weight bytes per token x tokens/s against a device-to-device copy's bandwidth.
Every step is wrapped: a failure records its error and the rest runs; the JSON is rewritten after each step.

    python3 tools/device/cuda_check.py --out $OUT/cuda_check.json [--models bundled,qwen2.5-0.5b,llama-3.2-1b]
    python3 tools/device/cuda_check.py --smoke --lib LIB.so --out x.json   # the CPU: a tiny model through a
                                                                           # build of cuda_step.cu (the tests)
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench" / "lib"))
import edgespec  # noqa: E402

try:
    import edgespec.export  # noqa: F401  (an installed checkout)
except ImportError:  # a bare checkout: edgespec.export is export/, edgespec.robots is robots/
    edgespec.__path__.append(str(ROOT))

DRAFT_NOISE = 0.2  # the draft's weights: w (1 + DRAFT_NOISE N(0, 1)), float16
GAMMA = 4
NEW_TOKENS = 128
MAX_CONTEXT = 1024


def err(e: BaseException) -> dict:
    return {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc(limit=6)}


class Report:
    """The check's record, written to `path` after every step; with `key`, as that key of path's JSON (the other
    keys kept: device_check.sh's one device.json)."""

    def __init__(self, path: Path, key: str | None = None):
        self.path, self.key = path, key
        self.data = {"command": " ".join([sys.executable] + sys.argv), "started": time.time()}
        path.parent.mkdir(parents=True, exist_ok=True)

    def save(self) -> None:
        doc = self.data
        if self.key:
            try:
                doc = json.loads(self.path.read_text())
            except (OSError, ValueError):
                doc = {}
            doc[self.key] = self.data
        self.path.write_text(json.dumps(doc, indent=1, default=str) + "\n")

    def step(self, keys: tuple, fn):
        """data[k0][k1]... = fn(), or its error; saved either way."""
        t0 = time.time()
        try:
            val = fn()
        except Exception as e:  # noqa: BLE001 - one failing step must not stop the others
            val = err(e)
            print(f"!! {'/'.join(keys)}: {val['error']}", file=sys.stderr, flush=True)
        node = self.data
        for k in keys[:-1]:
            node = node.setdefault(k, {})
        if isinstance(val, dict):
            val = {**val, "seconds": round(time.time() - t0, 2)}
        node[keys[-1]] = val
        self.save()
        print(f"-- {'/'.join(keys)} ({time.time() - t0:.1f}s)", flush=True)
        return val


# -- the machine ---------------------------------------------------------------------------------------------

def environment(device: str) -> dict:
    import torch
    out = {"python": platform.python_version(), "numpy": np.__version__, "torch": torch.__version__,
           "edgespec": edgespec.__version__, "machine": platform.machine(), "cpus": os.cpu_count()}
    if device == "cuda":
        p = torch.cuda.get_device_properties(0)
        out.update(gpu=p.name, compute=f"{p.major}.{p.minor}", gpu_memory=p.total_memory,
                   multiprocessors=p.multi_processor_count)
    for cmd in (["nvidia-smi", "--query-gpu=driver_version,clocks.max.sm,clocks.max.mem", "--format=csv,noheader"],
                ["nvcc", "--version"]):
        if shutil.which(cmd[0]):
            r = subprocess.run(cmd, capture_output=True, text=True)
            out[cmd[0]] = (r.stdout.strip().splitlines() or [""])[-1]
    return out


def bandwidth(device: str) -> dict:
    """A device-to-device copy of 1 GiB (bytes read + written per second): the roofline's bandwidth."""
    import torch
    if device != "cuda":
        return {"skipped": "no GPU"}
    a = torch.empty(1 << 28, dtype=torch.float32, device="cuda")
    b = torch.empty_like(a)
    for _ in range(3):
        b.copy_(a)
    torch.cuda.synchronize()
    best = 1e9
    for _ in range(10):
        t0 = time.perf_counter()
        b.copy_(a)
        torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t0)
    return {"bytes_per_s": 2 * a.numel() * 4 / best, "how": "best of 10 copies of 1 GiB, read + written"}


# -- models, made here ---------------------------------------------------------------------------------------

def noisy_copy(src: Path, dst: Path, seed: int = 0) -> Path:
    """src's checkpoint with every matrix times (1 + DRAFT_NOISE N(0, 1)), float16, into dst."""
    from safetensors.numpy import load_file, save_file
    dst.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.is_file() and f.suffix in (".json",):
            shutil.copy2(f, dst / f.name)
    rng = np.random.default_rng(seed)
    w = load_file(str(src / "model.safetensors"))
    out = {k: (v.astype(np.float32) * (1 + DRAFT_NOISE * rng.standard_normal(v.shape, np.float32))).astype(np.float16).astype(v.dtype)
           if v.ndim == 2 else v for k, v in w.items()}
    save_file(out, str(dst / "model.safetensors"))
    return dst


def make_models(name: str, source: Path, work: Path) -> dict:
    """{'target': dir, 'draft': dir, ...} for model `name` (the module docstring)."""
    draft_src = noisy_copy(source, work / "noisy-source")
    if name in ("bundled", "tiny"):
        return {"target": str(source), "draft": str(draft_src), "made_s": 0.0}
    from edgespec.export.standin import PRESETS, make_standin
    preset = PRESETS[name]
    t0 = time.perf_counter()
    tgt = make_standin(source, work / name / "target", preset.target, seed=0, progress=False)
    dft = make_standin(draft_src, work / name / "draft", preset.draft, seed=1, progress=False)
    return {"target": str(work / name / "target"), "draft": str(work / name / "draft"),
            "target_params": tgt.get("params"), "draft_params": dft.get("params"),
            "made_s": round(time.perf_counter() - t0, 1)}


def engines(dirs: dict, rt, cpu_too: bool) -> dict:
    """In-memory native folders of the target and the draft, on cuda-native (and the target on cpu-native)."""
    from edgespec.backends.cuda_native import CudaNativeEngine
    from edgespec.backends.native import NativeEngine
    from edgespec.export.checkpoint import load_checkpoint
    from edgespec.export.native import in_memory_engine_folder
    out = {}
    for role in ("target", "draft"):
        spec, w = load_checkpoint(Path(dirs[role]), dtype=None)
        folder = in_memory_engine_folder(spec, w, MAX_CONTEXT)
        del w
        out[role] = CudaNativeEngine(None, rt=rt, folder=folder)
        if role == "draft" or cpu_too:
            out[f"{role}_cpu"] = NativeEngine(None, folder=folder)
        out[f"{role}_bytes"] = int(sum(a.nbytes for k, a in folder.arrays.items() if k != "embed")
                                   + folder.arrays["embed"].nbytes // folder.arrays["embed"].shape[0])
    return out


def prompts(tokenizer_dir: Path, n: int, context: int) -> list[list[int]]:
    from tokenizers import Tokenizer

    from prompts import code_prompts
    tok = Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json"))
    return [tok.encode(p).ids[-context:] for p in code_prompts(tok, n=n, context=context)][:n]


# -- the measurements ----------------------------------------------------------------------------------------

def parity(e: dict, seqs: list[list[int]]) -> dict:
    """Teacher-forced: each prompt in one call from an empty cache on cuda-native and cpu-native."""
    gpu, cpu = e["target"].decoder(), e["target_cpu"].decoder()
    agree = total = 0
    diff = scale = 0.0
    for s in seqs:
        ids = np.array([s], np.int64)
        a, b = gpu(ids), cpu(ids)
        diff, scale = max(diff, float(np.abs(a - b).max())), max(scale, float(np.abs(b).max()))
        agree += int((gpu.last_ids() == cpu.last_ids()).sum())
        total += len(s)
        gpu.reset(), cpu.reset()
    return {"top1_agreement": agree / total, "rows": total, "max_logit_diff": diff, "max_abs_logit": scale,
            "against": "cpu-native (float32 arithmetic over the same float16 weights)"}


def generator(e: dict, draft: str | None):
    from edgespec.generate import Generator
    if draft is None:
        return Generator(e["target"])
    return Generator(e["target"], "model", e["draft" if draft == "gpu" else "draft_cpu"], None, gamma=GAMMA)


def spec_equals_plain(e: dict, seqs: list[list[int]], n: int) -> dict:
    plain, spec = generator(e, None), generator(e, "gpu")
    same = [plain.generate(s, max_new_tokens=n).token_ids == spec.generate(s, max_new_tokens=n).token_ids
            for s in seqs]
    return {"identical": all(same), "prompts": len(same), "new_tokens": n}


def decode_speed(e: dict, seqs: list[list[int]], n: int) -> dict:
    """tokens/s per mode (new tokens / decode seconds, summed over the prompts), the modes interleaved prompt by
    prompt; the share of decoding outside the kernels from the engines' CUDA-event kernel times."""
    modes = {"plain": (None, True), "plain_no_graphs": (None, False), "speculative": ("gpu", True),
             "speculative_draft_on_cpu": ("cpu", True)}
    gens = {k: generator(e, d) for k, (d, _) in modes.items()}
    tok, sec, kern = dict.fromkeys(modes, 0), dict.fromkeys(modes, 0.0), dict.fromkeys(modes, 0.0)
    acc = {"drafted": 0, "accepted": 0}
    for g in gens.values():  # warm-up: graphs captured, the library's first calls
        g.generate(seqs[0], max_new_tokens=8)
    gpu = (e["target"], e["draft"])
    for s in seqs:
        for k, (_, graphs) in modes.items():
            for eng in gpu:
                eng.use_graphs = graphs
            k0 = sum(eng.kernel_s for eng in gpu)
            r = gens[k].generate(s, max_new_tokens=n)
            kern[k] += sum(eng.kernel_s for eng in gpu) - k0
            tok[k] += len(r.token_ids)
            sec[k] += r.stats.time_s["decode"]
            if k == "speculative":
                acc["drafted"] += r.stats.drafted
                acc["accepted"] += r.stats.accepted
    for eng in gpu:
        eng.use_graphs = True
    out = {k: {"tokens_per_s": tok[k] / sec[k], "decode_s": sec[k], "tokens": tok[k],
               "outside_kernels_share": max(0.0, 1 - kern[k] / sec[k]) if kern[k] > 0 else None}
           for k in modes}
    out["speculative"]["acceptance"] = acc["accepted"] / max(acc["drafted"], 1)
    out["speculative"]["gamma"] = GAMMA
    out["note"] = ("outside_kernels_share: 1 - (kernel time of every cuda-native call, prefill included) / decode "
                   "wall time, so an upper bound of the kernels' share of the decode")
    return out


def kernel_profile(e: dict, seqs: list[list[int]]) -> dict:
    """After a prompt, one decode call (S = 1) and one verify call (S = γ + 1) run with an event after every
    kernel (CudaNativeDecoder.profile): the GPU ms of each kernel kind, where a call's time goes."""
    dec = e["target"].decoder()
    dec.ids(np.array([seqs[0]], np.int64))
    dec.cache.commit(len(seqs[0]))
    out = {}
    for s in (1, GAMMA + 1):
        prof = dec.profile(np.ones((1, s), np.int64))
        out[f"S={s}"] = {"by_kind": prof, "total_ms": sum(v["ms"] for v in prof.values())}
    return out


def torch_speed(target_dir: str, seqs: list[list[int]], n: int, device: str) -> dict:
    import torch

    from torch_llama import TorchLlama
    m = TorchLlama(target_dir, device, max_context=MAX_CONTEXT, dtype=torch.float16 if device == "cuda" else torch.float32)
    out = {}
    for mode, graphs in (("torch_eager", False), ("torch_cuda_graphs", True)):
        if graphs and device != "cuda":
            out[mode] = {"skipped": "no GPU"}
            continue
        m.greedy(seqs[0], 8, graphs=graphs)  # warm-up (and the graph's capture)
        tok, sec = 0, 0.0
        for s in seqs:
            ids = m.greedy(s, n, graphs=graphs)
            tok, sec = tok + len(ids) - 1, sec + m.last_s
        out[mode] = {"tokens_per_s": tok / sec, "decode_s": sec, "tokens": tok}
    out["weight_bytes"] = m.weight_bytes
    return out


def export_vla(source: Path, work: Path) -> dict:
    """The bundled reacher policy exported here (ONNX encoder, decoders with native weights: seconds)."""
    from edgespec.export.vla import export_policy
    out = work / "vla-reacher"
    if not (out / "policy.json").is_file():
        export_policy(source, out, progress=False)
    return {"policy": str(out)}


def vla(policy_dir: Path, n_obs: int) -> dict:
    """VLA decode ms per chunk on cuda-native: plain, exact speculative with the draft head and with the draft
    decoder; actions identical to plain."""
    plain = edgespec.load_policy(policy_dir, provider="cuda-native")
    drafts = {"head": edgespec.load_policy(policy_dir, draft="head", provider="cuda-native"),
              "decoder": edgespec.load_policy(policy_dir, draft=True, provider="cuda-native")}
    rng = np.random.default_rng(0)
    words = ["reach the red target", "go to the blue target", "touch the green target"]
    obs = [(rng.integers(0, 256, (plain.image_size, plain.image_size, 3), dtype=np.uint8),
            rng.normal(0, 1, plain.state_dim), words[i % 3]) for i in range(n_obs)]
    for pol in (plain, *drafts.values()):
        pol.act(*obs[0])  # warm: graphs captured
    ms = {"plain": [], **{k: [] for k in drafts}}
    same = dict.fromkeys(drafts, 0)
    for o in obs:
        a = plain.act(*o)
        ms["plain"].append(plain.last_info["decode_ms"])
        for k, pol in drafts.items():
            b = pol.act(*o)
            ms[k].append(pol.last_info["decode_ms"])
            same[k] += bool(np.array_equal(a, b))
    med = {k: float(np.median(v)) for k, v in ms.items()}
    return {"observations": n_obs, "decode_ms_median": med,
            "speedup": {k: med["plain"] / med[k] for k in drafts},
            "actions_identical": {k: f"{same[k]}/{n_obs}" for k in drafts}}


# -- the run -------------------------------------------------------------------------------------------------

def open_runtime(lib: Path | None, work: Path, data: dict):
    """cuda-native's runtime: `lib` (a build of cuda_step.cu) loaded, else the library compiled here on first use
    (into work/cache, so the compile is timed: data["build_s"]). The tests put a stand-in here."""
    from edgespec.backends import cuda_lib
    if lib is not None:
        return cuda_lib.CudaRuntime(lib=cuda_lib.load(lib))
    os.environ.setdefault("EDGESPEC_CACHE", str(work / "cache"))
    t = time.perf_counter()
    rt = cuda_lib.CudaRuntime()
    data["build_s"] = round(time.perf_counter() - t, 1)
    return rt


def summary(data: dict) -> str:
    lines = [f"cuda-native check: {data.get('environment', {}).get('gpu', 'no GPU')}"]
    bw = data.get("bandwidth", {}).get("bytes_per_s")
    for name, r in data.get("models", {}).items():
        sp, tt, par = r.get("speed", {}), r.get("torch", {}), r.get("parity", {})
        g = lambda d, k: d.get(k, {}).get("tokens_per_s") if isinstance(d.get(k), dict) else None  # noqa: E731
        plain, eager, graphs, spec = g(sp, "plain"), g(tt, "torch_eager"), g(tt, "torch_cuda_graphs"), g(sp, "speculative")
        lines.append(f"{name}: parity top-1 {par.get('top1_agreement', '?')}, max diff {par.get('max_logit_diff', '?')}; "
                     f"spec==plain {r.get('spec_equals_plain', {}).get('identical', '?')}")
        if plain:
            f = lambda v: f"{v:.1f}" if v else "n/a"  # noqa: E731
            row = f"  tok/s plain {f(plain)} (no graphs {f(g(sp, 'plain_no_graphs'))}), spec {f(spec)}"
            row += f" (draft on cpu {f(g(sp, 'speculative_draft_on_cpu'))}), torch eager {f(eager)}"
            row += f", torch graphs {f(graphs)}"
            lines.append(row)
            ratios = []
            if eager:
                ratios.append(f"plain/eager {plain / eager:.2f}x")
            if graphs:
                ratios.append(f"plain/torch-graphs {plain / graphs:.2f}x")
            if spec:
                ratios.append(f"spec/plain {spec / plain:.2f}x (acceptance {sp['speculative'].get('acceptance', 0):.2f})")
            outside = sp.get("plain", {}).get("outside_kernels_share")
            if outside is not None:
                ratios.append(f"outside kernels {100 * outside:.0f}%")
            if bw and r.get("weight_bytes"):
                ratios.append(f"roofline {100 * r['weight_bytes'] * plain / bw:.0f}%")
            lines.append("  " + ", ".join(ratios))
        kp = r.get("kernels", {}).get("S=1", {})
        if kp.get("by_kind"):
            top = sorted(kp["by_kind"].items(), key=lambda kv: -kv[1]["ms"])
            lines.append(f"  S=1 kernels {kp['total_ms']:.3f} ms: " + ", ".join(
                f"{k} {v['ms']:.3f} ({v['kernels']})" for k, v in top[:5]))
    v = data.get("vla", {})
    if "decode_ms_median" in v:
        lines.append(f"vla: decode ms plain {v['decode_ms_median']['plain']:.2f}, " + ", ".join(
            f"{k} {v['decode_ms_median'][k]:.2f} ({v['speedup'][k]:.2f}x, identical {v['actions_identical'][k]})"
            for k in v["speedup"]))
    elif v:
        lines.append(f"vla: {v.get('error') or v.get('skipped')}")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "cuda_check.json")
    ap.add_argument("--key", default=None, help="write the record as this key of --out's JSON, keeping the others")
    ap.add_argument("--models", default="bundled,qwen2.5-0.5b,llama-3.2-1b")
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--new-tokens", type=int, default=NEW_TOKENS)
    ap.add_argument("--budget-s", type=float, default=300, help="start no model after this many seconds")
    ap.add_argument("--work", type=Path, default=None, help="where the stand-ins are made (default: a temp dir)")
    ap.add_argument("--smoke", action="store_true", help="CPU: a tiny model, few tokens, --lib's build (tests)")
    ap.add_argument("--lib", type=Path, default=None, help="a built cuda_step library to load instead of nvcc's")
    ap.add_argument("--source", type=Path, default=ROOT / "models" / "demo-draft")
    ap.add_argument("--vla", type=Path, default=ROOT / "models" / "vla-reacher",
                    help="the policy model folder to export and decode (an exported policy folder is used as is)")
    ap.add_argument("--vla-obs", type=int, default=20)
    ap.add_argument("--no-vla", action="store_true")
    a = ap.parse_args(argv)
    t0 = time.time()
    rep = Report(a.out, a.key)
    device = "cpu" if a.smoke else "cuda"
    work = a.work or Path(tempfile.mkdtemp(prefix="cuda_check-"))
    rep.step(("environment",), lambda: environment(device))
    rep.step(("bandwidth",), lambda: bandwidth(device))
    rt = rep.step(("runtime",), lambda: {"rt": open_runtime(a.lib, work, rep.data)})
    if "error" in rt:
        print(summary(rep.data))
        return 2
    rt = rt.pop("rt")
    rep.data["runtime"] = {"device": rt.device}
    n = 6 if a.smoke else a.new_tokens
    seqs = rep.step(("prompts",), lambda: {"ids": prompts(a.source, a.prompts, 16 if a.smoke else 96)})["ids"]
    def run_vla():
        if time.time() - t0 > a.budget_s:
            rep.data["vla"] = {"skipped": f"over the {a.budget_s:.0f} s budget"}
            return
        exported = (a.vla / "target" / "engine.json").is_file()
        pol = {"policy": str(a.vla)} if exported else rep.step(("vla_export",), lambda: export_vla(a.vla, work))
        if "policy" in pol:
            rep.step(("vla",), lambda: vla(Path(pol["policy"]), 4 if a.smoke else a.vla_obs))

    for i, name in enumerate(a.models.split(",")):
        if i == 1 and not a.no_vla:  # after the first model: the VLA policy, before the large stand-ins
            run_vla()
        if time.time() - t0 > a.budget_s:
            rep.data.setdefault("models", {})[name] = {"skipped": f"over the {a.budget_s:.0f} s budget"}
            continue
        key = ("models", name)
        dirs = rep.step(key + ("made",), lambda: make_models(name, a.source, work))
        if "error" in dirs:
            continue
        e = rep.step(key + ("engines",), lambda: {"e": engines(dirs, rt, cpu_too=True)})
        if "error" in e:
            continue
        e = e.pop("e")
        rep.data["models"][name]["weight_bytes"] = e["target_bytes"]
        rep.data["models"][name]["draft_weight_bytes"] = e["draft_bytes"]
        rep.step(key + ("parity",), lambda: parity(e, seqs))
        rep.step(key + ("spec_equals_plain",), lambda: spec_equals_plain(e, seqs[:2], min(n, 64)))
        rep.step(key + ("speed",), lambda: decode_speed(e, seqs, n))
        rep.step(key + ("kernels",), lambda: kernel_profile(e, seqs))
        rep.step(key + ("torch",), lambda: torch_speed(dirs["target"], seqs, n, device))
        e = None  # the engines (and their device memory) go before the next model
    if len(a.models.split(",")) < 2 and not a.no_vla:
        run_vla()
    rep.data["total_s"] = round(time.time() - t0, 1)
    rep.save()
    print(summary(rep.data))
    return 0


if __name__ == "__main__":
    sys.exit(main())
