"""`pagedecode chat`: a conversation in the terminal, as `llama-cli -cnv` and `vllm chat` hold one.

Each turn renders the whole history through the model's chat template (or --chat-template's)
and streams the reply. /reset forgets the history (the system prompt stays), /exit or end of
input (Ctrl-D) leaves. Ctrl-C during a reply stops that reply only: SIGINT sets a flag that the
loop reads between engine steps and turns into a cancel, so no step is cut in half and the engine
serves the next turn; the words already shown stay in the history. At the prompt, Ctrl-C clears
the line. A history longer than the model's context is refused with a message saying so.
"""
from __future__ import annotations

import argparse
import signal
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, TextIO

from .params import SamplingParams
from .runtime.output.events import DeltaEvent, TerminalEvent

COMMANDS = "/reset forgets the conversation, /exit (or Ctrl-D) leaves, Ctrl-C stops a reply"
PROMPT = "> "


class ChatSetupError(Exception):
    """The model cannot chat as asked (no template, no jinja2): one line for the user."""


def load_chat_template(model: str | Path, override: str | Path | None) -> Any:
    """The model's ChatTemplate (its directory's tokenizer_config.json or chat_template.jinja, a
    GGUF's tokenizer.chat_template), or override's file."""
    try:
        from .server.chat import ChatTemplate, load_template
    except ImportError:               # jinja2 comes with pagedecode[server]
        raise ChatSetupError("chat templates need jinja2: pip install 'pagedecode[server]'") from None
    source, specials = load_template(model, override)
    if not source:
        raise ChatSetupError(f"{model} has no chat template; give one with --chat-template FILE")
    return ChatTemplate(source, specials)


def render_ids(tokenizer: Any, template: Any, messages: list[dict[str, Any]]) -> list[int]:
    """The prompt ids of `messages` rendered with a generation prompt; what a user typed stays
    plain text even where it spells a special token (as the server renders chat requests)."""
    from .model.tokenizer import EscapesSpecialTokens
    from .server.errors import ApiError
    try:
        if isinstance(tokenizer, EscapesSpecialTokens):
            return tokenizer.encode_escaped(template.render(messages, escape=tokenizer.escape_specials))
        return list(tokenizer.encode(template.render(messages), add_special_tokens=False))
    except ApiError as e:
        raise ChatSetupError(e.message) from None


@dataclass
class Conversation:
    """The messages so far; `system` leads every rendering and survives /reset."""
    system: str | None = None
    turns: list[dict[str, str]] = field(default_factory=list)

    def messages(self) -> list[dict[str, str]]:
        lead = [{"role": "system", "content": self.system}] if self.system else []
        return lead + self.turns

    def reset(self) -> None:
        self.turns.clear()


@dataclass
class Reply:
    text: str
    end: TerminalEvent | None
    stopped: bool                  # Ctrl-C ended it


class StopOnInterrupt:
    """While active, SIGINT only sets `requested` (the handler before it comes back on exit)."""

    def __init__(self) -> None:
        self.requested = False
        self._before: Any = None

    def __enter__(self) -> "StopOnInterrupt":
        self.requested = False
        self._before = signal.signal(signal.SIGINT, self._on_signal)
        return self

    def _on_signal(self, signum: int, frame: Any) -> None:
        self.requested = True

    def __exit__(self, *exc: object) -> None:
        signal.signal(signal.SIGINT, self._before)


def stream_reply(engine: Any, ids: list[int], params: SamplingParams, out: TextIO) -> Reply:
    """Run one reply to its end, writing its text as it comes; Ctrl-C cancels it (the engine
    applies the cancel at its next safe point, and the reply ends there)."""
    rid = engine.add_request(ids, params)
    text: list[str] = []
    end: TerminalEvent | None = None
    with StopOnInterrupt() as interrupt:
        cancelled = False
        while end is None:
            if interrupt.requested and not cancelled:
                engine.cancel(rid)
                cancelled = True
            for ev in engine.step():
                if ev.request_id != rid:
                    continue
                if isinstance(ev, DeltaEvent):
                    text.append(ev.text)
                    out.write(ev.text)
                    out.flush()
                elif isinstance(ev, TerminalEvent):
                    end = ev
    return Reply("".join(text), end, cancelled)


def chat_loop(engine: Any, template: Any, params: SamplingParams, conversation: Conversation,
              read_line: Callable[[str], str], out: TextIO, err: TextIO) -> int:
    """Turns until /exit or end of input; returns the exit status (0)."""
    print(f"[{COMMANDS}]", file=err)
    while True:
        try:
            line = read_line(PROMPT)
        except EOFError:
            out.write("\n")
            return 0
        except KeyboardInterrupt:      # at the prompt: a fresh line, as a shell does
            out.write("\n")
            continue
        text = line.strip()
        if text == "/exit":
            return 0
        if text == "/reset":
            conversation.reset()
            print("[conversation reset]", file=err)
            continue
        if not text:
            continue
        conversation.turns.append({"role": "user", "content": line})
        try:
            ids = render_ids(engine.tokenizer, template, conversation.messages())
        except ChatSetupError as e:          # the template refused this history: the turn is dropped
            conversation.turns.pop()
            print(f"[{e}]", file=err)
            continue
        room = engine.max_context - len(ids)
        if room < 1:
            conversation.turns.pop()
            print(f"[the conversation is {len(ids)} tokens and the context holds {engine.max_context}: "
                  "/reset to start over]", file=err)
            continue
        reply = stream_reply(engine, ids, params, out)
        out.write("\n")
        out.flush()
        conversation.turns.append({"role": "assistant", "content": reply.text})
        _report_ending(reply, engine.max_context, err)


def _report_ending(reply: Reply, max_context: int, err: TextIO) -> None:
    end = reply.end
    reason = end.finish_reason.value if end is not None and end.finish_reason is not None else None
    if reply.stopped:
        print("[stopped]", file=err)
    elif end is not None and end.error:
        print(f"[the reply failed: {end.error}]", file=err)
    elif reason == "context_limit":
        print(f"[the reply reached the end of the context ({max_context} tokens): /reset to start over]", file=err)
    elif reason == "max_output_tokens":
        print("[the reply reached --max-tokens]", file=err)


def read_terminal_line(prompt: str) -> str:
    """input() with line editing where the readline module exists."""
    try:
        import readline  # noqa: F401  (input() edits lines once it is imported)
    except ImportError:
        pass
    return input(prompt)


def chat_params(args: argparse.Namespace) -> SamplingParams:
    return SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_k=args.top_k,
                          top_p=args.top_p, min_p=args.min_p, repetition_penalty=args.repetition_penalty,
                          seed=args.seed, ignore_eos=args.ignore_eos)


def add_chat_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--system", default=None, help="a system prompt that leads the conversation")
    p.add_argument("--chat-template", default=None, help="a Jinja chat template file (default: the model's)")
    from .server.flags import add_sampling_arguments
    add_sampling_arguments(p, 512, 0.0, "reply")
