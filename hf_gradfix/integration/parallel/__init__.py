"""The parallel glue: the ND-parallel setup (:mod:`.nd`), transformers' tensor-parallel gradient fix
(:mod:`.tensor_parallel`), pipeline stages (:mod:`.pipeline`), DeepSpeed checks (:mod:`.deepspeed`) and their
error (:mod:`.errors`).
"""
