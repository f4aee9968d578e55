"""ChatTokenizer: an episode's ids grow by appending, decode to the template's text, keep sampled ids verbatim."""

from __future__ import annotations

import json
import shutil

import pytest

from workers.envs.base import openai_tools
from workers.envs.terminal import FAMILY
from workers.policy.chat_template import (
    ChatTemplateError,
    ChatTokenizer,
    load_chat_tokenizer,
)
from workers.policy.tiny_model import IM_END
from workers.policy.toolcalls import format_tool_call

TOOLS = openai_tools(FAMILY.tools)


@pytest.fixture(scope="module")
def tok(tiny_models) -> ChatTokenizer:
    return ChatTokenizer(tiny_models.primary)


def _system_and_task():
    return [
        {"role": "system", "content": "You are an agent in a Linux terminal. Use the tools."},
        {"role": "user", "content": "Count the ERROR lines in /var/log/app.log and write the number to /app/n.txt."},
    ]


def _round_trip_completion(tok: ChatTokenizer, text: str) -> list[int]:
    """Return canonical ids for ``text`` plus the end-of-turn token; check they decode back to ``text``."""
    ids = tok.encode(text)
    assert tok.decode(ids) == text  # precondition: this completion round-trips
    return [*ids, tok.end_of_turn_id]


def test_end_of_turn_is_found_from_the_template(tok):
    assert tok.end_of_turn == IM_END
    assert tok.end_of_turn_id == tok.tokenizer.convert_tokens_to_ids(IM_END)
    assert tok.ends_turn([5, tok.end_of_turn_id])
    assert not tok.ends_turn([tok.end_of_turn_id, 5])
    assert not tok.ends_turn([])


def test_initial_prompt_is_the_rendered_template(tok):
    messages = _system_and_task()
    ids = tok.initial_prompt_ids(messages, TOOLS)
    text = tok.render(messages, TOOLS, add_generation_prompt=True)
    assert tok.decode(ids) == text
    assert ids == tok.encode(text)
    assert json.dumps(TOOLS[0]["function"]["name"]) in text  # the tools are in the prompt


def test_multi_turn_concatenation_decodes_to_the_full_conversation(tok):
    messages = _system_and_task()
    ids = tok.initial_prompt_ids(messages, TOOLS)
    turns = [
        (
            "I will count them.\n" + format_tool_call("bash", {"command": "grep -c ERROR /var/log/app.log"}),
            [{"role": "tool", "content": "17\n[exit code: 0]"}],
        ),
        (
            format_tool_call("bash", {"command": "echo 17 > /app/n.txt && cat /app/n.txt"}),
            [{"role": "tool", "content": "17\n[exit code: 0]"}, {"role": "user", "content": "Anything else?"}],
        ),
        (
            format_tool_call("submit", {}),
            [{"role": "tool", "content": "[episode ended: submitted]\n"}],
        ),
    ]
    for completion_text, observation in turns:
        completion = _round_trip_completion(tok, completion_text)
        ids += completion
        history = [*messages, {"role": "assistant", "content": completion_text}]
        ids += tok.observation_ids(history, observation, TOOLS, completion_ended=True)
        messages = [*history, *observation]
        # After every turn the running ids decode to exactly what the template renders.
        assert tok.decode(ids) == tok.render(messages, TOOLS, add_generation_prompt=True)


def test_sampled_ids_are_kept_verbatim_even_when_not_canonical(tok):
    messages = _system_and_task()
    completion_text = format_tool_call("bash", {"command": "grep -c ERROR /var/log/app.log"})
    canonical = tok.encode(completion_text)
    # A tokenization the tokenizer would never produce: every character on its own.
    sampled = [i for ch in completion_text for i in tok.encode(ch)]
    assert sampled != canonical and tok.decode(sampled) == completion_text  # precondition
    sampled.append(tok.end_of_turn_id)

    prompt = tok.initial_prompt_ids(messages, TOOLS)
    history = [*messages, {"role": "assistant", "content": completion_text}]
    observation = [{"role": "tool", "content": "17\n[exit code: 0]"}]
    after = tok.observation_ids(history, observation, TOOLS, completion_ended=True)
    episode = prompt + sampled + after

    assert episode[len(prompt) : len(prompt) + len(sampled)] == sampled
    rendered = tok.render([*history, *observation], TOOLS, add_generation_prompt=True)
    assert tok.decode(episode) == rendered
    assert episode != tok.encode(rendered)  # a re-tokenization would have replaced the sampled ids


def test_completion_without_end_of_turn_gets_it_prepended(tok):
    messages = _system_and_task()
    completion_text = "I will first look at the log file and"  # cut off by max_tokens
    completion = tok.encode(completion_text)
    assert not tok.ends_turn(completion)
    prompt = tok.initial_prompt_ids(messages, TOOLS)
    history = [*messages, {"role": "assistant", "content": completion_text}]
    observation = [{"role": "user", "content": "Your reply had no tool call; call a tool."}]
    after = tok.observation_ids(history, observation, TOOLS, completion_ended=False)
    assert after[0] == tok.end_of_turn_id
    closed = tok.observation_ids(history, observation, TOOLS, completion_ended=True)
    assert after[1:] == closed
    assert tok.decode(prompt + completion + after) == tok.render(
        [*history, *observation], TOOLS, add_generation_prompt=True
    )


def test_observation_needs_an_assistant_turn_and_new_messages(tok):
    messages = _system_and_task()
    with pytest.raises(ChatTemplateError, match="assistant"):
        tok.observation_ids(messages, [{"role": "tool", "content": "x"}], TOOLS, completion_ended=True)
    history = [*messages, {"role": "assistant", "content": "hi"}]
    with pytest.raises(ChatTemplateError, match="new message"):
        tok.observation_ids(history, [], TOOLS, completion_ended=True)


def test_template_that_rewrites_history_is_refused(tiny_models, tmp_path):
    """A template whose rendering of earlier turns changes with later ones cannot be extended by appending."""
    model_dir = tmp_path / "rewriting"
    shutil.copytree(tiny_models.primary, model_dir, ignore=shutil.ignore_patterns("*.safetensors"))
    config_path = model_dir / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["chat_template"] = (
        "{{ '<|im_start|>system\\n' + (messages | length | string) + ' turns<|im_end|>\\n' }}"
        "{%- for m in messages %}{{ '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}{%- endfor %}"
        "{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{%- endif %}"
    )
    config_path.write_text(json.dumps(config))
    tok = ChatTokenizer(model_dir)
    history = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
    with pytest.raises(ChatTemplateError, match="differently"):
        tok.observation_ids(history, [{"role": "user", "content": "again"}], None, completion_ended=True)


def test_missing_tokenizer_names_the_path(tmp_path):
    missing = tmp_path / "no-such-model"
    with pytest.raises(ChatTemplateError, match="no-such-model"):
        ChatTokenizer(missing)


def test_load_chat_tokenizer_is_shared(tiny_models):
    assert load_chat_tokenizer(str(tiny_models.primary)) is load_chat_tokenizer(str(tiny_models.primary))
