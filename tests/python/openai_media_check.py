"""The official openai SDK's image and audio calls against a running Rialto.

Run by tests/e2e/media.rs with the base URL and key in the environment
(models mock-image, mock-tts, mock-asr behind the test kit's mock upstream);
exits non-zero on the first failed check. The media is read with the
standard library: a PNG's header, a WAV through `wave`.
"""

import base64
import io
import os
import struct
import wave

import openai

client = openai.OpenAI(
    base_url=os.environ["RIALTO_E2E_BASE_URL"], api_key=os.environ["RIALTO_E2E_API_KEY"], max_retries=0
)

# images.generate: a real PNG of the asked size, as base64.
raw = client.images.with_raw_response.generate(model="mock-image", prompt="a red fox", size="256x256")
generated = raw.parse()
png = base64.b64decode(generated.data[0].b64_json)
assert png[:8] == b"\x89PNG\r\n\x1a\n", png[:8]
assert struct.unpack(">II", png[16:24]) == (256, 256), png[16:24]
assert raw.headers["x-rialto-model-id"] == "mock-image", raw.headers
assert raw.headers["x-rialto-is-blurred"] == "false"
# An OpenAI model name means the server's default image model.
assert client.images.generate(model="dall-e-3", prompt="a lighthouse", size="256x256").data[0].b64_json
print("images ok")

# audio.speech.create: a WAV of 0.25 s per word.
speech = client.audio.speech.create(model="mock-tts", voice="af_sky", input="Hello from python", response_format="wav")
audio = speech.read()
with wave.open(io.BytesIO(audio)) as reader:
    seconds = reader.getnframes() / reader.getframerate()
assert abs(seconds - 0.75) < 0.01, seconds
try:
    client.audio.speech.create(model="mock-tts", voice="af_sky", input="Hi", response_format="mp3")
    raise AssertionError("mp3 is not one of mock-tts's formats")
except openai.BadRequestError as error:
    # The SDK keeps a binary call's error body as text: read the response.
    assert error.response.json()["details"]["response_format"], error.response.text
print("speech ok")

# Streamed speech (the hosted `streaming` member): relayed as it is made.
with client.audio.speech.with_streaming_response.create(
    model="mock-tts", voice="af_sky", input="Hello from python", response_format="wav", extra_body={"streaming": True}
) as streamed:
    assert streamed.headers.get("content-length") is None, streamed.headers
    relayed = b"".join(streamed.iter_bytes())
assert relayed == audio, len(relayed)
print("speech stream ok")

# audio.transcriptions.create: the speech read back, plain and verbose.
transcript = client.audio.transcriptions.create(model="mock-asr", file=("speech.wav", audio, "audio/wav"))
assert transcript.text == "Hello from python", transcript
verbose = client.audio.transcriptions.create(
    model="mock-asr",
    file=("speech.wav", audio, "audio/wav"),
    response_format="verbose_json",
    timestamp_granularities=["word"],
)
assert abs(verbose.duration - 0.75) < 0.01, verbose.duration
assert [w.word for w in verbose.words] == ["Hello", "from", "python"], verbose.words
assert verbose.segments and verbose.segments[-1].end == verbose.duration, verbose.segments
text = client.audio.transcriptions.create(
    model="mock-asr", file=("speech.wav", audio, "audio/wav"), response_format="text"
)
assert text.strip() == "Hello from python", text
print("transcriptions ok")
