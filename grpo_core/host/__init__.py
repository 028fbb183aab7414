"""Finding and loading what a run is built from: plugins (entry points,
local modules), the user code a config names, and objects a script hands
to :func:`grpo.train`. Depends on the contract only.
"""
