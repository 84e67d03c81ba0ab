"""A tiny patched Trainer run with its tqdm bar on, as a user runs it (tests/trainer/test_start_line.py reads its stderr).

usage: python tests/support/start_line_run.py sft|override
"""

from __future__ import annotations

import sys

import datasets
import transformers
import trl

import harness as H
import hf_gradfix


class _MeanOfMeansTrainer(transformers.Trainer):
    # a compute_loss override that ignores num_items_in_batch: stock divides each micro-batch mean by GA (inexact)
    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        outputs = model(**inputs)
        return (outputs.loss, outputs) if return_outputs else outputs.loss


def _tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({str(i): i for i in range(H.VOCAB)}, unk_token="3"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="0", bos_token="1", eos_token="2")


def main(mode: str) -> None:
    hf_gradfix.patch()
    model = H.build_model("llama")
    samples = H.make_samples("causal", n=8, seed=0)
    if mode == "sft":
        H.run_trainer(
            model, samples, "causal", trainer_cls=trl.SFTTrainer, args_cls=trl.SFTConfig,
            extra_args={"bf16": False, "fp16": False, "max_length": None, "packing": False, "disable_tqdm": False},
            dataset=datasets.Dataset.from_list(samples), trainer_kwargs={"processing_class": _tokenizer()},
        )
    else:
        H.run_trainer(model, samples, "causal", trainer_cls=_MeanOfMeansTrainer, extra_args={"disable_tqdm": False})


if __name__ == "__main__":
    main(sys.argv[1])
