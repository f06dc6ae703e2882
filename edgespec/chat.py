"""Chat templates: a conversation -> the prompt text an instruct checkpoint was trained on, rendered as
transformers' `apply_chat_template` renders it.

An instruct checkpoint (Qwen2.5-Instruct, Llama-3.2-Instruct, Gemma 3 -it, Phi-4-mini-instruct, SmolLM3) ships
its conversation format as a Jinja template: in `chat_template.jinja`, or as `chat_template` in
`tokenizer_config.json` (a string, or a list of named templates of which "default" is the one used).
`edgespec export` copies both files into the engine folder. The template sees what transformers gives it:
`messages`, `add_generation_prompt`, `tools`, `documents`, the tokenizer's special-token strings (`bos_token`,
`eos_token`, ...) and any extra keywords (Qwen3's `enable_thinking`), in a sandboxed environment with
`trim_blocks`, `lstrip_blocks`, loop controls, `raise_exception`, `strftime_now` and a `tojson` that does not
escape HTML. The rendered text holds its own special tokens (a Llama 3 template writes `<|begin_of_text|>`), so
it is encoded without adding any (TextTokenizer.encode).
"""
from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path

from .contract import EngineError

TEMPLATE_FILE = "chat_template.jinja"
CONFIG_FILE = "tokenizer_config.json"
SPECIAL_KEYS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
REASONING_KEYS = ("reasoning_content", "thinking", "reasoning")  # a turn's reasoning, by the names templates read
JINJA_MIN = (3, 1, 6)  # older versions have known sandbox escapes (transformers refuses them too)


def read_tokenizer_config(folder: Path) -> dict:
    """tokenizer_config.json of a folder ({} when absent), refused by name when it is not a JSON object."""
    path = Path(folder) / CONFIG_FILE
    if not path.is_file():
        return {}
    try:
        cfg = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise EngineError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(cfg, dict):
        raise EngineError(f"{path}: expected a JSON object, got {type(cfg).__name__}")
    return cfg


def special_tokens(cfg: dict, source: str = CONFIG_FILE) -> dict[str, str]:
    """The special-token strings a tokenizer_config names ({"bos_token": "<s>", ...}); a token is a string or
    an AddedToken dict ({"content": "<s>", ...}); null ones are left out."""
    out = {}
    for key in SPECIAL_KEYS:
        v = cfg.get(key)
        if isinstance(v, dict):
            v = v.get("content")
        if v is None:
            continue
        if not isinstance(v, str):
            raise EngineError(f"{source}: {key} must be a string or {{\"content\": str}}, got {cfg.get(key)!r}")
        out[key] = v
    return out


def _jinja():
    try:
        import jinja2
    except ImportError:
        raise ImportError("chat templates need jinja2 >= 3.1.6: pip install 'jinja2>=3.1.6'") from None
    have = tuple(int(x) for x in jinja2.__version__.split(".")[:3] if x.isdigit())
    if have < JINJA_MIN:
        raise ImportError(f"chat templates need jinja2 >= 3.1.6 (older versions have sandbox escapes), got "
                          f"{jinja2.__version__}: pip install -U 'jinja2>=3.1.6'")
    return jinja2


def _compile(source: str, origin: str):
    """The template compiled in a sandbox that gives it what transformers' chat-template environment gives."""
    jinja2 = _jinja()
    from jinja2.ext import Extension
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class Generation(Extension):
        """`{% generation %}...{% endgeneration %}` marks the assistant's tokens for training masks; rendering
        keeps its body as it is."""
        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        def _body(self, caller):
            return caller()

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    class Namespace(jinja2.utils.Namespace):
        """A namespace that refuses underscore names (no reach into Python internals)."""
        def __init__(*args, **kwargs):
            self, args = args[0], args[1:]
            attrs = dict(*args, **kwargs)
            for name in attrs:
                Namespace._check(name)
            jinja2.utils.Namespace.__init__(self, attrs)

        def __setitem__(self, name, value):
            Namespace._check(name)
            jinja2.utils.Namespace.__setitem__(self, name, value)

        @staticmethod
        def _check(name):
            if isinstance(name, str) and name.startswith("_"):
                raise jinja2.exceptions.SecurityError(f"a chat template may not set {name!r} on a namespace")

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[Generation, jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    env.globals["namespace"] = Namespace
    try:
        return env.from_string(source)
    except jinja2.exceptions.TemplateSyntaxError as e:
        raise EngineError(f"{origin}: the chat template does not parse (line {e.lineno}: {e.message})") from None


def check_messages(messages) -> list[dict]:
    """A conversation: a non-empty list of dicts, each with a str `role` and `content` that is a str, a list of
    content parts or absent (an assistant turn with tool calls only). Keys whose value is None are dropped, and a
    turn's reasoning is given under each name templates read, as transformers does. Tools are JSON schemas (dicts),
    not Python functions."""
    if isinstance(messages, (str, bytes)) or not isinstance(messages, (list, tuple)):
        raise TypeError(f"messages must be a list of {{'role': ..., 'content': ...}} dicts, got "
                        f"{type(messages).__name__}")
    if not messages:
        raise ValueError("messages is empty: give at least one {'role': ..., 'content': ...} message")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise TypeError(f"messages[{i}] must be a dict with 'role' and 'content', got {type(m).__name__}")
        m = {k: v for k, v in m.items() if v is not None}
        if not isinstance(m.get("role"), str) or not m["role"]:
            raise ValueError(f"messages[{i}] needs a non-empty str 'role' (system, user, assistant, tool), "
                             f"got {m.get('role')!r}")
        if "content" in m and not isinstance(m["content"], (str, list)):
            raise TypeError(f"messages[{i}]['content'] must be a str or a list of content parts, got "
                            f"{type(m['content']).__name__}")
        reasoning = next((m[k] for k in REASONING_KEYS if k in m), None)
        if reasoning is not None:  # templates read one name or another (Qwen3: reasoning_content); give both
            m = {"thinking": reasoning, **m, "reasoning_content": reasoning}
        out.append(m)
    return out


class ChatTemplate:
    """One checkpoint's chat template with the special-token strings it may write."""

    def __init__(self, source: str, special: dict[str, str] | None = None, origin: str = "chat template"):
        if not isinstance(source, str) or not source.strip():
            raise EngineError(f"{origin}: the chat template is empty")
        self.source, self.origin = source, origin
        self.special = dict(special or {})
        self._template = None  # compiled at the first render: a template that does not parse (or no jinja2)
        # refuses chat, never the engine's plain text generation

    @classmethod
    def from_folder(cls, folder: Path, cfg: dict | None = None) -> "ChatTemplate | None":
        """The folder's template: chat_template.jinja, else tokenizer_config.json's chat_template (a named list:
        its "default"); None when it has neither."""
        folder = Path(folder)
        cfg = read_tokenizer_config(folder) if cfg is None else cfg
        special = special_tokens(cfg, str(folder / CONFIG_FILE))
        path = folder / TEMPLATE_FILE
        if path.is_file():
            return cls(path.read_text(encoding="utf-8"), special, str(path))
        t = cfg.get("chat_template")
        origin = f"{folder / CONFIG_FILE}: chat_template"
        if t is None:
            return None
        if isinstance(t, list):
            named = {d.get("name"): d.get("template") for d in t if isinstance(d, dict)}
            if "default" not in named:
                raise EngineError(f"{origin}: a list of named templates needs one named 'default', got names "
                                  f"{sorted(map(str, named))}")
            t, origin = named["default"], origin + "['default']"
        if not isinstance(t, str):
            raise EngineError(f"{origin}: expected a Jinja template string, got {type(t).__name__}")
        return cls(t, special, origin)

    def render(self, messages, add_generation_prompt: bool = True, tools: list | None = None,
               documents: list | None = None, **kwargs) -> str:
        """The conversation as prompt text. add_generation_prompt: end with the header of the assistant's turn
        (what a reply is generated after). kwargs reach the template and win over the special tokens."""
        jinja2 = _jinja()
        msgs = check_messages(messages)
        if self._template is None:
            self._template = _compile(self.source, self.origin)
        variables = {**self.special, **kwargs}
        try:
            return self._template.render(messages=msgs, tools=tools, documents=documents,
                                         add_generation_prompt=add_generation_prompt, **variables)
        except jinja2.exceptions.TemplateError as e:  # the template's own raise_exception, or a sandbox refusal
            raise ValueError(f"{self.origin}: the chat template refused this conversation: {e}") from None
