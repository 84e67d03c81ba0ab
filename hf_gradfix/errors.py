"""The one family of errors hf_gradfix raises on purpose.

Every error the plugin diagnoses (a bad configuration, a mesh that does not fit, a model the fix cannot make
exact, an unsupported version, ...) derives from :class:`HfGradfixError`.  Each class keeps its historical
built-in base as well (``ConfigError`` is still a ``ValueError``, ``GradFixError`` still a ``RuntimeError``), so
existing ``except ValueError`` / ``except RuntimeError`` clauses keep working.  The ``hf-gradfix`` command
catches the family and prints one line with exit code 2; any other exception escaping it is a bug in the plugin.

>>> from hf_gradfix.errors import HfGradfixError
>>> from hf_gradfix.config import ConfigError
>>> issubclass(ConfigError, HfGradfixError) and issubclass(ConfigError, ValueError)
True

This module imports nothing (every capability may import it).
"""

from __future__ import annotations

__all__ = [
    "GradFixError", "HfGradfixError", "InvalidArgumentError", "InvalidTypeError", "ModelLoadError", "NonFiniteError", "PatchError",
    "UsageError", "model_load_error",
]


class HfGradfixError(Exception):
    """Base of every error hf_gradfix raises on purpose; the message says what is wrong and how to fix it."""


class GradFixError(HfGradfixError, RuntimeError):
    """hf_gradfix cannot make this trainer's loss exact; the message says why and what to do."""


class InvalidArgumentError(HfGradfixError, ValueError):
    """A bad argument to one of the plugin's functions or classes (value out of range, wrong choice)."""


class InvalidTypeError(HfGradfixError, TypeError):
    """An argument of the wrong type to one of the plugin's functions or classes."""


class UsageError(HfGradfixError, RuntimeError):
    """An operation the plugin refuses in this state or setup (e.g. a TokenWindow iterated twice)."""


class PatchError(HfGradfixError, RuntimeError):
    """``patch()`` / ``unpatch()`` cannot change (or restore) a third-party function safely."""


class NonFiniteError(HfGradfixError, FloatingPointError):
    """A loss or gradient was NaN or infinite and ``loss.on_nonfinite`` is ``error``."""


class ModelLoadError(HfGradfixError, ValueError):
    """A model (or its config) named on the command line cannot be loaded; the message says what to give instead."""


def model_load_error(spec: str, err: BaseException) -> ModelLoadError:
    """One line for a failed ``from_pretrained(spec)``: remote code refused, not found, unknown type.

    >>> str(model_load_error("org/m", ValueError("... contains custom code ... trust_remote_code=True ...")))[:60]
    "--model 'org/m': its config asks to run the repository's own"
    """
    text = str(err)
    if "trust_remote_code" in text or "custom code" in text or "auto_map" in text:
        return ModelLoadError(
            f"--model {spec!r}: its config asks to run the repository's own Python code (an auto_map / "
            "trust_remote_code model); hf-gradfix never runs remote code. Give a model whose model_type transformers "
            "knows, or a config.json of a supported architecture with the same sizes."
        )
    chain, cause = [], err
    while cause is not None and len(chain) < 8:  # transformers 4.57 wraps torch's refusal in an OSError about TF
        chain.append(cause)
        cause = cause.__cause__ or cause.__context__
    refused = next((c for c in chain if "Weights only load failed" in str(c) or type(c).__name__ == "UnpicklingError"),
                   None)
    if refused is not None:
        blocked = next((line.strip() for line in str(refused).splitlines() if "GLOBAL" in line), "")
        return ModelLoadError(
            f"--model {spec!r}: its weights file is a pickle that holds more than tensors, and torch.load("
            f"weights_only=True) refused to run it{' (' + blocked + ')' if blocked else ''}; hf-gradfix never unpickles "
            "code. Give weights in safetensors (model.safetensors), or convert a checkpoint you trust.")
    first = text.strip().splitlines()[0] if text.strip() else type(err).__name__
    return ModelLoadError(
        f"--model {spec!r}: cannot load it ({type(err).__name__}: {first}). Give 'tiny', a local directory with a "
        "config.json (and weights where needed), or a hub id available offline."
    )
