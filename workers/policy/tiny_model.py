"""Build a tiny random-weight Qwen2-style model offline, for tests against a real vLLM server.

The tokenizer is a byte-level BPE trained with `tokenizers` on Python's own standard
library sources (always on disk, no download), so it is the same for every seed; the
seed only draws the weights. Two seeds give two checkpoints of one architecture and
one vocabulary: the second is what a weight-reload test loads.

The chat template is ChatML with Qwen/Hermes tool calls: tools are listed in the
system turn inside ``<tools></tools>``; an assistant tool call is rendered as
``<tool_call>\\n{"name": ..., "arguments": ...}\\n</tool_call>``; tool results go in a
user turn inside ``<tool_response></tool_response>``. ``<|im_start|>``, ``<|im_end|>``,
``<|endoftext|>`` are special tokens; ``<tool_call>``, ``</tool_call>``,
``<tool_response>``, ``</tool_response>`` are added tokens that are never split but,
as in Qwen2.5, not "special": decoding with ``skip_special_tokens`` keeps them, so a
server's tool-call parser still sees them in the sampled text.
"""

from __future__ import annotations

import json
import logging
import sysconfig
from pathlib import Path

import numpy as np

logger = logging.getLogger(__name__)

ENDOFTEXT = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
TOOL_CALL = "<tool_call>"
TOOL_CALL_END = "</tool_call>"
TOOL_RESPONSE = "<tool_response>"
TOOL_RESPONSE_END = "</tool_response>"
SPECIAL_TOKENS = (ENDOFTEXT, IM_START, IM_END)
TOOL_TOKENS = (TOOL_CALL, TOOL_CALL_END, TOOL_RESPONSE, TOOL_RESPONSE_END)
QWEN2_PRETOKENIZE_REGEX = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
)

CHAT_TEMPLATE = """\
{%- macro render_content(content) -%}
    {%- if content is string -%}{{- content -}}
    {%- elif content is none -%}
    {%- else -%}{%- for part in content -%}{%- if part.type == 'text' -%}{{- part.text -}}{%- endif -%}{%- endfor -%}
    {%- endif -%}
{%- endmacro -%}
{%- if tools %}
    {{- '<|im_start|>system\\n' }}
    {%- if messages[0].role == 'system' %}
        {{- render_content(messages[0].content) }}
    {%- else %}
        {{- 'You are a helpful assistant.' }}
    {%- endif %}
    {{- "\\n\\n# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\nYou are provided with function signatures within <tools></tools> XML tags:\\n<tools>" }}
    {%- for tool in tools %}
        {{- "\\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\"name\\": <function-name>, \\"arguments\\": <args-json-object>}\\n</tool_call><|im_end|>\\n" }}
{%- elif messages[0].role == 'system' %}
    {{- '<|im_start|>system\\n' + render_content(messages[0].content) + '<|im_end|>\\n' }}
{%- else %}
    {{- '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}
{%- endif %}
{%- for message in messages %}
    {%- if message.role == 'user' or (message.role == 'system' and not loop.first) or (message.role == 'assistant' and not message.tool_calls) %}
        {{- '<|im_start|>' + message.role + '\\n' + render_content(message.content) + '<|im_end|>\\n' }}
    {%- elif message.role == 'assistant' %}
        {{- '<|im_start|>assistant' }}
        {%- if message.content %}
            {{- '\\n' + render_content(message.content) }}
        {%- endif %}
        {%- for tool_call in message.tool_calls %}
            {%- if tool_call.function is defined %}
                {%- set tool_call = tool_call.function %}
            {%- endif %}
            {{- '\\n<tool_call>\\n{"name": "' + tool_call.name + '", "arguments": ' }}
            {%- if tool_call.arguments is string %}
                {{- tool_call.arguments }}
            {%- else %}
                {{- tool_call.arguments | tojson }}
            {%- endif %}
            {{- '}\\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\\n' }}
    {%- elif message.role == 'tool' %}
        {%- if loop.index0 == 0 or messages[loop.index0 - 1].role != 'tool' %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\\n<tool_response>\\n' + render_content(message.content) + '\\n</tool_response>' }}
        {%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}
            {{- '<|im_end|>\\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
{%- endif %}
"""

# Text that teaches the merges the chat format needs, on top of the stdlib sources.
_CHAT_SAMPLES = (
    '<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n'
    '<|im_start|>user\nList the files in the current directory.<|im_end|>\n'
    '<|im_start|>assistant\n<tool_call>\n{"name": "bash", "arguments": {"command": "ls -la"}}\n'
    '</tool_call><|im_end|>\n<|im_start|>user\n<tool_response>\ntotal 0\n</tool_response><|im_end|>\n'
)
# Standard library modules read for the tokenizer corpus: stable names, mixed prose and code.
_CORPUS_MODULES = (
    "argparse.py", "ast.py", "base64.py", "calendar.py", "csv.py", "dataclasses.py",
    "difflib.py", "enum.py", "fractions.py", "functools.py", "heapq.py", "inspect.py",
    "json/__init__.py", "json/decoder.py", "json/encoder.py", "logging/__init__.py",
    "pathlib.py", "pprint.py", "shlex.py", "shutil.py", "statistics.py", "string.py",
    "subprocess.py", "tempfile.py", "textwrap.py", "typing.py", "uuid.py", "zipfile.py",
)


def _corpus() -> list[str]:
    """Return the tokenizer training texts: chat samples plus stdlib sources present on disk."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    texts = [_CHAT_SAMPLES] * 50
    for name in _CORPUS_MODULES:
        path = stdlib / name
        if path.is_file():
            texts.append(path.read_text(encoding="utf-8", errors="replace"))
    if len(texts) == 50:
        logger.warning("no standard library sources under %s; tokenizer trained on chat samples only", stdlib)
    return texts


def _train_tokenizer(vocab_size: int):
    """Train the byte-level BPE tokenizer (specials first, then the tool tokens last)."""
    from tokenizers import (
        AddedToken,
        Regex,
        Tokenizer,
        decoders,
        models,
        normalizers,
        pre_tokenizers,
        trainers,
    )

    # Exactly the pipeline transformers' Qwen2Tokenizer rebuilds around a vocabulary,
    # so `tokenizers`, transformers 4 and 5 and vLLM all produce the same ids.
    tokenizer = Tokenizer(models.BPE())
    tokenizer.normalizer = normalizers.NFC()
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN2_PRETOKENIZE_REGEX), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size - len(TOOL_TOKENS),
        min_frequency=2,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(_corpus(), trainer=trainer)
    tokenizer.add_tokens([AddedToken(t, special=False, normalized=False) for t in TOOL_TOKENS])
    return tokenizer


def _random_weights(config: dict, seed: int) -> dict[str, np.ndarray]:
    """Draw the Qwen2ForCausalLM tensors (float32) for ``config`` from ``seed``."""
    rng = np.random.default_rng(seed)
    hidden = config["hidden_size"]
    inter = config["intermediate_size"]
    vocab = config["vocab_size"]
    head_dim = hidden // config["num_attention_heads"]
    q_dim = config["num_attention_heads"] * head_dim
    kv_dim = config["num_key_value_heads"] * head_dim

    def normal(*shape: int, std: float = 0.02) -> np.ndarray:
        return rng.normal(0.0, std, size=shape).astype(np.float32)

    # Large embedding/head scales make the next-token distribution peaked, so two
    # seeds sample visibly different tokens, even greedily.
    weights = {"model.embed_tokens.weight": normal(vocab, hidden, std=1.0)}
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        weights |= {
            p + "input_layernorm.weight": np.ones(hidden, np.float32),
            p + "post_attention_layernorm.weight": np.ones(hidden, np.float32),
            p + "self_attn.q_proj.weight": normal(q_dim, hidden, std=0.1),
            p + "self_attn.q_proj.bias": normal(q_dim),
            p + "self_attn.k_proj.weight": normal(kv_dim, hidden, std=0.1),
            p + "self_attn.k_proj.bias": normal(kv_dim),
            p + "self_attn.v_proj.weight": normal(kv_dim, hidden, std=0.1),
            p + "self_attn.v_proj.bias": normal(kv_dim),
            p + "self_attn.o_proj.weight": normal(hidden, q_dim, std=0.1),
            p + "mlp.gate_proj.weight": normal(inter, hidden, std=0.1),
            p + "mlp.up_proj.weight": normal(inter, hidden, std=0.1),
            p + "mlp.down_proj.weight": normal(hidden, inter, std=0.1),
        }
    weights["model.norm.weight"] = np.ones(hidden, np.float32)
    weights["lm_head.weight"] = normal(vocab, hidden, std=0.5)
    return weights


def build_tiny_model(
    out_dir: str | Path,
    *,
    seed: int = 0,
    vocab_size: int = 2048,
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 2,
    num_kv_heads: int = 1,
    intermediate_size: int = 128,
    max_position_embeddings: int = 4096,
) -> Path:
    """Write a tiny random Qwen2 model (config, safetensors, tokenizer, chat template) to ``out_dir``.

    Deterministic: the same arguments give byte-identical files. The tokenizer does
    not depend on ``seed``, so models built with different seeds share a vocabulary
    and one can be loaded over the other. Head size is ``hidden_size // num_heads``
    (32 by default; vLLM's CPU attention needs at least 32).
    """
    from safetensors.numpy import save_file

    if hidden_size % num_heads or num_heads % num_kv_heads:
        raise ValueError(f"hidden_size {hidden_size} must split into {num_heads} heads over {num_kv_heads} KV heads")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)

    tokenizer = _train_tokenizer(vocab_size)
    tokenizer.save(str(out / "tokenizer.json"))
    vocab = tokenizer.get_vocab_size(with_added_tokens=True)
    ids = {t: tokenizer.token_to_id(t) for t in SPECIAL_TOKENS + TOOL_TOKENS}

    config = {
        "architectures": ["Qwen2ForCausalLM"],
        "model_type": "qwen2",
        "vocab_size": vocab,
        "hidden_size": hidden_size,
        "intermediate_size": intermediate_size,
        "num_hidden_layers": num_layers,
        "num_attention_heads": num_heads,
        "num_key_value_heads": num_kv_heads,
        "head_dim": hidden_size // num_heads,
        "hidden_act": "silu",
        "max_position_embeddings": max_position_embeddings,
        "max_window_layers": num_layers,
        "use_sliding_window": False,
        "sliding_window": None,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "attention_dropout": 0.0,
        "initializer_range": 0.02,
        "tie_word_embeddings": False,
        "use_cache": True,
        "torch_dtype": "float32",
        "bos_token_id": ids[ENDOFTEXT],
        "eos_token_id": ids[IM_END],
        "pad_token_id": ids[ENDOFTEXT],
    }
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    (out / "generation_config.json").write_text(
        json.dumps({"bos_token_id": ids[ENDOFTEXT], "eos_token_id": [ids[IM_END], ids[ENDOFTEXT]],
                    "pad_token_id": ids[ENDOFTEXT]}, indent=2) + "\n"
    )
    added = {
        str(ids[t]): {"content": t, "lstrip": False, "normalized": False, "rstrip": False,
                      "single_word": False, "special": t in SPECIAL_TOKENS}
        for t in SPECIAL_TOKENS + TOOL_TOKENS
    }
    tokenizer_config = {
        "tokenizer_class": "Qwen2Tokenizer",
        "added_tokens_decoder": added,
        "additional_special_tokens": [IM_START, IM_END],
        "bos_token": None,
        "eos_token": IM_END,
        "pad_token": ENDOFTEXT,
        "unk_token": None,
        "clean_up_tokenization_spaces": False,
        "model_max_length": max_position_embeddings,
        "split_special_tokens": False,
        "chat_template": CHAT_TEMPLATE,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2) + "\n")
    (out / "special_tokens_map.json").write_text(
        json.dumps({"eos_token": IM_END, "pad_token": ENDOFTEXT,
                    "additional_special_tokens": [IM_START, IM_END]}, indent=2) + "\n"
    )
    save_file(_random_weights(config, seed), str(out / "model.safetensors"), metadata={"format": "pt"})
    logger.info("tiny model (seed %d, vocab %d) written to %s", seed, vocab, out)
    return out
