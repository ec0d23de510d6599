"""``modelrunner new-plugin``: a working skeleton of a plugin distribution, for each kind."""

from __future__ import annotations

import re
from pathlib import Path

from .templates import (
    ADAPTER_TRANSFORMERS,
    DEPENDENCIES,
    KINDS,
    LLAMA_SHAPED,
    MODULES,
    PYPROJECT,
    README,
    SUMMARIES,
    TEST,
    TEST_OPTIONS,
    USAGE,
)

NAME = re.compile(r"^[a-z][a-z0-9_]{0,40}$")
"""Plugin names: lowercase letters, digits and underscores, starting with a letter."""


def adapter_architecture(name: str) -> tuple[str, str | None]:
    """``(architecture, model_type)`` of an adapter called ``name``: transformers' causal-LM class when
    ``name`` is one of its model types (``gpt_neox`` → ``GPTNeoXForCausalLM``), else ``<Name>ForCausalLM``
    with no model type."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    for model_type in (name, name.replace("_", "-")):
        if model_type in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
            return MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[model_type], model_type
    return "".join(part.capitalize() for part in name.split("_")) + "ForCausalLM", None


def new_plugin(kind: str, name: str, directory: str | Path = ".") -> Path:
    """Write the skeleton of a ``kind`` plugin called ``name`` into ``directory/modelrunner-<name>``.

    :returns: the distribution's folder.
    :raises ValueError: an unknown kind, a bad name, or a folder that already exists (nothing is overwritten).
    """
    if kind not in KINDS:
        raise ValueError(f"unknown plugin kind {kind!r}; kinds: {', '.join(KINDS)}")
    if not NAME.match(name):
        raise ValueError(f"plugin name {name!r} must be lowercase letters, digits and underscores, starting with "
                         "a letter (it becomes the entry point, the module and the registered name)")
    dist = "modelrunner-" + name.replace("_", "-")
    module = f"modelrunner_{name}"
    cls = "".join(part.capitalize() for part in name.split("_"))
    target = Path(directory) / dist
    if target.exists():
        raise ValueError(f"{target} already exists; pick another name or --output")
    fields = {"name": name, "cls": cls, "dist": dist, "module": module, "entry": name,
              "dependencies": ", ".join(f'"{d}"' for d in DEPENDENCIES.get(kind, ("modelrunner",)))}
    template = MODULES[kind]
    registered = name
    if kind == "adapter":
        # A transformers family the kernel's Llama-shaped decoder cannot load starts on transformers'
        # own model; any other name is a Llama-shaped architecture of its own (model_type "llama").
        registered, model_type = adapter_architecture(name)
        fields.update(arch=registered, model_type=', model_type="llama"' if model_type is None else "",
                      arch_note="Llama-shaped: their config's model_type is ``llama``" if model_type is None
                      else f"transformers' model_type ``{model_type}``")
        if model_type is not None and model_type not in LLAMA_SHAPED:
            template = ADAPTER_TRANSFORMERS
            fields["model_type"] = model_type
    fields["summary"] = SUMMARIES[kind].format(**fields)
    imports, options = TEST_OPTIONS.get(kind, ("", ""))
    files = {
        "pyproject.toml": PYPROJECT.format(**fields),
        "README.md": README.format(**fields, usage=USAGE[kind].format(**fields)),
        f"{module}/__init__.py": template.format(**fields),
        "tests/test_conformance.py": TEST.format(kind=KINDS[kind], name=registered, imports=imports,
                                                  options=options.format(**fields)),
    }
    for relative, text in files.items():
        path = target / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return target


__all__ = ["KINDS", "adapter_architecture", "new_plugin"]
