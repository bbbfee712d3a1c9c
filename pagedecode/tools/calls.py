"""What a tool-calling request produces, as plain data: a call, the deltas a stream parser
emits, and a whole output parsed. The server turns these into OpenAI's, the Responses API's or
Anthropic's shapes."""
from __future__ import annotations

import hashlib
import secrets
import string
from dataclasses import dataclass, field

ID_ALPHABET = string.ascii_letters + string.digits


def new_call_id() -> str:
    """`call_` and 24 random letters and digits (143 bits: unique without a registry)."""
    return "call_" + "".join(secrets.choice(ID_ALPHABET) for _ in range(24))


def digest_id(text: str, length: int) -> str:
    """`length` letters and digits drawn from sha256(text): the same text, the same id."""
    n = int.from_bytes(hashlib.sha256(text.encode()).digest(), "big")       # 256 bits: 43 base-62 digits
    out = []
    for _ in range(length):
        n, digit = divmod(n, len(ID_ALPHABET))
        out.append(ID_ALPHABET[digit])
    return "".join(out)


def template_call_id(call_id: str, length: int) -> str:
    """A call id as a template that takes only `length` letters and digits needs it (Mistral's
    refuse any other id): the id itself when it is one, else its digest_id, so the assistant's
    call and the tool result that answers it still name one id."""
    if len(call_id) == length and call_id.isascii() and call_id.isalnum():
        return call_id
    return digest_id(call_id, length)


@dataclass
class ToolCall:
    id: str
    name: str
    arguments: str = ""          # the arguments object's JSON text, exactly as generated
    complete: bool = False       # its object closed (False: the output was cut inside it)


@dataclass(frozen=True)
class ContentDelta:
    text: str


@dataclass(frozen=True)
class ToolCallDelta:
    """A call's first delta carries its id and name (arguments ""); later ones only arguments
    text (id and name None), in OpenAI's streaming shape."""
    index: int
    arguments: str
    id: str | None = None
    name: str | None = None


@dataclass(frozen=True)
class ToolCallEnd:
    """The call's arguments object closed: its arguments are final (the Responses API's
    `.done` event, Anthropic's content_block_stop). A call cut short never gets one."""
    index: int


Delta = ContentDelta | ToolCallDelta | ToolCallEnd


@dataclass
class ToolOutput:
    """An output parsed: its text outside calls, and its calls in order."""
    content: str = ""
    calls: list[ToolCall] = field(default_factory=list)

    @property
    def complete(self) -> bool:
        """Every call's arguments closed (a cut output may end inside one)."""
        return all(c.complete for c in self.calls)

    def apply(self, delta: Delta) -> None:
        """Fold one delta in: folding a stream's deltas gives the output parsed whole."""
        if isinstance(delta, ContentDelta):
            self.content += delta.text
        elif isinstance(delta, ToolCallEnd):
            self.calls[delta.index].complete = True
        elif delta.id is not None:
            assert delta.index == len(self.calls) and delta.name is not None, delta
            self.calls.append(ToolCall(delta.id, delta.name, delta.arguments))
        else:
            self.calls[delta.index].arguments += delta.arguments
