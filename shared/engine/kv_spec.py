"""The KV spec of a loaded model: what its KV bytes mean, for the compat hash.

shared/protocol/compat.py holds the spec as plain values (the protocol layer imports neither
torch nor the model); this module reads those values off the configurations an engine is built
from, so the choice of what matters lives in one place rather than at call sites.
"""

from __future__ import annotations

import dataclasses

from shared.config import EngineConfig
from shared.model.config import ModelConfig
from shared.protocol.compat import ModelKVSpec, WeightTransforms


def weight_transforms(config: EngineConfig) -> WeightTransforms:
    """What an engine built from `config` does to its weights.

    Resolved as the engine resolves it (shared/engine/engine.py `_quant_config`): without
    --quantize-lm-head the head follows the default of on-the-fly quantisation. A
    pre-quantised checkpoint is covered by its fingerprint (its files differ).
    """
    # imports the kernels; only needed here
    from shared.model.quant import DEFAULT_ENCODER, QuantConfig

    quant = QuantConfig.parse(config.quantization, config.quant_encoder or DEFAULT_ENCODER,
                              config.quant_activations)
    if quant is None:
        return WeightTransforms()
    head = quant.method if (config.quantize_lm_head or quant.lm_head) else "dense"
    return WeightTransforms(quantization=str(quant.method), lm_head=str(head),
                            encoder=str(quant.encoder), activations=str(quant.activations))


def kv_spec_of(model_id: str, weights_fingerprint: str, engine: EngineConfig,
               config: ModelConfig) -> ModelKVSpec:
    """The spec of a loaded model: ModelConfig carries geometry, RoPE and the attention
    windows, the engine's configuration the dtypes and the weight transforms.

    Every family's sliding windows are `config.layer_windows`, hashed once as the
    `attention_windows` factor. A family's other constants that change the KV bytes (Gemma:
    soft-caps, the sliding layers' RoPE, the score scale; gpt-oss: the clamped SwiGLU) ride
    in the `rope` factor as `gemma.*` / `gpt_oss.*` keys: the weights fingerprint does not
    cover config.json, so they must be hashed here.
    """
    # engine.speculative_config is deliberately not a factor: speculation runs on the decode
    # side after the KV has moved and changes neither the target model nor its weights, so the
    # prompt KV a prefill sends is the same with it on or off (a decode keeps its own drafts'
    # KV and rolls rejected ones back locally; a draft model is prefilled on the decode worker
    # from the prompt tokens, its KV never travels). Sending the draft's KV too would make
    # the draft a factor; tests/kv_transfer/test_kv_compat.py classifies every field.
    rope = dataclasses.asdict(config.rope)
    for family in (config.gemma, config.gpt_oss):
        if family is not None:
            rope.update(family.as_factors())
    return ModelKVSpec(model_id=model_id, weights_fingerprint=weights_fingerprint,
                       dtype=engine.dtype, kv_dtype=engine.resolved_kv_dtype,
                       num_layers=config.num_layers, num_kv_heads=config.num_kv_heads,
                       head_dim=config.head_dim, rope=ModelKVSpec.rope_items(rope),
                       transforms=weight_transforms(engine),
                       attention_windows=ModelKVSpec.windows_factor(config.layer_windows))
