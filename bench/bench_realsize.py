"""Real-size speed benchmark (issue 28's Targets): edgespec, llama.cpp and ONNX Runtime GenAI on a stand-in pair.

Full run (0.5B stand-in; 8 held-out code prompts x 64 new tokens, greedy, every row from one run):

    bash bench/setup_peers.sh llamacpp && bash bench/setup_peers.sh genai     # once: the peers' environments
    python bench/bench_realsize.py --preset qwen2.5-0.5b     # -> bench/results/realsize-qwen2.5-0.5b.{json,md,png}

Smoke run (2 prompts x 16 tokens, one configuration per mode but llama.cpp plain's two thread counts, no repeat):

    nice python bench/bench_realsize.py --preset qwen2.5-0.5b --smoke \\
        --out .cache/realsize-smoke/realsize-qwen2.5-0.5b.json

Other checkpoints: `--preset llama-3.2-1b`, or any Llama-shaped pair `--target CKPT --draft CKPT` (the stand-ins
of docs/standins.md; the draft must share the target's tokenizer).

Duration (2-core AMD EPYC, shared; the script prints its own estimate first and a progress bar after). The smoke
command took 17.6 and 17.1 minutes (runs dd2605aba71e and 1fb2c5adb589): 5.5 minutes of set-up each (4 engine
exports at 80-115 s, made again when the export code changes; GGUFs and GenAI builds about a minute the first
time, reused after), then 45-51 sweep configurations and 42 final rows in about 11.5 minutes, mostly process start
and model load. The full command (99 sweep configurations on 2 prompts x 64 tokens, 42 rows on 8 x 64, one repeat)
is estimated from the second smoke run's per-row start-up, prefill and decode speeds at about 34 minutes when the
machine is quiet (the smoke's sweep speeds) and up to about 70 when another CPU-bound process holds a core (its
final-phase speeds: llama.cpp's 2-thread speculative rows fell to 1-4 tok/s), plus the set-up when engines are
(re)made. Each --repeats beyond 1 adds about half of that again. Those figures predate the draft-precision sweeps
(--draft-dtype int8,int4 and --llamacpp-draft-precisions same,q8_0,q4_0), which add a draft export and triple
llama.cpp's draft configurations: a 1B fp16-only run (7 rows, 31 sweep configurations, 2 repeats) took 16 minutes.

What one run does, all in one invocation (bench_peers.check_same_run refuses a table holding a row from another):

  0. set-up (untimed): the stand-in pair if missing (python -m edgespec.export.standin --preset P); edgespec engine
     folders `edgespec export CKPT --out DIR --dtype D` for every precision asked (--precisions: fp16, int8, int4;
     fp32 too when asked, or when no folder carries float16 native weights for the cpu-native fp16 rows (an fp32
     export's native.npz holds them; an fp16 export now writes its own), and the drafts (--draft-dtype, default int8
     and int4, --role draft), cached in .cache/engines-realsize/
     and reused while the checkpoint (engine.json's source_sha256) and the export code (EXPORT_CODE's hash) are
     the same; llama.cpp GGUFs (f16 from convert_hf_to_gguf.py, q8_0 / q4_0 from llama-quantize) and GenAI
     builds, each made by one short call of its runner, so a precision that does not build is known before the
     sweep (its rows are recorded unavailable with the builder's error, not run);
  1. DRAM read bandwidth at 1 and 2 threads (bench/lib/membw.c, a native OpenMP read loop over 512 MiB, compiled on
     first use with cc -O3 -march=native -fopenmp) and the machine's load (load average, other processes' CPU);
  2. sweep: every configuration of every row on --sweep-prompts prompts, once, configurations interleaved across
     rows: edgespec plain over threads; draft model over γ; draft + prompt lookup over γ x lookup x lookup γ;
     n-gram over γ x longest n-gram; llama.cpp plain / draft / lookup per GGUF precision over threads, draft length,
     p_min, lookup type and lengths (bench_peers.llamacpp_modes); GenAI plain / draft / n-gram per precision over
     threads and k;
  3. final: each row's fastest configuration (bench_peers.select_best: among those whose tokens matched edgespec's
     own plain at the same precision on every sweep prompt, if any did) on every prompt, --repeats times, one
     process per (row, repeat), rows rotated each repeat;
  4. bandwidth and load again;
  5. head to head: for each ratio target (int4 fastest against llama.cpp's and GenAI's fastest, fp16 fastest
     against llama.cpp's, each plain row against llama.cpp's plain at its precision), its two rows again on the
     same chunk of prompts back to back, which goes first alternating, --paired-rounds x --paired-chunks times
     (default 2 x 4). This machine's read bandwidth moves within seconds, so two passes minutes apart can differ by
     a third; the target is judged by the median of the per-chunk ratios, with the final passes' ratio beside it;
     then the report.

Rows. edgespec: plain, draft, draft+lookup, ngram (and head, with --head: an attention draft head, EAGLE-style,
edgespec/attn_head.py, over --head-gammas; a head of the stand-in's source is widened to it, and every target
folder is then exported with --hidden) x provider cpu-native (edgespec/backends/native.py) and cpu (ONNX
Runtime) x weight precision. A row is labelled by the weights it reads: cpu rows by the engine folder's precision,
cpu-native rows by engine.json's extra.native.weights ("fp16" when absent: the fp32 folder's native.npz holds the
checkpoint's float16 weights). A (provider, precision) no exported folder supports is kept as an unavailable row
with the reason (engine.json's extra.native.unavailable, or the weights the native files do hold). llama.cpp: f16
/ q8_0 / q4_0 (fp16 / int8 / int4) x plain, draft (the draft GGUF at the target's precision, q8_0 and q4_0:
--llamacpp-draft-precisions, as edgespec's drafts are int8 and int4 whatever the target), lookup. GenAI: int4, fp16 and
fp32 (--genai-precisions) x plain, draft (the draft built at the target's precision), n-gram.
Agreement: every row's tokens against edgespec's own plain output at the same precision (cpu-native if that row
ran, else cpu; GenAI's fp32 rows against fp32 cpu, else fp16: the same function), and each edgespec speculative
row against its own plain (same precision and provider: must be identical).

Roofline: each edgespec plain row's bytes per token (cpu-native: every array of native.npz but the embedding,
plus one embedding row, read from the npz headers; cpu: engine.json's weight_bytes_per_token, what `edgespec
inspect` prints; both plus the KV cache read at the prompts' mean context) x its tok/s / the read bandwidth at its
thread count = its share of the DRAM roofline. This machine's read bandwidth moves by 2x within minutes, so the
read loop also runs right before and right after every final pass of a plain row (--adjacent-mib, 3 repetitions
at 1 and 2 threads): each pass's share is taken against the faster of its two neighbouring readings, and the row's
share (the one the target judges) is the median over its passes; the share against the run's best reading
(before and after all rows) is reported beside it. llama.cpp plain rows get the same with the GGUF's file size
(an upper bound: it holds the whole embedding table).

Writes JSON, markdown (.md) and PNG at --out (default bench/results/realsize-<preset>.json); raw runner outputs
(token ids) go to .cache/realsize/<run id>/raw.json.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import shlex
import subprocess
import sys
import time
import uuid
import zipfile
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE / "lib"))

from bench_peers import (Config, Mode, Progress, _brief, _iso, _mmss, _rel, _tps, check_same_run,  # noqa: E402
                         chunk_indices, chunk_tps, llamacpp_modes, merge_repeats, paired_summary, run_system,
                         select_best, summarize)
from host import machine, machine_load  # noqa: E402
from host import read_bandwidth as _read_bandwidth  # noqa: E402

PRECISIONS = ("fp16", "int8", "int4", "fp32")  # the weights a row reads; table order
PROVIDERS = ("cpu-native", "cpu")
EDGESPEC_KINDS = ("plain", "draft", "draft+lookup", "ngram")  # and "head" with --head
LLAMACPP_PRECISION = {"f16": "fp16", "q8_0": "int8", "q4_0": "int4"}  # GGUF type -> the weights' precision
GGUF_TYPE = {v: k for k, v in LLAMACPP_PRECISION.items()}
NATIVE_NAMES = {"float16": "fp16", "fp16": "fp16", "int8": "int8", "int4": "int4"}  # extra.native.weights
LOSSY = ("int8", "int4")  # target exports below the precision gate: --allow-lossy (the report keeps the gate)
ENGINES = ROOT / ".cache" / "engines-realsize"
WORK = ROOT / ".cache" / "realsize"
# what an export's output depends on beside the checkpoint: a cached folder made by other code is re-exported
EXPORT_CODE = ("export/onnx_export.py", "export/graph.py", "export/quantize.py", "export/native.py",
               "export/checkpoint.py", "export/validate.py", "edgespec/backends/native_format.py",
               "edgespec/contract.py")

SMOKE = dict(code_prompts=2, max_new_tokens=16, sweep_prompts=2, repeats=1, plain_threads="2", spec_threads="2",
             draft_dtype="int8",
             gammas="4", lookup_gammas="auto", lookups="2", lookup_lengths="0", ngram_gammas="4", max_ngrams="3",
             llamacpp_threads="1,2", llamacpp_spec_threads="2", llamacpp_draft_threads="0", llamacpp_draft_ks="4",
             llamacpp_draft_p_mins="0", llamacpp_draft_precisions="same",
             llamacpp_lookup_types="ngram-simple", llamacpp_ngram_sizes="3", llamacpp_lookup_lengths="8",
             llamacpp_repack="on", genai_threads="2", genai_spec_threads="2", genai_draft_ks="4", genai_ngram_ks="4",
             genai_ngram_sizes="3",
             membw_reps=3, paired_rounds=1, paired_chunks=2)


def _list(s: str) -> list[str]:
    return [x.strip() for x in str(s).split(",") if x.strip() and x.strip() != "none"]


# ---- engine folders: what each supports, what each reads per token ---------------------------------------------
def native_precision(extra: dict) -> tuple[str | None, str | None]:
    """(the precision of the native weights a folder carries, None) or (None, why it carries none), from
    engine.json's extra: extra.native.weights ("fp16" when absent; "float16" is fp16)."""
    nat = extra.get("native")
    if not nat:
        return None, "no native weights (engine.json has no extra.native: exported before the native step)"
    if not nat.get("file"):
        return None, nat.get("unavailable") or "no native weights (extra.native has no file)"
    w = nat.get("weights", "fp16")
    return NATIVE_NAMES.get(str(w), str(w)), None


@dataclass
class Folder:
    """An exported engine folder, as a row needs it: where, its precision, its native weights."""
    dtype: str  # the export's --dtype
    path: Path | None = None
    native: str | None = None  # the native weights' precision, None without
    native_why: str | None = None  # why there are none
    error: str | None = None  # the export failed: why
    record: dict = field(default_factory=dict)  # how it was made (command, reused, seconds, gate)


def folder_info(path: Path, dtype: str) -> Folder:
    m = json.loads((Path(path) / "engine.json").read_text())
    nat, why = native_precision(m.get("extra", {}))
    return Folder(dtype, Path(path), nat, why)


def npz_arrays(path: Path) -> dict[str, tuple[tuple, str, int]]:
    """{name: (shape, dtype, bytes)} of every array in an .npz, from the .npy headers only (no data read)."""
    from numpy.lib import format as npf
    out = {}
    with zipfile.ZipFile(path) as z:
        for info in z.infolist():
            if not info.filename.endswith(".npy"):
                continue
            with z.open(info) as f:
                version = npf.read_magic(f)
                if version == (1, 0):
                    shape, _, dtype = npf.read_array_header_1_0(f)
                elif version == (2, 0):
                    shape, _, dtype = npf.read_array_header_2_0(f)
                else:
                    shape, _, dtype = npf._read_array_header(f, version)
            n = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
            out[info.filename[:-4]] = (tuple(int(d) for d in shape), dtype.str, n)
    return out


def kv_bytes_per_context_token(m: dict) -> int:
    """Bytes of KV cache one decode step reads per token of context (keys and values of every layer)."""
    return 2 * m["num_layers"] * m["num_kv_heads"] * m["head_dim"] * (2 if m.get("cache_dtype") == "float16" else 4)


def weight_bytes_per_token(folder: Path, provider: str) -> dict:
    """The weight bytes one plain decode step reads on `provider`: {"bytes", "how", "recorded"}.
    cpu-native: every array of native.npz but the embedding table, plus one row of it (the token's), read from
    the npz headers (an int8 / int4 native file's scales count with their matrices); "recorded" is engine.json's
    extra.native.weight_bytes_per_token, what `edgespec inspect` prints (kept beside it as a cross-check).
    cpu (ONNX Runtime): engine.json's weight_bytes_per_token (export/quantize.py, what inspect prints)."""
    m = json.loads((Path(folder) / "engine.json").read_text())
    extra = m.get("extra", {})
    if provider == "cpu-native":
        nat = extra.get("native") or {}
        if not nat.get("file"):
            raise ValueError(f"{folder}: no native weights ({nat.get('unavailable', 'extra.native has no file')})")
        arrays = npz_arrays(Path(folder) / nat["file"])
        total = 0
        for name, (shape, _, n) in arrays.items():
            is_embed = name == "embed" or name.startswith("embed.")
            total += n // shape[0] if is_embed and shape and shape[0] else n
        return {"bytes": int(total), "recorded": nat.get("weight_bytes_per_token"),
                "how": f"{nat['file']}: every array but the embedding table, plus one embedding row"}
    w = extra.get("weight_bytes_per_token") or {}
    if not w.get("total"):
        raise ValueError(f"{folder}: engine.json records no weight_bytes_per_token (re-export the folder)")
    return {"bytes": int(w["total"]), "recorded": int(w["total"]),
            "how": "engine.json weight_bytes_per_token (the graph's initializers, one row of row tables)"}


def adjacent_share(passes: list[dict], bytes_per_token: float, threads: int) -> dict | None:
    """A plain row's roofline share pass by pass: each pass's tok/s against the faster of the read loop's
    readings right before and right after it (at the row's thread count); the median over the passes. None when
    no pass has both a speed and a reading."""
    got = []
    for p in passes:
        reads = [m.get(str(threads), {}).get("gbs_best") for m in (p.get("before") or {}, p.get("after") or {})]
        reads = [g for g in reads if g]
        if p.get("tokens_per_s") and reads:
            got.append(dict(roofline_share(p["tokens_per_s"], bytes_per_token, max(reads)), read_gbs=max(reads),
                            tokens_per_s=p["tokens_per_s"]))
    if not got:
        return None
    return {"passes": got, "share": float(np.median([g["share"] for g in got])),
            "read_gbs_median": float(np.median([g["read_gbs"] for g in got]))}


def roofline_share(tokens_per_s: float, bytes_per_token: float, read_gbs: float) -> dict:
    """A plain decoder's place under the DRAM roofline: the rate if a step only streamed its bytes at the read
    bandwidth, and the share of it reached (tok/s x bytes/token / bandwidth)."""
    roof = read_gbs * 1e9 / bytes_per_token
    return {"roofline_tokens_per_s": roof, "share": tokens_per_s / roof,
            "achieved_gbs": tokens_per_s * bytes_per_token / 1e9}


# ---- rows ------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Row:
    """One row of the table: a bench_peers Mode (its configurations; none when unavailable) and what it is."""
    mode: Mode
    precision: str  # the weights it reads: fp16 / int8 / int4 / fp32
    kind: str  # plain / draft / draft+lookup / ngram / head / lookup
    provider: str | None = None  # edgespec rows: cpu-native or cpu
    engine: str | None = None  # edgespec rows: the target engine folder (repository-relative)
    unavailable: str | None = None

    @property
    def name(self) -> str:
        return self.mode.name


def folder_for(precision: str, provider: str, folders: dict[str, Folder]) -> tuple[Folder | None, str | None]:
    """The engine folder a (provider, precision) row runs, or (None, why none does). cpu: the folder exported at
    that precision. cpu-native: a folder whose native weights are that precision, the one exported at it first,
    then the fp32 folder (whose native.npz holds the float16 weights)."""
    if provider == "cpu":
        f = folders.get(precision)
        if f is None:
            return None, f"no {precision} engine folder was exported"
        if f.error:
            return None, f"edgespec export --dtype {precision} failed: {f.error}"
        return f, None
    why = []
    for dtype in dict.fromkeys([precision, "fp32"]):
        f = folders.get(dtype)
        if f is None:
            continue
        if f.error:
            why.append(f"the {dtype} export failed ({f.error})")
        elif f.native == precision:
            return f, None
        elif f.native:
            why.append(f"the {dtype} folder's native weights are {f.native}")
        else:
            why.append(f"the {dtype} folder has none: {f.native_why}")
    return None, f"no engine folder has {precision} native weights: " + ("; ".join(why) or "none exported")


def edgespec_rows(folders: dict[str, Folder], drafts: list[Folder], args) -> list[Row]:
    """Every edgespec row (kind x provider x precision), each with its sweep configurations (the draft kinds over
    every draft folder that exported: --draft-dtype) or the reason it cannot run. Engine paths are
    repository-relative (the runners run in the repository root)."""
    ok = [d for d in drafts if not d.error]
    rows = []
    for prec in _list(args.precisions):
        for prov in _list(args.providers):
            f, why = folder_for(prec, prov, folders)
            eng = _rel(str(f.path)) if f else None
            if f and f.dtype != prec:
                where = f"native weights of the {f.dtype} folder"
            else:
                where = f"{prec} folder" if f else ""
            for kind in EDGESPEC_KINDS + (("head",) if args.head else ()):
                name = f"edgespec {kind} {prec} {prov}"
                reason = why
                if not reason and kind in ("draft", "draft+lookup") and not ok:
                    reason = "no draft engine: " + ("; ".join(f"{d.dtype}: {d.error}" for d in drafts)
                                                    or "none exported")
                if reason:
                    rows.append(Row(Mode(name, "edgespec", "edgespec", ()), prec, kind, prov, eng, reason))
                    continue
                rows.append(Row(Mode(name, "edgespec", "edgespec", tuple(_edgespec_configs(kind, prov, eng, ok, args,
                                                                                          where))),
                                prec, kind, prov, eng))
    return rows


def _draft_label(draft: Folder, provider: str) -> str:
    on = "cpu-native" if provider == "cpu-native" and draft.native else "cpu"  # edgespec.backends.draft_provider
    return f"{draft.native if on == 'cpu-native' else draft.dtype} draft on {on}"


def _edgespec_configs(kind: str, prov: str, eng: str, drafts: list[Folder], args, where: str) -> list[Config]:
    base = ("--mode", "draft" if kind == "draft+lookup" else kind, "--provider", prov, "--target-engine", eng)
    thr = lambda t: ("--threads", str(t))  # noqa: E731
    if kind == "plain":
        return [Config(f"threads {t} ({where})", base + thr(t)) for t in _list(args.plain_threads)]
    if kind == "head":  # the attention head drafts from the target's hidden states (edgespec.load(draft=".npz"))
        base = ("--mode", "draft", "--provider", prov, "--target-engine", eng, "--draft-engine", _rel(str(args.head)))
        return [Config(f"γ={g}, attention head, threads {t}", base + ("--gamma", g) + thr(t))
                for t in _list(args.spec_threads) for g in _list(args.head_gammas)]
    out = []
    for t in _list(args.spec_threads):
        if kind == "ngram":
            out += [Config(f"γ={g}, max_ngram={n}, threads {t}", base + ("--gamma", g, "--max-ngram", n) + thr(t))
                    for n in _list(args.max_ngrams) for g in _list(args.ngram_gammas)]
            continue
        for draft in drafts:
            dl = _draft_label(draft, prov)
            dv = ("--draft-engine", _rel(str(draft.path)))
            if kind == "draft":
                out += [Config(f"γ={g}, {dl}, threads {t}", base + ("--gamma", g) + dv + thr(t))
                        for g in _list(args.gammas)]
            else:
                out += [Config(f"γ={g}, lookup={n}" + (f", lookup γ={L}" if L != "0" else "")
                               + f", {dl}, threads {t}",
                               base + ("--gamma", g, "--lookup", n) + (("--lookup-gamma", L) if L != "0" else ())
                               + dv + thr(t))
                        for L in _list(args.lookup_lengths) for n in _list(args.lookups)
                        for g in _list(args.lookup_gammas)]
    return out


def llamacpp_rows(args, unavailable: dict[str, str]) -> list[Row]:
    """llama.cpp's rows (bench_peers.llamacpp_modes over this script's sweep settings: plain over --llamacpp-threads,
    draft and lookup over --llamacpp-spec-threads), one per GGUF precision and mode; a precision whose GGUFs did
    not build ({gguf type: error} in `unavailable`) keeps its rows, unavailable."""
    precs = [GGUF_TYPE[p] for p in _list(args.precisions) if p in GGUF_TYPE] if args.llamacpp_precisions == "auto" \
        else _list(args.llamacpp_precisions)
    ns = argparse.Namespace(**{k: getattr(args, k) for k in ("llamacpp_draft_threads", "llamacpp_draft_ks",
                                                             "llamacpp_draft_p_mins", "llamacpp_lookup_types",
                                                             "llamacpp_ngram_sizes", "llamacpp_lookup_lengths",
                                                             "llamacpp_draft_precisions", "llamacpp_repack")},
                            llamacpp_precisions=",".join(precs))
    plain = {m.name: m for m in llamacpp_modes(argparse.Namespace(**vars(ns), llamacpp_threads=args.llamacpp_threads))}
    spec = {m.name: m for m in llamacpp_modes(argparse.Namespace(**vars(ns),
                                                                 llamacpp_threads=args.llamacpp_spec_threads))}
    rows = []
    for name in dict.fromkeys(list(plain) + list(spec)):
        kind, gtype = name.split()[1], name.split()[2]
        m = (plain if kind == "plain" else spec).get(name)
        if m is None:
            continue
        why = unavailable.get(m.name) or unavailable.get(gtype)
        rows.append(Row(Mode(m.name, m.system, m.runner, () if why else m.configs), LLAMACPP_PRECISION[gtype], kind,
                        unavailable=why))
    return rows


def genai_rows(args, unavailable: dict[str, str]) -> list[Row]:
    """ONNX Runtime GenAI's rows per precision (--genai-precisions): plain over --genai-threads (0: GenAI's default),
    draft (the draft built at the target's precision) over k x --genai-spec-threads (target T, draft 1; 0: both
    GenAI's default), n-gram over k x n-gram size x --genai-spec-threads."""
    rows = []
    for p in _list(args.genai_precisions):
        tl = lambda t: "threads: GenAI default" if t == "0" else f"threads {t}"  # noqa: E731
        plain = [Config(f"{p}, {tl(t)}", ("--mode", "plain", "--precision", p, "--threads", t))
                 for t in _list(args.genai_threads)]
        draft = [Config(f"k={k}, {p} draft, " + ("threads: GenAI default" if t == "0" else f"threads {t}, draft 1"),
                        ("--mode", "draft", "--precision", p, "--draft-precision", p, "--gamma", k, "--threads", t,
                         "--draft-threads", "0" if t == "0" else "1"))
                 for t in _list(args.genai_spec_threads) for k in _list(args.genai_draft_ks)]
        ngram = [Config(f"k={k}, ngram_size={n}, {tl(t)}", ("--mode", "ngram", "--precision", p, "--gamma", k,
                                                             "--ngram-size", n, "--threads", t))
                 for t in _list(args.genai_spec_threads) for n in _list(args.genai_ngram_sizes)
                 for k in _list(args.genai_ngram_ks)]
        for kind, cfgs in (("plain", plain), ("draft", draft), ("ngram", ngram)):
            name = f"ORT GenAI {kind} {p}"
            why = unavailable.get(name) or unavailable.get(p)
            rows.append(Row(Mode(name, "ORT GenAI", "genai", () if why else tuple(cfgs)), p, kind, unavailable=why))
    return rows


def order_rows(rows: list[Row]) -> list[Row]:
    """Table order: by precision, then edgespec (cpu-native, cpu), llama.cpp, GenAI, each plain first."""
    sys_rank = lambda r: (0 if r.mode.system == "edgespec" else 1 if r.mode.system == "llama.cpp" else 2,  # noqa: E731
                          PROVIDERS.index(r.provider) if r.provider in PROVIDERS else 0)
    kinds = ("plain", "draft", "draft+lookup", "head", "lookup", "ngram")
    return sorted(rows, key=lambda r: (PRECISIONS.index(r.precision) if r.precision in PRECISIONS else 9,
                                       sys_rank(r), kinds.index(r.kind) if r.kind in kinds else 9))


def reference_row(precision: str, ok: set[str]) -> str | None:
    """The edgespec plain row whose tokens a row at `precision` is compared with: cpu-native at that precision if
    it ran, else cpu; fp32 rows fall back to fp16 (the checkpoint's float16 weights in float32 arithmetic are the
    fp32 function)."""
    cands = [f"edgespec plain {precision} cpu-native", f"edgespec plain {precision} cpu"]
    if precision == "fp32":
        cands += ["edgespec plain fp16 cpu-native"]
    return next((c for c in cands if c in ok), None)


# ---- the targets of issue 28 -----------------------------------------------------------------------------------
def comparisons(systems: dict, rows: list[Row]) -> list[dict]:
    """The ratio targets of issue 28 as {target, a, b, threshold} (a or b None where that side has no row that ran):
    int4: edgespec's fastest speculative row against the fastest llama.cpp q4_0 and GenAI int4 rows (1.5x); fp16:
    edgespec's fastest against llama.cpp's fastest f16 (2x); plain against llama.cpp plain at each precision, per
    provider (1x)."""
    by = {r.name: r for r in rows}
    tps = {n: _tps(s) for n, s in systems.items() if _tps(s)}

    def fastest(pred) -> str | None:
        names = [n for n in tps if n in by and pred(by[n])]
        return max(names, key=tps.get, default=None)

    out = []
    es_spec = fastest(lambda r: r.mode.system == "edgespec" and r.precision == "int4" and r.kind != "plain")
    for system, prec in (("llama.cpp", "int4"), ("ORT GenAI", "int4")):
        out.append({"target": f"int4: edgespec's fastest speculative mode >= 1.5x {system}'s fastest {prec} mode",
                    "a": es_spec, "b": fastest(lambda r, s=system: r.mode.system == s and r.precision == prec),
                    "threshold": 1.5})
    out.append({"target": "fp16: edgespec's fastest mode >= 2x llama.cpp's fastest f16 mode",
                "a": fastest(lambda r: r.mode.system == "edgespec" and r.precision == "fp16"),
                "b": fastest(lambda r: r.mode.system == "llama.cpp" and r.precision == "fp16"), "threshold": 2.0})
    for prec in ("fp16", "int8", "int4"):
        lp = f"llama.cpp plain {GGUF_TYPE[prec]}"
        for prov in PROVIDERS:
            a = f"edgespec plain {prec} {prov}"
            if a in by:
                out.append({"target": f"{prec}: edgespec plain ({prov}) >= llama.cpp plain {GGUF_TYPE[prec]}",
                            "a": a if a in tps else None, "b": lp if lp in tps else None, "threshold": 1.0})
    return out


def targets(systems: dict, rows: list[Row], roofline: dict, paired: dict | None = None) -> list[dict]:
    """Issue 28's targets, each met or not (or not measurable, saying which side is missing): the ratios of
    `comparisons` (the int4 ones also need output identical to edgespec's own int4 plain) and each edgespec plain
    row >= 85% of the DRAM roofline. `paired` ({"a | b": bench_peers.paired_summary}) judges a ratio by its
    head-to-head median where that ran; the ratio of the final passes' medians stays beside it."""
    tps = {n: _tps(s) for n, s in systems.items() if _tps(s)}
    paired = paired or {}
    out = []
    for c in comparisons(systems, rows):
        t, a, b = dict(c), c["a"], c["b"]
        if not a or not b:
            out.append(dict(t, met=None, why="no edgespec row ran" if not a else "no peer row ran"))
            continue
        v = tps[a] / tps[b]
        t.update(a_tokens_per_s=tps[a], b_tokens_per_s=tps[b], value=v, value_final_passes=v, judged_by="final passes")
        h = paired.get(f"{a} | {b}")
        if h and h.get("ratio_median") is not None:
            t.update(value=h["ratio_median"], judged_by="head to head",
                     paired={k: h[k] for k in ("ratio_median", "ratio_q1", "ratio_q3", "ratio_min", "ratio_max",
                                               "trials_ok", "failed_trials", "a_tokens_per_s_median",
                                               "b_tokens_per_s_median")})
        t["met"] = bool(t["value"] >= c["threshold"])
        if c["target"].startswith("int4: edgespec's fastest"):
            same = systems.get(a, {}).get("identical_prompts")
            t["edgespec_identical_to_own_int4_plain"] = same
            if t["met"] and same and same.split("/")[0] != same.split("/")[1]:
                t.update(met=False, why=f"fast enough, but its output differs from edgespec's int4 plain ({same})")
        out.append(t)
    for name, r in (roofline.get("rows") or {}).items():
        if name.startswith("edgespec") and "share" in r:
            out.append({"target": f"{name} >= 85% of the DRAM roofline", "a": name, "value": r["share"],
                        "threshold": 0.85, "met": bool(r["share"] >= 0.85)})
    return out


# ---- the machine: bandwidth and load ---------------------------------------------------------------------------
def read_bandwidth(threads: list[int], mib: int, reps: int) -> dict:
    """{threads: membw's JSON} (GB/s of each repetition, best, median), or {"error": ...}: bench/lib/membw.c,
    compiled into WORK once per source version."""
    return _read_bandwidth(threads, mib, reps, work=WORK)


def best_bandwidth(measures: list[dict], threads: int) -> float | None:
    """The best read GB/s at `threads` over every measurement of the run (the ceiling the roofline uses)."""
    got = [m.get(str(threads), {}).get("gbs_best") for m in measures]
    got = [g for g in got if g]
    return max(got) if got else None


# ---- set-up: checkpoints, exports, peer builds -----------------------------------------------------------------
def checkpoints(args) -> tuple[Path, Path, str]:
    """(target, draft, name): the preset's stand-in pair (made if missing; the tool keeps a folder holding the same
    recipe), or --target / --draft."""
    if args.preset:
        subprocess.run([sys.executable, "-m", "edgespec.export.standin", "--preset", args.preset, "--vocab",
                        args.vocab, "--no-progress"], check=True, cwd=ROOT, stdout=sys.stderr)
        from edgespec.export.standin import default_out
        base = default_out(args.preset, args.vocab)
        return base / "target", base / "draft", base.name
    t = Path(args.target).resolve()
    return t, Path(args.draft).resolve(), f"{t.parent.name}-{t.name}"  # folders are often named "target"


def code_fingerprint() -> str:
    h = hashlib.sha256()
    for f in EXPORT_CODE:
        p = ROOT / f
        h.update(f.encode() + (p.read_bytes() if p.is_file() else b"(missing)"))
    return h.hexdigest()[:16]


def source_sha256(ckpt: Path) -> str:
    from edgespec.export.checkpoint import hash_files, weight_files
    return hash_files(weight_files(ckpt) + [ckpt / "config.json"])


def reuse_reason(out: Path, dtype: str, source: str, code: str, hidden: bool = False) -> str | None:
    """None when the folder at `out` can be reused (same checkpoint, precision and export code, the hidden-state
    output when wanted), else why not."""
    if not (out / "engine.json").is_file():
        return "not exported yet"
    m = json.loads((out / "engine.json").read_text())
    if m.get("source_sha256") != source:
        return "the checkpoint changed (engine.json's source_sha256)"
    if m.get("precision") != dtype:
        return f"engine.json says {m.get('precision')}, {dtype} wanted"
    if hidden and not any(t.get("name") == "hidden" for t in m.get("outputs") or []):
        return "no hidden-state output (--hidden wanted)"
    side = out.with_name(out.name + ".export.json")
    if not side.is_file() or json.loads(side.read_text()).get("export_code") != code:
        return "made by other export code (" + ", ".join(EXPORT_CODE) + ")"
    return None


def export(ckpt: Path, name: str, dtype: str, role: str, reexport: bool, timeout: int, hidden: bool = False) -> Folder:
    """An engine folder of `ckpt` at `dtype` in .cache/engines-realsize/, exported unless a reusable one is there;
    a failed export is a Folder with its error. hidden: with the final hidden state as an output (--hidden, what
    an attention head drafts from), in a folder of its own (NAME-DTYPE-hidden)."""
    out = ENGINES / (f"{name}-{dtype}" + ("-hidden" if hidden else "") if role == "target"
                     else f"{name}-draft-{dtype}")
    cmd = ["edgespec", "export", _rel(str(ckpt)), "--out", _rel(str(out)), "--dtype", dtype, "--force", "--quiet"]
    cmd += ["--hidden"] if hidden else []
    cmd += ["--role", "draft"] if role == "draft" else (["--allow-lossy"] if dtype in LOSSY else [])
    source, code = source_sha256(ckpt), code_fingerprint()
    why = "--reexport" if reexport else reuse_reason(out, dtype, source, code, hidden)
    rec = {"command": shlex.join(cmd), "role": role}
    if why is None:
        f = folder_info(out, dtype)
        f.record = dict(rec, reused=True, **_export_facts(out))
        return f
    print(f"[realsize] exporting {_rel(str(out))} ({why}): {shlex.join(cmd)}", file=sys.stderr, flush=True)
    ENGINES.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    try:
        r = subprocess.run([sys.executable, "-m", "edgespec"] + cmd[1:], cwd=ROOT, capture_output=True, text=True,
                           timeout=timeout)
    except subprocess.TimeoutExpired:
        return Folder(dtype, error=f"timed out after {timeout} s", record=rec)
    if r.returncode != 0 or not (out / "engine.json").is_file():
        lines = [ln for ln in (r.stderr + r.stdout).splitlines() if ln.strip()]
        return Folder(dtype, error=f"exit {r.returncode}: {lines[-1] if lines else '(no output)'}", record=rec)
    out.with_name(out.name + ".export.json").write_text(json.dumps({"export_code": code, "command": rec["command"]}))
    f = folder_info(out, dtype)
    f.record = dict(rec, reused=False, export_s=round(time.time() - t0, 1), why=why, **_export_facts(out))
    return f


def _export_facts(out: Path) -> dict:
    m = json.loads((out / "engine.json").read_text())
    extra = m.get("extra", {})
    v = extra.get("validation") or {}
    nat = extra.get("native") or {}
    return {"path": _rel(str(out)), "precision": m.get("precision"), "flavor": m.get("flavor"),
            "weight_bytes_per_token": (extra.get("weight_bytes_per_token") or {}).get("total"),
            "precision_gate": v.get("precision_gate"), "agreement_vs_fp32": v.get("agreement_vs_fp32"),
            "native": {k: nat.get(k) for k in ("file", "weights", "weight_bytes_per_token", "unavailable") if k in nat}}


def prepare_peer(runner: str, prec: str, base: list[str], pfile: Path, timeout: int) -> dict:
    """Make one peer precision's models (GGUFs, GenAI builds) with a short call of its runner (draft mode: target
    and draft; untimed). -> {"status": "ok"} | {"status": "unavailable", "error", "rows": which rows}: rows that
    cannot build are recorded unavailable instead of failing one by one in the sweep."""
    if runner == "llamacpp":
        argv = ["--mode", "draft", "--precision", prec, "--draft-max", "2", "--threads", "2"]
    else:
        argv = ["--mode", "draft", "--precision", prec, "--draft-precision", prec, "--gamma", "2"]
    common = ["--prompts", str(pfile), "--repeats", "1", "--max-new-tokens", "2", "--warmup", "0"]
    t0 = time.time()
    out = run_system(f"{runner} {prec}", base + common + argv, timeout)
    rec = {"seconds": round(time.time() - t0, 1), "builds": (out.get("config") or {}).get("builds")}
    if "error" not in out or out.get("stage") not in (None, "build", "setup"):
        # built; a later stage's error (the draft mode refused, ...) is the rows' own to record
        return dict(rec, status="ok", note=_brief(out["error"]) if "error" in out else None)
    plain = run_system(f"{runner} {prec} plain", base + common + ["--mode", "plain", "--precision", prec], timeout)
    if "error" not in plain or plain.get("stage") not in (None, "build", "setup"):
        return dict(rec, status="unavailable", rows="draft", error=_brief(out["error"]))
    return dict(rec, status="unavailable", rows="all", error=_brief(plain["error"]))


def prepare_head(args, target_ck: Path) -> dict:
    """Point args.head at a head as wide as the target: a head of the stand-in's source (narrower) is widened once
    into .cache/realsize/heads/ (export/standin.widen_attention_head: the same proposals). -> how it was made."""
    from edgespec.attn_head import AttnHeadWeights
    from edgespec.export.standin import widen_attention_head

    src = Path(args.head)
    if not src.is_file():
        raise SystemExit(f"--head {src}: no such file (python -m edgespec.export.training.train_attn_head makes one)")
    width = int(json.loads((target_ck / "config.json").read_text())["hidden_size"])
    e = AttnHeadWeights.load(src).w_out.shape[1]
    rec = {"given": _rel(str(src)), "sha256": hashlib.sha256(src.read_bytes()).hexdigest()[:16], "width": e}
    meta = src.with_suffix(".json")  # train_attn_head's report beside the head: how it was trained
    if meta.is_file():
        m = json.loads(meta.read_text())
        rec.update(trained_by=m.get("command"), training_minutes=m.get("minutes"),
                   windows=(m.get("config") or {}).get("windows", "corpus"))
    if e > width:
        raise SystemExit(f"--head {src}: {e} wide, wider than the target's hidden size {width}")
    if e < width:
        out = WORK / "heads" / f"{src.stem}-{rec['sha256']}-e{width}.npz"
        if not out.is_file():
            out.parent.mkdir(parents=True, exist_ok=True)
            widen_attention_head(src, out, width)
        args.head = out
        rec.update(widened_to=width, path=_rel(str(out)),
                   how="export/standin.widen_attention_head (a stand-in's padded dimensions are zero)")
    return rec


# ---- the run ---------------------------------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    src = ap.add_argument_group("checkpoints")
    src.add_argument("--preset", help="a stand-in preset (python -m edgespec.export.standin --list)")
    src.add_argument("--vocab", choices=("source", "real"), default="source",
                     help="with --preset: the demo's 4096-token vocabulary or the real model's, padded (its LM-head "
                          "bytes and a narrower draft: docs/standins.md); results go to realsize-PRESET-real-vocab")
    src.add_argument("--target", help="instead of --preset: the target's Hugging Face folder")
    src.add_argument("--draft", help="with --target: the draft's Hugging Face folder")
    ap.add_argument("--out", type=Path, default=None, help="default bench/results/realsize-<preset>.json")
    ap.add_argument("--smoke", action="store_true", help="tiny settings (2 prompts x 16 tokens, one configuration "
                                                         "per mode); options given explicitly still apply")
    ap.add_argument("--precisions", default="fp16,int8,int4", help="edgespec weight precisions (fp16, int8, int4, "
                                                                   "fp32); llama.cpp's follow (f16, q8_0, q4_0)")
    ap.add_argument("--providers", default="cpu-native,cpu", help="edgespec target providers")
    ap.add_argument("--draft-dtype", default="int8,int4",
                    help="edgespec draft engine precisions swept (--role draft), comma-separated")
    ap.add_argument("--reexport", action="store_true", help="export every engine folder again")
    ap.add_argument("--code-prompts", type=int, default=8, help="held-out code prompts (bench/lib/prompts.py)")
    ap.add_argument("--prose-prompts", type=int, default=0)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--sweep-prompts", type=int, default=2, help="prompts each sweep configuration decodes")
    ap.add_argument("--repeats", type=int, default=1, help="final passes over every prompt, rows rotated (each "
                                                           "more adds about half the run's time)")
    es = ap.add_argument_group("edgespec sweep")
    cores = str(os.cpu_count() or 1)
    es.add_argument("--plain-threads", default=",".join(dict.fromkeys(["1", cores])), help="plain: threads swept")
    es.add_argument("--spec-threads", default=cores, help="speculative rows: the target's threads swept")
    es.add_argument("--gammas", default="4,6,auto", help="draft: γ")
    es.add_argument("--lookup-gammas", default="auto", help="draft+lookup: γ")
    es.add_argument("--lookups", default="2", help="draft+lookup: load(lookup=N)")
    es.add_argument("--lookup-lengths", default="0,16", help="draft+lookup: load(lookup_gamma=G) (0: γ)")
    es.add_argument("--ngram-gammas", default="4,auto", help="ngram: γ")
    es.add_argument("--max-ngrams", default="3", help="ngram: longest n-gram")
    es.add_argument("--head", type=Path, default=None,
                    help="an attention draft head (python -m edgespec.export.training.train_attn_head) for the "
                         "target or for the stand-in's source (widened here); adds 'edgespec head' rows, and every "
                         "target folder is exported with --hidden (all edgespec rows read the same folders)")
    es.add_argument("--head-gammas", default="6,8", help="head: γ")
    lc = ap.add_argument_group("llama.cpp sweep (bench_peers.llamacpp_modes)")
    lc.add_argument("--llamacpp-precisions", default="auto", help="GGUF types (auto: --precisions' f16, q8_0, q4_0; "
                                                                 "none: no llama.cpp rows)")
    lc.add_argument("--llamacpp-threads", default="1,2", help="plain: threads swept")
    lc.add_argument("--llamacpp-spec-threads", default="2", help="draft and lookup: threads swept")
    lc.add_argument("--llamacpp-draft-threads", default="0", help="draft threads (0: the target's)")
    lc.add_argument("--llamacpp-draft-ks", default="4,8", help="--spec-draft-n-max")
    lc.add_argument("--llamacpp-draft-p-mins", default="0,0.75", help="--spec-draft-p-min")
    lc.add_argument("--llamacpp-draft-precisions", default="same,q8_0,q4_0",
                    help="the draft GGUF's types swept (same: the target's): a draft's precision cannot change the "
                         "output, and edgespec's drafts are int8 and int4 (--draft-dtype): each side picks its fastest")
    lc.add_argument("--llamacpp-lookup-types", default="ngram-simple,ngram-cache")
    lc.add_argument("--llamacpp-repack", default="on,off",
                    help="its weight repacking swept (off: llama-server --no-repack; on an AMX CPU, no AMX weights)")
    lc.add_argument("--llamacpp-ngram-sizes", default="3")
    lc.add_argument("--llamacpp-lookup-lengths", default="8,16", help="ngram-simple: draft length after a match")
    ga = ap.add_argument_group("ONNX Runtime GenAI sweep")
    ga.add_argument("--genai-precisions", default="int4,fp16,fp32", help="builder precisions (none: no GenAI rows)")
    ga.add_argument("--genai-threads", default="0,2", help="plain: threads swept (0: GenAI's default threading)")
    ga.add_argument("--genai-spec-threads", default="2", help="draft and n-gram: the target's threads swept")
    ga.add_argument("--genai-draft-ks", default="3,5", help="draft: max_draft_tokens")
    ga.add_argument("--genai-ngram-ks", default="3,5", help="n-gram: max_draft_tokens")
    ga.add_argument("--genai-ngram-sizes", default="3")
    ap.add_argument("--membw-mib", type=int, default=512)
    ap.add_argument("--membw-reps", type=int, default=7)
    ap.add_argument("--adjacent-mib", type=int, default=256,
                    help="the read loop's buffer right before and after each final plain pass (0: not measured)")
    ap.add_argument("--paired-rounds", type=int, default=2,
                    help="head to head: rounds over the prompt chunks for each ratio target's two rows (0: none)")
    ap.add_argument("--paired-chunks", type=int, default=4, help="head to head: prompt chunks (interleaved)")
    ap.add_argument("--timeout", type=int, default=900, help="per runner process, seconds")
    ap.add_argument("--build-timeout", type=int, default=3600, help="per export or peer build, seconds")
    return ap


def parse_args(argv: list[str]):
    ap = build_parser()
    if "--smoke" in argv:
        ap.set_defaults(**SMOKE)
    args = ap.parse_args(argv)
    if bool(args.preset) == bool(args.target) or bool(args.target) != bool(args.draft):
        ap.error("give --preset NAME, or --target CKPT and --draft CKPT")
    if args.vocab != "source" and not args.preset:
        ap.error(f"--vocab {args.vocab} applies to --preset only (a --target keeps its own vocabulary)")
    n = args.code_prompts + args.prose_prompts
    if args.paired_rounds < 0 or not 1 <= args.paired_chunks <= n:
        ap.error(f"--paired-rounds must be >= 0 and --paired-chunks between 1 and the prompt count ({n}), got "
                 f"{args.paired_rounds} and {args.paired_chunks}")
    bad = [p for p in _list(args.precisions) if p not in PRECISIONS]
    if bad:
        ap.error(f"--precisions: expected some of {PRECISIONS}, got {bad}")
    return args


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    run = {"id": uuid.uuid4().hex[:12], "started_epoch": time.time(),
           "command": "python bench/bench_realsize.py " + shlex.join(argv)}
    run["started"] = _iso(run["started_epoch"])
    rdir = WORK / run["id"]
    rdir.mkdir(parents=True, exist_ok=True)
    load = {"start": machine_load()}

    # 0. set-up (untimed): checkpoints, engine folders, peer builds
    target_ck, draft_ck, name = checkpoints(args)
    args.out = args.out or ROOT / "bench" / "results" / f"realsize-{name}.json"
    want = _list(args.precisions)
    hidden = args.head is not None
    head_record = prepare_head(args, target_ck) if hidden else None
    folders: dict[str, Folder] = {}
    for dtype in want:
        folders[dtype] = export(target_ck, name, dtype, "target", args.reexport, args.build_timeout, hidden)
    if "cpu-native" in _list(args.providers) and "fp16" in want and not any(
            f.native == "fp16" for f in folders.values()) and "fp32" not in folders:
        folders["fp32"] = export(target_ck, name, "fp32", "target", args.reexport, args.build_timeout,  # native fp16
                                 hidden)
    drafts = [export(draft_ck, name, d, "draft", args.reexport, args.build_timeout) for d in _list(args.draft_dtype)]

    from prompts import PROSE, code_prompts
    from edgespec.tokenizer import TextTokenizer
    tok = TextTokenizer(target_ck / "tokenizer.json")
    prompts = code_prompts(tok, args.code_prompts) + PROSE[:args.prose_prompts]
    n = len(prompts)
    sweep_idx = sorted({round(i * (n - 1) / max(args.sweep_prompts - 1, 1)) for i in range(min(args.sweep_prompts, n))})
    pfile, sfile = rdir / "prompts.json", rdir / "sweep-prompts.json"
    pfile.write_text(json.dumps(prompts))
    sfile.write_text(json.dumps([prompts[i] for i in sweep_idx]))
    (rdir / "one-prompt.json").write_text(json.dumps(prompts[:1]))
    mean_ctx = float(np.mean([len(tok.encode(p)) for p in prompts])) + args.max_new_tokens / 2

    tokens = ["--max-new-tokens", str(args.max_new_tokens)]
    tgt, dft = _rel(str(target_ck)), _rel(str(draft_ck))
    # --no-cost-model: a fixed-γ draft row skips bench_peers' cost measurement after its timed runs (10-25 s at
    # this size; this report does not predict speedups)
    base = {"edgespec": [sys.executable, _rel(str(HERE / "bench_peers.py")), "--edgespec-runner", "--no-cost-model"]
            + tokens,
            "genai": [str(ROOT / ".venv-genai" / "bin" / "python"), _rel(str(HERE / "peers" / "genai_runner.py")),
                      "--target", tgt, "--draft", dft, "--work", _rel(str(WORK / "genai"))] + tokens,
            "llamacpp": [str(ROOT / ".venv-llamacpp" / "bin" / "python"),
                         _rel(str(HERE / "peers" / "llamacpp_runner.py")), "--target", tgt, "--draft", dft,
                         "--work", _rel(str(WORK / "llamacpp"))] + tokens}
    peer_builds, unavailable = {}, {}
    lc_precs = [GGUF_TYPE[p] for p in want if p in GGUF_TYPE] if args.llamacpp_precisions == "auto" \
        else _list(args.llamacpp_precisions)
    for runner, precs, label in (("llamacpp", lc_precs, "llama.cpp"), ("genai", _list(args.genai_precisions),
                                                                       "ORT GenAI")):
        for p in precs:
            print(f"[realsize] preparing {label} {p}", file=sys.stderr, flush=True)
            rec = prepare_peer(runner, p, base[runner], rdir / "one-prompt.json", args.build_timeout)
            peer_builds[f"{label} {p}"] = rec
            if rec["status"] != "ok":
                kinds = ("draft",) if rec["rows"] == "draft" else ("plain", "draft", "lookup", "ngram")
                for k in kinds:
                    unavailable[f"{label} {k} {p}"] = f"{label} {p} did not build: {rec['error']}"
    rows = order_rows(edgespec_rows(folders, drafts, args) + llamacpp_rows(args, unavailable)
                      + genai_rows(args, unavailable))
    runnable = [r for r in rows if r.mode.configs]

    # 1. bandwidth and load
    bw = [read_bandwidth([1, 2], args.membw_mib, args.membw_reps)]
    load["after_setup"] = machine_load()

    def cmd(row: Row, cfg: Config, prompts_file: Path) -> list[str]:
        return base[row.mode.runner] + ["--prompts", str(prompts_file), "--repeats", "1"] + list(cfg.argv)

    # ETA: a configuration costs its start-up (load; warm-up) plus its tokens at a rough speed
    gbs = best_bandwidth(bw, 2) or 10.0
    ck_bytes = sum(p.stat().st_size for p in target_ck.glob("*.safetensors"))
    per_param = {"fp32": 2.0, "fp16": 1.0, "int8": 0.55, "int4": 0.3}

    def est(row: Row, ntok: int) -> float:
        b = ck_bytes * per_param.get(row.precision, 1.0)
        speed = 0.5 * gbs * 1e9 / b * (1.0 if row.kind == "plain" else 1.5)
        return 4.0 + 3.0 * b / 1e9 + ntok / speed

    ns, nt = len(sweep_idx) * args.max_new_tokens, n * args.max_new_tokens
    total = sum(est(r, ns) * len(r.mode.configs) + args.repeats * est(r, nt) for r in runnable)
    n_sweep = sum(len(r.mode.configs) for r in runnable)
    print(f"run {run['id']}: {len(rows)} rows ({len(rows) - len(runnable)} unavailable), sweep {n_sweep} "
          f"configurations on {len(sweep_idx)} prompts, then {len(runnable)} rows x {args.repeats} repeats on {n} "
          f"prompts; estimated {_mmss(total)} (min:s)", file=sys.stderr)
    bar = Progress(total)

    # 2. sweep: the i-th configuration of every row, then the (i+1)-th, ...
    raw: dict = {"sweep": {}, "final": {}}
    order = [(r, r.mode.configs[i]) for i in range(max((len(r.mode.configs) for r in runnable), default=0))
             for r in runnable if i < len(r.mode.configs)]
    sweep_out: dict = {r.name: [] for r in runnable}
    for r, c in order:
        bar.show(f"sweep {r.name}: {c.label}")
        out = run_system(f"{r.name} {c.label}", cmd(r, c, sfile), args.timeout)
        raw["sweep"][f"{r.name} | {c.label}"] = out
        sweep_out[r.name].append((c, out))
        bar.done += est(r, ns)
    ok_plain = {r.name for r in runnable if r.kind == "plain" and r.mode.system == "edgespec"
                and any("error" not in o for _, o in sweep_out[r.name])}
    sweep_ref = {nm: next(o for _, o in sweep_out[nm] if "error" not in o) for nm in ok_plain}
    sweep: dict = {}
    best: dict = {}
    for r in runnable:
        refname = reference_row(r.precision, ok_plain)
        ref = sweep_ref.get(refname) if refname != r.name else None
        sweep[r.name] = [dict(summarize(o, ref, len(sweep_idx)), config=c.label, argv=list(c.argv), run_id=run["id"],
                              started=o["started"], ended=o["ended"]) for c, o in sweep_out[r.name]]
        b = select_best(sweep[r.name])
        best[r.name] = next((c for c in r.mode.configs if b and c.label == b["config"]), None)
    load["after_sweep"] = machine_load()

    # 3. final: each row's best configuration on every prompt, rows rotated each repeat
    final = [r for r in runnable if best[r.name] is not None]
    outs: dict = {r.name: [] for r in final}
    adjacent: dict = {r.name: [] for r in final if r.kind == "plain"}  # per pass: the read loop around it
    for rep in range(args.repeats):
        rot = final[rep % len(final):] + final[:rep % len(final)] if final else []
        for r in rot:
            bar.show(f"final {rep + 1}/{args.repeats} {r.name}: {best[r.name].label}")
            near = r.kind == "plain" and args.adjacent_mib > 0
            before = read_bandwidth([1, 2], args.adjacent_mib, 3) if near else None
            outs[r.name].append(run_system(r.name, cmd(r, best[r.name], pfile), args.timeout))
            if near:
                adjacent[r.name].append({"before": before, "tokens_per_s": chunk_tps(outs[r.name][-1]),
                                         "after": read_bandwidth([1, 2], args.adjacent_mib, 3)})
            bar.done += est(r, nt)
    bar.show("bandwidth and load")
    print(file=sys.stderr)
    merged = {nm: merge_repeats(o) for nm, o in outs.items()}
    raw["final"] = merged
    bw.append(read_bandwidth([1, 2], args.membw_mib, args.membw_reps))
    load["end"] = machine_load()

    ok_final = {nm for nm in merged if "error" not in merged[nm] and nm.startswith("edgespec plain")}
    systems: dict = {}
    for r in rows:
        stamp = {"run_id": run["id"]}
        meta = {"system": r.mode.system, "precision": r.precision, "kind": r.kind, "provider": r.provider,
                "engine": r.engine}
        if r.unavailable:
            systems[r.name] = dict(meta, status="unavailable", error=r.unavailable, started=run["started_epoch"],
                                   ended=run["started_epoch"], **stamp)
            continue
        if r.name not in merged:
            err = next((t["error"] for t in sweep[r.name] if t["status"] != "ok"), "no configuration ran")
            systems[r.name] = dict(meta, status="failed",
                                   error=f"every configuration failed in the sweep; first: {err}",
                                   started=sweep_out[r.name][0][1]["started"], ended=sweep_out[r.name][-1][1]["ended"],
                                   **stamp)
            continue
        out = merged[r.name]
        refname = reference_row(r.precision, ok_final)
        s = summarize(out, merged.get(refname) if refname != r.name else None, n)
        s.update(meta, config=best[r.name].label, selected_from=len(r.mode.configs), agreement_reference=refname,
                 started=out["started"], ended=out["ended"], **stamp)
        if r.mode.system == "edgespec" and r.kind != "plain" and "error" not in out:
            own = f"edgespec plain {r.precision} {r.provider}"
            if own in ok_final:
                s["identical_to_own_plain"] = summarize(out, merged[own], n).get("identical_prompts")
        if "error" not in out:
            cfg = out.get("config") or {}
            if cfg.get("builds"):
                s["builds"] = {role: _rel(b["builder_command"]) for role, b in cfg["builds"].items()}
            if r.mode.system == "llama.cpp" and cfg.get("target_gguf"):
                s["gguf_bytes"] = Path(ROOT / cfg["target_gguf"]).stat().st_size \
                    if (ROOT / cfg["target_gguf"]).is_file() else None
            if r.mode.system == "edgespec":
                s["threads"] = cfg.get("threads")
            elif cfg.get("threads") is not None:
                s["threads"] = cfg.get("threads")
        systems[r.name] = s

    # 4. head to head: each ratio target's two rows again, back to back on the same chunk of prompts (which goes
    # first alternates), so that the machine's bandwidth, which moves within seconds here, falls on both sides of
    # every ratio; the targets are judged by the median of these ratios
    by_row = {r.name: r for r in final}
    pairs = [(c["a"], c["b"]) for c in comparisons(systems, rows) if c["a"] in by_row and c["b"] in by_row]
    pairs = list(dict.fromkeys(pairs)) if args.paired_rounds > 0 else []
    paired: dict = {}
    if pairs:
        cfiles = []
        for ci, idx in enumerate(chunk_indices(n, args.paired_chunks)):
            cfiles.append(rdir / f"chunk-{ci}.json")
            cfiles[-1].write_text(json.dumps([prompts[i] for i in idx]))
        per_side = args.paired_rounds * n
        bar = Progress(sum(est(by_row[x], per_side * args.max_new_tokens) + 5.0 * args.paired_rounds
                           * args.paired_chunks for pair in pairs for x in pair))
        for a, b in pairs:
            trials = []
            for rnd in range(args.paired_rounds):
                for ci, cfile in enumerate(cfiles):
                    order = (a, b) if (rnd + ci) % 2 == 0 else (b, a)
                    got = {}
                    for nm in order:
                        bar.show(f"head to head {rnd + 1}/{args.paired_rounds} chunk {ci + 1}: {nm}")
                        got[nm] = run_system(nm, cmd(by_row[nm], best[nm], cfile), args.timeout)
                        bar.done += est(by_row[nm], per_side * args.max_new_tokens) / (
                            args.paired_rounds * len(cfiles)) + 5.0
                    trials.append({"round": rnd, "chunk": ci, "first": order[0],
                                   "a_tokens_per_s": chunk_tps(got[a]), "b_tokens_per_s": chunk_tps(got[b]),
                                   "errors": [_brief(o["error"]) for o in got.values() if "error" in o],
                                   "run_id": run["id"], "started": min(o["started"] for o in got.values()),
                                   "ended": max(o["ended"] for o in got.values())})
                    raw.setdefault("head_to_head", {}).setdefault(f"{a} | {b}", []).append(got)
            paired[f"{a} | {b}"] = dict(paired_summary(a, b, trials), a_config=best[a].label, b_config=best[b].label)
        print(file=sys.stderr)
        load["after_head_to_head"] = machine_load()

    roofline = {"bandwidth_measurements": bw, "mean_context_tokens": mean_ctx,
                "read_gbs_best": {t: best_bandwidth(bw, int(t)) for t in ("1", "2")}, "rows": {}}
    for r in rows:
        s = systems[r.name]
        if r.kind != "plain" or s.get("status") != "ok":
            continue
        th = s.get("threads") if isinstance(s.get("threads"), int) else (os.cpu_count() or 1)
        g = best_bandwidth(bw, min(int(th), 2))
        if not g:
            continue
        if r.mode.system == "edgespec":
            w = weight_bytes_per_token(ROOT / r.engine, r.provider)
            m = json.loads((ROOT / r.engine / "engine.json").read_text())
            kv = kv_bytes_per_context_token(m) * mean_ctx
            entry = dict(w, weight_bytes=w["bytes"], kv_bytes=kv, bytes_per_token=w["bytes"] + kv)
        elif s.get("gguf_bytes"):
            entry = {"bytes_per_token": s["gguf_bytes"], "how": "the GGUF's file size (an upper bound: the whole "
                                                                "embedding table; KV cache not counted)"}
        else:
            continue
        entry.update(threads=th, read_gbs=g, **roofline_share(_tps(s), entry["bytes_per_token"], g))
        entry["share_run_best"] = entry["share"]
        near = adjacent_share(adjacent.get(r.name, []), entry["bytes_per_token"], min(int(th), 2))
        if near:  # the share the target judges: against the readings next to each pass
            entry.update(adjacent=near, share=near["share"])
        roofline["rows"][r.name] = entry
        s["roofline_share"] = entry["share"]

    (rdir / "raw.json").write_text(json.dumps(raw))
    run["ended_epoch"] = time.time()
    run["ended"] = _iso(run["ended_epoch"])
    run["duration_min"] = round((run["ended_epoch"] - run["started_epoch"]) / 60, 1)
    report = {"run": run, "checkpoints": {"name": name, "target": tgt, "draft": dft, "preset": args.preset,
                                          "standin": _standin_facts(target_ck)},
              "prompts": {"code": args.code_prompts, "prose": n - args.code_prompts, "count": n,
                          "sweep_prompt_indices": sweep_idx},
              "max_new_tokens": args.max_new_tokens, "decoding": "greedy", "repeats": args.repeats,
              "engines": {f"target {d}": f.record | ({"error": f.error} if f.error else {}) for d, f in folders.items()}
              | {f"draft {d.dtype}": d.record | ({"error": d.error} if d.error else {}) for d in drafts},
              "peer_builds": peer_builds, "attention_head": head_record,
              "systems": systems, "sweep": {"modes": sweep}, "roofline": roofline,
              "head_to_head": list(paired.values()), "targets": targets(systems, rows, roofline, paired),
              "load": load, "machine": machine(),
              "method": {"selection": "each row's fastest sweep configuration among those whose tokens matched "
                                      "edgespec's own plain at the same precision on every sweep prompt (if none "
                                      "matched: the fastest, flagged)",
                         "schedule": "sweep: configurations interleaved across rows; final: one process per (row, "
                                     "repeat), rows rotated each repeat; head to head: each ratio target's two rows "
                                     "on the same chunk of prompts back to back, which goes first alternating, "
                                     f"{args.paired_rounds} round(s) x {args.paired_chunks} chunks",
                         "judged_by": "the head-to-head median of per-chunk ratios where it ran, else the ratio "
                                      "of the final passes' medians"},
              "raw": _rel(str(rdir / "raw.json"))}
    write_report(report, args.out)
    print(markdown(report))
    return 0


def _standin_facts(ckpt: Path) -> dict | None:
    p = ckpt / "standin.json"
    if not p.is_file():
        return None
    s = json.loads(p.read_text())
    return {k: s.get(k) for k in ("name", "params", "bytes", "recipe")}


# ---- the report ------------------------------------------------------------------------------------------------
def write_report(report: dict, out: Path) -> None:
    """JSON, markdown and PNG beside `out`, after bench_peers.check_same_run (it raises instead of writing rows
    from two runs)."""
    check_same_run(report)
    out.parent.mkdir(parents=True, exist_ok=True)
    # the peers' build commands carry this machine's paths: the repository's are written relative to it
    out.write_text(_rel(json.dumps(report, indent=2)) + "\n")
    out.with_suffix(".md").write_text(_rel(markdown(report)))
    plot(report, out.with_suffix(".png"))


def _why(err: str) -> str:
    """A failed row's error on one line: a runner's stderr tail shortened to its last error line (an exception, a
    compiler's "error:"), else bench_peers._brief's last line."""
    head, _, tail = err.partition("stderr tail:")
    lines = [ln.strip() for ln in tail.splitlines() if ln.strip()]
    key = [ln for ln in lines if "Error" in ln or "error:" in ln or "Exception" in ln]
    return (head + key[-1]).replace("|", "/").replace("\n", " ") if key else _brief(err)


def _f(x, fmt=".1f", none="–"):
    return none if x is None else format(x, fmt)


def markdown(r: dict) -> str:
    run = r["run"]
    ck = r["checkpoints"]
    rows = [f"Run `{run['id']}`: {run['started']} .. {run['ended']} ({run['duration_min']} min), every row from this "
            f"run. Checkpoints: {ck['target']} (target), {ck['draft']} (draft); {r['prompts']['count']} prompts x "
            f"{r['max_new_tokens']} new tokens, greedy, {r['repeats']} repeat(s).", ""]
    tg = r.get("targets") or []
    if tg:
        rows += ["**Issue 28's targets:**", ""]
        for t in tg:
            mark = {True: "met", False: "NOT met", None: "not measured"}[t.get("met")]
            if "value" not in t:
                rows.append(f"- {t['target']}: {mark} ({t.get('why', '')})")
            elif "b" in t and t.get("b") and t.get("paired"):
                h = t["paired"]
                rows.append(f"- {t['target']}: **{t['value']:.2f}x** head to head (median of {h['trials_ok']} "
                            f"back-to-back chunks, quartiles {h['ratio_q1']:.2f}-{h['ratio_q3']:.2f}x; {t['a']} "
                            f"{h['a_tokens_per_s_median']:.1f} vs {t['b']} {h['b_tokens_per_s_median']:.1f} tok/s); "
                            f"final passes {t['value_final_passes']:.2f}x ({t['a_tokens_per_s']:.1f} vs "
                            f"{t['b_tokens_per_s']:.1f}): {mark}" + (f" ({t['why']})" if t.get("why") else ""))
            elif "b" in t and t.get("b"):
                rows.append(f"- {t['target']}: **{t['value']:.2f}x** ({t['a']} {t['a_tokens_per_s']:.1f} vs {t['b']} "
                            f"{t['b_tokens_per_s']:.1f} tok/s): {mark}" + (f" ({t['why']})" if t.get("why") else ""))
            else:
                rows.append(f"- {t['target']}: **{100 * t['value']:.0f}%**: {mark}")
        rows.append("")
    rows += ["| row | tok/s median (min–max) | acceptance | identical to edgespec plain (reference) | "
             "% of DRAM roofline | peak RSS MiB | configuration (best in the sweep) |", "|---|---|---|---|---|---|---|"]
    for name, s in r["systems"].items():
        if s["status"] != "ok":
            rows.append(f"| {name} | {s['status']}: {_why(s.get('error', ''))[:240]} | | | | | |")
            continue
        t = s["tokens_per_s"]
        same = s.get("identical_prompts", "–")
        if s.get("agreement_reference"):
            same += f" ({s['agreement_reference'].replace('edgespec plain ', '')})"
        if s.get("identical_to_own_plain"):
            same += f"; own plain {s['identical_to_own_plain']}"
        cfg = s.get("config", "") + (f" (of {s['selected_from']})" if s.get("selected_from", 1) > 1 else "")
        rows.append(f"| {name} | {t['median']:.1f} ({t['min']:.1f}–{t['max']:.1f}) | "
                    f"{_f(s.get('acceptance_rate'), '.3f')} "
                    f"| {same} | {_f(100 * s['roofline_share'] if s.get('roofline_share') else None, '.0f')} | "
                    f"{s['peak_rss_mib']:.0f} | {cfg} |")
    rf = r["roofline"]
    bwl = []
    for k, m in enumerate(rf["bandwidth_measurements"]):
        bwl.append(("before" if k == 0 else "after") + ": " + ", ".join(
            f"{t} thread{'s' if t != '1' else ''} {v['gbs_best']:.1f} GB/s (median {v['gbs_median']:.1f})"
            if "gbs_best" in v else f"{t}: {v.get('error')}" for t, v in m.items() if isinstance(v, dict))
            if "error" not in m else f"error: {m['error']}")
    rows += ["", "DRAM read bandwidth (bench/lib/membw.c, a native read loop over 512 MiB): "
                 f"{'; '.join(bwl)}. Roofline rows use the best at their thread count; KV cache at the prompts' "
                 f"mean context ({rf['mean_context_tokens']:.0f} tokens).", ""]
    for name, e in rf["rows"].items():
        run_best = e.get("share_run_best", e["share"])
        line = (f"- {name}: {e['bytes_per_token'] / 1e6:.1f} MB per token ({e['how']}) x "
                f"{_tps(r['systems'][name]):.1f} tok/s = {e['achieved_gbs']:.1f} GB/s of {e['read_gbs']:.1f} (the "
                f"run's best) at {e['threads']} thread(s): {100 * run_best:.0f}% (roofline "
                f"{e['roofline_tokens_per_s']:.1f} tok/s)")
        if e.get("adjacent"):
            a = e["adjacent"]
            line += ("; against the read loop right before and after each pass (" + ", ".join(
                f"{p['tokens_per_s']:.1f} tok/s of {p['read_gbs']:.1f} GB/s" for p in a["passes"])
                + f"): **{100 * a['share']:.0f}%**, the share the target judges")
        else:
            line = line.replace(f": {100 * run_best:.0f}%", f": **{100 * run_best:.0f}%**")
        rows.append(line)
    ld = r.get("load", {})
    rows += ["", "Machine load (load average 1/5/15 min; other processes' CPU, % of one core): " + "; ".join(
        f"{k} {v['loadavg_1_5_15']}, others {v['others_cpu_percent']}%"
        + (" (" + ", ".join(f"{b['name']} {b['cpu_percent']}%" for b in v["busiest_others"][:3]) + ")"
           if v["busiest_others"] else "") for k, v in ld.items()), ""]
    rows += ["Engine folders (`edgespec export`):", ""]
    for k, e in r["engines"].items():
        rows.append(f"- {k}: `{e.get('command')}`" + (f" failed: {e['error']}" if e.get("error") else
                    f", {'reused' if e.get('reused') else 'exported in ' + str(e.get('export_s')) + ' s'}"
                    f"; native: {e.get('native') or 'none'}"
                    + (f"; precision gate {e.get('precision_gate')}" if e.get("precision_gate") else "")))
    h = r.get("attention_head")
    if h:
        rows.append(f"- attention head: `{h['given']}` (sha256 {h['sha256']}, {h['width']} wide"
                    + (f", widened to {h['widened_to']}: `{h['path']}`" if h.get("widened_to") else "") + ")"
                    + (f", trained by `{h['trained_by']}` ({h.get('windows')} windows, {h.get('training_minutes')} "
                       "min)" if h.get("trained_by") else ""))
    rows += ["", "Peer builds (one short runner call each, before the sweep):", ""]
    for k, b in r["peer_builds"].items():
        rows.append(f"- {k}: {b['status']}" + (f" ({b['rows']} rows): {b['error']}" if b["status"] != "ok" else "")
                    + "".join(f"; {role} `{_rel(x['builder_command'])}`"
                              for role, x in (b.get("builds") or {}).items()))
    rows += ["", f"Every configuration tried (sweep: prompts {r['prompts']['sweep_prompt_indices']} of "
                 f"{r['prompts']['count']}, once each; {r['method']['selection']}):", "",
             "| row | configuration | tok/s | acceptance | identical | |", "|---|---|---|---|---|---|"]
    for name, tried in r["sweep"]["modes"].items():
        chosen = r["systems"].get(name, {}).get("config")
        for t in tried:
            if t["status"] != "ok":
                rows.append(f"| {name} | {t['config']} | failed: {_why(t['error'])[:200]} | | | |")
                continue
            rows.append(f"| {name} | {t['config']} | {t['tokens_per_s']['median']:.1f} | "
                        f"{_f(t.get('acceptance_rate'), '.3f')} | {t.get('identical_prompts', '–')} | "
                        f"{'**selected**' if t['config'] == chosen else ''} |")
    rows.append(f"\nCommand: `{run['command']}`")
    return "\n".join(rows) + "\n"


def plot(r: dict, path: Path) -> None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    names = list(r["systems"])
    if not names:
        return
    fig, ax = plt.subplots(figsize=(11, 0.32 * len(names) + 1.8))
    color = {"edgespec": "tab:green", "llama.cpp": "tab:purple", "ORT GenAI": "tab:blue"}
    y = np.arange(len(names))
    for i, nm in enumerate(names):
        s = r["systems"][nm]
        if s["status"] != "ok":
            ax.text(0, i, f"  {s['status']}", va="center", fontsize=7, color="grey")
            continue
        t = s["tokens_per_s"]
        ax.barh(i, t["median"], xerr=[[t["median"] - t["min"]], [t["max"] - t["median"]]],
                color=color.get(s.get("system"), "tab:orange"), alpha=0.9 if s.get("kind") == "plain" else 0.6)
        roof = r["roofline"]["rows"].get(nm)
        if roof:
            ax.plot([roof["roofline_tokens_per_s"]] * 2, [i - 0.4, i + 0.4], color="black", lw=1.5)
    ax.set_yticks(y, [f"{nm}\n{r['systems'][nm].get('config', '')[:60]}" for nm in names], fontsize=6)
    ax.invert_yaxis()
    ax.set_xlabel("tokens/s (median over repeats; whiskers min–max); black ticks: DRAM roofline of plain rows")
    ck = r["checkpoints"]
    ax.set_title(f"{ck['name']} stand-in, {r['prompts']['count']} prompts x {r['max_new_tokens']} tokens, greedy, "
                 f"{r.get('machine', {}).get('cores', '?')}-core CPU, run {r['run']['id']}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    raise SystemExit(main())
