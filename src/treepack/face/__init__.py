"""The face: the command line, ``verify`` and the benchmark. Nothing imports it."""
