"""Tensor hooks that do not keep their owner alive.

torch stores the hooks of a tensor (``register_hook``,
``register_post_accumulate_grad_hook``) on the C++ side, where Python's garbage
collector cannot follow them. A hook whose closure refers to an engine that in turn
holds the parameter (through its module or its buckets) therefore forms a cycle that is
never collected: the module, its buffers and its process groups outlive every user
reference. Every vescale engine that hooks a parameter builds its hooks here.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

__all__ = ["weak_hook"]


def weak_hook(fn: Callable[..., Any], owner: object, *args: Any) -> Callable[..., Any]:
    """A hook that calls ``fn(owner, *args, *hook_args)`` while ``owner`` is alive.

    Args:
        fn: A function or an unbound method (``Engine._on_grad``, not
            ``engine._on_grad``, which would hold ``engine``).
        owner: Held by a weak reference; once it is collected the hook does nothing
            and returns ``None``.
        *args: Held strongly: indices, names and other values that do not refer
            back to the hooked tensor.

    Returns:
        A callable to pass to a tensor's ``register_hook`` or
        ``register_post_accumulate_grad_hook``.

    Example:
        ```python
        handle = param.register_post_accumulate_grad_hook(
            weak_hook(Engine._on_grad, engine, bucket_index)
        )
        ```
    """
    ref = weakref.ref(owner)

    def hook(*hook_args: Any) -> Any:
        obj = ref()
        if obj is None:
            return None
        return fn(obj, *args, *hook_args)

    return hook
