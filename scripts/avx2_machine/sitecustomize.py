"""Loaded by every Python process under scripts/as_avx2_machine.sh: torch answers as an AVX2-only CPU.

vLLM picks its kernel library (``_C_AVX2`` or ``_C_AVX512``) and its attention backend from
``torch.cpu._is_*_supported()``, which read the CPU itself, not ``ATEN_CPU_CAPABILITY``; this makes
them say what an AVX2-only machine says. Runs only when the script puts this folder on PYTHONPATH.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys

_AVX512_AND_AMX = (
    "_is_avx512_supported",
    "_is_avx512_vnni_supported",
    "_is_avx512_bf16_supported",
    "_is_amx_tile_supported",
    "_is_amx_fp16_supported",
)


def _answer_as_avx2(torch_module) -> None:
    for name in _AVX512_AND_AMX:
        if hasattr(torch_module.cpu, name):
            setattr(torch_module.cpu, name, lambda: False)


class _PatchTorchAfterImport(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name != "torch":
            return None
        sys.meta_path.remove(self)
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None:
            return spec
        real_exec = spec.loader.exec_module

        def exec_then_patch(module):
            real_exec(module)
            _answer_as_avx2(module)

        spec.loader.exec_module = exec_then_patch
        return spec


sys.meta_path.insert(0, _PatchTorchAfterImport())
