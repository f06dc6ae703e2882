"""Write a checkpoint folder in exactly OpenVLA's layout (config.json, model.safetensors, preprocessor_config.json,
tokenizer.json) with seeded random weights and a tokenizer made here: what the OpenVLA import is tested on, since
no published weights can be downloaded. The weight names and shapes follow timm's ViTs and Prismatic's projector
(export/prismatic.py's docstring); the sizes are small by default.

    python -m edgespec.export.openvla_ckpt --out .cache/openvla-tiny [--backbone dinosiglip-vit-so-224px]

The text vocabulary is trained here (a BPE over robot instructions, Metaspace pieces like Llama 2's) and padded
with filler tokens to `text_vocab` ids; "<PAD>" follows, and the language model's vocabulary is that rounded up
to a multiple of 64, as OpenVLA pads Llama 2's 32000 + 1 to 32064. The action ids are then the last n_bins ids
below text_vocab, overlapping real tokens as OpenVLA's do.
"""
from __future__ import annotations

import argparse
import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from .prismatic import BACKBONES, EMPTY_PIECE, VIT_FAMILIES

PAD_MULTIPLE = 64
MLP_RATIO = {"vit_so400m_patch14_siglip_224": 3.7362, "vit_so400m_patch14_siglip_384": 3.7362}
WORDS = ("pick place put open close push pull move lift the a an up down left right red green blue yellow cup "
         "bowl drawer block can sponge spoon towel into onto on in of to from top bottom reach touch go target "
         "object table sink pot knife carrot eggplant corn").split()
BRIDGE_Q = ([-0.029, -0.041, -0.026, -0.081, -0.092, -0.203, 0.0], [0.028, 0.040, 0.040, 0.082, 0.076, 0.200, 1.0])


@dataclass
class TinyOpenVLA:
    """Sizes of a written checkpoint. vit_dims: one width per backbone, a multiple of its head size (None: two
    heads each)."""
    backbone: str = "dinosiglip-vit-so-224px"
    vit_dims: tuple | None = None
    vit_depth: int = 3
    image_size: int | None = None  # None: the backbone id's own (224)
    hidden: int = 128
    layers: int = 2
    heads: int = 4
    kv_heads: int = 4
    inter: int = 256
    text_vocab: int = 960
    n_bins: int = 256
    max_positions: int = 2048
    norm_stats: dict = field(default_factory=lambda: default_norm_stats())
    seed: int = 0

    def __post_init__(self):
        if self.backbone not in BACKBONES:
            raise ValueError(f"backbone must be one of {sorted(BACKBONES)}, got {self.backbone!r}")
        ids = BACKBONES[self.backbone][0]
        if self.vit_dims is None:
            self.vit_dims = tuple(2 * VIT_FAMILIES[x].head_dim for x in ids)
        self.vit_dims = tuple(int(d) for d in self.vit_dims)
        if len(self.vit_dims) != len(ids):
            raise ValueError(f"{self.backbone} has {len(ids)} backbones; vit_dims gives {len(self.vit_dims)} widths")
        for d, t in zip(self.vit_dims, ids):
            if d % VIT_FAMILIES[t].head_dim:
                raise ValueError(f"vit width {d} is not a multiple of {t}'s head size {VIT_FAMILIES[t].head_dim}")
        if self.text_vocab < self.n_bins + 64:
            raise ValueError(f"text_vocab {self.text_vocab} must leave room for {self.n_bins} action ids and words")


def default_norm_stats() -> dict:
    """Two datasets (so --unnorm-key matters), OpenVLA's nesting: {name: {"action": {...}, "proprio": {...}}}."""
    def entry(scale: float) -> dict:
        q01, q99 = (np.array(q) * scale for q in BRIDGE_Q)
        q01[6], q99[6] = 0.0, 1.0
        return {"action": {"mean": ((q01 + q99) / 2).tolist(), "std": ((q99 - q01) / 4).tolist(),
                           "max": (q99 * 1.5).tolist(), "min": (q01 * 1.5).tolist(), "q01": q01.tolist(),
                           "q99": q99.tolist(), "mask": [True] * 6 + [False]},
                "proprio": {k: [0.0] * 7 for k in ("mean", "std", "max", "min", "q01", "q99")},
                "num_transitions": 1000, "num_trajectories": 10}
    return {"bridge_orig": entry(1.0), "fractal20220817_data": entry(2.0)}


def build_tokenizer(text_vocab: int):
    """A BPE tokenizer with text_vocab ids (BOS "<s>" = 1 added to every encoding), then "<PAD>" = text_vocab."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    rng = np.random.default_rng(0)
    corpus = []
    for _ in range(4000):
        words = " ".join(rng.choice(WORDS, int(rng.integers(2, 9))))
        corpus.append(f"In: What action should the robot take to {words}?\nOut:")
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement=EMPTY_PIECE, prepend_scheme="first")
    tok.decoder = decoders.Metaspace(replacement=EMPTY_PIECE, prepend_scheme="first")
    alphabet = sorted(set("".join(corpus)) | {EMPTY_PIECE} | set("abcdefghijklmnopqrstuvwxyz0123456789.,?:!\n"))
    trainer = trainers.BpeTrainer(vocab_size=text_vocab, special_tokens=["<unk>", "<s>", "</s>"],
                                  initial_alphabet=alphabet, show_progress=False)
    tok.train_from_iterator(corpus, trainer)
    d = json.loads(tok.to_str())  # filler pieces into the model's own vocabulary (not added tokens), up to text_vocab
    vocab = d["model"]["vocab"]
    for i in range(len(vocab), text_vocab):
        vocab[f"<extra_{i}>"] = i
    tok = Tokenizer.from_str(json.dumps(d))
    if tok.get_vocab_size(with_added_tokens=False) != text_vocab:
        raise RuntimeError(f"tokenizer has {tok.get_vocab_size()} ids, wanted {text_vocab}")
    tok.add_special_tokens(["<PAD>"])
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", pair="<s> $A <s> $B",
                                                       special_tokens=[("<s>", 1)])
    return tok


def _vit_weights(rng, timm_id: str, dim: int, depth: int, image_size: int) -> dict[str, np.ndarray]:
    """Random weights under timm's names for one ViT of this family (pre-norm blocks, LayerScale for DINOv2)."""
    patch = 16 if "patch16" in timm_id else 14
    n = (image_size // patch) ** 2
    dinov2, siglip, clip = "dinov2" in timm_id, "siglip" in timm_id, "clip" in timm_id
    mlp = int(dim * MLP_RATIO.get(timm_id, 4.0))

    def lin(o, i, std=None):
        return rng.normal(0, std or i ** -0.5, (o, i)), rng.normal(0, 0.02, o)

    w = {"patch_embed.proj.weight": rng.normal(0, (3 * patch * patch) ** -0.5, (dim, 3, patch, patch))}
    if not clip:
        w["patch_embed.proj.bias"] = rng.normal(0, 0.02, dim)
    else:
        w["norm_pre.weight"], w["norm_pre.bias"] = 1 + rng.normal(0, 0.1, dim), rng.normal(0, 0.02, dim)
    n_prefix = 0
    if not siglip:
        w["cls_token"] = rng.normal(0, 0.5, (1, 1, dim))
        n_prefix = 1
    if dinov2:
        w["reg_token"] = rng.normal(0, 0.5, (1, 4, dim))
    w["pos_embed"] = rng.normal(0, 0.5, (1, n if (dinov2 or siglip) else n + n_prefix, dim))
    for b in range(depth):
        p = f"blocks.{b}."
        for ln in ("norm1", "norm2"):
            w[p + ln + ".weight"], w[p + ln + ".bias"] = 1 + rng.normal(0, 0.1, dim), rng.normal(0, 0.05, dim)
        w[p + "attn.qkv.weight"], w[p + "attn.qkv.bias"] = lin(3 * dim, dim)
        w[p + "attn.proj.weight"], w[p + "attn.proj.bias"] = lin(dim, dim)
        w[p + "mlp.fc1.weight"], w[p + "mlp.fc1.bias"] = lin(mlp, dim)
        w[p + "mlp.fc2.weight"], w[p + "mlp.fc2.bias"] = lin(dim, mlp)
        if dinov2:
            w[p + "ls1.scale_factor"] = rng.uniform(0.2, 1.0, dim)
            w[p + "ls2.scale_factor"] = rng.uniform(0.2, 1.0, dim)
    w["norm.weight"], w["norm.bias"] = np.ones(dim), np.zeros(dim)
    if siglip:  # the MAP head timm builds for SigLIP (global_pool="map"): in the file, never read
        w["attn_pool.latent"] = rng.normal(0, 0.02, (1, 1, dim))
        w["attn_pool.q.weight"], w["attn_pool.q.bias"] = lin(dim, dim)
        w["attn_pool.kv.weight"], w["attn_pool.kv.bias"] = lin(2 * dim, dim)
        w["attn_pool.proj.weight"], w["attn_pool.proj.bias"] = lin(dim, dim)
        w["attn_pool.norm.weight"], w["attn_pool.norm.bias"] = np.ones(dim), np.zeros(dim)
        w["attn_pool.mlp.fc1.weight"], w["attn_pool.mlp.fc1.bias"] = lin(mlp, dim)
        w["attn_pool.mlp.fc2.weight"], w["attn_pool.mlp.fc2.bias"] = lin(dim, mlp)
    return w


def text_config(t: TinyOpenVLA) -> dict:
    vocab = -(-(t.text_vocab + 1) // PAD_MULTIPLE) * PAD_MULTIPLE  # + <PAD>, rounded up like OpenVLA's 32064
    return {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": vocab,
            "hidden_size": t.hidden, "intermediate_size": t.inter, "num_hidden_layers": t.layers,
            "num_attention_heads": t.heads, "num_key_value_heads": t.kv_heads, "max_position_embeddings": t.max_positions,
            "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "hidden_act": "silu", "tie_word_embeddings": False,
            "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": t.text_vocab, "torch_dtype": "bfloat16"}


def language_model_weights(t: TinyOpenVLA) -> dict:
    """A random Llama of text_config(t) (transformers' own init, seeded) under `language_model.`."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = {k: v for k, v in text_config(t).items() if k not in ("model_type", "architectures", "torch_dtype")}
    torch.manual_seed(t.seed)
    lm = LlamaForCausalLM(LlamaConfig(**cfg))
    with torch.no_grad():  # wider than the 0.02 init, so the greedy choices are not near-ties
        for name, p in lm.named_parameters():
            if p.dim() == 2:
                p.normal_(0, p.shape[1] ** -0.5 if "embed" not in name else 1.0)
    return {f"language_model.{k}": v.detach().numpy() for k, v in lm.state_dict().items()}


def write_checkpoint(out: str | Path, t: TinyOpenVLA | None = None, dtype: str = "bfloat16",
                     extra: dict | None = None, drop: tuple = ()) -> Path:
    """Write an OpenVLA-layout folder at out. extra: more config.json fields (tests break the layout with it);
    drop: weight names to leave out."""
    import torch
    from safetensors.torch import save_file

    t = t or TinyOpenVLA()
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(t.seed)
    timm_ids, sizes = BACKBONES[t.backbone]
    sizes = [t.image_size or s for s in sizes]
    fused = len(timm_ids) == 2
    weights: dict[str, np.ndarray] = {}
    for i, (tid, d) in enumerate(zip(timm_ids, t.vit_dims)):
        name = ("featurizer", "fused_featurizer")[i]
        for k, v in _vit_weights(rng, tid, d, t.vit_depth, sizes[i]).items():
            weights[f"vision_backbone.{name}.{k}"] = v
    vd, e = sum(t.vit_dims), t.hidden
    dims = [(vd, 4 * vd), (4 * vd, e), (e, e)] if fused else [(vd, e), (e, e)]
    for j, (i, o) in enumerate(dims, 1):
        weights[f"projector.fc{j}.weight"] = rng.normal(0, i ** -0.5, (o, i))
        weights[f"projector.fc{j}.bias"] = rng.normal(0, 0.02, o)
    weights.update(language_model_weights(t))
    td = getattr(torch, dtype)
    tensors = {k: torch.from_numpy(np.ascontiguousarray(v)).to(td) for k, v in weights.items() if k not in drop}
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    config = {
        "arch_specifier": "no-align+fused-gelu-mlp" if fused else "no-align+gelu-mlp",
        "architectures": ["OpenVLAForActionPrediction"],
        "auto_map": {"AutoConfig": "configuration_prismatic.OpenVLAConfig",
                     "AutoModelForVision2Seq": "modeling_prismatic.OpenVLAForActionPrediction"},
        "hf_llm_id": "meta-llama/Llama-2-7b-hf", "image_resize_strategy": "resize-naive", "image_sizes": sizes,
        "llm_backbone_id": "llama2-7b-pure", "llm_max_length": 2048, "model_type": "openvla",
        "n_action_bins": t.n_bins, "norm_stats": t.norm_stats, "output_projector_states": False,
        "pad_to_multiple_of": PAD_MULTIPLE, "pad_token_id": t.text_vocab, "text_config": text_config(t),
        "timm_model_ids": list(timm_ids), "timm_override_act_layers": [None] * len(timm_ids),
        "torch_dtype": dtype, "transformers_version": "4.40.1", "use_fused_vision_backbone": fused,
        "vision_backbone_id": t.backbone, "edgespec_written": asdict(t) | {"norm_stats": "(above)"},
        **(extra or {})}
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    means = [list(VIT_FAMILIES[x].norm[0]) for x in timm_ids]
    stds = [list(VIT_FAMILIES[x].norm[1]) for x in timm_ids]
    pre = {"image_processor_type": "PrismaticImageProcessor", "processor_class": "PrismaticProcessor",
           "image_resize_strategy": "resize-naive", "input_sizes": [[3, s, s] for s in sizes],
           "interpolations": ["bicubic"] * len(timm_ids), "means": means, "stds": stds, "use_fused_vision_backbone": fused}
    (out / "preprocessor_config.json").write_text(json.dumps(pre, indent=2) + "\n")
    build_tokenizer(t.text_vocab).save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps(
        {"add_bos_token": True, "add_eos_token": False, "bos_token": "<s>", "eos_token": "</s>", "pad_token": "<PAD>",
         "unk_token": "<unk>", "tokenizer_class": "LlamaTokenizer", "model_max_length": 2048}, indent=2) + "\n")
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--backbone", default="dinosiglip-vit-so-224px", choices=sorted(BACKBONES))
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    t = TinyOpenVLA(backbone=args.backbone, seed=args.seed)
    print(f"wrote {write_checkpoint(args.out, t)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
