"""The stage contract on the user's and the developer's path: a stage reads only the params keys
it declares, and an edit reruns the stages that declare what was edited (real DVC, in a copy of
the shared tiny run's workspace)."""
from __future__ import annotations

import pytest

from conftest import TINY
from tasks.params import load_params
from tasks.stage import Contract, Declared, UndeclaredParam


def test_the_view_answers_declared_keys_only() -> None:
    p = load_params(TINY)
    view = Declared(p, Contract("x", params=("seed", "model.max_prompt_tokens", "rollout")))
    assert view.seed == p.seed
    assert view.rollout is p.rollout                   # a declared section: the params' own
    assert view.rollout.generation.max_new_tokens == p.rollout.generation.max_new_tokens
    assert view.model.max_prompt_tokens == p.model.max_prompt_tokens
    with pytest.raises(UndeclaredParam, match=r"^stage x reads params key model\.source, which "
                       r"its contract does not declare: add it to CONTRACT\.params in "
                       r"tasks/stages/x\.py"):
        view.model.source                                # a sibling of a declared key
    with pytest.raises(UndeclaredParam, match="params key judge,"):
        view.judge                                       # a section not declared at all
    with pytest.raises(AttributeError):
        view.no_such_key                                 # not a key: Python's own error


def test_declares_reads_sections_and_keys() -> None:
    c = Contract("x", params=("device", "update", "offpolicy.source"))
    assert c.declares("device") and c.declares("update.dpo.beta") and c.declares("offpolicy.source")
    assert not c.declares("offpolicy") and not c.declares("offpolicy.n_prompts")
    assert not c.declares("seed") and not c.declares("updates")
