"""The HTTP judge against real local HTTP servers (stdlib, loopback, in a thread): retries on
5xx, no retry on 4xx, a server that never answers gives `invalid` verdicts counted, not a hang;
token usage summed; the request is an OpenAI chat completion."""
from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from tasks.config.params import JudgeParams
from tasks.data.records import Message
from tasks.judging.judge_factory import make_judge
from tasks.judging.judge_http import Endpoint, HttpBackend, endpoint_from_env
from tasks.judging.judges import judge_pairs
from tasks.judging.pairwise import JudgeStats

ROOT = Path(__file__).resolve().parents[1]
PROMPT = (Message("user", "Write a short review of Jaws."),)


def completion(content: str) -> dict:
    return {"id": "x", "object": "chat.completion", "model": "m",
            "choices": [{"index": 0, "message": {"role": "assistant", "content": content},
                         "finish_reason": "stop"}],
            "usage": {"prompt_tokens": 7, "completion_tokens": 1, "total_tokens": 8}}


class Script:
    """What the server does with each request: a list of (status, body) or "hang"."""

    def __init__(self, steps: list, default: object = (200, completion("A"))):
        self.steps, self.default, self.bodies = list(steps), default, []
        self.lock = threading.Lock()

    def next(self, body: dict) -> object:
        with self.lock:
            return self.steps.pop(0) if self.steps else self.default


@pytest.fixture
def server() -> Iterator:
    servers = []

    def start(script: Script) -> str:
        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:      # noqa: N802
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                script.bodies.append((self.path, body, self.headers.get("Authorization")))
                step = script.next(body)
                if step == "hang":
                    time.sleep(3)           # longer than the client's timeout
                    return
                status, payload = step      # type: ignore[misc]
                data = json.dumps(payload).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args: object) -> None:
                pass
        srv = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        srv.daemon_threads = True
        threading.Thread(target=srv.serve_forever, daemon=True).start()
        servers.append(srv)
        return f"http://127.0.0.1:{srv.server_address[1]}/v1"
    yield start
    for srv in servers:
        srv.shutdown()
        srv.server_close()


def backend(url: str, **kw: object) -> HttpBackend:
    opts = {"model": "judge-m", "max_tokens": 4, "concurrency": 2, "timeout_s": 0.5,
            "max_retries": 3, "backoff_s": 0.01, **kw}
    return HttpBackend(Endpoint(url, "sk-test"), **opts)  # type: ignore[arg-type]


def test_500_twice_then_200_is_retried(server) -> None:
    script = Script([(500, {"error": "boom"}), (503, {"error": "busy"})],
                    default=(200, completion("B")))
    stats = JudgeStats()
    [reply] = backend(server(script)).ask_many(["judge this"], stats)
    assert (reply.verdict, reply.answered, reply.text) == ("B", True, "B")
    assert (stats.requests, stats.retries, stats.failed) == (3, 2, 0)
    assert (stats.prompt_tokens, stats.completion_tokens) == (7, 1)
    path, body, auth = script.bodies[-1]
    assert path == "/v1/chat/completions" and auth == "Bearer sk-test"
    assert body == {"model": "judge-m", "messages": [{"role": "user", "content": "judge this"}],
                    "temperature": 0.0, "max_tokens": 4, "stream": False}


def test_429_is_retried_and_exhausted_retries_are_invalid(server) -> None:
    script = Script([], default=(429, {"error": "slow down"}))
    stats = JudgeStats()
    [reply] = backend(server(script), max_retries=2).ask_many(["x"], stats)
    assert (reply.verdict, reply.answered) == ("invalid", False)
    assert (stats.requests, stats.retries) == (3, 2)


def test_4xx_is_not_retried(server) -> None:
    script = Script([], default=(401, {"error": "bad key"}))
    stats = JudgeStats()
    [reply] = backend(server(script)).ask_many(["x"], stats)
    assert (reply.verdict, reply.answered, reply.text) == ("invalid", False, "HTTP 401")
    assert (stats.requests, stats.retries) == (1, 0)


def test_a_server_that_never_answers_gives_counted_invalid_verdicts(server) -> None:
    script = Script([], default="hang")
    stats = JudgeStats()
    start = time.monotonic()
    replies = backend(server(script), timeout_s=0.2, max_retries=1, concurrency=4).ask_many(
        ["a", "b", "c", "d"], stats)
    assert time.monotonic() - start < 2.5         # 2 attempts of 0.2 s each, 4 in parallel
    assert [r.verdict for r in replies] == ["invalid"] * 4 and not any(r.answered for r in replies)
    assert (stats.requests, stats.timeouts, stats.retries) == (8, 8, 4)


def test_refused_connection_is_invalid_at_once() -> None:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]                   # closed again: nothing listens there
    stats = JudgeStats()
    [reply] = backend(f"http://127.0.0.1:{port}/v1").ask_many(["x"], stats)
    assert (reply.verdict, reply.answered, stats.requests) == ("invalid", False, 1)


def test_http_judge_end_to_end_with_cache(server, tmp_path: Path,
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """make_judge(kind: http) from params and env: both orders, unparsable replies invalid,
    usage summed, verdicts cached in the workspace; a second judge asks nothing."""
    def reply_for(body: dict) -> str:
        text = body["messages"][0]["content"]
        a = text.split("Response A:\n")[1].split("\n")[0]
        return "A" if "good" in a else "B"

    class Echo(Script):
        def next(self, body: dict) -> object:
            return (200, completion(reply_for(body)))
    script = Echo([])
    monkeypatch.setenv("ALIGNLOOP_JUDGE_URL", server(script))
    monkeypatch.delenv("OPENAI_BASE_URL", raising=False)
    (tmp_path / "params" / "judges").mkdir(parents=True)
    (tmp_path / "params" / "judges" / "pairwise_review.txt").write_bytes(
        (ROOT / "params" / "judges" / "pairwise_review.txt").read_bytes())
    jp = JudgeParams(kind="http", model="judge-m", max_concurrency=2, timeout_s=5)
    judge = make_judge(jp, tmp_path)
    items = [(PROMPT, "good film", "bad film"), (PROMPT, "bad film", "good film")]
    assert [v for v, _, _ in judge_pairs(judge, items)] == ["A", "B"]
    stats = judge.stats  # type: ignore[attr-defined]
    # the two items are one pair in both orders: 2 distinct requests, each asked once
    assert (stats.comparisons, stats.requests, stats.prompt_tokens, stats.cache_misses) == \
        (4, 2, 14, 2)
    assert judge.version.startswith("judge-m|template=")
    assert list((tmp_path / ".alignloop" / "judge-cache").glob("*.sqlite"))
    again = make_judge(jp, tmp_path)
    assert [v for v, _, _ in judge_pairs(again, items)] == ["A", "B"]
    assert (again.stats.requests, again.stats.cache_hits) == (0, 4)  # type: ignore[attr-defined]
    assert len(script.bodies) == 2


def test_endpoint_from_env_prefers_our_names() -> None:
    env = {"OPENAI_BASE_URL": "http://o/v1", "OPENAI_API_KEY": "k1",
           "ALIGNLOOP_JUDGE_URL": "http://a/v1"}
    assert endpoint_from_env(env) == Endpoint("http://a/v1", "k1")
    assert endpoint_from_env({"OPENAI_BASE_URL": "http://o/v1"}) == Endpoint("http://o/v1")
    assert Endpoint("http://a/v1/").chat_url == "http://a/v1/chat/completions"


def test_served_model_names_the_judge_when_judge_model_is_empty(server) -> None:
    from tasks.core.errors import InputError
    from tasks.judging.judge_http import served_model

    class Models(BaseHTTPRequestHandler):
        def do_GET(self) -> None:      # noqa: N802
            data = json.dumps({"object": "list", "data": [{"id": "/models/judge"}]}).encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *args: object) -> None:
            pass
    srv = ThreadingHTTPServer(("127.0.0.1", 0), Models)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        assert served_model(Endpoint(f"http://127.0.0.1:{srv.server_address[1]}/v1")) == \
            "/models/judge"
    finally:
        srv.shutdown()
        srv.server_close()
    with pytest.raises(InputError, match="cannot read the served model's name"):
        served_model(Endpoint("http://127.0.0.1:9/v1"), timeout_s=1)
