"""Chat templates render as transformers' ``apply_chat_template`` renders them.

Templates in the styles of the families being added (Llama 3's ``bos_token`` and
``strftime_now``, Qwen's ``tools`` test and ``namespace``, Gemma's role mapping and
``raise_exception``, a ``{% generation %}`` block, ``tojson`` with its arguments), rendered by
``Tokenizer.apply_chat_template`` and by transformers' ``render_jinja_template`` with the same
special tokens: the text must be the same.
"""

from __future__ import annotations

import pytest
from tokenizers import Tokenizer as BackendTokenizer
from tokenizers import models

from pdserve.engine.model.tokenizer import NoChatTemplateError, Tokenizer

LLAMA3 = (
    "{{- bos_token }}{%- set date_string = strftime_now('%d %b %Y') %}"
    "{{- '<|start_header_id|>system<|end_header_id|>\\n\\n' }}Today Date: {{ date_string }}\n"
    "{%- if messages[0]['role'] == 'system' %}{{ '\\n' + messages[0]['content'] | trim }}"
    "{%- set messages = messages[1:] %}{%- endif %}{{- '<|eot_id|>' }}"
    "{%- for message in messages %}{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n'"
    " + message['content'] | trim + '<|eot_id|>' }}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}"
)
QWEN = (
    "{%- if tools %}{{- 'TOOLS' }}{%- endif %}"
    "{%- set ns = namespace(last_user=-1) %}"
    "{%- for message in messages %}{%- if message.role == 'user' %}{%- set ns.last_user = loop.index0 %}{%- endif %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}{%- endfor %}"
    "{{- '<!-- last user: ' ~ ns.last_user ~ ' -->' }}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
GEMMA = (
    "{{ bos_token }}{% for message in messages %}"
    "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    "{% set role = 'model' if message['role'] == 'assistant' else message['role'] %}"
    "{{ '<start_of_turn>' + role + '\\n' + message['content'] | trim + '<end_of_turn>\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<start_of_turn>model\\n' }}{% endif %}"
)
GENERATION_AND_JSON = (
    "{% for message in messages %}{% if message.role == 'assistant' %}{% generation %}"
    "{{ message.content }}{% endgeneration %}{% else %}{{ message | tojson(indent=1, sort_keys=True) }}"
    "{% endif %}{% endfor %}{{ eos_token if not add_generation_prompt else '' }}"
    "{{ {'a': [1, 2]} | tojson(separators=(',', ':')) }}{{ pad_token is defined }}{{ unk_token }}"
)
CONVERSATIONS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [
        {"role": "system", "content": "  Answer briefly.  "},
        {"role": "user", "content": "Hi <b>there</b> é ü"},
        {"role": "assistant", "content": "Hello!"},
        {"role": "user", "content": "2+2?"},
    ],
]


def _tokenizer(template: str | None) -> Tokenizer:
    vocab = {t: i for i, t in enumerate(["<unk>", "<s>", "</s>", "<pad>"])}
    backend = BackendTokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    return Tokenizer(
        backend,
        bos_token_id=1,
        eos_token_id=2,
        chat_template=template,
        template_tokens={"unk_token": "<unk>"},
    )


@pytest.mark.parametrize(
    "template", [LLAMA3, QWEN, GEMMA, GENERATION_AND_JSON], ids=["llama3", "qwen", "gemma", "misc"]
)
def test_renders_as_transformers(template):
    from transformers.utils.chat_template_utils import render_jinja_template

    ours = _tokenizer(template)
    for messages in CONVERSATIONS:
        if template is GEMMA and messages[0]["role"] == "system":
            continue  # this Gemma-style template takes no system turn (it raises, tested below)
        for add_generation_prompt in (True, False):
            expected, _ = render_jinja_template(
                conversations=[messages],
                chat_template=template,
                add_generation_prompt=add_generation_prompt,
                bos_token="<s>",
                eos_token="</s>",
                unk_token="<unk>",
            )
            assert ours.apply_chat_template(messages, add_generation_prompt) == expected[0]


def test_a_refusing_template_and_no_template():
    with pytest.raises(
        ValueError, match="^messages: the chat template refused them: Conversation roles must"
    ):
        _tokenizer(GEMMA).apply_chat_template([{"role": "assistant", "content": "Hi"}])
    with pytest.raises(NoChatTemplateError, match="no chat template"):
        _tokenizer(None).apply_chat_template(CONVERSATIONS[0])
    with pytest.raises(ValueError, match="chat template"):  # the sandbox holds
        _tokenizer(
            "{{ messages.__class__.__mro__ }}{% set ns = namespace() %}{% set ns._x = 1 %}"
        ).apply_chat_template(CONVERSATIONS[0])
