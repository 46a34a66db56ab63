"""Chat-template rendering is bounded: a hostile template (huge loops, exponential macros,
giant strings or numbers, unbounded output) stops with a 400-worthy RenderLimitExceeded, the
server answers 400 at its time limit even when the render cannot be interrupted, and it keeps
serving. No timed assertions: the limits are set tiny and the tests assert what comes back."""
import threading

import pytest
from starlette.testclient import TestClient

from radixserve.server.app import create_app
from radixserve.tokenizer.chat_template import ChatTemplate, RenderLimitExceeded, RenderLimits

from test_server_fake_engine import LOCAL, FakeEngine, FakeTokenizer

CHAT = [{"role": "user", "content": "hi"}]
TINY = RenderLimits(max_seconds=0.2, max_chars=10_000)

LOOP = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"
HOSTILE = {
    "nested range loops": (LOOP, "took longer than 0.2 s"),
    "loops over the messages": ("{% for a in messages %}{% for i in range(100000) %}{% for b in "
                                "messages %}{% for c in range(100000) %}{% endfor %}{% endfor %}"
                                "{% endfor %}{% endfor %}", "took longer than 0.2 s"),
    "exponential macro": ("{% macro f(n) %}{% if n %}{{ f(n - 1) }}{{ f(n - 1) }}{% endif %}"
                          "{% endmacro %}{{ f(60) }}", "took longer than 0.2 s"),
    "unbounded output": ("{% for i in range(100000) %}{{ messages[0].content * 50 }}{% endfor %}",
                         "more than 10000 characters"),
    "giant string": ("{{ 'x' * 10 ** 12 }}", "more than 10000"),
    "giant number": ("{{ 10 ** 1000000000 }}", "bits"),
    "doubling namespace": ("{% set ns = namespace(s='xx') %}{% for i in range(64) %}"
                           "{% set ns.s = ns.s ~ ns.s %}{% endfor %}", "more than"),
    "infinite recursion": ("{% macro f() %}{{ f() }}{% endmacro %}{{ f() }}", "recursed too deeply"),
}


@pytest.mark.parametrize("name", sorted(HOSTILE))
def test_hostile_templates_stop_at_their_limits(name):
    source, words = HOSTILE[name]
    with pytest.raises(ValueError) as info:
        ChatTemplate(source).render(CHAT, render_limits=TINY)
    assert words in str(info.value), str(info.value)


def test_limits_leave_ordinary_templates_alone():
    """range, the message list and filters over them behave as in plain jinja."""
    t = ChatTemplate("{% for m in messages %}{{ m.role }}={{ m.content }};{% endfor %}"
                     "{{ range(3)|list }}{{ range(5)|length }}{{ range(10)[2] }}{{ range(6)[1:3]|list }}"
                     "{{ messages|length }}{{ messages|tojson }}{{ 'ab' * 2 }}{{ 2 ** 10 }}")
    out = t.render(CHAT + [{"role": "assistant", "content": "yo"}], render_limits=TINY)
    assert out == ('user=hi;assistant=yo;[0, 1, 2]52[1, 2]2'
                   '[{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]abab1024')
    with pytest.raises(RenderLimitExceeded):
        t.render([{"role": "user", "content": "x" * 20_000}], render_limits=TINY)


class TemplateTokenizer(FakeTokenizer):
    """The fake byte tokenizer rendering chats with a real ChatTemplate that loops forever
    when a message says LOOP, and blocks (beyond any check point) when one says BLOCK."""

    def __init__(self):
        self.template = ChatTemplate("{% if messages[0].content == 'LOOP' %}" + LOOP + "{% endif %}"
                                     "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}")
        self.release = threading.Event()

    def apply_chat_template(self, messages, add_generation_prompt=True, tools=None,
                            render_limits=None):
        if messages[0]["content"] == "BLOCK":
            self.release.wait(60)
        text = self.template.render(messages, add_generation_prompt, tools,
                                    render_limits=render_limits)
        return text + ("<assistant>" if add_generation_prompt else "")


@pytest.fixture
def template_client():
    engine = FakeEngine()
    engine.tokenizer = TemplateTokenizer()
    engine.server_args.chat_template_timeout = 0.2
    with TestClient(create_app(engine), base_url=LOCAL, raise_server_exceptions=False) as client:
        yield engine, client
    engine.tokenizer.release.set()


@pytest.mark.parametrize("content", ["LOOP", "BLOCK"])
def test_server_answers_400_past_the_template_limit_and_keeps_serving(template_client, content):
    engine, client = template_client
    r = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": content}],
                                                  "max_tokens": 2})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "messages"
    assert "the chat template took longer than 0.2 s" in err["message"]
    engine.tokenizer.release.set()
    assert client.get("/health").status_code == 200
    ok = client.post("/v1/chat/completions", json={"messages": CHAT, "max_tokens": 2})
    assert ok.status_code == 200 and ok.json()["choices"][0]["message"]["content"] == "Pa"
    assert engine.seen and all(bytes(r.input_ids).startswith(b"<user>hi") for r in engine.seen)
