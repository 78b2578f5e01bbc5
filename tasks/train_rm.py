"""Stage `train_rm`: the iteration's Bradley-Terry reward model.

It learns from the pair pool: the off-policy pairs plus every on-policy pair the judge has
labelled up to and including this iteration's rollouts, so that it is reliable where the current
policy samples. The backbone starts from the initial model; the head is new each iteration.
"""
from __future__ import annotations

from tasks import atomic, jsonl, layout, lm, stage
from tasks.jsonl import DataError
from tasks.records import parse_pair
from tasks.reward_model import (encode_pairs, heldout_split, init_reward_model, reward_stats,
                                save_stats, train_reward)


def main(argv: list[str] | None = None) -> None:
    args = stage.parse(argv, __doc__ or "")
    p, it, root = args.params, args.it, args.root
    pool_path = str(root / layout.pairs_pool(it))
    pairs = [parse_pair(rec, pool_path, n, "unknown") for n, rec in jsonl.read(pool_path)]
    if len(pairs) < 2:
        raise DataError(f"{pool_path}: {len(pairs)} pairs; the reward model needs at least 2")
    backbone = root / layout.policy(0)
    tok = lm.load_tokenizer(backbone)
    model = init_reward_model(backbone)
    train, held = heldout_split(pairs, p.train_rm.heldout_fraction)
    enc = lambda ps: encode_pairs(tok, ps, p.model.max_prompt_tokens, p.train_rm.max_length)  # noqa: E731
    enc_train, enc_held = enc(train), enc(held)
    metrics = train_reward(model, enc_train, enc_held, p.train_rm, tok.pad_token_id,
                           stage.generator(p.seed, 2, it))
    metrics["rm/n_onpolicy"] = float(sum(1 for x in pairs if x.source.startswith("iter_")))
    stats = reward_stats(model, enc_train, tok.pad_token_id)
    with atomic.directory(root / layout.reward_model(it)) as tmp:
        model.save_pretrained(tmp)
        tok.save_pretrained(tmp)
        save_stats(tmp, stats)
        atomic.write_json(tmp / layout.MODEL_META, {"iteration": it, "role": "reward_model",
                                                    "pairs": len(pairs)})
    stage.write_metrics(root, layout.metrics(it, "train_rm"), metrics)
    print(f"train_rm@{it}: {len(train)} train / {len(held)} held-out pairs, "
          f"held-out accuracy {metrics['rm/accuracy']:.3f}")


if __name__ == "__main__":
    stage.run_main(lambda: main())
