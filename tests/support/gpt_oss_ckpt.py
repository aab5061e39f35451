"""Small random gpt-oss checkpoints written by HF transformers itself (the independent side of
every gpt-oss test): experts with biases, sinks, YaRN and alternating sliding windows.

Weights are redrawn so that activations stay O(1) (HF's 0.02 init leaves attention almost
uniform and the router almost tied, which would hide routing, sink or window bugs).
"""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import GptOssConfig, GptOssForCausalLM

from shared.model.make_model import copy_tokenizer

WINDOW = 8  # every test prompt is longer: the sliding layers really slide


def write_gpt_oss(path: Path, *, seed: int, vocab_size: int = 256,
                  tokenizer_dir: Path | None = None, max_position_embeddings: int = 512) -> Path:
    """Two layers (sliding, full), 4 experts top-2, head_dim 16; with tokenizer_dir, its
    tokenizer files are copied (vocab_size must then cover the tokenizer)."""
    torch.manual_seed(seed)
    cfg = GptOssConfig(
        vocab_size=vocab_size, hidden_size=64, intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_local_experts=4,
        num_experts_per_tok=2, sliding_window=WINDOW,
        max_position_embeddings=max_position_embeddings,
        rope_parameters={"rope_type": "yarn", "rope_theta": 150000.0, "factor": 8.0,
                         "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                         "original_max_position_embeddings": 64},
        bos_token_id=1, eos_token_id=2, pad_token_id=0, tie_word_embeddings=False)
    model = GptOssForCausalLM(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            elif "sinks" in name:
                p.normal_(0.0, 1.0)
            elif "router" in name:
                p.normal_(0.0, 0.5)
            else:
                p.normal_(0.0, 0.15)
    model.save_pretrained(path)
    if tokenizer_dir is not None:
        copy_tokenizer(Path(tokenizer_dir), Path(path))
    return Path(path)
