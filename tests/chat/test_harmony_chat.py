"""gpt-oss chat through the worker's HTTP API in the harmony format.

A fake engine that says it is gpt-oss (model_type) and writes a scripted harmony text shows
the whole path: the prompt is openai-harmony's rendering, the answer comes back as
reasoning_content / tool_calls / content, streamed and not, with the openai SDK; bad
requests are 400 envelopes. A tiny random gpt-oss checkpoint (SmolLM2's tokenizer given
harmony's control tokens) shows the same on the real engine, where the prompt the model
gets is the harmony rendering tokenized by its own tokenizer.
"""

from __future__ import annotations

import json
import shutil
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from openai_harmony import (
    Conversation,
    DeveloperContent,
    Message,
    ReasoningEffort,
    Role,
    SystemContent,
    ToolDescription,
)
from tokenizers import Tokenizer
from transformers import GptOssConfig, GptOssForCausalLM

from services.worker.chat_format import load_chat_format
from services.worker.config import WorkerConfig
from services.worker.openai_protocol import SamplingFields
from services.worker.parsers_config import ParsersConfig
from shared.config import EngineConfig
from shared.parsing.harmony_encoding import encoding
from tests.chat.conftest import FakeServer
from tests.support.harmony import add_harmony_specials
from tests.support.worker import MODEL, WorkerThread

PARAMS = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
TOOLS: list[Any] = [{"type": "function", "function": {"name": "get_weather", "parameters": PARAMS}}]
MSGS: list[Any] = [{"role": "system", "content": "Be brief."},
                   {"role": "user", "content": "Weather in Paris?"}]
REASONING = "Need the weather."
SCRIPT = (f"<|channel|>analysis<|message|>{REASONING}<|end|><|start|>assistant<|channel|>"
          'commentary to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris"}'
          "<|call|>")


def reference_prompt(effort: ReasoningEffort, tools: bool) -> str:
    """openai-harmony's rendering of MSGS, the conversation written with its own API."""
    developer = DeveloperContent.new().with_instructions("Be brief.")
    if tools:
        developer = developer.with_function_tools([ToolDescription.new("get_weather", "",
                                                                       parameters=PARAMS)])
    system = SystemContent.new().with_reasoning_effort(effort)
    if not tools:
        system = system.with_required_channels(["analysis", "final"])
    conversation = Conversation.from_messages([
        Message.from_role_and_content(Role.SYSTEM, system),
        Message.from_role_and_content(Role.DEVELOPER, developer),
        Message.from_role_and_content(Role.USER, "Weather in Paris?")])
    enc = encoding()
    return enc.decode_utf8(enc.render_conversation_for_completion(conversation, Role.ASSISTANT))


def extra(obj: Any, key: str) -> Any:
    return (obj.model_extra or {}).get(key)


def post(url: str, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    req = urllib.request.Request(url, json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


@pytest.fixture(scope="module")
def gpt_oss_fake(harmony_vocab_dir: Path) -> Iterator[FakeServer]:
    server = FakeServer(ParsersConfig(harmony_vocab=harmony_vocab_dir))
    server.engine.model_config.model_type = "gpt_oss"  # type: ignore[attr-defined]
    server.worker.start(ready_timeout=60)
    yield server
    server.worker.stop()


def test_prompt_is_the_harmony_rendering(gpt_oss_fake: FakeServer) -> None:
    status, body = post(f"{gpt_oss_fake.worker.url}/tokenize", {"model": MODEL, "messages": MSGS})
    assert status == 200, body
    # The fake tokenizer's ids are the text's UTF-8 bytes.
    assert bytes(body["tokens"]).decode() == reference_prompt(ReasoningEffort.MEDIUM, False)


@pytest.mark.parametrize("stream", [False, True])
def test_reasoning_and_tool_calls_come_back(gpt_oss_fake: FakeServer, stream: bool) -> None:
    gpt_oss_fake.say(SCRIPT)
    client = gpt_oss_fake.client()
    kwargs: dict[str, Any] = {"model": MODEL, "messages": MSGS, "tools": TOOLS,
                              "extra_body": {"reasoning_effort": "high"}}
    if not stream:
        reply = client.chat.completions.create(**kwargs)
        message, finish = reply.choices[0].message, reply.choices[0].finish_reason
        reasoning = extra(message, "reasoning_content")
        assert reply.usage is not None
        assert reply.usage.prompt_tokens == len(reference_prompt(ReasoningEffort.HIGH,
                                                                 True).encode())
    else:
        with client.chat.completions.stream(**kwargs) as events:
            chunks = [e.chunk for e in events if e.type == "chunk"]
            final = events.get_final_completion()
        message, finish = final.choices[0].message, final.choices[0].finish_reason
        deltas = [c.choices[0].delta for c in chunks if c.choices]
        reasoning = "".join(extra(d, "reasoning_content") or "" for d in deltas)
    assert reasoning == REASONING
    assert [(c.function.name, json.loads(c.function.arguments))
            for c in message.tool_calls or []] == [("get_weather", {"city": "Paris"})]
    assert not message.content and finish == "tool_calls"


def test_unframed_output_is_content(gpt_oss_fake: FakeServer) -> None:
    gpt_oss_fake.say("no harmony here")
    reply = gpt_oss_fake.client().chat.completions.create(model=MODEL, messages=MSGS)
    assert reply.choices[0].message.content == "no harmony here"


@pytest.mark.parametrize("change, param", [
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice"),
    ({"reasoning_effort": "extreme"}, "reasoning_effort"),
])
def test_bad_requests_are_400_envelopes(gpt_oss_fake: FakeServer, change: dict[str, Any],
                                        param: str) -> None:
    status, body = post(f"{gpt_oss_fake.worker.url}/v1/chat/completions",
                        {"model": MODEL, "messages": MSGS, **change})
    assert status == 400 and body["error"]["param"] == param, body
    assert body["error"]["type"] == "invalid_request_error" and body["error"]["message"]


def test_metadata_names_the_harmony_parsers(gpt_oss_fake: FakeServer) -> None:
    with urllib.request.urlopen(f"{gpt_oss_fake.worker.url}/v1/metadata", timeout=10) as resp:
        parsers = json.loads(resp.read())["parsers"]
    assert parsers == {"tool_call_parser": "openai", "reasoning_parser": "openai_gptoss",
                       "enable_auto_tool_choice": True}


@pytest.fixture(scope="module")
def tiny_gpt_oss(tmp_path_factory: pytest.TempPathFactory, tokenizer_dir: Path) -> Path:
    out = tmp_path_factory.mktemp("gpt-oss-harmony")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tokenizer_dir / name, out / name)
    specials = add_harmony_specials(out / "tokenizer.json")
    torch.manual_seed(0)
    cfg = GptOssConfig(vocab_size=max(specials) + 1, hidden_size=32, intermediate_size=16,
                       num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                       head_dim=16, num_local_experts=2, num_experts_per_tok=1,
                       sliding_window=16, max_position_embeddings=1024,
                       bos_token_id=1, eos_token_id=2, pad_token_id=0,
                       tie_word_embeddings=False)
    GptOssForCausalLM(cfg).save_pretrained(out)
    return out


def test_tiny_gpt_oss_checkpoint_speaks_harmony(tiny_gpt_oss: Path,
                                                harmony_vocab_dir: Path) -> None:
    engine = EngineConfig(model=str(tiny_gpt_oss), dtype="float32", max_model_len=1024,
                          kv_cache_memory_bytes=8 * 1024 * 1024)
    config = WorkerConfig(engine=engine, served_model_names=("tiny",),
                          parsers=ParsersConfig(harmony_vocab=harmony_vocab_dir))
    server = WorkerThread(config).start(ready_timeout=120)
    try:
        body = {"model": "tiny", "messages": MSGS, "tools": TOOLS, "max_tokens": 6,
                "reasoning_effort": "low", "temperature": 0}
        status, reply = post(f"{server.url}/v1/chat/completions", body)
        assert status == 200, reply
        text = reference_prompt(ReasoningEffort.LOW, True)
        want = Tokenizer.from_file(str(tiny_gpt_oss / "tokenizer.json")).encode(
            text, add_special_tokens=False).ids
        assert reply["usage"]["prompt_tokens"] == len(want)
        status, tokenized = post(f"{server.url}/tokenize", {"model": "tiny", "messages": MSGS})
        assert status == 200 and tokenized["tokens"][-2:] == want[-2:]  # ...<|start|>assistant
        status, bad = post(f"{server.url}/v1/chat/completions",
                           {**body, "tool_choice": {"type": "function",
                                                    "function": {"name": "nope"}}})
        assert status == 400 and bad["error"]["param"] == "tool_choice"
    finally:
        server.stop()


class _ModelTokenizer:
    """The checkpoint's tokenizer.json read by `tokenizers` directly, as TokenizerLike."""

    def __init__(self, path: Path) -> None:
        self.tok = Tokenizer.from_file(str(path))

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.tok.encode(text, add_special_tokens=add_special_tokens).ids


def test_a_harmony_turn_ends_at_return_and_call(tiny_gpt_oss: Path,
                                                harmony_vocab_dir: Path) -> None:
    tok = _ModelTokenizer(tiny_gpt_oss / "tokenizer.json")
    fmt = load_chat_format(ParsersConfig(harmony_vocab=harmony_vocab_dir),
                           SimpleNamespace(model_type="gpt_oss"), tiny_gpt_oss,
                           tiny_gpt_oss / "cache", tok)
    want = (tok.tok.token_to_id("<|return|>"), tok.tok.token_to_id("<|call|>"))
    assert fmt.stop_token_ids == want and fmt.harmony is not None
    assert fmt.sampling(SamplingFields(stop_token_ids=(7,))).stop_token_ids == (7, *want)
    plain = load_chat_format(ParsersConfig(), SimpleNamespace(model_type="llama"), tiny_gpt_oss,
                             tiny_gpt_oss / "cache", tok)
    assert plain.harmony is None and plain.parsers == ParsersConfig()
    assert plain.sampling(SamplingFields()) == SamplingFields()
