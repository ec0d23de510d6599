# vLLM-style log-probabilities of sampled and prompt tokens, and request metrics.
from modelrunner import LLM, SamplingParams

llm = LLM(model="smollm2", max_model_len=512)
sampling_params = SamplingParams(temperature=0.0, max_tokens=6, logprobs=3, prompt_logprobs=2)
output = llm.generate(["The capital of France is"], sampling_params)[0]
completion = output.outputs[0]
print(f"text: {completion.text!r}  cumulative_logprob: {completion.cumulative_logprob:.4f}")
for token_id, top in zip(completion.token_ids, completion.logprobs):
    chosen = top[token_id]
    alternatives = ", ".join(f"{lp.decoded_token!r}:{lp.logprob:.2f}" for tid, lp in top.items() if tid != token_id)
    print(f"  {chosen.decoded_token!r} logprob={chosen.logprob:.3f} rank={chosen.rank}  [{alternatives}]")
print("prompt logprobs:", [None if p is None else len(p) for p in output.prompt_logprobs])
metrics = output.metrics
print(f"time to first token: {metrics.time_to_first_token:.3f}s, per output token: "
      f"{metrics.time_per_output_token:.3f}s")
