"""Text tokenizer of an engine folder (tokenizers' tokenizer.json), and the draft/target compatibility check."""
from __future__ import annotations

from itertools import groupby
from pathlib import Path

from .chat import ChatTemplate, read_tokenizer_config, special_tokens
from .contract import EngineError, Manifest


class TextTokenizer:
    """tokenizer.json, with tokenizer_config.json's special-token strings and the folder's chat template
    (edgespec/chat.py) beside it."""

    def __init__(self, path: str | Path):
        from tokenizers import Tokenizer

        self.path = Path(path)
        self.tok = Tokenizer.from_file(str(self.path))
        self.size = self.tok.get_vocab_size(with_added_tokens=True)  # ids 0..size-1 decode
        self.control = {i for i, t in self.tok.get_added_tokens_decoder().items() if t.special}  # special ids
        self.config = read_tokenizer_config(self.path.parent)
        self.special = special_tokens(self.config, str(self.path.parent / "tokenizer_config.json"))
        self.chat_template = ChatTemplate.from_folder(self.path.parent, self.config)

    @classmethod
    def from_engine(cls, engine_dir: Path, manifest: Manifest) -> "TextTokenizer | None":
        return cls(Path(engine_dir) / manifest.tokenizer_file) if manifest.tokenizer_file else None

    def encode(self, text: str) -> list[int]:
        """The ids of `text` alone, no special tokens added (a rendered chat template writes its own)."""
        return self.tok.encode(text, add_special_tokens=False).ids

    def encode_prompt(self, text: str) -> list[int]:
        """The ids of a text prompt as transformers' `tokenizer(text)` gives them: with the tokens tokenizer.json's
        post-processor adds to every text (Llama 3's <|begin_of_text|>, Gemma's <bos>; Qwen's none). transformers 5
        reads them from there alone: tokenizer_config.json's add_bos_token no longer changes them (a checkpoint
        saved by transformers 4 wrote its post-processor from that flag)."""
        return self.tok.encode(text, add_special_tokens=True).ids

    def decode(self, ids) -> str:
        """The text of `ids`. An id the tokenizer does not hold (a model whose vocabulary is padded past its
        tokenizer, as Qwen's and Phi's are, chose a padding id) shows as "<|id:N|>", where tokenizers would drop
        it silently."""
        ids = list(map(int, ids))
        out = []
        for held, run in groupby(ids, key=lambda i: 0 <= i < self.size):
            run = list(run)
            out.append(self.tok.decode(run, skip_special_tokens=False) if held else "".join(f"<|id:{i}|>" for i in run))
        return "".join(out)

    def token_to_id(self, s: str) -> int | None:
        return self.tok.token_to_id(s)


def check_pair(target: Manifest, draft: Manifest, target_dir, draft_dir) -> None:
    """A draft must share the target's vocabulary and tokenizer; refuse otherwise, saying what differs."""
    if draft.vocab_size != target.vocab_size:
        raise EngineError(f"draft {draft_dir} has vocabulary size {draft.vocab_size} but target {target_dir} has "
                          f"{target.vocab_size}; a draft must share the target's tokenizer")
    if target.tokenizer_sha256 and draft.tokenizer_sha256 and target.tokenizer_sha256 != draft.tokenizer_sha256:
        raise EngineError(f"draft {draft_dir} and target {target_dir} ship different tokenizers (tokenizer.json "
                          f"sha256 {draft.tokenizer_sha256[:12]}… vs {target.tokenizer_sha256[:12]}…); "
                          f"a draft must share the target's tokenizer")
