"""Every private name of another library that hf_triaccel uses, in one list.

A private name (leading underscore) can change in any release without notice. Each entry
says what the package uses, the parameters it relies on (for a method it calls or
overrides) and where; :func:`missing_private_names` checks them against the installed
releases, and ``tests/integrations/test_private_api.py`` fails naming the entry when one
is gone or changed. Checked with transformers 5.17 and 5.25, accelerate 1.15, timm 1.0.29
and 1.0.31, torch 2.11 and 2.14 (the version sets in the README). Triton's private launch
names are used by the kernels and need a GPU to exercise; the GPU tests check them.

Example:
    >>> missing_private_names()
    []
"""

from __future__ import annotations

import importlib
import inspect
from dataclasses import dataclass


@dataclass(frozen=True)
class PrivateName:
    """One private name of another library.

    Attributes:
        module: the module to import.
        attribute: the dotted attribute path below it (its last part is the private name).
        parameters: parameter names the package passes or overrides, for a callable.
        used_by: where the package uses it, and why.
        assigned_in: for an instance attribute, the method (below ``module``) whose source
            must assign ``self.<name>``; the attribute is then not looked up on the class.
    """

    module: str
    attribute: str
    parameters: tuple[str, ...] = ()
    used_by: str = ""
    assigned_in: str = ""

    @property
    def name(self) -> str:
        """``module.attribute``, as the failure message names it."""
        return f"{self.module}.{self.attribute}"

    def problem(self) -> str | None:
        """Why the installed release breaks this use, or None when it holds."""
        try:
            found = importlib.import_module(self.module)
        except ImportError as err:
            return f"{self.name}: module {self.module} does not import ({err})"
        if self.assigned_in:
            owner = found
            for part in self.assigned_in.split("."):
                owner = getattr(owner, part, None)
            private = self.attribute.rsplit(".", 1)[-1]
            if owner is None or f"self.{private} =" not in inspect.getsource(owner):
                return f"{self.name}: not assigned in {self.assigned_in} (used by {self.used_by})"
            return None
        for part in self.attribute.split("."):
            if not hasattr(found, part):
                return f"{self.name}: no attribute {part!r} (used by {self.used_by})"
            found = getattr(found, part)
        if self.parameters:
            accepted = inspect.signature(found).parameters
            absent = [p for p in self.parameters if p not in accepted]
            if absent:
                return f"{self.name}: no parameter {absent} (used by {self.used_by})"
        return None


PRIVATE_NAMES: tuple[PrivateName, ...] = (
    PrivateName(
        "transformers",
        "Trainer._prepare_inputs",
        ("inputs",),
        "integrations.trainer_compat.prepare_inputs: the elastic batch's pieces to the device",
    ),
    PrivateName(
        "transformers",
        "Trainer._prepare_context_parallel_inputs",
        ("model", "inputs"),
        "integrations.trainer_compat.context_parallel_inputs: the training step's batch",
    ),
    PrivateName(
        "transformers",
        "Trainer._remove_unused_columns",
        ("dataset", "description"),
        "integrations.trainer_compat.ColumnsForPositionalModels: timm's forward(x)",
    ),
    PrivateName(
        "transformers",
        "Trainer._get_collator_with_removed_columns",
        ("data_collator", "description"),
        "integrations.trainer_compat.ColumnsForPositionalModels: timm's forward(x)",
    ),
    PrivateName(
        "transformers",
        "Trainer._clip_grad_norm",
        ("model",),
        "integrations.trainer_compat.KeptParameterClipping: one list of parameters",
    ),
    PrivateName(
        "transformers",
        "Trainer.save_model",
        ("output_dir", "_internal_call"),
        "integrations.trainer.TriAccelMixin.save_model: checkpoints told from user saves",
    ),
    PrivateName(
        "transformers",
        "Trainer._train_batch_size",
        used_by="integrations.trainer_compat.train_batch_size: the batch after "
        "auto_find_batch_size",
        assigned_in="Trainer.__init__",
    ),
    PrivateName(
        "timm.optim._optim_factory",
        "default_registry",
        (),
        "integrations.timm_optim: AdaFisher and AdaFisherW registered with timm's optimizers",
    ),
    PrivateName(
        "torch._dynamo.eval_frame",
        "OptimizedModule._orig_mod",
        used_by="integrations.compiled: the module a compiled model wraps",
        assigned_in="OptimizedModule.__init__",
    ),
)


def missing_private_names(names: tuple[PrivateName, ...] = PRIVATE_NAMES) -> list[str]:
    """One line per entry of ``names`` that the installed releases break.

    Example:
        >>> gone = PrivateName("json", "_no_such_name", used_by="an example")
        >>> missing_private_names((gone,))
        ["json._no_such_name: no attribute '_no_such_name' (used by an example)"]
    """
    return [p for p in (name.problem() for name in names) if p is not None]
