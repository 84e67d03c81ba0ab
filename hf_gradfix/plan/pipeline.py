"""The planner's pipeline arithmetic: :mod:`hf_gradfix.parallel.pipeline_schedule` (moved there so that ``config``
can use the same bubble formula without importing the planner); this name stays for existing imports.

>>> bubble_fraction(PipelineSpec(4, "1f1b", 1, 8))   # (p-1)/(m+p-1)
0.2727272727272727
"""

from ..parallel.pipeline_schedule import (SCHEDULES, PipelineSpec, bubble_fraction, check_pipeline,  # noqa: F401
                                          chunk_layer_counts, in_flight, stage_chunks, stage_layers)
from ..parallel.pipeline_schedule import __all__  # noqa: F401
