"""Checkpoints: the sharded ones hf_gradfix writes for pipeline / expert-parallel runs (:mod:`.sharded`) and the
complete-or-refused ones of every run (:mod:`.complete`).
"""
