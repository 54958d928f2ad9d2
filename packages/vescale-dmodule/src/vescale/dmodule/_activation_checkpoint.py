"""Activation checkpointing of chosen submodules, composed with TP, DDP, FSDP and HSDP.

`apply_activation_checkpointing` replaces the ``forward`` of each chosen
submodule **on the instance** (the class is untouched) by a call of
``torch.utils.checkpoint.checkpoint(forward, ..., use_reentrant=False)``: the
submodule keeps only its inputs for backward and recomputes its forward when
backward first needs one of its saved tensors. The submodule's own forward hooks
(plan input/output hooks, FSDP pre/post hooks) stay outside the checkpointed region
and run once; hooks of modules *inside* it run again during the recomputation.

During a recomputation (backward, so the parallel engines' forward state is gone)
the checkpoint's ``context_fn`` recreates what the original forward had:

* FSDP/HSDP (`FSDPEngine.recompute_context`): the groups enclosing the
  submodule are unsharded if needed and their unsharded parameters swapped in;
  groups inside it see the recomputation (``FSDPEngine.in_recompute``) and only
  unshard and swap in, without recording the forward order, prefetching,
  resharding, registering pre-backward hooks or wrapping inputs for post-backward.
* DDP: nothing (its parameters are plain tensors or the plan's DTensors).
* ``parallelize_module`` computing on the mesh without its replica dims
  (`vescale.dmodule._replica`): the submodule's own parameters and buffers are
  presented on the compute mesh again (the hooks that do it in the forward sit
  outside the checkpointed region).
* ``parallelize_module``'s implicit replication: the flag is set again, and plain
  tensors that the region saves for backward (causal masks, indices) are stored as
  replicated DTensors, in the original forward and in the recomputation alike (the
  checkpoint's own saved-tensor hooks would otherwise hide the module's).
"""

from __future__ import annotations

import contextlib
import dataclasses
import types
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from vescale.dmodule import _compat
from vescale.dmodule._dp_common import select_submodules
from vescale.dmodule._module_state import dp_engine, module_state

__all__ = ["apply_activation_checkpointing", "resolve_checkpoint_modules", "is_checkpointed"]

#: What ``activation_checkpointing=`` accepts.
Selection = bool | str | Sequence[str | nn.Module] | Callable[[str, nn.Module], bool]


@dataclasses.dataclass
class _ACState:
    root: nn.Module
    inner: Callable | None  # an instance-level forward that was there before
    preserve_rng_state: bool


def is_checkpointed(module: nn.Module) -> bool:
    """True if ``module``'s forward was wrapped by `apply_activation_checkpointing`."""
    state = module_state(module)
    return state is not None and state.checkpoint is not None


def _default_modules(model: nn.Module) -> list[str]:
    """The FSDP groups of ``model`` (root excluded), else every ``nn.ModuleList`` element."""
    from vescale.dmodule._fsdp_groups import default_groups

    engine = dp_engine(model)
    names = [] if engine is None else engine.checkpoint_candidates(model)
    return names or default_groups(model)


def resolve_checkpoint_modules(model: nn.Module, which: Selection) -> list[str]:
    """Names (``named_modules()``) of the submodules ``which`` selects, outermost only.

    Args:
        model: The model.
        which: ``True``: the FSDP groups if ``model`` has an FSDP engine, else every
            element of an ``nn.ModuleList`` (transformer blocks). A regex string or
            a list of regexes (full match against ``named_modules()`` names; each
            must match) and/or submodules. A predicate ``(name, module) -> bool``.
            ``False``/``None``: nothing.

    Raises:
        ValueError: A regex that matches no submodule, a module not in ``model``, or
            ``True`` for a model with no ``nn.ModuleList``.
        TypeError: Anything else.
    """
    what = "activation_checkpointing"
    if which is None or which is False:
        return []
    mods = dict(model.named_modules())
    if which is True:
        chosen = _default_modules(model)
        if not chosen:
            raise ValueError(
                f"{what}=True: {type(model).__name__} has no nn.ModuleList (transformer "
                "blocks) and no FSDP groups; name the submodules (regexes) or pass a "
                "predicate (name, module) -> bool"
            )
    elif isinstance(which, str):
        return resolve_checkpoint_modules(model, [which])
    elif (callable(which) and not isinstance(which, nn.Module)) or isinstance(which, (list, tuple)):
        chosen = select_submodules(model, which, what)
    else:
        raise TypeError(
            f"{what} must be True, a regex, a list of regexes/modules or a predicate "
            f"(name, module) -> bool; got {type(which).__name__}"
        )
    chosen = [n for n in dict.fromkeys(chosen) if n]  # never the root itself
    outer = [n for n in chosen if not any(n.startswith(o + ".") for o in chosen)]
    order = {n: i for i, n in enumerate(mods)}
    return sorted(outer, key=order.__getitem__)


def apply_activation_checkpointing(
    model: nn.Module, which: Selection = True, *, preserve_rng_state: bool = True
) -> list[str]:
    """Checkpoint the activations of the submodules ``which`` selects, in place.

    Each selected submodule's forward runs under
    ``torch.utils.checkpoint.checkpoint(..., use_reentrant=False)``; see the module
    docs for how it composes with the data-parallel engines and tensor parallelism.
    Apply it before or after `parallelize_module` /
    ``fully_shard`` / ``replicate`` (``DModule(..., activation_checkpointing=...)``
    applies it last). Modules already checkpointed are left as they are.

    Args:
        model: The model (the root of the engines and of ``which``'s names).
        which: See `resolve_checkpoint_modules`.
        preserve_rng_state: Restore the RNG state for the recomputation (dropout
            masks identical to the forward's).

    Returns:
        The names of the checkpointed submodules.
    """
    names = resolve_checkpoint_modules(model, which)
    for name in names:
        mod = model.get_submodule(name)
        if is_checkpointed(mod):
            continue
        inner = mod.__dict__.get("forward")
        module_state(mod, create=True).checkpoint = _ACState(model, inner, preserve_rng_state)
        mod.forward = types.MethodType(_checkpointed_forward, mod)
    return names


def _checkpointed_forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
    st: _ACState = module_state(self).checkpoint  # type: ignore[union-attr,assignment]
    fn = st.inner if st.inner is not None else types.MethodType(type(self).forward, self)
    if not torch.is_grad_enabled():
        return fn(*args, **kwargs)  # nothing is saved: no need to recompute

    def run(*a: Any) -> Any:
        return fn(*a, **kwargs)

    return checkpoint(
        run,
        *args,
        use_reentrant=False,
        preserve_rng_state=st.preserve_rng_state,
        context_fn=lambda: (_forward_context(st.root), _recompute_context(st.root, self)),
    )


def _engines(root: nn.Module) -> list[Any]:
    out: list[Any] = []
    for m in root.modules():
        engine = dp_engine(m)
        # one engine runs every module wrapped by per-layer-then-root fully_shard calls
        if engine is not None and not any(engine is e for e in out):
            out.append(engine)
    return out


def _implicit_replication(root: nn.Module) -> Any:
    state = module_state(root)
    return None if state is None or state.dmodule is None else state.dmodule.implicit


@contextlib.contextmanager
def _store_replicated(ir: Any) -> Iterator[None]:
    """Compose ``ir``'s pack conversion under the current (checkpoint's) saved-tensor hooks."""
    top = _compat.top_saved_tensors_hooks()
    if top is None:
        yield
        return
    pack, unpack = top
    with torch.autograd.graph.saved_tensors_hooks(lambda t: pack(ir._pack(t)), unpack):
        yield


def _forward_context(root: nn.Module) -> contextlib.AbstractContextManager:
    ir = _implicit_replication(root)
    return _store_replicated(ir) if ir is not None else contextlib.nullcontext()


@contextlib.contextmanager
def _recompute_context(root: nn.Module, module: nn.Module) -> Iterator[None]:
    from vescale.dmodule._hooks import _get_flag, _set_flag

    with contextlib.ExitStack() as stack:
        ir = _implicit_replication(root)
        if ir is not None:
            old = _get_flag()
            _set_flag(True)
            stack.callback(_set_flag, old)
            stack.enter_context(_store_replicated(ir))
        for engine in _engines(root):
            stack.enter_context(engine.recompute_context(module))
        state = module_state(root)
        replica = None if state is None or state.dmodule is None else state.dmodule.replica
        if replica is not None:  # the module's own tensors as its forward saw them
            stack.enter_context(replica.recompute_context(module))
        yield
