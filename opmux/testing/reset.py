"""The one reset for tests: a fresh runtime object, and what lives outside it undone.

Most process state is a field of the runtime object (:class:`opmux.core.state.Runtime`),
so replacing the object resets it. What outlives the object is undone here, in order:
the providers plugins added to the process-wide registry's ops (the ops themselves stay:
torch cannot undefine an op), each op's priorities and wiring, the tensor-parallel
process group opmux created, and the caches of derived data held by modules.
"""

from __future__ import annotations

import sys

from opmux._runtime import new_runtime
from opmux.core import forward_context, runners, state, switches, trace

__all__ = ["reset_for_tests"]


def reset_for_tests() -> None:
    """Return the process to its state after ``import opmux``: start-up runs again on the
    next op call, with the environment of that moment.

    Ops stay defined, catalog and plugin-defined ones included; only what plugins
    registered on them is rolled back.
    """
    old = state.runtime()
    registry = old.registry
    with old.plugins.lock:  # the plugins' registrations, undone
        for providers, ops in old.plugins.journal.kept.values():
            old.plugins.journal.rollback(providers, ops, forget_ops=False)
        for op in registry.known_ops():
            op.priorities.reset()
        registry.unload()
    if old.tensor_parallel is not None:  # a process group opmux may have created
        from opmux.distributed import destroy_tensor_parallel

        destroy_tensor_parallel()
    state.install(new_runtime(registry))
    switches.rewire_ops()  # every op wired for the new object's switch values
    trace.zero_counts()
    runners.runner_registry().clear()
    forward_context.leave_forward_context()
    # caches of modules that hold derived data (only if that module was ever imported)
    build_cache = sys.modules.get("opmux.plugins.build_cache")
    if build_cache is not None:
        build_cache.reset_statuses()
    dlpack = sys.modules.get("opmux.plugins.ascend.dlpack_provider")
    if dlpack is not None:
        dlpack.forget_views()
