"""Checks that Rialto's answers match the OpenAPI document it publishes.

Run by tests/e2e/python.rs against a sandbox (base URL, operator token, a
model id, and the id of a model whose global window admits one request per
minute, in the environment). Every exchange below is validated, request and
response, with openapi-core against GET /openapi.yaml; exits non-zero on the
first mismatch. A wallet signs in with eth-account (Sign-In-With-X); the
sandbox has no [x402], so top-ups answer 503 (the x402 flows are in
tests/e2e/wallet.rs and x402_wallet_check.py).

The failed-requests guard blocks the client address after more than 20 4xx
answers in 30 s that no API key authenticated (operator calls, requests
without credentials, refused sign-ins, payment headers, wallet mismatches):
this script makes 18 of them; keep it under the threshold.
"""

import base64
import json
import os
import secrets
import struct
import sys
import time
from datetime import datetime, timedelta, timezone
from decimal import Decimal

import requests
import yaml
from eth_account import Account
from eth_account.messages import encode_defunct
from openapi_core import OpenAPI
from openapi_core.contrib.requests import RequestsOpenAPIRequest, RequestsOpenAPIResponse

root = os.environ["RIALTO_E2E_ROOT_URL"].rstrip("/")
operator = os.environ["RIALTO_E2E_OPERATOR_TOKEN"]
model = os.environ["RIALTO_E2E_MODEL"]
# Its `global_rpm = 1` window is shared by every caller: the second request
# within a minute is refused.
limited_model = os.environ["RIALTO_E2E_LIMITED_MODEL"]

document = requests.get(f"{root}/openapi.yaml", timeout=30)
assert document.status_code == 200, document.status_code
spec = yaml.safe_load(document.text)
assert spec["info"]["version"] == document.headers["x-rialto-version"], spec["info"]["version"]
openapi = OpenAPI.from_dict(spec)

checked = 0


def check(response, expected_status, valid_request=True):
    """Validates one exchange against the document (the request too, unless
    it is deliberately invalid)."""
    global checked
    request = RequestsOpenAPIRequest(response.request)
    assert response.status_code == expected_status, (
        f"{response.request.method} {response.request.url}: {response.status_code} {response.text[:500]}"
    )
    try:
        if valid_request:
            openapi.validate_request(request)
        openapi.validate_response(request, RequestsOpenAPIResponse(response))
    except Exception as error:  # noqa: BLE001 - report any mismatch with its exchange
        details = getattr(error, "__cause__", None) or error
        sys.exit(
            f"{response.request.method} {response.request.url} -> {response.status_code} "
            f"does not match the OpenAPI document: {error!r}: {details!r}\nbody: {response.text[:1000]}"
        )
    checked += 1
    return response


session = requests.Session()
api = f"{root}/api/v1"
operator_auth = {"Authorization": f"Bearer {operator}"}


def numbers(response):
    """The JSON body with its numbers as exact Decimals (or ints)."""
    return response.json(parse_float=Decimal)


def decoded(value):
    """The JSON of an x402 header (base64, standard and padded)."""
    return json.loads(base64.b64decode(value, validate=True))


def discovery(response):
    """Asserts that a 402 is the x402 discovery answer to a request without
    credentials; this sandbox has no [x402], so nothing to pay with."""
    body = response.json()
    assert body["x402Version"] == 2, body
    assert body["error"] == "Authentication required", body
    assert body["resource"]["url"].endswith(response.request.path_url.split("?")[0]), body
    assert body["accepts"] == [], body
    assert set(body["authOptions"]) == {"apiKey", "x402Wallet"}, body
    assert body["authOptions"]["x402Wallet"]["header"] == "SIGN-IN-WITH-X", body
    challenge = body["extensions"]["sign-in-with-x"]
    assert challenge["info"]["domain"] == "127.0.0.1:8080", challenge
    assert {"chainId": "eip155:8453", "type": "eip191"} in challenge["supportedChains"], challenge
    required = decoded(response.headers["PAYMENT-REQUIRED"])
    assert required["x402Version"] == 2 and required["accepts"] == [], required
    assert "sign-in-with-x" in required["extensions"], required
    return body


account = check(
    session.post(f"{root}/admin/v1/accounts", json={"name": "conformance"}, headers=operator_auth),
    201,
).json()
admin = {"Authorization": f"Bearer {account['api_key']['key']}"}
credits_url = f"{root}/admin/v1/accounts/{account['id']}/credits"
credited = check(
    session.post(credits_url, json={"usd": "100.00", "reference": "conformance-seed"}, headers=operator_auth),
    200,
).json()
assert credited["applied"] is True, credited
assert credited["balance"]["usd"] == "100", credited

# Crediting is idempotent on the reference: the second time changes nothing.
again = check(
    session.post(credits_url, json={"usd": "100.00", "reference": "conformance-seed"}, headers=operator_auth),
    200,
).json()
assert again == {"applied": False, "balance": {"usd": "100", "diem": "0"}}, again
# Bad amounts and references are refused, and so is a wrong operator token.
for bad_body in ({"usd": "1.0000000001", "reference": "conformance-precise"},
                 {"diem": "ten", "reference": "conformance-words"},
                 {"usd": "1", "reference": "x" * 201}):
    refused = check(session.post(credits_url, json=bad_body, headers=operator_auth), 400, valid_request=False)
    assert refused.json()["error"].startswith(("usd ", "diem ", "reference ")), refused.text
negative = check(
    session.post(credits_url, json={"usd": "-1", "reference": "conformance-negative"}, headers=operator_auth),
    400, valid_request=False,
)
assert negative.json() == {"error": "usd must be zero or more, with at most 9 decimals"}, negative.text
missing = check(session.post(credits_url, json={"usd": "1"}, headers=operator_auth), 400, valid_request=False)
assert missing.json()["details"]["reference"]["_errors"] == ["Required"], missing.text
check(session.post(credits_url, json={"usd": 1, "reference": "conformance-number"}, headers=operator_auth), 400,
      valid_request=False)
check(session.post(credits_url, json={"usd": "1", "reference": "conformance-token"},
                   headers={"Authorization": "Bearer not-the-operator"}), 401)
assert check(
    session.post(credits_url, json={"reference": "conformance-seed"}, headers=operator_auth), 200,
).json()["balance"] == {"usd": "100", "diem": "0"}

created = check(
    session.post(f"{api}/api_keys", json={"apiKeyType": "INFERENCE", "description": "conformance"}, headers=admin),
    200,
).json()["data"]
inference = {"Authorization": f"Bearer {created['apiKey']}"}
check(session.get(f"{api}/api_keys", headers=admin), 200)
assert check(session.get(f"{api}/characters", headers=admin), 200).json() == {"object": "list", "data": []}
assert check(session.get(f"{api}/models/traits"), 200).json()["object"] == "list"
check(session.get(f"{api}/models/compatibility_mapping?type=text"), 200)
check(session.get(f"{api}/characters/nobody", headers=admin), 404)
# A stored character, found by its category, reviewed, its reviews paged.
check(session.put(f"{root}/admin/v1/characters/conformance-sage", headers=operator_auth,
                  json={"name": "Sage", "system_prompt": "You are a sage.", "categories": ["wisdom"]}), 200)
found = check(session.get(f"{api}/characters", headers=admin,
                          params={"categories": "wisdom", "tags[]": [], "sortBy": "highlyRated"}), 200).json()
assert [c["slug"] for c in found["data"]] == ["conformance-sage"], found
check(session.post(f"{api}/characters/conformance-sage/reviews", headers=admin,
                   json={"rating": 5, "message": "Wise.", "locale": "en"}), 200)
reviews = check(session.get(f"{api}/characters/conformance-sage/reviews", headers=admin,
                            params={"pageSize": 5}), 200).json()
assert reviews["summary"] == {"averageRating": 5, "totalReviews": 1}, reviews
check(session.get(f"{api}/characters/nobody/reviews", headers=admin), 404)
check(session.delete(f"{root}/admin/v1/characters/conformance-sage", headers=operator_auth), 200)
check(session.get(f"{api}/api_keys/{created['id']}", headers=admin), 200)
check(session.get(f"{api}/api_keys", headers=inference), 401)
patched = check(session.patch(f"{api}/api_keys", headers=admin, json={
    "id": created["id"], "description": "conformance, patched", "modelPrivacy": "PRIVATE_TEXT"}), 200).json()
assert patched["data"]["modelPrivacy"] == "PRIVATE_TEXT", patched
check(session.patch(f"{api}/api_keys", headers=admin, json={"id": created["id"], "modelPrivacy": "ALL"}), 200)
check(session.patch(f"{api}/api_keys", headers=admin, json={"id": "no-such-key"}), 400)

# A wallet makes itself a key: the public token, signed with eth-account.
web3_wallet = Account.create()
token = check(session.get(f"{api}/api_keys/generate_web3_key"), 200).json()["data"]["token"]
signature = web3_wallet.sign_message(encode_defunct(text=token)).signature.hex()
web3 = {"apiKeyType": "INFERENCE", "address": web3_wallet.address, "token": token,
        "signature": "0x" + signature.removeprefix("0x")}
web3_key = check(session.post(f"{api}/api_keys/generate_web3_key", json=web3), 200).json()["data"]
assert web3_key["description"] == "Web3 API Key" and web3_key["apiKey"], web3_key
# The token is spent.
check(session.post(f"{api}/api_keys/generate_web3_key", json=web3), 401)


def rate_headers(response, tokens):
    """The `x-ratelimit-*` headers of `response` as ints (the type as is);
    asserts that the request ones are there, and the token ones iff `tokens`."""
    headers = response.headers
    where = f"{response.request.method} {response.request.url} -> {response.status_code}"
    for name in ["x-ratelimit-limit-requests", "x-ratelimit-remaining-requests", "x-ratelimit-reset-requests",
                 "x-ratelimit-type"]:
        assert name in headers, f"{where}: no {name} in {dict(headers)}"
    token_names = ["x-ratelimit-limit-tokens", "x-ratelimit-remaining-tokens", "x-ratelimit-reset-tokens"]
    for name in token_names:
        assert (name in headers) == tokens, f"{where}: {name} {'missing' if tokens else 'unexpected'}"
    values = {
        name.lower(): value if name.lower() == "x-ratelimit-type" else int(value)
        for name, value in headers.items()
        if name.lower().startswith("x-ratelimit-")
    }
    assert values["x-ratelimit-type"] in ("user", "api_key", "global"), values
    assert 0 <= values["x-ratelimit-remaining-requests"] <= values["x-ratelimit-limit-requests"], values
    # A Unix time in seconds, within the next day (not milliseconds, not past).
    now = time.time()
    assert now - 5 <= values["x-ratelimit-reset-requests"] <= now + 86_400, values
    return values


# Limits of the calling key, for any key type.
for key in (inference, admin):
    reply = check(session.get(f"{api}/api_keys/rate_limits", headers=key), 200)
    limits = reply.json()["data"]
    assert limits["accessPermitted"] is True, limits
    assert limits["keyExpiration"] is None, limits
    by_model = {entry["apiModelId"]: entry["rateLimits"] for entry in limits["rateLimits"]}
    assert model in by_model and limited_model in by_model, by_model
    assert {"RPM", "TPM"} <= {limit["type"] for limit in by_model[model]}, by_model
    assert numbers(reply)["data"]["balances"] == {"USD": 100, "DIEM": 0}, reply.text
    assert rate_headers(reply, tokens=False)["x-ratelimit-type"] == "api_key"
tier = limits["apiTier"]["id"]


def balance(key):
    """GET /billing/balance with `key` (ADMIN): the body, numbers exact."""
    reply = check(session.get(f"{api}/billing/balance", headers=key), 200)
    assert rate_headers(reply, tokens=False)["x-ratelimit-type"] == "api_key"
    return numbers(reply)


assert balance(admin) == {"canConsume": True, "consumptionCurrency": "USD", "balances": {"diem": 0, "usd": 100},
                          "diemEpochAllocation": 0}
refused = check(session.get(f"{api}/billing/balance", headers=inference), 401)
assert refused.json() == {"error": "Admin API key required"}, refused.text
# No credentials at all: 402 with the x402 discovery body, not 401.
discovery(check(session.get(f"{api}/billing/balance"), 402, valid_request=False))

# The rate-limit log under both paths: ADMIN keys only.
for path in ("api_keys/rate_limits/log", "api_keys/rate_limit_logs"):
    log = check(session.get(f"{api}/{path}", headers=admin), 200)
    assert log.json() == {"object": "list", "data": []}, log.text
    rate_headers(log, tokens=False)
    refused = check(session.get(f"{api}/{path}", headers=inference), 401)
    assert refused.json() == {"error": "Admin API key required"}, refused.text

def balance_headers(response):
    """(usd, diem) of the `x-rialto-balance-*` headers, as Decimals."""
    where = f"{response.request.method} {response.request.url} -> {response.status_code}"
    for name in ("x-rialto-balance-usd", "x-rialto-balance-diem"):
        assert name in response.headers, f"{where}: no {name} in {dict(response.headers)}"
    return Decimal(response.headers["x-rialto-balance-usd"]), Decimal(response.headers["x-rialto-balance-diem"])


hello = [{"role": "user", "content": "hello"}]
plain = check(session.post(f"{api}/chat/completions", json={"model": model, "messages": hello}, headers=inference),
              200)
values = rate_headers(plain, tokens=True)
assert values["x-ratelimit-type"] == "api_key", values
assert values["x-ratelimit-remaining-tokens"] <= values["x-ratelimit-limit-tokens"], values
# The balances before the request; the model has prices, so it cost USD.
assert plain.headers["x-rialto-balance-usd"] == "100", dict(plain.headers)
assert plain.headers["x-rialto-balance-diem"] == "0", dict(plain.headers)
plain_cost = numbers(plain)["cost"]
assert plain_cost["usd"] > 0 and plain_cost["diem"] == 0, plain_cost
spent = plain_cost["usd"]
two = check(session.post(f"{api}/chat/completions", json={"model": model, "messages": hello, "n": 2},
                         headers=inference), 200)
assert balance_headers(two) == (100 - spent, 0), (dict(two.headers), spent)
spent += numbers(two)["cost"]["usd"]
streamed = check(
    session.post(f"{api}/chat/completions", json={"model": model, "messages": hello, "stream": True},
                 headers=inference),
    200,
)
assert streamed.text.rstrip().endswith("data: [DONE]"), streamed.text[-200:]
rate_headers(streamed, tokens=True)
assert balance_headers(streamed) == (100 - spent, 0), (dict(streamed.headers), spent)
events = [json.loads(line[len("data: "):], parse_float=Decimal) for line in streamed.text.splitlines()
          if line.startswith("data: {")]
stream_cost = [event["cost"] for event in events if "cost" in event]
assert len(stream_cost) == 1 and stream_cost[0]["usd"] > 0 and stream_cost[0]["diem"] == 0, events[-1]
spent += stream_cost[0]["usd"]
# What the chats cost is what the balance lost.
assert balance(admin)["balances"] == {"diem": 0, "usd": 100 - spent}, spent
# The same three charges in the usage walk and the analytics.
walked = check(session.get(f"{api}/billing/usage-history", params={"pageSize": 10}, headers=admin), 200).json()
assert len(walked["data"]) == 3 and walked["nextCursor"] is None, walked
analytics = check(session.get(f"{api}/billing/usage-analytics", params={"lookback": "2d"}, headers=admin),
                  200).json(parse_float=Decimal)
assert sum(day["USD"] for day in analytics["byDate"]) == spent, (analytics, spent)
assert [k["apiKeyId"] for k in analytics["byKey"]] == [created["id"]], analytics
# The Responses API, from the same chat path and charged the same way.
answered = check(session.post(f"{api}/responses", headers=inference,
                              json={"model": model, "input": "hello", "instructions": "Be brief."}), 200)
answered = numbers(answered)
assert answered["object"] == "response" and answered["output"][0]["type"] == "message", answered
spent += answered["cost"]["usd"]
continued = check(session.post(f"{api}/responses", headers=inference, json={
    "model": model, "input": [{"role": "user", "content": [{"type": "input_text", "text": "again"}]}],
    "previous_response_id": answered["id"]}), 200)
spent += numbers(continued)["cost"]["usd"]
check(session.post(f"{api}/responses", headers=inference,
                   json={"model": model, "input": "x", "previous_response_id": "resp_nobody"}), 400)
assert balance(admin)["balances"] == {"diem": 0, "usd": 100 - spent}, spent

# Web search in a chat, and the augment routes, against a mock SearXNG that
# also serves the page to scrape; each is billed its configured price.
search_model = os.environ["RIALTO_E2E_SEARCH_MODEL"]
searched = check(session.post(f"{api}/chat/completions", headers=inference, json={
    "model": search_model, "messages": hello,
    "rialto_parameters": {"enable_web_search": "on", "enable_web_citations": True}}), 200)
assert len(searched.json()["rialto_parameters"]["web_search_citations"]) == 3, searched.text
spent += numbers(searched)["cost"]["usd"]
found = check(session.post(f"{api}/augment/search", json={"query": "conformance", "limit": 2}, headers=inference),
              200).json()
assert [r["title"] for r in found["results"]] == ["Result 1 about conformance", "Result 2 about conformance"], found
spent += Decimal("0.01")
page = check(session.post(f"{api}/augment/scrape", json={"url": os.environ["RIALTO_E2E_PAGE_URL"]},
                          headers=inference), 200).json()
assert "the answer is 42" in page["content"] and page["format"] == "markdown", page
spent += Decimal("0.002")
check(session.post(f"{api}/augment/scrape", json={"url": "not a url"}, headers=inference), 400, valid_request=False)
parsed = check(session.post(f"{api}/augment/text-parser", files={"file": ("notes.txt", b"some text here")},
                            headers=inference), 200).json()
assert parsed == {"text": "some text here", "tokens": 4}, parsed
as_text = check(session.post(f"{api}/augment/text-parser", files={"file": ("notes.txt", b"some text here")},
                             data={"response_format": "text"}, headers=inference), 200)
assert as_text.text == "some text here", as_text.text
check(session.post(f"{api}/augment/text-parser", files={"file": ("tool.exe", b"MZ")}, headers=inference), 400)
assert balance(admin)["balances"] == {"diem": 0, "usd": 100 - spent}, spent

# Images and audio against the mock upstream's real PNG and WAV, each billed
# its unit price: $0.01 an image, $0.01 a thousand characters, $0.001 a
# started second.
generated = check(session.post(f"{api}/image/generate", headers=inference, json={
    "model": "conformance-image", "prompt": "a dot", "width": 8, "height": 8, "format": "png"}), 200).json()
assert base64.b64decode(generated["images"][0])[:8] == b"\x89PNG\r\n\x1a\n", generated["images"][0][:20]
binary = check(session.post(f"{api}/image/generate", headers=inference, json={
    "model": "conformance-image", "prompt": "a dot", "width": 8, "height": 8, "return_binary": True,
    "format": "png"}), 200)
assert binary.headers["content-type"] == "image/png" and binary.content[:4] == b"\x89PNG", binary.headers
openai_image = check(session.post(f"{api}/images/generations", headers=inference,
                                  json={"prompt": "a dot", "size": "256x256"}), 200).json()
assert openai_image["data"][0]["b64_json"], openai_image
edited = check(session.post(f"{api}/image/edit", headers=inference,
                            files={"image": ("dot.png", base64.b64decode(generated["images"][0]), "image/png")},
                            data={"model": "conformance-edit", "prompt": "invert it"}), 200)
assert edited.headers["content-type"] == "image/png" and edited.content[:4] == b"\x89PNG", edited.headers
multi = check(session.post(f"{api}/image/multi-edit", headers=inference, json={
    "model": "conformance-edit", "prompt": "combine", "images": [generated["images"][0]] * 2}), 200)
assert multi.content[:4] == b"\x89PNG", multi.headers
spent += Decimal("0.05")
# A 256x256 PNG to upscale (the smallest accepted) and to cut out.
square = check(session.post(f"{api}/image/generate", headers=inference, json={
    "model": "conformance-image", "prompt": "a square", "width": 256, "height": 256, "format": "png",
    "return_binary": True}), 200).content
upscaled = check(session.post(f"{api}/image/upscale", headers=inference, json={
    "image": base64.b64encode(square).decode(), "scale": 2}), 200)
assert upscaled.headers["content-type"] == "image/png" and upscaled.content[:4] == b"\x89PNG", upscaled.headers
assert struct.unpack(">II", upscaled.content[16:24]) == (512, 512)
cut = check(session.post(f"{api}/image/background-remove", headers=inference, json={
    "image": base64.b64encode(square).decode()}), 200)
# IHDR's colour type 6: RGBA.
assert cut.content[:4] == b"\x89PNG" and cut.content[25] == 6, cut.content[:32]
check(session.post(f"{api}/image/upscale", headers=inference, json={"scale": 2}), 400, valid_request=False)
spent += Decimal("0.01") + Decimal("0.02") + Decimal("0.01")
assert "Anime" in check(session.get(f"{api}/image/styles"), 200).json()["data"]
check(session.post(f"{api}/image/generate", headers=inference,
                   json={"model": "conformance-image", "prompt": "x", "width": 5000}), 400, valid_request=False)
words = "one two three four"
speech = check(session.post(f"{api}/audio/speech", headers=inference, json={
    "model": "conformance-tts", "input": words, "response_format": "wav"}), 200)
assert speech.content[:4] == b"RIFF" and speech.headers["content-type"] == "audio/wav", speech.headers
spent += Decimal(len(words)) * Decimal("0.01") / 1000
heard = check(session.post(f"{api}/audio/transcriptions", headers=inference,
                           files={"file": ("speech.wav", speech.content, "audio/wav")},
                           data={"model": "conformance-asr", "timestamps": "true"}), 200).json()
assert heard["text"] == words and heard["duration"] == 1 and heard["timestamps"]["segment"], heard
spent += Decimal("0.001")
voices = check(session.get(f"{api}/audio/voices", headers=inference), 200).json()
assert [v["id"] for v in voices["data"]] == ["af_sky"], voices


def job_done(path, model, queue_id):
    """Polls a job's retrieve until it answers its media."""
    for _ in range(600):
        retrieved = check(session.post(f"{api}/{path}/retrieve", headers=inference,
                                       json={"model": model, "queue_id": queue_id}), 200)
        if not retrieved.headers["content-type"].startswith("application/json"):
            return retrieved
        time.sleep(0.05)
    raise AssertionError(f"{path} job {queue_id} never finished")


assert check(session.post(f"{api}/video/quote", json={"model": "conformance-video", "duration": "1s"}),
             200).json() == {"quote": 0.01}
video = check(session.post(f"{api}/video/queue", headers=inference, json={
    "model": "conformance-video", "prompt": "a dot", "duration": "1s"}), 200).json()
made = job_done("video", "conformance-video", video["queue_id"])
assert made.headers["content-type"] == "video/mp4" and made.content[4:8] == b"ftyp", made.headers
assert check(session.post(f"{api}/video/complete", headers=inference, json={
    "model": "conformance-video", "queue_id": video["queue_id"]}), 200).json() == {"success": True}
check(session.post(f"{api}/video/retrieve", headers=inference, json={
    "model": "conformance-video", "queue_id": video["queue_id"]}), 404)
check(session.post(f"{api}/video/transcriptions", headers=inference, json={"url": "https://example.com"}), 410,
      valid_request=False)
spent += Decimal("0.01")
assert check(session.post(f"{api}/audio/quote", json={"model": "conformance-tts", "character_count": 1000}),
             200).json() == {"quote": 0.01}
queued = check(session.post(f"{api}/audio/queue", headers=inference, json={
    "model": "conformance-tts", "prompt": words}), 200).json()
assert queued["status"] == "QUEUED", queued
spoken = job_done("audio", "conformance-tts", queued["queue_id"])
assert spoken.content[:4] == b"RIFF", spoken.headers
check(session.post(f"{api}/audio/complete", headers=inference, json={
    "model": "conformance-tts", "queue_id": queued["queue_id"]}), 200)
spent += Decimal(len(words)) * Decimal("0.01") / 1000
time.sleep(0.5)  # the jobs' charges land as their workers report
assert balance(admin)["balances"] == {"diem": 0, "usd": 100 - spent}, spent
check(session.post(f"{api}/chat/completions", json={"model": model, "messages": []}, headers=inference), 400,
      valid_request=False)
check(session.post(f"{api}/chat/completions", json={"model": "nope", "messages": hello}, headers=inference), 404)
discovery(check(session.post(f"{api}/chat/completions", json={"model": model, "messages": hello}), 402,
                valid_request=False))
# x402 payment headers belong to the top-up only.
refused = check(session.post(f"{api}/chat/completions", json={"model": model, "messages": hello},
                             headers={**inference, "PAYMENT-SIGNATURE": "e30="}), 400)
assert refused.json()["error"] == "PAYMENT_HEADER_NOT_ACCEPTED", refused.text
# This sandbox has no [x402]: top-ups are off, with or without a payment.
for extra in ({}, {"PAYMENT-SIGNATURE": "e30="}):
    off = check(session.post(f"{api}/x402/top-up", headers=extra), 503)
    assert off.json()["error"] == "X402_NOT_CONFIGURED", off.text


# A wallet signed in with Sign-In-With-X (eth-account, one nonce per
# request): billed on its own empty ledger, it can use an unpriced model
# only; its balance and movements are its own.
wallet = Account.create()


def sign_in(nonce=None):
    """A fresh SIGN-IN-WITH-X header (the hosted API's signed-text shape)."""
    issued = datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.000Z")
    message = (
        f"localhost:8080 wants you to sign in with your Ethereum account:\n{wallet.address}\n\n"
        f"Sign in to Rialto\n\nURI: http://localhost:8080\nVersion: 1\nChain ID: 8453\n"
        f"Nonce: {nonce or secrets.token_hex(8)}\nIssued At: {issued}"
    )
    signature = Account.sign_message(encode_defunct(text=message), private_key=wallet.key).signature
    payload = {"address": wallet.address, "message": message,
               "signature": "0x" + signature.hex().removeprefix("0x"), "chainId": 8453}
    return {"SIGN-IN-WITH-X": base64.b64encode(json.dumps(payload).encode()).decode()}


wallet_broke = check(session.post(f"{api}/chat/completions", json={"model": model, "messages": hello},
                                  headers=sign_in()), 402)
assert wallet_broke.json()["reason"] == "insufficient_balance", wallet_broke.text
assert numbers(wallet_broke)["currentBalanceUsd"] == 0, wallet_broke.text
assert decoded(wallet_broke.headers["PAYMENT-REQUIRED"])["x402Version"] == 2, dict(wallet_broke.headers)
# The sign-in wins over a key, and a nonce serves once.
once = sign_in()
free = check(session.post(f"{api}/chat/completions", json={"model": "old-chat", "messages": hello},
                          headers={**inference, **once}), 200)
assert free.headers["X-Balance-Remaining"] == "0", dict(free.headers)
assert free.json()["cost"] == {"usd": 0, "diem": 0}, free.text
wallet_stream = check(session.post(f"{api}/chat/completions",
                                   json={"model": "old-chat", "messages": hello, "stream": True},
                                   headers=sign_in()), 200)
assert wallet_stream.headers["X-Balance-Remaining"] == "0", dict(wallet_stream.headers)
assert "X-Balance-Remaining" not in plain.headers, dict(plain.headers)
replayed = check(session.post(f"{api}/chat/completions", json={"model": "old-chat", "messages": hello},
                              headers=once), 401)
assert replayed.json()["code"] == "X402_SIGN_IN_NONCE_REUSED", replayed.text
own = check(session.get(f"{api}/x402/balance/{wallet.address}", headers=sign_in()), 200).json()["data"]
assert own["walletAddress"] == wallet.address and own["balanceUsd"] == 0 and own["canConsume"] is False, own
moves = check(session.get(f"{api}/x402/transactions/{wallet.address}", headers=sign_in()), 200).json()["data"]
assert moves["transactions"] == [] and moves["pagination"] == {"limit": 50, "offset": 0, "hasMore": False}, moves
other = check(session.get(f"{api}/x402/balance/0x2222222222222222222222222222222222222222", headers=sign_in()),
              403)
assert other.json()["code"] == "X402_WALLET_MISMATCH", other.text
discovery(check(session.get(f"{api}/x402/balance/{wallet.address}", headers=inference), 402,
                valid_request=False))


# An account without credit is refused (402) before the model is called; a
# DIEM credit then pays, DIEM first.
unfunded = check(
    session.post(f"{root}/admin/v1/accounts", json={"name": "conformance-unfunded"}, headers=operator_auth),
    201,
).json()
unfunded_admin = {"Authorization": f"Bearer {unfunded['api_key']['key']}"}
unfunded_key = check(
    session.post(f"{api}/api_keys", json={"apiKeyType": "INFERENCE", "description": "unfunded"},
                 headers=unfunded_admin),
    200,
).json()["data"]
unfunded_inference = {"Authorization": f"Bearer {unfunded_key['apiKey']}"}
assert balance(unfunded_admin) == {"canConsume": False, "consumptionCurrency": None,
                                   "balances": {"diem": 0, "usd": 0}, "diemEpochAllocation": 0}
broke = check(session.post(f"{api}/chat/completions", json={"model": model, "messages": hello},
                           headers=unfunded_inference), 402)
assert broke.json() == {"error": "Insufficient USD or Diem balance to complete request. "
                                 "Add credits to your account and try again."}, broke.text
assert broke.headers["x-rialto-balance-usd"] == "0", dict(broke.headers)
assert broke.headers["x-rialto-balance-diem"] == "0", dict(broke.headers)
rate_headers(broke, tokens=True)
diem_credit = check(
    session.post(f"{root}/admin/v1/accounts/{unfunded['id']}/credits",
                 json={"diem": "1", "reference": "conformance-diem"}, headers=operator_auth),
    200,
).json()
assert diem_credit == {"applied": True, "balance": {"usd": "0", "diem": "1"}}, diem_credit
assert balance(unfunded_admin)["consumptionCurrency"] == "DIEM"
paid = check(session.post(f"{api}/chat/completions", json={"model": model, "messages": hello},
                          headers=unfunded_inference), 200)
assert balance_headers(paid) == (0, 1), dict(paid.headers)
paid_cost = numbers(paid)["cost"]
assert paid_cost["diem"] > 0 and paid_cost["usd"] == 0, paid_cost
assert balance(unfunded_admin)["balances"] == {"diem": 1 - paid_cost["diem"], "usd": 0}

# A key capped at one billionth of a DIEM a month: one cheap request is refused
# by the cap (402 naming it), though the account could pay; its record shows
# the cap, the period and what it spent in it.
capped = check(
    session.post(f"{api}/api_keys", json={"apiKeyType": "INFERENCE", "description": "capped",
                                          "consumptionLimit": {"usd": 0, "diem": 0.000000001, "vcu": None},
                                          "limitPeriod": "MONTH"}, headers=unfunded_admin),
    200,
).json()["data"]
assert capped["consumptionLimit"] == {"usd": 0, "diem": 1e-9, "vcu": None}, capped
assert capped["limitPeriod"] == "MONTH", capped
refused = check(session.post(f"{api}/chat/completions", json={"model": model, "messages": hello},
                             headers={"Authorization": f"Bearer {capped['apiKey']}"}), 402)
assert "consumption limit for the current MONTH period" in refused.json()["error"], refused.text
record = check(session.get(f"{api}/api_keys/{capped['id']}", headers=unfunded_admin), 200).json()["data"]
assert record["currentPeriodUsage"] == {"usd": "0", "diem": "0"}, record
check(session.post(f"{api}/api_keys", json={"apiKeyType": "INFERENCE", "description": "bad",
                                            "limitPeriod": "WEEK"}, headers=unfunded_admin), 400,
      valid_request=False)

# A real refusal: the limited model's global window admits one request a minute.
first = check(session.post(f"{api}/chat/completions", json={"model": limited_model, "messages": hello},
                           headers=inference), 200)
# The limited model has no prices: it costs nothing, and the balance shows.
assert first.json()["cost"] == {"usd": 0, "diem": 0}, first.text
assert balance_headers(first) == (100 - spent, 0), dict(first.headers)
values = rate_headers(first, tokens=False)
assert (values["x-ratelimit-type"], values["x-ratelimit-limit-requests"], values["x-ratelimit-remaining-requests"]) \
    == ("global", 1, 0), values
limited = check(session.post(f"{api}/chat/completions", json={"model": limited_model, "messages": hello},
                             headers=inference), 429)
values = rate_headers(limited, tokens=False)
assert (values["x-ratelimit-type"], values["x-ratelimit-limit-requests"], values["x-ratelimit-remaining-requests"]) \
    == ("global", 1, 0), values
retry_after = int(limited.headers["Retry-After"])
assert 1 <= retry_after <= 61, retry_after
assert limited.json()["error"].startswith("Rate limit exceeded: "), limited.text
assert limited_model in limited.json()["error"], limited.text


def log_entry(matches):
    """Polls the log (ADMIN key, both paths) until an entry `matches`: hits
    are written off the request path."""
    deadline = time.monotonic() + 10
    while True:
        entries = check(session.get(f"{api}/api_keys/rate_limits/log", headers=admin), 200).json()["data"]
        found = [entry for entry in entries if matches(entry)]
        if found:
            alias = check(session.get(f"{api}/api_keys/rate_limit_logs", headers=admin), 200).json()["data"]
            assert alias == entries, (alias, entries)
            timestamps = [entry["timestamp"] for entry in entries]
            assert timestamps == sorted(timestamps, reverse=True), timestamps
            return found[0]
        assert time.monotonic() < deadline, f"no matching entry in the rate-limit log: {entries}"
        time.sleep(0.1)


def recent(timestamp):
    at = datetime.fromisoformat(timestamp.replace("Z", "+00:00"))
    return abs(datetime.now(timezone.utc) - at) < timedelta(minutes=1)


entry = log_entry(lambda e: e["modelId"] == limited_model)
assert entry["rateLimitType"] == "RPM", entry
assert entry["apiKeyId"] == created["id"], entry
assert entry["rateLimitTier"] == tier, entry
assert entry["timestamp"].endswith("Z") and recent(entry["timestamp"]), entry

# The failed-requests guard: a key that fails 21 times within 30 s is refused
# everywhere, before anything else, and the block is logged.
failing = check(
    session.post(f"{api}/api_keys", json={"apiKeyType": "INFERENCE", "description": "failing"}, headers=admin),
    200,
).json()["data"]
failing_key = {"Authorization": f"Bearer {failing['apiKey']}"}
for _ in range(21):
    check(session.get(f"{api}/api_keys", headers=failing_key), 401)
blocked_message = ("Too many failed attempts (> 20) resulting in a non-success status code. "
                   "Please wait 30s and try again.")
for blocked in (
    check(session.get(f"{api}/api_keys/rate_limits", headers=failing_key), 429),
    check(session.get(f"{api}/models", headers=failing_key), 429),
    check(session.post(f"{api}/chat/completions", json={"model": model, "messages": hello}, headers=failing_key),
          429),
):
    assert blocked.json() == {"error": blocked_message}, blocked.text
    assert 1 <= int(blocked.headers["Retry-After"]) <= 30, dict(blocked.headers)
    values = rate_headers(blocked, tokens=False)
    assert (values["x-ratelimit-limit-requests"], values["x-ratelimit-remaining-requests"]) == (20, 0), values
entry = log_entry(lambda e: e["rateLimitType"] == "FAILED_REQUESTS")
assert entry["apiKeyId"] == failing["id"], entry
assert entry["modelId"] == "endpoint:api/v1/api_keys", entry
assert entry["rateLimitTier"] == tier and recent(entry["timestamp"]), entry

check(session.get(f"{api}/models"), 200)
check(session.get(f"{api}/models", params={"type": "all"}), 200)
check(session.get(f"{api}/models", params={"type": "bogus"}), 400, valid_request=False)

check(session.delete(f"{api}/api_keys", params={"id": created["id"]}, headers=admin), 200)
check(session.delete(f"{api}/api_keys", params={"id": created["id"]}, headers=admin), 400)
check(session.get(f"{root}/healthz"), 200)
check(session.get(f"{root}/readyz"), 200)

print(f"conformance ok: {checked} exchanges match the document")


# The operator moves the account to the partner tier; an unknown account is 404.
operator_auth = {"Authorization": f"Bearer {operator}"}
tiered = check(session.put(f"{root}/admin/v1/accounts/{account['id']}/tier", json={"tier": "partner"},
                           headers=operator_auth), 200).json()
assert tiered["tier"] == "partner", tiered
check(session.put(f"{root}/admin/v1/accounts/{account['id']}/tier", json={"tier": "gold"},
                  headers=operator_auth), 400)
check(session.put(f"{root}/admin/v1/accounts/no-such-account/tier", json={"tier": "partner"},
                  headers=operator_auth), 404)
missing = check(session.post(f"{root}/admin/v1/accounts/no-such-account/credits",
                             json={"usd": "1", "reference": "nowhere"}, headers=operator_auth), 404)
assert missing.json() == {"error": "Account not found"}, missing.text
print(f"tier and unknown-account checks ok ({checked} exchanges in all)")
