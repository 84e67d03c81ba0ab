"""The diagnostics glue: callbacks and checks that report on a run (noise scale :mod:`.gns`, memory
:mod:`.memory_timeline`, the non-finite guard :mod:`.nonfinite`) and what hf_gradfix prints (:mod:`.start_line`,
:mod:`.explained_warnings`, :mod:`.first_run`).
"""
