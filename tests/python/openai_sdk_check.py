"""The official openai SDK against a running Rialto: plain, streamed, n=2.

Run by tests/e2e/python_sdk.rs with the base URL, key and model in the
environment; exits non-zero on the first failed check.
"""

import json
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

# The Responses API: plain, streamed, a two-turn conversation, a function call.
raw = client.responses.with_raw_response.create(model=model, input="hello from python",
                                                instructions="Answer briefly.")
response = raw.parse()
assert response.object == "response" and response.status == "completed", response
assert response.output_text == "Hello from mock: hello from python", response.output_text
assert response.output[0].type == "message" and response.output[0].role == "assistant", response.output
# The instructions are a system message: 2 words, and the input's 3.
assert response.usage.input_tokens == 5, response.usage
assert response.usage.total_tokens == response.usage.input_tokens + response.usage.output_tokens
assert response.model_extra["cost"]["usd"] > 0, response.model_extra
assert raw.headers["x-rialto-model-id"] == model and raw.headers["x-rialto-balance-usd"]
# Continued: the first turn (its input and its answer, not its instructions)
# is sent again before the new input.
second = client.responses.create(model=model, input="and again", previous_response_id=response.id)
assert second.previous_response_id == response.id, second
assert second.output_text == "Hello from mock: and again", second.output_text
assert second.usage.input_tokens == 3 + 6 + 2, second.usage
print("responses ok")

events = []
with client.responses.stream(model=model, input="stream me") as stream:
    for event in stream:
        events.append(event.type)
    final = stream.get_final_response()
assert events[:2] == ["response.created", "response.in_progress"], events
assert "response.output_text.delta" in events and events[-1] == "response.completed", events
assert final.output_text == "Hello from mock: stream me", final.output_text
assert final.usage.output_tokens > 0, final.usage
streamed_again = client.responses.create(model=model, input="x", previous_response_id=final.id)
assert streamed_again.usage.input_tokens == 2 + 5 + 1, streamed_again.usage
print("responses stream ok")

tools = [{"type": "function", "name": "get_weather", "description": "The weather in a city",
          "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}]
call_directive = {"mock": {"tool_call": {"name": "get_weather", "arguments": {"city": "Paris"}}}}
called = client.responses.create(model=model, input="weather in Paris?", tools=tools, extra_body=call_directive)
call = called.output[0]
assert call.type == "function_call" and call.name == "get_weather", called.output
assert json.loads(call.arguments) == {"city": "Paris"}, call.arguments
answered = client.responses.create(model=model, previous_response_id=called.id, tools=tools, input=[
    {"type": "function_call_output", "call_id": call.call_id, "output": "sunny"}])
assert answered.status == "completed", answered
streamed_call = None
for event in client.responses.create(model=model, input="weather?", tools=tools, stream=True,
                                     extra_body=call_directive):
    if event.type == "response.output_item.done":
        streamed_call = event.item
assert streamed_call is not None and streamed_call.type == "function_call", streamed_call
assert json.loads(streamed_call.arguments) == {"city": "Paris"}, streamed_call
try:
    client.responses.create(model=model, input="x", previous_response_id="resp_nobody")
except openai.BadRequestError as error:
    assert "not found" in error.response.text, error.response.text
else:
    raise AssertionError("an unknown previous_response_id was accepted")
print("responses tools ok")

# A deleted or wrong key is an authentication error the SDK understands.
bad = openai.OpenAI(base_url=base_url, api_key="RIALTO_INFERENCE_KEY_nope", max_retries=0)
try:
    bad.chat.completions.create(model=model, messages=messages)
except openai.AuthenticationError as error:
    assert error.status_code == 401
    print("auth error ok")
else:
    raise AssertionError("a wrong key was accepted")
