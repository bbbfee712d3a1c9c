"""Speculation on a real model (SmolLM2-135M-Instruct): where each draft source pays, in one run,
off and on interleaved, outputs checked identical.

    .venv/bin/python benchmarks/speculative_real.py --http      # every workload of issue 38's goals
    .venv/bin/python benchmarks/speculative_real.py --quick     # 5 prompts a set, greedy only

Workloads, each a chat rendered through the model's own template:
  grounded   20 input-grounded prompts over five paragraphs of 105-121 words (repeat, fix typos,
             quote sentences, reformat as a list, summarize then quote; and one code edit) with
             the chat set's self-draft backed by prompt lookup (SpeculativeConfig(prompt_lookup=True),
             k = --draft-k), or with --grounded ngram n-gram speculation alone (prompt lookup,
             k = --k), against none; with --http also over HTTP (two servers, the openai client
             streaming), single stream, with the same speculation as the in-process runs
  chat       20 free chat prompts with the quantized self-draft (the model's own weights in
             q4_0 on the target's KV cache, SpeculativeConfig(method="draft", draft_quantization="q4_0",
             num_tokens=--draft-k, min_draft_confidence=0.5, max_batch=1)) against none
  code-edit  a 106-line file and a small change asked (5 prompts), the answer opened with a code
             fence and stopped at the closing one, the file given as the prediction (Predicted
             Outputs) against no prediction, single stream
each greedy and seeded sampling (temperature 0.7), single stream and batches (--concurrency).
Outputs must be identical on and off, except seeded runs with the draft model (the chat set's,
and the grounded set's unless --grounded ngram): its rejection rule keeps the target's
distribution, not its draws (reported, not compared).
The target is the model in float32 (its Q4_1 file dequantized once into a cached F32 GGUF,
benchmarks/real_model.py), or --dtype bfloat16. A pass runs a set in waves (--concurrency prompts
at once, one generate call each; a batch case at least 5 waves, the set cycled: MIN_WAVES); off
and on alternate wave by wave, so that the machine's drift falls on both alike (alternating whole
passes, a case where nothing drafts read 0.85x to 1.05x); each speedup is the median of the
passes' own ratios (--repeat passes; --batch-repeat for the batch cases, whose passes are shorter).
The in-process engines share one loaded model (the speculating ones are built over the plain
engine's), so that off and on differ by their speculation alone.
JSON under benchmarks/results/ and a PNG beside it; a progress bar and each pass's figures with
the load average on stderr.
"""
from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Callable

import torch

import pagedecode as pd
from pagedecode.runtime.loading import with_self_draft
from common import plot, result_path, write_json
from real_model import smollm2_chat, smollm2_f32_gguf

PARAGRAPHS = [
    "The lighthouse keeper climbed the spiral stairs every evening at dusk. He trimmed the wick, polished "
    "the great lens and wrote the weather in a leather book: the wind, the clouds, the height of the waves "
    "and the ships he saw. In winter the storms came from the north and the spray reached the lantern room, "
    "so he kept a second lamp ready and a bucket of sand by the door. His daughter brought bread and letters "
    "from the village on Sundays, rowing across the bay when the sea was calm. Ships passed far out at sea, "
    "and none of them ever knew his name, but every captain on the coast knew his light.",
    "Our town library opens at nine and closes at six on weekdays, and at noon on Saturdays. Children may "
    "borrow five books at a time, adults ten. Books are lent for three weeks and may be renewed twice, in "
    "person, by telephone or on the website, unless another reader has reserved them. Returns go in the slot "
    "beside the door, and late books cost ten cents a day. The reading room on the first floor has "
    "newspapers, maps and four computers, which may be booked for an hour at a time. On Wednesday afternoons "
    "a volunteer reads stories to young children in the garden room.",
    "To make bread, mix five hundred grams of flour, three hundred millilitres of warm water, ten grams of "
    "salt and seven grams of dried yeast in a large bowl. Knead the dough on a floured table for ten minutes, "
    "until it is smooth and springs back when you press it. Put it back in the bowl, cover it with a damp "
    "cloth and let it rise in a warm place for an hour, until it has doubled in size. Shape it into a loaf, "
    "place it on a baking tray and let it rise for another half hour. Bake it at two hundred degrees for "
    "forty minutes, until the crust is golden and the loaf sounds hollow when you tap it.",
    "Maria planted tomatoes, beans and sunflowers in the spring, in the narrow garden behind her house. She "
    "watered them every morning before work and pulled the weeds on Saturday afternoons. By July the "
    "sunflowers were taller than the fence, the beans climbed every pole, and the tomatoes turned red one by "
    "one. Her neighbours stopped to look over the wall, and she gave them bags of beans and baskets of "
    "tomatoes, more than she could ever eat herself. In September she saved the seeds of the best plants in "
    "paper envelopes, wrote the names on them and kept them in a tin for the next year.",
    "The train left the station at seven. It crossed the river on the old iron bridge, passed the mill and "
    "the brick factory, and climbed slowly through the hills, where sheep grazed between the stone walls. It "
    "stopped in three small villages, each with a single platform and a bench, and at each one a few people "
    "got on with baskets and bags. The conductor knew most of them by name and asked after their families. "
    "After the last village the line ran straight across the plain, beside the canal and the long rows of "
    "poplars, and the train reached the city just after noon.",
]
TYPOS = [("evening", "evning"), ("weather", "wether"), ("borrow", "borow"), ("minutes", "minuts"),
         ("planted", "plantd"), ("station", "staton"), ("villages", "vilages"), ("telephone", "telefone"),
         ("neighbours", "nieghbours"), ("smooth", "smoth"), ("conductor", "conducter"), ("daughter", "dauhgter")]
# the input-grounded set's kinds of request (with the code edit: issue 38's six), each paragraph
# asked four of them in turn
KINDS = [
    "Repeat the following paragraph exactly:\n\n{p}",
    "Fix the spelling mistakes in this paragraph and give it back:\n\n{typo}",
    "Quote the first three sentences of this text word for word:\n\n{p}",
    "Rewrite this text as a bulleted list, one sentence per bullet, keeping every word:\n\n{p}",
    "Summarize this text in one sentence, then quote its last two sentences word for word:\n\n{p}",
]
CODE = "\n".join(
    [f"def area_{i}(width, height):\n    \"\"\"Area of rectangle number {i}.\"\"\"\n    return width * height\n"
     for i in range(12)] +
    ["class Inventory:\n    def __init__(self):\n        self.items = {}\n",
     "    def add(self, name, count):\n        self.items[name] = self.items.get(name, 0) + count\n",
     "    def remove(self, name, count):\n        self.items[name] = max(0, self.items.get(name, 0) - count)\n",
     "    def total(self):\n        return sum(self.items.values())\n"])
# The code-edit set's file: single blank lines between definitions, the layout SmolLM2-135M writes
# itself (given the usual two, it copies with one and leaves the prediction at every definition).
# A model this small copies the file rather than making the change asked; what is measured is how
# fast a prediction lets the output go where it follows the file. The answer is opened with the
# code fence (EDIT_OPENING after the template's generation prompt) and stopped at the closing one,
# as code-edit tools ask for a file: asked plainly, SmolLM2-135M explains the functions instead of
# writing the file (2.3-2.5x with a prediction, its own repetitive prose drafting itself), and
# without the stop it goes on after the file in prose the prediction does not hold.
EDIT_FILE = """import json
import os

def load_config(path):
    with open(path) as f:
        return json.load(f)

def save_config(path, config):
    with open(path, "w") as f:
        json.dump(config, f, indent=2)

def area(width, height):
    return width * height

def perimeter(width, height):
    return 2 * (width + height)

def is_square(width, height):
    return width == height

def scale(width, height, factor):
    return width * factor, height * factor

def list_files(folder):
    return sorted(os.listdir(folder))

def count_lines(path):
    with open(path) as f:
        return sum(1 for _ in f)

def read_words(path):
    with open(path) as f:
        return f.read().split()

def word_count(path):
    return len(read_words(path))

class Inventory:
    def __init__(self):
        self.items = {}

    def add(self, name, count):
        self.items[name] = self.items.get(name, 0) + count

    def remove(self, name, count):
        self.items[name] = max(0, self.items.get(name, 0) - count)

    def total(self):
        return sum(self.items.values())

    def names(self):
        return sorted(self.items)

class Stack:
    def __init__(self):
        self.values = []

    def push(self, value):
        self.values.append(value)

    def pop(self):
        return self.values.pop()

    def peek(self):
        return self.values[-1]

    def is_empty(self):
        return not self.values

class Queue:
    def __init__(self):
        self.values = []

    def put(self, value):
        self.values.append(value)

    def get(self):
        return self.values.pop(0)

    def size(self):
        return len(self.values)

def celsius_to_fahrenheit(celsius):
    return celsius * 9 / 5 + 32

def fahrenheit_to_celsius(fahrenheit):
    return (fahrenheit - 32) * 5 / 9

def average(numbers):
    if not numbers:
        return 0
    return sum(numbers) / len(numbers)

def largest(numbers):
    best = numbers[0]
    for number in numbers:
        if number > best:
            best = number
    return best

def main():
    config = load_config("config.json")
    print(area(config["width"], config["height"]))

if __name__ == "__main__":
    main()
"""
EDIT_OPENING = "```python\n"       # the assistant's answer, begun ...
EDIT_CLOSING = "```"                # ... and ended where the code does (a stop string)
EDITS = [("method", "total", "count_all"), ("function", "area", "rectangle_area"), ("method", "peek", "top"),
         ("class", "Queue", "FifoQueue"), ("function", "average", "mean")]
CHAT = ["What is the capital of France?", "Give me three tips for sleeping better.",
        "Explain what a rainbow is to a child.", "Write a short poem about the sea.",
        "What are the benefits of drinking water?", "How do I boil an egg?",
        "Why is the sky blue?", "Suggest a name for a pet cat.", "What is photosynthesis?",
        "Tell me a fun fact about elephants.", "How can I learn to play the guitar?",
        "What should I pack for a weekend trip?", "Describe a sunset in two sentences.",
        "What is the difference between a virus and a bacterium?", "How do airplanes fly?",
        "Give me a simple recipe for pancakes.", "What is the tallest mountain in the world?",
        "How do I stay motivated when studying?", "Write a haiku about autumn.",
        "What are three things to do on a rainy day?"]


def grounded_prompts() -> list[str]:
    out = []
    for i, p in enumerate(PARAGRAPHS):
        typo = p
        for right, wrong in TYPOS:
            typo = typo.replace(right, wrong)
        out += [KINDS[(i + j) % len(KINDS)].format(p=p, typo=typo) for j in range(4)]
    out[-1] = f"In this code, rename the method `total` to `count_all` and give back the whole code:\n\n{CODE[-300:]}"
    return out


def edit_prompts(chat: Callable[[str], str]) -> list[str]:
    return [chat(f"In this Python file, rename the {kind} `{old}` to `{new}`, and give back the whole file.\n\n"
                 f"```python\n{EDIT_FILE}```") + EDIT_OPENING for kind, old, new in EDITS]


class Progress:
    """One bar over every timed wave of the run (tqdm on stderr), each pass's figures logged above
    it with the load average."""

    def __init__(self, total: int) -> None:
        from tqdm import tqdm
        self.bar = tqdm(total=total, unit="wave", file=sys.stderr, dynamic_ncols=True)

    def log(self, msg: str) -> None:
        self.bar.write(f"[{time.strftime('%H:%M:%S')}] {msg} (load {os.getloadavg()[0]:.1f})", file=sys.stderr)

    def step(self, desc: str) -> None:
        self.bar.set_description(desc, refresh=False)
        self.bar.update(1)


def run(engine: pd.Engine, prompts: list[str], params: list[pd.SamplingParams]) -> dict:
    """One wave: the prompts at once (engine.generate), timed."""
    before = engine.snapshot()
    t0 = time.perf_counter()
    outs = engine.generate(prompts, params)
    wall = time.perf_counter() - t0
    after = engine.snapshot()
    return {"wall_s": wall, "tokens": sum(len(o.token_ids) for o in outs), "steps": after.steps - before.steps,
            "draft_tokens": sum(o.usage.draft_tokens for o in outs),
            "accepted_tokens": sum(o.usage.accepted_draft_tokens for o in outs), "outputs": [o.token_ids for o in outs]}


def interleaved(name: str, waves: int, one_wave: Callable[[str, int], dict], repeat: int, progress: Progress) -> dict:
    """A pass of each mode is `waves` waves (one_wave(mode, w): its wall_s, tokens, outputs, and
    any further counts); off and on alternate wave by wave (off on, on off, ...), so that the
    machine's drift, up to ~30 % within a run here, falls on both alike. The speedup is the median
    of the passes' own ratios; outputs compared."""
    runs: dict[str, list[dict]] = {"off": [], "on": []}
    for rep in range(repeat):
        parts: dict[str, list[dict]] = {"off": [], "on": []}
        loads = []
        for w in range(waves):
            loads.append(os.getloadavg()[0])
            for mode in (("off", "on") if (rep + w) % 2 == 0 else ("on", "off")):
                parts[mode].append(one_wave(mode, w))
                progress.step(name)
        for mode, ws in parts.items():
            r = {key: sum(x[key] for x in ws) for key in ws[0] if key != "outputs"}
            r["outputs"] = [o for x in ws for o in x["outputs"]]
            r["tokens_per_s"] = r["tokens"] / r["wall_s"]
            proposed = r.get("draft_tokens")
            r["acceptance"] = r["accepted_tokens"] / proposed if proposed else None
            r["load"] = max(loads)
            runs[mode].append(r)
        progress.log(f"{name} pass {rep + 1}: off {runs['off'][-1]['tokens_per_s']:.1f}, "
                     f"on {runs['on'][-1]['tokens_per_s']:.1f} tok/s (load up to {max(loads):.1f})")
    same = all(r["outputs"] == runs["off"][0]["outputs"] for r in runs["off"] + runs["on"])
    for rs in runs.values():
        for r in rs:
            del r["outputs"]
    med = {m: statistics.median(r["tokens_per_s"] for r in rs) for m, rs in runs.items()}
    speedup = statistics.median(on["tokens_per_s"] / off["tokens_per_s"] for off, on in zip(runs["off"], runs["on"]))
    acc = runs["on"][-1].get("acceptance")
    c = {"identical_outputs": same, "off_tokens_per_s": med["off"], "on_tokens_per_s": med["on"],
         "speedup": speedup, "acceptance": acc,
         "load": [r["load"] for rs in runs.values() for r in rs], "runs": runs}
    progress.log(f"{name}: {c['speedup']:.2f}x, acceptance {acc if acc is None else round(acc, 2)}, identical {same}")
    return c


# A pass has at least this many waves: a set of 20 prompts makes 2 waves of 16 streams, ~10 s a
# pass here, where single passes of one engine spread ~10 % (a case where nothing drafts read 0.85x
# to 1.03x over three passes); its prompts are cycled to make up the rest.
MIN_WAVES = 5


def waves_of(prompts: int, concurrent: int) -> int:
    return max(MIN_WAVES, -(-prompts // concurrent)) if concurrent > 1 else prompts


def case(name: str, engines: dict[str, pd.Engine], prompts: list[str], params: dict[str, list[pd.SamplingParams]],
         concurrent: int, repeat: int, progress: Progress, exact: bool = True) -> dict:
    """engines / params: "off" and "on" (the same engine twice where only the params differ).
    exact: the contract is the same tokens on and off (False: a sampled request under the draft
    model's rejection rule, whose tokens follow the target's distribution, not its draws).
    Wave w takes the next `concurrent` prompts, cycling through the set (waves_of)."""
    def wave(mode: str, w: int) -> dict:
        at = [(w * concurrent + i) % len(prompts) for i in range(concurrent)]
        return run(engines[mode], [prompts[i] for i in at], [params[mode][i] for i in at])

    c = interleaved(f"{name} x{concurrent}", waves_of(len(prompts), concurrent), wave, repeat, progress)
    return {"case": name, "concurrent": concurrent, "identical_expected": exact, **c}


def http_case(model: str, prompts: list[str], flags: list[str], sampling: dict[str, pd.SamplingParams], repeat: int,
              progress: Progress, exact_sampled: bool) -> list[dict]:
    """The input-grounded set over HTTP, single stream, as a client sees it: two servers on loopback
    ports (plain, and speculation by `flags`), the official openai client streaming chat completions;
    tokens/s from the usage chunk over the wall time of each request. One case per sampling;
    exact_sampled: seeded outputs are expected token for token (not under a draft model's rejection rule)."""
    import tempfile

    import openai
    from serve_load import start_server

    tmp = Path(tempfile.mkdtemp())
    servers = {"off": start_server(model, 16, tmp / "off.log"),
               "on": start_server(model, 16, tmp / "on.log", flags)}
    cases = []
    try:
        clients = {m: openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0) for m, (_, url) in servers.items()}

        def one_request(mode: str, prompt: str, p: pd.SamplingParams) -> dict:
            t0 = time.perf_counter()
            stream = clients[mode].chat.completions.create(
                model="m", messages=[{"role": "user", "content": prompt}], max_tokens=p.max_tokens,
                temperature=p.temperature, seed=p.seed, stream=True, stream_options={"include_usage": True})
            parts, tokens = [], 0
            for chunk in stream:
                if chunk.choices and chunk.choices[0].delta.content:
                    parts.append(chunk.choices[0].delta.content)
                if chunk.usage is not None:
                    tokens = chunk.usage.completion_tokens
            return {"wall_s": time.perf_counter() - t0, "tokens": tokens, "outputs": ["".join(parts)]}

        for mode in servers:               # first-call costs out of the timing, and every prompt in each
            for prompt in ["Hi", *prompts]:  # server's prefix cache, as the in-process runs warm theirs
                clients[mode].chat.completions.create(model="m", messages=[{"role": "user", "content": prompt}],
                                                      max_tokens=4)
        for label, p in sampling.items():
            name = f"grounded-{label}-http"
            c = interleaved(f"{name} x1", len(prompts), lambda mode, w: one_request(mode, prompts[w], p), repeat,
                            progress)
            cases.append({"case": name, "concurrent": 1, "identical_expected": exact_sampled or p.temperature == 0,
                          **c})
    finally:
        for proc, _ in servers.values():
            proc.terminate()
            proc.wait(timeout=30)
    return cases


def over(plain: pd.Engine, checkpoint: Path, speculative: pd.SpeculativeConfig) -> pd.Engine:
    """An engine with `speculative` over the plain engine's model (the same tensors); a self-draft
    loads `checkpoint`, the plain engine's, as Engine.from_pretrained's does."""
    config = replace(plain.config, speculative=with_self_draft(speculative, checkpoint))
    return pd.Engine(plain.model, plain.tokenizer, config)


def bench(args: argparse.Namespace) -> dict:
    dtype = getattr(torch, args.dtype)
    model = smollm2_f32_gguf()
    chat = smollm2_chat(model)
    n = 5 if args.quick else 20
    sampling = {"greedy": pd.SamplingParams(max_tokens=args.max_tokens),
                "seeded": pd.SamplingParams(max_tokens=args.max_tokens, temperature=0.7, seed=11)}
    asked = {name.strip() for name in args.sampling.split(",")}
    if not asked <= set(sampling):
        raise SystemExit(f"--sampling takes greedy and / or seeded, got {args.sampling!r}")
    sampling = {name: p for name, p in sampling.items() if name in asked and not (args.quick and name == "seeded")}
    if not sampling:
        raise SystemExit("--quick runs greedy only: --sampling seeded leaves nothing to run")
    concurrency = [int(c) for c in args.concurrency.split(",")]
    only = set(args.only.split(",")) if args.only else {"grounded", "chat", "edit", "http"}
    if not args.http:
        only.discard("http")
    workloads = {"grounded": [chat(p) for p in grounded_prompts()[:n]], "chat": [chat(p) for p in CHAT[:n]]}
    plan = [(w, label, conc) for w in workloads if w in only for label in sampling for conc in concurrency]
    edit_plan = [label for label in sampling if "edit" in only]
    http_passes = len(sampling) if "http" in only else 0
    edit = edit_prompts(chat)
    def repeat(concurrent: int) -> int:
        return args.batch_repeat if concurrent > 1 and args.batch_repeat else args.repeat

    waves = (sum(repeat(conc) * waves_of(n, conc) for _, _, conc in plan)
             + args.repeat * (len(edit_plan) * len(edit) + http_passes * n))
    progress = Progress(2 * waves)
    plain = pd.Engine.from_pretrained(model, dtype=dtype, max_batch_size=16)
    # the speculating engines run over the plain engine's own loaded model (its weights' memory):
    # engines over two loads of one checkpoint differed by up to ~7 % per step with nothing
    # drafting (where each load's pages landed), which a batch case read as speculation's cost
    self_draft = pd.SpeculativeConfig(method="draft", draft_quantization=args.draft_quantization,
                                      num_tokens=args.draft_k, min_draft_confidence=args.draft_confidence,
                                      max_batch=args.draft_max_batch)
    grounded = (pd.SpeculativeConfig(method="ngram", num_tokens=args.k) if args.grounded == "ngram" else
                replace(self_draft, prompt_lookup=True))
    engines = {"grounded": over(plain, model, grounded), "chat": over(plain, model, self_draft)}
    # first-call costs out of the timing, the step-cost gates' first measurements among them (at
    # its start a speculating engine takes a few plain steps to measure against: a server pays
    # that once, not per pass)
    plain.generate([workloads["chat"][0]], pd.SamplingParams(max_tokens=4))
    for name, eng in engines.items():
        eng.generate([workloads[name][0]], pd.SamplingParams(max_tokens=args.max_tokens))
    # every prompt in every engine's prefix cache before the first pass, so that each pass hits it
    # alike: a pass that hits the cache computes a prompt's K/V in other chunks than one that does
    # not, and in bfloat16 that rounding flipped near-ties of the plain engine itself (its second
    # pass differed from its first); a cold first pass also paid prefills the others did not
    one = pd.SamplingParams(max_tokens=1)
    for eng, prompts in [(plain, workloads["grounded"] + workloads["chat"] + edit), (engines["grounded"],
                         workloads["grounded"]), (engines["chat"], workloads["chat"])]:
        for prompt in prompts:
            eng.generate([prompt], one)
    cases = []
    for name, label, conc in plan:
        p = sampling[label] if name == "chat" else replace(sampling[label], max_tokens=args.grounded_tokens)
        prompts = workloads[name]
        cases.append(case(f"{name}-{label}", {"off": plain, "on": engines[name]}, prompts,
                          {"off": [p] * len(prompts), "on": [p] * len(prompts)}, conc, repeat(conc), progress,
                          exact=not (p.temperature > 0 and (name == "chat" or args.grounded != "ngram"))))
    for label in edit_plan:
        p = replace(sampling[label], max_tokens=args.edit_tokens, stop=[EDIT_CLOSING])
        cases.append(case(f"code-edit-{label}", {"off": plain, "on": plain}, edit,
                          {"off": [p] * len(edit), "on": [replace(p, prediction=EDIT_FILE)] * len(edit)}, 1,
                          args.repeat, progress))
    if http_passes:
        flags = (["--speculative-method", "ngram", "--num-speculative-tokens", str(args.k)] if args.grounded == "ngram"
                 else ["--speculative-method", "draft", "--speculative-draft-quantization", args.draft_quantization,
                       "--num-speculative-tokens", str(args.draft_k), "--speculative-prompt-lookup",
                       "--speculative-min-draft-confidence", str(args.draft_confidence)])
        grounded_sampling = {label: replace(p, max_tokens=args.grounded_tokens) for label, p in sampling.items()}
        cases += http_case(str(model), grounded_prompts()[:n], flags, grounded_sampling, args.repeat, progress,
                           exact_sampled=args.grounded == "ngram")
    progress.bar.close()
    return {"benchmark": "speculative-real", "date": time.strftime("%Y-%m-%d %H:%M"), "model": "SmolLM2-135M-Instruct",
            "dtype": args.dtype, "k": args.k, "grounded": args.grounded, "draft_k": args.draft_k,
            "max_tokens": {"chat": args.max_tokens, "grounded": args.grounded_tokens, "code-edit": args.edit_tokens},
            "draft_quantization": args.draft_quantization,
            "machine": {"platform": platform.platform(), "cpus": os.cpu_count(),
                        "torch_threads": torch.get_num_threads()}, "cases": cases}


def draw(result: dict):
    def inner(axes):
        cases = result["cases"]
        x = range(len(cases))
        axes.bar(list(x), [c["speedup"] for c in cases])
        axes.axhline(1.0, color="gray", lw=0.8)
        axes.set_xticks(list(x), [f"{c['case']} x{c['concurrent']}" for c in cases], rotation=60, ha="right",
                        fontsize=7)
        axes.set_ylabel("tokens/s on / off")
        grounded = (f"n-gram k = {result['k']}" if result["grounded"] == "ngram" else
                    f"{result['draft_quantization']} self-draft k = {result['draft_k']} with prompt lookup")
        axes.set_title(f"speculation on SmolLM2-135M-Instruct, {result['dtype']}\ngrounded: {grounded}; chat: "
                       f"{result['draft_quantization']} self-draft; code edit: its prediction", fontsize=10)
    return inner


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="5 prompts a set, greedy only")
    ap.add_argument("--concurrency", default="1,4,16")
    ap.add_argument("--sampling", default="greedy,seeded", help="comma-separated: greedy, seeded")
    ap.add_argument("--repeat", type=int, default=2)
    # a batch case's pass is 5 waves a mode, a single stream's 20 (or the edit set's 5 long ones):
    # paired waves of one engine spread ~10 % here, so 5 pairs leave a case where nothing drafts
    # anywhere in 0.95x-1.05x, and only more passes narrow it
    ap.add_argument("--batch-repeat", type=int, default=None,
                    help="passes of each batch case (--concurrency above 1; default --repeat)")
    ap.add_argument("--k", type=int, default=4, help="n-gram draft tokens per run (the grounded sets)")
    # the draft stops where it is unsure (--draft-confidence), so k is a ceiling; 6 keeps a verify
    # under the 8 rows from which the float gemv leaves the spinning pool for OpenMP's threads
    ap.add_argument("--draft-k", type=int, default=6, help="self-draft tokens per run (the chat set)")
    ap.add_argument("--max-tokens", type=int, default=96, help="per request, the chat set")
    ap.add_argument("--grounded-tokens", type=int, default=192, help="per request, the grounded set (its answers "
                    "run to ~190 tokens)")
    ap.add_argument("--edit-tokens", type=int, default=800)
    ap.add_argument("--grounded", choices=["ngram", "lookup+draft"], default="lookup+draft",
                    help="the grounded set's speculation: n-gram (k = --k), or the self-draft backed by prompt "
                         "lookup (SpeculativeConfig(prompt_lookup=True), k = --draft-k)")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--draft-quantization", default="q4_0")
    # on CPU a q4_0 draft's rows are compute-bound (4 rows cost ~2.4x one on SmolLM2), and every
    # request's prompt goes through the draft too: with more than one stream it costs more than it saves
    ap.add_argument("--draft-max-batch", type=int, default=1,
                    help="SpeculativeConfig.max_batch of the chat set's self-draft (drafts only this many streams)")
    ap.add_argument("--draft-confidence", type=float, default=0.5,
                    help="SpeculativeConfig.min_draft_confidence of the chat set's self-draft")
    ap.add_argument("--http", action="store_true", help="also the input-grounded set over HTTP (two servers)")
    ap.add_argument("--only", default=None, help="comma-separated workloads to run: grounded, chat, edit, http "
                    "(http only with --http)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    result = bench(args)
    path = result_path("speculative-real", args.out)
    write_json(path, result)
    plot(path, draw(result), size=(12, 5))
    print(f"{'case':22} {'conc':>4} {'off tok/s':>10} {'on tok/s':>10} {'ratio':>6} {'accept':>7} {'same':>5} load")
    for c in result["cases"]:
        acc = f"{c['acceptance']:.2f}" if c["acceptance"] is not None else "-"
        same = str(c["identical_outputs"]) + ("" if c["identical_expected"] else "*")
        print(f"{c['case']:22} {c['concurrent']:4} {c['off_tokens_per_s']:10.1f} {c['on_tokens_per_s']:10.1f} "
              f"{c['speedup']:6.2f} {acc:>7} {same:>6} {min(c['load']):.1f}-{max(c['load']):.1f}")
    if not all(c["identical_expected"] for c in result["cases"]):
        print("* the rejection rule: the target's distribution, not the same draws (not compared)")
    print(f"written {path}")
    return 0 if all(c["identical_outputs"] for c in result["cases"] if c["identical_expected"]) else 1


if __name__ == "__main__":
    sys.exit(main())
