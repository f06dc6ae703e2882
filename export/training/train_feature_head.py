"""Distil a feature-level draft head (edgespec/text_head.py, EAGLE-style) for a FAST-token VLA policy from its
model folder (train_vla.py --actions fast): a numpy MLP that reads the target's final hidden state and the
token it emitted, guesses the next hidden state, and proposes the next FAST token from the target's own LM
head. The per-dimension head (train_draft_head.py) cannot serve FAST: a FAST id is a BPE piece of DCT
coefficients, not a bin of one dimension at one step.

    python -m edgespec.export.training.train_feature_head --model .cache/vla-fast/model \
        --demos .cache/vla/expert-train-6000.npz --val-demos .cache/vla/expert-val-100.npz
    edgespec export-policy .cache/vla-fast/model --out engines/vla-reacher-fast   # exports the target --hidden

1. Data: observations drawn (fixed seed) from the expert demonstrations (robots/demos.py; the target's own
   state distribution is close: it succeeds on 98% of episodes). The fp32 torch encoder and target (what the
   exported engines match within their gates) decode each chunk greedily, constrained to the action ids, to
   its END; the target's final hidden states at the rows that emitted the chunk's ids are kept. Blocks are
   cached under --work, so an interrupted run resumes.
2. Training: train_text_head.train, unrolled from every position of a chunk, masked past its END.
3. Validation: the runtime's rounds replayed on held-out chunks (`replay_rounds`): from each target call's
   hidden state the head chains γ proposals, the target keeps the agreeing prefix and adds its own token.
   Reported per γ: acceptance, tokens per target call, and target calls per chunk against plain decoding's.
Writes OUT (feature_head.npz in the model folder by default) and the report beside it (.json).
"""
from __future__ import annotations

import argparse
import inspect
import json
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from edgespec.policy_contract import FEATURE_HEAD_FILE

from .train_text_head import HeadConfig, train

SEED = 23


@dataclass
class DataConfig:
    train_obs: int = 48000  # observations drawn from --demos
    val_obs: int = 1000  # from --val-demos
    block: int = 500  # observations per cached block

    def __post_init__(self):
        for name, v in asdict(self).items():
            if v <= 0:
                raise ValueError(f"{name} must be > 0, got {v}")


def load_policy_model(model_dir: Path):
    """-> (prefix_groups, target LM (fp32, eval), instr_len, (lo, hi) action ids, END id or None, tokens per chunk).
    prefix_groups(obs) -> [(indices, prefix (b, P, E))]: the observations in groups of one prefix length. A FAST
    policy model folder (train_vla.py), or an OpenVLA- or Llava-layout checkpoint (a prompt policy: bins, its prefix
    the prompt's embeddings with the image rows)."""
    import torch
    from transformers import AutoModelForCausalLM

    from edgespec.fast_tokens import FastTokenizer

    from ..llava import is_llava_folder
    from ..prismatic import is_openvla_folder
    if is_openvla_folder(model_dir) or is_llava_folder(model_dir):
        return load_prompt_model(model_dir)
    from ..vla import load_encoder
    enc, policy, _ = load_encoder(model_dir)
    fast = policy.get("fast")
    if not fast:
        raise ValueError(f"{model_dir}/policy.json has no \"fast\": a feature head drafts FAST tokens (or a prompt "
                         f"policy's bins); this policy's head is train_draft_head.py's")
    target = AutoModelForCausalLM.from_pretrained(model_dir / "target", dtype=torch.float32).eval()
    lo, hi = int(policy["vocab_end"]) - int(policy["n_bins"]), int(policy["vocab_end"])
    end = FastTokenizer.load(model_dir / fast["file"]).end_id

    def groups(obs):
        x = enc(torch.from_numpy(obs["image"]), torch.from_numpy(obs["state"]), torch.from_numpy(obs["instr"]))
        return [(np.arange(len(obs["image"])), x)]
    return groups, target, int(policy["instr_len"]), (lo, hi), end, int(fast["max_tokens"])


def load_prompt_model(ckpt_dir: Path):
    """load_policy_model for an OpenVLA- or Llava-layout checkpoint: the prefix as the runtime builds it (the
    prompt's embeddings, the image rows after BOS or in place of the image token), grouped by instruction."""
    import torch
    from tokenizers import Tokenizer

    from ..llava import is_llava_folder, llava_source
    from ..openvla import openvla_source
    src = llava_source(ckpt_dir) if is_llava_folder(ckpt_dir) else openvla_source(ckpt_dir)
    _, stats = src.action_stats(next(iter(src.norm_stats)))  # a chunk's length (every dataset's is the same)
    tok = Tokenizer.from_file(str(src.tokenizer_path))
    lm = src.language_model.eval()
    table = lm.get_input_embeddings()

    def groups(obs):
        out = []
        for text in np.unique(obs["instruction"]):
            idx = np.nonzero(obs["instruction"] == text)[0]
            ids = src.prompt(tok, str(text))  # (L,)
            emb = table(torch.from_numpy(ids))[None].expand(len(idx), -1, -1)  # (b, L, E)
            rows = src.image_encoder(torch.from_numpy(obs["image"][idx]))  # (b, N, E)
            at = 1 if src.image_token_id is None else int(np.nonzero(ids == src.image_token_id)[0][0])
            skip = 0 if src.image_token_id is None else 1  # Llava: the image token itself is replaced
            out.append((idx, torch.cat([emb[:, :at], rows, emb[:, at + skip:]], 1)))
        return out
    return groups, lm, 6, (src.vocab_end - src.n_bins, src.vocab_end), None, stats.dims


def greedy_chunks(groups, target, obs: dict, ids_range: tuple[int, int], end: int | None, n: int) -> dict:
    """One block of observations -> the target's greedy chunks and hidden states, laid out for train():
    ids (B, n+1): a placeholder, then the chunk's ids c_0..c_{n-1}; hidden (B, n+1, E) fp16: row k is the final
    hidden state that emitted c_k (the prefix's last row for c_0); greedy (B, n+1): c_{k} at row k; valid
    (B, n+1): row k < the chunk's length (through END; all n without an END)."""
    import torch
    lo, hi = ids_range
    table = target.get_input_embeddings().weight
    # the KV cache's argument: `cache` in transformers 5.x, `past_key_values` before
    key = "cache" if "cache" in inspect.signature(target.model.forward).parameters else "past_key_values"
    b, e = len(obs["image"]), table.shape[1]
    c, hid = np.zeros((b, n), np.int64), np.zeros((b, n, e), np.float32)
    with torch.no_grad():
        for idx, x in groups(obs):
            out = target.model(inputs_embeds=x, use_cache=True)  # the prefill
            for k in range(n):
                h = out.last_hidden_state[:, -1]  # (b, E), after the final norm: the row that emits the next id
                nxt = target.lm_head(h)[:, lo:hi].argmax(-1) + lo  # (b,)
                c[idx, k], hid[idx, k] = nxt.numpy(), h.numpy()
                if k + 1 < n:
                    out = target.model(inputs_embeds=table[nxt][:, None], use_cache=True, **{key: getattr(out, key)})
    is_end = (c == end) if end is not None else np.zeros_like(c, bool)
    length = np.where(is_end.any(1), is_end.argmax(1) + 1, n)  # (B,) ids through END
    ids = np.zeros((b, n + 1), np.int64)
    ids[:, 1:] = c
    hidden = np.zeros((b, n + 1, e), np.float16)
    hidden[:, :n] = hid
    greedy = np.zeros((b, n + 1), np.int64)
    greedy[:, :n] = c
    valid = np.arange(n + 1)[None] < length[:, None]
    return {"ids": ids, "hidden": hidden, "greedy": np.where(valid, greedy, 0), "valid": valid}


def collect(model, demos: Path, count: int, seed: int, work: Path, name: str, cfg: DataConfig,
            progress: bool) -> dict:
    """`count` observations of the demonstrations file, through greedy_chunks in cached blocks -> one dict."""
    from tqdm import tqdm

    from .train_vla import load_demos
    groups, target, instr_len, ids_range, end, n = model
    work.mkdir(parents=True, exist_ok=True)
    paths = [work / f"{name}-{i:04d}.npz" for i in range(-(-count // cfg.block))]
    if not all(p.is_file() for p in paths):
        data = load_demos(demos, instr_len)
        if count > len(data["image"]):
            raise ValueError(f"{demos} has {len(data['image'])} observations, {count} were asked for")
        pick = np.sort(np.random.default_rng(seed).choice(len(data["image"]), count, replace=False))
        for i, path in enumerate(tqdm(paths, desc=f"target chunks ({name})", disable=not progress)):
            if path.is_file():
                continue
            idx = pick[i * cfg.block:(i + 1) * cfg.block]
            obs = {k: data[k][idx] for k in ("image", "state", "instr", "instruction")}
            block = greedy_chunks(groups, target, obs, ids_range, end, n)
            tmp = path.with_suffix(".partial.npz")
            np.savez(tmp, **block)
            tmp.replace(path)
    parts = [np.load(p) for p in paths]
    return {k: np.concatenate([z[k] for z in parts]) for k in ("ids", "hidden", "greedy", "valid")}


def replay_rounds(head, data: dict, gamma: int, stop_below: float = 0.0) -> dict:
    """The runtime's rounds on held-out chunks (TextHeadDraft + exact acceptance): the chunk's prefill emits c_0;
    each round the head chains up to γ proposals from the hidden state that emitted the chunk's last id, the
    target keeps the agreeing prefix and adds its own next id. -> acceptance, tokens per target call, calls."""
    ids, hid, valid = data["ids"], data["hidden"].astype(np.float32), data["valid"]
    n = ids.shape[1] - 1  # the most ids a chunk takes
    drafted = kept = calls = tokens = 0
    by_pos_tried, by_pos_kept = np.zeros(gamma), np.zeros(gamma)
    for i in range(len(ids)):
        # the chunk: its ids through END (length), then what the target's greedy decoding would have emitted
        # after END, which a round can also accept (the ids are dropped, the acceptance counts, as in the runtime)
        length, chunk = int(valid[i].sum()), ids[i, 1:]
        pos, calls, tokens = 0, calls + 1, tokens + length  # the prefill emits c_0
        while pos < length - 1:
            props, g = [], min(gamma, n - 2 - pos)  # the round's own id is one of the n - 1 - pos left
            tok, pr = head.first(hid[i, pos], int(chunk[pos])) if g else (None, 0.0)
            for j in range(g):  # the drafter proposes without knowing what the target will keep
                props.append(tok)
                if pr < stop_below or j + 1 == g:
                    break
                tok, pr = head.next(tok)
            acc = 0
            while acc < len(props) and props[acc] == chunk[pos + 1 + acc]:  # pos + 1 + acc < n: g's cap
                acc += 1
            drafted, kept, calls = drafted + len(props), kept + acc, calls + 1
            by_pos_tried[:min(acc + 1, len(props))] += 1  # a position counts when the ones before it were kept
            by_pos_kept[:acc] += 1
            pos += acc + 1  # the kept proposals and the target's own next id
    return {"gamma": gamma, "stop_below": stop_below, "drafted": drafted, "accepted": kept,
            "acceptance": round(kept / max(drafted, 1), 4),
            "acceptance_by_position": [round(float(k / t), 4) if t else None
                                       for k, t in zip(by_pos_kept, by_pos_tried)],
            "tokens_per_target_call": round(tokens / calls, 3),
            "target_calls_per_chunk": round(calls / len(ids), 3),
            "plain_calls_per_chunk": round(tokens / len(ids), 3)}


def report_for(gammas=(2, 3, 4, 6)):
    def report(w, val: dict) -> dict:
        from edgespec.text_head import TextHead
        head = TextHead(w)
        return {"chunks": int(len(val["ids"])), "rounds": [replay_rounds(head, val, g) for g in gammas]}
    return report


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m edgespec.export.training.train_feature_head", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, required=True, help="a FAST policy model folder (train_vla.py)")
    ap.add_argument("--demos", type=Path, default=Path(".cache/vla/expert-train-6000.npz"))
    ap.add_argument("--val-demos", type=Path, default=Path(".cache/vla/expert-val-100.npz"))
    ap.add_argument("--out", type=Path, default=None, help=f"default: MODEL/{FEATURE_HEAD_FILE}")
    ap.add_argument("--work", type=Path, default=Path(".cache/feature-head"), help="cached chunk blocks")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    ap.add_argument("--quiet", action="store_true")
    head_args = {"hidden": 256, "unroll": 4, "epochs": 60, "batch": 512, "lr": 4e-3, "feature_weight": 0.1}
    for f, v in {**asdict(DataConfig()), **head_args}.items():
        ap.add_argument(f"--{f.replace('_', '-')}", type=type(v), default=v)
    args = ap.parse_args(argv)
    import torch
    try:
        dcfg = DataConfig(**{f: getattr(args, f) for f in asdict(DataConfig())})
        model = load_policy_model(args.model)
        n = model[5]
        hcfg = HeadConfig(**{f: getattr(args, f) for f in head_args}, seq_len=n + 1)
    except (ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.threads:
        torch.set_num_threads(args.threads)
    t0 = time.time()
    out = args.out or args.model / FEATURE_HEAD_FILE
    progress = not args.quiet
    from edgespec.files import file_sha256
    weights = sorted(args.model.glob("target/model*.safetensors")) or sorted(args.model.glob("model*.safetensors"))
    key = f"{file_sha256(weights[0])[:12]}-{SEED}"  # the target's weights name the cached blocks
    data = collect(model, args.demos, dcfg.train_obs, SEED, args.work, f"train-{key}-{dcfg.train_obs}", dcfg,
                   progress)
    val = collect(model, args.val_demos, dcfg.val_obs, SEED + 1, args.work, f"val-{key}-{dcfg.val_obs}", dcfg,
                  progress)
    target, (lo, hi) = model[1], model[3]
    embed = np.ascontiguousarray(target.get_input_embeddings().weight.detach().numpy(), np.float32)
    lm = np.ascontiguousarray(target.lm_head.weight.detach().numpy(), np.float32)
    seen = np.unique(data["greedy"][data["valid"]])  # the action ids the target chose: the head's vocabulary
    if seen.min() < lo or seen.max() >= hi:
        raise AssertionError(f"greedy ids outside the action ids {lo}..{hi - 1}")  # the decode is constrained
    w, report = train(data, val, embed, lm, hcfg, progress, vocab=seen, report=report_for())
    out.parent.mkdir(parents=True, exist_ok=True)
    w.save(out)
    meta = {"command": "python -m edgespec.export.training.train_feature_head "
                       + " ".join(argv if argv is not None else sys.argv[1:]),
            "model": str(args.model), "data": asdict(dcfg), "head": asdict(hcfg), "vocab": int(len(seen)),
            "train_chunks": int(len(data["ids"])), "mean_chunk_tokens": round(float(data["valid"].sum(1).mean()), 3),
            "validation": report, "minutes": round((time.time() - t0) / 60, 1)}
    out.with_suffix(".json").write_text(json.dumps(meta, indent=2) + "\n")
    print(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
