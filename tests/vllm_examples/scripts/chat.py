# In the style of vLLM's examples/offline_inference/basic/chat.py: a conversation, a batch of them,
# and a custom chat template; only the import (and the local model) changed.
from modelrunner import LLM, SamplingParams


def print_outputs(outputs):
    print("\nGenerated Outputs:\n" + "-" * 80)
    for output in outputs:
        prompt = output.prompt
        generated_text = output.outputs[0].text
        print(f"Prompt: {prompt!r}\n")
        print(f"Generated text: {generated_text!r}")
        print("-" * 80)


def main():
    llm = LLM(model="smollm2", enforce_eager=True, max_model_len=1024, seed=0)
    sampling_params = llm.get_default_sampling_params()
    sampling_params.max_tokens = 32
    sampling_params.temperature = 0.0

    conversation = [
        {"role": "system", "content": "You are a helpful assistant"},
        {"role": "user", "content": "Hello"},
        {"role": "assistant", "content": "Hello! How can I assist you today?"},
        {"role": "user", "content": "Write an essay about the importance of higher education."},
    ]
    outputs = llm.chat(conversation, sampling_params, use_tqdm=False)
    print_outputs(outputs)

    # You can run batch inference with llm.chat API
    conversations = [conversation for _ in range(3)]
    outputs = llm.chat(conversations, sampling_params, use_tqdm=True)
    print_outputs(outputs)
    assert len({o.outputs[0].text for o in outputs}) == 1  # greedy: the same reply three times

    # A chat template can be optionally supplied.
    chat_template = ("{% for message in messages %}{{ message['role'] | upper }}: {{ message['content'] }}\n"
                     "{% endfor %}{% if add_generation_prompt %}ASSISTANT:{% endif %}")
    outputs = llm.chat(conversation, sampling_params, use_tqdm=False, chat_template=chat_template)
    assert outputs[0].prompt.startswith("SYSTEM: You are a helpful assistant\n")
    print_outputs(outputs)

    # Continuing the assistant's last message instead of starting a new turn.
    partial = conversation[:3] + [{"role": "user", "content": "Name a colour."},
                                  {"role": "assistant", "content": "My favourite colour is"}]
    outputs = llm.chat(partial, sampling_params, use_tqdm=False, add_generation_prompt=False,
                       continue_final_message=True)
    assert outputs[0].prompt.rstrip().endswith("My favourite colour is")
    print_outputs(outputs)


if __name__ == "__main__":
    main()
