"""A Matformer model trained under Lightning's Trainer: the role of seed 000's ModelWrapper::

    module = MatformerLightningModule(model, OptimizerConfig(name="muon"),
                                      schedule=TierSchedule(tiers=[0, 1, 2]))
    lightning.Trainer(max_steps=1000).fit(module, token_budget_loader(documents, 16384))

Each batch is a list of documents (1-D token ids), as ``token_budget_loader`` gives them.
A training step is our own: ``tier_gradients`` accumulates the batch's gradient at the
step's tiers in microbatches that adapt to out-of-memory errors, the gradient is clipped to
``max_grad_norm``, and the optimizers an ``OptimizerConfig`` builds take their step, then
their learning-rate schedules. So a Lightning run gives the weights our loop gives
(``train_step_on_examples``) on the same batches; tests/test_lightning_wrapper.py checks it.
Lightning brings what is around the step: devices, bf16, callbacks, loggers, checkpoints.

The module optimizes manually: a step backpropagates once per tier and microbatch, where
Lightning's automatic optimization wants one loss, and muon is two optimizers (Muon for the
hidden matrices, AdamW for the rest), where automatic optimization takes one. Lightning
counts every optimizer's step in ``global_step`` under manual optimization, so with muon
``max_steps`` counts two per batch.

Two settings are refused, because their gradients would be wrong without a word:
several devices (Lightning's DDP averages gradients in the forward pass of its wrapper,
which ``tier_gradients`` bypasses; ``matformer train --fsdp`` trains on several GPUs), and
``precision="16-mixed"`` (its loss scaler expects Lightning's own backward; bf16 needs none).

Lightning is an optional extra: ``pip install 'matformer[lightning]'``.
"""

from __future__ import annotations

from torch import Tensor

from matformer.modeling.batching import AdaptiveLimitsConfig, MicrobatchRunner
from matformer.modeling.budget_sampler import TokenBudgetBatchSampler
from matformer.modeling.errors import ConfigError
from matformer.modeling.models import TransformerWithLMHead
from matformer.modeling.optim import OptimizerConfig
from matformer.modeling.training import StepOptions, TierSchedule, clip_gradient, tier_gradients

try:
    from lightning.pytorch import LightningModule
except ImportError as error:
    raise ImportError("training under Lightning's Trainer needs Lightning: "
                      "pip install 'matformer[lightning]'.") from error


class MatformerLightningModule(LightningModule):
    """``model`` trained on token-budget batches at the tiers of ``schedule``."""

    def __init__(
        self,
        model: TransformerWithLMHead,
        optimizer: OptimizerConfig,
        *,
        schedule: TierSchedule | None = None,
        limits: AdaptiveLimitsConfig | None = None,
        max_grad_norm: float | None = None,
        seed: int = 0,
    ) -> None:
        """``limits``: the microbatches' starting limits (default ``AdaptiveLimitsConfig()``);
        ``seed``: of a masked model's masks, as in ``StepOptions``."""
        super().__init__()
        self.schedule = schedule or TierSchedule()
        self.schedule.check(model.config)
        self.model = model
        self.optimizer_config = optimizer
        self.runner = MicrobatchRunner(model, (limits or AdaptiveLimitsConfig()).build())
        self.max_grad_norm = max_grad_norm
        self.options = StepOptions(seed=seed)
        self.automatic_optimization = False

    def configure_optimizers(self) -> tuple[list, list]:
        built = self.optimizer_config.build(self.model)
        return list(built.optimizers), list(built.schedulers)

    def on_fit_start(self) -> None:
        if self.trainer.world_size > 1:
            raise ConfigError(
                f"MatformerLightningModule trains on one device; this Trainer has "
                f"{self.trainer.world_size}. Use devices=1, or matformer train --fsdp.")
        if self.trainer.precision == "16-mixed":
            raise ConfigError("precision='16-mixed' scales a loss this module never hands to "
                              "Lightning; use precision='bf16-mixed' (or '32-true').")

    def on_train_epoch_start(self) -> None:
        """A new order of the batches each epoch (Lightning tells only plain samplers)."""
        sampler = getattr(self.trainer.train_dataloader, "batch_sampler", None)
        if isinstance(sampler, TokenBudgetBatchSampler):
            sampler.set_epoch(self.current_epoch)

    def training_step(self, batch: list[Tensor], batch_idx: int) -> None:
        optimizers = _as_list(self.optimizers())
        step = self.trainer.global_step // len(optimizers)  # batches trained so far
        losses = tier_gradients(self.runner, batch, self.schedule, step, options=self.options)
        if self.max_grad_norm is not None:
            clip_gradient(self.model, self.max_grad_norm)
        for optimizer in optimizers:
            optimizer.step()
        for scheduler in _as_list(self.lr_schedulers()):
            scheduler.step()
        self.log_dict({f"loss/tier_{label}": loss for label, loss in losses.items()},
                      prog_bar=True, batch_size=len(batch))


def _as_list(value: object) -> list:
    """Lightning's optimizers() and lr_schedulers(): None, one, or a list."""
    if value is None:
        return []
    return value if isinstance(value, list) else [value]
