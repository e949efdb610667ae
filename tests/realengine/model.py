"""Build a tiny Qwen3-architecture checkpoint whose output is fixed by hand-set weights.

Run with the engine's Python (it needs torch, transformers, tokenizers and safetensors, which a
vLLM install brings)::

    $ENGINE_PYTHON tests/realengine/model.py OUT_DIR

Nothing is downloaded. Random weights never emit ``</think>``, a tool call or end-of-sequence, so
this model is a deterministic "next token = successor of the current token" machine instead:

- the prompt ends with ``<think>\\n`` (thinking on): ``Okay, let me think.`` ``</think>``
  ``\\n\\n`` ``Hello from the tiny model!`` ``<|im_end|>``;
- the prompt ends with ``</think>\\n\\n`` (thinking off, or a raw completion prompt ending in a
  blank line): ``Hello from the tiny model!`` ``<|im_end|>``;
- a ``<tools>`` token anywhere in the prompt (the chat template writes one when the request has
  tools) turns ``\\n\\n`` into a ``qwen3_coder`` call,
  ``<tool_call>\\n<function=get_weather>\\n<parameter=city>\\nParis\\n</parameter>\\n</function>\\n</tool_call>``,
  unless a ``</tool_response>`` follows it (a tool result came back): then the model answers.

How: chain tokens get orthogonal one-hot embeddings, ``lm_head`` maps each to its successor with
a large logit, so sampling at temperature <= 1 still picks it. Layer 0 has two attention heads
that look for a marker token anywhere before (RoPE is inert on the dimension they use, because
its frequency is ``rope_theta ** (-30/32)``, about 4e-10 rad per position): head 0 adds a
"tools" direction for ``<tools>``, head 2 subtracts it for ``</tool_response>``. Every other
weight (MLPs, layer 1) is zero. Architecture as in the Qwen3 model card and transformers'
``Qwen3Config``: RMSNorm, q/k norms, grouped-query attention, SwiGLU MLP.
"""

from __future__ import annotations

import itertools
import json
import sys
import sysconfig
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors.torch import save_file
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
# Kept in decoded text, as in Qwen3's tokenizer: the reasoning and tool parsers look for them.
MARKUP_TOKENS = (
    "<think>",
    "</think>",
    "<tool_call>",
    "</tool_call>",
    "<tools>",
    "</tools>",
    "<tool_response>",
    "</tool_response>",
    "\n<function=get_weather>\n",
    "<parameter=city>\n",
    "\n</parameter>\n",
    "</function>\n",
)
REASONING = ("Okay", ",", " let", " me", " think", ".")
# RoPE positions the checkpoint declares: vLLM computes its rotary table this far, so a prompt
# reaches the marker heads intact up to here (Claude Code's first request is ~30,000 tokens).
MAX_POSITIONS = 65536
ANSWER = ("Hello", " from", " the", " tiny", " model", "!")
TOOL_CALL = (
    "<tool_call>",
    "\n<function=get_weather>\n",
    "<parameter=city>\n",
    "Paris",
    "\n</parameter>\n",
    "</function>\n",
    "</tool_call>",
)
EOS = "<|im_end|>"

# Shape: small enough to load in a second, a real Qwen3ForCausalLM all the same.
HIDDEN, LAYERS, HEADS, KV_HEADS, HEAD_DIM, FFN = 64, 2, 4, 2, 32, 128
IDENTITY_DIMS = 48  # dims 0..47 say which token this is
DIM_ONE, DIM_TOOLS, DIM_RESPONSE, DIM_MODE = 48, 49, 50, 51
ROPE_THETA = 1e10
INERT_DIM = HEAD_DIM // 2 - 1  # rotary pair (15, 31): the slowest frequency
SUCCESSOR_LOGIT = 10.0

CHAT_TEMPLATE = r"""{%- set ns = namespace(system='') -%}
{%- if messages and messages[0].role == 'system' -%}{%- set ns.system = messages[0].content -%}{%- endif -%}
{%- if tools -%}
<|im_start|>system
{% if ns.system %}{{ ns.system }}

{% endif %}# Tools

You may call one or more functions to assist with the user query.

You are provided with function signatures within <tools></tools> XML tags:
<tools>{% for tool in tools %}
{{ tool | tojson }}{% endfor %}
</tools>

If you choose to call a function ONLY reply in the following format with NO suffix:

<tool_call>
<function=example_function_name>
<parameter=example_parameter_1>
value_1
</parameter>
</function>
</tool_call><|im_end|>
{% elif ns.system -%}
<|im_start|>system
{{ ns.system }}<|im_end|>
{% endif -%}
{%- for message in messages -%}
{%- set text = message.content if message.content is string else '' -%}
{%- if message.role == 'user' or (message.role == 'system' and not loop.first) -%}
<|im_start|>{{ message.role }}
{{ text }}<|im_end|>
{% elif message.role == 'assistant' -%}
<|im_start|>assistant
{{ text }}
{%- for call in message.tool_calls or [] -%}
{%- set fn = call.function if call.function is defined else call %}
<tool_call>
<function={{ fn.name }}>
{% if fn.arguments is mapping -%}
{%- for name, value in fn.arguments.items() -%}
<parameter={{ name }}>
{{ value if value is string else value | tojson }}
</parameter>
{% endfor -%}
{%- endif -%}
</function>
</tool_call>
{%- endfor -%}
<|im_end|>
{% elif message.role == 'tool' -%}
<|im_start|>user
<tool_response>
{{ text }}
</tool_response><|im_end|>
{% endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}
<|im_start|>assistant
{% if enable_thinking is defined and enable_thinking is false -%}
<think>

</think>

{% else -%}
<think>
{% endif -%}
{%- endif -%}"""


def training_text() -> Iterator[str]:
    """Text the BPE learns from: the chain's words many times, then the standard library."""
    yield (
        "Okay, let me think.\nHello from the tiny model!\nParis\nThe weather in Paris.\n\n"
    ) * 4000
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    for path in sorted(stdlib.glob("*.py"))[:120]:
        yield path.read_text(encoding="utf-8", errors="replace")[:40_000]


def build_tokenizer(out: Path) -> PreTrainedTokenizerFast:
    """Train a byte-level BPE, add Qwen's tokens, save it with the chat template; return it."""
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=3000,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    bpe.train_from_iterator(training_text(), trainer=trainer)
    bpe.add_tokens([AddedToken(t, special=False, normalized=False) for t in MARKUP_TOKENS])
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=bpe,
        eos_token=EOS,
        pad_token="<|endoftext|>",
        model_max_length=8192,
        clean_up_tokenization_spaces=False,
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(str(out))
    config_path = out / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["tokenizer_class"] = "PreTrainedTokenizerFast"  # a class every transformers knows
    config["chat_template"] = CHAT_TEMPLATE
    config_path.write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n")
    return tokenizer


def token_id(tokenizer: PreTrainedTokenizerFast, text: str) -> int:
    """The id of ``text``, which must be exactly one token (SystemExit otherwise)."""
    ids = tokenizer.encode(text, add_special_tokens=False)
    if len(ids) != 1:
        raise SystemExit(f"{text!r} is {len(ids)} tokens {ids}; the chain needs one")
    return int(ids[0])


def successors(tokenizer: PreTrainedTokenizerFast) -> tuple[list[int], dict[int, int]]:
    """(chain token ids, {token: next token}) of the three paths in the module docstring."""
    one = lambda text: token_id(tokenizer, text)  # noqa: E731
    think = [one("\n"), *map(one, REASONING), one("</think>"), one("\n\n")]
    answer = [one("\n\n"), *map(one, ANSWER), one(EOS)]
    call = [*map(one, TOOL_CALL), one(EOS)]
    following: dict[int, int] = {}
    for path in (think, answer, call):
        following.update(itertools.pairwise(path))
    chain = list(dict.fromkeys(think + answer + call))
    if len(chain) > IDENTITY_DIMS:
        raise SystemExit(f"{len(chain)} chain tokens do not fit {IDENTITY_DIMS} identity dims")
    return chain, following


def build_weights(tokenizer: PreTrainedTokenizerFast) -> tuple[dict[str, torch.Tensor], int]:
    """The state dict (float32) and the padded vocabulary size."""
    vocab = -(-len(tokenizer) // 64) * 64
    chain, following = successors(tokenizer)
    slot = {token: index for index, token in enumerate(chain)}

    generator = torch.Generator().manual_seed(1234)
    embed = torch.randn(vocab, IDENTITY_DIMS, generator=generator)
    embed = torch.nn.functional.normalize(embed, dim=1)
    embed = torch.cat([embed, torch.zeros(vocab, HIDDEN - IDENTITY_DIMS)], dim=1)
    for token, index in slot.items():
        embed[token, :IDENTITY_DIMS] = 0.0
        embed[token, index] = 1.0
    embed[:, DIM_ONE] = 1.0
    embed[token_id(tokenizer, "<tools>"), DIM_TOOLS] = 1.0
    embed[token_id(tokenizer, "</tool_response>"), DIM_RESPONSE] = 1.0

    state: dict[str, torch.Tensor] = {
        "model.embed_tokens.weight": embed,
        "model.norm.weight": torch.ones(HIDDEN),
    }
    for layer in range(LAYERS):
        q = torch.zeros(HEADS * HEAD_DIM, HIDDEN)
        k = torch.zeros(KV_HEADS * HEAD_DIM, HIDDEN)
        v = torch.zeros(KV_HEADS * HEAD_DIM, HIDDEN)
        o = torch.zeros(HIDDEN, HEADS * HEAD_DIM)
        k_norm = torch.ones(HEAD_DIM)
        if layer == 0:
            # Query heads 0 and 2 (key/value heads 0 and 1) ask "is there a marker before?".
            # After the q/k RMSNorms and the 1/sqrt(HEAD_DIM) scaling the score is 8 * sqrt(32),
            # about 45, on a marker token and exactly 0 elsewhere (a zero key stays zero through
            # RMSNorm), so a marker anywhere in thousands of tokens takes all the weight.
            k_norm[INERT_DIM] = 8.0
            markers = ((0, 0, DIM_TOOLS, 0.3), (2, 1, DIM_RESPONSE, -0.45))
            for q_head, kv_head, marker, gain in markers:
                q[q_head * HEAD_DIM + INERT_DIM, DIM_ONE] = 1.0
                k[kv_head * HEAD_DIM + INERT_DIM, marker] = 1.0
                v[kv_head * HEAD_DIM, marker] = 1.0
                o[DIM_MODE, q_head * HEAD_DIM] = gain
        prefix = f"model.layers.{layer}."
        state.update(
            {
                prefix + "input_layernorm.weight": torch.ones(HIDDEN),
                prefix + "post_attention_layernorm.weight": torch.ones(HIDDEN),
                prefix + "self_attn.q_proj.weight": q,
                prefix + "self_attn.k_proj.weight": k,
                prefix + "self_attn.v_proj.weight": v,
                prefix + "self_attn.o_proj.weight": o,
                prefix + "self_attn.q_norm.weight": torch.ones(HEAD_DIM),
                prefix + "self_attn.k_norm.weight": k_norm,
                prefix + "mlp.gate_proj.weight": torch.zeros(FFN, HIDDEN),
                prefix + "mlp.up_proj.weight": torch.zeros(FFN, HIDDEN),
                prefix + "mlp.down_proj.weight": torch.zeros(HIDDEN, FFN),
            }
        )

    head = torch.zeros(vocab, HIDDEN)
    for current, nxt in following.items():
        head[nxt, slot[current]] = SUCCESSOR_LOGIT
    # "\n\n" is followed by "Hello" (10) or, in tool mode (DIM_MODE about +1.4), by <tool_call>
    # (10 + 8 * 1.4 - 5 = 16); without tool mode it scores 5, and elsewhere in tool mode 6, both
    # below a successor's 10; after a tool response the mode is negative and the answer wins.
    call = token_id(tokenizer, "<tool_call>")
    head[call, slot[token_id(tokenizer, "\n\n")]] = SUCCESSOR_LOGIT
    head[call, DIM_MODE] = 8.0
    head[call, DIM_ONE] = -5.0
    state["lm_head.weight"] = head
    return state, vocab


def model_config(tokenizer: PreTrainedTokenizerFast, vocab: int) -> dict[str, object]:
    """config.json of a ``Qwen3ForCausalLM`` (transformers' Qwen3Config field names)."""
    return {
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        "vocab_size": vocab,
        "hidden_size": HIDDEN,
        "intermediate_size": FFN,
        "num_hidden_layers": LAYERS,
        "num_attention_heads": HEADS,
        "num_key_value_heads": KV_HEADS,
        "head_dim": HEAD_DIM,
        "hidden_act": "silu",
        "max_position_embeddings": MAX_POSITIONS,
        "rms_norm_eps": 1e-6,
        "rope_theta": ROPE_THETA,
        "rope_scaling": None,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "tie_word_embeddings": False,
        "use_sliding_window": False,
        "sliding_window": None,
        "max_window_layers": LAYERS,
        "bos_token_id": token_id(tokenizer, "<|endoftext|>"),
        "eos_token_id": token_id(tokenizer, EOS),
        "torch_dtype": "bfloat16",
        "initializer_range": 0.02,
        "use_cache": True,
    }


def build(out: Path) -> None:
    """Write tokenizer, chat template, config.json and model.safetensors into ``out``."""
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer(out)
    state, vocab = build_weights(tokenizer)
    tensors = {name: t.to(torch.bfloat16).contiguous() for name, t in state.items()}
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    config = model_config(tokenizer, vocab)
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    generation = {"eos_token_id": [config["eos_token_id"], config["bos_token_id"]]}
    (out / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")


if __name__ == "__main__":
    if len(sys.argv) != 2:
        raise SystemExit("usage: model.py OUT_DIR")
    build(Path(sys.argv[1]))
