"""A video job from a plain HTTP client, the video decoded by FFmpeg.

Run by tests/e2e/media_jobs.rs with the base URL and key in the environment
(model mock-video behind the test kit's mock upstream): quotes, queues a
two-second video, polls /video/retrieve as the hosted API's clients do,
decodes every frame with PyAV (FFmpeg's H.264 decoder), and completes the
job. Exits non-zero on the first failed check.
"""

import io
import os
import time

import av
import requests

base = os.environ["RIALTO_E2E_BASE_URL"].rstrip("/")
session = requests.Session()
session.headers["Authorization"] = "Bearer " + os.environ["RIALTO_E2E_API_KEY"]

quote = session.post(f"{base}/video/quote", json={"model": "mock-video", "duration": "2s"}, timeout=30)
assert quote.status_code == 200, quote.text
assert quote.json() == {"quote": 0.1}, quote.text

queued = session.post(
    f"{base}/video/queue",
    json={"model": "mock-video", "prompt": "a gondola from python", "duration": "2s", "resolution": "240p"},
    timeout=30,
)
assert queued.status_code == 200, queued.text
queue_id = queued.json()["queue_id"]

deadline = time.monotonic() + 60
while True:
    retrieved = session.post(
        f"{base}/video/retrieve", json={"model": "mock-video", "queue_id": queue_id}, timeout=30
    )
    assert retrieved.status_code == 200, retrieved.text
    if retrieved.headers["content-type"] == "video/mp4":
        break
    status = retrieved.json()
    assert status["status"] == "PROCESSING", status
    assert time.monotonic() < deadline, status
    time.sleep(0.05)

with av.open(io.BytesIO(retrieved.content)) as container:
    stream = container.streams.video[0]
    assert stream.codec_context.name == "h264", stream.codec_context.name
    frames = [frame for frame in container.decode(stream)]
# 240p at 16:9: 426 rounded to even.
assert (frames[0].width, frames[0].height) == (426, 240), (frames[0].width, frames[0].height)
assert len(frames) == 16, len(frames)
plane = frames[0].planes[0]
data = bytes(plane)
luma = [data[y * plane.line_size + x] for y in range(plane.height) for x in range(plane.width)]
# The mock's gradient, as it was written (no sample below 16).
assert min(luma) >= 16 and max(luma) > min(luma), (min(luma), max(luma))

done = session.post(f"{base}/video/complete", json={"model": "mock-video", "queue_id": queue_id}, timeout=30)
assert done.json() == {"success": True}, done.text
print("video job ok")
