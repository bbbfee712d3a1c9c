"""The finish reason of a tool-calling output, consistent with what was parsed: "tool_calls"
exactly when calls were returned and the output ended on its own; "length" when it was cut
(a call may then be incomplete), whatever it holds."""
from __future__ import annotations

from .calls import ToolOutput

CUT = frozenset({"length", "max_output_tokens", "context_limit"})


def tool_finish_reason(output: ToolOutput, reason: str) -> str:
    """reason: the server's finish reason without tools ("stop", "length", ...) or the
    engine's FinishReason value. A stop string met inside a call leaves it incomplete: the
    output is then not a tool call ("stop")."""
    if reason in CUT:
        return "length"
    if output.calls and output.complete:
        return "tool_calls"
    return "stop" if reason in ("eos", "stop_sequence", "grammar_complete") else reason
