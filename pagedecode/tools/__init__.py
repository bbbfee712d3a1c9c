"""Tool calling, engine side: a request's tools read into a ToolSpec (spec.py), the format a
chat template writes calls in (formats.py), the constraint that makes every call parse and
validate (constraint.py), the template's inputs (prompt.py), and the parser of the output,
whole or streamed (stream.py), with the finish reason that agrees with it (finish.py)."""
from .calls import ContentDelta, Delta, ToolCall, ToolCallDelta, ToolCallEnd, ToolOutput, new_call_id
from .constraint import check_grammars, tool_constraint
from .finish import tool_finish_reason
from .formats import FORMATS, GENERIC, HERMES, LLAMA3, MISTRAL, ToolFormat, detect_format
from .prompt import prepare_messages, template_kwargs
from .spec import FunctionTool, ToolLimits, ToolSpec, parse_tool_fields
from .stream import ToolStreamParser, parse_tool_output

__all__ = [
    "FORMATS", "GENERIC", "HERMES", "LLAMA3", "MISTRAL", "ContentDelta", "Delta", "FunctionTool", "ToolCall",
    "ToolCallDelta", "ToolCallEnd", "ToolFormat", "ToolLimits", "ToolOutput", "ToolSpec", "ToolStreamParser",
    "check_grammars", "detect_format", "new_call_id", "parse_tool_fields", "parse_tool_output",
    "prepare_messages", "template_kwargs", "tool_constraint", "tool_finish_reason",
]
