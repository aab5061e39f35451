"""Calibration token sequences for GPTQ (`pdmesh quantize --method gptq`).

Two sources, each a list of separate sequences (every one starts at position 0):

- a text file (`--calibration FILE`): tokenised and cut into CHUNK_TOKENS-token pieces, at
  most max_tokens in all;
- by default, text the dense model writes itself: GENERIC_PROMPTS through its chat template,
  sampled with fixed seeds, each prompt + reply one sequence. This needs no data set, is
  not any evaluation text, and follows what the model is served for (chat). The prompts are
  deliberately broad (how-to, explanation, story, code, advice) and not tuned to any
  benchmark text.
"""

from __future__ import annotations

from pathlib import Path

from shared.engine.llm import LLM
from shared.engine.sampling_params import SamplingParams
from shared.model.tokenizer import Tokenizer

CHUNK_TOKENS = 512  # tokens per sequence cut from a calibration file
DEFAULT_MAX_TOKENS = 2048  # calibration tokens used from a file
GENERATED_TOKENS = 256  # new tokens per reply at most (16 prompts: ~4k tokens in all)
GENERIC_PROMPTS = (
    "Explain how a refrigerator keeps food cold.",
    "Write a short story about two friends who get lost on a hike.",
    "What are some good habits for staying healthy while working at a desk?",
    "Write a Python function that checks whether a string is a palindrome, and explain it.",
    "Summarise the main causes of the First World War.",
    "How do I prepare for a job interview?",
    "Describe the water cycle to a ten-year-old.",
    "Give me a recipe for a simple vegetable soup.",
    "What is the difference between a virus and a bacterium?",
    "Write a polite email asking a landlord to repair a broken heater.",
    "Explain what a database index is and when to use one.",
    "Tell me about the history of the bicycle.",
    "How does compound interest work? Give an example with numbers.",
    "Write a poem about the sea at night.",
    "What should I pack for a week-long camping trip?",
    "Explain the rules of chess to a beginner.",
)


def file_sequences(path: Path, tokenizer: Tokenizer,
                   max_tokens: int = DEFAULT_MAX_TOKENS) -> list[list[int]]:
    """The first max_tokens tokens of a UTF-8 text file, in CHUNK_TOKENS-token sequences.
    Raises ValueError for an unreadable or empty file (FileNotFoundError when missing)."""
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
    try:
        text = Path(path).read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise ValueError(f"calibration file {path} is not UTF-8 text: {exc}") from None
    ids = tokenizer.encode(text, add_special_tokens=False)[:max_tokens]
    if not text.strip() or not ids:
        raise ValueError(f"calibration file {path} is empty")
    return [ids[i:i + CHUNK_TOKENS] for i in range(0, len(ids), CHUNK_TOKENS)]


def generated_sequences(model_dir: Path, seed: int = 0, tokens: int = GENERATED_TOKENS,
                        prompts: tuple[str, ...] = GENERIC_PROMPTS, dtype: str = "bfloat16",
                        kv_cache_bytes: int = 64 << 20) -> list[list[int]]:
    """[chat-templated prompt + the dense model's sampled reply] per prompt: prompt i is
    sampled with seed + i (temperature 0.8, top_p 0.95), so the text is reproducible. bf16 by
    default, the dtype the model is served in."""
    llm = LLM(model=str(model_dir), dtype=dtype, seed=seed, kv_cache_memory_bytes=kv_cache_bytes)
    params = [SamplingParams(temperature=0.8, top_p=0.95, max_tokens=tokens, seed=seed + i)
              for i in range(len(prompts))]
    outputs = llm.chat([[{"role": "user", "content": p}] for p in prompts], params)
    return [out.prompt_token_ids + out.outputs[0].token_ids for out in outputs]
