"""Chat templates: transformers-compatible rendering, built-ins, and errors that never leak a jinja traceback."""

import json
from datetime import datetime

import pytest

from conftest import in_kit, in_reference
from engine.errors import InvalidRequest, TemplateError
from engine.templates import CHATML_TEMPLATE, GEMMA_TEMPLATE, ChatTemplate, template_for

SMOLLM2 = "SmolLM2-135M-Instruct.Q4_1"
GEMMA = "gemma-3-270m-q4_k_m"


def _chat_case(model: str) -> dict:
    cases = json.loads(in_reference(f"{model}.json").read_text())["cases"]
    (case,) = [c for c in cases if c["category"] == "chat"]
    return case


def _meta(model: str) -> dict:
    return json.loads(in_reference(f"{model}.meta.json").read_text())


# --- golden prompts from llama.cpp's reference run ---------------------------------------------------------


def test_smollm2_gguf_template_matches_reference_prompt():
    case = _chat_case(SMOLLM2)
    meta = _meta(SMOLLM2)
    assert "tokenizer.chat_template" in case["chat_template_source"]
    template = template_for(meta["architecture"], meta["chat_template"], "<|im_start|>", "<|im_end|>")
    assert template.render(case["messages"], add_generation_prompt=True) == case["prompt"]


def test_smollm2_template_keeps_a_given_system_prompt():
    meta = _meta(SMOLLM2)
    template = ChatTemplate(meta["chat_template"])
    text = template.render([{"role": "system", "content": "Be terse."}, {"role": "user", "content": "Hi"}])
    assert text == "<|im_start|>system\nBe terse.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"


def test_gemma_builtin_template_matches_reference_prompt():
    case = _chat_case(GEMMA)
    meta = _meta(GEMMA)
    # The reference was rendered with llama.cpp's built-in 'gemma' format (the GGUF has no template);
    # the tokenizer adds BOS (add_bos true), so the text itself must not start with "<bos>".
    assert meta["chat_template"] is None
    assert "built-in 'gemma' template" in case["chat_template_source"]
    assert case["add_bos"] is True
    template = template_for(meta["architecture"], meta["chat_template"], "<bos>", "<eos>")
    assert template.source == GEMMA_TEMPLATE
    assert template.render(case["messages"], add_generation_prompt=True) == case["prompt"]


def test_gemma_builtin_merges_system_into_first_user_turn_and_maps_assistant_to_model():
    template = template_for("gemma3", None, "<bos>", "<eos>")
    text = template.render([
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello."},
        {"role": "user", "content": "Bye"},
    ], add_generation_prompt=False)
    assert text == ("<start_of_turn>user\nYou are terse.\n\nHi<end_of_turn>\n"
                    "<start_of_turn>model\nHello.<end_of_turn>\n"
                    "<start_of_turn>user\nBye<end_of_turn>\n")
    assert "<bos>" not in text


def test_gemma_builtin_rejects_tool_role():
    template = template_for("gemma3", None, "<bos>", "<eos>")
    with pytest.raises(TemplateError, match="no 'tool' role"):
        template.render([{"role": "user", "content": "x"}, {"role": "tool", "content": "42"}])


def test_unknown_arch_without_template_gets_chatml():
    template = template_for("qwen2", None, "", "<|im_end|>")
    assert template.source == CHATML_TEMPLATE
    text = template.render([{"role": "system", "content": "S"}, {"role": "user", "content": "U"}])
    assert text == "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nU<|im_end|>\n<|im_start|>assistant\n"
    assert template.render([{"role": "user", "content": "U"}], add_generation_prompt=False) == (
        "<|im_start|>user\nU<|im_end|>\n")


def test_gguf_template_wins_over_builtin():
    template = template_for("gemma3", "{{ bos_token }}{{ messages[0]['content'] }}", "<bos>", "<eos>")
    assert template.render([{"role": "user", "content": "x"}]) == "<bos>x"


# --- transformers semantics ----------------------------------------------------------------------------


def test_trim_blocks_and_lstrip_blocks_like_transformers():
    source = "{% for m in messages %}\n    {% if m.role == 'user' %}\n[{{ m.content }}]\n    {% endif %}\n{% endfor %}"
    text = ChatTemplate(source).render([{"role": "user", "content": "a"}, {"role": "user", "content": "b"}])
    assert text == "[a]\n[b]\n"


def test_loopcontrols_extension():
    source = "{% for m in messages %}{% if loop.index > 1 %}{% break %}{% endif %}{{ m.content }}{% endfor %}"
    assert ChatTemplate(source).render([{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]) == "a"


def test_raise_exception_becomes_template_error_with_the_message():
    template = ChatTemplate("{% if messages[0].role != 'user' %}{{ raise_exception('Roles must alternate') }}{% endif %}ok")
    assert template.render([{"role": "user", "content": "x"}]) == "ok"
    with pytest.raises(TemplateError) as info:
        template.render([{"role": "assistant", "content": "x"}])
    assert str(info.value) == "Roles must alternate"


def test_tojson_keeps_unicode_and_honours_indent_and_separators():
    value = {"name": "météo", "html": "<b>&'"}
    assert ChatTemplate("{{ x | tojson }}").render([], x=value) == '{"name": "météo", "html": "<b>&\'"}'
    assert ChatTemplate("{{ x | tojson(indent=2) }}").render([], x={"a": 1}) == '{\n  "a": 1\n}'
    assert ChatTemplate("{{ x | tojson(separators=(',', ':')) }}").render([], x={"a": [1, 2]}) == '{"a":[1,2]}'
    assert ChatTemplate("{{ x | tojson(ensure_ascii=True) }}").render([], x="é") == '"\\u00e9"'


def test_tools_reach_the_template():
    tools = [{"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                                "parameters": {"type": "object",
                                                               "properties": {"city": {"type": "string"}}}}}]
    source = ("{% if tools %}<tools>{% for t in tools %}{{ t | tojson }}{% endfor %}</tools>\n{% endif %}"
              "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}")
    template = ChatTemplate(source)
    text = template.render([{"role": "user", "content": "Weather in Paris?"}], tools=tools)
    assert text == "<tools>" + json.dumps(tools[0]) + "</tools>\nuser: Weather in Paris?\n"
    assert template.render([{"role": "user", "content": "hi"}]) == "user: hi\n"


def test_extra_variables_and_bos_eos():
    template = ChatTemplate("{{ bos_token }}{% if enable_thinking %}T{% endif %}{{ eos_token }}",
                            bos_token="<s>", eos_token="</s>")
    assert template.render([], enable_thinking=True) == "<s>T</s>"
    assert template.render([]) == "<s></s>"


def test_strftime_now():
    text = ChatTemplate("{{ strftime_now('%Y') }}").render([])
    assert text == str(datetime.now().year)


def test_generation_block_renders_its_body():
    source = "{% for m in messages %}{% generation %}{{ m.content }}{% endgeneration %}{% endfor %}"
    assert ChatTemplate(source).render([{"role": "assistant", "content": "hi"}]) == "hi"


# --- message content -----------------------------------------------------------------------------------


def test_content_parts_are_joined_into_text():
    template = ChatTemplate("{% for m in messages %}[{{ m.content }}]{% endfor %}")
    messages = [{"role": "user", "content": [{"type": "text", "text": "first"}, {"type": "text", "text": "second"}]}]
    assert template.render(messages) == "[first\nsecond]"
    assert messages[0]["content"][0] == {"type": "text", "text": "first"}  # the caller's message is untouched


def test_content_none_is_kept_for_templates_that_test_it():
    template = ChatTemplate("{% for m in messages %}{{ 'none' if m.content is none else m.content }}{% endfor %}")
    assert template.render([{"role": "assistant", "content": None, "tool_calls": []}]) == "none"


def test_non_text_content_part_is_refused():
    with pytest.raises(InvalidRequest, match="image_url"):
        ChatTemplate("{{ messages }}").render(
            [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}])


# --- errors ---------------------------------------------------------------------------------------------


def test_syntax_error_is_a_template_error():
    with pytest.raises(TemplateError, match="syntax error") as info:
        ChatTemplate("{% for m in messages %}{{ m.content }}")
    assert "line 1" in str(info.value)


def test_runtime_error_is_a_template_error():
    with pytest.raises(TemplateError, match="TypeError"):
        ChatTemplate("{{ messages[0].content + 1 }}").render([{"role": "user", "content": "x"}])
    with pytest.raises(TemplateError, match="undefined"):
        ChatTemplate("{{ nothing.here }}").render([])


@pytest.mark.parametrize("source", [
    "{{ ''.__class__.__mro__ }}",
    "{{ ''.__class__ }}",
    "{{ messages.__class__.__base__.__subclasses__() }}",
    "{{ cycler.__init__.__globals__ }}",
])
def test_sandbox_refuses_dunder_access(source):
    with pytest.raises(TemplateError, match="sandbox|unsafe|undefined"):
        ChatTemplate(source).render([{"role": "user", "content": "x"}])


def test_immutable_sandbox_refuses_mutation():
    with pytest.raises(TemplateError, match="unsafe"):
        ChatTemplate("{{ messages.append({'role': 'user'}) }}").render([])


@pytest.mark.real_model
def test_smollm2_template_read_from_the_gguf_file(smollm2_gguf):
    from gguf import GGUFReader

    reader = GGUFReader(smollm2_gguf)
    source = reader.fields["tokenizer.chat_template"].contents()
    case = _chat_case(SMOLLM2)
    assert ChatTemplate(source).render(case["messages"]) == case["prompt"]


@pytest.mark.parametrize("family", ["qwen3_moe", "qwen3_5", "qwen3_5_moe", "gpt_oss", "lfm2", "gemma4"])
def test_a_kit_chat_prompt_renders_from_its_gguf_template(family):
    # each family's chat case: its messages through the template its GGUF carries give llama.cpp's prompt text
    import engine

    kit = in_kit(family)
    ref = json.loads(next(kit.glob("*.Q8_0.json")).read_text())
    case = next(c for c in ref["cases"] if c["name"] == "chat")
    model = engine.load_model(kit / ref["model_file"], selftest=False)
    assert model.render_chat(case["messages"], add_generation_prompt=True) == case["prompt"]
