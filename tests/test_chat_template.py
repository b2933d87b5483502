"""Chat messages -> prompt text (`server/chat.py`): jinja2 chat templates rendered as
Hugging Face transformers renders them (`apply_chat_template` is the oracle), and
DeepSeek-V3.2's message encoding."""

from __future__ import annotations

import json

import pytest
from transformers import PreTrainedTokenizerFast

from pagedmla.server.chat import deepseek_v32_render, load_chat_renderer
from pagedmla.tokenizer import ByteTokenizer

TEMPLATES = {
    "plain": ("{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}\n"
              "{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}"),
    # Whitespace control, a system message taken out, loop controls, raise_exception.
    "system": ("{% if messages[0]['role'] == 'system' %}{% set sys = messages[0]['content'] %}"
               "{% set messages = messages[1:] %}{% else %}{% set sys = '' %}{% endif %}\n"
               "  {{ bos_token }}[{{ sys }}]\n"
               "{% for m in messages %}\n"
               "  {% if m['role'] == 'tool' %}{% continue %}{% endif %}\n"
               "  {% if loop.first and m['role'] != 'user' %}"
               "{{ raise_exception('the first turn must be from the user') }}{% endif %}\n"
               "  {{ m['role'] | upper }}: {{ m['content'] | trim }}{{ eos_token }}\n"
               "{% endfor %}\n"
               "{% if add_generation_prompt %}ASSISTANT:{% endif %}"),
}
MESSAGES = [{"role": "system", "content": "Be brief."},
            {"role": "user", "content": "  What is MLA?  "},
            {"role": "tool", "content": "ignored"},
            {"role": "assistant", "content": "A latent cache. ✓"},
            {"role": "user", "content": [{"type": "text", "text": "And "},
                                         {"type": "text", "text": "DSA?"}]}]


def _checkpoint(tmp_path, template: str):
    config = {"bos_token": "<bos>", "eos_token": "<eos>", "chat_template": template}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    ByteTokenizer().to_tokenizers().save(str(tmp_path / "tokenizer.json"))
    return tmp_path


@pytest.mark.parametrize("name", list(TEMPLATES))
@pytest.mark.parametrize("generation_prompt", [True, False])
def test_templates_render_as_transformers_renders_them(tmp_path, name, generation_prompt):
    path = _checkpoint(tmp_path, TEMPLATES[name])
    render = load_chat_renderer(path, "deepseek_v3")
    hf = PreTrainedTokenizerFast(tokenizer_file=str(path / "tokenizer.json"),
                                 bos_token="<bos>", eos_token="<eos>",
                                 chat_template=TEMPLATES[name])
    # transformers takes text parts as they are; give it the joined text.
    plain = [{**m, "content": m["content"] if isinstance(m["content"], str)
              else "".join(p["text"] for p in m["content"])} for m in MESSAGES]
    want = hf.apply_chat_template(plain, tokenize=False,
                                  add_generation_prompt=generation_prompt)
    assert render(MESSAGES, generation_prompt) == want


def test_a_template_that_raises_is_a_value_error(tmp_path) -> None:
    render = load_chat_renderer(_checkpoint(tmp_path, TEMPLATES["system"]), "deepseek_v3")
    with pytest.raises(ValueError, match="the first turn must be from the user"):
        render([{"role": "assistant", "content": "first"}], True)


def test_chat_template_jinja_file_wins(tmp_path) -> None:
    path = _checkpoint(tmp_path, "from the config")
    (path / "chat_template.jinja").write_text("{{ messages[0]['content'] }}!")
    assert load_chat_renderer(path, "deepseek_v3")([{"role": "user", "content": "hi"}],
                                                   True) == "hi!"


def test_deepseek_v32_encoding(tmp_path) -> None:
    # V3.2 ships no template: its encoding applies where the checkpoint has none.
    assert load_chat_renderer(tmp_path, "deepseek_v32") is deepseek_v32_render
    assert load_chat_renderer(tmp_path, "deepseek_v3") is None
    messages = [{"role": "system", "content": "S"}, {"role": "user", "content": "U1"},
                {"role": "assistant", "content": "A1"}, {"role": "user", "content": "U2"}]
    want = ("<｜begin▁of▁sentence｜>S<｜User｜>U1<｜Assistant｜></think>A1"
            "<｜end▁of▁sentence｜><｜User｜>U2<｜Assistant｜></think>")
    assert deepseek_v32_render(messages, True) == want
    with pytest.raises(ValueError, match="role"):
        deepseek_v32_render([{"role": "tool", "content": "x"}], True)
