"""Instruct checkpoints as transformers runs them: chat templates rendered and tokenized as apply_chat_template does,
text prompts with the tokenizer's own BOS as tokenizer(text) gives them, generation_config.json's end-of-turn ids
among the EOS ids, and a chat through an exported engine equal to transformers' generate().

The templates are this file's own, written in the shapes real ones take (ChatML with tools and a thinking switch,
Llama 3 headers with bos_token and strftime_now, Gemma turns with content parts and raise_exception, a training
template with {% generation %} blocks); each is rendered by edgespec and by transformers and the ids compared.
"""
import json
import shutil

import pytest
import torch
import transformers

import edgespec
from conftest import CHARS
from edgespec.chat import ChatTemplate, check_messages
from edgespec.contract import EngineError, file_sha256
from edgespec.export.checkpoint import CheckpointError, read_config
from edgespec.tokenizer import TextTokenizer

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|begin_of_text|>", "<|start_header_id|>",
            "<|end_header_id|>", "<|eot_id|>", "<bos>", "<start_of_turn>", "<end_of_turn>"]
VOCAB = len(CHARS) + len(SPECIALS)  # 106: one id per character, then the special tokens

CHATML = (
    "{%- if tools %}{{- '<|im_start|>system\\n' }}{%- if messages[0]['role'] == 'system' %}"
    "{{- messages[0]['content'] }}{%- else %}{{- 'You are helpful.' }}{%- endif %}{{- '\\nTools:\\n' }}"
    "{%- for tool in tools %}{{- tool | tojson }}{{- '\\n' }}{%- endfor %}{{- '<|im_end|>\\n' }}\n"
    "{%- elif messages[0]['role'] != 'system' %}{{- '<|im_start|>system\\nYou are helpful.<|im_end|>\\n' }}"
    "{%- endif %}\n"
    "{%- for message in messages %}\n"
    "{%- if message.role == 'system' and not loop.first %}{{ raise_exception('a system message goes first') }}"
    "{%- endif %}\n"
    "{%- if message.role == 'system' and tools %}{% continue %}{% endif %}\n"
    "{%- if message.reasoning_content %}{{- '<|im_start|>' + message.role + '\\n<think>' + message.reasoning_content"
    " + '</think>' + message.content + '<|im_end|>\\n' }}{% continue %}{%- endif %}\n"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}\n"
    "{%- endfor %}\n"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and not enable_thinking %}{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}"
    "{%- endif %}\n")
LLAMA3 = (
    "{{- bos_token }}\n"
    "{%- set ns = namespace(system='') %}\n"
    "{%- if messages[0].role == 'system' %}{%- set ns.system = messages[0].content %}"
    "{%- set messages = messages[1:] %}{%- endif %}\n"
    "{{- '<|start_header_id|>system<|end_header_id|>\\n\\nToday: ' + strftime_now('%d %b %Y') + '\\n' + ns.system"
    " + '<|eot_id|>' }}\n"
    "{%- for m in messages %}\n"
    "    {{- '<|start_header_id|>' + m.role + '<|end_header_id|>\\n\\n' + m.content | trim + '<|eot_id|>' }}\n"
    "{%- endfor %}\n"
    "{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}\n")
GEMMA = (
    "{{ bos_token }}\n"
    "{%- if messages[0]['role'] == 'system' -%}\n"
    "  {%- set first = messages[0]['content'] if messages[0]['content'] is string"
    " else messages[0]['content'][0]['text'] -%}\n"
    "  {%- set first = first + '\\n\\n' -%}{%- set loop_messages = messages[1:] -%}\n"
    "{%- else -%}{%- set first = '' -%}{%- set loop_messages = messages -%}{%- endif -%}\n"
    "{%- for message in loop_messages -%}\n"
    "  {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}"
    "{{ raise_exception('roles must alternate user/assistant/user/...') }}{%- endif -%}\n"
    "  {%- set role = 'model' if message['role'] == 'assistant' else message['role'] -%}\n"
    "  {{ '<start_of_turn>' + role + '\\n' + (first if loop.first else '') }}\n"
    "  {%- if message['content'] is string -%}{{ message['content'] | trim }}\n"
    "  {%- else -%}{%- for item in message['content'] -%}{%- if item['type'] == 'text' -%}"
    "{{ item['text'] | trim }}{%- endif -%}{%- endfor -%}{%- endif -%}\n"
    "  {{ '<end_of_turn>\\n' }}\n"
    "{%- endfor -%}\n"
    "{%- if add_generation_prompt -%}{{ '<start_of_turn>model\\n' }}{%- endif -%}\n")
TRAINING = (  # no "-" in its tags: its layout rests on trim_blocks and lstrip_blocks; {% generation %} marks the
    # assistant's tokens for a training mask, and rendering keeps them as they are
    "{% for m in messages %}\n"
    "  {% if m.role == 'assistant' %}\n"
    "<|im_start|>assistant\n"
    "{% generation %}{{ m.content }}{% endgeneration %}<|im_end|>\n"
    "\n"
    "  {% else %}\n"
    "<|im_start|>{{ m.role }}\n"
    "{{ m.content }}<|im_end|>\n"
    "  {% endif %}\n"
    "{% endfor %}\n"
    "{% if add_generation_prompt %}\n"
    "<|im_start|>assistant\n"
    "{% endif %}\n")
TEMPLATES = {"chatml": CHATML, "llama3": LLAMA3, "gemma": GEMMA, "training": TRAINING}
BOS = {"chatml": None, "llama3": "<|begin_of_text|>", "gemma": "<bos>", "training": None}

TOOL = {"type": "function", "function": {"name": "move_arm", "description": "Move to x, y (metres, ±1 cm) <fast>",
                                         "parameters": {"type": "object", "properties": {"x": {"type": "number"}}}}}
CONVERSATIONS = [
    ([{"role": "user", "content": "Pick up the red block."}], {}),
    ([{"role": "system", "content": "You drive a robot arm."}, {"role": "user", "content": " Where is it? "}], {}),
    ([{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Hello. "},
      {"role": "user", "content": "Stack them.", "name": None}], {}),
]
EXTRA = {  # what only some templates read
    "chatml": [([{"role": "user", "content": "Go left."}], {"tools": [TOOL]}),
               ([{"role": "user", "content": "Go left."}], {"enable_thinking": False}),
               ([{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Left.", "thinking": "near"},
                 {"role": "user", "content": "Why?"}], {})],
    "gemma": [([{"role": "system", "content": [{"type": "text", "text": "Be brief."}]},
                {"role": "user", "content": [{"type": "text", "text": " Which block? "}]}], {})],
}


def tokenizer_folder(path, template=None, bos=None, add_bos=None, post_bos=False, **config):
    """A char-level tokenizer with the chat special tokens, and a tokenizer_config.json naming them."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors
    path.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.WordLevel({c: i for i, c in enumerate(CHARS)}, unk_token=" "))
    tok.pre_tokenizer = pre_tokenizers.Split("", behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in SPECIALS])
    if post_bos:
        tok.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, tok.token_to_id(bos))])
    tok.save(str(path / "tokenizer.json"))
    cfg = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": bos, "eos_token": "<|endoftext|>",
           "pad_token": None, "unk_token": None, "model_max_length": 256, **config}
    if add_bos is not None:
        cfg["add_bos_token"] = add_bos
    if template is not None:
        cfg["chat_template"] = template
    (path / "tokenizer_config.json").write_text(json.dumps(cfg))
    return path


def hf_tokenizer(folder):
    """transformers' fast tokenizer of the folder, as tokenizer_config.json's tokenizer_class names it (AutoTokenizer
    would take a checkpoint's model-type class, which rebuilds a BPE from this char-level vocabulary)."""
    return transformers.PreTrainedTokenizerFast.from_pretrained(folder)


def hf_chat_ids(folder, messages, add_generation_prompt=True, **kw):
    out = hf_tokenizer(folder).apply_chat_template(
        messages, add_generation_prompt=add_generation_prompt, tokenize=True, **kw)
    return list(out["input_ids"] if hasattr(out, "keys") else out)


@pytest.mark.parametrize("name", list(TEMPLATES))
def test_chat_templates_render_and_tokenize_as_transformers_does(tmp_path, name):
    folder = tokenizer_folder(tmp_path / name, TEMPLATES[name], bos=BOS[name])
    tok = TextTokenizer(folder / "tokenizer.json")
    hf = hf_tokenizer(folder)
    for messages, kw in CONVERSATIONS[: 2 if name == "gemma" else 3] + EXTRA.get(name, []):
        for gen_prompt in (True, False):
            text = tok.chat_template.render(messages, gen_prompt, **kw)
            assert text == hf.apply_chat_template(messages, add_generation_prompt=gen_prompt, tokenize=False, **kw)
            assert tok.encode(text) == hf_chat_ids(folder, messages, gen_prompt, **kw), (messages, kw)
    if BOS[name]:
        assert tok.encode(text)[0] == tok.token_to_id(BOS[name])  # written once, by the template


def test_a_templates_refusal_and_bad_conversations_are_named(tmp_path):
    tok = TextTokenizer(tokenizer_folder(tmp_path / "g", GEMMA, bos="<bos>") / "tokenizer.json")
    with pytest.raises(ValueError, match="refused this conversation: roles must alternate"):
        tok.chat_template.render([{"role": "user", "content": "a"}, {"role": "user", "content": "b"}])
    for bad, err, match in [("hello", TypeError, "list of"), ([], ValueError, "empty"),
                            (["hi"], TypeError, r"messages\[0\] must be a dict"),
                            ([{"content": "hi"}], ValueError, r"messages\[0\] needs a non-empty str 'role'"),
                            ([{"role": "user", "content": 3}], TypeError, r"'content'\] must be a str")]:
        with pytest.raises(err, match=match):
            check_messages(bad)
    assert check_messages([{"role": "user", "content": "x", "name": None}]) == [{"role": "user", "content": "x"}]


def test_where_a_folders_template_comes_from(tmp_path):
    d = tokenizer_folder(tmp_path / "a", [{"name": "tool_use", "template": "T"}, {"name": "default",
                                                                                 "template": CHATML}])
    assert ChatTemplate.from_folder(d).source == CHATML  # a named list: its default
    (d / "chat_template.jinja").write_text(GEMMA)
    assert ChatTemplate.from_folder(d).source == GEMMA  # the .jinja file wins, as in transformers
    assert ChatTemplate.from_folder(tokenizer_folder(tmp_path / "none")) is None
    d = tokenizer_folder(tmp_path / "b", [{"name": "tool_use", "template": "T"}])
    with pytest.raises(EngineError, match=r"needs one named 'default', got names \['tool_use'\]"):
        ChatTemplate.from_folder(d)
    d = tokenizer_folder(tmp_path / "c", "{% for m in messages %}{{ m.content }")
    tok = TextTokenizer(d / "tokenizer.json")  # a broken template refuses chat, not the tokenizer
    assert tok.encode_prompt("ab") == [65, 66]
    with pytest.raises(EngineError, match="chat_template: the chat template does not parse"):
        tok.chat_template.render([{"role": "user", "content": "hi"}])
    d = tokenizer_folder(tmp_path / "d", CHATML, bos=7)  # a special token that is neither a str nor a dict
    with pytest.raises(EngineError, match="bos_token must be a string"):
        ChatTemplate.from_folder(d)


@pytest.mark.parametrize("case, bos_first", [
    (dict(bos="<|begin_of_text|>", post_bos=True), True),  # Llama 3, Gemma: tokenizer.json's post-processor adds it
    (dict(bos="<|begin_of_text|>", post_bos=True, add_bos=False), True),  # the config's flag changes nothing...
    (dict(bos="<bos>", add_bos=True), False),  # ...either way (transformers 5)
    (dict(bos=None), False)])  # Qwen: none
def test_a_text_prompt_gets_the_special_tokens_transformers_adds(tmp_path, case, bos_first):
    folder = tokenizer_folder(tmp_path / "t", **case)
    text = "def grasp(obj):"
    want = list(hf_tokenizer(folder)(text)["input_ids"])
    got = TextTokenizer(folder / "tokenizer.json").encode_prompt(text)
    assert got == want
    assert (got[0] >= len(CHARS)) == bos_first and len(got) == len(text) + bos_first


def test_a_text_prompt_through_the_generator_starts_with_the_bos(tmp_path, instruct):
    _, _, out, _, _ = instruct
    bos = tmp_path / "bos"
    shutil.copytree(out, bos)
    tokenizer_folder(bos, bos="<|begin_of_text|>", post_bos=True)  # the same ids, plus a BOS post-processor
    m = json.loads((bos / "engine.json").read_text())
    m["tokenizer_sha256"] = file_sha256(bos / "tokenizer.json")
    (bos / "engine.json").write_text(json.dumps(m))
    gen = edgespec.load(bos)
    assert gen.encode("ab") == [len(CHARS) + SPECIALS.index("<|begin_of_text|>"), 65, 66]
    assert edgespec.load(out).encode("ab") == [65, 66]


def test_generation_configs_eos_ids_follow_the_configs(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"eos_token_id": 5}))
    assert read_config(tmp_path)["eos_token_id"] == 5
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [7, 4]}))
    assert read_config(tmp_path)["eos_token_id"] == [7, 4]  # generate()'s, in place of config.json's
    (tmp_path / "generation_config.json").write_text(json.dumps({"do_sample": False}))
    assert read_config(tmp_path)["eos_token_id"] == 5
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": "<|im_end|>"}))
    with pytest.raises(CheckpointError, match=r"generation_config.json: eos_token_id must be a token id"):
        read_config(tmp_path)


@pytest.fixture(scope="module")
def instruct(tmp_path_factory):
    """A tiny random Qwen2 'instruct' checkpoint with a chat template in chat_template.jinja and its end of turn in
    generation_config.json (config.json names another EOS), exported;
    (checkpoint, model, engine folder, conversation, end-of-turn id)."""
    from edgespec.export.onnx_export import export_engine
    root = tmp_path_factory.mktemp("instruct")
    ck = tokenizer_folder(root / "ck", bos=None)
    (ck / "chat_template.jinja").write_text(CHATML)
    cfg = transformers.Qwen2Config(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                                   tie_word_embeddings=True, bos_token_id=None,
                                   eos_token_id=len(CHARS) + SPECIALS.index("<|endoftext|>"))
    torch.manual_seed(3)
    model = transformers.Qwen2ForCausalLM(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.2)
        model.tie_weights()
    model.save_pretrained(ck, safe_serialization=True)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Which block?"}]
    ids = torch.tensor([hf_chat_ids(ck, messages)])
    with torch.no_grad():  # the end of turn: the 6th token the model would write (so a reply stops there)
        free = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=8, do_sample=False,
                              eos_token_id=None, pad_token_id=0)[0, ids.shape[1]:].tolist()
    end = free[5]
    (ck / "generation_config.json").write_text(json.dumps({"eos_token_id": [end]}))
    out = root / "engine"
    export_engine(ck, out, max_context=128, progress=False)
    return ck, model, out, messages, end


def test_a_chat_through_an_exported_engine_equals_transformers_generate(instruct):
    ck, model, out, messages, end = instruct
    assert (out / "chat_template.jinja").read_text() == CHATML
    m = json.loads((out / "engine.json").read_text())
    assert m["eos_token_ids"] == [end]  # generation_config.json's, as transformers' generate() reads them
    ids = torch.tensor([hf_chat_ids(ck, messages)])
    gen_cfg = transformers.GenerationConfig.from_pretrained(ck)
    with torch.no_grad():
        want = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=24, do_sample=False,
                              eos_token_id=m["eos_token_ids"], pad_token_id=0)[0, ids.shape[1]:].tolist()
    assert gen_cfg.eos_token_id == [end] and want[-1] == end and len(want) <= 6
    gen = edgespec.load(out)
    assert gen.chat_ids(messages) == ids[0].tolist()
    plain = gen.plain().chat(messages, max_new_tokens=24)
    assert plain.token_ids == want and plain.finish_reason == "eos"
    spec = edgespec.load(out, draft="ngram").chat(messages, max_new_tokens=24)
    assert spec.token_ids == want
    assert "".join(gen.plain().stream_chat(messages, max_new_tokens=24)) == plain.text
    assert plain.text == gen.tok.decode(want[:-1] if end in gen.tok.control else want)


def test_a_reply_ending_at_a_special_eos_leaves_it_out_of_the_text(instruct, tmp_path):
    """An end of turn that is a special token (<|im_end|>) is not text: token_ids end with it, .text and the stream
    do not. Here the model's end of turn is a character; marked special, it is left out of the text."""
    from tokenizers import AddedToken, Tokenizer
    _, _, out, messages, end = instruct
    before = edgespec.load(out).plain().chat(messages, max_new_tokens=24)
    special = tmp_path / "special"
    shutil.copytree(out, special)
    tok = Tokenizer.from_file(str(special / "tokenizer.json"))
    tok.add_special_tokens([AddedToken(CHARS[end], special=True, normalized=False)])
    tok.save(str(special / "tokenizer.json"))
    m = json.loads((special / "engine.json").read_text())
    m["tokenizer_sha256"] = file_sha256(special / "tokenizer.json")
    (special / "engine.json").write_text(json.dumps(m))
    gen = edgespec.load(special).plain()
    assert end in gen.tok.control and gen.chat_ids(messages) == edgespec.load(out).chat_ids(messages)
    after = gen.chat(messages, max_new_tokens=24)
    assert after.token_ids == before.token_ids and after.finish_reason == "eos"
    assert before.text.endswith(CHARS[end]) and after.text == before.text[:-1]
    assert "".join(gen.stream_chat(messages, max_new_tokens=24)) == after.text


def test_the_cli_chats_through_the_template(instruct, capsys):
    from edgespec.cli import main
    _, _, out, messages, end = instruct
    assert main(["inspect", str(out)]) == 0
    assert f"EOS ids [{end}]; chat template: chat_template.jinja" in capsys.readouterr().out
    assert main(["generate", "--target", str(out), "--chat", "--system", "Be brief.", "--prompt", "Which block?",
                 "--json", "--gamma", "0", "--max-new-tokens", "24"]) == 0
    got = json.loads(capsys.readouterr().out)
    assert got["token_ids"] == edgespec.load(out).plain().chat(messages, max_new_tokens=24).token_ids
    assert main(["generate", "--target", str(out), "--system", "x", "--prompt", "y"]) == 2
    assert "--system goes with --chat" in capsys.readouterr().err


def test_an_engine_without_a_template_says_where_one_comes_from(instruct, tmp_path):
    _, _, out, messages, _ = instruct
    bare = tmp_path / "bare"
    shutil.copytree(out, bare)
    (bare / "chat_template.jinja").unlink()
    with pytest.raises(ValueError, match="no chat template .*chat_template.jinja"):
        edgespec.load(bare).chat(messages)
