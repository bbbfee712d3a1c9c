"""`pagedecode chat` and `generate --chat`: a three-turn conversation through a pseudo-terminal
(pexpect), each reply checked against the engine's own greedy reply to the whole history; /reset;
Ctrl-C stopping a reply (a real SIGINT) while the program goes on; the context limit."""
import io
import os
import signal
import sys

import pytest

from pagedecode import cli
from pagedecode.terminal_chat import Conversation, chat_loop, load_chat_template, render_ids

# stories260k has no chat template: this one turns a conversation into one story, so that every
# reply depends on the whole history
TEMPLATE = ("{{ bos_token }}{% for m in messages %}{{ m['content'] }}{% if m['role'] == 'assistant' %}{{ eos_token }}"
            "{% endif %} {% endfor %}")
TURNS = ["Once upon a time, there was a girl.", "She had a red ball.", "One day the ball rolled away."]


@pytest.fixture
def template_file(tmp_path):
    f = tmp_path / "story.jinja"
    f.write_text(TEMPLATE)
    return f


def expected_replies(stories_path, template_file, turns, max_tokens, system=None):
    """What each turn must print: the engine's greedy reply to the whole conversation so far."""
    import pagedecode as pd
    engine = pd.Engine.from_pretrained(stories_path)
    template = load_chat_template(stories_path, template_file)
    conv, replies = Conversation(system), []
    for turn in turns:
        conv.turns.append({"role": "user", "content": turn})
        ids = render_ids(engine.tokenizer, template, conv.messages())
        text = engine.generate([ids], pd.SamplingParams(max_tokens=max_tokens, temperature=0))[0].text
        conv.turns.append({"role": "assistant", "content": text})
        replies.append(text)
    return replies


def spawn_chat(stories_path, template_file, *extra):
    pexpect = pytest.importorskip("pexpect")
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    child = pexpect.spawn(sys.executable, ["-m", "pagedecode.cli", "chat", "--model", str(stories_path),
                                           "--chat-template", str(template_file), "--max-tokens", "12", *extra],
                          env=env, encoding="utf-8", timeout=120)
    child.expect_exact("> ")
    return child


def test_three_turns_through_a_pty_keep_the_history(stories_path, template_file):
    want = expected_replies(stories_path, template_file, TURNS, 12)
    # the third reply differs from the reply to its message alone: the history is what made it
    alone = expected_replies(stories_path, template_file, TURNS[2:], 12)
    assert alone[0] != want[2]
    child = spawn_chat(stories_path, template_file)
    for turn, reply in zip(TURNS, want):
        child.sendline(turn)
        child.expect_exact(turn)                 # the terminal's echo
        child.expect_exact("> ")
        assert reply.strip() and reply.strip() in child.before.replace("\r\n", "\n")
    child.sendline("/reset")
    child.expect_exact("[conversation reset]")
    child.expect_exact("> ")
    child.sendline(TURNS[2])
    child.expect_exact(TURNS[2])
    child.expect_exact("> ")
    assert alone[0].strip() in child.before.replace("\r\n", "\n")       # no history after /reset
    child.sendeof()
    child.expect(__import__("pexpect").EOF)
    child.close()
    assert child.exitstatus == 0


def test_exit_command_and_system_prompt(stories_path, template_file):
    want = expected_replies(stories_path, template_file, TURNS[:1], 12, system="A tale.")
    child = spawn_chat(stories_path, template_file, "--system", "A tale.")
    child.sendline(TURNS[0])
    child.expect_exact(TURNS[0])
    child.expect_exact("> ")
    assert want[0].strip() in child.before.replace("\r\n", "\n")
    child.sendline("/exit")
    child.expect(__import__("pexpect").EOF)
    child.close()
    assert child.exitstatus == 0


def scripted(lines):
    """A read_line that answers the given lines, then end of input."""
    it = iter(lines)

    def read(prompt):
        try:
            return next(it)
        except StopIteration:
            raise EOFError from None
    return read


def test_ctrl_c_stops_the_reply_not_the_program(stories_path, template_file, monkeypatch):
    """A real SIGINT in the middle of a reply: the reply ends (cancelled) with the text shown so
    far kept in the history, and the next turn is served by the same engine."""
    import pagedecode as pd
    from pagedecode.runtime.engine import Engine
    engine = pd.Engine.from_pretrained(stories_path)
    template = load_chat_template(stories_path, template_file)
    real, calls = Engine.step, {"n": 0}

    def step(self):
        calls["n"] += 1
        if calls["n"] == 5:
            os.kill(os.getpid(), signal.SIGINT)
        return real(self)
    monkeypatch.setattr(Engine, "step", step)
    conv, out, err = Conversation(), io.StringIO(), io.StringIO()
    params = pd.SamplingParams(max_tokens=200, temperature=0, ignore_eos=True)
    assert chat_loop(engine, template, params, conv, scripted(TURNS[:2]), out, err) == 0
    assert err.getvalue().count("[stopped]") == 1
    first = conv.turns[1]["content"]
    assert conv.turns[0]["content"] == TURNS[0] and 0 < len(engine.tokenizer.encode(first, False)) < 20
    assert len(conv.turns) == 4 and conv.turns[3]["content"]        # the second turn ran to its end
    assert not engine.has_unfinished()
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler      # restored


def test_a_history_past_the_context_is_refused_with_a_message(stories_path, template_file):
    import pagedecode as pd
    engine = pd.Engine.from_pretrained(stories_path, max_context=64)
    template = load_chat_template(stories_path, template_file)
    conv, out, err = Conversation(), io.StringIO(), io.StringIO()
    long_turn = "the dog ran " * 30
    assert chat_loop(engine, template, pd.SamplingParams(max_tokens=8, temperature=0), conv,
                     scripted([long_turn, "/reset", TURNS[0]]), out, err) == 0
    assert "the context holds 64: /reset to start over" in err.getvalue()
    assert [t["content"] for t in conv.turns][:1] == [TURNS[0]] and len(conv.turns) == 2


def test_a_reply_reaching_the_context_says_so(stories_path, template_file):
    import pagedecode as pd
    engine = pd.Engine.from_pretrained(stories_path, max_context=48)
    template = load_chat_template(stories_path, template_file)
    err = io.StringIO()
    chat_loop(engine, template, pd.SamplingParams(max_tokens=500, temperature=0, ignore_eos=True), Conversation(),
              scripted([TURNS[0]]), io.StringIO(), err)
    assert "[the reply reached the end of the context (48 tokens)" in err.getvalue()


def test_generate_chat_renders_the_prompt_through_the_template(stories_path, template_file, capsys):
    want = expected_replies(stories_path, template_file, TURNS[:1], 10, system="A tale.")
    assert cli.main(["generate", "--model", str(stories_path), "--prompt", TURNS[0], "--chat", "--system", "A tale.",
                     "--chat-template", str(template_file), "--max-tokens", "10"]) == 0
    assert capsys.readouterr().out.strip() == want[0].strip()


def test_no_template_is_one_clear_line(stories_path, capsys):
    assert cli.main(["chat", "--model", str(stories_path)]) == 2
    assert "has no chat template; give one with --chat-template FILE" in capsys.readouterr().err


def test_a_turn_the_template_refuses_is_dropped_with_a_message(stories_path, tmp_path):
    import pagedecode as pd
    f = tmp_path / "short.jinja"
    f.write_text("{% if messages | length > 1 %}{{ raise_exception('one message only') }}{% endif %}"
                 "{{ bos_token }}{{ messages[0]['content'] }}")
    engine = pd.Engine.from_pretrained(stories_path)
    conv, err = Conversation(), io.StringIO()
    assert chat_loop(engine, load_chat_template(stories_path, f), pd.SamplingParams(max_tokens=4, temperature=0),
                     conv, scripted([TURNS[0], TURNS[1], "/reset", TURNS[1]]), io.StringIO(), err) == 0
    assert "the chat template refused these messages: one message only" in err.getvalue()
    assert [t["role"] for t in conv.turns] == ["user", "assistant"] and conv.turns[0]["content"] == TURNS[1]
