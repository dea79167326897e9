"""The official openai SDK against a running Rialto: plain, streamed, n=2.

Run by tests/e2e/python_sdk.rs with the base URL, key and model in the
environment; exits non-zero on the first failed check.
"""

import os

import openai

base_url = os.environ["RIALTO_E2E_BASE_URL"]
client = openai.OpenAI(base_url=base_url, api_key=os.environ["RIALTO_E2E_API_KEY"], max_retries=0)
model = os.environ["RIALTO_E2E_MODEL"]
messages = [{"role": "user", "content": "hello from python"}]

# Plain chat, with the raw response to see the headers.
raw = client.chat.completions.with_raw_response.create(model=model, messages=messages)
completion = raw.parse()
assert completion.object == "chat.completion", completion
assert completion.model == model, completion.model
assert completion.choices[0].message.content == "Hello from mock: hello from python", completion
assert completion.choices[0].finish_reason == "stop"
assert completion.usage.total_tokens == completion.usage.prompt_tokens + completion.usage.completion_tokens
extra = completion.model_extra
assert extra["cost"]["usd"] > 0, extra
assert extra["rialto_parameters"]["enable_web_search"] == "off", extra
assert raw.headers["x-rialto-model-id"] == model
assert raw.headers["cf-ray"]
print("plain ok")

# Streamed chat: content in order, then a usage chunk with cost.
stream = client.chat.completions.create(model=model, messages=messages, stream=True)
text, usage, cost = "", None, None
for chunk in stream:
    for choice in chunk.choices:
        text += choice.delta.content or ""
    if chunk.usage is not None:
        usage = chunk.usage
        cost = chunk.model_extra.get("cost")
assert text.strip() == "Hello from mock: hello from python", text
assert usage is not None and usage.completion_tokens > 0, usage
assert cost is not None and cost["usd"] > 0, cost
print("stream ok")

# Two choices.
both = client.chat.completions.create(model=model, messages=messages, n=2)
assert [c.index for c in both.choices] == [0, 1], both.choices
assert both.choices[0].message.content != both.choices[1].message.content
print("n=2 ok")

# A model suffix strips the thinking, whole and streamed; the SDK parses both.
thinking = {"mock": {"reply": "<think>first, plan</think> Paris is the capital."}}
stripped = client.chat.completions.create(
    model=f"{model}:strip_thinking_response=true", messages=messages, extra_body=thinking
)
assert stripped.choices[0].message.content == "Paris is the capital.", stripped
assert stripped.model == model, stripped.model
assert stripped.model_extra["rialto_parameters"]["strip_thinking_response"] is True
streamed = "".join(
    choice.delta.content or ""
    for chunk in client.chat.completions.create(
        model=f"{model}:strip_thinking_response=true", messages=messages, stream=True, extra_body=thinking
    )
    for choice in chunk.choices
)
assert streamed == "Paris is the capital.", streamed
print("thinking ok")

# A deleted or wrong key is an authentication error the SDK understands.
bad = openai.OpenAI(base_url=base_url, api_key="RIALTO_INFERENCE_KEY_nope", max_retries=0)
try:
    bad.chat.completions.create(model=model, messages=messages)
except openai.AuthenticationError as error:
    assert error.status_code == 401
    print("auth error ok")
else:
    raise AssertionError("a wrong key was accepted")
