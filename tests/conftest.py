import os
import sys
from pathlib import Path

import torch

# Without a GPU, Triton kernels run in Triton's interpreter (numpy on the CPU); it is read when a
# kernel is defined, so it must be set before blockspec is imported.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def patch_language_once_per_launch() -> None:
    """Triton's interpreter patches triton.language for the interpreter at each kernel launch and again at
    every call of a nested @triton.jit helper (a product's inner step runs once per tile), each time through
    inspect.getmembers of four modules: a third of the kernels' time on the CPU. Inside a launch the modules
    are already patched, so a helper's call that would patch the same modules is skipped; the launch's own
    patch and its undoing are Triton's."""
    try:
        from triton.runtime import interpreter
    except ImportError:
        return
    patch = getattr(interpreter, "_patch_lang", None)
    if patch is None or getattr(patch, "once_per_launch", False):
        return
    patched: set[int] = set()

    def languages(fn) -> set[int]:
        return {id(v) for v in fn.__globals__.values() if v is interpreter.tl or v is interpreter.tl.core}

    def patch_once(fn):
        wanted = languages(fn)
        if patched and wanted <= patched:
            return interpreter._LangPatchScope()
        scope = patch(fn)
        undo = scope.restore

        def restore() -> None:
            patched.clear()
            undo()

        patched.update(wanted)
        scope.restore = restore
        return scope

    patch_once.once_per_launch = True
    interpreter._patch_lang = patch_once


if os.environ.get("TRITON_INTERPRET") == "1":
    patch_language_once_per_launch()

sys.path.insert(0, str(Path(__file__).parent))
# The test models are tiny: one thread avoids thread start-up and oversubscription on 2-core CI.
torch.set_num_threads(1)
