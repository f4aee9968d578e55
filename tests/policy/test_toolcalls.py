"""parse_tool_calls: the hermes and json formats, and error messages written for the model."""

from __future__ import annotations

import json

import pytest

from workers.policy.toolcalls import (
    ToolCallParseError,
    format_tool_call,
    parse_tool_calls,
)


def test_hermes_single_call_with_text_around():
    text = (
        "Let me look at the files first.\n"
        '<tool_call>\n{"name": "bash", "arguments": {"command": "ls -la /app"}}\n</tool_call>\n'
        "Then I will decide."
    )
    assert parse_tool_calls(text) == [{"name": "bash", "arguments": {"command": "ls -la /app"}}]


def test_hermes_several_calls_in_order():
    text = (
        '<tool_call>{"name": "bash", "arguments": {"command": "cd /app"}}</tool_call>'
        "and then\n"
        '<tool_call>\n{"name": "bash", "arguments": {"command": "make", "timeout": 30}}\n</tool_call>'
        '<tool_call>{"name": "submit", "arguments": {}}</tool_call>'
    )
    assert parse_tool_calls(text) == [
        {"name": "bash", "arguments": {"command": "cd /app"}},
        {"name": "bash", "arguments": {"command": "make", "timeout": 30}},
        {"name": "submit", "arguments": {}},
    ]


def test_hermes_arguments_as_a_json_string():
    arguments = {"command": 'echo "a b" | wc -w'}
    text = f'<tool_call>{json.dumps({"name": "bash", "arguments": json.dumps(arguments)})}</tool_call>'
    assert parse_tool_calls(text) == [{"name": "bash", "arguments": arguments}]


def test_hermes_missing_or_null_arguments_mean_no_arguments():
    text = '<tool_call>{"name": "submit"}</tool_call><tool_call>{"name": "submit", "arguments": null}</tool_call>'
    assert parse_tool_calls(text) == [{"name": "submit", "arguments": {}}, {"name": "submit", "arguments": {}}]


def test_hermes_plain_text_has_no_calls():
    assert parse_tool_calls("I think the task is done; the file is in place.") == []
    assert parse_tool_calls("") == []


def test_hermes_unclosed_final_call_with_complete_json_is_accepted():
    # Models often stop right after the JSON (the stop token cuts the closing tag).
    text = 'ok\n<tool_call>\n{"name": "bash", "arguments": {"command": "pwd"}}\n'
    assert parse_tool_calls(text) == [{"name": "bash", "arguments": {"command": "pwd"}}]


def test_hermes_code_fence_inside_the_block_is_tolerated():
    text = '<tool_call>\n```json\n{"name": "bash", "arguments": {"command": "id"}}\n```\n</tool_call>'
    assert parse_tool_calls(text) == [{"name": "bash", "arguments": {"command": "id"}}]


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ('<tool_call>{"name": "bash", "arguments": {"command": "ls"}</tool_call>', "not valid JSON"),
        ("<tool_call>  </tool_call>", "empty"),
        ('<tool_call>{"arguments": {"command": "ls"}}</tool_call>', '"name"'),
        ('<tool_call>{"name": "bash", "arguments": ["ls"]}</tool_call>', "not an object"),
        ('<tool_call>{"name": "bash", "arguments": "{not json"}</tool_call>', "not valid JSON"),
        ('<tool_call>["bash", "ls"]</tool_call>', "JSON object"),
        ('<tool_call>{"name": "bash", "command": "ls"}</tool_call>', "'command'"),
        ('<tool_call>{"name": "bash", "arguments": {"command": "ls"', "not closed"),
        ('<tool_call>{"name": "bash"} <tool_call>{"name": "submit"}</tool_call>', "not closed"),
        ('{"name": "bash", "arguments": {}}</tool_call>', "without a matching"),
        ('<tool_call>{"name": "submit"} and more</tool_call>', "text after its JSON"),
    ],
)
def test_hermes_malformed_calls_explain_the_expected_format(text, expected):
    with pytest.raises(ToolCallParseError) as info:
        parse_tool_calls(text)
    message = str(info.value)
    assert expected in message
    assert "<tool_call>" in message and '"arguments"' in message  # the model is shown the expected format


def test_hermes_closing_tag_inside_an_argument_is_not_the_end_of_the_call():
    arguments = {"command": "grep -c '</tool_call>' parser.py"}
    text = f'<tool_call>{json.dumps({"name": "bash", "arguments": arguments})}</tool_call> done'
    assert parse_tool_calls(text) == [{"name": "bash", "arguments": arguments}]


def test_hermes_error_names_which_call_is_wrong():
    text = '<tool_call>{"name": "bash", "arguments": {"command": "ls"}}</tool_call><tool_call>{oops}</tool_call>'
    with pytest.raises(ToolCallParseError, match="tool call 2"):
        parse_tool_calls(text)


def test_json_format_bare_object():
    text = '{"name": "bash", "arguments": {"command": "cat /etc/hostname"}}'
    assert parse_tool_calls(text, "json") == [{"name": "bash", "arguments": {"command": "cat /etc/hostname"}}]


def test_json_format_fenced_object_and_arguments_string():
    text = '```json\n{"name": "bash", "arguments": "{\\"command\\": \\"ls\\"}"}\n```'
    assert parse_tool_calls(text, "json") == [{"name": "bash", "arguments": {"command": "ls"}}]


def test_json_format_object_after_prose():
    text = 'I will list files.\n{"name": "bash", "arguments": {"command": "ls"}}'
    assert parse_tool_calls(text, "json") == [{"name": "bash", "arguments": {"command": "ls"}}]


def test_json_format_list_of_calls():
    text = '[{"name": "bash", "arguments": {"command": "ls"}}, {"name": "submit", "arguments": {}}]'
    assert parse_tool_calls(text, "json") == [
        {"name": "bash", "arguments": {"command": "ls"}},
        {"name": "submit", "arguments": {}},
    ]


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("", "empty"),
        ("I am done.", "no JSON object"),
        ('{"name": "bash", "arguments": {"command": ', "not valid JSON"),
        ('{"tool": "bash"}', '"name"'),
        ("[]", "empty JSON list"),
    ],
)
def test_json_format_malformed(text, expected):
    with pytest.raises(ToolCallParseError) as info:
        parse_tool_calls(text, "json")
    assert expected in str(info.value)
    assert '{"name": "<tool-name>", "arguments"' in str(info.value)


def test_unknown_format_is_a_programming_error():
    with pytest.raises(ValueError, match="xml"):
        parse_tool_calls("<tool_call>{}</tool_call>", "xml")


@pytest.mark.parametrize("fmt", ["hermes", "json"])
def test_format_tool_call_round_trips(fmt):
    arguments = {"command": "printf '%s\\n' \"ünïcode\" <<EOF\n</tool_call>?\nEOF", "timeout": 12.5}
    text = format_tool_call("bash", arguments, fmt)
    assert parse_tool_calls(text, fmt) == [{"name": "bash", "arguments": arguments}]
