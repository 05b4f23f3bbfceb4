"""Reasoning content: the model's `<think>...</think>` part split from its answer (vLLM's --reasoning-parser).

    qwen3        reasoning only when the output opens with <think> (enable_thinking: false gives none)
    deepseek_r1  the output is reasoning until </think> (its chat template opens <think> in the prompt)

parse(text) -> (reasoning or None, content); a Stream fed text pieces yields (reasoning piece, content piece) pairs,
holding back only a tail that may be the start of a tag. Text is split at the tags, not stripped (vLLM's way).
"""

from __future__ import annotations

START, END = "<think>", "</think>"


class ReasoningParser:
    def __init__(self, name: str):
        if name not in PARSERS:
            raise ValueError(f"unknown reasoning parser {name!r} (known: {', '.join(PARSERS)})")
        self.name = name
        self.opens_in_reasoning = name == "deepseek_r1"

    def parse(self, text: str) -> tuple[str | None, str]:
        s = self.stream()
        r, c = s.push(text)
        r2, c2 = s.flush()
        reasoning = r + r2
        return (reasoning if s.had_reasoning else None), c + c2

    def stream(self) -> Stream:
        return Stream(self.opens_in_reasoning)


PARSERS = ("qwen3", "deepseek_r1")


class Stream:
    def __init__(self, opens_in_reasoning: bool):
        self.state = "start"  # start -> reasoning -> content
        self.opens_in_reasoning = opens_in_reasoning
        self.buf = ""
        self.had_reasoning = False

    def push(self, piece: str) -> tuple[str, str]:
        """(reasoning, content) text that can be sent now."""
        self.buf += piece
        reasoning = content = ""
        if self.state == "start":
            stripped = self.buf.lstrip()
            if stripped.startswith(START):
                self.buf, self.state, self.had_reasoning = stripped[len(START) :], "reasoning", True
            elif START.startswith(stripped) and stripped:
                return "", ""  # may still become <think>
            elif not stripped:
                return "", ""
            elif self.opens_in_reasoning:
                self.state, self.had_reasoning = "reasoning", True
            else:
                self.state = "content"
        if self.state == "reasoning":
            i = self.buf.find(END)
            if i < 0:
                keep = _partial(self.buf, END)
                reasoning, self.buf = self.buf[: len(self.buf) - keep], self.buf[len(self.buf) - keep :]
                return reasoning, ""
            reasoning, self.buf, self.state = self.buf[:i], self.buf[i + len(END) :], "content"
        if self.state == "content":
            content, self.buf = self.buf, ""
        return reasoning, content

    def flush(self) -> tuple[str, str]:
        """What is held back, at the end of the output."""
        rest, self.buf = self.buf, ""
        if self.state == "reasoning":
            return rest, ""
        return "", rest


def _partial(text: str, marker: str) -> int:
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:n]):
            return n
    return 0
