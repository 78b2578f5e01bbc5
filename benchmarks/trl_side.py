"""TRL's side of benchmarks/vs_trl.py: its DPOTrainer and RewardTrainer on our pairs, in our
batch order, at the same hyperparameters and precision (vs_trl's docstring says what is matched
and what differs). Each returns (seconds, per-step losses)."""
from __future__ import annotations

import os
import tempfile
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import torch

from tasks.config.params import DPOParams, TrainRMParams
from tasks.models import lm
from tasks.reward.features import EncodedPair


class _FixedOrder(torch.utils.data.Sampler[int]):
    """Yields orders[e] in epoch e (the Trainer calls set_epoch before each epoch)."""

    def __init__(self, orders: list[list[int]]):
        self.orders, self.epoch = orders, 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __iter__(self) -> Iterator[int]:
        return iter(self.orders[min(self.epoch, len(self.orders) - 1)])

    def __len__(self) -> int:
        return len(self.orders[0])


def _instrumented(base: type, orders: list[list[int]]) -> type:
    """`base` (a TRL trainer) with our batch order, per-step losses recorded, its reference
    precompute timed, and pre-tokenised DPO rows passed through unchanged."""

    class Bench(base):  # type: ignore[misc, valid-type]
        step_losses: list[float]
        precompute_s = 0.0

        def _prepare_dataset(self, dataset: Any, *args: Any, **kwargs: Any) -> Any:
            if "prompt_ids" in dataset.column_names:          # DPO rows: our ids as they are
                return dataset
            return super()._prepare_dataset(dataset, *args, **kwargs)

        def _precompute_ref_logps(self, *args: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            out = super()._precompute_ref_logps(*args, **kwargs)
            type(self).precompute_s += time.perf_counter() - t0
            return out

        def _get_train_sampler(self, *args: Any, **kwargs: Any) -> torch.utils.data.Sampler:
            return _FixedOrder(orders)

        def compute_loss(self, model: Any, inputs: Any, *args: Any, **kwargs: Any) -> Any:
            out = super().compute_loss(model, inputs, *args, **kwargs)
            if model.training:
                loss = out[0] if isinstance(out, tuple) else out
                self.step_losses.append(float(loss.detach()))
            return out

    Bench.step_losses = []
    return Bench


def _common_args(out_dir: str, lr: float, batch_size: int, epochs: int,
                 weight_decay: float, precision: str) -> dict[str, Any]:
    """TrainingArguments both TRL trainers get (module docstring: what is matched)."""
    import datasets
    datasets.disable_progress_bars()
    os.environ["TQDM_DISABLE"] = "1"                  # TRL's reference-precompute bar
    return dict(output_dir=out_dir, learning_rate=lr, per_device_train_batch_size=batch_size,
                num_train_epochs=epochs, lr_scheduler_type="constant", warmup_steps=0,
                optim="adamw_torch", adam_beta1=0.9, adam_beta2=0.999, adam_epsilon=1e-8,
                weight_decay=weight_decay, max_grad_norm=0.0, gradient_accumulation_steps=1,
                activation_checkpointing=False, gradient_checkpointing=False,
                bf16=precision == "bf16", fp16=False, use_cpu=True, logging_steps=1,
                report_to=[], save_strategy="no", disable_tqdm=True, dataloader_num_workers=0,
                seed=0)


def _check_precision(trainer: Any, precision: str) -> None:
    """TRL's bf16 on the CPU is the Trainer's mixed precision, torch.autocast as ours, with the
    weights left in fp32: checked, so that the two sides run the same arithmetic."""
    want = "bf16" if precision == "bf16" else "no"
    assert str(trainer.accelerator.mixed_precision) == want, trainer.accelerator.mixed_precision
    assert all(w.dtype == torch.float32 for w in trainer.model.parameters()), "TRL cast weights"


def _quiet(trainer: Any) -> None:
    """No per-step log dict on stdout (the Trainer prints one when tqdm is off)."""
    from transformers.trainer_callback import PrinterCallback
    trainer.remove_callback(PrinterCallback)


def trl_dpo(model_dir: Path, pairs: Sequence[EncodedPair], p: DPOParams, max_length: int,
            orders: list[list[int]]) -> tuple[float, list[float]]:
    """TRL's DPOTrainer on the pairs: (seconds of training and reference precompute, per-step
    losses)."""
    from datasets import Dataset
    from trl import DPOConfig, DPOTrainer
    tok = lm.load_tokenizer(model_dir)
    model = lm.load_causal_lm(model_dir)
    data = Dataset.from_list([{"prompt_ids": list(e.prompt_ids), "chosen_ids": list(e.chosen_ids),
                               "rejected_ids": list(e.rejected_ids)} for e in pairs])
    cls = _instrumented(DPOTrainer, orders)
    with tempfile.TemporaryDirectory() as tmp:
        args = DPOConfig(**_common_args(tmp, p.lr, p.batch_size, p.epochs, 0.0, p.precision),
                         beta=p.beta, loss_type=["sigmoid"], label_smoothing=0.0,
                         max_length=max_length, precompute_ref_log_probs=True,
                         precompute_ref_batch_size=p.batch_size)
        trainer = cls(model=model, ref_model=None, args=args, train_dataset=data,
                      processing_class=tok)
        assert not model.is_activation_checkpointing, "TRL turned checkpointing on"
        _check_precision(trainer, p.precision)
        _quiet(trainer)
        t0 = time.perf_counter()
        trainer.train()
        seconds = time.perf_counter() - t0 + cls.precompute_s
    return seconds, list(cls.step_losses)


def trl_rm(model_dir: Path, model: Any, pairs: Sequence[EncodedPair], p: TrainRMParams,
           orders: list[list[int]]) -> tuple[float, list[float]]:
    """TRL's RewardTrainer on the pairs, from `model` (the reward model both sides start
    from): (seconds of training, per-step losses)."""
    from datasets import Dataset
    from trl import RewardConfig, RewardTrainer
    tok = lm.load_tokenizer(model_dir)
    data = Dataset.from_list([{"chosen_ids": list(e.prompt_ids + e.chosen_ids),
                               "rejected_ids": list(e.prompt_ids + e.rejected_ids)}
                              for e in pairs])
    cls = _instrumented(RewardTrainer, orders)
    with tempfile.TemporaryDirectory() as tmp:
        args = RewardConfig(**_common_args(tmp, p.lr, p.batch_size, p.epochs, p.weight_decay,
                                           p.precision),
                            max_length=p.max_length, center_rewards_coefficient=None)
        trainer = cls(model=model, args=args, train_dataset=data, processing_class=tok)
        _check_precision(trainer, p.precision)
        _quiet(trainer)
        t0 = time.perf_counter()
        trainer.train()
        seconds = time.perf_counter() - t0
    return seconds, list(cls.step_losses)
