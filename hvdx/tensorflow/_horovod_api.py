"""Re-exporting a Horovod module's whole public API from an hvdx module, generated from
Horovod's module rather than listed by hand, so that "change the import only" holds for
every name a Horovod script uses.

A module calls `reexport(horovod_module, globals(), own=..., lazy=...)` after defining (or
importing) hvdx's names, and binds `__getattr__ = late(horovod_module, __name__, lazy,
exported)` for the names Horovod's module gains after that (its submodules, as they are
imported: Horovod imports some only when first used). Its `__all__` is computed by that
`__getattr__` on each access, so it lists those too.
"""
from __future__ import annotations

import importlib
import types
from typing import Any, Callable, Dict, Iterable, List

__all__ = ["late", "public_names", "reexport"]


def public_names(module: types.ModuleType) -> List[str]:
    """Every attribute of `module` that does not start with "_" (Horovod's modules define no
    `__all__`: this is what `from horovod... import *` binds)."""
    return sorted(name for name in dir(module) if not name.startswith("_"))


def _foreign_module(value: Any) -> bool:
    return isinstance(value, types.ModuleType) and not value.__name__.startswith("horovod")


def reexport(module: types.ModuleType, namespace: Dict[str, Any], own: Iterable[str],
             lazy: Iterable[str] = ()) -> List[str]:
    """Binds into `namespace` each public name of Horovod's `module` but hvdx's: `own` (bound
    in `namespace` already: hvdx's overrides and additions) and `lazy` (hvdx's submodules,
    imported on first use by `late`). Returns the `__all__` of `namespace`: Horovod's public
    names (less its modules from outside Horovod, tf, os, ..., which stay attributes) and
    hvdx's. Raises ImportError if `namespace` binds a Horovod name that `own` does not list
    (an override must be declared) or lacks one that it lists."""
    own, lazy = set(own), set(lazy)
    missing = sorted(own - set(namespace))
    if missing:
        raise ImportError(f"{namespace.get('__name__')}: declares {missing} but does not define them")
    for name in public_names(module):
        if name in lazy or name in own:
            continue
        if name in namespace:
            raise ImportError(f"{namespace.get('__name__')} binds Horovod's name {name!r}: list it in `own` "
                              "(an hvdx override) or rename it")
        namespace[name] = getattr(module, name)
    horovod = {name for name in public_names(module) if not _foreign_module(getattr(module, name))}
    return sorted(horovod | own | lazy)


def late(module: types.ModuleType, package: str, lazy: Iterable[str] = (),
         exported: Iterable[str] = ()) -> Callable[[str], Any]:
    """A module-level `__getattr__` (PEP 562) for `package`: a name in `lazy` is hvdx's
    submodule `package.name`, imported on first use; another public name is Horovod's
    `module`'s, if it has it (now); `__all__` is `exported` (what `reexport` returned) and
    the public names `module` has gained since (less modules from outside Horovod)."""
    lazy, exported = set(lazy), set(exported)

    def __getattr__(name: str) -> Any:
        if name == "__all__":
            return sorted(exported | {n for n in public_names(module) if not _foreign_module(getattr(module, n))})
        if name in lazy:
            return importlib.import_module(f"{package}.{name}")
        if not name.startswith("_") and hasattr(module, name):
            return getattr(module, name)
        raise AttributeError(f"module {package!r} has no attribute {name!r}")

    return __getattr__
