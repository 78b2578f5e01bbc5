"""Pairwise LLM judges: the strict parser on canned replies, the template, both orders at once,
position bias, seeded pairs, the verdict cache (resume, rerun for free), the identity."""
from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import pytest

from tasks.config.params import JudgeParams
from tasks.data.records import Message, Prompt
from tasks.judging.judge_factory import make_judge
from tasks.judging.judges import judge_pair, judge_pairs, swapped
from tasks.judging.labelling import judge_all, pairwise_groups, seeded_pairs
from tasks.judging.pairwise import (
    JudgeStats,
    PairwiseLLMJudge,
    Reply,
    Template,
    load_template,
    parse_verdict,
)
from tasks.judging.verdict_cache import VerdictCache, cache_key

ROOT = Path(__file__).resolve().parents[1]
PROMPT: Prompt = (Message("system", "You are helpful."),
                  Message("user", "Write a short review of Jaws."))
TEMPLATE = Template("Q: {prompt}\n[A] {first}\n[B] {second}\nVerdict:", "abc123", "t.txt")


# --- the strict parser ------------------------------------------------------------------------

@pytest.mark.parametrize("reply, verdict", [
    ("A", "A"), ("B", "B"), ("tie", "tie"), ("Tie", "tie"), ("TIE", "tie"),
    (" a ", "A"), ("b.", "B"), ("**A**", "A"), ("'B'", "B"), ("[[A]]", "A"), ("(B)", "B"),
    ("Verdict: A", "A"), ("Answer: [[B]]", "B"), ("answer - tie", "tie"), ("Winner: B.", "B"),
    ("A\nBecause it names the film.", "A"), ("\n\n  B  \n", "B"),
    ("", "invalid"), ("   ", "invalid"), ("A because it names the film", "invalid"),
    ("A or B", "invalid"), ("Both", "invalid"), ("C", "invalid"), ("AB", "invalid"),
    ("Response A", "invalid"), ("I think A", "invalid"), ("A.B", "invalid"),
])
def test_parser_on_canned_replies(reply: str, verdict: str) -> None:
    assert parse_verdict(reply) == verdict


def test_template_renders_slots_once_and_literally() -> None:
    text = TEMPLATE.render(PROMPT, "it has {second} in it", "plain")
    assert text == "Q: Write a short review of Jaws.\n[A] it has {second} in it\n[B] plain\nVerdict:"


def test_shipped_template_loads_and_its_md5_is_the_file_md5() -> None:
    import hashlib
    t = load_template(ROOT, "params/judges/pairwise_review.txt")
    assert t.md5 == hashlib.md5((ROOT / t.path).read_bytes()).hexdigest()
    assert "Jaws" in t.render(PROMPT, "x", "y")


def test_template_without_a_slot_is_refused(tmp_path: Path) -> None:
    from tasks.core.errors import InputError
    (tmp_path / "t.txt").write_text("{prompt} {first}")
    with pytest.raises(InputError, match=r"t.txt: judge template lacks the slot\(s\) \{second\}"):
        load_template(tmp_path, "t.txt")


# --- a scripted backend -----------------------------------------------------------------------

class ScriptedBackend:
    """Replies from a rule on the rendered text; counts what it was asked."""

    def __init__(self, rule):
        self.rule, self.asked = rule, []

    def ask_many(self, texts: Sequence[str], stats: JudgeStats) -> list[Reply]:
        self.asked += list(texts)
        stats.add(requests=len(texts), prompt_tokens=10 * len(texts), completion_tokens=len(texts))
        return [self.rule(t) for t in texts]


def first_of(text: str) -> str:
    return text.split("[A] ")[1].split("\n")[0]


def prefers(word: str):
    """Prefers the response containing `word`; position-biased ("A") when neither does."""
    def rule(text: str) -> Reply:
        a, b = first_of(text), text.split("[B] ")[1].split("\n")[0]
        if word in a and word not in b:
            return Reply("A", "A")
        if word in b and word not in a:
            return Reply("B", "B")
        return Reply("A", "A")
    return rule


def judge_with(rule, cache: VerdictCache | None = None, batch: int = 64) -> PairwiseLLMJudge:
    return PairwiseLLMJudge("scripted", "m", "greedy", TEMPLATE, ScriptedBackend(rule), cache,
                            batch)


def test_identity_is_model_template_md5_and_decoding() -> None:
    judge = judge_with(prefers("good"))
    assert judge.version == "m|template=abc123|greedy"


def test_swap_exact_values() -> None:
    assert [swapped(f, r) for f, r in [("A", "B"), ("B", "A"), ("A", "A"), ("B", "B"),
                                        ("tie", "tie"), ("A", "tie"), ("A", "invalid"),
                                        ("invalid", "B")]] == \
        ["A", "B", "tie", "tie", "tie", "tie", "invalid", "invalid"]


def test_both_orders_in_one_batch_and_position_bias_shows() -> None:
    judge = judge_with(prefers("good"))
    items = [(PROMPT, "good film", "bad film"), (PROMPT, "bad film", "good film"),
             (PROMPT, "meh", "so-so")]
    out = judge_pairs(judge, items)
    assert out == [("A", "A", "B"), ("B", "B", "A"), ("tie", "A", "A")]   # last: biased
    asked = [first_of(t) for t in judge.backend.asked]   # type: ignore[attr-defined]
    # items 1 and 2 are one pair in both orders: each distinct order is asked once
    assert asked == ["good film", "bad film", "meh", "so-so"]
    assert judge_pair(judge, PROMPT, "good film", "bad film") == "A"      # same swap logic


def test_invalid_reply_is_counted_and_wins() -> None:
    judge = judge_with(lambda t: Reply(parse_verdict("A because"), "A because"))
    assert judge_pairs(judge, [(PROMPT, "x", "y")]) == [("invalid", "invalid", "invalid")]
    assert judge.stats.unparsed == 2 and judge.stats.failed == 0


def test_seeded_pairs_are_fixed_distinct_and_skip_equal_texts() -> None:
    responses = ["a", "b", "c", "d"]
    first = seeded_pairs("p1", responses, 3)
    assert first == seeded_pairs("p1", responses, 3) and len(set(first)) == 3
    assert all(i < j for i, j in first)
    assert seeded_pairs("p1", responses, 99) == seeded_pairs("p1", responses, 6)
    assert len(seeded_pairs("p1", responses, 99)) == 6
    assert seeded_pairs("p1", ["a", "a", "b"], 9) == [(0, 2), (1, 2)] or \
        sorted(seeded_pairs("p1", ["a", "a", "b"], 9)) == [(0, 2), (1, 2)]


def test_pairwise_groups_pairs_and_metrics() -> None:
    judge = judge_with(prefers("good"))
    jp = JudgeParams(kind="http", model="m", comparisons_per_prompt=6, pairs_per_prompt=1,
                     pool_pairs="all")
    groups = [(PROMPT, ["good one", "bad one", "good two", "meh"], {"prompt_id": "p1"}),
              (PROMPT, ["x", "y"], {"prompt_id": "p2"})]
    pairs, pool, m = pairwise_groups(judge, groups, "iter_1", jp)
    # p1: 6 comparisons, the 4 good-vs-other ones are clear, good-vs-good and bad-vs-meh tie
    assert m["judge/n"] == 7 and m["judge/n_tie"] == 3 and m["judge/n_A"] + m["judge/n_B"] == 4
    assert len(pool) == 4 and all("good" in p.chosen and "good" not in p.rejected for p in pool)
    assert len(pairs) == 1 and pairs[0].meta["pair_rank"] == 0
    assert pairs[0].meta["judge"] == "scripted:m|template=abc123|greedy"
    assert pairs[0].meta["prompt_id"] == "p1" and pairs[0].source == "iter_1"
    assert m["judge/position_bias_rate"] == pytest.approx(3 / 7)
    assert m["judge/requests"] == 14 and m["judge/tokens"] == 14 * 11
    assert m["judge/cache_misses"] == 14 and m["judge/cache_hits"] == 0
    assert "judge/lexicon_agreement" in m and m["judge/n_pool_pairs"] == 4
    ranked = pairwise_groups(judge_with(prefers("good")), groups, "s",
                             JudgeParams(kind="http", model="m", comparisons_per_prompt=6,
                                         pairs_per_prompt=2))[1]
    assert len(ranked) == 2 and len({ranked[0].chosen, ranked[0].rejected,
                                     ranked[1].chosen, ranked[1].rejected}) == 4   # disjoint


def test_judge_all_keeps_the_pointwise_path() -> None:
    from tasks.judging.labelling import judge_groups, pool_margin
    lex = make_judge(JudgeParams(kind="lexicon"))
    groups = [(PROMPT, ["A wonderful film.", "An awful film.", "A film."], {"prompt_id": "p"})]
    jp = JudgeParams(kind="lexicon", pool_pairs="all")
    assert judge_all(lex, groups, "s", jp) == judge_groups(lex, groups, "s", 1, pool_margin(jp))


# --- the verdict cache ------------------------------------------------------------------------

def test_cache_resumes_a_killed_run_and_a_rerun_pays_nothing(tmp_path: Path) -> None:
    items = [(PROMPT, f"good {i}", f"bad {i}") for i in range(10)]
    calls = {"n": 0}

    def dies_after_8(text: str) -> Reply:
        calls["n"] += 1
        if calls["n"] > 8:
            raise KeyboardInterrupt        # killed in the second batch
        return prefers("good")(text)
    cache = VerdictCache(tmp_path / "c.sqlite", "id")
    with pytest.raises(KeyboardInterrupt):
        judge_pairs(judge_with(dies_after_8, cache, batch=4), items)
    cache.close()
    cache = VerdictCache(tmp_path / "c.sqlite", "id")
    assert len(cache) == 8                                   # two whole batches survived
    resumed = judge_with(prefers("good"), cache, batch=4)
    assert [v for v, _, _ in judge_pairs(resumed, items)] == ["A"] * 10
    assert (resumed.stats.cache_hits, resumed.stats.cache_misses) == (8, 12)
    again = judge_with(prefers("good"), cache, batch=4)
    judge_pairs(again, items)
    assert (again.stats.cache_hits, again.stats.cache_misses, again.stats.requests) == (20, 0, 0)


def test_unanswered_verdicts_are_not_cached(tmp_path: Path) -> None:
    cache = VerdictCache(tmp_path / "c.sqlite", "id")
    judge = judge_with(lambda t: Reply("invalid", "timeout", answered=False), cache)
    assert judge_pairs(judge, [(PROMPT, "x", "y")])[0][0] == "invalid"
    assert judge.stats.failed == 2 and len(cache) == 0


def test_cache_key_depends_on_identity_prompt_and_order() -> None:
    k = cache_key("id", PROMPT, "a", "b")
    assert k == cache_key("id", PROMPT, "a", "b")
    assert len({k, cache_key("id2", PROMPT, "a", "b"), cache_key("id", PROMPT, "b", "a"),
                cache_key("id", PROMPT[1:], "a", "b")}) == 4


# --- params -----------------------------------------------------------------------------------

def test_pairwise_params_are_checked(tmp_path: Path) -> None:
    from tasks.config.params import ParamsError, load_params
    text = (ROOT / "params" / "tiny.yaml").read_text()
    bad = tmp_path / "p.yaml"
    bad.write_text(text.replace("  kind: lexicon\n", "  kind: llm\n"))
    with pytest.raises(ParamsError, match=r"judge.model: judge.kind llm needs judge.model"):
        load_params(bad)
    bad.write_text(text.replace("  kind: lexicon\n", "  kind: http\n").replace(
        '  model: ""\n', "  model: m\n", 1).replace("  decoding: greedy\n",
                                                      "  decoding: logprob\n"))
    with pytest.raises(ParamsError, match=r"judge.decoding: the http judge decodes greedily"):
        load_params(bad)


def test_http_judge_needs_an_endpoint(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from tasks.core.errors import InputError
    for k in ("ALIGNLOOP_JUDGE_URL", "OPENAI_BASE_URL"):
        monkeypatch.delenv(k, raising=False)
    with pytest.raises(InputError, match="export ALIGNLOOP_JUDGE_URL"):
        make_judge(JudgeParams(kind="http", model="m"), ROOT)


# --- the declaration: templates synced, identity in the registry tags ---------------------------

def test_templates_are_synced_into_a_workspace(tmp_path: Path) -> None:
    from flows.workspace import sync_declaration
    changed = sync_declaration(tmp_path, ROOT / "params" / "tiny-http-judge.yaml")
    assert "params/judges/pairwise_review.txt" in changed
    assert (tmp_path / "params/judges/pairwise_review.txt").read_bytes() == \
        (ROOT / "params/judges/pairwise_review.txt").read_bytes()


def test_registry_tags_name_the_template_md5_for_pairwise_judges_only() -> None:
    import hashlib

    from tasks.config.params import load_params
    from tasks.judging.judge_factory import judge_identity
    assert judge_identity(load_params(ROOT / "params" / "tiny.yaml").judge, ROOT) == \
        {"judge": "lexicon:vader-v1"}
    md5 = hashlib.md5((ROOT / "params/judges/pairwise_review.txt").read_bytes()).hexdigest()
    assert judge_identity(load_params(ROOT / "params" / "tiny-http-judge.yaml").judge, ROOT) == \
        {"judge": "http:served", "judge_template": "params/judges/pairwise_review.txt",
         "judge_template_md5": md5, "judge_decoding": "greedy"}


def test_crash_hook_kills_after_n_cached_batches(tmp_path: Path) -> None:
    """The e2e test's kill -9 midway: a child process judging 3 batches dies after the 2nd,
    with exactly those two batches in the cache."""
    import subprocess
    import sys
    code = f"""
import sys; sys.path.insert(0, {str(ROOT)!r}); sys.path.insert(0, {str(ROOT / 'tests')!r})
from pathlib import Path
from test_pairwise_judge import PROMPT, judge_with, prefers
from tasks.judging.judges import judge_pairs
from tasks.judging.verdict_cache import VerdictCache
cache = VerdictCache(Path({str(tmp_path / 'c.sqlite')!r}), "id")
judge_pairs(judge_with(prefers("good"), cache, batch=4), [(PROMPT, f"good {{i}}", f"bad {{i}}") for i in range(6)])
"""
    from tasks.judging.pairwise import CRASH_ENV
    proc = subprocess.run([sys.executable, "-c", code], env={**__import__("os").environ,
                                                                CRASH_ENV: "2"})
    assert proc.returncode == -9
    assert len(VerdictCache(tmp_path / "c.sqlite", "id")) == 8


def test_a_judge_that_answers_nothing_fails_the_stage_in_one_line() -> None:
    from tasks.judging.pairwise import JudgeUnavailable
    judge = judge_with(lambda t: Reply("invalid", "HTTP 401", answered=False))
    groups = [(PROMPT, ["a", "b", "c"], {"prompt_id": "p"})]
    with pytest.raises(JudgeUnavailable, match=r"scripted judge \(iter_1\): the judge answered "
                       r"none of 6 comparisons \(6 requests, 0 timed out; last: HTTP 401\)"):
        pairwise_groups(judge, groups, "iter_1", JudgeParams(kind="http", model="m",
                                                             comparisons_per_prompt=3))
    partly = judge_with(lambda t: Reply("invalid", "x", answered="[A] a" in t))
    pairwise_groups(partly, groups, "iter_1", JudgeParams(kind="http", model="m",
                                                          comparisons_per_prompt=3))
    assert 0 < partly.stats.failed < partly.stats.cache_misses      # some answered: counted
