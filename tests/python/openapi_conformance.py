"""Checks that Rialto's answers match the OpenAPI document it publishes.

Run by tests/e2e/python.rs against a sandbox (base URL, operator token, a
model id, and the id of a model whose global window admits one request per
minute, in the environment). Every exchange below is validated, request and
response, with openapi-core against GET /openapi.yaml; exits non-zero on the
first mismatch.
"""

import os
import sys
import time
from datetime import datetime, timedelta, timezone

import requests
import yaml
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

account = check(
    session.post(f"{root}/admin/v1/accounts", json={"name": "conformance"},
                 headers={"Authorization": f"Bearer {operator}"}),
    201,
).json()
admin = {"Authorization": f"Bearer {account['api_key']['key']}"}

created = check(
    session.post(f"{api}/api_keys", json={"apiKeyType": "INFERENCE", "description": "conformance"}, headers=admin),
    200,
).json()["data"]
inference = {"Authorization": f"Bearer {created['apiKey']}"}
check(session.get(f"{api}/api_keys", headers=admin), 200)
check(session.get(f"{api}/api_keys/{created['id']}", headers=admin), 200)
check(session.get(f"{api}/api_keys", headers=inference), 401)


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
    assert rate_headers(reply, tokens=False)["x-ratelimit-type"] == "api_key"
tier = limits["apiTier"]["id"]

# The rate-limit log under both paths: ADMIN keys only.
for path in ("api_keys/rate_limits/log", "api_keys/rate_limit_logs"):
    log = check(session.get(f"{api}/{path}", headers=admin), 200)
    assert log.json() == {"object": "list", "data": []}, log.text
    rate_headers(log, tokens=False)
    refused = check(session.get(f"{api}/{path}", headers=inference), 401)
    assert refused.json() == {"error": "Admin API key required"}, refused.text

hello = [{"role": "user", "content": "hello"}]
plain = check(session.post(f"{api}/chat/completions", json={"model": model, "messages": hello}, headers=inference),
              200)
values = rate_headers(plain, tokens=True)
assert values["x-ratelimit-type"] == "api_key", values
assert values["x-ratelimit-remaining-tokens"] <= values["x-ratelimit-limit-tokens"], values
check(session.post(f"{api}/chat/completions", json={"model": model, "messages": hello, "n": 2}, headers=inference), 200)
streamed = check(
    session.post(f"{api}/chat/completions", json={"model": model, "messages": hello, "stream": True},
                 headers=inference),
    200,
)
assert streamed.text.rstrip().endswith("data: [DONE]"), streamed.text[-200:]
rate_headers(streamed, tokens=True)
check(session.post(f"{api}/chat/completions", json={"model": model, "messages": []}, headers=inference), 400,
      valid_request=False)
check(session.post(f"{api}/chat/completions", json={"model": "nope", "messages": hello}, headers=inference), 404)
check(session.post(f"{api}/chat/completions", json={"model": model, "messages": hello}), 401,
      valid_request=False)


# A real refusal: the limited model's global window admits one request a minute.
first = check(session.post(f"{api}/chat/completions", json={"model": limited_model, "messages": hello},
                           headers=inference), 200)
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
