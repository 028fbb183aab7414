"""How people start grpo: the ``grpo`` command line, its tools around a run
(``report``, ``rewards test``, ``eval``, ``merge``), the multi-process
launcher, and the Python entry point :func:`grpo.train`. The top layer:
nothing below imports it.
"""
