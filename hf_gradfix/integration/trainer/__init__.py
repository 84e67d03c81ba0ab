"""The Trainer class layers: exact loss normalization inside ``transformers.Trainer`` (and subclasses such as TRL's
``SFTTrainer``).

How it is wired (why a class swap and not a callback): a ``TrainerCallback`` cannot change the loss,
and a subclass's ``super().compute_loss(...)`` must reach the fixed default body. So a fixed trainer
gets a generated class whose MRO is::

    [_GradFixTop, UserTrainer, ..., SFTTrainer, ..., _GradFixDefaultLoss, Trainer, ...]

- ``_GradFixTop`` (outermost, :mod:`.top`) sees every micro-batch first: it counts the window's targets once per
  optimizer step (all micro-batches, all data-parallel ranks, with the loss's own count rule) and turns
  whatever the effective ``compute_loss`` returns into ``S_mb * W / N_global``.
- ``_GradFixDefaultLoss`` (:mod:`.default_loss`) replaces the body of ``Trainer.compute_loss`` reached through
  ``super()``: it returns ``S_mb * W / N`` for every head (also heads that ignore ``num_items_in_batch``),
  ``compute_loss_func`` and label smoothing, and averages MoE aux losses over micro-batches and ranks.

Nothing here touches a transformers function: the class of one trainer instance is changed (:mod:`.class_swap`).
How each loss behaves is detected by probing it on the first batch (:mod:`.probe`, :mod:`hf_gradfix.loss.probe`).

``_GradFixTop`` is a short list of overrides; each delegates to the module of its concern, a plain function that
takes the trainer (and, where it needs ``super()``, the parent implementation):

- :mod:`.window_steps`: drawing and counting each optimizer window (``get_batch_samples``), its micro-batches
  (``training_step``); :mod:`.windows`: the window's parts and the stock fallbacks
- :mod:`.loss`: ``compute_loss``, normalized by the window's count; :mod:`.ga_flag`: ``loss_is_scaled_for_ga``
- :mod:`.evaluation`: the exact eval loss (``evaluation_loop``, ``prediction_step``)
- :mod:`.saving`: checkpoints written and resumed (complete-checkpoint markers, pp / ep shards, stream state)
- :mod:`.optimizer`: the low-rank optimizer, its hooks' lifetime (``train``), clipping
- :mod:`.workloads`: dispatch to the pipeline, packing and RL glue
- :mod:`.reentry`: delegates that call back into the trainer; :mod:`.layers`: ``super()`` of the top layer
- :mod:`.probe`, :mod:`.reading`: the probes, and reading batches, models and what they return

This package imports no module of its own here, so a concern module never runs another's import by accident; the
old home :mod:`hf_gradfix.integration.trainer_fix` re-exports the names used from it.
"""
