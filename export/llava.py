"""A Llava-style checkpoint made of transformers' own classes (`LlavaForConditionalGeneration`: a CLIP or SigLIP
vision tower, a two-layer projector, a Llama / Qwen2 / Mistral language model) -> a policy folder through
export/vlm_policy.py's pipeline, with OpenVLA-style action tokens: the last n_bins ids of the text vocabulary.

    edgespec export-policy LLAVA_DIR --out engines/llava-vla [--action-stats stats.json] [--unnorm-key K]

The reference is transformers' model itself: its forward pass with the processor's expansion of the image token
to N tokens is what the export's end-to-end gate compares against. The encoder engine computes what
`get_image_features` does (the vision tower's hidden state at `vision_feature_layer`, the CLS row dropped for the
"default" strategy, the projector) from a uint8 image of the tower's size, normalised with the checkpoint's
preprocessor_config.json mean and std. The prompt holds the image token once; the runtime puts the N image rows in
its place. Causal attention over the whole prefix, as Llava's language model uses it.

Action statistics: config.json's "norm_stats" (OpenVLA's nesting) when the checkpoint is a VLA fine-tune, else
--action-stats FILE: {"q01", "q99", "mask"?} or {dataset: {"action": {...}}}.
"""
from __future__ import annotations

import json
from pathlib import Path

from .vlm_policy import TOKENIZER_FILE, VLMFormatError, VLMSource, check_bos, export_vlm_policy

DEFAULT_PROMPT = "USER: <image>\nWhat action should the robot take to {instruction}? ASSISTANT:"
IMAGE_TOKEN = "<image>"


def is_llava_folder(path: Path) -> bool:
    cfg = Path(path) / "config.json"
    try:
        return cfg.is_file() and json.loads(cfg.read_text()).get("model_type") == "llava"
    except ValueError:
        return False


def read_stats(path: Path | None, config: dict, where: Path) -> dict:
    """-> norm_stats in OpenVLA's nesting {dataset: {"action": {...}}}."""
    if path is None:
        if isinstance(config.get("norm_stats"), dict) and config["norm_stats"]:
            return config["norm_stats"]
        raise VLMFormatError(f"{where}/config.json has no norm_stats; give the action statistics with --action-stats "
                             f"FILE ({{\"q01\": [...], \"q99\": [...]}} or OpenVLA's dataset_statistics.json)")
    d = json.loads(Path(path).read_text())
    if isinstance(d, dict) and "q01" in d:
        return {Path(path).stem: {"action": d}}
    if isinstance(d, dict) and "action" in d:
        return {Path(path).stem: d}
    if isinstance(d, dict) and d and all(isinstance(v, dict) and "action" in v for v in d.values()):
        return d
    raise VLMFormatError(f"--action-stats {path}: expected {{\"q01\", \"q99\"}} or {{dataset: {{\"action\": ...}}}}, "
                         f"got keys {sorted(d) if isinstance(d, dict) else type(d).__name__}")


def refuse_loading_gaps(path: Path, info: dict) -> None:
    """transformers fills a missing or misshapen weight with a random one and only prints a table; an export gated
    against that same model would pass. Refuse it in one line naming the weights."""
    def names(keys):
        keys = sorted(keys)
        return f"{keys[:6]}{' ...' if len(keys) > 6 else ''}"
    problems = []
    if info.get("missing_keys"):
        problems.append(f"missing {names(info['missing_keys'])}")
    if info.get("mismatched_keys"):
        problems.append("of the wrong shape " + "; ".join(
            f"{k}: expected {tuple(want)}, got {tuple(got)}" for k, got, want in sorted(info["mismatched_keys"])[:4]))
    if info.get("unexpected_keys"):
        problems.append(f"unexpected {names(info['unexpected_keys'])}")
    if info.get("error_msgs"):
        problems.append("errors " + " ".join(" ".join(str(m).split()) for m in info["error_msgs"][:2]))
    if problems:
        raise VLMFormatError(f"{path}: the weights do not fit config.json's Llava model: " + "; ".join(problems))


def llava_source(path: str | Path, prompt_template: str | None = None, action_stats: Path | None = None,
                 n_bins: int = 256, vocab_end: int | None = None) -> VLMSource:
    import torch
    from tokenizers import Tokenizer
    from transformers import AutoModelForCausalLM, LlavaForConditionalGeneration

    path = Path(path)
    if not is_llava_folder(path):
        raise VLMFormatError(f"{path}: config.json model_type is not 'llava'")
    config = json.loads((path / "config.json").read_text())
    norm_stats = read_stats(action_stats, config, path)
    tok_path = path / TOKENIZER_FILE
    if not tok_path.is_file():
        raise VLMFormatError(f"{tok_path} is missing: the prompt is tokenized with the checkpoint's own tokenizer")
    tok = Tokenizer.from_file(str(tok_path))
    check_bos(tok, tok_path)
    pre_path = path / "preprocessor_config.json"
    pre = json.loads(pre_path.read_text()) if pre_path.is_file() else {}
    if "image_mean" not in pre or "image_std" not in pre:
        raise VLMFormatError(f"{pre_path}: needs image_mean and image_std (the vision tower's normalisation)")
    model, info = LlavaForConditionalGeneration.from_pretrained(path, dtype=torch.float32, attn_implementation="eager",
                                                                output_loading_info=True, ignore_mismatched_sizes=True)
    refuse_loading_gaps(path, info)
    model = model.eval()
    cfg = model.config
    image_id = int(cfg.image_token_id)
    if tok.token_to_id(IMAGE_TOKEN) != image_id:
        raise VLMFormatError(f"{tok_path} gives {IMAGE_TOKEN!r} the id {tok.token_to_id(IMAGE_TOKEN)}; config.json's "
                             f"image_token_id is {image_id}")
    template = prompt_template or DEFAULT_PROMPT
    if template.count(IMAGE_TOKEN) != 1:
        raise VLMFormatError(f"the prompt template must hold {IMAGE_TOKEN} once, got {template!r}")
    layer, strategy = cfg.vision_feature_layer, cfg.vision_feature_select_strategy
    if strategy not in ("default", "full"):
        raise VLMFormatError(f"vision_feature_select_strategy {strategy!r}: supported default, full")
    size = int(cfg.vision_config.image_size)
    lm_core, vision, projector = model.model.language_model, model.model.vision_tower, model.model.multi_modal_projector
    text_vocab = int(cfg.text_config.vocab_size)
    vocab_end = int(vocab_end if vocab_end is not None else tok.get_vocab_size(with_added_tokens=False))
    if not n_bins <= vocab_end <= text_vocab:
        raise VLMFormatError(f"action ids end at {vocab_end}: it must be within the text vocabulary ({text_vocab}) and "
                             f"leave room for {n_bins} bins")

    class ImageEncoder(torch.nn.Module):
        """image (B, S, S, 3) uint8 -> (B, N, E): get_image_features' computation."""

        def __init__(self):
            super().__init__()
            self.vision, self.projector = vision, projector
            self.register_buffer("mean", torch.tensor(pre["image_mean"], dtype=torch.float32).view(1, 3, 1, 1))
            self.register_buffer("std", torch.tensor(pre["image_std"], dtype=torch.float32).view(1, 3, 1, 1))

        def forward(self, image):
            x = (image.permute(0, 3, 1, 2).to(torch.float32) / 255.0 - self.mean) / self.std
            hs = self.vision(x, output_hidden_states=True).hidden_states
            feats = [hs[i] for i in (layer if isinstance(layer, (list, tuple)) else [layer])]
            if strategy == "default":
                feats = [f[:, 1:] for f in feats]
            return self.projector(torch.cat(feats, -1))

    encoder = ImageEncoder().eval()
    with torch.no_grad():
        n_rows = int(encoder(torch.zeros(1, size, size, 3, dtype=torch.uint8)).shape[1])

    def expand(ids):  # the processor's expansion: the one image token -> n_rows of them
        i = int((ids[0] == image_id).nonzero()[0, 0])
        return torch.cat([ids[:, :i], torch.full((1, n_rows), image_id, dtype=ids.dtype), ids[:, i + 1:]], 1)

    def pixels(image):
        return (image.permute(0, 3, 1, 2).to(torch.float32) / 255.0 - encoder.mean) / encoder.std

    @torch.no_grad()
    def reference_prefix(image, ids):  # transformers' own merge: the embeddings its language model receives
        out = model.model(input_ids=expand(ids), pixel_values=pixels(image), output_hidden_states=True)
        return out.hidden_states[0]

    @torch.no_grad()
    def reference_action_ids(image, ids, n, lo, hi):  # transformers' forward, whole sequence per step
        seq, out = expand(ids), []
        for _ in range(n):
            nxt = int(model(input_ids=seq, pixel_values=pixels(image)).logits[0, -1, lo:hi].argmax()) + lo
            out.append(nxt)
            seq = torch.cat([seq, torch.tensor([[nxt]], dtype=seq.dtype)], 1)
        return out

    lm = AutoModelForCausalLM.from_config(cfg.text_config)  # the language model as a causal LM, for export_engine
    lm.model, lm.lm_head = lm_core, model.lm_head
    lm = lm.to(torch.float32).eval()
    return VLMSource(path=path, kind="llava", image_size=size, n_image_rows=n_rows, width=int(cfg.text_config.hidden_size),
                     vocab_size=text_vocab, vocab_end=vocab_end, n_bins=n_bins, norm_stats=norm_stats,
                     tokenizer_path=tok_path, template=template, image_token_id=image_id, append_id=None,
                     image_encoder=encoder, language_model=lm, reference_prefix=reference_prefix,
                     reference_action_ids=reference_action_ids,
                     info={"vision_model_type": cfg.vision_config.model_type,
                           "text_model_type": cfg.text_config.model_type,
                           "vision_feature_layer": layer, "vision_feature_select_strategy": strategy})


def export_llava(path: str | Path, out_dir: str | Path, unnorm_key: str | None = None,
                 prompt_template: str | None = None, action_stats: Path | None = None, n_bins: int = 256, **kw) -> dict:
    """kw: export_vlm_policy's (dtype, draft, action_names, action_units, action_kind, horizon, force, progress,
    allow_lossy, max_context)."""
    src = llava_source(path, prompt_template, action_stats, n_bins)
    src.action_stats(unnorm_key)  # refuse a bad --unnorm-key before any work
    return export_vlm_policy(src, out_dir, unnorm_key=unnorm_key, **kw)


def write_llava_checkpoint(out: str | Path, vision: str = "clip", text: str = "qwen2", seed: int = 0) -> Path:
    """A small random Llava checkpoint of transformers' classes (for tests): vision "clip" | "siglip", text "llama" |
    "qwen2" | "mistral", the tokenizer of export/openvla_ckpt.py plus "<image>", a preprocessor_config.json, and
    OpenVLA-style norm_stats in config.json."""
    import torch
    from transformers import (CLIPVisionConfig, LlamaConfig, LlavaConfig, LlavaForConditionalGeneration, MistralConfig,
                              Qwen2Config, SiglipVisionConfig)

    from .openvla_ckpt import PAD_MULTIPLE, build_tokenizer, default_norm_stats

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    text_vocab = 960
    tok = build_tokenizer(text_vocab)  # ids 0..959, "<PAD>" 960
    tok.add_special_tokens([IMAGE_TOKEN])  # 961
    vocab = -(-(text_vocab + 2) // PAD_MULTIPLE) * PAD_MULTIPLE
    vc = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=2, image_size=56,
              patch_size=14)
    vision_config = CLIPVisionConfig(**vc, projection_dim=64) if vision == "clip" else SiglipVisionConfig(**vc)
    tc = dict(vocab_size=vocab, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=512, bos_token_id=1, eos_token_id=2,
              pad_token_id=text_vocab, tie_word_embeddings=False)
    classes = {"qwen2": Qwen2Config, "llama": LlamaConfig, "mistral": MistralConfig}
    if text not in classes:
        raise ValueError(f"text must be one of {sorted(classes)}, got {text!r}")
    text_config = classes[text](**tc)
    cfg = LlavaConfig(vision_config=vision_config, text_config=text_config, image_token_id=text_vocab + 1,
                      vision_feature_layer=-2, projector_hidden_act="gelu",
                      vision_feature_select_strategy="default" if vision == "clip" else "full")  # SigLIP has no CLS
    cfg.norm_stats = default_norm_stats()
    torch.manual_seed(seed)
    model = LlavaForConditionalGeneration(cfg)
    with torch.no_grad():  # wider than the 0.02 init, so the greedy choices are not near-ties
        for name, p in model.named_parameters():
            if p.dim() == 2:
                p.normal_(0, p.shape[1] ** -0.5 if "embed" not in name else 1.0)
    model.save_pretrained(out)
    tok.save(str(out / TOKENIZER_FILE))
    mean, std = ([0.48145466, 0.4578275, 0.40821073], [0.26862954, 0.26130258, 0.27577711]) if vision == "clip" \
        else ([0.5] * 3, [0.5] * 3)
    (out / "preprocessor_config.json").write_text(json.dumps(
        {"image_processor_type": "CLIPImageProcessor", "crop_size": {"height": 56, "width": 56},
         "size": {"shortest_edge": 56}, "image_mean": mean, "image_std": std, "do_normalize": True,
         "do_rescale": True, "rescale_factor": 1 / 255}, indent=2) + "\n")
    return out
