"""The draft model's own cache (runtime/spec/draft_model.py): the K/V it wrote for its drafts is
kept where the target accepted them, so a proposal after a run recomputes one or two rows, not
the whole run; the scripted draft checks on every forward that its cache holds the tokens it
should (a reused row that were not the request's token would fail it, and speculation with it)."""
import pytest

import pagedecode as pd
from pagedecode.testing import ScriptedModel

from .helpers import EOS, engine, run

CYCLE = [5, 6, 101, 102, 103]


def cycle(prompt, output):
    """The next token of a fixed cycle after the last known token."""
    last = (prompt + output)[-1]
    return CYCLE[(CYCLE.index(last) + 1) % len(CYCLE)] if last in CYCLE else CYCLE[0]


def wrong_every_fourth(prompt, output):
    """The cycle, except at every fourth output position (then a token the target never picks)."""
    return 104 if len(output) % 4 == 3 else cycle(prompt, output)


@pytest.mark.parametrize("draft_script, most_rows", [(cycle, 2), (wrong_every_fourth, 2)])
def test_a_proposal_recomputes_only_what_its_drafts_did_not_write(draft_script, most_rows):
    """k = 3: a run kept whole leaves d1 d2 in the draft's cache, so the next proposal computes
    d3 and the token after it (2 rows; it computed 4 before); a run cut short leaves the kept
    drafts and computes the token after them (1 row). The output is the plain engine's."""
    calls = []                             # rows of each draft forward, None where a proposal starts
    draft = ScriptedModel(draft_script, vocab_size=200, eos_token_ids=[EOS],
                          on_forward=lambda info: calls.append(info["batch"].input_ids.numel()))
    config = pd.SpeculativeConfig(method="draft", draft_model=draft, num_tokens=3, min_acceptance=0.0, min_gain=0.0)
    params = pd.SamplingParams(max_tokens=40)
    want = engine(cycle).generate([[1, 5]], params)[0].token_ids
    eng = engine(cycle, speculative=config)
    proposer = eng.speculator.draft
    propose = proposer.propose
    proposer.propose = lambda wants: calls.append(None) or propose(wants)
    rid = eng.add_request([1, 5], params)
    run(eng)
    got = eng.result(rid)
    first_rows = [calls[i + 1] for i, c in enumerate(calls) if c is None]
    assert got.token_ids == want
    assert got.usage.accepted_draft_tokens > 10                  # the draft's cache checks passed: it drafted
    assert first_rows[0] == 3 and max(first_rows[1:]) <= most_rows   # prompt and y1, then one or two rows
    assert len(first_rows) > 8
