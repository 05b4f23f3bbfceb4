"""Shared by the model tests: one jitted forward + logits step, and the three SmolLM2 parity prompts."""

from __future__ import annotations

import functools

import jax

from kiln.models.transformer import forward, logits


@functools.cache
def logits_step(cfg):
    """jit of (weights, kv, batch) -> (float32 logits of every token (T, V), kv): the model without sampling."""

    @jax.jit
    def run(weights, kv, batch):
        hidden, kv = forward(cfg, weights, kv, batch)
        return logits(cfg, weights, hidden), kv

    return run


def parity_prompts(tok) -> list[list[int]]:
    """The token ids of the three SmolLM2 parity prompts: a chat question, a sentence start, a code start."""
    chat = tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}])
    return [tok.encode(chat), tok.encode("The three primary colors are"), tok.encode("def fibonacci(n):\n    ")]
