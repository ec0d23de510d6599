"""Loading, in one place: from the user's ``model`` string to a loaded model.

- :mod:`.source`: resolve ``model`` (a directory, a ``.gguf`` file, ``smollm2``) to a
  :class:`~.source.ModelSource` — its config, tokenizer and tensors;
- :mod:`.gguf_file` and :mod:`.gguf_metadata`: a GGUF file read in place (metadata, tensor table,
  config, tokenizer, tensors under Hugging Face names, blocks kept as stored);
- :mod:`.weights`: safetensors checkpoints, and ``load_weights`` / ``materialize``, which put
  ``(name, tensor)`` pairs into a model built on the meta device;
- :mod:`.build`: what an adapter's ``load`` hook calls (``build_and_load``, ``loaded_for``);
- :mod:`.loader`: how the runner calls the ``load`` hooks (the adapter chosen, the time bound, the checks
  on what comes back).

Plugins import these names from :mod:`modelrunner.api`.
"""

from .build import build_and_load, kv_cache_spec_for, load_tokenizer, loaded_for
from .gguf_file import GGUFCheckpoint
from .loader import ModelLoader, adapter_for
from .source import ModelSource, resolve_source
from .weights import CheckpointError, iter_weights, load_weights, materialize

__all__ = [
    "CheckpointError",
    "GGUFCheckpoint",
    "ModelLoader",
    "ModelSource",
    "adapter_for",
    "build_and_load",
    "iter_weights",
    "kv_cache_spec_for",
    "load_tokenizer",
    "load_weights",
    "loaded_for",
    "materialize",
    "resolve_source",
]
