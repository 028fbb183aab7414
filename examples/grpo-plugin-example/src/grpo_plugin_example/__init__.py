"""Example grpo plugin package.

* :func:`grpo_plugin_example.rewards.length_bonus`, published under
  ``grpo.reward`` as ``length_bonus``;
* :class:`grpo_plugin_example.ranking.RankAdvantages`, published under
  ``grpo.advantage_aggregation`` as ``rank``;
* :class:`grpo_plugin_example.weight_sync.SafetensorsDirSync`, published
  under ``grpo.weight_sync`` as ``safetensors_dir``.

Modules import nothing heavy at import time, so ``grpo plugins`` (which
imports every published implementation to check it) stays fast.
"""

__version__ = "0.1.0"
