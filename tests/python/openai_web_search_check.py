"""The official openai SDK reads web search citations from a running Rialto.

Run by tests/e2e/web.rs with the base URL, key and a model that searches
(against the mock SearXNG) in the environment; exits non-zero on the first
failed check. The citations are not OpenAI fields: the SDK keeps them in
`model_extra`, on the completion and on the stream's citations chunk.
"""

import os

import openai

client = openai.OpenAI(
    base_url=os.environ["RIALTO_E2E_BASE_URL"], api_key=os.environ["RIALTO_E2E_API_KEY"], max_retries=0
)
model = os.environ["RIALTO_E2E_MODEL"]
messages = [{"role": "user", "content": "who won the race"}]
parameters = {"enable_web_search": "on", "enable_web_citations": True}

completion = client.chat.completions.create(
    model=model, messages=messages, extra_body={"rialto_parameters": parameters}
)
echo = completion.model_extra["rialto_parameters"]
assert echo["enable_web_search"] == "on", echo
citations = echo["web_search_citations"]
assert [c["title"] for c in citations] == [f"Result {n} about who won the race" for n in (1, 2, 3)], citations
assert all(c["url"].startswith("http://") for c in citations), citations
print("citations ok")

# The model suffix, streamed: the citations come in a `choices: []` chunk.
stream = client.chat.completions.create(
    model=f"{model}:enable_web_search=on&include_search_results_in_stream=true", messages=messages, stream=True
)
text, streamed = "", None
for chunk in stream:
    for choice in chunk.choices:
        text += choice.delta.content or ""
    extra = chunk.model_extra or {}
    if "rialto_parameters" in extra:
        assert chunk.choices == [], chunk
        streamed = extra["rialto_parameters"]["web_search_citations"]
assert text, "no content streamed"
assert streamed == citations, streamed
print("stream citations ok")
