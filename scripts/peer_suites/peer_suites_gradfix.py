"""pytest plugin loaded (``-p peer_suites_gradfix``) only in the patched run of a peer's suite.

It calls ``hf_gradfix.patch()`` (default configuration) when pytest configures, before any test module is imported
and before any Trainer exists, and does nothing else, so the patched run differs from the stock run by that one
call. The runner clears ``HF_GRADFIX_CONFIG`` in both runs, so ``patch()`` uses the library defaults.
"""

import hf_gradfix


def pytest_configure(config):
    hf_gradfix.patch()
