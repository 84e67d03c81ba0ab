"""TRL's policy-gradient family: which trainers are made exact and how (:mod:`.policy_gradient`: GRPO / RLOO;
:mod:`.asynchronous`: AsyncGRPO; :mod:`.plan`: the plan both build) and packed forwards (:mod:`.packing`).
"""
