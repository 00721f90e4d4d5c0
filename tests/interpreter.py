"""Triton's interpreter without its repeated language patching (the test suite's CPU runs).

Under ``TRITON_INTERPRET=1`` a launch patches ``triton.language`` (every builtin rerouted to
the interpreter) and restores it when the launch ends. Triton 3.x also patches it again on every
call of a ``@triton.jit`` device function inside the launch, listing each module's members with
``inspect.getmembers`` every time, which is nearly half of an interpreted backward's time. The
second patching finds the language already patched, so :func:`skip_repatching` skips it where
the launch has patched every language module the device function sees: the kernels run the same
interpreted code, only sooner. Where Triton lacks the internals named here it changes nothing.
"""

from __future__ import annotations

import functools
import threading


def skip_repatching() -> bool:
    """Skip the device functions' repatching inside a launch; whether the interpreter has the
    internals to do so (else it is left as it is)."""
    try:
        import triton.language as tl
        from triton.runtime import interpreter

        launch, patch_lang, scope = (
            interpreter.GridExecutor.__call__,
            interpreter._patch_lang,
            interpreter._LangPatchScope,
        )
    except (ImportError, AttributeError):
        return False
    if getattr(patch_lang, "skips_repatching", False):
        return True
    state = threading.local()  # .patched: the language modules this thread's launch has patched

    def languages(fn) -> set[int]:
        return {id(v) for v in fn.__globals__.values() if v is tl or v is tl.core}

    @functools.wraps(patch_lang)
    def patch_once(fn):
        patched = getattr(state, "patched", None)
        if patched is None:  # outside a launch: as Triton does
            return patch_lang(fn)
        wanted = languages(fn)
        if wanted <= patched:  # patched by this launch already
            return scope()
        patched |= wanted
        return patch_lang(fn)

    @functools.wraps(launch)
    def tracked_launch(self, *args, **kwargs):
        outer, state.patched = getattr(state, "patched", None), set()
        try:
            return launch(self, *args, **kwargs)
        finally:
            state.patched = outer

    patch_once.skips_repatching = True
    interpreter._patch_lang = patch_once
    interpreter.GridExecutor.__call__ = tracked_launch
    return True
