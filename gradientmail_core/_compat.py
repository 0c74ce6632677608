"""Old import paths keep working: ``gradientmail_core.file_mailbox`` is ``gradientmail_core.mailbox.file``.

Until 0.1 the core was 30 flat modules. Code written against them (``from gradientmail_core.config
import DiLoCo`` still works as it is; ``from gradientmail_core.file_mailbox import FileMailbox``
needs this) finds each old name as an alias of the module that replaced it: the very same module
object, loaded only when first imported, so aliases cost nothing and patches made through either
name are seen through both.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
from types import ModuleType

# old flat module -> its home now (relative to the package)
MOVED = {
    "keys": "protocol.keys",
    "records": "protocol.records",
    "schedule": "protocol.schedule",
    "run": "protocol.run",
    "lease": "protocol.lease",
    "store": "protocol.store",
    "guard": "protocol.guard",
    "auth": "protocol.auth",
    "partition": "protocol.partition",
    "overview": "cli.overview",
    "memory_mailbox": "mailbox.memory",
    "file_mailbox": "mailbox.file",
    "s3_mailbox": "mailbox.s3",
    "node": "syncer.node",
    "closer": "syncer.closer",
    "learner": "syncer.learner",
    "bridge": "syncer.bridge",
    "timing": "syncer.timing",
    "merge": "aggregators.merge",
    "outer": "aggregators.outer",
    "acceptance": "aggregators.acceptance",
    "payload": "codec.payload",
    "safetensors_io": "codec.safetensors_io",
    "quant": "codec.quant",
    "compress": "codec.compress",
}


class _Alias(importlib.abc.Loader):
    def __init__(self, target: str) -> None:
        self.target = target

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        module = importlib.import_module(self.target)
        self._spec = module.__spec__
        return module

    def exec_module(self, module: ModuleType) -> None:
        # The target ran its own code when it was imported; importlib has just pointed its
        # ``__spec__`` at the alias, so point it back.
        module.__spec__ = self._spec


class _OldPaths(importlib.abc.MetaPathFinder):
    def __init__(self, package: str) -> None:
        self.package = package

    def find_spec(
        self, fullname: str, path: object = None, target: object = None
    ) -> importlib.machinery.ModuleSpec | None:
        old = fullname[len(self.package) + 1 :] if fullname.startswith(self.package + ".") else None
        if old not in MOVED:
            return None
        return importlib.machinery.ModuleSpec(fullname, _Alias(f"{self.package}.{MOVED[old]}"))


def install(package: str) -> None:
    if not any(isinstance(f, _OldPaths) and f.package == package for f in sys.meta_path):
        sys.meta_path.append(_OldPaths(package))
