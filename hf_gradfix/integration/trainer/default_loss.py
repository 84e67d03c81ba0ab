"""``_GradFixDefaultLoss``: the inner class layer, the body of ``Trainer.compute_loss`` made exact, which a trainer
subclass's ``super().compute_loss(...)`` reaches.

Apart from the top layer (:mod:`.top`) because it is its own layer of the generated class, just above
``transformers.Trainer``; the probes (:mod:`.probe`) read what it produces.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from transformers import Trainer

from ...loss.counting import CountRule, count_targets
from ...loss.probe import ProbeError
from ..state import _dp_world, state_of
from .reading import _loss_of, _router_term, _zero_connected


class _GradFixDefaultLoss(Trainer):
    """The body of ``Trainer.compute_loss`` made exact for every loss producer.

    Contract (the one transformers' own compute_loss keeps for registered causal LMs): given
    ``num_items_in_batch = N`` (targets in the whole window on all data ranks) it returns
    ``S_mb * W / N`` (``W``: data-parallel replicas DDP averages over), plus the micro-batch's share of
    a mean-type aux loss; given ``None`` it returns the micro-batch mean, like transformers.
    """

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None, **kwargs):
        state = state_of(self)
        if (
            state is None
            or state.default is None
            or state.disabled_reason is not None
            or state.stock_window
            or not state.config.loss.enabled
        ):
            if state is not None and state.in_probe and state.default is None:
                raise ProbeError("compute_loss was probed before the model")
            return super().compute_loss(model, inputs, return_outputs=return_outputs, num_items_in_batch=num_items_in_batch, **kwargs)
        n = num_items_in_batch
        inputs = dict(inputs)
        labels = None
        if (self.label_smoother is not None or self.compute_loss_func is not None) and "labels" in inputs:
            labels = inputs.pop("labels")
        model_behaviour = state.model
        call = inputs
        if (
            labels is None
            and n is not None
            and model_behaviour is not None
            and model_behaviour.honors_num_items
            and "labels" in inputs
        ):
            call = {**inputs, "num_items_in_batch": n}
        if state.aux_coef and model.training and n is not None:
            from ..moe import before_forward

            before_forward(self, state)  # global / previous router loss: the window's routing counts
        if state.lean is not None:  # loss.head: lean (integration/lean_head.py), the probes' calls too
            from ..lean_head import call_model

            outputs, smoothed_lean = call_model(self, state.lean, model, call, inputs, labels, n, model_behaviour,
                                                probe=state.in_probe)
        else:
            outputs, smoothed_lean = model(**call), False
        if getattr(self.args, "past_index", -1) >= 0:  # removed in transformers 5
            self._past = outputs[self.args.past_index]

        aux = 0.0
        if self.compute_loss_func is not None:
            behaviour = state.func
            if behaviour.honors_num_items:
                local = count_targets({"labels": labels}, behaviour.count_rule)
                base = self.compute_loss_func(outputs, labels, num_items_in_batch=n if n is not None else local)
                n_used = n
            else:
                base = self._gradfix_mean_to_window(
                    self.compute_loss_func(outputs, labels, num_items_in_batch=n), labels, behaviour, n, outputs, model
                )
                n_used = n
        elif labels is not None and smoothed_lean:
            # the smoothed sum over this micro-batch's targets / the window's count, plus the router term a MoE model
            # adds when it is given labels (taken out here, added back below by the declared convention)
            raw = _loss_of(outputs)
            aux_term = _router_term(state, outputs, raw)
            base = raw - aux_term if aux_term is not None else raw
            aux = aux_term if aux_term is not None else 0.0
            n_used = n
        elif labels is not None:
            rule = model_behaviour.count_rule if model_behaviour is not None else CountRule.UNSHIFTED
            mean = self.label_smoother(outputs, labels, shift_labels=rule is CountRule.SHIFTED)
            base = self._gradfix_mean_to_window(mean, labels, model_behaviour, n, outputs, model)
            # the label smoother reads the logits only: a MoE model's router loss, computed beside them, is added here
            # by the declared convention (stock's label-smoothing path drops it without a word)
            aux_term = _router_term(state, outputs, base)
            aux = aux_term if aux_term is not None else 0.0
            n_used = n
        else:
            raw = _loss_of(outputs)
            if raw is None:
                keys = ",".join(outputs.keys()) if isinstance(outputs, Mapping) else type(outputs).__name__
                raise ValueError(
                    f"The model did not return a loss from the inputs, only the following keys: {keys}. "
                    f"For reference, the inputs it received are {','.join(inputs.keys())}."
                )
            aux_term = _router_term(state, outputs, raw)
            main = raw - aux_term if aux_term is not None else raw
            if model_behaviour.honors_num_items or n is None:
                base = main
            else:
                base = self._gradfix_mean_to_window(main, inputs["labels"], model_behaviour, n, outputs, model)
            n_used = n
            if aux_term is not None:
                aux = aux_term
        if n_used is None:
            loss = base + aux
            state.last_aux = aux.detach().clone() if torch.is_tensor(aux) else aux  # read only by eval
        else:
            share = aux
            if torch.is_tensor(aux) and model.training and state.config.loss.aux_loss != "as_is":
                from ..moe import aux_share

                share = aux_share(self, state, aux, outputs, inputs,
                                  max(1, getattr(self, "current_gradient_accumulation_steps", 1)))
            loss = base * _dp_world(self) + share
            state.last_aux = share.detach().clone() if torch.is_tensor(share) else share  # read only by eval
        return (loss, outputs) if return_outputs else loss

    def _gradfix_mean_to_window(self, mean, labels, behaviour, n, outputs, model):
        """Micro-batch mean over its own targets -> sum / N (N: global count); unchanged when N is None."""
        if n is None:
            return mean
        local = int(count_targets({"labels": labels}, behaviour.count_rule))
        if local == 0:
            return _zero_connected(mean, outputs, model)
        return mean * (local / float(n))
