"""The worker on the real embedded SmolLM2-135M-Instruct: HTTP output equals offline output."""

from __future__ import annotations

import openai
import pytest

from services.worker.config import WorkerConfig
from shared.config import EngineConfig
from shared.engine import LLM
from shared.engine.sampling_params import SamplingParams
from tests.support.worker import WorkerThread

MODEL = "smollm2-135m-instruct"


@pytest.mark.slow
def test_smollm2_chat_and_completion_match_offline() -> None:
    engine = EngineConfig(model=MODEL, dtype="float32", max_model_len=1024,
                          kv_cache_memory_bytes=64 * 2**20)
    server = WorkerThread(WorkerConfig(engine=engine)).start(ready_timeout=300)
    try:
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
        messages = [{"role": "user", "content": "What is the capital of France?"}]
        chat = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=8, temperature=0)
        stream = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=8,
                                                temperature=0, stream=True)
        streamed = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
        comp = client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=6,
                                         temperature=0)
    finally:
        server.stop()
    llm = LLM(model=MODEL, dtype="float32", max_model_len=1024, kv_cache_memory_bytes=64 * 2**20)
    greedy8, greedy6 = SamplingParams(temperature=0.0, max_tokens=8), SamplingParams(temperature=0.0, max_tokens=6)
    ref_chat = llm.chat(messages, greedy8)[0].outputs[0].text
    ref_comp = llm.generate("The capital of France is", greedy6)[0].outputs[0].text
    assert chat.choices[0].message.content == ref_chat == streamed
    assert "Paris" in ref_chat
    assert comp.choices[0].text == ref_comp
