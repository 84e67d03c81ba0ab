"""The ``hf-gradfix`` subcommands, one module each (as accelerate's ``accelerate/commands/``): :mod:`.launch`,
:mod:`.check` (``config check``), :mod:`.configs` (``configs list / show / copy``), :mod:`.env`.  The entry point,
:mod:`hf_gradfix.cli`, builds the top-level parser and dispatches; ``verify`` and ``plan`` live in their own rooms
(:mod:`hf_gradfix.verify.command`, :mod:`hf_gradfix.plan.command`).  Nothing here is imported by a capability.
"""
