"""`kiln chat`: an interactive chat in the terminal against a running OpenAI-compatible server (kiln, vLLM, ...).

Each line you type is sent with the conversation so far to /v1/chat/completions with stream=true; the reply is printed
as it arrives. Empty input or Ctrl+D ends the chat, Ctrl+C interrupts a reply, `/reset` clears the conversation.
Standard library only (urllib), so it works wherever kiln is installed.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import urllib.error
import urllib.request
from collections.abc import Iterator
from typing import IO

from kiln.models.errors import KilnError


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--base-url", default="http://127.0.0.1:8000/v1", help="the server's OpenAI base URL")
    p.add_argument("--model", default=None, help="model name (default: the server's first model)")
    p.add_argument("--api-key", default=os.environ.get("KILN_API_KEY"), help="Bearer key (env KILN_API_KEY)")
    p.add_argument("--system", default=None, help="a system prompt")
    p.add_argument("--temperature", type=float, default=None, help="sampling temperature (default: the model's)")
    p.add_argument("--max-tokens", type=int, default=None, help="longest reply in tokens")


def _request(args: argparse.Namespace, path: str, body: dict | None = None) -> IO[bytes]:
    headers = {"Content-Type": "application/json", "Accept": "text/event-stream, application/json"}
    if args.api_key:
        headers["Authorization"] = f"Bearer {args.api_key}"
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(args.base_url.rstrip("/") + path, data=data, headers=headers)
    try:
        return urllib.request.urlopen(req, timeout=600)
    except urllib.error.HTTPError as e:
        try:
            message = json.loads(e.read())["error"]["message"]
        except (ValueError, KeyError, TypeError):
            message = e.reason
        raise KilnError(f"The server answered {e.code}: {message}") from None
    except (urllib.error.URLError, OSError) as e:
        raise KilnError(f"Cannot reach {args.base_url} ({getattr(e, 'reason', e)}); is `kiln serve` running?") from None


def stream_reply(args: argparse.Namespace, model: str, messages: list[dict]) -> Iterator[str]:
    """Yield the assistant's reply piece by piece as the server streams it."""
    body: dict = {"model": model, "messages": messages, "stream": True}
    if args.temperature is not None:
        body["temperature"] = args.temperature
    if args.max_tokens is not None:
        body["max_tokens"] = args.max_tokens
    with _request(args, "/chat/completions", body) as resp:
        for raw in resp:
            line = raw.decode("utf-8").strip()
            if not line.startswith("data:"):
                continue
            data = line[5:].strip()
            if data == "[DONE]":
                return
            event = json.loads(data)
            if "error" in event:
                raise KilnError(f"The server failed mid-reply: {event['error'].get('message')}")
            for choice in event.get("choices", []):
                piece = choice.get("delta", {}).get("content")
                if piece:
                    yield piece


def run(args: argparse.Namespace) -> int:
    model = args.model
    if model is None:
        with _request(args, "/models") as resp:
            data = json.load(resp).get("data") or []
        if not data:
            raise KilnError(f"{args.base_url} serves no model.")
        model = data[0]["id"]
    system = [{"role": "system", "content": args.system}] if args.system else []
    messages = list(system)
    print(f"Chatting with {model} at {args.base_url}. Empty line or Ctrl+D quits, /reset forgets.", file=sys.stderr)
    while True:
        try:
            text = input("> ")
        except EOFError:
            print(file=sys.stderr)
            return 0
        if not text.strip():
            return 0
        if text.strip() == "/reset":
            messages = list(system)
            continue
        messages.append({"role": "user", "content": text})
        reply = []
        try:
            for piece in stream_reply(args, model, messages):
                reply.append(piece)
                print(piece, end="", flush=True)
        except KeyboardInterrupt:
            print(" [interrupted]", end="")
        print()
        messages.append({"role": "assistant", "content": "".join(reply)})
