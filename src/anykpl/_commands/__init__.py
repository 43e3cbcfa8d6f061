"""The tools the ``anykpl`` command runs (``cli.py``): the demo, the bench, the emulator's
statistics, the fleet's allocator and table commands. They use the library; the library never
imports them (tests/test_layout.py keeps it so).
"""
