"""``python -m hf_gradfix`` == the ``hf-gradfix`` command."""

import sys

from .cli import main

sys.exit(main())
