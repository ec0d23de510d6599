# vLLM-style sampling: penalties, min_p, logit bias, bad words, allowed tokens, stop strings.
from modelrunner import LLM, SamplingParams

llm = LLM(model="smollm2", max_model_len=512, enable_prefix_caching=True, max_num_seqs=8)
tokenizer = llm.get_tokenizer()
prompts = ["Write a list of fruits:", "Once upon a time"]

params = [
    SamplingParams(temperature=0.7, top_k=40, top_p=0.9, min_p=0.05, repetition_penalty=1.2,
                   presence_penalty=0.5, frequency_penalty=0.3, max_tokens=24, seed=1),
    SamplingParams(temperature=0.0, max_tokens=24, bad_words=["apple", "banana"], stop=["\n\n"],
                   include_stop_str_in_output=True),
]
for output in llm.generate(prompts, params):
    print(f"{output.prompt!r} -> {output.outputs[0].text!r} ({output.outputs[0].finish_reason})")

yes = tokenizer.encode(" yes", add_special_tokens=False)[0]
no = tokenizer.encode(" no", add_special_tokens=False)[0]
answer = llm.generate("Is the sky blue? Answer:", SamplingParams(max_tokens=1, temperature=0.0,
                                                               allowed_token_ids=[yes, no], logit_bias={no: 5.0}))
assert answer[0].outputs[0].token_ids == [no]
print("constrained answer:", answer[0].outputs[0].text)
print("prefix cache reset:", llm.reset_prefix_cache())
