"""Speculative decoding (``ngram``) against plain decoding on the default model (SmolLM2-135M-Instruct),
both engines loaded in this process and timed in alternating rounds:

- single stream, copy-heavy prompts (repeat a passage, edit code): target at least 1.5x plain;
- single stream, prompts with nothing to copy: target at least 0.95x plain (speculation turns itself
  down when its proposals are rejected);
- a batch of 64 mixed prompts: target at least 0.9x plain.

Greedy decoding, a fixed number of tokens per request (EOS ignored), so both sides do the same work;
each line prints tokens/s, the ratio and the acceptance rate.

    python bench/speculative.py           # 128 tokens, batch 64, 3 rounds
    python bench/speculative.py --quick   # 16 tokens, batch 8, 1 round: checks that it runs
"""

from __future__ import annotations

import argparse
import statistics
import time

from modelrunner import LLM, SamplingParams

CODE = '''def merge_sorted(a, b):
    out, i, j = [], 0, 0
    while i < len(a) and j < len(b):
        if a[i] <= b[j]:
            out.append(a[i])
            i += 1
        else:
            out.append(b[j])
            j += 1
    out.extend(a[i:])
    out.extend(b[j:])
    return out
'''
# Longer than the tokens measured (128), so the whole measured output is a copy, not what follows it.
PASSAGE = ("The river rose slowly through the night, and by morning the low fields along the valley were "
           "under water. Farmers moved their animals to the hills, and the old bridge, built a century ago, "
           "held against the current while the town watched from the church steps. By noon the rain had "
           "stopped, but the water kept coming down from the mountains, brown and fast, carrying branches, "
           "fence posts and once a small wooden boat with nobody in it. The mayor walked along the embankment "
           "with two engineers, pointing at the places where the stones had begun to move. Children were sent "
           "to the school on the hill, where teachers handed out blankets and bread, and the baker kept his "
           "ovens going all afternoon. When the evening came, the river began to fall, a few centimetres an "
           "hour, and people stood at their windows watching the fields appear again, grey with mud and "
           "covered in everything the flood had carried away.")
COPY_PROMPTS = [
    [{"role": "user", "content": "Rename the function to merge_lists and repeat the rest of the code unchanged:\n"
                                 + CODE}],
    [{"role": "user", "content": "Repeat this passage word for word:\n" + PASSAGE}],
]
FREE_PROMPTS = [
    [{"role": "user", "content": "Write a short story about a robot who learns to paint."}],
    [{"role": "user", "content": "Explain why the sky is blue to a ten-year-old."}],
]
SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 4}


def timed(llm: LLM, prompts: list, tokens: int) -> tuple[float, int, int, int]:
    """(seconds, output tokens, proposed, accepted) of one ``chat`` call."""
    params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
    start = time.perf_counter()
    outs = llm.chat(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - start
    return (seconds, sum(len(o.outputs[0].token_ids) for o in outs),
            sum(o.metrics.spec_num_draft_tokens for o in outs), sum(o.metrics.spec_num_accepted_tokens for o in outs))


def compare(name: str, plain: LLM, spec: LLM, batches: list[list], tokens: int, rounds: int) -> None:
    """Alternate plain and speculative runs of every batch; print median tokens/s, ratio, acceptance."""
    speeds: dict[str, list[float]] = {"plain": [], "spec": []}
    proposed = accepted = 0
    for _ in range(rounds):
        for batch in batches:
            for label, llm in (("plain", plain), ("spec", spec)):
                seconds, out, p, a = timed(llm, batch, tokens)
                speeds[label].append(out / seconds)
                proposed, accepted = proposed + p, accepted + a
    plain_tps, spec_tps = statistics.median(speeds["plain"]), statistics.median(speeds["spec"])
    rate = accepted / proposed if proposed else 0.0
    print(f"{name:<28} plain {plain_tps:8.1f} tok/s   ngram {spec_tps:8.1f} tok/s   ratio {spec_tps / plain_tps:5.2f}x"
          f"   acceptance {rate:5.1%} ({accepted}/{proposed})", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="16 tokens, batch 8, 1 round")
    parser.add_argument("--model", default="smollm2")
    args = parser.parse_args()
    tokens, batch, rounds = (16, 8, 1) if args.quick else (128, 64, 3)
    common = dict(max_model_len=1024)
    plain = LLM(args.model, **common)
    spec = LLM(args.model, **common, speculative_config=SPEC)
    for llm in (plain, spec):  # warm-up (compiled paths, timing caches)
        timed(llm, COPY_PROMPTS[:1], 8)
    print(f"model {args.model}, {tokens} tokens per request, {rounds} round(s), {SPEC}")
    compare("single stream, copy-heavy", plain, spec, [[p] for p in COPY_PROMPTS], tokens, rounds)
    compare("single stream, nothing to copy", plain, spec, [[p] for p in FREE_PROMPTS], tokens, rounds)
    mixed = [(COPY_PROMPTS + FREE_PROMPTS)[i % 4] for i in range(batch)]
    compare(f"batch {batch}, mixed", plain, spec, [mixed], tokens, rounds)


if __name__ == "__main__":
    main()
