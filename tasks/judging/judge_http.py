"""The `http` judge's backend: any OpenAI-compatible `/v1/chat/completions` endpoint (vLLM,
llama.cpp's server, Ollama, TGI, `transformers serve`, a hosted API).

Where it is, is the machine's business, not the experiment's: the base URL comes from
ALIGNLOOP_JUDGE_URL or OPENAI_BASE_URL (e.g. http://127.0.0.1:8000/v1), the key from
ALIGNLOOP_JUDGE_KEY or OPENAI_API_KEY; neither is a DVC param. Requests run in a bounded pool
of threads, each with a timeout; 429, 5xx and timeouts are retried with exponential backoff,
anything else is not; a request still failing after the retries is an `invalid` verdict,
counted, never a guess.
"""
from __future__ import annotations

import json
import os
import socket
import time
import urllib.error
import urllib.request
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from tasks.core.errors import InputError
from tasks.judging.pairwise import JudgeStats, Reply, parse_verdict

URL_ENVS = ("ALIGNLOOP_JUDGE_URL", "OPENAI_BASE_URL")
KEY_ENVS = ("ALIGNLOOP_JUDGE_KEY", "OPENAI_API_KEY")
MAX_BACKOFF_S = 30.0


@dataclass(frozen=True)
class Endpoint:
    base_url: str
    api_key: str | None = None

    @property
    def chat_url(self) -> str:
        return self.base_url.rstrip("/") + "/chat/completions"

    def headers(self) -> dict[str, str]:
        h = {"Content-Type": "application/json"}
        if self.api_key:
            h["Authorization"] = f"Bearer {self.api_key}"
        return h


def served_model(endpoint: Endpoint, timeout_s: float = 30.0) -> str:
    """The first model id the server lists at /v1/models (a server pinned to one model, as
    `transformers serve DIR` or llama.cpp's, lists just that one)."""
    url = endpoint.base_url.rstrip("/") + "/models"
    try:
        req = urllib.request.Request(url, headers=endpoint.headers())
        with urllib.request.urlopen(req, timeout=timeout_s) as r:
            return str(json.loads(r.read())["data"][0]["id"])
    except (OSError, ValueError, KeyError, IndexError, TypeError) as e:
        raise InputError(f"{url}: cannot read the served model's name ({type(e).__name__}: "
                         f"{e}); is the judge server up? Or set judge.model") from None


def endpoint_from_env(env: Mapping[str, str] | None = None) -> Endpoint:
    env = os.environ if env is None else env
    url = next((env[k] for k in URL_ENVS if env.get(k)), None)
    if not url:
        raise InputError("judge.kind is http but no endpoint is set: export ALIGNLOOP_JUDGE_URL "
                         "(or OPENAI_BASE_URL), e.g. http://127.0.0.1:8000/v1 (`alignloop "
                         "judge-server start` runs one locally)")
    return Endpoint(url, next((env[k] for k in KEY_ENVS if env.get(k)), None))


def _timed_out(e: BaseException) -> bool:
    reason = getattr(e, "reason", e)
    return isinstance(e, (TimeoutError, socket.timeout)) or \
        isinstance(reason, (TimeoutError, socket.timeout))


class HttpBackend:
    def __init__(self, endpoint: Endpoint, model: str, max_tokens: int, concurrency: int,
                 timeout_s: float, max_retries: int, backoff_s: float):
        self.endpoint, self.model, self.max_tokens = endpoint, model, max_tokens
        self.concurrency, self.timeout_s = concurrency, timeout_s
        self.max_retries, self.backoff_s = max_retries, backoff_s

    def ask_many(self, texts: Sequence[str], stats: JudgeStats) -> list[Reply]:
        with ThreadPoolExecutor(max_workers=self.concurrency,
                                thread_name_prefix="judge-http") as pool:
            return list(pool.map(lambda t: self.ask(t, stats), texts))

    def _request(self, text: str) -> urllib.request.Request:
        body = {"model": self.model, "messages": [{"role": "user", "content": text}],
                "temperature": 0.0, "max_tokens": self.max_tokens, "stream": False}
        return urllib.request.Request(self.endpoint.chat_url, json.dumps(body).encode(),
                                      self.endpoint.headers(), method="POST")

    def ask(self, text: str, stats: JudgeStats) -> Reply:
        """One comparison: retried on 429/5xx/timeouts, `invalid` (unanswered) after that."""
        for attempt in range(self.max_retries + 1):
            if attempt:
                stats.add(retries=1)
                time.sleep(min(self.backoff_s * 2 ** (attempt - 1), MAX_BACKOFF_S))
            stats.add(requests=1)
            try:
                with urllib.request.urlopen(self._request(text), timeout=self.timeout_s) as r:
                    data = json.loads(r.read())
            except urllib.error.HTTPError as e:
                if e.code == 429 or e.code >= 500:
                    continue
                return Reply("invalid", f"HTTP {e.code}", answered=False)
            except (urllib.error.URLError, OSError) as e:
                if _timed_out(e):
                    stats.add(timeouts=1)
                    continue
                return Reply("invalid", f"{type(e).__name__}: {e}", answered=False)
            except ValueError:                      # a 200 whose body is not JSON
                return Reply("invalid", "reply is not JSON", answered=False)
            return _reply(data, stats)
        return Reply("invalid", "no reply after retries", answered=False)


def _reply(data: object, stats: JudgeStats) -> Reply:
    try:
        content = data["choices"][0]["message"]["content"] or ""   # type: ignore[index]
    except (KeyError, IndexError, TypeError):
        return Reply("invalid", json.dumps(data)[:200], answered=False)
    usage = data.get("usage") or {} if isinstance(data, dict) else {}
    pt, ct = int(usage.get("prompt_tokens") or 0), int(usage.get("completion_tokens") or 0)
    stats.add(prompt_tokens=pt, completion_tokens=ct)
    return Reply(parse_verdict(content), content, True, pt, ct)
