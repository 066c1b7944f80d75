"""Importing Triton and choosing how its kernels run: compiled on a GPU, or under the interpreter.

How Triton 3.9 reads ``TRITON_INTERPRET``: ``triton.knobs.runtime.interpret`` consults the
environment on every access, and ``@triton.jit`` looks at it when it *decorates* a function,
returning an ``InterpretedFunction`` (run on the CPU with NumPy) when it is set and a compiled
``JITFunction`` otherwise. Two consequences:

* Triton's own library functions (``tl.max``, ``tl.sum``, ``tl.cdiv``...) are decorated once, when
  ``triton`` is imported, in the mode of that moment. Our kernels therefore call no such function
  (reductions go through ``tl.reduce`` with the library's combine functions, which the interpreter
  recognises), so the interpreter works even when ``triton`` was imported before the variable was
  set. The reverse cannot work: a library imported under the interpreter cannot be compiled, and
  :func:`select_mode` says so.
* Our kernels are decorated when their module is imported; :func:`for_mode` re-wraps them from
  their Python source when the mode chosen at backend construction differs.
"""

from __future__ import annotations

import contextlib
import types
from typing import Any

import torch

from kvpolicy.errors import ConfigError

_rewrapped: dict[tuple[Any, bool], Any] = {}


def import_triton() -> Any:
    """Import and return the ``triton`` module.

    Raises
    ------
    MissingDependencyError
        (a :class:`ConfigError`) naming ``pip install "kvpolicy[triton]"`` when it is not installed.
    """
    from kvpolicy.backends._optional import require

    return require("triton", "triton", '"kvpolicy[triton]"')


def interpreter_requested() -> bool:
    """Whether Triton's interpreter is switched on (``TRITON_INTERPRET=1`` or ``triton.knobs``)."""
    from triton import knobs

    return bool(knobs.runtime.interpret)


def library_interpreted() -> bool:
    """Whether Triton's own library functions were decorated for the interpreter (at ``import triton``)."""
    from triton.language import standard
    from triton.runtime.interpreter import InterpretedFunction

    return isinstance(standard._elementwise_max, InterpretedFunction)


def select_mode() -> str:
    """``"interpret"`` when the interpreter is on, ``"compiled"`` when a CUDA GPU is there.

    Raises
    ------
    ConfigError
        Neither: there is nothing the kernels could run on.
    """
    import_triton()
    if interpreter_requested():
        # Triton imports its Gluon package on the first launch, asserting that the interpreter is on
        # if the library was decorated for it; import it now, while it is, so later launches do not
        # depend on the variable staying set.
        with contextlib.suppress(ImportError):
            import triton.experimental.gluon  # noqa: F401
        return "interpret"
    if torch.cuda.is_available():
        if library_interpreted():
            raise ConfigError(
                "backend 'triton' cannot compile its kernels: triton was imported while TRITON_INTERPRET was set, "
                "so Triton's own library runs only under the interpreter in this process; set TRITON_INTERPRET=1 "
                "to use the interpreter, or unset it before triton is first imported (a new process)"
            )
        return "compiled"
    raise ConfigError(
        "backend 'triton' runs its kernels compiled on a CUDA GPU, and no GPU is available "
        "(torch.cuda.is_available() is False); on a CPU it runs only under Triton's interpreter: set the "
        "environment variable TRITON_INTERPRET=1 (slow, meant for tests and debugging), or use backend='torch'"
    )


def for_mode(kernel: Any, interpret: bool) -> Any:
    """``kernel`` (a ``@triton.jit`` object) as an interpreted or a compiled kernel.

    Every ``@triton.jit`` function of the kernel's module (its helpers: kvpolicy's own) is re-wrapped with it,
    over one shared copy of the module's globals in which each of them is in the new mode, so that helpers
    calling helpers stay in that mode too. The module itself is left as it was imported.
    """
    from triton.runtime.interpreter import InterpretedFunction

    if isinstance(kernel, InterpretedFunction) == interpret:
        return kernel
    key = (kernel.fn, interpret)
    if key not in _rewrapped:
        _rewrap_module(kernel.fn, interpret)
    return _rewrapped[key]


def _options(kernel: Any) -> dict[str, Any]:
    """The decorator arguments of a ``@triton.jit`` object that matter to a re-wrap (``do_not_specialize``)."""
    from triton.runtime.interpreter import InterpretedFunction

    if isinstance(kernel, InterpretedFunction):  # it keeps its decorator's arguments in ``kwargs``
        named = kernel.kwargs.get("do_not_specialize")
    else:
        named = kernel.do_not_specialize
    return {"do_not_specialize": list(named)} if named else {}


def _rewrap_module(fn: Any, interpret: bool) -> None:
    """Re-wrap every ``@triton.jit`` function of ``fn``'s module for ``interpret`` (see :func:`for_mode`)."""
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction

    jitted = {
        name: value
        for name, value in fn.__globals__.items()
        if isinstance(value, (InterpretedFunction, JITFunction))
        and getattr(value.fn, "__module__", None) == fn.__module__
    }
    scope = dict(fn.__globals__)
    for name, kernel in jitted.items():
        original = kernel.fn
        copy = types.FunctionType(original.__code__, scope, original.__name__, original.__defaults__,
                                  original.__closure__)  # fmt: skip
        copy.__module__, copy.__qualname__, copy.__doc__ = original.__module__, original.__qualname__, original.__doc__
        copy.__kwdefaults__ = original.__kwdefaults__
        options = _options(kernel)
        wrapped = InterpretedFunction(copy, **options) if interpret else JITFunction(copy, **options)
        scope[name] = wrapped
        _rewrapped[(original, interpret)] = wrapped


def next_pow2(n: int) -> int:
    """The smallest power of two ``>= n`` (and ``>= 1``)."""
    return 1 << max(0, int(n) - 1).bit_length()
