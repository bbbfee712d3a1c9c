"""A stored response keeps what it needs of the request's `text`, at its real size: a `text`
object padded with 878 KB of nested empty lists cost 21 MB resident per stored response while
the finished-request budget counted 0.9 MB of it (issue: the edges, second round)."""
import gc
import json
import tracemalloc

from pagedecode.server.protocol import Limits
from pagedecode.server.responses_input import parse_body


def padded_text(fmt):
    nested = [[] for _ in range(219_000)]            # json.dumps: 878 KB of "[], "
    return {"format": fmt, "junk": nested, "verbosity": ["x"] * 1000}


def test_a_stored_response_keeps_only_its_text_format_at_its_real_size():
    schema = {"type": "json_schema", "name": "n", "schema": {"type": "object"}, "strict": True, "extra": [[]] * 9}
    for fmt, kept in (({"type": "text"}, {"type": "text"}),
                      (schema, {"type": "json_schema", "name": "n", "schema": {"type": "object"}, "strict": True})):
        body = {"model": "m", "input": "Hi", "text": padded_text(fmt)}
        raw = json.dumps(body)
        gc.collect()
        tracemalloc.start()
        before = tracemalloc.get_traced_memory()[0]
        _, stored = parse_body(json.loads(raw), {}, Limits())
        gc.collect()
        held = tracemalloc.get_traced_memory()[0] - before
        tracemalloc.stop()
        assert stored.text == {"format": kept}
        assert held < 64_000, held                            # was ~21 MB: the whole parsed object
        assert stored.kept_bytes() < 1_000                    # what the finished budget counts
        assert stored.kept_bytes() >= len(json.dumps(stored.text)) + len(json.dumps([stored.instructions, stored.metadata]))
