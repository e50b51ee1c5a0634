"""Small run configs for tests and rehearsals: a few thousand parameters, short leases."""

from __future__ import annotations

from typing import Any

from geodiloco.config import RunConfig


def tiny_config(**overrides: Any) -> RunConfig:
    """A run small enough for unit and integration tests (a few thousand parameters)."""
    data: dict[str, Any] = {
        "run_id": "test-run",
        "sites": ["site-a", "site-b"],
        "rounds": 3,
        "round_timeout_s": 30.0,
        "heartbeat_interval_s": 0.5,
        "lease_s": 5.0,
        "model": {"n_layer": 1, "n_head": 2, "d_model": 16, "seq_len": 16},
        "data": {"max_bytes": 300_000, "batch_size": 4, "eval_sequences": 16},
        "inner": {"steps_per_round": 3, "lr": 3e-3},
        "outer": {"optimizer": "nesterov", "lr": 0.7, "momentum": 0.5},
    }
    for key, value in overrides.items():
        node = data
        *parents, leaf = key.split("__")
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = value
    return RunConfig.from_dict(data)


def streaming_config(fragments: int = 1, overlap: int = 0, **overrides: Any) -> RunConfig:
    """tiny_config with a streaming schedule: P fragments, τ steps of overlap, α = 0.5."""
    settings: dict[str, Any] = {
        "rounds": 3,
        "inner__steps_per_round": 4,
        "outer__fragments": fragments,
        "outer__overlap_steps": overlap,
        "outer__mix_alpha": 0.5,
        "lease_s": 30.0,
        **overrides,
    }
    return tiny_config(**settings)
