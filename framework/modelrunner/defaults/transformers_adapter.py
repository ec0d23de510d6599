"""The generic adapter: any causal LM transformers knows, run with transformers' own KV cache.

It keeps one ``DynamicCache`` per sequence and runs sequences one after another, so it is
correct for every architecture but not fast; native adapters (installed separately) win over it.
It has no paged KV cache, so the runner turns prefix caching off for it. An encoder family that
transformers also runs as a causal LM (BERT, RoBERTa, …: ``BertLMHeadModel`` in encoder mode, on a
``BertModel`` checkpoint) loads as ``causal=False``: the engine serves its embeddings, each prompt in one
step.
"""

from __future__ import annotations

from typing import Any

import torch

from ..forward_batch import HIDDEN_STATES, RETURN_HIDDEN_STATES, ForwardOutput
from ..hookspecs import hookimpl
from ..loaded_model import LoadedModel
from ..registry import FALLBACK_ARCHITECTURE


@hookimpl
def register(registry: Any) -> None:
    """Declare the fallback architecture: the kernel asks this adapter for any architecture no plugin registered."""
    registry.architectures(FALLBACK_ARCHITECTURE, tensor_parallel=False, pipeline_parallel=False,
                           quantization=("none",), devices=("cpu", "cuda"), attention_backends=False)


@hookimpl
def load(source: Any, config: Any, device: torch.device, dtype: torch.dtype) -> LoadedModel | None:
    """transformers' own model for ``source``; None when transformers has no causal LM for its
    ``model_type`` (and ``trust_remote_code`` is off)."""
    from transformers import AutoModelForCausalLM
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    model_type = getattr(source.hf_config, "model_type", None)
    if model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES and not config.model.trust_remote_code:
        return None
    model = AutoModelForCausalLM.from_pretrained(
        str(source.directory), dtype=dtype, trust_remote_code=config.model.trust_remote_code
    ).to(device)
    model.eval()
    return LoadedModel(
        model=model,
        tokenizer=source.load_tokenizer(),
        hf_config=model.config,
        kv_cache_spec=None,
        extra={"caches": {}, "cache_argument": _cache_argument(model)},
        causal=not is_encoder(model.config),
    )


def is_encoder(config: Any) -> bool:
    """Whether transformers runs ``config``'s causal-LM class as a bidirectional encoder: a family that
    also has a masked-LM head (BERT, RoBERTa, XLM-R, ELECTRA …) whose config is neither a decoder
    (``is_decoder``) nor an encoder-decoder (BART's decoder is causal)."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_MASKED_LM_MAPPING_NAMES

    return (getattr(config, "model_type", None) in MODEL_FOR_MASKED_LM_MAPPING_NAMES
            and not getattr(config, "is_decoder", False) and not getattr(config, "is_encoder_decoder", False))


def _cache_argument(model: Any) -> str:
    """The name under which ``model.forward`` takes its KV cache: ``cache`` in recent transformers 5
    releases, ``past_key_values`` before (where an unknown ``cache=`` is swallowed by ``**kwargs`` and
    every step would run without its context)."""
    import inspect

    parameters = inspect.signature(model.forward).parameters
    return "cache" if "cache" in parameters else "past_key_values"


@hookimpl
def parallelize(loaded: LoadedModel, parallel: Any) -> None:
    """Refuse more than one process: transformers' model has no split plan here."""
    if parallel.world_size > 1:
        raise ValueError(
            f"the generic transformers adapter cannot shard {type(loaded.model).__name__} across "
            f"{parallel.world_size} processes; install a native adapter for it or use "
            "tensor_parallel_size=1, pipeline_parallel_size=1"
        )


@hookimpl
def forward(loaded: LoadedModel, batch: Any) -> torch.Tensor | ForwardOutput:
    """Run each sequence of the step through transformers' model with its own ``DynamicCache``; with
    ``batch.extra[RETURN_HIDDEN_STATES]``, also the final hidden states of those rows (transformers'
    last ``hidden_states`` entry, which is after the final norm)."""
    from transformers import DynamicCache

    caches: dict[int, Any] = loaded.extra["caches"]
    for seq_id in batch.finished_seq_ids:
        caches.pop(seq_id, None)
    starts = batch.query_start_loc.tolist()
    context_lens = batch.context_lens.tolist()
    wanted = batch.logits_indices.tolist()
    pooled = batch.extra.get(RETURN_HIDDEN_STATES)
    pooled_rows = [] if pooled is None else pooled.tolist()
    hidden_rows: dict[int, torch.Tensor] = {}
    rows: list[torch.Tensor] = []
    for i, seq_id in enumerate(batch.seq_ids):
        start, end = starts[i], starts[i + 1]
        cache = caches.get(seq_id)
        if context_lens[i] == 0 or cache is None:
            if context_lens[i] != 0:
                raise RuntimeError(f"sequence {seq_id} resumes at token {context_lens[i]} but has no cache")
            cache = caches[seq_id] = DynamicCache()
        elif cache.get_seq_length() > context_lens[i]:
            cache.crop(context_lens[i])
        mine = [w - start for w in wanted if start <= w < end]
        keep = (end - start - min(mine)) if mine else 1
        pooled_here = [r for r in pooled_rows if start <= r < end]
        out = loaded.runnable(
            input_ids=batch.input_ids[start:end].unsqueeze(0),
            position_ids=batch.positions[start:end].unsqueeze(0),
            **{loaded.extra["cache_argument"]: cache},
            use_cache=True,
            logits_to_keep=keep,
            **({"output_hidden_states": True} if pooled_here else {}),
        )
        if pooled_here:
            final = out.hidden_states[-1][0]
            hidden_rows.update((r, final[r - start]) for r in pooled_here)
        if mine:
            logits = out.logits[0]
            offset = (end - start) - keep
            rows.append(logits[[m - offset for m in mine]])
    logits = torch.cat(rows).float() if rows else batch.input_ids.new_zeros((0, loaded.vocab_size),
                                                                             dtype=torch.float32)
    if pooled is None:
        return logits
    return ForwardOutput(logits=logits, aux={HIDDEN_STATES: torch.stack([hidden_rows[r] for r in pooled_rows])
                                             if pooled_rows else logits.new_zeros((0, 0))})
