"""OpenVLA's checkpoint layout (Kim et al. 2024, built on Prismatic VLMs), read and re-implemented in torch: the
reference the OpenVLA import (export/openvla.py) is gated against. Learned from openvla/openvla's
prismatic/extern/hf (configuration_prismatic.py, modeling_prismatic.py, processing_prismatic.py) and timm's
VisionTransformer; written here without timm.

A checkpoint folder (openvla/openvla-7b and its fine-tunes):
  config.json              model_type "openvla": vision_backbone_id, llm_backbone_id, use_fused_vision_backbone,
                           image_sizes, timm_model_ids, text_config (the language model's config),
                           pad_to_multiple_of, n_action_bins, norm_stats {dataset: {"action": {q01, q99, mask}}}
  model*.safetensors       vision_backbone.featurizer.*        timm ViT (DINOv2 / SigLIP / CLIP / IN1k)
                           vision_backbone.fused_featurizer.*  the second ViT of a fused backbone (dinosiglip)
                           projector.fc1, fc2 (, fc3 when fused)
                           language_model.model.*, language_model.lm_head.weight
  preprocessor_config.json means / stds per backbone (falls back to each timm model's own)
  tokenizer.json           the language model's tokenizer (adds BOS)

The forward pass (OpenVLAForActionPrediction.predict_action):
  pixels_i   = (image / 255 - mean_i) / std_i                      image (S, S, 3) uint8, one per backbone
  patches_i  = ViT_i(pixels_i) after its second-to-last block, prefix tokens dropped       (N, D_i)
  img        = projector(concat_i patches_i)                      (N, E)   fused: fc1 gelu fc2 gelu fc3
  ids        = tokenizer(prompt) (BOS first) + [id of "▁"] unless it already ends with it
  x          = [embed(ids[0]), img, embed(ids[1:])]               the image rows go right after BOS
  action ids = D greedy steps of the language model;  bin = clip(vocab_end - id - 1, 0, n_bins - 2)
  with vocab_end = text_config.vocab_size - pad_to_multiple_of and D = len(norm_stats[key].action.q01)
A ViT block is pre-norm: x += ls1 * attn(norm1(x)); x += ls2 * mlp(norm2(x)) (ls: DINOv2's LayerScale, saved
as `scale_factor`). Sizes are read from the weights; per timm model only the head size, activation, norm eps
and default normalisation are known facts (VIT_FAMILIES).
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path


IMAGENET = ((0.485, 0.456, 0.406), (0.229, 0.224, 0.225))
HALF = ((0.5, 0.5, 0.5), (0.5, 0.5, 0.5))
OPENAI_CLIP = ((0.48145466, 0.4578275, 0.40821073), (0.26862954, 0.26130258, 0.27577711))


@dataclass(frozen=True)
class VitFamily:
    """What a timm model id fixes that its weights do not show."""
    head_dim: int
    act: str  # "gelu" (exact) | "quick_gelu"
    eps: float  # LayerNorm epsilon
    norm: tuple  # default (mean, std) of its preprocessing


VIT_FAMILIES = {
    "vit_large_patch14_reg4_dinov2.lvd142m": VitFamily(64, "gelu", 1e-6, IMAGENET),
    "vit_so400m_patch14_siglip_224": VitFamily(72, "gelu", 1e-6, HALF),
    "vit_so400m_patch14_siglip_384": VitFamily(72, "gelu", 1e-6, HALF),
    "vit_large_patch14_clip_224.openai": VitFamily(64, "quick_gelu", 1e-5, OPENAI_CLIP),
    "vit_large_patch14_clip_336.openai": VitFamily(64, "quick_gelu", 1e-5, OPENAI_CLIP),
    "vit_large_patch16_224.augreg_in21k_ft_in1k": VitFamily(64, "gelu", 1e-6, HALF),
}
# configuration_prismatic.py: vision_backbone_id -> timm model ids and image sizes
BACKBONES = {
    "clip-vit-l": (["vit_large_patch14_clip_224.openai"], [224]),
    "clip-vit-l-336px": (["vit_large_patch14_clip_336.openai"], [336]),
    "dinov2-vit-l": (["vit_large_patch14_reg4_dinov2.lvd142m"], [224]),
    "in1k-vit-l": (["vit_large_patch16_224.augreg_in21k_ft_in1k"], [224]),
    "siglip-vit-so400m": (["vit_so400m_patch14_siglip_224"], [224]),
    "siglip-vit-so400m-384px": (["vit_so400m_patch14_siglip_384"], [384]),
    "dinoclip-vit-l-336px": (["vit_large_patch14_reg4_dinov2.lvd142m", "vit_large_patch14_clip_336.openai"],
                             [336, 336]),
    "dinosiglip-vit-so-224px": (["vit_large_patch14_reg4_dinov2.lvd142m", "vit_so400m_patch14_siglip_224"],
                                [224, 224]),
    "dinosiglip-vit-so-384px": (["vit_large_patch14_reg4_dinov2.lvd142m", "vit_so400m_patch14_siglip_384"],
                                [384, 384]),
}
FEATURIZERS = ("featurizer", "fused_featurizer")
# weights a featurizer holds that the forward pass never reads (its head after the last block)
UNUSED_TOP = ("norm.", "fc_norm.", "attn_pool.", "head.")
# the prompt of OpenVLA's README per language-model family (PurePromptBuilder / VicunaV15ChatPromptBuilder)
PROMPTS = {
    "llama2": "In: What action should the robot take to {instruction}?\nOut:",
    "vicuna": "A chat between a curious user and an artificial intelligence assistant. The assistant gives "
              "helpful, detailed, and polite answers to the user's questions. USER: What action should the robot "
              "take to {instruction}? ASSISTANT:",
}
# configuration_prismatic.py: llm_backbone_id -> the transformers config class its text_config fills (a saved
# text_config holds only what differs from that class's defaults: openvla-7b's has no hidden_size)
LLM_CONFIG_CLASS = {
    "llama2-7b-pure": "llama", "llama2-13b-pure": "llama", "llama2-7b-chat": "llama", "llama2-13b-chat": "llama",
    "vicuna-v15-7b": "llama", "vicuna-v15-13b": "llama",
    "mistral-v0.1-7b-pure": "mistral", "mistral-v0.1-7b-instruct": "mistral", "phi-2-3b": "phi",
}
EMPTY_PIECE = "\u2581"  # "▁": the id predict_action appends after the prompt (29871 in Llama 2's vocabulary)


class VLMFormatError(ValueError):
    """A checkpoint folder that is not the layout it claims, or one the importers do not support."""


class OpenVLAFormatError(VLMFormatError):
    """A folder that is not an OpenVLA-layout checkpoint, or one this importer does not support."""


@dataclass
class VitArch:
    """One ViT's shapes, read from its weights."""
    timm_id: str
    image_size: int
    patch: int
    dim: int
    depth: int
    heads: int
    mlp: int
    n_cls: int  # 0 or 1 class token
    n_reg: int  # register tokens
    pos_prefix: bool  # pos_embed also covers the class/register tokens (timm's no_embed_class=False)
    layerscale: bool
    pre_norm: bool
    patch_bias: bool
    act: str
    eps: float
    mean: tuple
    std: tuple

    @property
    def n_patches(self) -> int:
        return (self.image_size // self.patch) ** 2


@dataclass
class OpenVLACheckpoint:
    """What an OpenVLA-layout folder declares, checked: the import's one source of sizes and names."""
    path: Path
    config: dict
    vits: list  # [VitArch], one or two
    text_config: dict
    llm_dim: int
    fused: bool
    n_bins: int
    vocab_end: int  # action ids are vocab_end - n_bins .. vocab_end - 1
    norm_stats: dict
    prompt_template: str
    weight_files: list = field(default_factory=list)

    @property
    def image_size(self) -> int:
        return self.vits[0].image_size

    @property
    def n_image_tokens(self) -> int:
        return self.vits[0].n_patches


def is_openvla_folder(path: Path) -> bool:
    """A folder whose config.json names an OpenVLA/Prismatic model (what `export-policy` dispatches on)."""
    cfg = Path(path) / "config.json"
    if not cfg.is_file():
        return False
    try:
        d = json.loads(cfg.read_text())
    except ValueError:
        return False
    return isinstance(d, dict) and (d.get("model_type") in ("openvla", "prismatic") or "vision_backbone_id" in d)


# ---------------------------------------------------------------------------------------------------
# reading a folder
# ---------------------------------------------------------------------------------------------------
def weight_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.is_file():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [path / n for n in names]
    single = path / "model.safetensors"
    if single.is_file():
        return [single]
    raise OpenVLAFormatError(f"{path}: no model.safetensors or model.safetensors.index.json")


def weight_shapes(files: list[Path]) -> dict[str, tuple]:
    from safetensors import safe_open
    shapes = {}
    for f in files:
        with safe_open(str(f), "np") as h:
            for k in h.keys():
                shapes[k] = tuple(h.get_slice(k).get_shape())
    return shapes


def _vit_arch(shapes: dict, prefix: str, timm_id: str, image_size: int, act_override, pre: dict | None,
              index: int, where: Path) -> VitArch:
    fam = VIT_FAMILIES[timm_id]
    p = prefix + "."
    need = [p + "patch_embed.proj.weight", p + "pos_embed", p + "blocks.0.attn.qkv.weight", p + "blocks.0.mlp.fc1.weight"]
    missing = [k for k in need if k not in shapes]
    if missing:
        raise OpenVLAFormatError(f"{where}: weight names do not match OpenVLA's layout for {prefix} ({timm_id}): "
                                 f"missing {missing}")
    dim, chans, patch, _ = shapes[p + "patch_embed.proj.weight"]
    if chans != 3:
        raise OpenVLAFormatError(f"{where}: {p}patch_embed.proj.weight takes {chans} channels, expected 3 (RGB)")
    depth = 1 + max(int(k[len(p) + 7:].split(".")[0]) for k in shapes if k.startswith(p + "blocks."))
    if dim % fam.head_dim:
        raise OpenVLAFormatError(f"{where}: {prefix} width {dim} is not a multiple of {timm_id}'s head size "
                                 f"{fam.head_dim}")
    n_cls = 1 if p + "cls_token" in shapes else 0
    n_reg = shapes[p + "reg_token"][1] if p + "reg_token" in shapes else 0
    if image_size % patch:
        raise OpenVLAFormatError(f"{where}: image size {image_size} is not a multiple of {prefix}'s patch {patch}")
    n = (image_size // patch) ** 2
    n_pos = shapes[p + "pos_embed"][1]
    if n_pos not in (n, n + n_cls + n_reg):
        raise OpenVLAFormatError(f"{where}: {p}pos_embed has {n_pos} positions; a {image_size}px image in "
                                 f"{patch}px patches has {n} (+{n_cls + n_reg} prefix tokens)")
    if depth < 2:
        raise OpenVLAFormatError(f"{where}: {prefix} has {depth} block; OpenVLA reads the second-to-last block's "
                                 f"output, so a ViT needs at least 2")
    act = act_override or fam.act
    if act not in ("gelu", "quick_gelu"):
        raise OpenVLAFormatError(f"{where}: timm_override_act_layers[{index}] = {act!r}; supported: gelu, quick_gelu")
    mean, std = fam.norm
    if pre is not None:
        means, stds = pre.get("means"), pre.get("stds")
        if means is not None and stds is not None:
            if len(means) <= index or len(stds) <= index:
                raise OpenVLAFormatError(f"{where}/preprocessor_config.json has {len(means)} means and {len(stds)} "
                                         f"stds; backbone {index} needs its own")
            mean, std = tuple(map(float, means[index])), tuple(map(float, stds[index]))
    return VitArch(timm_id=timm_id, image_size=image_size, patch=patch, dim=dim, depth=depth,
                   heads=dim // fam.head_dim, mlp=shapes[p + "blocks.0.mlp.fc1.weight"][0], n_cls=n_cls, n_reg=n_reg,
                   pos_prefix=n_pos != n, layerscale=p + "blocks.0.ls1.scale_factor" in shapes,
                   pre_norm=p + "norm_pre.weight" in shapes, patch_bias=p + "patch_embed.proj.bias" in shapes,
                   act=act, eps=fam.eps, mean=mean, std=std)


def full_text_config(config: dict, cfg_path: Path) -> dict:
    """config.json's text_config completed with the defaults of its transformers config class, as OpenVLA's
    PrismaticConfig does (`CONFIG_MAPPING[kind](**text_config)`, or the class's defaults when text_config is
    absent); the class is text_config's model_type, else the one llm_backbone_id names."""
    text = config.get("text_config")
    if text is not None and not isinstance(text, dict):
        raise OpenVLAFormatError(f"{cfg_path}: text_config must be an object (the language model's config), got "
                                 f"{type(text).__name__}")
    text = dict(text or {})
    llm = config.get("llm_backbone_id")
    kind = text.pop("model_type", None) or LLM_CONFIG_CLASS.get(llm)
    if kind is None:
        raise OpenVLAFormatError(f"{cfg_path}: text_config has no model_type and llm_backbone_id {llm!r} is not one "
                                 f"OpenVLA defines; known: {sorted(LLM_CONFIG_CLASS)}")
    from transformers import AutoConfig
    try:
        full = AutoConfig.for_model(kind, **{k: v for k, v in text.items() if not k.startswith("_")}).to_dict()
    except (ValueError, TypeError) as e:
        raise OpenVLAFormatError(f"{cfg_path}: text_config is not a valid {kind!r} config: "
                                 f"{' '.join(str(e).split())}") from None
    full["model_type"] = kind
    return full


def read_checkpoint(path: str | Path, prompt_template: str | None = None) -> OpenVLACheckpoint:
    """An OpenVLA-layout folder's declarations and weight shapes, checked; one OpenVLAFormatError naming what was
    expected and what was found."""
    path = Path(path)
    cfg_path = path / "config.json"
    if not cfg_path.is_file():
        raise OpenVLAFormatError(f"{path}: no config.json; expected an OpenVLA checkpoint folder")
    config = json.loads(cfg_path.read_text())
    if "vision_backbone_id" not in config:
        raise OpenVLAFormatError(f"{cfg_path}: no vision_backbone_id; not an OpenVLA checkpoint (model_type "
                                 f"{config.get('model_type')!r})")
    bid = config["vision_backbone_id"]
    if bid not in BACKBONES:
        raise OpenVLAFormatError(f"{cfg_path}: vision_backbone_id {bid!r} is not one OpenVLA defines; known: "
                                 f"{sorted(BACKBONES)}")
    timm_ids, sizes = BACKBONES[bid]
    timm_ids = list(config.get("timm_model_ids") or timm_ids)
    sizes = list(config.get("image_sizes") or sizes)
    unknown = [t for t in timm_ids if t not in VIT_FAMILIES]
    if unknown:
        raise OpenVLAFormatError(f"{cfg_path}: timm model ids {unknown} are not supported; supported: "
                                 f"{sorted(VIT_FAMILIES)}")
    fused = config.get("use_fused_vision_backbone")
    if fused is None:
        fused = bid.startswith(("dinoclip", "dinosiglip"))
    if len(timm_ids) != (2 if fused else 1) or len(sizes) != len(timm_ids):
        raise OpenVLAFormatError(f"{cfg_path}: use_fused_vision_backbone={fused} needs {2 if fused else 1} timm ids "
                                 f"and image sizes, got {timm_ids} and {sizes}")
    if len(set(sizes)) != 1:
        raise OpenVLAFormatError(f"{cfg_path}: image_sizes {sizes} differ; this importer takes one image size")
    text = full_text_config(config, cfg_path)
    norm_stats = config.get("norm_stats")
    if not isinstance(norm_stats, dict) or not norm_stats:
        raise OpenVLAFormatError(f"{cfg_path}: norm_stats must map dataset names to action statistics, got "
                                 f"{type(norm_stats).__name__}")
    pad = int(config.get("pad_to_multiple_of", 64))
    n_bins = int(config.get("n_action_bins", 256))
    vocab_end = int(text["vocab_size"]) - pad
    if vocab_end < n_bins:
        raise OpenVLAFormatError(f"{cfg_path}: text_config.vocab_size {text['vocab_size']} - pad_to_multiple_of "
                                 f"{pad} = {vocab_end} leaves no room for {n_bins} action ids")
    pre_path = path / "preprocessor_config.json"
    pre = json.loads(pre_path.read_text()) if pre_path.is_file() else None
    files = weight_files(path)
    shapes = weight_shapes(files)
    overrides = list(config.get("timm_override_act_layers") or [None] * len(timm_ids))
    vits = [_vit_arch(shapes, f"vision_backbone.{FEATURIZERS[i]}", t, int(sizes[i]), overrides[i], pre, i, path)
            for i, t in enumerate(timm_ids)]
    if len({v.n_patches for v in vits}) != 1:
        raise OpenVLAFormatError(f"{path}: the fused backbones give {[v.n_patches for v in vits]} patches; "
                                 f"OpenVLA concatenates them per patch, so they must agree")
    llm_dim = int(text["hidden_size"])
    vision_dim = sum(v.dim for v in vits)
    want_proj = {"projector.fc1.weight": (4 * vision_dim if fused else llm_dim, vision_dim)}
    want_proj["projector.fc2.weight"] = (llm_dim, 4 * vision_dim) if fused else (llm_dim, llm_dim)
    if fused:
        want_proj["projector.fc3.weight"] = (llm_dim, llm_dim)
    bad = {k: shapes.get(k) for k, s in want_proj.items() if shapes.get(k) != s}
    if bad:
        raise OpenVLAFormatError(f"{path}: projector weights do not match a {'fused ' if fused else ''}backbone of "
                                 f"width {vision_dim} into a language model of width {llm_dim}: expected "
                                 f"{want_proj}, got {bad}")
    if "language_model.model.embed_tokens.weight" not in shapes:
        raise OpenVLAFormatError(f"{path}: no language_model.model.embed_tokens.weight; weight names do not match "
                                 f"OpenVLA's layout")
    if prompt_template is None:
        llm = str(config.get("llm_backbone_id", ""))
        family = "vicuna" if llm.startswith("vicuna") else "llama2"
        prompt_template = PROMPTS[family]
    if prompt_template.count("{instruction}") != 1:
        raise OpenVLAFormatError(f"the prompt template must contain {{instruction}} once, got {prompt_template!r}")
    return OpenVLACheckpoint(path=path, config=config, vits=vits, text_config=text, llm_dim=llm_dim, fused=fused,
                             n_bins=n_bins, vocab_end=vocab_end, norm_stats=norm_stats,
                             prompt_template=prompt_template, weight_files=files)


# ---------------------------------------------------------------------------------------------------
# the torch reference
# ---------------------------------------------------------------------------------------------------
def build_reference(ck: OpenVLACheckpoint, load_weights: bool = True):
    """-> the torch model of ck (fp32, eval), weights loaded strictly: a name missing or left over is an error,
    except a featurizer's head after its last block (UNUSED_TOP), which the forward pass never reads."""
    import torch
    import torch.nn as nn
    import torch.nn.functional as F

    class LayerScale(nn.Module):
        def __init__(self, d):
            super().__init__()
            self.scale_factor = nn.Parameter(torch.ones(d))

        def forward(self, x):
            return x * self.scale_factor

    class Attention(nn.Module):
        def __init__(self, d, heads):
            super().__init__()
            self.heads = heads
            self.qkv = nn.Linear(d, 3 * d)
            self.proj = nn.Linear(d, d)

        def forward(self, x):  # (B, T, D)
            b, t, d = x.shape
            hd = d // self.heads
            q, k, v = self.qkv(x).reshape(b, t, 3, self.heads, hd).permute(2, 0, 3, 1, 4)  # 3 x (B, H, T, hd)
            a = torch.softmax((q * hd ** -0.5) @ k.transpose(-2, -1), -1)  # (B, H, T, T)
            return self.proj((a @ v).transpose(1, 2).reshape(b, t, d))

    class Mlp(nn.Module):
        def __init__(self, d, hidden, act):
            super().__init__()
            self.fc1, self.fc2, self.act = nn.Linear(d, hidden), nn.Linear(hidden, d), act

        def forward(self, x):
            h = self.fc1(x)
            h = h * torch.sigmoid(1.702 * h) if self.act == "quick_gelu" else F.gelu(h)
            return self.fc2(h)

    class Block(nn.Module):
        def __init__(self, a: VitArch):
            super().__init__()
            self.norm1, self.norm2 = nn.LayerNorm(a.dim, eps=a.eps), nn.LayerNorm(a.dim, eps=a.eps)
            self.attn, self.mlp = Attention(a.dim, a.heads), Mlp(a.dim, a.mlp, a.act)
            self.ls1 = LayerScale(a.dim) if a.layerscale else nn.Identity()
            self.ls2 = LayerScale(a.dim) if a.layerscale else nn.Identity()

        def forward(self, x):
            x = x + self.ls1(self.attn(self.norm1(x)))
            return x + self.ls2(self.mlp(self.norm2(x)))

    class PatchEmbed(nn.Module):
        def __init__(self, a: VitArch):
            super().__init__()
            self.proj = nn.Conv2d(3, a.dim, a.patch, stride=a.patch, bias=a.patch_bias)

    class ViT(nn.Module):
        """timm's VisionTransformer as Prismatic calls it: get_intermediate_layers(n={depth - 2}), prefix
        tokens dropped, no final norm."""

        def __init__(self, a: VitArch):
            super().__init__()
            self.a = a
            self.patch_embed = PatchEmbed(a)
            if a.n_cls:
                self.cls_token = nn.Parameter(torch.zeros(1, 1, a.dim))
            if a.n_reg:
                self.reg_token = nn.Parameter(torch.zeros(1, a.n_reg, a.dim))
            n_pos = a.n_patches + (a.n_cls + a.n_reg if a.pos_prefix else 0)
            self.pos_embed = nn.Parameter(torch.zeros(1, n_pos, a.dim))
            if a.pre_norm:
                self.norm_pre = nn.LayerNorm(a.dim, eps=a.eps)
            self.blocks = nn.ModuleList(Block(a) for _ in range(a.depth))

        def forward(self, pixels):  # (B, 3, S, S) normalised -> (B, N, D)
            a = self.a
            x = self.patch_embed.proj(pixels).flatten(2).transpose(1, 2)  # (B, N, D)
            b = x.shape[0]
            prefix = ([self.cls_token.expand(b, -1, -1)] if a.n_cls else []) + \
                     ([self.reg_token.expand(b, -1, -1)] if a.n_reg else [])
            if a.pos_prefix:
                x = torch.cat(prefix + [x], 1) + self.pos_embed
            else:
                x = torch.cat(prefix + [x + self.pos_embed], 1)
            if a.pre_norm:
                x = self.norm_pre(x)
            for blk in self.blocks[:a.depth - 1]:  # the last block's output is never read
                x = blk(x)
            return x[:, a.n_cls + a.n_reg:]

    class VisionBackbone(nn.Module):
        def __init__(self):
            super().__init__()
            self.featurizer = ViT(ck.vits[0])
            if ck.fused:
                self.fused_featurizer = ViT(ck.vits[1])

    class Projector(nn.Module):
        def __init__(self):
            super().__init__()
            vd, e = sum(v.dim for v in ck.vits), ck.llm_dim
            if ck.fused:
                self.fc1, self.fc2, self.fc3 = nn.Linear(vd, 4 * vd), nn.Linear(4 * vd, e), nn.Linear(e, e)
            else:
                self.fc1, self.fc2 = nn.Linear(vd, e), nn.Linear(e, e)

        def forward(self, x):
            if ck.fused:
                return self.fc3(F.gelu(self.fc2(F.gelu(self.fc1(x)))))
            return self.fc2(F.gelu(self.fc1(x)))

    class OpenVLAReference(nn.Module):
        def __init__(self):
            super().__init__()
            from transformers import AutoConfig, AutoModelForCausalLM
            self.vision_backbone = VisionBackbone()
            self.projector = Projector()
            text = dict(ck.text_config)
            kind = text.pop("model_type", "llama")
            lm_cfg = AutoConfig.for_model(kind, **{k: v for k, v in text.items() if not k.startswith("_")})
            self.language_model = AutoModelForCausalLM.from_config(lm_cfg, attn_implementation="eager")
            self.vits = [self.vision_backbone.featurizer] + ([self.vision_backbone.fused_featurizer] if ck.fused else [])
            for i, v in enumerate(ck.vits):
                self.register_buffer(f"mean{i}", torch.tensor(v.mean, dtype=torch.float32).view(1, 3, 1, 1),
                                     persistent=False)
                self.register_buffer(f"std{i}", torch.tensor(v.std, dtype=torch.float32).view(1, 3, 1, 1),
                                     persistent=False)

        def forward(self, image):  # (B, S, S, 3) uint8 -> (B, N, E): what the encoder engine computes
            return self.image_embeds(image)

        def image_embeds(self, image):
            x = image.permute(0, 3, 1, 2).to(torch.float32) / 255.0
            feats = [vit((x - getattr(self, f"mean{i}")) / getattr(self, f"std{i}")) for i, vit in enumerate(self.vits)]
            return self.projector(torch.cat(feats, 2))

        def prefix(self, image, ids):  # image (1, S, S, 3) uint8, ids (1, L) int64 -> (1, 1 + N + L - 1, E)
            emb = self.language_model.get_input_embeddings()(ids)
            return torch.cat([emb[:, :1], self.image_embeds(image), emb[:, 1:]], 1)

        @torch.no_grad()
        def action_ids(self, image, ids, n: int, lo: int, hi: int) -> list[int]:
            """n greedy ids among lo..hi-1 after the prompt, recomputing the whole sequence each step (slow,
            obvious)."""
            x = self.prefix(image, ids)
            table = self.language_model.get_input_embeddings().weight
            out: list[int] = []
            for _ in range(n):
                logits = self.language_model(inputs_embeds=x).logits[0, -1]
                nxt = int(logits[lo:hi].argmax()) + lo
                out.append(nxt)
                x = torch.cat([x, table[nxt][None, None]], 1)
            return out

    torch.manual_seed(0)
    model = OpenVLAReference()
    if load_weights:
        load_state(model, ck)
    return model.to(torch.float32).eval()


def load_state(model, ck: OpenVLACheckpoint) -> list[str]:
    """Load ck's weights into the reference strictly; -> the names skipped as unused (UNUSED_TOP). Each tensor is
    read from its file (no memory map: SafetensorsFile) and copied (to fp32) into its parameter in turn, so the
    model's fp32 copy is the only whole one held: a 3B checkpoint's fp32 dict beside the model was 11 GB more, and
    a memory-mapped file's pages, resident once read, 5 GB more."""
    import torch

    from .checkpoint import SafetensorsFile
    want = model.state_dict()  # tied parameters share storage: copying one fills the other
    tied = getattr(model.language_model.config, "tie_word_embeddings", False)
    seen, skipped, wrong, unexpected = set(), [], [], []
    with torch.no_grad():
        for f in ck.weight_files:
            try:
                fh = SafetensorsFile(f)
            except (OSError, ValueError) as e:
                raise OpenVLAFormatError(f"{f}: corrupt or unreadable safetensors file ({e})") from None
            with fh:
                for k in fh.keys():
                    top = k.split(".", 2)
                    if len(top) == 3 and top[0] == "vision_backbone" and top[1] in FEATURIZERS and \
                            top[2].startswith(UNUSED_TOP):
                        skipped.append(k)
                        continue
                    if k not in want:
                        unexpected.append(k)
                        continue
                    shape = fh.shape(k)
                    if shape != tuple(want[k].shape):
                        wrong.append(f"{k}: expected {tuple(want[k].shape)}, got {shape}")
                        continue
                    want[k].copy_(torch.from_numpy(fh.read(k)))  # bf16 (as fp32) / fp16 -> the parameter's fp32
                    seen.add(k)
    if wrong:
        verb = "weights do" if len(wrong) > 1 else "weight does"
        raise OpenVLAFormatError(f"{ck.path}: {len(wrong)} {verb} not fit config.json: "
                                 f"{'; '.join(wrong[:4])}{' ...' if len(wrong) > 4 else ''}")
    head, embed = "language_model.lm_head.weight", "language_model.model.embed_tokens.weight"
    if head not in seen and tied and embed in seen:
        seen.add(head)  # the same storage as the embedding's
    missing = [k for k in want if k not in seen and not k.endswith("rotary_emb.inv_freq")]
    if missing or unexpected:
        raise OpenVLAFormatError(f"{ck.path}: weight names do not match OpenVLA's layout: missing {missing[:8]}"
                                 f"{' ...' if len(missing) > 8 else ''}, unexpected {unexpected[:8]}"
                                 f"{' ...' if len(unexpected) > 8 else ''}")
    return skipped
