"""Export-time validation gates. Each returns a report dict; `require` raises GateError with the worst diff.

1. parity:  ONNX Runtime fp32 logits vs the eager reference, at past length 0, mid and near capacity,
            with garbage in the stale cache rows (NaN, inf and huge keys, huge values: they must be masked).
            Judged against the logits' scale: max |diff| <= PARITY_TOL * max(1, max |reference logit|), since
            fp32 rounding over a long context grows with the logits; and beside it top-1 agreement on the
            teacher-forced tokens: every position whose reference top-2 margin exceeds twice that tolerance
            (a closer pair may legitimately swap) must have the reference's argmax.
2. verify:  one S = k+1 verify pass vs k+1 single-token steps on the same engine (the same scale rule; the
            cache rows against the cache's own scale).
3. agreement (precision variants): top-1 agreement and mean KL(fp32 || variant) over >= 1000
            teacher-forced tokens.
4. precision (precision variants): a fp16 / int8 / int4 target keeps top-1 agreement >= 0.99 with fp32 on
            held-out tokens, or the export is refused (unless allow_lossy, which engine.json records).

The gates stay sharp: a wrong rotary base, a missing bias or a broken mask moves the logits by far more than
rounding does (tests/test_gates.py breaks each on purpose and expects a refusal).
"""
from __future__ import annotations

import zlib
from pathlib import Path

import numpy as np

from edgespec import contract as C
from edgespec.masks import step_inputs

PARITY_TOL = 1e-4
PRECISION_TOP1 = 0.99  # the design's gate: a target below fp32 agrees with fp32 on >= 99% of top-1 tokens
ROLES = ("target", "draft")  # what an engine is exported for; the precision gate binds targets only


class GateError(RuntimeError):
    pass


def _empty_past(m: C.Manifest, batch: int, rows: int, rng=None) -> list[np.ndarray]:
    """Cache buffers (B, Hkv, rows, D): zeros, or with rng garbage in every row: keys with NaN, inf and huge
    values, values with huge ones (the graph stores only finite values, so a stale value row is finite)."""
    shape = (batch, m.num_kv_heads, rows, m.head_dim)
    if rng is None:
        return [np.zeros(shape, m.cache_dtype) for _ in range(2 * m.num_layers)]
    return [garbage(shape, m.cache_dtype, rng, finite=j % 2 == 1) for j in range(2 * m.num_layers)]


def garbage(shape, dtype, rng, finite: bool) -> np.ndarray:
    """Random rows with huge values (and NaN / +-inf unless finite) that a masked row must never let through."""
    a = rng.standard_normal(shape) * 3
    huge = float(np.finfo(dtype).max) / 4
    a[rng.random(shape) < 0.05] = huge
    a[rng.random(shape) < 0.05] = -huge
    if not finite:
        a[rng.random(shape) < 0.05] = np.nan
        a[rng.random(shape) < 0.05] = np.inf
        a[rng.random(shape) < 0.05] = -np.inf
    return a.astype(dtype)


def _feeds(m: C.Manifest, first: np.ndarray, small: dict, past: list[np.ndarray]) -> dict:
    feeds = {m.inputs[0].name: first, **small}
    for i in range(m.num_layers):
        feeds[C.past_key(i)], feeds[C.past_value(i)] = past[2 * i], past[2 * i + 1]
    return feeds


def step(engine, tokens: np.ndarray, buffers: list[np.ndarray], length: int, embed=None) -> np.ndarray:
    """Feed tokens (1, S) at committed `length` over full `buffers` through a plain `session.run`; the
    buffers become the returned `present`s; return logits (1, S, V)."""
    m = engine.manifest
    s = tokens.shape[1]
    cap = buffers[0].shape[2]
    first = tokens if embed is None else embed[tokens]
    out = engine.run(_feeds(m, first, step_inputs(m, np.array([length]), s, cap), buffers))
    for buf, (_, present) in zip(buffers, C.cache_names(m.num_layers)):
        buf[...] = out[present]
    return out[C.LOGITS]


def scaled_tolerance(scale: float, tol: float = PARITY_TOL) -> float:
    """The absolute bound for values of magnitude up to `scale`: tol x max(1, scale)."""
    return float(tol * max(1.0, scale))


def _top1(got: np.ndarray, want: np.ndarray, tol: float) -> tuple[int, int]:
    """(positions where the argmax differs though the reference's top-2 margin exceeds 2 tol, positions
    with such a margin): got, want (..., V)."""
    w = want.reshape(-1, want.shape[-1]).astype(np.float64)
    g = got.reshape(-1, got.shape[-1])
    top2 = np.sort(w, axis=-1)[:, -2:]
    decisive = (top2[:, 1] - top2[:, 0]) > 2 * tol
    wrong = decisive & (g.argmax(-1) != w.argmax(-1))
    return int(wrong.sum()), int(decisive.sum())


def parity_reference(reference, vocab_size: int, max_context: int, seed: int = 0) -> list[tuple]:
    """The parity gate's sequences and the reference's logits for them: [(label, ids (1, T), cuts, logits
    (1, T, V))], a 4-token call at past length 0 ("past0") and one sequence of max_context tokens ("long") fed
    in chunks (cuts: (start, end) per call): a prefill to half, a 4-token step there (mid), a prefill to near
    capacity and a 4-token step at the end (near_capacity). Computed apart from the engine, so that the
    exporter can let the checkpoint go before it opens the fp32 session."""
    import torch

    rng = np.random.default_rng(seed)
    s = 4
    mid, near = max(0, min(max_context // 2, max_context - 2 * s)), max(0, max_context - s)
    ids0 = rng.integers(0, vocab_size, size=(1, s), dtype=np.int64)
    ids = rng.integers(0, vocab_size, size=(1, max(near + s, mid + s)), dtype=np.int64)
    cases = []
    for label, seq, cuts in (("past0", ids0, [(0, s)]),
                             ("long", ids, [(0, mid), (mid, mid + s), (mid + s, near), (near, near + s)])):
        with torch.no_grad():
            want = reference(torch.from_numpy(seq)).numpy()  # (1, T, V): one forward for every chunk
        cases.append((label, seq, [(a, b) for a, b in cuts if b > a], want))
    return cases


def parity_gate(engine, reference, max_context: int, seed: int = 0, embed=None) -> dict:
    """Worst |ORT - reference| over parity_reference's calls (reference: a ReferenceDecoder, or the cases
    parity_reference made), every position compared; against the logits' scale, with top-1 agreement on
    every decisive position. The cache starts as garbage in every row."""
    m = engine.manifest
    cases = reference if isinstance(reference, list) else parity_reference(reference, m.vocab_size, max_context, seed)
    rng = np.random.default_rng([seed, 1])
    s = 4
    mid, near = max(0, min(max_context // 2, max_context - 2 * s)), max(0, max_context - s)
    report, pairs = {}, []
    for _, seq, cuts, want in cases:
        buffers = _empty_past(m, 1, max_context, rng)  # garbage everywhere: stale rows must be masked
        for a, b in cuts:
            got = step(engine, seq[:, a:b], buffers, a, embed)
            w = want[:, a:b]
            name = {0: "past0", mid: "mid", near: "near_capacity"}.get(a) if b - a == s else None
            worst = float(np.max(np.abs(got - w)))  # np.max keeps a NaN
            key = name or f"prefill_{a}_{b}"
            report[key] = {"past_length": a, "tokens": b - a, "max_abs_diff": worst,
                           "max_abs_logit": float(np.abs(w).max())}
            pairs.append((got, w))
    scale = max(r["max_abs_logit"] for r in report.values())
    tol = scaled_tolerance(scale)
    wrong = decisive = 0
    for got, want in pairs:
        a, b = _top1(got, want, tol)
        wrong, decisive = wrong + a, decisive + b
    report["max_abs_diff"] = float(np.max([r["max_abs_diff"] for r in report.values()]))
    report["max_abs_logit"] = scale
    report["tolerance"] = tol
    report["relative_tolerance"] = PARITY_TOL
    report["top1"] = {"disagree": wrong, "decisive_tokens": decisive,
                      "agreement": 1.0 - wrong / decisive if decisive else 1.0}
    return report


def verify_gate(engine, max_context: int, k: int = 4, seed: int = 1, embed=None) -> dict:
    """One verify pass of S = k+1 tokens vs k+1 single-token steps, from a random prefix."""
    m = engine.manifest
    rng = np.random.default_rng(seed)
    prefix = min(37, max_context - k - 1)
    ids = rng.integers(0, m.vocab_size, size=(1, prefix + k + 1), dtype=np.int64)
    buf_a, buf_b = _empty_past(m, 1, max_context), _empty_past(m, 1, max_context)
    step(engine, ids[:, :prefix], buf_a, 0, embed)
    for a, b in zip(buf_a, buf_b):
        b[...] = a
    verify = step(engine, ids[:, prefix:], buf_a, prefix, embed)
    singles = np.concatenate([step(engine, ids[:, prefix + j:prefix + j + 1], buf_b, prefix + j, embed)
                              for j in range(k + 1)], axis=1)
    rows = prefix + k + 1
    cache = float(np.max([np.abs(a[:, :, :rows].astype(np.float32) - b[:, :, :rows]).max()
                          for a, b in zip(buf_a, buf_b)]))
    cache_scale = float(np.max([np.abs(b[:, :, :rows].astype(np.float32)).max() for b in buf_b]))
    scale = float(np.abs(singles).max())
    wrong, decisive = _top1(verify, singles, scaled_tolerance(scale))
    return {"k": k, "max_abs_diff": float(np.abs(verify - singles).max()), "max_abs_logit": scale,
            "tolerance": scaled_tolerance(scale), "cache_max_abs_diff": cache,
            "cache_tolerance": scaled_tolerance(cache_scale), "relative_tolerance": PARITY_TOL,
            "top1": {"disagree": wrong, "decisive_tokens": decisive,
                     "agreement": 1.0 - wrong / decisive if decisive else 1.0}}


def require(name: str, report: dict) -> None:
    """GateError unless the report's differences are within its tolerances and no decisive top-1 differs."""
    problems = []
    for key, tol_key in (("max_abs_diff", "tolerance"), ("cache_max_abs_diff", "cache_tolerance")):
        if key not in report:
            continue
        worst, tol = float(report[key]), float(report[tol_key])
        if not np.isfinite(worst) or worst > tol:
            scale = report.get("max_abs_logit") if key == "max_abs_diff" else None
            against = f" ({report['relative_tolerance']:.0e} x max(1, max |logit| {scale:.3g}))" if scale is not None else ""
            problems.append(f"worst |difference| {worst:.3e} > tolerance {tol:.3e}{against}"
                            + (" in the cache rows" if key.startswith("cache") else ""))
    top1 = report.get("top1")
    if top1 and top1["disagree"]:
        problems.append(f"top-1 differs on {top1['disagree']} of {top1['decisive_tokens']} teacher-forced tokens "
                        f"whose reference margin exceeds the tolerance")
    if problems:
        raise GateError(f"validation gate '{name}' failed: " + "; ".join(problems) + f"\nreport: {report}")


def log_softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    x = x - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


def teacher_forced(engine, token_rows: list, embed=None) -> list[np.ndarray]:
    """Each row through `engine` from an empty cache: its logits (S, V). A row is token ids (S,), or (x, start):
    x token ids (S,) or input embeddings (S, E)."""
    out = []
    for row in token_rows:
        x, _ = row if isinstance(row, tuple) else (row, 0)
        x = np.asarray(x)
        embedded = x.dtype.kind == "f"  # (S, E) embeddings go in as they are
        feed = x.astype(np.float32)[None] if embedded else x.astype(np.int64)[None]
        cap = feed.shape[1]
        out.append(step(engine, feed, _empty_past(engine.manifest, 1, cap), 0, None if embedded else embed)[0])
    return out


def agreement(base_engine, variant_engine, token_rows: list, embed=None, embed_variant=None) -> dict:
    """Teacher-force each row through both engines; top-1 agreement (over the manifest's argmax range: the ids
    the runtime picks among) and mean KL(base || variant). A row is token ids (S,), or (x, start): x token
    ids (S,) or input embeddings (S, E), only positions >= start scored (e.g. a policy's prefix is context,
    its actions are what is decoded). base_engine may also be the base's logits from teacher_forced(), so
    that the two engines need not be in memory together."""
    base = base_engine if isinstance(base_engine, list) else teacher_forced(base_engine, token_rows, embed)
    variant = teacher_forced(variant_engine, token_rows, embed_variant)
    return compare_logits(base, variant, token_rows, *variant_engine.manifest.argmax_range)


def compare_logits(base: list[np.ndarray], variant: list[np.ndarray], token_rows: list, lo: int, hi: int) -> dict:
    """agreement's numbers for two lists of teacher-forced logits (S, V) of token_rows: top-1 agreement over
    ids [lo, hi) and mean KL(base || variant)."""
    agree, kls, n = 0, [], 0
    for row, a, b in zip(token_rows, base, variant):
        start = row[1] if isinstance(row, tuple) else 0
        a, b = a[start:], b[start:]
        la, lb = log_softmax(a), log_softmax(b)
        agree += int((a[:, lo:hi].argmax(-1) == b[:, lo:hi].argmax(-1)).sum())
        kls.append((np.exp(la) * (la - lb)).sum(-1))
        n += a.shape[0]
    return {"tokens": n, "top1_agreement": agree / n, "mean_kl": float(np.concatenate(kls).mean())}


def precision_gate(agree: dict, precision: str, role: str, allow_lossy: bool = False,
                   threshold: float = PRECISION_TOP1) -> dict:
    """The precision gate on an `agreement` report of a variant below fp32 (fp16, int8, int4, int8-dynamic)
    vs fp32; returns the record that engine.json keeps (validation.precision_gate). A target below `threshold`
    raises GateError, with the numbers, unless `allow_lossy` (then `overridden` is recorded). A draft is
    reported, never refused: the target verifies every draft token, so a lossy draft lowers the acceptance
    rate (speed), never changes the output."""
    if role not in ROLES:
        raise ValueError(f"role must be one of {ROLES}, got {role!r}")
    if not (isinstance(threshold, (int, float)) and 0 < threshold <= 1):
        raise ValueError(f"the precision gate's threshold must be a top-1 agreement in (0, 1], got {threshold!r}")
    top1, tokens = float(agree["top1_agreement"]), int(agree["tokens"])
    passed = top1 >= threshold
    enforced = role == "target"
    if enforced and not passed and not allow_lossy:
        raise GateError(f"validation gate 'precision' failed: the {precision} target agrees with fp32 on the "
                        f"top-1 token for {top1:.4f} of {tokens} held-out tokens ({agree.get('text', '?')}; "
                        f"mean KL {float(agree.get('mean_kl', float('nan'))):.2e}); expected >= {threshold} "
                        f"(the gate for every target below fp32). Export at a higher precision (fp16 or int8 "
                        f"keep more than int4), use it as a draft instead (--role draft: the target verifies "
                        f"every token), or pass --allow-lossy (allow_lossy=True) to export it anyway (engine.json "
                        f"records the override)")
    return {"threshold": threshold, "top1": top1, "tokens": tokens, "role": role, "enforced": enforced,
            "passed": passed, "overridden": enforced and not passed and allow_lossy}


def calibration_rows(ckpt_dir: Path, vocab_size: int, n_tokens: int = 1024, seq: int = 256) -> tuple[list, str]:
    """Token rows for the agreement report: held-out Python stdlib code through the checkpoint's tokenizer,
    or random ids when the checkpoint has no tokenizer (random-init test models)."""
    rows_needed = -(-n_tokens // seq)
    tok_path = Path(ckpt_dir) / "tokenizer.json"
    if tok_path.is_file():
        import sysconfig

        from tokenizers import Tokenizer
        tok = Tokenizer.from_file(str(tok_path))
        root = Path(sysconfig.get_paths()["stdlib"])
        ids: list[int] = []
        for p in sorted(root.glob("*.py")):  # same held-out rule as train_demo.py
            if zlib.crc32(str(p.relative_to(root)).encode()) % 50 == 0:
                ids.extend(tok.encode(p.read_text(encoding="utf-8", errors="replace")).ids)
            if len(ids) >= rows_needed * seq:
                break
        if len(ids) >= rows_needed * seq:
            arr = np.asarray(ids[:rows_needed * seq], dtype=np.int64).reshape(rows_needed, seq)
            return [r for r in arr if r.max() < vocab_size], "python-stdlib held-out code"
    rng = np.random.default_rng(0)
    return [rng.integers(0, vocab_size, size=seq) for _ in range(rows_needed)], "random token ids"
