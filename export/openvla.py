"""An OpenVLA-layout checkpoint (export/prismatic.py) -> a policy folder (export/vlm_policy.py's pipeline); what
`edgespec export-policy` runs when the folder's config.json names a vision_backbone_id.

    edgespec export-policy CKPT --out engines/openvla [--unnorm-key bridge_orig] [--draft DRAFT_LM] [--dtype fp16]

The image rows go right after BOS; the prompt is OpenVLA's for the checkpoint's language model (or
--prompt-template), with "▁" appended unless the prompt ends with it; the actions are the last n_action_bins ids
below text_config.vocab_size - pad_to_multiple_of, one step of len(q01) (OpenVLA's 7 named as end-effector delta
+ gripper; --horizon H for a chunked fine-tune whose statistics repeat every step).
"""
from __future__ import annotations

from pathlib import Path

from .prismatic import EMPTY_PIECE, OpenVLACheckpoint, build_reference, read_checkpoint
from .vlm_policy import TOKENIZER_FILE, VLMFormatError, VLMSource, check_bos, export_vlm_policy


def read_tokenizer(ck: OpenVLACheckpoint):
    """-> (the tokenizer, append_id); refuses a tokenizer that adds no BOS (the image rows go after it)."""
    from tokenizers import Tokenizer
    path = ck.path / TOKENIZER_FILE
    if not path.is_file():
        raise VLMFormatError(f"{path} is missing: the prompt is tokenized with the checkpoint's own tokenizer "
                             f"(tokenizers' tokenizer.json, which OpenVLA's repositories ship)")
    tok = Tokenizer.from_file(str(path))
    check_bos(tok, path)
    append_id = tok.token_to_id(EMPTY_PIECE)
    if append_id is None:
        raise VLMFormatError(f"{path} has no {EMPTY_PIECE!r} piece; OpenVLA appends it after the prompt (id 29871 in "
                             f"Llama 2's vocabulary)")
    return tok, append_id


def openvla_source(ckpt_dir: str | Path, prompt_template: str | None = None) -> VLMSource:
    ck = read_checkpoint(ckpt_dir, prompt_template)  # refuses a folder that is not OpenVLA's layout, by name
    _, append_id = read_tokenizer(ck)
    ref = build_reference(ck)
    return VLMSource(path=ck.path, kind="openvla", image_size=ck.image_size, n_image_rows=ck.n_image_tokens,
                     width=ck.llm_dim, vocab_size=int(ck.text_config["vocab_size"]), vocab_end=ck.vocab_end,
                     n_bins=ck.n_bins, norm_stats=ck.norm_stats, tokenizer_path=ck.path / TOKENIZER_FILE,
                     template=ck.prompt_template, image_token_id=None, append_id=append_id,
                     image_encoder=ref, language_model=ref.language_model,
                     reference_prefix=ref.prefix, reference_action_ids=ref.action_ids,
                     info={"vision_backbone_id": ck.config["vision_backbone_id"],
                           "llm_backbone_id": ck.config.get("llm_backbone_id"),
                           "image_resize_strategy": ck.config.get("image_resize_strategy")})


def export_openvla(ckpt_dir: str | Path, out_dir: str | Path, unnorm_key: str | None = None,
                   prompt_template: str | None = None, **kw) -> dict:
    """kw: export_vlm_policy's (dtype, draft, action_names, action_units, action_kind, horizon, force, progress,
    allow_lossy, max_context)."""
    src = openvla_source(ckpt_dir, prompt_template)
    src.action_stats(unnorm_key)  # refuse a bad --unnorm-key before any work
    return export_vlm_policy(src, out_dir, unnorm_key=unnorm_key, **kw)
