"""Trainer integrations for gradientmail: PyTorch Lightning, Hugging Face Accelerate, the
Hugging Face ``transformers.Trainer`` (TRL's trainers too) and Keras 3's ``model.fit``.

    from gradientmail_lightning import MailboxDiLoCoStrategy
    trainer = Trainer(strategy=MailboxDiLoCoStrategy(algorithm=gm.DiLoCo(sync_every=100, fragments=4),
                                                     mailbox="file:///shared/run-1"))

    import gradientmail_lightning  # adds Accelerator.register_gradientmail
    handle = accelerator.register_gradientmail(model, optimizer, algorithm=..., mailbox=...)

    from gradientmail_lightning import GradientMailTrainerCallback
    trainer = transformers.Trainer(..., callbacks=[GradientMailTrainerCallback(algorithm=..., mailbox=...)])

    from gradientmail_lightning import GradientMailKerasCallback
    model.fit(x, y, callbacks=[GradientMailKerasCallback(algorithm=..., mailbox=..., samples_per_batch=32)])

Lightning loads when one of its classes is first used; a missing framework raises
``gm.MissingExtra`` naming the extra to install. Importing this package imports Accelerate
when it is installed, to add ``register_gradientmail`` to ``accelerate.Accelerator``.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from gradientmail_core.errors import MissingExtra

if TYPE_CHECKING:
    from .accelerate import GradientMailHandle, register_gradientmail
    from .callback import GradientMailCallback
    from .hf_trainer import GradientMailTrainerCallback
    from .keras import GradientMailKerasCallback
    from .strategy import MailboxDiLoCoStrategy

_LAZY = {
    "GradientMailCallback": ("callback", "lightning"),
    "MailboxDiLoCoStrategy": ("strategy", "lightning"),
    "GradientMailTrainerCallback": ("hf_trainer", "transformers"),
    "GradientMailKerasCallback": ("keras", "keras"),
    "GradientMailHandle": ("accelerate", "accelerate"),
    "register_gradientmail": ("accelerate", "accelerate"),
}


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module 'gradientmail_lightning' has no attribute {name!r}")
    module, extra = _LAZY[name]
    try:
        mod = importlib.import_module(f".{module}", __name__)
    except MissingExtra:
        raise
    except ImportError as e:  # e.g. torch itself missing under the framework
        raise MissingExtra(extra) from e
    return getattr(mod, name)


try:  # Accelerator.register_gradientmail exists as soon as this package is imported
    from . import accelerate as _accelerate  # noqa: F401
except ImportError:  # MissingExtra included: without Accelerate there is nothing to add
    pass

__all__ = [
    "GradientMailCallback",
    "GradientMailHandle",
    "GradientMailKerasCallback",
    "GradientMailTrainerCallback",
    "MailboxDiLoCoStrategy",
    "register_gradientmail",
]
