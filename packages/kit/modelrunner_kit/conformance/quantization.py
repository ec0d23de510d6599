"""The conformance suite of a quantization method: a tiny Llama (and a tiny Mixtral, when the method
covers fused-MoE experts) loaded with ``quantization=NAME``, against the same model in dense floats.

A method that refuses a float checkpoint (``check_source``) is checked on a GGUF file of the same
tiny Llama (:func:`~.gguf.write_llama_gguf`), whose dense reference is that file read with
``quantization="none"``; give ``checkpoint=`` for a method that runs neither. A method checked on
floats is also fed that GGUF file (what the default model is), which it must refuse up front or run.

Each covered layer is compared with the checkpoint's own float weight (the layer loaded with
``quantization="none"``) by the least-squares gain of its outputs: the format's rounding leaves it at
1, a storage-side error of 1% in a single layer does not — which the logits check cannot tell apart.
"""

from __future__ import annotations

import os
from functools import cached_property
from pathlib import Path
from typing import Any

from .base import Check, ConformanceError, NotApplicable, Suite, expect
from .models import make_llm, scratch_root, tiny_checkpoint

BLOCK_SIZE = 4
"""KV-cache block size of every run (the prompts span several blocks)."""
PROMPTS = {0: [5, 9, 2, 77, 31, 8, 100], 1: [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5]}
"""Two prompts prefilled together, then one decode step each."""
DECODE = {0: [11], 1: [12]}
"""The decode step after :data:`PROMPTS`."""
OTHER_PROMPT = [40, 7, 7, 123, 90, 5, 5, 44]
"""The batch-mate of the batch-independence check (with ``PROMPTS[0]``: 15 rows, one kernel bucket)."""
LAYER_ROWS = (1, 40)
"""Input rows of each call of the per-layer check: one decode-sized and one batch-sized input (each kernel choice)."""
LAYER_SAMPLES = 256
"""Input rows per layer and row count of the per-layer check: enough outputs that the format's rounding
moves the least-squares gain by well under :data:`GAIN_TOLERANCE`."""
GAIN_TOLERANCE = 0.005
"""Largest |gain − 1| of a layer's output against the float weight's, the gain being the least-squares
fit ``g = <got, want> / <want, want>``: rounding errors are uncorrelated with the output and leave it
near 1 (int4/g32 on these shapes: within 0.004 in 800 random draws), while a weight or scale off by 1%
moves it by about 0.01 (at least 0.007 in the same draws)."""
BATCH_ATOL = 1e-5
"""Largest |logit difference| of a row alone and the same row in a batch."""
DETERMINISM_ATOL = 0.0
"""Largest |logit difference| of the same batch run twice."""
TP_ATOL = 1e-5
"""Largest |logit difference| of two tensor-parallel ranks and one process."""
INVALID = type("InvalidOptionValue", (), {"__repr__": lambda self: "<invalid option value>"})()
"""A value no option accepts (given to each option in turn by the options check)."""
UNKNOWN_OPTION = "no_such_option_xyz"
"""An option name no method has."""
_ALLOW_ENV, _BLOCK_ENV = "MODELRUNNER_PLUGINS", "MODELRUNNER_BLOCK_PLUGINS"


def _env_names(var: str) -> list[str] | None:
    value = os.environ.get(var)
    return None if value is None else [n.strip() for n in value.split(",") if n.strip()]


def least_squares_gain(got: Any, want: Any) -> tuple[float, float]:
    """``(g, r)``: the gain ``g`` that best fits ``got ≈ g · want`` (least squares), and the RMS of
    ``got − g · want`` relative to the RMS of ``want`` (inf, inf when non-finite)."""
    got, want = got.double().reshape(-1), want.double().reshape(-1)
    power = want.dot(want).item()
    if not (got.isfinite().all() and power > 0):
        return float("inf"), float("inf")
    gain = got.dot(want).item() / power
    residual = ((got - gain * want).square().sum().item() / power) ** 0.5
    return gain, residual


def _relative(got: Any, want: Any) -> float:
    """max |got − want| / max |want| (inf when non-finite)."""
    import torch

    diff = (got.float() - want.float()).abs().max()
    if not torch.isfinite(diff):
        return float("inf")
    return diff.item() / max(want.float().abs().max().item(), 1e-30)


class QuantizationMethodSuite(Suite):
    """The checks of one quantization method on tiny models.

    :param name: the method (``int4``).
    :param plugins: the loaded plugins (default: the process's).
    :param plugin: the plugin providing it (default: the one the kernel would pick).
    :param checkpoint: a checkpoint (directory or ``.gguf``) to check the method on instead of the tiny Llama.
    :param root: where tiny checkpoints are written (default: this process's scratch folder).
    :param seed: the tiny checkpoints' weight seed.
    :param options: the method's ``quantization_options`` for every run.
    :param tensor_parallel: run the ``tensor-parallel=2`` check (it starts a worker process); False
        reports it skipped.
    :raises ValueError: no loaded plugin provides ``name``, or ``plugin`` does not.
    """

    kind = "quantization_methods"

    def __init__(self, name: str, plugins: Any = None, plugin: str | None = None, checkpoint: str | Path | None = None,
                 root: str | Path | None = None, seed: int = 0, options: dict[str, Any] | None = None,
                 tensor_parallel: bool = True) -> None:
        super().__init__(name, plugins, plugin)
        providers = self.plugins.registry.providers["quantization_methods"].get(name, [])
        if self.plugin is None:
            self.plugin = self.plugins.require("quantization_methods", name)
        elif self.plugin not in providers:
            raise ValueError(f"plugin {self.plugin!r} does not provide quantization method {name!r}; it is provided "
                             f"by {', '.join(map(repr, providers)) or 'no loaded plugin'}")
        self.method_class = self.plugins.registry.get_class("quantization_methods", name, self.plugin)
        """The method's class."""
        self.quantization = name if len(providers) == 1 else f"{self.plugin}:{name}"
        """The ``quantization`` config value that picks this plugin's method."""
        self.options = dict(options or {})
        """``quantization_options`` of every run."""
        self.root = Path(root) if root is not None else scratch_root()
        """Where tiny checkpoints go."""
        self.seed = seed
        """The tiny checkpoints' seed."""
        self.tensor_parallel = tensor_parallel
        """Whether the tensor-parallel check runs."""
        self._checkpoint = None if checkpoint is None else Path(checkpoint)
        self._models: dict[tuple[str, str], Any] = {}
        self._methods: dict[tuple[str, str], Any] = {}

    # -- set-up, built once and shared by the checks ---------------------------------------------

    @cached_property
    def llama(self) -> Path:
        """The tiny float Llama checkpoint."""
        return tiny_checkpoint("LlamaForCausalLM", self.root, self.seed)

    @cached_property
    def llama_gguf(self) -> Path:
        """The tiny Llama as a GGUF file (Q4_0 attention, Q4_1 MLP, Q8_0 embedding and head)."""
        from .gguf import write_llama_gguf

        path = self.root / f"LlamaForCausalLM-seed{self.seed}.gguf"
        return path if path.is_file() else write_llama_gguf(self.llama, path)

    def _refusal(self, path: Path) -> str | None:
        """Why the method refuses the checkpoint at ``path`` (None: it runs it)."""
        from modelrunner.loading.source import resolve_source  # kernel internal: reads a checkpoint as the runner does

        source = resolve_source(str(path))
        try:
            self.method_class(self.options, None).check_source(source)
        except ValueError as e:
            return str(e)
        finally:
            getattr(source, "release_weights", lambda: None)()
        return None

    @cached_property
    def subject(self) -> Path:
        """The Llama checkpoint the method runs: ``checkpoint=``, else the float one, else the GGUF file.

        :raises NotApplicable: the method refuses each.
        """
        candidates = [self._checkpoint] if self._checkpoint is not None else [self.llama, self.llama_gguf]
        reasons = []
        for path in candidates:
            reason = self._refusal(path)
            if reason is None:
                return path
            reasons.append(reason)
        raise NotApplicable(f"quantization {self.name!r} runs none of the suite's checkpoints ({'; '.join(reasons)}); "
                            "give the suite checkpoint=")

    @cached_property
    def mixtral(self) -> Path:
        """The tiny float Mixtral checkpoint (fused-MoE experts), when the method runs float checkpoints.

        :raises NotApplicable: it does not.
        """
        if self._checkpoint is not None:
            raise NotApplicable("the suite was given checkpoint= and checks that checkpoint only")
        if self.subject != self.llama:
            raise NotApplicable(f"quantization {self.name!r} is checked on {self.subject.name}, not on float "
                                "checkpoints, so not on an MoE model")
        return tiny_checkpoint("MixtralForCausalLM", self.root, self.seed)

    def config(self, quantization: str, **overrides: Any) -> dict[str, Any]:
        """The flat config of a run: ``quantization`` with the suite's options (none for ``none``)."""
        config: dict[str, Any] = {"quantization": quantization, "block_size": BLOCK_SIZE}
        if quantization != "none" and self.options:
            config["quantization_options"] = dict(self.options)
        config.update(overrides)
        return config

    def model(self, path: Path, quantization: str) -> Any:
        """``path`` loaded by its adapter with ``quantization`` (an :class:`~modelrunner_kit.testing.AdapterUnderTest`;
        the method instance that prepared it is :meth:`method_of` it)."""
        import attrs

        from modelrunner.api import RunnerConfig

        # Kernel internals: the model is loaded as the runner loads it.
        from modelrunner.cache_dir import cache_root  # the kernel's cache folder
        from modelrunner.capabilities import runs_quantization  # the table `plugins --matrix` prints
        from modelrunner.quantization import select_quantization  # picks the method as the runner does
        from modelrunner.loading.source import resolve_source  # reads a checkpoint as the runner does

        from ..testing import load_adapter

        key = (str(path), quantization)
        if key not in self._models:
            config = RunnerConfig.from_dict(self.config(quantization))
            source = resolve_source(str(path))
            method = select_quantization(config.model.quantization, config.model.quantization_options, source,
                                         self.plugins, cache_root(config.model.cache_dir))
            model = load_adapter(attrs.evolve(source, quantization=method), config, plugins=self.plugins)
            self._methods[key] = method
            loaded = model.loaded
            architecture = (getattr(loaded.hf_config, "architectures", None) or ["?"])[0]
            if loaded.kv_cache_spec is None or not runs_quantization(self.plugins, architecture, loaded.adapter,
                                                                     self.name):
                raise ValueError(f"{path.name} ({architecture}) is loaded by adapter {loaded.adapter!r}, which does not "
                                 f"run quantization {self.name!r} on the kernel's layers; the suite needs an adapter "
                                 "that does (e.g. modelrunner-llama and modelrunner-moe) among the plugins")
            self._models[key] = model
        return self._models[key]

    def method_of(self, path: Path, quantization: str) -> Any:
        """The method instance that prepared ``path`` loaded with ``quantization`` (None: dense)."""
        self.model(path, quantization)
        return self._methods[(str(path), quantization)]

    def quantized(self, path: Path) -> Any:
        """``path`` loaded with the method under test."""
        return self.model(path, self.quantization)

    def covered(self, model: Any) -> list[tuple[str, Any]]:
        """``(name, layer)`` of the layers the method gave a quantization scheme in ``model``."""
        from modelrunner.api import quantizable_layers

        return [(n, m) for n, m in quantizable_layers(model.loaded.model) if getattr(m, "quant_scheme", None) is not None]

    def moe_model(self) -> Any:
        """The Mixtral loaded with the method.

        :raises NotApplicable: the method covers none of its fused-MoE layers.
        """
        from modelrunner.api import FusedMoE

        model = self.quantized(self.mixtral)
        if not any(isinstance(m, FusedMoE) for _, m in self.covered(model)):
            raise NotApplicable(f"quantization {self.name!r} covers no fused-MoE layer")
        return model

    @staticmethod
    def logits(model: Any, chunks: list[dict[int, list[int]]] | None = None) -> Any:
        """Every position's logits of :data:`PROMPTS` prefilled together, then of :data:`DECODE`."""
        import torch

        from ..testing import PagedDriver

        driver = PagedDriver(model.forward, model.loaded.kv_cache_spec, num_blocks=32)
        return torch.cat([driver.step(c, all_logits=True) for c in (chunks or [PROMPTS, DECODE])])

    # -- the checks ------------------------------------------------------------------------------------

    def checks(self) -> list[Check]:
        """``covers-layers``, ``logits``, ``logits/moe``, ``layers``, ``layers/moe``, ``batch-independence``, ``determinism``,
        ``tensor-parallel=2``, ``weight-bytes``, ``gguf-source`` and ``options``."""
        return [
            Check("covers-layers", self.check_covers_layers),
            Check("logits", self.check_logits),
            Check("logits/moe", self.check_moe_logits),
            Check("layers", self.check_layers),
            Check("layers/moe", self.check_moe_layers),
            Check("batch-independence", self.check_batch_independence),
            Check("determinism", self.check_determinism),
            Check("tensor-parallel=2", self.check_tensor_parallel),
            Check("weight-bytes", self.check_weight_bytes),
            Check("gguf-source", self.check_gguf_source),
            Check("options", self.check_options),
        ]

    def check_covers_layers(self) -> str:
        """The method gives the tiny Llama's layers quantized storage (``covers_layers``), or, for a
        dense method, none, and records each layer it covers in its ``layers`` (what ``stats()`` and
        the weight-bytes check count); returns how many."""
        covered = self.covered(self.quantized(self.subject))
        if self.method_class.covers_layers:
            expect(bool(covered), f"quantization {self.name!r} gave no layer of {self.subject.name} quantized storage "
                                  "(it declares covers_layers=True): prepare() must set the quant_scheme of each "
                                  "layer it covers")
        elif covered:
            raise ConformanceError(f"quantization {self.name!r} declares covers_layers=False but gave "
                                   f"{len(covered)} layers quantized storage ({covered[0][0]}, …)")
        recorded = set(getattr(self.method_of(self.subject, self.quantization), "layers", {}) or {})
        unrecorded = [name for name, _ in covered if name not in recorded]
        expect(not unrecorded, f"quantization {self.name!r} gave {len(covered)} layers a quant_scheme but did not "
                               f"record {len(unrecorded)} of them in its `layers` ({unrecorded[0] if unrecorded else ''}"
                               ", …): prepare() must also set self.layers[name] = scheme for each layer it covers "
                               "(stats() counts those)")
        return f"{len(covered)} layers covered"

    def _expect_within_tolerance(self, path: Path, quantized: Any, what: str) -> str:
        if not self.method_class.covers_layers:
            raise NotApplicable(f"quantization {self.name!r} keeps dense weights: its logits are the adapter "
                                "suite's (against transformers)")
        try:
            dense_model = self.model(path, "none")
        except ValueError as e:
            raise NotApplicable(f"no dense reference: {path.name} does not load with quantization='none' ({e})") from e
        dense = self.logits(dense_model)
        got = self.logits(quantized)
        expect(tuple(got.shape) == tuple(dense.shape),
               f"{what}: logits of shape {list(got.shape)}, the dense model's {list(dense.shape)}")
        error = _relative(got, dense)
        tolerance = self.method_class.conformance_tolerance
        expect(error <= tolerance,
               f"{what}: max |logits - dense logits| is {error:.3g} of max |dense logits|, above the method's "
               f"conformance_tolerance {tolerance:g}")
        return f"{error:.3g} of max |dense logits| (tolerance {tolerance:g})"

    def check_logits(self) -> str:
        """The tiny Llama's logits (prefill over several blocks, then decode) within the method's
        ``conformance_tolerance`` of the dense model's, relative to their largest magnitude; returns that ratio."""
        return self._expect_within_tolerance(self.subject, self.quantized(self.subject),
                                             f"{self.subject.name} with quantization {self.name!r}")

    def check_moe_logits(self) -> str:
        """The same on the tiny Mixtral, whose experts the method covers."""
        return self._expect_within_tolerance(self.mixtral, self.moe_model(),
                                             f"{self.mixtral.name} with quantization {self.name!r}")

    def _dense_twin(self, path: Path) -> Any:
        """``path`` loaded with ``quantization="none"``: the checkpoint's float weights, layer by layer.

        :raises NotApplicable: it does not load so.
        """
        try:
            return self.model(path, "none")
        except ValueError as e:
            raise NotApplicable(f"no float reference: {path.name} does not load with quantization='none' ({e})") from e

    def _expect_layers_match(self, path: Path, model: Any, moe: bool) -> str:
        import torch
        import torch.nn.functional as F

        from modelrunner.api import FusedMoE, ParallelLMHead, VocabParallelEmbedding
        from modelrunner_quantization import STACKS  # the quantization distribution's stacked expert weights

        tolerance = self.method_class.conformance_tolerance
        generator = torch.Generator().manual_seed(0)
        worst_gain, worst_residual, checked, covered = 0.0, 0.0, 0, 0
        dense = None

        def compare(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
            nonlocal worst_gain, worst_residual, checked
            expect(tuple(got.shape) == tuple(want.shape),
                   f"{what}: output of shape {list(got.shape)}, F.linear with the checkpoint's float weight gives "
                   f"{list(want.shape)}")
            gain, residual = least_squares_gain(got, want)
            expect(abs(gain - 1) <= GAIN_TOLERANCE,
                   f"{what}: least-squares gain {gain:.4f} of the output against F.linear with the checkpoint's float "
                   f"weight (|gain - 1| at most {GAIN_TOLERANCE:g}): a systematic scale error in the stored weight "
                   "or its kernel")
            expect(residual <= tolerance,
                   f"{what}: output differs from F.linear with the checkpoint's float weight by {residual:.3g} "
                   f"(RMS of the residual after the gain, relative to the float output's RMS), above the method's "
                   f"conformance_tolerance {tolerance:g}")
            worst_gain, worst_residual = max(worst_gain, abs(gain - 1)), max(worst_residual, residual)
            checked += 1

        def outputs(run: Any, weight: torch.Tensor, bias: torch.Tensor | None, rows: int) -> tuple[Any, Any]:
            """``run`` and F.linear on :data:`LAYER_SAMPLES` rows in calls of ``rows`` rows."""
            x = torch.randn(max(rows, LAYER_SAMPLES), weight.shape[1], generator=generator)
            got = torch.cat([run(part) for part in x.split(rows)])
            return got, F.linear(x, weight, bias)

        with torch.no_grad():
            for name, layer in self.covered(model):
                if isinstance(layer, FusedMoE) != moe:
                    continue
                covered += 1
                scheme = layer.quant_scheme
                if dense is None:
                    dense = self._dense_twin(path).loaded.model
                float_layer = dense.get_submodule(name)
                if isinstance(layer, FusedMoE):
                    if not callable(getattr(scheme, "matmul", None)):
                        continue
                    for stack in STACKS:
                        weights = getattr(float_layer, stack)
                        for expert in sorted({0, weights.shape[0] - 1}):
                            for rows in LAYER_ROWS:
                                got, want = outputs(lambda x, s=stack, e=expert: scheme.matmul(s, e, x),
                                                    weights[expert].float(), None, rows)
                                compare(got, want, f"{name}.{stack} expert {expert} ({rows} rows a call)")
                    continue
                weight = float_layer.weight.float()
                if isinstance(layer, VocabParallelEmbedding) and not isinstance(layer, ParallelLMHead):
                    ids = torch.randint(0, weight.shape[0], (LAYER_SAMPLES,), generator=generator)
                    compare(layer.lookup(ids).float(), weight.index_select(0, ids), f"{name} (embedding lookup)")
                    continue
                bias = getattr(float_layer, "bias", None)
                for rows in LAYER_ROWS:
                    got, want = outputs(lambda x: scheme.apply(layer, x, getattr(layer, "bias", None)), weight,
                                        None if bias is None else bias.float(), rows)
                    compare(got.float(), want, f"{name} ({rows} rows a call)")
        if covered == 0:
            raise NotApplicable(f"quantization {self.name!r} covers no {'fused-MoE' if moe else 'linear or embedding'} "
                                "layer")
        if checked == 0:
            raise NotApplicable(f"quantization {self.name!r}'s fused-MoE schemes have no matmul(stack, expert, x)")
        return (f"{checked} layer outputs against the float weights: worst |gain - 1| {worst_gain:.2g} (tolerance "
                f"{GAIN_TOLERANCE:g}), worst residual {worst_residual:.3g} (tolerance {tolerance:g})")

    def check_layers(self) -> str:
        """Each layer the method covers in the tiny Llama: its scheme's ``apply`` (or embedding lookup) on
        random inputs, :data:`LAYER_SAMPLES` rows in calls of each of :data:`LAYER_ROWS` rows, against
        ``F.linear`` with the checkpoint's float weight (the same layer loaded with ``quantization="none"``):
        the least-squares gain of the output within :data:`GAIN_TOLERANCE` of 1 (a systematic error of 1%
        in one layer fails), and the residual after it within ``conformance_tolerance`` (the format's
        rounding passes). Returns the worst of each."""
        return self._expect_layers_match(self.subject, self.quantized(self.subject), moe=False)

    def check_moe_layers(self) -> str:
        """The same for each covered fused-MoE layer of the tiny Mixtral (first and last expert, both stacks)."""
        return self._expect_layers_match(self.mixtral, self.moe_model(), moe=True)

    def check_batch_independence(self) -> str:
        """A prompt's logits alone equal its logits next to another prompt within :data:`BATCH_ATOL`
        (both in one kernel bucket); returns the difference."""
        from ..testing import PagedDriver

        model = self.quantized(self.subject)
        spec = model.loaded.kv_cache_spec
        alone = PagedDriver(model.forward, spec, num_blocks=32).step({0: PROMPTS[0]}, all_logits=True)
        batch = PagedDriver(model.forward, spec, num_blocks=32).step({0: PROMPTS[0], 1: OTHER_PROMPT},
                                                                     all_logits=True)
        together = batch[: len(PROMPTS[0])]
        diff = (alone - together).abs().max().item()
        expect(diff <= BATCH_ATOL, f"a {len(PROMPTS[0])}-token prompt's logits change by {diff:.3g} when another "
                                   f"prompt shares its batch (tolerance {BATCH_ATOL:g})")
        return f"max |difference| {diff:.3g}"

    def check_determinism(self) -> str:
        """The same steps run twice give the same logits (within :data:`DETERMINISM_ATOL`)."""
        model = self.quantized(self.subject)
        first, second = self.logits(model), self.logits(model)
        diff = (first - second).abs().max().item()
        expect(diff <= DETERMINISM_ATOL,
               f"the same steps run twice give logits {diff:.3g} apart (tolerance {DETERMINISM_ATOL:g})")
        return f"max |difference| {diff:.3g}"

    def check_tensor_parallel(self) -> str:
        """With ``tensor_parallel_size=2`` (a worker process), one prompt's logits within :data:`TP_ATOL` of
        one process's (float activations where the method has an ``activations`` option); returns the difference."""
        from modelrunner.api import Plugins
        from modelrunner.plugins import get_plugins  # kernel internal: the process's loaded plugins

        if not self.tensor_parallel:
            raise NotApplicable("left out by the suite's options (tensor_parallel=False)")
        if self.method_class.tensor_parallel is False:
            raise NotApplicable(f"quantization {self.name!r} declares tensor_parallel=False")
        # Parallel ranks route through the process's own plugins (rank 0) and the entry points a fresh
        # interpreter finds (the workers), not through ``self.plugins``.
        views = {"rank 0": get_plugins(),
                 "a worker": Plugins(allow=_env_names(_ALLOW_ENV), block=_env_names(_BLOCK_ENV) or [])}
        for rank, view in views.items():
            try:
                same = view.quantization_method_class(self.quantization) is self.method_class
            except ValueError:
                same = False
            if not same:
                raise NotApplicable(f"tensor-parallel {rank} would not run {self.plugin!r}'s {self.name!r} (parallel "
                                    "ranks load the installed plugins, not the ones passed to the suite)")
        options = dict(self.options)
        if "activations" in self.method_class.OPTIONS:
            # Quantized activations take their scales over each rank's share of a row-parallel input.
            options.setdefault("activations", "float")
        config = {"dtype": "float32", "device": "cpu", "block_size": BLOCK_SIZE, "max_model_len": 64,
                  "kv_cache_memory": 1 << 28, "quantization": self.quantization, "quantization_options": options}
        prompt = PROMPTS[1]
        one = make_llm(self.subject, self.plugins, **config).runner.forward(prompt)[0]
        llm = make_llm(self.subject, self.plugins, tensor_parallel_size=2, **config)
        try:
            two = llm.runner.forward(prompt)[0]
        finally:
            llm.shutdown()
        expect(tuple(two.shape) == tuple(one.shape),
               f"tensor_parallel_size=2: logits of shape {list(two.shape)}, one process's {list(one.shape)}")
        diff = (two - one).abs().max().item()
        expect(diff <= TP_ATOL, f"tensor_parallel_size=2 with quantization {self.name!r}: logits differ from one "
                                f"process's by {diff:.3g} (tolerance {TP_ATOL:g})")
        return f"max |difference| {diff:.3g}"

    def check_weight_bytes(self) -> str:
        """A method that covers layers keeps fewer resident weight bytes (``ModelRunner.stats()``) than the
        dense model; returns the ratio."""
        from modelrunner import ModelRunner

        def resident(quantization: str) -> tuple[int, Any]:
            runner = ModelRunner(dict(self.config(quantization, model=str(self.subject), dtype="float32",
                                                  device="cpu", max_model_len=64, kv_cache_memory=1 << 28)),
                                 plugins=self.plugins)
            runner.load_model()
            return runner.stats()["weights"]["resident_bytes"], runner

        quantized, runner = resident(self.quantization)
        covered = [m for m in runner.loaded.model.modules() if getattr(m, "quant_scheme", None) is not None]
        if not covered:
            raise NotApplicable(f"quantization {self.name!r} gives no layer a quant_scheme: nothing to compress")
        dense, _ = resident("none")
        expect(quantized < dense, f"quantization {self.name!r} covers {len(covered)} layers but "
                                  f"keeps {quantized:,} resident weight bytes, not fewer than the dense model's "
                                  f"{dense:,}")
        return f"{quantized / dense:.3f} of dense"

    def check_gguf_source(self) -> str:
        """A GGUF file (what the default model is): the method refuses it in ``check_source`` with a
        ``ValueError``, or runs it — its quantized tensors reach the layers' loaders as
        :class:`~modelrunner.quantization.GGMLBlocks`, not tensors — with logits within
        ``conformance_tolerance`` of the file read with ``quantization="none"`` and every covered layer
        passing the per-layer check. Returns which."""
        if self._checkpoint is not None:
            raise NotApplicable("the suite was given checkpoint= and checks that checkpoint only")
        import importlib.util

        if importlib.util.find_spec("gguf") is None:
            raise NotApplicable("writing the GGUF file needs the gguf package (pip install gguf)")
        path = self.llama_gguf
        if self.subject == path:
            raise NotApplicable(f"quantization {self.name!r} is checked on {path.name} by every other check")
        reason = self._refusal(path)
        if reason is not None:
            return f"refuses GGUF files up front: {reason}"
        try:
            model = self.quantized(path)
        except Exception as e:  # noqa: BLE001 - what the default model would hit, reported with the remedy
            raise ConformanceError(
                f"loading {path.name} (Q4_0/Q4_1/Q8_0 blocks, like the default model) with quantization {self.name!r} "
                f"raised {type(e).__name__}: {e}. Quantized GGUF tensors reach a layer's quant_loader as GGMLBlocks "
                "(dequantize() gives floats, to_planar() the planar triple); take them, or refuse GGUF sources "
                "in check_source() with a ValueError") from e
        if not self.method_class.covers_layers:
            return f"runs {path.name}"
        logits = self._expect_within_tolerance(path, model, f"{path.name} with quantization {self.name!r}")
        layers = self._expect_layers_match(path, model, moe=False)
        return f"runs {path.name}: logits {logits}; {layers}"

    def check_options(self) -> None:
        """An unknown option, and each known option given a value no option accepts, are refused with a
        ``ValueError`` naming the option."""
        problems = []
        for option, value in [(UNKNOWN_OPTION, 1), *[(o, INVALID) for o in self.method_class.OPTIONS]]:
            try:
                self.method_class({**self.options, option: value}, None)
            except ValueError as e:
                if option not in str(e):
                    problems.append(f"{option}={value!r} is refused, but the message does not name it: {e}")
                continue
            except Exception as e:  # noqa: BLE001 - anything but a ValueError is the wrong kind of refusal
                problems.append(f"{option}={value!r} raised {type(e).__name__} ({e}), not a ValueError naming it")
                continue
            problems.append(f"{option}={value!r} is accepted without complaint")
        if problems:
            raise ConformanceError(f"quantization {self.name!r} options: " + "; ".join(problems))


__all__ = ["BATCH_ATOL", "DETERMINISM_ATOL", "GAIN_TOLERANCE", "TP_ATOL", "QuantizationMethodSuite", "least_squares_gain"]
