"""Sequence packing wired into the Trainer: its dataloader and model checks (:mod:`.trainer`) and the per-rank
balance log (:mod:`.balance_log`).
"""
