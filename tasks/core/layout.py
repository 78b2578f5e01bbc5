"""Where every artifact lives inside a workspace: the one place that knows the layout.

dvc.yaml declares the same paths; tests check that the two agree.
"""
from __future__ import annotations

import re

PARAMS_FILE = "params.yaml"

# the stages, in run order, as dvc.yaml declares them (tests/test_dvc_yaml.py): the set-up stages
# run once, the loop stages once per iteration (`name@k`), the final stages once after the last
# iteration (they read every iteration's results)
SETUP_STAGES = ("prompts", "prepare_model", "collect_offpolicy", "reference_samples")
LOOP_STAGES = ("rollout", "judge", "train_rm", "update", "evaluate", "gate")
FINAL_STAGES = ("report",)
STAGES = SETUP_STAGES + LOOP_STAGES + FINAL_STAGES

DATA_DIR = "data"                        # every dataset the stages write
METRICS_DIR = "metrics"                  # every metrics file and gate decision (git-tracked)
REPORT_DIR = "report"                    # the report page and its plots (stage `report`)

PROMPTS_TRAIN = "data/prompts/train.jsonl"
PROMPTS_HELDOUT = "data/prompts/heldout.jsonl"
PROMPTS_SELECT = "data/prompts/select.jsonl"    # held-out subjects for promotion decisions only
REFERENCE_SAMPLES = "data/reference/heldout_samples.jsonl"   # the reference on held-out prompts
BEST_OF_N_SAMPLES = "data/reference/best_of_n_samples.jsonl"  # N more per prompt (baseline)
IMPORT_DIR = "data/import"
JUDGE_TEMPLATES = "params/judges"        # the pairwise judges' versioned prompts (llm, http)
IMPORT_PAIRS = "data/import/pairs.jsonl"   # `alignloop import` writes it (offpolicy.import_path)
BOOK_MANIFEST = "data/import/book.json"  # `import --from-workspace`: where the pairs came from
OFFPOLICY_METRICS = "metrics/offpolicy.json"
TARGETS = "metrics/targets.json"          # the last iteration against the profile's targets
MODEL_META = "alignloop_model.json"      # written inside every saved model directory
ADAPTER_BASE = "alignloop_base.json"     # ... of a LoRA adapter: the base it names (path, md5)
TRAINING_CURVE = "training_curve.json"   # in a model directory: one record per optimiser step
MODEL_CARD = "README.md"                 # ... and its model card (tasks/models/model_card.py)
MLMODEL = "MLmodel"                      # ... and its MLflow model file (models/mlflow_model.py)
RM_STATS = "reward_stats.json"           # in a reward model's directory: its score mean and std
VALUE_HEAD = "value_head.safetensors"    # in a PPO policy's directory: its critic
REPLAY_ROLLOUTS = "replay_rollouts.jsonl"  # ... with reuse on: its rollouts, for update@k+1
RM_MEMBER_PREFIX = "member_"            # ensemble K > 1: models/iter_k/rm/member_0, member_1, ...
AUDIT_LABELS = "audit/labels.jsonl"      # the person's audit verdicts; git-tracked, never an out
JUDGE_CACHE_DIR = ".alignloop/judge-cache"   # pairwise judges' verdicts (machine state, no out)


def policy(it: int) -> str:
    """Iteration 0's policy is the initial model, which is also the default reference."""
    return f"models/iter_{it}/policy"


def reward_model(it: int) -> str:
    return f"models/iter_{it}/rm"


def audit_queue(it: int) -> str:
    """Pairs exported for a person to audit after train_rm@it (replaced on every rerun)."""
    return f"audit/iter_{it}/queue.jsonl"


def pairs_pool(it: int) -> str:
    """Every pair the reward model of iteration `it` trains on (iteration 0: off-policy only)."""
    return f"data/iter_{it}/pairs_pool.jsonl"


def pool_iteration(path: str) -> int | None:
    """The iteration whose pair pool `path` is (`pairs_pool(k)` -> k), None for any other path."""
    m = _POOL.fullmatch(path)
    return int(m[1]) if m else None


_POOL = re.compile(r"data/iter_(0|[1-9][0-9]*)/pairs_pool\.jsonl")   # as pairs_pool writes it


def rollouts(it: int) -> str:
    return f"data/iter_{it}/rollouts.jsonl"


def pairs(it: int) -> str:
    return f"data/iter_{it}/pairs.jsonl"


def eval_samples(it: int) -> str:
    return f"data/iter_{it}/eval_samples.jsonl"


def select_samples(it: int) -> str:
    """Policy `it`'s responses to the select prompts (iteration 0: the reference's)."""
    return f"data/iter_{it}/select_samples.jsonl"


def redteam_samples(it: int | str) -> str:
    """Policy `it`'s responses to the red-team regression set with their violations
    (iteration 0: the reference's); `it` may be a DVC reference such as `${gate.production}`."""
    return f"data/iter_{it}/redteam_samples.jsonl"


def metrics(it: int, stage: str) -> str:
    return f"metrics/iter_{it}/{stage}.json"


def gate(it: int) -> str:
    """The promotion decision of iteration `it` (git-tracked, like the metrics)."""
    return f"metrics/iter_{it}/gate_decision.json"


def iteration_dirs(it: int) -> list[str]:
    """Every directory that holds only iteration `it`'s artifacts."""
    return [f"data/iter_{it}", f"models/iter_{it}", f"metrics/iter_{it}"]
