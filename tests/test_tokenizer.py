"""The Tokenizer against transformers.AutoTokenizer on tokenizers trained in a tmp dir."""

import json
import os
from datetime import datetime

import jinja2
import pytest
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers, processors, trainers

from sage_infer.models.tokenizer import Tokenizer

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # transformers only ever reads the tmp dirs

CORPUS = [
    "Hello world, the quick brown fox jumps over the lazy dog. It's 42 degrees!",
    "你好，世界！我们今天学习中文。汉字很有意思。",
    "Emoji time 🙂🚀🎉 and café naïve résumé",
    "def main():\n    return {'a': [1, 2, 3]}\n",
]
TEXTS = [
    "Hello world!",
    "  leading spaces and\ttabs\n\nnewlines",
    "你好，世界 🙂🚀 mixed text",
    "<|im_start|>user\nhi<|im_end|>",
    "",
]
CHATML = (
    "{% for message in messages %}"
    "{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
QWEN_TOOLS = """{%- if tools %}
    {{- '<|im_start|>system\\n' }}
    {%- if messages[0]['role'] == 'system' %}{{- messages[0]['content'] }}
    {%- else %}{{- 'You are a helpful assistant.' }}{%- endif %}
    {{- "\\n\\n# Tools\\n\\n<tools>" }}
    {%- for tool in tools %}
        {{- "\\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\\n</tools><|im_end|>\\n" }}
{%- elif messages[0]['role'] == 'system' %}
    {{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}
{%- endif %}
{%- for message in messages %}
    {%- if message.role == "user" or (message.role == "assistant" and not message.tool_calls) %}
        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}
    {%- elif message.role == "assistant" %}
        {{- '<|im_start|>' + message.role }}
        {%- if message.content %}{{- '\\n' + message.content }}{%- endif %}
        {%- for tool_call in message.tool_calls %}
            {%- if tool_call.function is defined %}{%- set tool_call = tool_call.function %}{%- endif %}
            {{- '\\n<tool_call>\\n{"name": "' + tool_call.name + '", "arguments": ' }}
            {{- tool_call.arguments | tojson }}
            {{- '}\\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\\n' }}
    {%- elif message.role == "tool" %}
        {{- '<|im_start|>user\\n<tool_response>\\n' + message.content + '\\n</tool_response><|im_end|>\\n' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"""
LLAMA3 = """{{- bos_token }}
{%- if not date_string is defined %}{%- set date_string = strftime_now("%d %b %Y") %}{%- endif %}
{%- if messages[0]['role'] == 'system' %}
    {%- set system_message = messages[0]['content']|trim %}
    {%- set messages = messages[1:] %}
{%- else %}
    {%- set system_message = "" %}
{%- endif %}
{{- "<|start_header_id|>system<|end_header_id|>\\n\\n" }}
{{- "Today Date: " + date_string + "\\n\\n" }}
{%- if tools is not none %}
    {%- for t in tools %}{{- t | tojson(indent=4) }}{{- "\\n\\n" }}{%- endfor %}
{%- endif %}
{{- system_message }}{{- "<|eot_id|>" }}
{%- for message in messages %}
    {%- if message.role not in ['user', 'assistant', 'tool'] %}
        {{- raise_exception('Unknown role: ' + message.role) }}
    {%- endif %}
    {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' }}
    {{- message['content'] | trim + '<|eot_id|>' }}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}"""
CHAT = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "你好 🙂 <b>bold</b>"},
    {"role": "assistant", "content": "Hi! "},
    {"role": "user", "content": "What's the weather?"},
]
TOOLS = [{"type": "function", "function": {"name": "weather", "parameters": {"type": "object", "properties": {}}}}]


def write_model_dir(path, special_tokens, tokenizer_config, post_processor=None, vocab_size=600, files=None):
    tok = HFTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = post_processor or processors.ByteLevel(trim_offsets=False)
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=special_tokens, initial_alphabet=alphabet)
    tok.train_from_iterator(CORPUS * 20, trainer)
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
    for name, content in (files or {}).items():
        (path / name).write_text(json.dumps(content) if isinstance(content, dict) else content)
    return path


@pytest.fixture
def chatml_dir(tmp_path):
    config = {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>", "bos_token": None, "chat_template": CHATML}
    return write_model_dir(tmp_path, ["<|endoftext|>", "<|im_start|>", "<|im_end|>"], config)


@pytest.fixture
def llama3_dir(tmp_path):
    bos_processor = processors.TemplateProcessing(
        single="<|begin_of_text|> $A", pair="<|begin_of_text|> $A <|begin_of_text|> $B",
        special_tokens=[("<|begin_of_text|>", 0)],
    )  # fmt: skip
    config = {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>", "chat_template": LLAMA3}
    specials = ["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>", "<|eom_id|>"]
    files = {"generation_config.json": {"eos_token_id": [3, 4]}, "config.json": {"eos_token_id": 3}}
    return write_model_dir(tmp_path, specials, config, post_processor=bos_processor, files=files)


def load_both(path):
    from transformers import AutoTokenizer

    return Tokenizer.from_dir(path), AutoTokenizer.from_pretrained(str(path))


@pytest.mark.parametrize("fixture", ["chatml_dir", "llama3_dir"])
def test_encode_matches_transformers(fixture, request):
    ours, hf = load_both(request.getfixturevalue(fixture))
    for text in TEXTS:
        assert ours.encode(text) == hf(text).input_ids, text
        assert ours.encode(text, add_special_tokens=False) == hf(text, add_special_tokens=False).input_ids


def test_llama3_post_processor_adds_bos(llama3_dir):
    ours = Tokenizer.from_dir(llama3_dir)
    assert ours.encode("Hello")[0] == ours.bos_token_id == 0
    assert ours.encode("Hello", add_special_tokens=False)[0] != 0


@pytest.mark.parametrize("fixture", ["chatml_dir", "llama3_dir"])
def test_decode_matches_transformers(fixture, request):
    ours, hf = load_both(request.getfixturevalue(fixture))
    for text in TEXTS:
        ids = hf(text).input_ids
        for skip in (True, False):
            assert ours.decode(ids, skip_special_tokens=skip) == hf.decode(ids, skip_special_tokens=skip)


def test_byte_level_round_trips_multibyte_text_and_partial_bytes_match(chatml_dir):
    ours, hf = load_both(chatml_dir)
    text = "中文和表情 🙂🚀🎉 naïve"
    ids = ours.encode(text)
    assert ours.decode(ids) == text
    # Single tokens may hold part of a character's bytes: both decode those to U+FFFD alike.
    assert [ours.decode([i]) for i in ids] == [hf.decode([i]) for i in ids]
    assert any("\ufffd" in ours.decode([i]) for i in ids)


def test_token_lookups_and_special_ids_match_transformers(chatml_dir):
    ours, hf = load_both(chatml_dir)
    ids = ours.encode("Hello 你好")
    assert ours.convert_ids_to_tokens(ids) == hf.convert_ids_to_tokens(ids)
    assert ours.token_to_id("<|im_end|>") == hf.convert_tokens_to_ids("<|im_end|>")
    assert ours.id_to_token(2) == "<|im_end|>"
    assert ours.vocab_size == len(hf)
    assert set(hf.all_special_ids) <= set(ours.all_special_ids)
    assert ours.pad_token_id == hf.pad_token_id and ours.bos_token_id is None


def test_eos_ids_union_generation_config_config_and_tokenizer(llama3_dir):
    assert Tokenizer.from_dir(llama3_dir).eos_token_ids == [3, 4]


def test_eos_from_tokenizer_when_no_model_configs(chatml_dir):
    assert Tokenizer.from_dir(chatml_dir).eos_token_ids == [2]


@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chatml_template_matches_transformers(chatml_dir, add_generation_prompt):
    ours, hf = load_both(chatml_dir)
    expected = hf.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=add_generation_prompt)
    assert ours.apply_chat_template(CHAT, add_generation_prompt=add_generation_prompt) == expected


def test_qwen_tool_template_matches_transformers(tmp_path):
    config = {"eos_token": "<|im_end|>", "chat_template": QWEN_TOOLS}
    ours, hf = load_both(write_model_dir(tmp_path, ["<|endoftext|>", "<|im_start|>", "<|im_end|>"], config))
    call = {"type": "function", "function": {"name": "weather", "arguments": {"city": "北京"}}}
    chat = [*CHAT, {"role": "assistant", "content": None, "tool_calls": [call]}, {"role": "tool", "content": "晴 25°C"}]
    expected = hf.apply_chat_template(chat, tools=TOOLS, tokenize=False, add_generation_prompt=True)
    assert ours.apply_chat_template(chat, tools=TOOLS) == expected
    assert '"北京"' in expected  # tojson keeps non-ASCII as is


def test_llama3_template_with_bos_and_tools_matches_transformers(llama3_dir):
    ours, hf = load_both(llama3_dir)
    for tools in (None, TOOLS):
        expected = hf.apply_chat_template(CHAT, tools=tools, tokenize=False, add_generation_prompt=True)
        rendered = ours.apply_chat_template(CHAT, tools=tools)
        assert rendered == expected
        assert rendered.startswith("<|begin_of_text|><|start_header_id|>system")
    # A rendered chat already holds BOS: encode it without adding another, as transformers does.
    ids = hf.apply_chat_template(CHAT, tokenize=True, add_generation_prompt=True, return_dict=False)
    assert ours.encode(ours.apply_chat_template(CHAT), add_special_tokens=False) == list(ids)


def test_strftime_now_gives_todays_date(llama3_dir):
    rendered = Tokenizer.from_dir(llama3_dir).apply_chat_template(CHAT[1:2])
    assert f"Today Date: {datetime.now().strftime('%d %b %Y')}" in rendered


def test_template_kwargs_reach_the_template(llama3_dir):
    rendered = Tokenizer.from_dir(llama3_dir).apply_chat_template(CHAT[1:2], date_string="26 Jul 2024")
    assert "Today Date: 26 Jul 2024" in rendered


def test_raise_exception_in_template_raises_template_error(llama3_dir):
    with pytest.raises(jinja2.TemplateError, match="Unknown role: narrator"):
        Tokenizer.from_dir(llama3_dir).apply_chat_template([{"role": "narrator", "content": "x"}])


def test_template_cannot_reach_python_internals(chatml_dir):
    ours = Tokenizer.from_dir(chatml_dir)
    ours.chat_template = "{{ messages.__class__.__mro__ }}"
    with pytest.raises(jinja2.exceptions.SecurityError):
        ours.apply_chat_template(CHAT)


@pytest.mark.parametrize(
    "template",
    [
        "{% for m in messages %}{% if m.role == 'assistant' %}{% generation %}{{ m.content }}{% endgeneration %}"
        "{% else %}{{ m.content }}{% endif %}{% endfor %}",
        "{% set ns = namespace(n=0) %}{% for m in messages %}{% set ns.n = ns.n + 1 %}{% if ns.n > 2 %}{% break %}"
        "{% endif %}[{{ m.content }}]{% endfor %}{{ dict(a=1) | tojson }}",
    ],
)
def test_generation_tag_namespace_and_loopcontrols_render_like_transformers(chatml_dir, template):
    ours, hf = load_both(chatml_dir)
    ours.chat_template = template
    assert ours.apply_chat_template(CHAT) == hf.apply_chat_template(CHAT, chat_template=template, tokenize=False)


def test_template_cannot_set_underscore_namespace_attributes(chatml_dir):
    ours = Tokenizer.from_dir(chatml_dir)
    ours.chat_template = "{% set ns = namespace() %}{% set ns._x = 1 %}"
    with pytest.raises(jinja2.exceptions.SecurityError):
        ours.apply_chat_template(CHAT)


def test_chat_template_jinja_file_takes_priority(tmp_path):
    config = {"eos_token": "<|im_end|>", "chat_template": "config template"}
    path = write_model_dir(tmp_path, ["<|im_end|>"], config, files={"chat_template.jinja": CHATML})
    ours, hf = load_both(path)
    assert ours.apply_chat_template(CHAT) == hf.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True)


def test_missing_chat_template_raises_value_error(tmp_path):
    ours = Tokenizer.from_dir(write_model_dir(tmp_path, ["<|im_end|>"], {"eos_token": "<|im_end|>"}))
    assert ours.chat_template is None
    with pytest.raises(ValueError, match="has no chat template"):
        ours.apply_chat_template(CHAT)


def test_missing_tokenizer_json_names_the_file(tmp_path):
    with pytest.raises(FileNotFoundError, match="tokenizer.json"):
        Tokenizer.from_dir(tmp_path)


def test_corrupt_tokenizer_json_raises_value_error_naming_the_file(tmp_path):
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(ValueError, match="tokenizer.json: cannot load"):
        Tokenizer.from_dir(tmp_path)


def test_config_special_token_missing_from_vocab_is_added_like_transformers(tmp_path):
    config = {"eos_token": "<|im_end|>", "pad_token": "<pad>"}
    ours, hf = load_both(write_model_dir(tmp_path, ["<|im_end|>"], config))
    assert ours.pad_token_id == hf.pad_token_id == ours.vocab_size - 1
    assert ours.encode("a<pad>b") == hf("a<pad>b").input_ids


def test_add_bos_token_applies_when_tokenizer_json_has_no_post_processor(tmp_path):
    config = {"bos_token": "<s>", "eos_token": "</s>", "add_bos_token": True}
    path = write_model_dir(tmp_path, ["<s>", "</s>"], config)
    data = json.loads((path / "tokenizer.json").read_text())
    data["post_processor"] = None
    (path / "tokenizer.json").write_text(json.dumps(data))
    assert Tokenizer.from_dir(path).encode("Hello")[0] == 0
