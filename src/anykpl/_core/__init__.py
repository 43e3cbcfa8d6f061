"""The sans-IO core: what happens to a record, with no event loop, no network and no clock of
its own (time is passed in). Nothing here imports anyio, trio or botocore, or anything outside
this package but :mod:`anykpl.errors`, :mod:`anykpl.config` and ``_compat``
(tests/test_layout.py keeps it so); it is what the compiled build compiles (mypyc,
hatch_build.py). The runtime (``_runtime/``) drives it.
"""
