"""Build the configured judge from params and the workspace root (`make_judge`): the lexicon
judges (tasks/judging/judges.py), a reward model as judge, or a pairwise LLM judge (`judge.kind:
llm | http`). The top of the judging package: nothing in it imports this module."""
from __future__ import annotations

from pathlib import Path

from tasks.judging.judges import JUDGES, PAIRWISE_KINDS, PointwiseJudge
from tasks.judging.pairwise import PairwiseLLMJudge, cache_path, load_template
from tasks.judging.verdict_cache import VerdictCache
from tasks.schemas.judge import JudgeParams


def make_pairwise_judge(p: JudgeParams, root: Path, device: object = "cpu") -> PairwiseLLMJudge:
    """`device`: where an llm judge's model runs (a torch device or its name)."""
    template = load_template(root, p.template)
    if p.kind == "http":
        from tasks.judging.judge_http import HttpBackend, endpoint_from_env, served_model
        endpoint = endpoint_from_env()
        model = p.model or served_model(endpoint, p.timeout_s)
        backend = HttpBackend(endpoint, model, p.max_new_tokens, p.max_concurrency,
                              p.timeout_s, p.max_retries, p.backoff_s)
        batch = max(16, 4 * p.max_concurrency)
    elif p.kind == "llm":
        from tasks.judging.judge_llm import LocalLMBackend
        from tasks.models import lm
        model_dir = (root / Path(p.model).expanduser()).resolve()
        lm.check_model_dir(model_dir)
        backend = LocalLMBackend(  # type: ignore[assignment]
            model_dir, p.decoding, p.max_new_tokens, device=device)
        model, batch = f"{model_dir.name}@{lm.weights_md5(model_dir)}", 32
    else:
        raise ValueError(f"not a pairwise judge kind: {p.kind}")
    decoding = p.decoding if p.decoding == "logprob" else f"greedy,max_tokens={p.max_new_tokens}"
    judge = PairwiseLLMJudge(p.kind, model, decoding, template, backend, None, batch)
    judge.cache = VerdictCache(cache_path(root, judge.version), judge.version)
    return judge


def make_judge(p: JudgeParams, root: Path | None = None,
               device: object = "cpu") -> PointwiseJudge:
    """The configured judge. Pairwise kinds (llm, http) read their template and keep their
    verdict cache under the workspace `root` (they have no `score`: see `is_pointwise`);
    `reward_model` and `llm` find `judge.model` relative to it and load it on `device` (a
    torch device or its name; importing this module imports no torch)."""
    root = Path(".") if root is None else root
    if p.kind in PAIRWISE_KINDS:
        return make_pairwise_judge(p, root, device)  # type: ignore[return-value]
    if p.kind == "reward_model":
        from tasks.judging.judge_rm import RewardModelJudge
        return RewardModelJudge((root / Path(p.model).expanduser()).resolve(), p.tie_margin,
                                p.min_words, p.max_length, device=device)
    return JUDGES[p.kind](p)


def judge_identity(p: JudgeParams, root: Path) -> dict[str, str]:
    """The configured judge as registry tags, what names its verdicts: kind:version for the
    lexicons; for pairwise judges kind:model (kind:served: the server's one model), the
    template, its md5 and the decoding; for a reward model as judge its directory and the md5
    of its weights. `root`: the workspace the judge's files are relative to."""
    if p.kind == "reward_model":
        from tasks.judging.judge_rm import rm_md5
        model = (root / Path(p.model).expanduser()).resolve()
        return {"judge": f"reward_model:{p.model}", "judge_model_md5": rm_md5(model)}
    if p.kind not in PAIRWISE_KINDS:
        return {"judge": f"{p.kind}:{p.version}"}
    return {"judge": f"{p.kind}:{p.model or 'served'}", "judge_template": p.template,
            "judge_template_md5": load_template(root, p.template).md5,
            "judge_decoding": p.decoding}
