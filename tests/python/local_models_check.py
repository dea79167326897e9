"""The built-in models through Rialto with the official openai SDK.

Reads RIALTO_E2E_BASE_URL and RIALTO_E2E_API_KEY; prints one line per
check and exits non-zero on the first failure.
"""

import io
import math
import os
import wave

import openai

client = openai.OpenAI(
    base_url=os.environ["RIALTO_E2E_BASE_URL"],
    api_key=os.environ["RIALTO_E2E_API_KEY"],
    max_retries=0,
)

question = [{"role": "user", "content": "What is the capital of France? Answer in one word."}]

reply = client.chat.completions.create(
    model="smollm2-135m", messages=question, temperature=0, max_tokens=24
)
assert "Paris" in reply.choices[0].message.content, reply
assert reply.usage.prompt_tokens > 20 and reply.usage.completion_tokens > 0, reply.usage
print("chat ok")

pieces, usage = [], None
for chunk in client.chat.completions.create(
    model="smollm2-135m", messages=question, temperature=0, max_tokens=24, stream=True
):
    if chunk.choices and chunk.choices[0].delta.content:
        pieces.append(chunk.choices[0].delta.content)
    if chunk.usage:
        usage = chunk.usage
text = "".join(pieces)
# Tokens arrive as they are produced: several content chunks, one answer.
assert len(pieces) > 2 and "Paris" in text, pieces
assert usage is not None and usage.completion_tokens >= len(pieces) - 1, (usage, pieces)
print("stream ok")

result = client.embeddings.create(
    model="all-minilm-l6-v2",
    input=["The cat sits on the mat.", "A cat is sitting on a mat.", "Quarterly revenue grew 8%."],
)
vectors = [item.embedding for item in result.data]
assert len(vectors) == 3 and len(vectors[0]) == 384, result


def cosine(a, b):
    return sum(x * y for x, y in zip(a, b)) / math.sqrt(sum(x * x for x in a) * sum(y * y for y in b))


assert cosine(vectors[0], vectors[1]) > cosine(vectors[0], vectors[2]) + 0.3, result
assert result.usage.prompt_tokens > 10, result.usage
print("embeddings ok")

speech = client.audio.speech.create(model="espeak-ng", voice="en-us", input="Hello from Rialto.", response_format="wav")
with wave.open(io.BytesIO(speech.read())) as reader:
    seconds = reader.getnframes() / reader.getframerate()
assert 0.5 < seconds < 5, seconds
print("speech ok")
