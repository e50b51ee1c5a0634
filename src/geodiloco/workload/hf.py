"""Hugging Face ``transformers`` causal language models through the builder route.

    [workload]
    model = "geodiloco.workload.hf:build_model"
    init_weights = "/models/my-llama"        # optional: θ_0 from its safetensors
    [workload.options]
    hf_model = "/models/my-llama"            # a save_pretrained directory, or a config name/path
    hf_config = { num_hidden_layers = 4 }    # optional overrides of that config

The architecture comes from the config of ``hf_model``; the weights are initialised from the
run's seed (the same on every machine), or loaded from ``workload.init_weights`` (a safetensors
directory such as ``hf_model`` itself, a DCP checkpoint, or a torch state dict). The model gives
``.logits``, which the default loss (``workload.loss``) scores against the batch's targets, so
the reference byte data trains it as it is (with ``vocab_size`` >= 256). Needs the ``hf``
extra: ``pip install 'geodiloco[hf]'``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from geodiloco.config import ConfigError

if TYPE_CHECKING:
    from transformers import LlamaForCausalLM

    from geodiloco.config import RunConfig


def _options(cfg: RunConfig) -> tuple[str, dict[str, Any]]:
    name = cfg.workload.options.get("hf_model")
    if not isinstance(name, str) or not name:
        raise ConfigError(
            "workload.options.hf_model: name a transformers config or a save_pretrained directory "
            f"for {cfg.workload.model}"
        )
    overrides = cfg.workload.options.get("hf_config", {})
    if not isinstance(overrides, dict):
        raise ConfigError(f"workload.options.hf_config: expected a table, got {overrides!r}")
    return name, overrides


def load_config(cfg: RunConfig) -> Any:
    """The ``transformers`` config ``workload.options`` names, with its overrides."""
    try:
        from transformers import AutoConfig
    except ImportError:
        raise ConfigError(
            f"workload.model: {cfg.workload.model} needs transformers: pip install 'geodiloco[hf]'"
        ) from None
    name, overrides = _options(cfg)
    try:
        config = AutoConfig.from_pretrained(name)
    except (OSError, ValueError) as exc:
        first = " ".join(str(exc).split())[:300]
        raise ConfigError(f"workload.options.hf_model: cannot read a config from {name!r}: {first}") from None
    for key, value in overrides.items():
        if not hasattr(config, key):
            raise ConfigError(f"workload.options.hf_config.{key}: not a field of {type(config).__name__}")
        setattr(config, key, value)
    return config


def build_model(cfg: RunConfig) -> nn.Module:
    """A causal LM of the configured architecture in fp32, initialised from ``cfg.seed``."""
    from transformers import AutoModelForCausalLM

    config = load_config(cfg)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(cfg.seed)
        try:
            model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        except ValueError as exc:  # not a causal LM architecture
            first = " ".join(str(exc).split())[:300]
            raise ConfigError(f"workload.options.hf_model: not a causal language model: {first}") from None
    model.train()
    return model


def tiny_llama(
    seed: int, hidden: int = 32, intermediate: int = 64, positions: int = 64, tie: bool = False
) -> LlamaForCausalLM:
    """A small random byte-vocabulary Llama (2 layers, 4 heads, 2 KV heads) made without a
    download: the stand-in for a user's pretrained model in the tests and the example."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=256,
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=positions,
        tie_word_embeddings=tie,
    )
    torch.manual_seed(seed)
    return LlamaForCausalLM(config)
