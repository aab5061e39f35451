"""A model's own sampling defaults, from its `generation_config.json`, as vLLM applies them.

vLLM's `--generation-config auto` (its default) reads the checkpoint's generation config and
makes a few of its keys the defaults of every request that does not set them: temperature,
top_p, top_k, min_p, repetition_penalty, and max_new_tokens as max_tokens. A request's own
value always wins; `--generation-config vllm` ignores the file (the OpenAI defaults then hold:
temperature 1, no truncation). Stop ids are separate: the loader adds the file's eos_token_id to
the model's EOS set in both modes (shared.model.loader.Checkpoint.eos_token_ids).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from enum import StrEnum
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

# generation_config.json key -> request field (vLLM's `get_diff_sampling_param`).
_KEYS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
         "repetition_penalty": "repetition_penalty", "max_new_tokens": "max_tokens"}


class GenerationConfigMode(StrEnum):
    """Where request defaults come from: the model's generation_config.json, or vLLM's."""

    AUTO = "auto"
    VLLM = "vllm"


def sampling_defaults(generation_config: Mapping[str, Any]) -> dict[str, Any]:
    """The request fields a generation config sets (None values and other keys dropped)."""
    return {field: generation_config[key] for key, field in _KEYS.items()
            if generation_config.get(key) is not None}


def model_defaults(mode: GenerationConfigMode, model_dir: Path | None) -> dict[str, Any]:
    """The defaults a worker applies to each request; logged once, as vLLM does, so an
    operator sees why an unset temperature is not 1."""
    if mode is GenerationConfigMode.VLLM or model_dir is None:
        return {}
    # Imported here, not at the top: services.worker.config imports this module, and every
    # `pdmesh` command builds serve's parser from that config, so a top-level import would
    # load torch (through the loader) into the router and `up`'s supervisor (~190 MB each).
    from shared.model.loader import read_generation_config

    defaults = sampling_defaults(read_generation_config(model_dir))
    if defaults:
        log.warning("default sampling parameters come from the model's generation_config.json: "
                    "%s (--generation-config vllm ignores them)", defaults)
    return defaults


def with_defaults(body: dict[str, Any], defaults: Mapping[str, Any]) -> dict[str, Any]:
    """`body` with the model defaults of every field it leaves unset (present keys, even with
    null, are the client's). A chat request's max_completion_tokens counts as max_tokens."""
    if not defaults:
        return body
    missing = {k: v for k, v in defaults.items() if k not in body}
    if "max_completion_tokens" in body:
        missing.pop("max_tokens", None)
    return {**missing, **body} if missing else body
