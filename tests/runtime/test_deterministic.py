"""Deterministic mode (EngineConfig.deterministic): a request's logits are the same bits whatever
else runs -- other requests, chunked prefill, the prefix cache, preemption, the thread count."""
from __future__ import annotations

import pytest
import torch

import pagedecode as pd
from pagedecode import cli
from pagedecode.runtime.config import EngineConfig


def test_the_option_reaches_the_model_and_the_trace(stories_path):
    engine = pd.Engine.from_pretrained(stories_path, deterministic=True, trace="tokens")
    assert engine.config.deterministic and engine.model.deterministic
    out = engine.generate("Once upon a time", pd.SamplingParams(max_tokens=2))[0]
    added = [r for r in engine.trace(out.request_id) if r["kind"] == "added"]
    assert added and added[0]["deterministic"] is True
    plain = pd.Engine.from_pretrained(stories_path)
    assert not plain.model.deterministic
    with pytest.raises(ValueError, match="deterministic"):
        EngineConfig(deterministic="yes")  # type: ignore[arg-type]


def test_a_model_without_a_deterministic_forward_is_refused(stories_path):
    engine = pd.Engine.from_pretrained(stories_path)

    class Plain:
        config, device, dtype = engine.model.config, torch.device("cpu"), torch.float32

        def forward(self, batch, kv):
            raise AssertionError("never called")
    with pytest.raises(ValueError, match="batch-invariant"):
        pd.Engine(Plain(), engine.tokenizer, EngineConfig(deterministic=True))


def test_the_flag_on_generate_demo_and_serve():
    ap = cli.build_parser()
    for cmd in (["generate", "--prompt", "x"], ["demo"]):
        assert ap.parse_args(cmd + ["--deterministic"]).deterministic is True
        assert ap.parse_args(cmd).deterministic is False
    assert ap.parse_args(["serve", "--deterministic"]).engine_deterministic is True
    assert ap.parse_args(["serve", "--deterministic", "false"]).engine_deterministic is False
    assert ap.parse_args(["serve"]).engine_deterministic is False
