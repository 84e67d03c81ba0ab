"""``_GradFixTop``: the outermost class layer of a fixed trainer (the MRO: :mod:`hf_gradfix.integration.trainer`).

Each override says in one line why it exists and hands on to the module of its concern, with ``super()``'s method
where the concern calls the next class: the class is the list of what the plugin changes in a Trainer, the code of
each change is in its module.
"""

from __future__ import annotations

from transformers import Trainer

from . import evaluation, ga_flag, loss, optimizer, saving, window_steps, workloads
from .layers import TOP_MARK
from .reentry import passes_through_delegates


class _GradFixTop:
    """Outermost layer: window counting, normalization of whatever compute_loss returns, exact eval loss."""

    _gradfix_layer = TOP_MARK  # how the concern modules find this class in a trainer's MRO (layers.py)

    @property
    def loss_is_scaled_for_ga(self):
        # True while the loss is window-normalized (5.x must not divide it by the accumulation steps), else the own
        return ga_flag.loss_is_scaled_for_ga(self)

    @loss_is_scaled_for_ga.setter
    def loss_is_scaled_for_ga(self, value):
        # a value the trainer sets is its own: read back when the fix is off
        ga_flag.set_loss_is_scaled_for_ga(self, value)

    def create_optimizer(self, *args, **kwargs):
        # GaLore / APOLLO from the optimizer section, with the Trainer's own hyperparameters
        return optimizer.create_optimizer(self, super().create_optimizer, *args, **kwargs)

    def train(self, *args, **kwargs):
        # a low-rank optimizer's hooks live as long as train(); resume skips a checkpoint a crash tore
        return optimizer.train(self, super().train, *args, **kwargs)

    def get_train_dataloader(self):
        # packing: the packed dataloader
        return workloads.get_train_dataloader(self, super().get_train_dataloader)

    def _save_rng_state(self, output_dir, *args, **kwargs):
        # a packed stream's and the MoE router's state go with the RNG state; the process's complete marker
        return saving.save_rng_state(self, super()._save_rng_state, output_dir, *args, **kwargs)

    def _save_checkpoint(self, model, trial, *args, **kwargs):
        # a checkpoint's start file first, so a torn save is known as the plugin's and a full disk named
        return saving.save_checkpoint(self, super()._save_checkpoint, model, trial, *args, **kwargs)

    def save_model(self, output_dir=None, _internal_call=False):
        # pipeline: every stage's weights saved as one model
        return saving.save_model(self, super().save_model, output_dir, _internal_call)

    def _save_optimizer_and_scheduler(self, output_dir):
        # pipeline / expert parallelism: one distributed checkpoint of every rank's shards
        return saving.save_optimizer_and_scheduler(self, super()._save_optimizer_and_scheduler, output_dir)

    def _load_from_checkpoint(self, resume_from_checkpoint, model=None):
        # the sharded checkpoints resumed; a sharded run's checkpoint refused by a run that is not
        return saving.load_from_checkpoint(self, super()._load_from_checkpoint, resume_from_checkpoint, model)

    def _load_optimizer_and_scheduler(self, checkpoint, *args, **kwargs):
        # the sharded optimizer resumed, and the packed stream's and router's state with it
        return saving.load_optimizer_and_scheduler(self, super()._load_optimizer_and_scheduler, checkpoint, *args,
                                                   **kwargs)

    def get_batch_samples(self, epoch_iterator, num_batches, device):
        # each optimizer window drawn and its targets counted once over every rank
        return window_steps.get_batch_samples(self, super().get_batch_samples, epoch_iterator, num_batches, device)

    def _track_num_input_tokens(self, inputs):
        # pipeline: each micro-batch's tokens counted once
        return workloads.track_num_input_tokens(self, super()._track_num_input_tokens, inputs)

    def _sync_replicated_trainable_parameters(self, model):
        # pipeline: each stage holds other weights, no world-wide broadcast
        return workloads.sync_replicated_trainable_parameters(self, super()._sync_replicated_trainable_parameters,
                                                              model)

    def _clip_grad_norm(self, model):
        # pipeline: the norm over every stage's gradients
        return optimizer.clip_grad_norm(self, super()._clip_grad_norm, model)

    def _get_grad_norm(self, model, grad_norm=None):
        # pipeline: the pre-clip norm over every stage's gradients
        return optimizer.get_grad_norm(self, super()._get_grad_norm, model, grad_norm)

    def training_step(self, model, inputs, *args, **kwargs):
        # a micro-batch of the drawn window, or a call of the caller's own; a division after compute_loss undone
        return window_steps.training_step(self, super().training_step, model, inputs, *args, **kwargs)

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None, **kwargs):
        # what the compute_loss below returns, normalized by the window's target count over every rank
        return loss.compute_loss(self, super().compute_loss, model, inputs, return_outputs, num_items_in_batch,
                                 **kwargs)

    def prediction_step(self, model, inputs, prediction_loss_only, ignore_keys=None, **kwargs):
        # an eval loss computed outside compute_loss counted too; pipeline: through the schedule
        return evaluation.prediction_step(self, super().prediction_step, model, inputs, prediction_loss_only,
                                          ignore_keys, **kwargs)

    def evaluation_loop(self, dataloader, description, prediction_loss_only=None, ignore_keys=None,
                        metric_key_prefix="eval"):
        # eval_loss: the exact target mean over the eval set and every rank
        return evaluation.evaluation_loop(self, super().evaluation_loop, dataloader, description,
                                          prediction_loss_only, ignore_keys, metric_key_prefix)


# Pipeline-parallel overrides of Trainer methods that only transformers 5.x has (on 4.57 the pipeline glue routes
# clipping through this trainer's accelerator and corrects the token count in training_step). On 4.57 the
# mixin must not add them: code that tells the two Trainers apart by these methods (the noise-scale monitor reads the
# pre-clip norm through ``_get_grad_norm`` on 5.x and through ``accelerator.clip_grad_norm_`` on 4.57) would take
# the 5.x path, which the 4.57 Trainer never calls.
for _name in ("_clip_grad_norm", "_get_grad_norm", "_track_num_input_tokens", "_sync_replicated_trainable_parameters"):
    if not hasattr(Trainer, _name):
        delattr(_GradFixTop, _name)
del _name

#: the Trainer methods the generated class overrides: a delegate of one of them that calls back into the trainer
#: (``patch.object(MyTrainer, "training_step", wraps=trainer.training_step)``) continues the stock chain (reentry.py)
_TOP_OVERRIDES = tuple(n for n, v in vars(_GradFixTop).items() if callable(v) and hasattr(Trainer, n))
passes_through_delegates(_GradFixTop, _TOP_OVERRIDES)
