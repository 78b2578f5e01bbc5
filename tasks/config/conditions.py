"""Conditional inputs: a stage input read under some params only (PPO reads the reward model,
DPO on the judge's pairs does not).

dvc.yaml marks such a dep with `# if: NAME`; each workspace's dvc.yaml is rendered from it for
the workspace's params (flows/workspace.py): a dep whose condition does not hold is commented
out, so DVC neither reruns the stage when that input changes nor records it as an input in
dvc.lock (the lineage of a DPO policy names no reward model it never read). The stage checks
the same conditions when it starts (`check`): an input it is about to read that the workspace's
dvc.yaml left out (params.yaml edited by hand, dvc.yaml not rendered again) stops it in one
line. Light: no torch.
"""
from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tasks.core.errors import InputError

MARK = re.compile(r"^(\s*)(#\s?)?(- .*?)\s+# if: (\w+)\s*$")


def _dpo_by(p: Any, source: str) -> bool:
    return p.update.algo == "dpo" and p.update.dpo.pair_source == source


CONDITIONS: dict[str, Callable[[Any], bool]] = {
    # update@k: the judge's pairs (DPO, pair_source judge)
    "update_reads_judge_pairs": lambda p: _dpo_by(p, "judge"),
    # update@k: the rollouts and the reward model (PPO; DPO with pair_source rm)
    "update_reads_reward_model": lambda p: p.update.algo == "ppo" or _dpo_by(p, "rm"),
    # update@k: the previous pair pool (DPO with offpolicy_mix > 0, or offline iterations)
    "update_reads_pair_pool": lambda p: p.update.algo == "dpo" and (
        p.update.dpo.offpolicy_mix > 0 or bool(p.rollout.offline)),
    # update@k: iteration 0's model as the reference
    "update_reads_initial_policy": lambda p: (p.update.reference == "initial"   # the reference,
                                              or p.update.kl_budget.total > 0    # the budget's,
                                              or p.update.lora.r > 0),   # or a LoRA policy's base
    # rollout@k: iteration 0's model, the base of a LoRA policy's adapter
    "policy_is_adapter": lambda p: p.update.lora.r > 0,
}


class UndeclaredInput(InputError):
    """A stage is about to read an input its workspace's dvc.yaml does not declare."""


def render(template: str, params: Any) -> str:
    """dvc.yaml for these params: each `# if: NAME` dep kept, or commented out (`#- path`)
    where NAME does not hold. Rendering a rendered file again gives the same as the template."""
    out = []
    for line in template.split("\n"):
        m = MARK.match(line)
        if m:
            indent, _, item, name = m.groups()
            on = CONDITIONS[name](params)
            line = f"{indent}{'' if on else '#'}{item}   # if: {name}"
        out.append(line)
    return "\n".join(out)


def declared(text: str) -> dict[str, bool]:
    """Each condition named in a (rendered) dvc.yaml: whether its deps are declared there."""
    out: dict[str, bool] = {}
    for line in text.split("\n"):
        m = MARK.match(line)
        if m:
            out[m.group(4)] = m.group(2) is None
    return out


def holds(name: str, params: Any) -> bool:
    return CONDITIONS[name](params)


def check(contract: Any, params: Any, root: Path, facts: dict[str, bool] | None = None) -> None:
    """Stop a stage whose conditional inputs (its contract's `when`) hold for these params but
    are left out of the workspace's dvc.yaml (a workspace without one: nothing to check).
    facts: conditions the stage knows from its inputs rather than from params (rollout: whether
    the policy it samples is an adapter), which it need not declare params for."""
    path = root / "dvc.yaml"
    facts = facts or {}
    on = declared(path.read_text()) if path.is_file() else {}
    missing = [n for n in contract.when
               if (facts[n] if n in facts else holds(n, params)) and not on.get(n, True)]
    if missing:
        raise UndeclaredInput(
            f"{path}: {contract.name} reads inputs declared there for other params "
            f"({', '.join(missing)}; params.yaml edited by hand?): `alignloop run` declares "
            f"them anew")
